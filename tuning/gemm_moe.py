"""Tuning spec of gemm_moe: a prompt's routed-expert products, its rows grouped by expert on the device.

Shape: as gemv_moe's (``op``, ``n``, ``k``, ``experts``, ``used``, ``bits``, ``group``, ``sym``, ``f32``, ``act``,
``bias``, ``mxfp4``),
``m`` the prompt's rows, optionally ``accumulate`` (down adds to y).
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops.gemm_moe import PARAMS, GemmMoE, GroupedExperts
from perfx.ops.gemv_moe import ExpertWeights
from perfx.tuning.gemv_moe import fuzz_shapes as gemv_fuzz_shapes
from perfx.tuning.gemv_moe import expert_bytes, gate_up_expected, random_bias, random_experts
from perfx.tuning.spec import Case, Spec, cached_per_params


def make_case(device, shape, rng) -> Case:
    n, k, e, used, m = shape["n"], shape["k"], shape["experts"], shape["used"], shape["m"]
    # rows choose few experts (the first third more often), so some experts get many rows, some one, some none
    weights_of = np.linspace(3.0, 1.0, e)
    ids = np.stack([rng.choice(e, used, replace=False, p=weights_of / weights_of.sum()) for _ in range(m)])
    ids = ids.astype(np.int32)
    gate_up = shape["op"] == "gate_up"
    experts = random_experts(shape, rng, 2 * n if gate_up else n)
    bias = random_bias(shape, rng, 2 * n if gate_up else n)
    weight = ExpertWeights(device, experts, "gemm_moe case", bias=bias)
    scratch = GroupedExperts(device, e, m, used, n)
    wrapper = cached_per_params(lambda params: GemmMoE(device, params, shape))
    ids_d = device.upload(ids)
    start = None
    if gate_up:
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = gate_up_expected(x, experts, ids, bias, shape.get("act", "silu"))
        x_d, y = device.upload(x), device.empty((m, used, n), np.float32)

        def launch(params):
            return list(wrapper(params).gate_up(weight, x_d, ids_d, y, m, used, scratch))
    else:
        h = rng.standard_normal((m, used, k)).astype(np.float32)
        w = rng.uniform(0.1, 1.0, (m, used)).astype(np.float32)
        start = rng.standard_normal((m, n)).astype(np.float32) if shape.get("accumulate") else None
        want = reference.moe_experts_down(h, ids, w, experts, bias) + (0.0 if start is None else start)
        h_d, w_d, y = device.upload(h), device.upload(w), device.empty((m, n), np.float32)

        def launch(params):
            made = wrapper(params)
            return [made.group(ids_d, m, used, scratch),
                    *made.down(weight, h_d, w_d, y, m, used, scratch, start is not None)]

    def run(params):
        if start is None:
            y.fill(np.float32(np.nan))
        else:
            y.set(start)
        scratch.out.fill(np.float32(np.nan))
        for event in launch(params):
            event.wait()
        return {"y": y.get()}

    return Case(expected={"y": want}, run=run, launch=launch)


def _bytes_moved(s) -> int:
    """Each chosen expert's weights once (at most m rows choose it), the activations, the per-pair outputs."""
    per_expert = expert_bytes(s)
    touched = min(s["experts"], s["m"] * s["used"])
    return touched * per_expert + 4 * s["m"] * s["used"] * (s["k"] + 2 * s["n"])


def fuzz_shapes(st):
    """gemv_moe's shapes over prompts of 1 to 40 rows."""
    @st.composite
    def shape(draw):
        return {**draw(gemv_fuzz_shapes(st)), "m": draw(st.integers(1, 40))}
    return shape()


def programs(device, shape, params) -> None:
    """The kernels a run at ``params`` builds: the wrapper's, all made when it is."""
    GemmMoE(device, params, shape)


SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    reference=reference.moe_experts,
    fuzz_shapes=fuzz_shapes,
    oclgrind_shapes=(
        {"op": "gate_up", "n": 5, "k": 64, "experts": 4, "used": 2, "bits": 4, "group": 32, "sym": True,
         "f32": False, "act": "silu", "m": 5},
        {"op": "down", "n": 7, "k": 32, "experts": 3, "used": 2, "bits": 8, "group": 16, "sym": False, "f32": True,
         "m": 3},
    ),
    tolerance=1e-5,
    tolerance_why=(
        "as gemv_moe's: each output sums K ≤ 768 fp32 products, group by group, and down a sum of the used experts "
        "in a fixed order: ≲ 1e-6 of max|y|; 1e-5 still fails a row given another row's x, an expert's tile that "
        "stops short or a pair left out (errors of O(1))"),
    test_shapes=(
        # more rows than TM and experts with none, one and many rows; columns off every TN
        {"op": "gate_up", "n": 37, "k": 96, "experts": 9, "used": 3, "bits": 4, "group": 32, "sym": True,
         "f32": False, "act": "silu", "m": 21},
        {"op": "down", "n": 45, "k": 64, "experts": 9, "used": 3, "bits": 4, "group": 32, "sym": True, "f32": False,
         "m": 21},
        {"op": "gate_up", "n": 23, "k": 128, "experts": 5, "used": 2, "bits": 8, "group": 16, "sym": False,
         "f32": True, "act": "gelu_tanh", "m": 9},
        {"op": "down", "n": 70, "k": 128, "experts": 6, "used": 4, "bits": 4, "group": 64, "sym": False,
         "f32": False, "m": 2, "accumulate": True},
        {"op": "gate_up", "n": 19, "k": 64, "experts": 12, "used": 1, "bits": 8, "group": 32, "sym": True,
         "f32": False, "act": "silu", "m": 1},
        # gpt-oss: MXFP4 experts (e2m1 nibbles, E8M0 bytes), row biases, the clamped SwiGLU
        {"op": "gate_up", "n": 29, "k": 96, "experts": 6, "used": 4, "bits": 4, "group": 32, "sym": True,
         "f32": False, "mxfp4": True, "act": "swiglu_oai", "bias": True, "m": 13},
        {"op": "down", "n": 41, "k": 64, "experts": 6, "used": 4, "bits": 4, "group": 32, "sym": True, "f32": False,
         "mxfp4": True, "bias": True, "m": 13},
    ),
    bytes_moved=_bytes_moved,
    flops=lambda s: 2 * s["m"] * s["used"] * s["k"] * s["n"] * (2 if s["op"] == "gate_up" else 1),
    describe=lambda s: (f"{s['op']} N={s['n']} K={s['k']} {s['used']}/{s['experts']} int{s['bits']} g{s['group']}"
                        + (" sym" if s.get("sym") else "") + (" f32" if s.get("f32") else "")
                        + (" mxfp4" if s.get("mxfp4") else "")
                        + (f" {s['act']}" if s.get("act", "silu") != "silu" else "") + (" bias" if s.get("bias") else "")
                        + f" m={s['m']}"
                        + (" +=" if s.get("accumulate") else "")),
    programs=programs,
)
