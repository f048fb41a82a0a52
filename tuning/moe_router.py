"""Tuning spec of moe_router: a mixture-of-experts router's logits and its top-k choice, on the device.

Shape: ``e`` experts, ``k`` the hidden size, ``used`` experts chosen a row, ``gating`` ("softmax", "sigmoid",
"softmax_weight"), ``bias`` (a selection bias), ``norm`` (renormalised weights), ``m`` rows, optionally ``scale``
(the weights' scale, 1 by default) and ``logit_bias`` (a bias on the logits: gpt-oss's router).
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops.moe_router import PARAMS, MoeRouter
from perfx.tuning.spec import Case, Spec, cached_per_params

# The float64 choice is redrawn where two selection scores at the top lie this close (relative to the largest):
# float32 logits (errors ~1e-6 of it) could then choose the other expert, and the case would test the tie.
SEPARATION = 1e-4


def _inputs(shape, rng):
    e, k, m = shape["e"], shape["k"], shape["m"]
    while True:
        x = rng.standard_normal((m, k)).astype(np.float32)
        router = (rng.standard_normal((e, k)) / np.sqrt(k)).astype(np.float32)
        bias = (rng.standard_normal(e) * 0.5).astype(np.float32) if shape.get("bias") else None
        logit_bias = rng.standard_normal(e).astype(np.float32) if shape.get("logit_bias") else None
        logits = reference.linear(x, router, logit_bias)
        gating = shape["gating"]
        probs = (reference.softmax(logits) if gating == "softmax" else reference.sigmoid(logits)
                 if gating == "sigmoid" else logits)
        select = np.sort(probs + (0.0 if bias is None else bias), axis=-1)[:, ::-1][:, :shape["used"] + 1]
        gaps = np.abs(np.diff(select, axis=-1)) if select.shape[1] > 1 else np.ones((m, 1))
        if gaps.min() > SEPARATION * np.abs(select).max():
            return x, router, bias, logit_bias, logits


def make_case(device, shape, rng) -> Case:
    e, k, m, used = shape["e"], shape["k"], shape["m"], shape["used"]
    scale = float(shape.get("scale", 1.0))
    x, router, bias, logit_bias, logits = _inputs(shape, rng)
    ids, weights = reference.moe_route(logits, used, shape["gating"], bias, bool(shape.get("norm")), scale)
    x_d, w_d = device.upload(x), device.upload(router)
    b_d = device.upload(bias) if bias is not None else None
    l_d = device.upload(logit_bias) if logit_bias is not None else None
    z_d, i_d, o_d = device.empty((m, e), np.float32), device.empty((m, used), np.int32), device.empty((m, used),
                                                                                                       np.float32)
    wrapper = cached_per_params(lambda params: MoeRouter(device, params, shape))

    def launch(params):
        return list(wrapper(params)(x_d, w_d, b_d, z_d, i_d, o_d, m, k, scale, logit_bias=l_d))

    def run(params):
        z_d.fill(np.float32(np.nan))
        i_d.fill(np.int32(-1))
        o_d.fill(np.float32(np.nan))
        for event in launch(params):
            event.wait()
        return {"logits": z_d.get(), "ids": i_d.get(), "weights": o_d.get()}

    return Case(expected={"logits": logits, "ids": ids, "weights": weights}, run=run, launch=launch)


def fuzz_shapes(st):
    """Expert counts off every work-group size, any number chosen, every gating, with and without bias and norm."""
    @st.composite
    def shape(draw):
        e = draw(st.integers(1, 300))
        return {"e": e, "k": draw(st.integers(1, 300)), "used": draw(st.integers(1, min(e, 32))),
                "gating": draw(st.sampled_from(["softmax", "sigmoid", "softmax_weight"])), "bias": draw(st.booleans()),
                "norm": draw(st.booleans()), "logit_bias": draw(st.booleans()), "m": draw(st.integers(1, 6))}
    return shape()


def programs(device, shape, params) -> None:
    """The kernels a run at ``params`` builds: the wrapper's, all made when it is."""
    MoeRouter(device, params, shape)


SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    reference=reference.moe_route,
    fuzz_shapes=fuzz_shapes,
    oclgrind_shapes=({"e": 19, "k": 70, "used": 3, "gating": "sigmoid", "bias": True, "norm": True, "m": 2},),
    tolerance=1e-5,
    tolerance_why=(
        "logits are sums of K ≤ 300 fp32 products (a few 1e-7 of the largest); the weights are exp or σ of them "
        "over a sum of E terms, a few ulp more; the ids are exact, as the inputs keep the top scores 1e-4 apart, "
        "so one expert chosen wrongly gives an error ≥ 1/E, 200× over 1e-5 at E ≤ 512, and a weight of the wrong "
        "expert or unnormalised an error of O(1/used)"),
    test_shapes=(
        {"e": 13, "k": 70, "used": 3, "gating": "softmax", "bias": False, "norm": True, "m": 1},   # Qwen3-MoE's
        {"e": 32, "k": 96, "used": 4, "gating": "sigmoid", "bias": True, "norm": True, "m": 5},   # LFM2-MoE's
        {"e": 130, "k": 45, "used": 8, "gating": "softmax", "bias": False, "norm": False, "m": 3, "scale": 2.5},
        {"e": 7, "k": 33, "used": 7, "gating": "softmax_weight", "bias": False, "norm": False, "m": 2},  # all chosen
        {"e": 300, "k": 20, "used": 2, "gating": "sigmoid", "bias": False, "norm": False, "m": 1},
        {"e": 32, "k": 90, "used": 4, "gating": "softmax_weight", "bias": False, "norm": False, "logit_bias": True,
         "m": 3},   # gpt-oss-20b's
    ),
    bytes_moved=lambda s: 4 * (s["e"] * s["k"] + s["m"] * (s["k"] + 2 * s["e"] + 2 * s["used"])),
    flops=lambda s: 2 * s["m"] * s["e"] * s["k"],
    describe=lambda s: (f"E={s['e']} K={s['k']} top-{s['used']} {s['gating']}" + (" bias" if s.get("bias") else "")
                        + (" norm" if s.get("norm") else "") + (" logit-bias" if s.get("logit_bias") else "")
                        + f" m={s['m']}"),
    programs=programs,
)
