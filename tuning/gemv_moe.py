"""Tuning spec of gemv_moe: the routed-expert GEMVs, each row through its chosen experts only.

Shape: ``op`` ("gate_up": h = act(gate)·up of each chosen expert; "down": y = the weighted sum of the chosen
experts' down products), ``n`` the output width (the experts' I for gate_up, the hidden size for down), ``k``,
``experts`` E, ``used`` chosen a row, the weights' form (``bits`` 4 or 8, ``group``, ``sym``, ``f32``: float32
scales; ``mxfp4``: gpt-oss's MXFP4 in the file's bits, with bits 4, group 32, sym), ``act`` (gate_up's "silu",
"gelu_tanh" or "swiglu_oai", gpt-oss's clamped SwiGLU), ``m`` rows, optionally
``bias`` (each expert's rows have a bias: gpt-oss) and ``accumulate`` (down adds to y).
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.formats import MXFP4_VALUES, Q4_PAIRS, Q4_SYMMETRIC, Q4_ZEROS, Q4Matrix, Q8Matrix, mxfp4_scales
from perfx.ops.gemv_moe import PARAMS, ExpertWeights, GemvMoE
from perfx.tuning.spec import Case, Spec, cached_per_params


def random_experts(shape, rng, rows: int) -> list:
    """E random expert matrices (rows, k) in the shape's form (int4 with f32: zero points, whose offsets −s·z are
    float32; MXFP4: every e2m1 code, fifteen exponents 2^-10 to 2^4 about the other forms' weights, so an exponent
    read one off doubles or halves a group)."""
    k, group, sym, f32 = shape["k"], shape["group"], bool(shape.get("sym")), bool(shape.get("f32"))
    if shape.get("mxfp4"):
        out = []
        for _ in range(shape["experts"]):
            codes = MXFP4_VALUES[rng.integers(0, 16, size=(rows, k))]
            s = mxfp4_scales(rng.integers(118, 133, size=(rows, k // 32)))
            out.append(Q8Matrix(codes, s, np.zeros_like(s), 32, f32=True, symmetric=True, mxfp4=True))
        return out
    if shape["bits"] == 4:
        form = Q4_SYMMETRIC if sym else Q4_ZEROS if f32 else Q4_PAIRS
        return [Q4Matrix.random(rows, k, group, rng, form=form) for _ in range(shape["experts"])]
    return [Q8Matrix.random(rows, k, group, rng, f32=f32, symmetric=sym) for _ in range(shape["experts"])]


def random_bias(shape, rng, rows: int) -> np.ndarray | None:
    """Each expert's row biases (E, rows) where the shape has them, else None: about the size of the products, so a
    bias added twice, to the wrong row or not at all shows."""
    return rng.standard_normal((shape["experts"], rows)).astype(np.float32) if shape.get("bias") else None


def gate_up_expected(x, experts, ids, bias, act: str) -> np.ndarray:
    """h (m, used, I): glu(gate + bg, up + bu) of each row's chosen experts (``reference.GLU_ACTIVATIONS``)."""
    glu = reference.GLU_ACTIVATIONS[act]
    out = []
    for r in range(len(ids)):
        rows = []
        for e in ids[r]:
            gu = reference.linear(x[r:r + 1], experts[e], None if bias is None else bias[e])[0]
            rows.append(glu(*np.split(gu, 2)))
        out.append(np.stack(rows))
    return np.stack(out)


def make_case(device, shape, rng) -> Case:
    n, k, e, used, m = shape["n"], shape["k"], shape["experts"], shape["used"], shape["m"]
    ids = np.stack([rng.choice(e, used, replace=False) for _ in range(m)]).astype(np.int32)
    gate_up = shape["op"] == "gate_up"
    experts = random_experts(shape, rng, 2 * n if gate_up else n)
    bias = random_bias(shape, rng, 2 * n if gate_up else n)
    weight = ExpertWeights(device, experts, "gemv_moe case", bias=bias)
    wrapper = cached_per_params(lambda params: GemvMoE(device, params, shape))
    ids_d = device.upload(ids)
    if gate_up:
        x = rng.standard_normal((m, k)).astype(np.float32)
        want = gate_up_expected(x, experts, ids, bias, shape.get("act", "silu"))
        x_d, y = device.upload(x), device.empty((m, used, n), np.float32)

        def launch(params):
            return [wrapper(params).gate_up(weight, x_d, ids_d, y, m, used)]
        start = None
    else:
        h = rng.standard_normal((m, used, k)).astype(np.float32)
        w = rng.uniform(0.1, 1.0, (m, used)).astype(np.float32)
        start = rng.standard_normal((m, n)).astype(np.float32) if shape.get("accumulate") else None
        want = np.zeros((m, n)) if start is None else start.astype(np.float64)
        want += reference.moe_experts_down(h, ids, w, experts, bias)
        h_d, w_d, y = device.upload(h), device.upload(w), device.empty((m, n), np.float32)

        def launch(params):
            return [wrapper(params).down(weight, h_d, ids_d, w_d, y, m, used, start is not None)]

    def run(params):
        if start is None:
            y.fill(np.float32(np.nan))
        else:
            y.set(start)
        for event in launch(params):
            event.wait()
        return {"y": y.get()}

    return Case(expected={"y": want}, run=run, launch=launch)


