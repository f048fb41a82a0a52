"""Tuning specs of the prefill int8 GEMM (and the lm_head over many positions): ``gemm_q8`` (float8
accumulators, a work-item's columns in registers), ``gemm_q8_lanes`` (an output column a SIMD lane) and
``gemm_q8_i8`` (a few rows with int8 activations: the batched decode step).

A shape is {"m", "n" (weight rows: 2·I for a gate-up epilogue), "k", "group", "f32", "epilogue" ("none" |
"bias" | "silu_mul" | "gelu_mul")}, optionally "sym" (scales alone, as gemv_q8's) and "block_bytes" (the
most code bytes per row block, forcing the split a large vocabulary needs on a phone).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from perfx import reference
from perfx.ops import gemm_q8
from perfx.ops.epilogue import output_rows
from perfx.ops.gemm_q8 import GemmQ8
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.tuning.gemm_q4 import q8_rounded
from perfx.tuning.gemv_q8 import random_weight
from perfx.tuning.spec import (Case, Spec, cached_per_params, epilogue_reference, gemm_copies, lazy_copies,
                                q8_group_bytes, q8_matrix, rotating_case)


def output_columns(shape) -> int:
    return output_rows(shape["n"], shape.get("epilogue"))


def bytes_moved(shape) -> int:
    """Weights once (codes, scales and offsets, bias), X once and Y once."""
    m, k = shape["m"], shape["k"]
    return weight_bytes(shape) + 4 * m * k + 4 * m * output_columns(shape)


def weight_bytes(shape) -> int:
    """The weight's bytes: codes, scales (and offsets) and bias."""
    n, k, group = shape["n"], shape["k"], shape["group"]
    bias = 4 * n if shape.get("epilogue") == "bias" else 0
    return n * k + q8_group_bytes(shape) * n * (k // group) + bias


def make_case(device, shape, rng, kind: str = "skinny") -> Case:
    m, n, k = shape["m"], shape["n"], shape["k"]
    epilogue = shape.get("epilogue", "none")
    q8 = random_weight(shape, rng)
    bias = (0.1 * rng.standard_normal(n)).astype(np.float32) if epilogue == "bias" else None
    copies = gemm_copies(device, m, weight_bytes(shape))   # the copies a timing rotates through
    weights = lazy_copies(lambda: Q8DeviceWeight.upload(device, q8, bias, shape.get("block_bytes"),
                                                        what=f"gemm_q8 test {n}x{k}"))
    x_host = rng.standard_normal((m, k)).astype(np.float32)
    x = device.upload(x_host)
    y = device.poisoned((m, output_columns(shape)), np.float32)
    # the int8 kernel computes with X rounded to int8 per group (I8_TOLERANCE_WHY)
    x_ref = q8_rounded(x_host, shape["group"]) if kind == "i8" else x_host
    expected = epilogue_reference(epilogue, reference.gemm(x_ref, q8.dequantize(), bias))
    wrapper = cached_per_params(lambda params: GemmQ8(device, params, shape, kind))

    def launch_copy(i, params):
        return [wrapper(params)(weights(i), x, y, m, epilogue)]

    return rotating_case(expected, y, copies, launch_copy, device=device if copies > 1 else None)


def programs(device, shape, params, kind: str = "skinny") -> None:
    """The kernel a product at ``params`` runs on ``shape`` (and the int8 kernel's rounding of X)."""
    wrapper = GemmQ8(device, params, shape, kind)
    wrapper.kernel(shape["group"], bool(shape.get("f32")), bool(shape.get("sym")), shape.get("epilogue", "none"))
    if kind == "i8":
        wrapper.quantize_kernel(shape["group"])


def fuzz_shapes(st):
    """Any M up to 40, N up to 100 (twice that for gate-up), K of 1–12 groups of 16 or 32, any int8 form,
    maybe in row blocks, any epilogue."""
    @st.composite
    def shape(draw):
        n, k, group, form, block = draw(q8_matrix(st, 100))
        epilogue = draw(st.sampled_from(["none", "bias", "silu_mul", "gelu_mul"]))
        drawn = {"m": draw(st.integers(1, 40)), "n": 2 * n if epilogue.endswith("_mul") else n, "k": k,
                 "group": group, **form, "epilogue": epilogue}
        if block:
            drawn["block_bytes"] = block
        return drawn
    return shape()


SPEC = Spec(
    params=gemm_q8.PARAMS,
    make_case=make_case,
    programs=programs,
    tolerance=1e-4,
    tolerance_why=(
        "fp32 accumulation of K ≤ 4160 products of dequantized weights (s·q + m, one rounding) and x against "
        "float64 on the same codes and pairs: rounding grows like sqrt(K)·2⁻²⁴ of Σ|x·w|, and max|Y| of random "
        "inputs is about sqrt(K) times smaller than Σ|x·w|, so the relative error is a few 1e-6; 1e-4 leaves "
        "margin and still catches one wrong weight group (≥ 1e-3) or a dropped block (≥ 1e-1)"),
    # Off every tile grid: M = 33 runs passes of MT then a single row; 60, 100 and 37 columns are no
    # multiple of ROWS·WGS. The first shape (gate-up, G = 16, float32 pairs, gate and up rows crossing
    # block boundaries at different columns) exercises the most code: tests sweep it. The third and fourth
    # have scales alone (fp16: Q8_0's and Q5_0's).
    test_shapes=(
        {"m": 33, "n": 2 * 60, "k": 352, "group": 16, "f32": True, "epilogue": "silu_mul", "block_bytes": 50 * 352},
        {"m": 7, "n": 100, "k": 384, "group": 32, "f32": False, "epilogue": "bias"},
        {"m": 5, "n": 37, "k": 576, "group": 32, "f32": False, "sym": True, "epilogue": "none",
         "block_bytes": 10 * 576},
        {"m": 9, "n": 2 * 50, "k": 320, "group": 32, "f32": False, "sym": True, "epilogue": "gelu_mul",
         "block_bytes": 30 * 320},
    ),
    bytes_moved=bytes_moved,
    reference=reference.gemm,
    fuzz_shapes=fuzz_shapes,
    oclgrind_shapes=(
        {"m": 3, "n": 2 * 5, "k": 64, "group": 16, "f32": True, "epilogue": "silu_mul", "block_bytes": 4 * 64},
        {"m": 2, "n": 9, "k": 96, "group": 32, "f32": False, "sym": True, "epilogue": "bias"},
        {"m": 2, "n": 2 * 3, "k": 32, "group": 32, "f32": True, "sym": True, "epilogue": "gelu_mul"},
    ),
    flops=lambda shape: 2 * shape["m"] * shape["n"] * shape["k"],
    compared_kind=True,
)


# The same shapes, checks and tolerance: the same products and edges. M = 33 runs passes of MB and then the
# remainder's masked passes of 4 (kernels/m_masked_passes.h; every remainder of every MB:
# tests/test_q8_kernels.py); 60, 100, 37 and 50 columns are no multiple of ROWS·WGS.
def lanes_case(device, shape, rng) -> Case:
    return make_case(device, shape, rng, "lanes")


LANES = dataclasses.replace(SPEC, params=gemm_q8.LANES, make_case=lanes_case,
                            programs=lambda device, shape, params: programs(device, shape, params, "lanes"))


# gemm_q8_i8: the same shapes (M = 33, 7, 5, 9 off every MT, the columns off ROWS·WGS, row blocks, G = 16 and 32,
# pairs and scales alone), against X rounded as the kernel rounds it.
I8_TOLERANCE_WHY = (
    "gemm_q8_i8 rounds X to int8 per group of G (llama.cpp's Q8_1, as gemv_q8's I8 does), and then its products "
    "and sums are exact in int until fp32 takes over per group: so it is checked against the float64 product of "
    "the weights and X so rounded (tuning/gemm_q4.py's q8_rounded), at the fp32 kernels' tolerance and for the "
    "same reasons; a wrong code, group or row shows there as it would in fp32. Against the exact X its error is "
    "the rounding's (gemv_q8's I8 tolerance: tests/test_q8_kernels.py checks that too).")


def i8_case(device, shape, rng) -> Case:
    return make_case(device, shape, rng, "i8")


I8 = dataclasses.replace(SPEC, params=gemm_q8.I8, make_case=i8_case, tolerance_why=I8_TOLERANCE_WHY,
                         programs=lambda device, shape, params: programs(device, shape, params, "i8"))
