"""Tuning spec of gemv_q8: the decode-path int8 GEMV (plain, fused QKV with bias, gate-up SiLU·mul or
GELU·mul, lm_head).

A shape is a dict: ``n`` rows of W (gate-up: 2·I, gate rows then up rows), ``k``, ``group`` (16 or 32),
``f32`` (float32 scales, as Q5_K and Q6_K need), optionally ``sym`` (scales alone: Q8_0, Q5_0, Q6_K), ``epilogue`` ("none" | "silu_mul" | "gelu_mul"),
``bias`` (bool), optionally ``parts`` (row counts of matrices fused along N, e.g. QKV), ``block_bytes``
(the most code bytes per row block, to force the split a large vocabulary needs on a phone). Timings
rotate through copies of the weight past the device's cache (``copies_past_cache``), as a decode step
reads it: from memory.
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.formats import Q8Matrix
from perfx.ops.epilogue import output_rows
from perfx.ops.gemv_q8 import PARAMS, GemvQ8
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.tuning.spec import (GATED, Case, Spec, cached_per_params, copies_past_cache, epilogue_reference,
                               lazy_copies, q8_group_bytes, q8_matrix, q8_random, rotating_case)


def _outputs(shape) -> int:
    return output_rows(shape["n"], shape.get("epilogue"))


def _weight_bytes(shape) -> int:
    n, k, g = shape["n"], shape["k"], shape["group"]
    return n * k + q8_group_bytes(shape) * n * (k // g) + (4 * n if shape.get("bias") else 0)


def bytes_moved(shape) -> int:
    return _weight_bytes(shape) + 4 * shape["k"] + 4 * _outputs(shape)


def random_weight(shape, rng, n: int | None = None) -> Q8Matrix:
    """A random int8 matrix of the shape's group and form (fused parts concatenated)."""
    parts = shape.get("parts") or (n or shape["n"],)
    return Q8Matrix.concat([q8_random(shape, rng, p) for p in parts])


def make_case(device, shape, rng) -> Case:
    n, k = shape["n"], shape["k"]
    epilogue = shape.get("epilogue", "none")
    assert sum(shape.get("parts") or (n,)) == n, f"parts {shape.get('parts')} do not add up to n = {n}"
    q8 = random_weight(shape, rng)
    bias = rng.standard_normal(n).astype(np.float32) * 0.1 if shape.get("bias") else None
    weights = lazy_copies(lambda: Q8DeviceWeight.upload(device, q8, bias, shape.get("block_bytes")))
    x = device.upload(rng.standard_normal(k).astype(np.float32))
    m = _outputs(shape)
    y = device.poisoned(m, np.float32)

    # Row blocks, so the float64 reference of a large lm_head stays at ~64 MB at a time.
    full = np.concatenate([reference.gemv(q8.rows(i, min(i + 2048, n)).dequantize(), x.get())
                           for i in range(0, n, 2048)])
    full = full if bias is None else full + bias
    expected = epilogue_reference(epilogue, full)

    wrapper = cached_per_params(lambda params: GemvQ8(device, params, shape))
    return rotating_case(expected, y, copies_past_cache(device, _weight_bytes(shape)),
                         lambda i, params: wrapper(params).events(weights(i), x, y, epilogue),
                         device=device)


def programs(device, shape, params) -> None:
    """The kernels a product at ``params`` runs on ``shape``: the GEMV, and x's quantization with I8."""
    wrapper = GemvQ8(device, params, shape)
    wrapper.kernel(shape["group"], bool(shape.get("f32")), bool(shape.get("sym")), shape.get("epilogue", "none"))
    if wrapper.params["I8"]:
        wrapper.quantize_kernel(shape["group"])


def fuzz_shapes(st):
    """Any N up to 120 (twice that for gate-up), K of 1–12 groups of 16 or 32, any int8 form, maybe in row
    blocks: plain (maybe with bias) or gate-up with either activation."""
    @st.composite
    def shape(draw):
        n, k, group, form, block = draw(q8_matrix(st, 120))
        drawn = {"n": n, "k": k, "group": group, **form, "epilogue": "none", "bias": draw(st.booleans())}
        if draw(st.booleans()):
            drawn.update(n=2 * n, epilogue=draw(st.sampled_from(GATED)), bias=False)
        if block:
            drawn["block_bytes"] = block
        return drawn
    return shape()


SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    programs=programs,
    tolerance=1e-4,
    tolerance_why=(
        "fp32 accumulation against a float64 reference on the same codes, scales and offsets: s·q·x per "
        "weight summed in groups of G ≤ 32, then K/G group terms s·Σqx (+ m·Σx) per lane and a tree over the "
        "lanes; the rounding is a few 1e-6 of Σ|w·x|, which is ~10–30× max|y| for random signs, so 1e-4 of "
        "max|y| leaves margin (≤ 5e-7 measured on PoCL), while one code off by one (|Δw| = s ≈ 1.6e-4 "
        "times |x| ~ 3, against max|y| ~ 0.5) or a missing group or block is far above it"),
    variant_tolerances={
        "I8": (2e-2, (
            "I8 = 1: x is rounded to int8 per group of G (step d = max|x_group|/127, the offset term on the sum "
            "of the rounded group), each value moving by up to d/2; the products are then exact in int and "
            "summed in fp32 per group. For N(0, 1) activations a group's max|x| is ~2.1 (G = 32), so x moves "
            "by ~d/√12 ≈ 4.8e-3 rms, ~5e-3 of |y| (rms): measured 5.5e-3 to 6.7e-3 of max|y| on the test "
            "shapes (PoCL and Intel alike). 2e-2 leaves 3× and still fails a dropped group or a wrong row; a "
            "single wrong code it does not see, so test_q8_kernels also checks I8 against the float64 product "
            "of the same quantized x (perfx.reference.quantize_activations_q8) at the fp32 tolerance")),
    },
    # Build variants (G, the form and the epilogue are defines), each swept over every candidate by the
    # tests: a large off-grid matrix; a fused QKV with bias and float32 pairs at G = 16; a small matrix of
    # fp16 scales alone (Q8_0's, Q5_0's) over 4 row blocks; a SwiGLU gate-up of float32 scales alone at
    # G = 16 (Q6_K's) and a GeGLU one, their gate and up rows crossing block boundaries at other rows.
    test_shapes=(
        {"n": 1000, "k": 4160, "group": 32, "f32": False, "epilogue": "none", "bias": False},
        {"n": 960, "k": 576, "group": 16, "f32": True, "epilogue": "none", "bias": True, "parts": (576, 192, 192)},
        {"n": 37, "k": 576, "group": 32, "f32": False, "sym": True, "epilogue": "none", "bias": True,
         "block_bytes": 10 * 576},
        {"n": 2 * 203, "k": 640, "group": 16, "f32": True, "sym": True, "epilogue": "silu_mul", "bias": False,
         "block_bytes": 150 * 640},
        {"n": 2 * 75, "k": 384, "group": 32, "f32": False, "epilogue": "gelu_mul", "bias": False,
         "block_bytes": 40 * 384},
    ),
    bytes_moved=bytes_moved,
    reference=reference.gemv,
    fuzz_shapes=fuzz_shapes,
    oclgrind_shapes=(
        {"n": 13, "k": 96, "group": 32, "f32": False, "sym": True, "epilogue": "none", "bias": True, "parts": (7, 6),
         "block_bytes": 5 * 96},
        {"n": 2 * 7, "k": 64, "group": 16, "f32": True, "epilogue": "silu_mul", "bias": False,
         "block_bytes": 4 * 64},
        {"n": 2 * 5, "k": 64, "group": 32, "f32": False, "sym": True, "epilogue": "gelu_mul", "bias": False},
    ),
    flops=lambda shape: 2 * shape["n"] * shape["k"],
    describe=lambda s: (f"{s['n']}x{s['k']} G={s['group']}{' f32' if s.get('f32') else ''}"
                        + (" sym" if s.get("sym") else "")
                        + (" +bias" if s.get("bias") else "")
                        + (f" {s['epilogue']}" if s.get("epilogue", "none") != "none" else "")
                        + (" blocks" if s.get("block_bytes") else "")),
)
