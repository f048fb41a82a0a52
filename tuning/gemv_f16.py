"""Tuning spec of gemv_f16: y (N) = W (N, K) · x (K), W fp16, fp32 accumulation (the lm_head).

Shape: n, k, and optionally block_bytes (the most bytes per row block of W) to force the split of W
over several buffers that a large vocabulary needs on a phone.
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops.gemv_f16 import PARAMS, F16DeviceWeight, GemvF16
from perfx.tuning.spec import Case, Spec, cached_per_params, f16_matrix

# Input copies cycled by Case.rotate when W is small enough to stay in a cache between launches.
ROTATE_BELOW_BYTES = 64 << 20


def expected_gemv(w: np.ndarray, x: np.ndarray, rows: int = 4096) -> np.ndarray:
    """reference.gemv in row chunks: a float64 copy of a whole 32000 × 4096 W would take 1 GB."""
    return np.concatenate([reference.gemv(w[i:i + rows], x) for i in range(0, w.shape[0], rows)])


def make_case(device, shape, rng) -> Case:
    n, k = shape["n"], shape["k"]
    # Weights of Llama's size (|w| ~ 0.05) so fp16 keeps its full precision; x ~ N(0, 1).
    w = (rng.standard_normal((n, k), dtype=np.float32) * 0.05).astype(np.float16)
    x = rng.standard_normal(k, dtype=np.float32)
    copies = 3 if 2 * n * k < ROTATE_BELOW_BYTES else 1
    inputs = [(F16DeviceWeight.upload(device, w, shape.get("block_bytes")), device.upload(x))
              for _ in range(copies)]
    y = device.empty(n, np.float32)
    poison = np.full(n, np.nan, np.float32)
    wrapper = cached_per_params(lambda params: GemvF16(device, params))
    state = {"copy": 0}

    def launch(params):
        weight, xd = inputs[state["copy"]]
        return wrapper(params)(weight, xd, y)

    def run(params):
        y.set(poison)
        for event in launch(params):
            event.wait()
        return {"y": y.get()}

    def rotate():
        state["copy"] = (state["copy"] + 1) % copies

    return Case(expected={"y": expected_gemv(w, x)}, run=run, launch=launch, rotate=rotate)


SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    programs=lambda device, shape, params: GemvF16(device, params),
    tolerance=1e-5,
    tolerance_why=("fp32 accumulation of K products of exact fp16·fp32 values, in LANES·VW partial sums "
                   "then a tree: the error grows like ~sqrt(K)·2⁻²⁴ relative to |y| (measured ≤ 9e-7 at "
                   "K = 4160); 1e-5 leaves room for other summation orders, while one missed or doubled "
                   "column (≈1/sqrt(K) of |y|) is far above it"),
    test_shapes=(
        {"n": 1000, "k": 4160},
        {"n": 131, "k": 1003},                       # K mod 8 = 3: the scalar tail
        {"n": 1000, "k": 576, "block_bytes": 300 * 576 * 2},  # W over 4 buffers: 300, 300, 300, 100 rows
        {"n": 37, "k": 5},                            # K below one vector: tail only
    ),
    bytes_moved=lambda s: 2 * s["n"] * s["k"] + 4 * s["k"] + 4 * s["n"],
    reference=reference.gemv,
    fuzz_shapes=lambda st: f16_matrix(st, 200, 1200),
    oclgrind_shapes=(
        {"n": 19, "k": 203},
        {"n": 20, "k": 40, "block_bytes": 7 * 40 * 2},  # W over three buffers (7, 7 and 6 rows)
    ),
    flops=lambda s: 2 * s["n"] * s["k"],
)
