"""Tuning spec of moe_shared_gate: a shared expert's σ gate, h (m, n) *= σ(x·w) a row, in place.

Shape: ``m`` rows, ``k`` the hidden size (the dot product's length), ``n`` the shared expert's width (the values
scaled a row).
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops.moe_shared_gate import PARAMS, MoeSharedGate
from perfx.tuning.spec import Case, Spec, cached_per_params


def make_case(device, shape, rng) -> Case:
    m, k, n = shape["m"], shape["k"], shape["n"]
    x = rng.standard_normal((m, k)).astype(np.float32)
    # gate logits of O(1) either side of 0, with a far-negative row where there are several (σ ≈ 0 at its tail)
    w = (rng.standard_normal(k) * 1.5 / np.sqrt(k)).astype(np.float32)
    if m > 2:
        x[-1] = -w * (30.0 / float(w @ w))
    h = rng.standard_normal((m, n)).astype(np.float32)
    x_d, w_d, h_d = device.upload(x), device.upload(w), device.upload(h)
    made = cached_per_params(lambda params: MoeSharedGate(device, params))

    def launch(params):
        return [made(params)(x_d, w_d, h_d, m, k, n)]

    def run(params):
        h_d.set(h)   # scaled in place: the fresh values first (a value left unscaled is off by 1 − σ, O(1))
        for event in launch(params):
            event.wait()
        return {"h": h_d.get()}

    return Case(expected={"h": reference.moe_shared_gate(x, w, h)}, run=run, launch=launch)


def programs(device, shape, params) -> None:
    """The kernel a run at ``params`` builds: the wrapper's, made when it is."""
    MoeSharedGate(device, params)


SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    reference=reference.moe_shared_gate,
    tolerance=1e-5,
    tolerance_why=("σ of an fp32 dot product of K ≤ 4096 terms (a few 1e-7 of Σ|x·w|, which σ' ≤ 1/4 shrinks), "
                   "times each value: a few 2⁻²⁴ relative; an unscaled or doubly scaled value is off by O(1)"),
    test_shapes=({"m": 1, "k": 2048, "n": 512}, {"m": 5, "k": 70, "n": 37}, {"m": 3, "k": 33, "n": 300}),
    bytes_moved=lambda s: 4 * (s["m"] * (s["k"] + 2 * s["n"]) + s["k"]),
    flops=lambda s: 2 * s["m"] * (s["k"] + s["n"]),
    fuzz_shapes=lambda st: st.fixed_dictionaries({"m": st.integers(1, 8), "k": st.integers(1, 600),
                                                  "n": st.integers(1, 2000)}),
    oclgrind_shapes=({"m": 2, "k": 70, "n": 37},),
    describe=lambda s: f"m={s['m']} K={s['k']} n={s['n']}",
    programs=programs,
)
