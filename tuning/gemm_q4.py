"""Tuning specs of the prefill int4 GEMM: ``gemm_q4_skinny`` (small M), ``gemm_q4_tiled`` (large M),
``gemm_q4_lanes`` (a column a SIMD lane), ``gemm_q4_i8`` (a few rows with int8 activations: the batched decode
step) and ``gemm_q4_f16`` (fp16 register tiles, where the device has cl_khr_fp16).

A shape is {"m", "n" (weight rows: 2·I for a gate-up epilogue), "k", "group", "epilogue" ("none" | "bias" |
"silu_mul" | "gelu_mul")}.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from perfx import reference
from perfx.formats import Q4_PAIRS, Q4Matrix, q4_scale_bytes
from perfx.ops import gemm_q4
from perfx.ops.epilogue import output_rows
from perfx.ops.gemm_q4 import GemmQ4
from perfx.ops.params import READ_BUFFER, READ_IMAGE2D, READ_NAMES
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.tuning.gemv_q4 import read_paths
from perfx.tuning.spec import (Case, Spec, cached_per_params, epilogue_reference, gemm_copies, lazy_copies, q4_matrix,
                                rotating_case)

TOLERANCE = 1e-4
TOLERANCE_WHY = (
    "fp32 accumulation of K ≤ 4160 products against float64, on the same fp16 scales and offsets: "
    "rounding grows like sqrt(K)·2⁻²⁴ of Σ|x·w|, and max|Y| of random inputs is about sqrt(K) times "
    "smaller than Σ|x·w|, so the relative error is a few 1e-6 (K = 4160: ~5e-6 seen); the order in "
    "which lanes and tiles add their partial sums changes it by as much again. 1e-4 leaves margin and "
    "still catches one wrong weight group (≥ 1e-3) or a dropped or doubled K-tile (≥ 1e-1)."
)


def output_columns(shape) -> int:
    return output_rows(shape["n"], shape.get("epilogue"))


def bytes_moved(shape) -> int:
    """Weights once (codes, scale/offset pairs, bias), X once and Y once."""
    m, k = shape["m"], shape["k"]
    return weight_bytes(shape) + 4 * m * k + 4 * m * output_columns(shape)


def weight_bytes(shape) -> int:
    """The weight's bytes: codes, scales (and offsets) and bias."""
    n, k, group = shape["n"], shape["k"], shape["group"]
    bias = 4 * n if shape.get("epilogue") == "bias" else 0
    return n * k // 2 + q4_scale_bytes(shape.get("form", Q4_PAIRS), n * (k // group)) + bias


def flops(shape) -> int:
    return 2 * shape["m"] * shape["n"] * shape["k"]


I8_TOLERANCE_WHY = (
    "gemm_q4_i8 rounds X to int8 per block of 32 (llama.cpp's Q8_1, as the rows-I8 GEMV does), and then its "
    "products and sums are exact in int until fp32 takes over per block: so it is checked against the float64 "
    "product of the weights and X so rounded (q8_rounded: reference.quantize_activations_q8's rule in the kernel's "
    "fp32, so a value within a rounding of a half goes the kernel's way), at the fp32 kernels' "
    "tolerance and for the same reasons; a wrong code, block or row shows there as it would in fp32. "
    "Against the exact X its error is the rounding's (the gemv_q4 spec's I8 tolerance, 5e-2: "
    "tests/test_gemm_q4.py checks that too).")


def q8_rounded(x, block: int = 32) -> np.ndarray:
    """X as the int8-activation kernels round it (llama.cpp's Q8_1: ``reference.quantize_activations_q8``), in
    their fp32 arithmetic: 127/max|x| and x times it in fp32, then rint (ties to even), so a value that lands
    within an fp32 rounding of a half goes the way the kernel's does; float64 values code·max|x|/127."""
    blocks = np.asarray(x, np.float32).reshape(-1, block)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    inv = np.divide(np.float32(127.0), amax, out=np.zeros_like(amax), where=amax > 0)
    codes = np.rint(blocks * inv)
    return (codes.astype(np.float64) * (amax.astype(np.float64) / 127.0)).reshape(np.shape(x))


def expected_output(x, q4: Q4Matrix, bias, epilogue: str) -> np.ndarray:
    """The float64 reference of every epilogue."""
    product = reference.gemm(x, q4.dequantize(), bias if epilogue == "bias" else None)
    return epilogue_reference(epilogue, product)


