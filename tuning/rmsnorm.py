"""Tuning spec of rmsnorm: h = x + r (written back into r), y = rmsnorm(h)·γ; or plain y = rmsnorm(x)·γ; or
Gemma's sandwich norms, h = r + rmsnorm(x)·γ_post (written back into r), y = rmsnorm(h)·γ_next.

Shape: m rows, k columns, residual (True: a fused residual entry point, False: plain), optionally post (True,
with residual: the post-norm residual entry point, ``RMSNorm.post_residual``) and q8 (True, K a multiple of 32:
y also written as Q8_1 blocks for the GEMVs' int8 activations, as the decode step runs the norms: in an int4
texel's order, or with natural (True) in y's own, for the int8 GEMV).
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops import Q8_NATURAL, Q8_TEXEL
from perfx.ops.rmsnorm import PARAMS, RMSNorm
from perfx.tuning.spec import Case, Spec, cached_per_params

EPS = 1e-5
COPIES = 3  # input copies cycled by Case.rotate: a row of 4096 floats would otherwise stay in cache


def make_case(device, shape, rng) -> Case:
    m, k, residual, post = shape["m"], shape["k"], shape["residual"], shape.get("post", False)
    q8, natural = shape.get("q8", False), shape.get("natural", False)
    order = {"order": Q8_NATURAL if natural else Q8_TEXEL}
    assert residual or not post, "the post-norm entry point adds into the residual stream: residual True"
    x = rng.standard_normal((m, k), dtype=np.float32)
    r = rng.standard_normal((m, k), dtype=np.float32) * 3
    gamma = rng.uniform(0.5, 1.5, k).astype(np.float32)
    next_gamma = rng.uniform(0.5, 1.5, k).astype(np.float32)   # post only: the next norm's γ
    inputs = [tuple(device.upload(a) for a in (x, r, gamma, next_gamma)) for _ in range(COPIES)]
    y = device.empty((m, k), np.float32)
    poison = np.full((m, k), np.nan, np.float32)
    quantized = (device.empty(m * k, np.int8), device.empty((m * k // 32, 2), np.float32)) if q8 else None
    wrapper = cached_per_params(lambda params: RMSNorm(device, params))
    state = {"copy": 0}
    if post:
        h, want = reference.rmsnorm_post_residual(x, r, gamma, next_gamma, EPS)
        expected = {"h": h, "y": want}
    elif residual:
        h, want = reference.rmsnorm_residual(x, r, gamma, EPS)
        expected = {"h": h, "y": want}
    else:
        expected = {"y": reference.rmsnorm(x, gamma, EPS)}
    if q8:
        # the blocks must be a correct rounding of the kernel's own y (reference.q8_1_rounding_excess: 0.0)
        expected["q8_excess"] = np.zeros(1)

    def launch(params):
        xd, rd, gd, nd = inputs[state["copy"]]
        if post:
            return [wrapper(params).post_residual(xd, rd, gd, nd, y, m, k, EPS, quantized=quantized, **order)]
        if residual:
            return [wrapper(params).residual(xd, rd, gd, y, m, k, EPS, quantized=quantized, **order)]
        return [wrapper(params).plain(xd, gd, y, m, k, EPS, quantized=quantized, **order)]

    def run(params):
        y.set(poison)
        if q8:
            quantized[0].set(np.full(m * k, 127, np.int8))
            quantized[1].set(np.full((m * k // 32, 2), np.nan, np.float32))
        inputs[state["copy"]][1].set(r)  # the residual is updated in place: restore it first
        for event in launch(params):
            event.wait()
        out = {"y": y.get()}
        if q8:
            out["q8_excess"] = np.array([reference.q8_1_rounding_excess(out["y"], quantized[0].get(),
                                                                        quantized[1].get(), not natural)])
        if residual:
            out["h"] = inputs[state["copy"]][1].get()
        return out

    def rotate():
        state["copy"] = (state["copy"] + 1) % COPIES

    return Case(expected=expected, run=run, launch=launch, rotate=rotate)


def programs(device, shape, params) -> None:
    """The kernels of every entry point (the wrapper builds them at once), and the entry point's quantizing form
    where the shape writes y as Q8_1 blocks."""
    wrapper = RMSNorm(device, params)
    if shape.get("q8"):
        name = "rmsnorm_post_residual" if shape.get("post") else "rmsnorm_residual" if shape["residual"] else "rmsnorm"
        wrapper.kernel(name, Q8_NATURAL if shape.get("natural") else Q8_TEXEL)


def _bytes(shape) -> int:
    m, k = shape["m"], shape["k"]
    # residual: read x and r, write r and y; plain: read x, write y. γ once (post: both γ). q8: K codes and K/32
    # (step, sum) pairs a row written too.
    quantized = m * (k + k // 4) if shape.get("q8") else 0
    return 4 * m * k * (4 if shape["residual"] else 2) + 4 * k * (2 if shape.get("post") else 1) + quantized


def fuzz_shapes(st):
    """1–4 rows of K up to 1500, plain or with the residual, maybe the post-norm form."""
    @st.composite
    def shape(draw):
        drawn = {"m": draw(st.integers(1, 4)), "k": draw(st.integers(1, 1500)), "residual": draw(st.booleans())}
        if drawn["residual"] and draw(st.booleans()):
            drawn["post"] = True   # the post-norm form, Gemma's sandwich norm
        if draw(st.booleans()):   # y quantized too: K whole blocks of 32
            drawn.update(k=32 * draw(st.integers(1, 47)), q8=True, natural=draw(st.booleans()))
        return drawn
    return shape()


SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    programs=programs,
    tolerance=1e-5,
    tolerance_why=("fp32 against float64: h = x + r is one rounding (2⁻²⁴); the sum of squares runs in "
                   "WGS·VW partial sums then a tree, its error stays near log2(K)·2⁻²⁴; sqrt and the "
                   "division add a few ulp: ~1e-6 relative at worst (the post-norm form chains two norms: "
                   "twice that), 1e-5 leaves a margin while a wrong eps, a missed column, a swapped γ or a "
                   "row normalised by another row's scale is far above it. The Q8_1 blocks (q8) have no "
                   "tolerance of their own: q8_excess, their distance from a correct rounding of the kernel's "
                   "own y, must be 0"),
    test_shapes=(
        {"m": 1, "k": 4096, "residual": True},
        {"m": 3, "k": 1000, "residual": True},   # prefill rows, K off every vector and work-group multiple
        {"m": 2, "k": 576, "residual": False, "q8": True},   # the decode step's form, its first norm
        {"m": 2, "k": 7, "residual": True},      # K below one vector: tail only, most work-items idle
        {"m": 3, "k": 1003, "residual": True, "post": True},   # Gemma's sandwich norm, K off every multiple
        {"m": 1, "k": 5, "residual": True, "post": True},
        # Gemma 3's hidden, quantized in x's order for its int8 GEMVs
        {"m": 3, "k": 640, "residual": True, "post": True, "q8": True, "natural": True},
        {"m": 1, "k": 32, "residual": True, "q8": True},   # one block: most work-items idle
    ),
    bytes_moved=_bytes,
    # Each case compares with rmsnorm itself or one of its fused forms, rmsnorm_residual and
    # rmsnorm_post_residual, both built on it.
    reference=reference.rmsnorm,
    fuzz_shapes=fuzz_shapes,
    oclgrind_shapes=(
        {"m": 2, "k": 203, "residual": True},
        {"m": 1, "k": 7, "residual": False},
        {"m": 2, "k": 37, "residual": True, "post": True},
        {"m": 2, "k": 96, "residual": True, "q8": True},
        {"m": 1, "k": 64, "residual": False, "q8": True, "natural": True},
    ),
    flops=lambda s: 4 * s["m"] * s["k"],
)
