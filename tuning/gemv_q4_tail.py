"""Tuning spec of gemv_q4_tail: gemv_q4's rows product with a tail run by its last row set (kernels/gemv_q4_tail.cl).

Its shapes are gemv_q4's (``n``, ``k``, ``group``, ``epilogue``, ``bias``, optionally ``form``) and ``tail``:
"norm" (p = W·x, h = r + p, or with ``post`` h = r + rmsnorm(p)·γ_post, into r; xn = rmsnorm(h)·γ, and with ``q8``
xn's Q8_1 blocks, in y's own order where ``natural``) or "q8" (y's own Q8_1 blocks, in the texel order, or natural).
The decode step runs it for the o and down projections (norm) and gate-up (q8), where the plain step ran an
RMSNorm or a quantizing launch after them (``perfx.step``).

A set reading x as Q8_1 blocks (I8) is timed on blocks written once before, as gemv_q4's (``step_blocks``): in the
fused step the launch before each of these GEMVs writes them (the decode attention for o, the norm in o's tail for
gate-up, gate-up's tail for down), except where the shape carries ``quantizes_x`` (the short convolution's and the
DeltaNet's out-projections, o after a gated attention: ``perfx.op.quantizes_x``), timed with the quantizing launch.
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.formats import Q4_PAIRS, Q4Matrix
from perfx.ops import Q8_NATURAL, Q8_TEXEL
from perfx.ops.gemv_q4_tail import PARAMS, GemvQ4Tail
from perfx.ops.q4_weight import LAYOUT_ROWS, Q4DeviceWeight
from perfx.tuning.gemv_q4 import (SPEC as GEMV_Q4, _outputs, _weight_bytes, activations, describe, flops, read_paths,
                                  step_blocks)
from perfx.tuning.spec import Case, Spec, cached_per_params, copies_past_cache, epilogue_reference, lazy_copies

EPS = 1e-5


def make_case(device, shape, rng) -> Case:
    n, k, group, tail = shape["n"], shape["k"], shape["group"], shape["tail"]
    epilogue, post = shape.get("epilogue", "none"), shape.get("post", False)
    order = (Q8_NATURAL if shape.get("natural") else Q8_TEXEL) if shape.get("q8") or tail == "q8" else 0
    q4 = Q4Matrix.random(n, k, group, rng, form=shape.get("form", Q4_PAIRS))
    bias = rng.standard_normal(n).astype(np.float32) * 0.1 if shape.get("bias") else None
    x = device.upload(activations(rng, k))
    m = _outputs(shape)
    y = device.poisoned(m, np.float32)
    full = reference.gemv(q4.dequantize(), x.get())
    p = epilogue_reference(epilogue, full if bias is None else full + bias)
    expected = {"y": p}
    r = rng.standard_normal(m).astype(np.float32) * 3
    gamma = device.upload(rng.uniform(0.5, 1.5, m).astype(np.float32))
    post_gamma = device.upload(rng.uniform(0.5, 1.5, m).astype(np.float32)) if post else None
    residual, xn = device.upload(r), device.poisoned(m, np.float32)
    blocks = (device.empty(m, np.int8), device.empty((m // 32, 2), np.float32)) if order else None
    if tail == "norm":
        if post:
            h, want = reference.rmsnorm_post_residual(p, r, post_gamma.get(), gamma.get(), EPS)
        else:
            h, want = reference.rmsnorm_residual(p, r, gamma.get(), EPS)
        expected.update(h=h, xn=want)
    if order:
        # the blocks must be a correct rounding of the kernel's own output (reference.q8_1_rounding_excess: 0.0)
        expected["q8_excess"] = np.zeros(1)

    wrapper = cached_per_params(lambda params: GemvQ4Tail(device, params, shape))
    uploaded = lazy_copies(lambda: Q4DeviceWeight.upload(device, q4, bias, read_paths(device, n, k, LAYOUT_ROWS),
                                                            layout=LAYOUT_ROWS))
    copies = copies_past_cache(device, _weight_bytes(shape))
    x_blocks = (lambda params, fresh=False: None) if shape.get("quantizes_x") else step_blocks(
        device, x, k, wrapper, lambda made: made.kernel(group, epilogue, k, shape.get("form", Q4_PAIRS),
                                                        _tail_defines(shape)))
    state = {"i": 0}

    def launch(params):
        weight, quantized = uploaded(state["i"]), x_blocks(params)
        if tail == "q8":
            return wrapper(params).quantize_output(weight, x, y, blocks, order, epilogue, quantized)
        return wrapper(params).norm(weight, x, y, residual, gamma, EPS, xn, post_gamma, blocks, order, quantized)

    def run(params):
        state["i"] = 0
        y.fill(np.float32(np.nan))
        xn.fill(np.float32(np.nan))
        residual.set(r)   # the residual is updated in place: restore it first
        if order:
            blocks[0].set(np.full(m, 127, np.int8))
            blocks[1].set(np.full((m // 32, 2), np.nan, np.float32))
        x_blocks(params, True)
        for event in launch(params):
            event.wait()
        out = {"y": y.get()}
        if tail == "norm":
            out.update(h=residual.get(), xn=xn.get())
        if order:
            quantized = out["xn"] if tail == "norm" else out["y"]
            out["q8_excess"] = np.array([reference.q8_1_rounding_excess(quantized, blocks[0].get(), blocks[1].get(),
                                                                        order == Q8_TEXEL)])
        return out

    def rotate():
        state["i"] = (state["i"] + 1) % copies

    return Case(expected=expected, run=run, launch=launch, rotate=rotate)


def programs(device, shape, params) -> None:
    """The kernel a run of ``params`` builds: the product with the shape's tail (x's own quantizing with I8)."""
    wrapper = GemvQ4Tail(device, params, shape)
    wrapper.kernel(shape["group"], shape.get("epilogue", "none"), shape["k"], shape.get("form", Q4_PAIRS),
                   _tail_defines(shape))
    if wrapper.reads_quantized:
        wrapper.quantize_kernel()


def _tail_defines(shape) -> tuple:
    """The tail's build defines at ``shape``, as a run of the case builds them."""
    tail, order = shape["tail"], Q8_NATURAL if shape.get("natural") else Q8_TEXEL
    order = order if shape.get("q8") or tail == "q8" else 0
    return ("TAIL", 1 if tail == "norm" else 2), ("POST", int(bool(shape.get("post")))), ("Q8X", order)


