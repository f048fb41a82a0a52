"""Tuning spec of gemv_q4_split: the int4 GEMV shaped for a GPU (K split across work-groups, coalesced texels,
partial sums reduced by a second launch), on the rows layout.

Its shapes are gemv_q4's (``n``, ``k``, ``group``, ``epilogue``, ``bias``, optionally ``parts`` and ``form``):
the same decode GEMVs, so `perfx tune` measures both families at each int4 GEMV of the step
(``perfx.tuning.problems``' decode alternatives) and the faster can be chosen per role. Timings rotate
through copies of the weight past the device's cache, as gemv_q4's. ``perfx.tuning.gemv_index`` models its
launch and loads at a GPU's limits.
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.formats import Q4_PAIRS, Q4Matrix
from perfx.ops.gemv_q4_split import PARAMS, GemvQ4Split
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.tuning.gemv_q4 import (OCLGRIND_SHAPES, _bytes_moved, _outputs, _weight_bytes, activations, describe, flops,
                                  fuzz_shapes)
from perfx.tuning.spec import (Case, Spec, cached_per_params, copies_past_cache, epilogue_reference, lazy_copies,
                               rotating_case)


def make_case(device, shape, rng) -> Case:
    n, k, group = shape["n"], shape["k"], shape["group"]
    epilogue = shape.get("epilogue", "none")
    parts = shape.get("parts") or (n,)
    assert sum(parts) == n, f"parts {parts} do not add up to n = {n}"
    q4 = Q4Matrix.concat([Q4Matrix.random(p, k, group, rng, form=shape.get("form", Q4_PAIRS)) for p in parts])
    bias = rng.standard_normal(n).astype(np.float32) * 0.1 if shape.get("bias") else None
    x = device.upload(activations(rng, k))
    y = device.poisoned(_outputs(shape), np.float32)

    full = np.concatenate([reference.gemv(q4.rows(i, min(i + 2048, n)).dequantize(), x.get())
                           for i in range(0, n, 2048)])
    full = full if bias is None else full + bias
    expected = epilogue_reference(epilogue, full)

    wrapper = cached_per_params(lambda params: GemvQ4Split(device, params, shape))
    uploaded = lazy_copies(lambda: Q4DeviceWeight.upload(device, q4, bias, ("buffer",)))
    return rotating_case(expected, y, copies_past_cache(device, _weight_bytes(shape)),
                         lambda i, params: wrapper(params).events(uploaded(i), x, y, epilogue), device=device)


SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    programs=lambda device, shape, params: GemvQ4Split(device, params, shape).kernels(
        shape["group"], shape.get("epilogue", "none"), shape["k"], shape.get("form", Q4_PAIRS),
        bool(shape.get("bias"))),
    tolerance=1e-4,
    tolerance_why=(
        "fp32 accumulation as gemv_q4's, against the float64 reference: each texel's 32 products in 8 lanes, "
        "scaled per texel, K/32/(LANES·SPLIT) texels a work-item, then a tree of LANES and a sum of SPLIT "
        "partials, every partial of at most K ≤ 4160 O(1) terms: a worst-case rounding of a few 1e-6 of Σ|w·x|, "
        "~10–30× max|y|, so 1e-4 of max|y| leaves >3× margin while one wrong code (|Δw| = s ≈ 0.0025 times |x| "
        "~ 3), a missing texel, group or slice still shows"),
    # N = 1000, K = 4160 (130 texels: slices of 66, 34, 18, 10 that do not divide it; 65 groups of 64); a fused
    # QKV with bias; an off-grid matrix (marked as gemv_q4's whose x the step hands no blocks: the split reads x
    # as floats either way); an off-grid gate-up with each activation (SwiGLU, GeGLU).
    test_shapes=(
        {"n": 1000, "k": 4160, "group": 64, "epilogue": "none", "bias": False},
        {"n": 960, "k": 576, "group": 32, "epilogue": "none", "bias": True, "parts": (576, 192, 192)},
        {"n": 37, "k": 576, "group": 32, "epilogue": "none", "bias": False, "quantizes_x": True},
        {"n": 2 * 203, "k": 640, "group": 128, "epilogue": "silu_mul", "bias": False},
        {"n": 2 * 75, "k": 1344, "group": 64, "epilogue": "gelu_mul", "bias": True},
    ),
    bytes_moved=_bytes_moved,
    reference=reference.gemv,
    fuzz_shapes=fuzz_shapes,
    oclgrind_shapes=OCLGRIND_SHAPES,
    flops=flops,
    describe=describe,
)
