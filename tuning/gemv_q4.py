"""Tuning spec of gemv_q4: the decode-path int4 GEMV (plain, fused QKV with bias, gate-up SiLU·mul).

A shape is a dict: ``n`` rows of W (for ``silu_mul``: 2·I, gate rows then up rows), ``k``, ``group``,
``epilogue`` ("none" | "silu_mul"), ``bias`` (bool), optionally ``parts`` (row counts of matrices
fused along N, e.g. QKV) and ``copies`` (weights to rotate between, for timing).
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.formats import Q4Matrix
from perfx.ops.gemv_q4 import PARAMS, GemvQ4
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.tuning.spec import Case, Spec, cached_per_params


def _outputs(shape) -> int:
    return shape["n"] // 2 if shape.get("epilogue", "none") == "silu_mul" else shape["n"]


def _bytes_moved(shape) -> int:
    n, k, g = shape["n"], shape["k"], shape["group"]
    return n * k // 2 + 4 * n * (k // g) + 4 * k + 4 * _outputs(shape) + (4 * n if shape.get("bias") else 0)


def _read_paths(device, shape) -> tuple[str, ...]:
    caps = device.caps
    images = caps.image_support and shape["k"] // 32 <= caps.image2d_max_width
    return ("buffer", "image2d") if images else ("buffer",)


def make_case(device, shape, rng) -> Case:
    n, k, group = shape["n"], shape["k"], shape["group"]
    epilogue = shape.get("epilogue", "none")
    parts = shape.get("parts") or (n,)
    assert sum(parts) == n, f"parts {parts} do not add up to n = {n}"
    copies = []
    for _ in range(max(1, shape.get("copies", 1))):
        q4 = Q4Matrix.concat([Q4Matrix.random(p, k, group, rng) for p in parts])
        bias = rng.standard_normal(n).astype(np.float32) * 0.1 if shape.get("bias") else None
        copies.append((q4, bias, Q4DeviceWeight.upload(device, q4, bias, read_paths=_read_paths(device, shape))))
    x = device.upload(rng.standard_normal(k).astype(np.float32))
    m = _outputs(shape)
    y = device.poisoned(m, np.float32)

    q4, bias, _ = copies[0]
    # Row blocks, so the float64 reference of a 7B gate-up (22016 x 4096) stays at ~64 MB at a time.
    full = np.concatenate([reference.gemv(q4.rows(i, min(i + 2048, n)).dequantize(), x.get())
                           for i in range(0, n, 2048)])
    full = full if bias is None else full + bias
    expected = reference.swiglu(full[:m], full[m:]) if epilogue == "silu_mul" else full

    wrapper = cached_per_params(lambda params: GemvQ4(device, params, shape))
    state = {"i": 0}

    def launch(params):
        return wrapper(params).events(copies[state["i"]][2], x, y, epilogue)

    def run(params):
        state["i"] = 0
        y.fill(np.float32(np.nan))
        for event in launch(params):
            event.wait()
        return {"y": y.get()}

    def rotate():
        state["i"] = (state["i"] + 1) % len(copies)

    return Case(expected={"y": expected}, run=run, launch=launch, rotate=rotate)


SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    tolerance=1e-4,
    tolerance_why=(
        "fp32 accumulation of K ≤ 4160 products of O(1) terms against a float64 reference: per-group "
        "partial sums of G ≤ 128 terms, then K/G group terms, give a worst-case rounding error of a few "
        "1e-6 of Σ|w·x|; Σ|w·x| is ~10–30× max|y| for random signs, so 1e-4 of max|y| leaves >3× margin "
        "while a single wrong code (|Δw| = s ≈ 0.0025 times |x| ~ 3) or a missing group still shows"),
    # Three build variants (G and epilogue are defines), each swept over every candidate by the tests:
    # the brief's N = 1000, K = 4160 (65 groups of 64); a fused QKV with bias; an off-grid gate-up.
    test_shapes=(
        {"n": 1000, "k": 4160, "group": 64, "epilogue": "none", "bias": False},
        {"n": 960, "k": 576, "group": 32, "epilogue": "none", "bias": True, "parts": (576, 192, 192)},
        {"n": 37, "k": 576, "group": 32, "epilogue": "none", "bias": False},
        {"n": 2 * 203, "k": 640, "group": 128, "epilogue": "silu_mul", "bias": False},
    ),
    bytes_moved=_bytes_moved,
    flops=lambda shape: 2 * shape["n"] * shape["k"],
    describe=lambda s: (f"{s['n']}x{s['k']} G={s['group']}" + (" +bias" if s.get("bias") else "")
                        + (f" {s['epilogue']}" if s.get("epilogue", "none") != "none" else "")),
)