def expert_bytes(s) -> int:
    """Bytes of one expert's matrix of the shape's role in its form (``ExpertWeights.expert_bytes`` less biases)."""
    rows = 2 * s["n"] if s["op"] == "gate_up" else s["n"]
    groups = s["k"] // s["group"]
    if s.get("mxfp4"):
        return rows * (s["k"] // 2 + groups)
    return rows * (s["k"] * s["bits"] // 8 + (4 if s.get("f32") else 2) * groups * (1 if s.get("sym") else 2))


def _bytes_moved(s) -> int:
    per_expert = expert_bytes(s)
    return s["m"] * (s["used"] * per_expert + 4 * s["used"] * (s["k"] + s["n"]))


def fuzz_shapes(st):
    """Rows off every tile, a few groups along K, both forms and ops, any number of experts chosen."""
    @st.composite
    def shape(draw):
        e = draw(st.integers(1, 12))
        bits = draw(st.sampled_from([4, 8]))
        group = draw(st.sampled_from([16, 32] if bits == 8 else [32, 64, 128]))
        op = draw(st.sampled_from(["gate_up", "down"]))
        sym = draw(st.booleans())
        mxfp4 = bits == 4 and group == 32 and sym and draw(st.booleans())
        return {**({"mxfp4": True} if mxfp4 else {}),
                "op": op, "n": draw(st.integers(1, 80)), "k": group * draw(st.integers(1, 6)), "experts": e,
                "used": draw(st.integers(1, e)), "bits": bits, "group": group, "sym": sym,
                # an int4 form with float32 values is the zero points' (offsets −s·z), never a symmetric one
                "f32": draw(st.booleans()) and not (bits == 4 and sym),
                "act": draw(st.sampled_from(["silu", "gelu_tanh", "swiglu_oai"])), "m": draw(st.integers(1, 4)),
                "bias": draw(st.booleans()), "accumulate": op == "down" and draw(st.booleans())}
    return shape()


def programs(device, shape, params) -> None:
    """The kernels a run at ``params`` builds: the wrapper's, all made when it is."""
    GemvMoE(device, params, shape)


SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    reference=reference.moe_experts,
    fuzz_shapes=fuzz_shapes,
    oclgrind_shapes=(
        {"op": "gate_up", "n": 5, "k": 96, "experts": 4, "used": 2, "bits": 4, "group": 32, "sym": True,
         "f32": False, "act": "silu", "m": 1},
        {"op": "down", "n": 7, "k": 64, "experts": 3, "used": 2, "bits": 8, "group": 16, "sym": False, "f32": True,
         "m": 2},
        {"op": "gate_up", "n": 3, "k": 64, "experts": 3, "used": 2, "bits": 4, "group": 32, "sym": True,
         "f32": False, "mxfp4": True, "act": "swiglu_oai", "bias": True, "m": 1},
    ),
    tolerance=1e-5,
    tolerance_why=(
        "each output sums K ≤ 768 fp32 products in groups, then a tree over the work-group, and down a sum of the "
        "used experts: about √K·2⁻²⁴ of Σ|terms|, which random signs make ~√K·|y|, so ≲ 1e-6 of max|y| (the "
        "selftest's worst: 4e-7); 1e-5 leaves 10× and still fails a wrong expert, a wrong nibble, scale or "
        "weight, or one missing group (errors of 1/K or more)"),
    test_shapes=(
        # the real models' forms at small sizes, rows off every ROWS, groups off every WGS
        {"op": "gate_up", "n": 37, "k": 96, "experts": 9, "used": 3, "bits": 4, "group": 32, "sym": True, "f32": False,
         "act": "silu", "m": 1},
        {"op": "down", "n": 45, "k": 64, "experts": 9, "used": 3, "bits": 4, "group": 32, "sym": True, "f32": False,
         "m": 1},
        {"op": "gate_up", "n": 23, "k": 160, "experts": 5, "used": 2, "bits": 4, "group": 32, "sym": False,
         "f32": False, "act": "gelu_tanh", "m": 3},
        {"op": "down", "n": 50, "k": 48, "experts": 6, "used": 4, "bits": 8, "group": 16, "sym": False, "f32": True,
         "m": 3},
        {"op": "gate_up", "n": 19, "k": 64, "experts": 4, "used": 4, "bits": 8, "group": 32, "sym": True,
         "f32": False, "act": "silu", "m": 2},
        {"op": "down", "n": 33, "k": 256, "experts": 5, "used": 2, "bits": 4, "group": 128, "sym": False,
         "f32": True, "m": 2, "accumulate": True},
        # gpt-oss: MXFP4 experts (e2m1 nibbles, E8M0 bytes), row biases, the clamped SwiGLU
        {"op": "gate_up", "n": 29, "k": 96, "experts": 6, "used": 4, "bits": 4, "group": 32, "sym": True,
         "f32": False, "mxfp4": True, "act": "swiglu_oai", "bias": True, "m": 2},
        {"op": "down", "n": 41, "k": 64, "experts": 6, "used": 4, "bits": 4, "group": 32, "sym": True, "f32": False,
         "mxfp4": True, "bias": True, "m": 1},
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