def fuzz_shapes(max_m: int):
    """Shapes of any M up to ``max_m``, N up to 100 (twice that for gate-up), K of 1–8 groups, any epilogue."""
    def strategy(st):
        @st.composite
        def shape(draw):
            n, k, group = draw(q4_matrix(st, 100))
            epilogue = draw(st.sampled_from(["none", "bias", "silu_mul", "gelu_mul"]))
            return {"m": draw(st.integers(1, max_m)), "n": 2 * n if epilogue.endswith("_mul") else n, "k": k,
                    "group": group, "epilogue": epilogue}
        return shape()
    return strategy


def _programs(kind: str):
    def programs(device, shape, params) -> None:
        """The kernel a product at ``params`` runs (with the read path the case's weight holds), and for fp16 the
        conversion of X."""
        paths = read_paths(device, shape["n"], shape["k"], params["LAYOUT"])
        read = (params["READ"] if READ_NAMES[params["READ"]] in paths
                else READ_BUFFER if "buffer" in paths else READ_IMAGE2D)   # GemmQ4.read_path on that weight
        wrapper = GemmQ4(device, **{f"{kind}_params": params}, shape=shape, kind=kind)
        wrapper.kernel(kind, shape.get("epilogue", "none"), read, params["LAYOUT"], shape.get("form", Q4_PAIRS))
        if kind == "f16":
            wrapper.convert_kernel()
        if kind == "i8":
            wrapper.quantize_kernel()
    return programs


def _case_maker(kind: str):
    def make_case(device, shape, rng) -> Case:
        m, n, k, group = shape["m"], shape["n"], shape["k"], shape["group"]
        epilogue = shape.get("epilogue", "none")
        q4 = Q4Matrix.random(n, k, group, rng, form=shape.get("form", Q4_PAIRS))   # tests set "form"
        bias = (0.1 * rng.standard_normal(n)).astype(np.float32) if epilogue == "bias" else None
        # The weight in each layout, uploaded when a candidate of that layout first runs, in as many copies as a
        # timing rotates through
        copies = gemm_copies(device, m, weight_bytes(shape))
        weights = cached_per_params(lambda key: lazy_copies(lambda: Q4DeviceWeight.upload(
            device, q4, bias, read_paths(device, n, k, key["LAYOUT"]), what=f"gemm_q4 test {n}x{k}",
            layout=key["LAYOUT"])))
        x_host = rng.standard_normal((m, k)).astype(np.float32)
        x_host[:, rng.integers(0, 256)::256] *= 40   # a few large activation channels, as in Llama
        x = device.upload(x_host)
        y = device.poisoned((m, output_columns(shape)), np.float32)
        wrapper = cached_per_params(lambda params: GemmQ4(device, **{f"{kind}_params": params}, shape=shape,
                                                          kind=kind))

        def launch_copy(i, params):
            return [wrapper(params).run(kind, weights({"LAYOUT": params["LAYOUT"]})(i), x, y, m, epilogue)]

        # the int8 kernel computes with X rounded to Q8_1 blocks (I8_TOLERANCE_WHY)
        x_ref = q8_rounded(x_host) if kind == "i8" else x_host
        return rotating_case(expected_output(x_ref, q4, bias, epilogue), y, copies, launch_copy,
                             device=device if copies > 1 else None)

    return make_case


SKINNY = Spec(
    params=gemm_q4.SKINNY,
    make_case=_case_maker("skinny"),
    programs=_programs("skinny"),
    tolerance=TOLERANCE,
    tolerance_why=TOLERANCE_WHY,
    # Off every tile grid: M = 33 runs passes of MT and then one of a single row, and the columns
    # (60 and 100) are no multiple of ROWS·WGS. The first shape exercises the most code: tests sweep it.
    test_shapes=(
        {"m": 33, "n": 2 * 60, "k": 352, "group": 32, "epilogue": "silu_mul"},
        {"m": 7, "n": 100, "k": 384, "group": 128, "epilogue": "bias"},
        {"m": 9, "n": 2 * 50, "k": 320, "group": 64, "epilogue": "gelu_mul"},
    ),
    bytes_moved=bytes_moved,
    reference=reference.gemm,
    fuzz_shapes=fuzz_shapes(40),
    oclgrind_shapes=(
        {"m": 3, "n": 19, "k": 192, "group": 64, "epilogue": "bias"},
        {"m": 2, "n": 2 * 5, "k": 128, "group": 32, "epilogue": "silu_mul"},
        {"m": 3, "n": 2 * 3, "k": 64, "group": 64, "epilogue": "gelu_mul"},
    ),
    flops=flops,
    compared_kind=True,
)