def _bytes_moved(shape) -> int:
    m = _outputs(shape)
    # the product's weight, x and y; the tail reads y again and, for a norm, reads and writes r, writes xn, reads γ
    # (and γ_post); blocks: m codes and m/32 (step, sum) pairs
    tail = 4 * m * (4 + bool(shape.get("post"))) if shape["tail"] == "norm" else 4 * m
    blocks = m + m // 4 if shape.get("q8") or shape["tail"] == "q8" else 0
    return _weight_bytes(shape) + 4 * shape["k"] + 4 * m + tail + blocks


def fuzz_shapes(st):
    """Any N up to 160 and K of 1–8 groups: a norm tail (maybe post, maybe blocks where N is whole blocks), or a
    gate-up with its output's blocks."""
    @st.composite
    def shape(draw):
        group = draw(st.sampled_from([32, 64, 128]))
        k = group * draw(st.integers(1, 8))
        if draw(st.booleans()):
            half = 32 * draw(st.integers(1, 5))
            return {"n": 2 * half, "k": k, "group": group, "epilogue": draw(st.sampled_from(["silu_mul", "gelu_mul"])),
                    "bias": False, "tail": "q8", "natural": draw(st.booleans())}
        n = draw(st.integers(1, 160))
        drawn = {"n": n, "k": k, "group": group, "epilogue": "none", "bias": draw(st.booleans()), "tail": "norm",
                 "post": draw(st.booleans())}
        if n % 32 == 0 and draw(st.booleans()):
            drawn.update(q8=True, natural=draw(st.booleans()))
        return drawn
    return shape()


SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    programs=programs,
    tolerance=1e-4,
    tolerance_why=(
        "the product is gemv_q4's (its bound: 1e-4 of max|y| for fp32 accumulation of K ≤ 4160 products); the norm "
        "tail adds rmsnorm's fp32 rounding (~1e-6, two chained norms with post: twice that) over an h whose p part "
        "carries the product's error, so 1e-4 of each output's max holds while a missed row set (a poisoned NaN), "
        "a wrong γ, eps or row scale shows far above it. The Q8_1 blocks have no tolerance of their own: q8_excess, "
        "their distance from a correct rounding of the kernel's own output, must be 0"),
    variant_tolerances=GEMV_Q4.variant_tolerances,   # the product's fp16 and int8-activation forms, as gemv_q4's
    # An off-grid norm (N = 37: no whole blocks, not a multiple of any ROWS·WGR; x not handed as blocks, so I8 sets
    # quantize it themselves), one with bias and its blocks
    # (N = 96), the post-norm form in y's own order, and gate-up with each activation and its output's blocks.
    test_shapes=(
        {"n": 37, "k": 576, "group": 32, "epilogue": "none", "bias": False, "tail": "norm", "quantizes_x": True},
        {"n": 96, "k": 640, "group": 128, "epilogue": "none", "bias": True, "tail": "norm", "q8": True},
        {"n": 160, "k": 1344, "group": 64, "epilogue": "none", "bias": False, "tail": "norm", "post": True,
         "q8": True, "natural": True},
        {"n": 2 * 224, "k": 576, "group": 32, "epilogue": "silu_mul", "bias": False, "tail": "q8"},
        {"n": 2 * 96, "k": 640, "group": 128, "epilogue": "gelu_mul", "bias": False, "tail": "q8", "natural": True},
    ),
    bytes_moved=_bytes_moved,
    reference=reference.gemv,
    fuzz_shapes=fuzz_shapes,
    oclgrind_shapes=(
        {"n": 2 * 96, "k": 128, "group": 64, "epilogue": "silu_mul", "bias": False, "tail": "q8"},
        {"n": 45, "k": 192, "group": 64, "epilogue": "none", "bias": True, "tail": "norm", "post": True},
        {"n": 64, "k": 128, "group": 32, "epilogue": "none", "bias": False, "tail": "norm", "q8": True},
    ),
    flops=flops,
    describe=lambda s: describe(s) + f" tail={s['tail']}" + (" post" if s.get("post") else "")
    + (" +q8" if s.get("q8") else "") + (" natural" if s.get("natural") else ""),
)
