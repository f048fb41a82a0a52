"""Tuning spec of gemv_q4: the decode-path int4 GEMV (plain, fused QKV with bias, gate-up SiLU·mul or
GELU·mul).

A shape is a dict: ``n`` rows of W (gate-up: 2·I, gate rows then up rows), ``k``, ``group``,
``epilogue`` ("none" | "silu_mul" | "gelu_mul"), ``bias`` (bool), optionally ``parts`` (row counts of matrices
fused along N, e.g. QKV), optionally ``form`` (the int4 scales' form, ``perfx.formats.Q4_PAIRS`` when absent,
as every tuned shape: tests run the others), optionally ``quantizes_x`` (True: the decode step hands this GEMV no
Q8_1 blocks of x, ``perfx.op.quantizes_x``). Timings rotate through copies of the weight past the device's cache
(``copies_past_cache``), as a decode step reads it: from memory.

A set reading x as Q8_1 blocks (the rows layout's I8) is timed as the decode step runs it: the GEMV alone, on
blocks its own quantizing kernel wrote once before (``step_blocks``), and checked through them, so the check
still covers the quantizing. In the decode step the launch before an int4 GEMV writes its x's blocks
(``perfx.model``, ``perfx.mixers.attention``): the norm (or the tail of the GEMV before it) for qkv, gate-up,
the in-projections of the other mixers and the int4 lm_head; the decode attention for o (heads of whole blocks
of 32, no output gate); gate-up's tail for down in the fused step (``perfx.step.fused_step``, the default
where the device's compiler orders the tails' hand-off). The int4 GEMVs that quantize x by a launch of their
own in the step are the short convolution's and the DeltaNet's out-projections, o after a gated attention or
with heads not whole blocks of 32, Gemma 4's per-layer matrices and Gemma 3n's per-layer gate and LAuReL R: their
shapes carry ``quantizes_x``, and an I8 set is timed there with its quantizing launch before each product. So is
down in the unfused step (``PERFX_FUSE=off``, a compiler without the ordered hand-off), but its shape is not
marked: it keys the shipped entries that both steps' down reads (the fused step's tail takes the plain GEMV's set
where it has none of its own, and is handed blocks), and a key changed would orphan them; there the tuner leaves
out a launch the step runs (its cost at the default model's down: ``benchmarks/NOTES.md``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from perfx import reference
from perfx.formats import Q4_PAIRS, Q4Matrix, q4_scale_bytes
from perfx.ops.epilogue import output_rows
from perfx.ops.gemv_q4 import PARAMS, GemvQ4
from perfx.ops.params import Params
from perfx.ops.q4_weight import LAYOUT_ROWS, Q4DeviceWeight, available_paths, image2d_fits
from perfx.tuning.spec import (Case, Spec, cached_per_params, copies_past_cache, epilogue_reference, lazy_copies,
                               rotating_case)


def activations(rng, k: int) -> np.ndarray:
    """x ~ N(0, 1), with one outlier of ±40 in every 256: Llama activations carry a few large channels,
    and the fp16 variants must hold them (their half partial sums would overflow if they could not)."""
    x = rng.standard_normal(k).astype(np.float32)
    x[rng.integers(0, 256)::256] *= 40
    return x


def _outputs(shape) -> int:
    return output_rows(shape["n"], shape.get("epilogue"))


def _weight_bytes(shape) -> int:
    n, k, g = shape["n"], shape["k"], shape["group"]
    scales = q4_scale_bytes(shape.get("form", Q4_PAIRS), n * (k // g))
    return n * k // 2 + scales + (4 * n if shape.get("bias") else 0)


def _bytes_moved(shape) -> int:
    return _weight_bytes(shape) + 4 * shape["k"] + 4 * _outputs(shape)


def read_paths(device, n: int, k: int, layout: int) -> tuple[str, ...]:
    """Every read path a weight of this layout can have here, image2d included where it is a copy: the case
    serves every candidate (a model uploads only what its kernels read, once)."""
    paths = available_paths(device.caps, n, k, layout)
    if layout == LAYOUT_ROWS and "image2d" not in paths and image2d_fits(device.caps, k):
        paths += ("image2d",)
    return paths


def step_blocks(device, x, k: int, wrapper, build_product) -> Callable[[Params, bool], tuple | None]:
    """``blocks(params, fresh)``: x's Q8_1 blocks (K int8 codes, K/32 (step, sum) pairs) for a parameter set whose
    product reads them (``wrapper(params).reads_quantized``; None for the others), written by that set's own
    quantizing kernel into buffers of its own and waited for: once, or again, poisoned first, where ``fresh`` (a
    check's run, so a block the quantizing leaves unwritten or gets wrong shows in the product).
    ``build_product(made)`` builds the set's product on its wrapper first, so that the quantizing comes from the
    product's program as in a model (``GemvQ4.quantize_kernel``), not from a program of its own."""
    def allocate(params):
        return device.empty(k, np.int8), device.empty((k // 32, 2), np.float32), {"written": False}
    held = cached_per_params(allocate)

    def blocks(params: Params, fresh: bool = False):
        made = wrapper(params)
        if not made.reads_quantized:
            return None
        codes, steps, state = held(params)
        if fresh or not state["written"]:
            build_product(made)
            if fresh:
                device.fill(codes, np.int8(127)).wait()
                device.fill(steps, np.float32(np.nan)).wait()
            for event in made.quantize(x, k, (codes, steps))[0]:
                event.wait()
            state["written"] = True
        return codes, steps
    return blocks


def make_case(device, shape, rng) -> Case:
    n, k, group = shape["n"], shape["k"], shape["group"]
    epilogue = shape.get("epilogue", "none")
    parts = shape.get("parts") or (n,)
    assert sum(parts) == n, f"parts {parts} do not add up to n = {n}"
    q4 = Q4Matrix.concat([Q4Matrix.random(p, k, group, rng, form=shape.get("form", Q4_PAIRS)) for p in parts])
    bias = rng.standard_normal(n).astype(np.float32) * 0.1 if shape.get("bias") else None
    x = device.upload(activations(rng, k))
    m = _outputs(shape)
    y = device.poisoned(m, np.float32)

    # Row blocks, so the float64 reference of a 7B gate-up (22016 x 4096) stays at ~64 MB at a time.
    full = np.concatenate([reference.gemv(q4.rows(i, min(i + 2048, n)).dequantize(), x.get())
                           for i in range(0, n, 2048)])
    full = full if bias is None else full + bias
    expected = epilogue_reference(epilogue, full)

    wrapper = cached_per_params(lambda params: GemvQ4(device, params, shape))
    # The weight's copies in each layout, uploaded when a candidate of that layout first reaches them.
    uploaded = cached_per_params(lambda key: lazy_copies(lambda: Q4DeviceWeight.upload(
        device, q4, bias, read_paths(device, n, k, key["LAYOUT"]), layout=key["LAYOUT"])))
    blocks = None if shape.get("quantizes_x") else step_blocks(
        device, x, k, wrapper, lambda made: made.kernel(group, epilogue, k, shape.get("form", Q4_PAIRS)))
    return rotating_case(expected, y, copies_past_cache(device, _weight_bytes(shape)),
                         lambda i, params: wrapper(params).events(uploaded({"LAYOUT": params["LAYOUT"]})(i), x, y,
                                                                  epilogue, quantized=blocks(params) if blocks else None),
                         device=device, prepare=blocks)


def programs(device, shape, params) -> None:
    """The kernels a product at ``params`` runs on ``shape``: the GEMV, and x's quantization with the rows
    layout's I8."""
    wrapper = GemvQ4(device, params, shape)
    wrapper.kernel(shape["group"], shape.get("epilogue", "none"), shape["k"], shape.get("form", Q4_PAIRS))
    if wrapper.reads_quantized:
        wrapper.quantize_kernel()


def fuzz_shapes(st):
    """Any N up to 120 and K of 1–8 groups of 32, 64 or 128: plain (maybe with bias, maybe a fused QKV of
    three parts) or gate-up with either activation."""
    @st.composite
    def shape(draw):
        group = draw(st.sampled_from([32, 64, 128]))
        k = group * draw(st.integers(1, 8))
        n = draw(st.integers(1, 120))
        if draw(st.booleans()):
            epilogue = draw(st.sampled_from(["silu_mul", "gelu_mul"]))
            return {"n": 2 * n, "k": k, "group": group, "epilogue": epilogue, "bias": False}
        drawn = {"n": n, "k": k, "group": group, "epilogue": "none", "bias": draw(st.booleans())}
        if n >= 3 and draw(st.booleans()):  # a fused QKV: three matrices along N
            a = draw(st.integers(1, n - 2))
            b = draw(st.integers(1, n - a - 1))
            drawn["parts"] = (a, b, n - a - b)
        return drawn
    return shape()


# Small off-grid shapes for the simulator: a fused QKV with bias, each gated epilogue.
OCLGRIND_SHAPES = (
    {"n": 13, "k": 320, "group": 64, "epilogue": "none", "bias": True, "parts": (7, 6)},
    {"n": 2 * 7, "k": 192, "group": 32, "epilogue": "silu_mul", "bias": False},
    {"n": 2 * 5, "k": 128, "group": 64, "epilogue": "gelu_mul", "bias": False},
)


def flops(shape) -> int:
    return 2 * shape["n"] * shape["k"]


def describe(s) -> str:
    return (f"{s['n']}x{s['k']} G={s['group']}" + (" +bias" if s.get("bias") else "")
            + (f" {s['epilogue']}" if s.get("epilogue", "none") != "none" else "")
            + (" quantizes x" if s.get("quantizes_x") else ""))


SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    tolerance=1e-4,
    tolerance_why=(
        "fp32 accumulation of K ≤ 4160 products of O(1) terms against a float64 reference: per-group "
        "partial sums of G ≤ 128 terms, then K/G group terms, give a worst-case rounding error of a few "
        "1e-6 of Σ|w·x|; Σ|w·x| is ~10–30× max|y| for random signs, so 1e-4 of max|y| leaves >3× margin "
        "while a single wrong code (|Δw| = s ≈ 0.0025 times |x| ~ 3) or a missing group still shows"),
    variant_tolerances={
        "HALF": (4e-3, (
            "HALF = 1: x rounds to half once (relative ≤ u = 2⁻¹¹ ≈ 4.9e-4) and each centred product (q − 8)·x "
            "once more (≤ u); a half8 lane adds G/8 ≤ 16 of them in half (≤ 16u of their absolute sum at "
            "worst, ~2–4u as a random walk) before fp32 takes over at each group, so nothing builds up across "
            "K. The rounding of x alone is ~u of |y| where one large activation dominates a row: measured "
            "5.0e-4 (G = 64) and 7.1e-4 (G = 128) on the test shapes, whose x carries ±40 outliers. 4e-3 = 8u "
            "leaves 5× over the worst measured and still fails a dropped or doubled group (≥ 3e-2) or a wrong "
            "row")),
        "I8": (5e-2, (
            "I8 = 1: x is quantized to int8 per block of 32 (llama.cpp's Q8_1 activations, with the sum of the "
            "quantized block for the offset term): each value moves by up to half a step, max|x_block|/254, "
            "and the products and sums are then exact (int16, int32) until fp32 takes over per block. For "
            "Gaussian blocks that is ~6e-3 of |y| (rms); a block holding one of the test's ±40 outliers "
            "quantizes its other 31 values 16× more coarsely, and those blocks dominate: measured 1.0e-2 to "
            "2.4e-2 of max|y| over 12 seeds at gate-up 3072×576 (SiLU·mul), 1.6e-2 on the test shapes. 5e-2 "
            "leaves 2× and still fails a dropped block or group (≥ 0.15 at K ≤ 4160) or a wrong row; one wrong "
            "code it does not see, so test_gemv_q4 also checks I8 against the product of the quantized x at "
            "the fp32 tolerance")),
    },
    # Build variants (G and epilogue are defines): N = 1000, K = 4160 (65 groups of 64); a fused QKV with
    # bias; an off-grid matrix, one the decode step hands no blocks of x (``quantizes_x``: I8 sets quantize x
    # themselves); an off-grid gate-up with each activation (SwiGLU, GeGLU).
    test_shapes=(
        {"n": 1000, "k": 4160, "group": 64, "epilogue": "none", "bias": False},
        {"n": 960, "k": 576, "group": 32, "epilogue": "none", "bias": True, "parts": (576, 192, 192)},
        {"n": 37, "k": 576, "group": 32, "epilogue": "none", "bias": False, "quantizes_x": True},
        {"n": 2 * 203, "k": 640, "group": 128, "epilogue": "silu_mul", "bias": False},
        {"n": 2 * 75, "k": 576, "group": 64, "epilogue": "gelu_mul", "bias": False},
    ),
    bytes_moved=_bytes_moved,
    reference=reference.gemv,
    fuzz_shapes=fuzz_shapes,
    oclgrind_shapes=OCLGRIND_SHAPES,
    flops=flops,
    describe=describe,
    programs=programs,
)