TILED = Spec(
    params=gemm_q4.TILED,
    make_case=_case_maker("tiled"),
    programs=_programs("tiled"),
    tolerance=TOLERANCE,
    tolerance_why=TOLERANCE_WHY,
    # M = 70 and 33 off MWG, 100 columns off NWG, K = 608 is 19 texels: the last K-tile is partial for
    # KWG = 64. The first shape exercises the most code: tests sweep it.
    test_shapes=(
        {"m": 70, "n": 2 * 100, "k": 608, "group": 32, "epilogue": "silu_mul"},
        {"m": 33, "n": 100, "k": 384, "group": 128, "epilogue": "bias"},
        {"m": 37, "n": 2 * 70, "k": 320, "group": 64, "epilogue": "gelu_mul"},
    ),
    bytes_moved=bytes_moved,
    reference=reference.gemm,
    fuzz_shapes=fuzz_shapes(80),
    oclgrind_shapes=(
        {"m": 9, "n": 37, "k": 128, "group": 32, "epilogue": "none"},
        {"m": 3, "n": 2 * 5, "k": 64, "group": 64, "epilogue": "silu_mul"},
        {"m": 2, "n": 2 * 3, "k": 64, "group": 32, "epilogue": "gelu_mul"},
    ),
    flops=flops,
    compared_kind=True,
)


F16 = Spec(
    params=gemm_q4.F16,
    make_case=_case_maker("f16"),
    programs=_programs("f16"),
    tolerance=TOLERANCE,
    tolerance_why=TOLERANCE_WHY,
    variant_tolerances={"HALF": (8e-3, (
        "fp16 arithmetic: X rounds to half once (≤ u = 2⁻¹¹ ≈ 4.9e-4 of each value) and each centred "
        "product (q − 8)·x once more (≤ u); each output's half sum covers one texel (32 products: ≤ 32u of "
        "their absolute sum at worst, ~6u as a random walk) before it joins an fp32 total scaled by the "
        "group's s, with (m + 8s)·Σx in fp32, so the error does not grow with K. Against max|Y|: measured "
        "1.1e-3 (G = 32) and 1.8e-3 (G = 128) on the test shapes, whose X carries ±40 outliers. 8e-3 = 16u "
        "leaves 4× and still fails a dropped texel (≥ 5e-2 at K ≤ 4096) or group, or a wrong column."))},
    # Off the tile grid: M = 33 and 7 are no multiple of TM, 100 and 60 columns no multiple of TN·WGS.
    test_shapes=(
        {"m": 33, "n": 2 * 60, "k": 352, "group": 32, "epilogue": "silu_mul"},
        {"m": 7, "n": 100, "k": 384, "group": 128, "epilogue": "bias"},
        {"m": 9, "n": 2 * 50, "k": 320, "group": 64, "epilogue": "gelu_mul"},
    ),
    bytes_moved=bytes_moved,
    reference=reference.gemm,
    fuzz_shapes=fuzz_shapes(40),
    # Its smallest test shape, already off the tile grid.
    oclgrind_shapes=({"m": 9, "n": 2 * 50, "k": 320, "group": 64, "epilogue": "gelu_mul"},),
    flops=flops,
    compared_kind=True,
)


# The skinny kernel's shapes, checks and tolerance: the same products and edges. M = 33 runs passes of MB and
# then the remainder's masked passes of 4 (kernels/m_masked_passes.h; every remainder of every MB:
# tests/test_gemm_q4.py); the columns (60 and 100) are no multiple of ROWS·WGS.
LANES = dataclasses.replace(SKINNY, params=gemm_q4.LANES, make_case=_case_maker("lanes"), programs=_programs("lanes"))

# The skinny kernel's shapes, checks and fp32 tolerance, against X rounded as the kernel rounds it
# (I8_TOLERANCE_WHY). M = 33 runs passes of MT and then the remainder's; M = 7 and 9 are off every MT; the
# columns (60, 100, 50) are no multiple of ROWS·WGS; G = 32, 128 and 64 (one texel a group, and several).
I8 = dataclasses.replace(SKINNY, params=gemm_q4.I8, make_case=_case_maker("i8"), programs=_programs("i8"),
                         tolerance_why=I8_TOLERANCE_WHY)
