"""Tuning specs of Gated DeltaNet: ``gated_delta_net_recurrent`` (token by token, decode) and
``gated_delta_net_chunked`` (chunks, prefill), both against the float64 token-by-token recurrence.

Shape keys: n_k_heads, n_v_heads, d_k, d_v, tokens, optionally head_map ("tile" | "interleave"), raw_gates
(True: a and b with dt_bias and ssm_a instead of g and β) and qkv_offset (where token 0's [q | k | v]
starts). Each token's row is [q | k | v | g | β] in one buffer (the wrapper's gates=None), rows two floats
apart beyond that width so the strides are exercised. The state starts random (a prefix already seen) and is
checked with the outputs; ``run`` restores it first, since the kernels update it in place.
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops.gated_delta_net import (CHUNKED_PARAMS, RECURRENT_PARAMS, GatedDeltaNetChunked,
                                      GatedDeltaNetRecurrent)
from perfx.tuning.spec import Case, Spec, cached_per_params

EPS = 1e-6
ROW_GAP = 2  # floats between one token's [q | k | v | gates] and the next


def qkv_size(shape) -> int:
    return 2 * shape["n_k_heads"] * shape["d_k"] + shape["n_v_heads"] * shape["d_v"]


def random_gates(rng, tokens: int, n_v_heads: int, raw: bool) -> tuple[np.ndarray, dict]:
    """(T, 2·Hv) float32 gates and, raw, the dt_bias and ssm_a they need. Realistic ranges: α = exp(g) over
    [0.02, 1) (a few heads forget fast, most keep nearly everything: α near 1), β over (0.05, 0.95)."""
    if not raw:
        slow = rng.random((tokens, n_v_heads)) < 0.5
        size = (tokens, n_v_heads)
        alpha = np.where(slow, rng.uniform(0.9, 0.999, size), rng.uniform(0.02, 0.9, size))
        beta = rng.uniform(0.05, 0.95, (tokens, n_v_heads))
        return np.concatenate([np.log(alpha), beta], axis=1).astype(np.float32), {}
    # a and b as projections give them; dt_bias and ssm_a = −exp(A_log) as a checkpoint holds them
    a = rng.standard_normal((tokens, n_v_heads)) * 2
    b = rng.standard_normal((tokens, n_v_heads)) * 2
    extra = {"dt_bias": rng.uniform(-2.0, 2.0, n_v_heads).astype(np.float32),
             "ssm_a": -np.exp(rng.uniform(-3.0, 1.0, n_v_heads)).astype(np.float32)}
    return np.concatenate([a, b], axis=1).astype(np.float32), extra


def expected(shape, rows: np.ndarray, state: np.ndarray, extra: dict) -> dict[str, np.ndarray]:
    """The float64 outputs (T, Hv·d_v) and final state of the token rows [q | k | v | gates]."""
    hk, hv, dk, dv = (shape[key] for key in ("n_k_heads", "n_v_heads", "d_k", "d_v"))
    t, size = rows.shape[0], qkv_size(shape)
    q = rows[:, :hk * dk].reshape(t, hk, dk)
    k = rows[:, hk * dk:2 * hk * dk].reshape(t, hk, dk)
    v = rows[:, 2 * hk * dk:size].reshape(t, hv, dv)
    g, beta = rows[:, size:size + hv], rows[:, size + hv:size + 2 * hv]
    if shape.get("raw_gates"):
        g, beta = reference.gated_delta_gates(g, beta, extra["dt_bias"], extra["ssm_a"])
    out, final = reference.gated_delta_net(q, k, v, g, beta, state, shape.get("head_map", "tile"), eps=EPS)
    return {"out": out.reshape(t, hv * dv), "state": final}


def make_case_for(wrapper_class):
    def make_case(device, shape, rng) -> Case:
        hv, dk, dv, tokens = shape["n_v_heads"], shape["d_k"], shape["d_v"], shape["tokens"]
        offset, size = shape.get("qkv_offset", 0), qkv_size(shape)
        stride = size + 2 * hv + ROW_GAP
        gates, extra = random_gates(rng, tokens, hv, bool(shape.get("raw_gates")))
        rows = np.full((tokens, stride), np.nan, np.float32)   # the gaps stay NaN: a kernel reading them fails
        rows[:, :size] = rng.standard_normal((tokens, size))
        rows[:, size:size + 2 * hv] = gates
        flat = np.concatenate([rng.standard_normal(offset).astype(np.float32), rows.reshape(-1)[:-ROW_GAP]])
        state0 = (rng.standard_normal((hv, dv, dk)) * 0.3).astype(np.float32)
        want = expected(shape, rows[:, :size + 2 * hv], state0, extra)
        qkv_dev, state = device.upload(flat), device.upload(state0)
        out = device.poisoned((tokens, hv * dv), np.float32)
        extra_dev = {name: device.upload(value) for name, value in extra.items()}
        op = cached_per_params(lambda params: wrapper_class(device, params, shape))

        def launch(params):
            return [op(params)(qkv_dev, None, state, out, tokens, qkv_offset=offset, qkv_stride=stride,
                               eps=EPS, **extra_dev)]

        def run(params):
            state.set(state0)
            out.fill(np.float32(np.nan))
            for event in launch(params):
                event.wait()
            return {"out": out.get(), "state": state.get()}

        return Case(expected=want, run=run, launch=launch)
    return make_case


def bytes_moved(shape) -> int:
    """The state read and written once, each token's inputs read and outputs written once."""
    hv, dk, dv, t = shape["n_v_heads"], shape["d_k"], shape["d_v"], shape["tokens"]
    return 8 * hv * dv * dk + 4 * t * (qkv_size(shape) + 2 * hv + hv * dv)


def recurrent_flops(shape) -> int:
    # per token and state element: S·k, S·q and the update, three multiply-adds
    return 6 * shape["tokens"] * shape["n_v_heads"] * shape["d_v"] * shape["d_k"]


def chunked_flops(shape, chunk: int = 16) -> int:
    # per chunk of C and head: L and P (2·C²·d_k multiply-adds, once a head), each row's k̂·S, q̂·S and update
    # (3·C·d_k) and its substitution and outputs (C²); counted once a head, not once per work-group
    hv, dk, dv, t = shape["n_v_heads"], shape["d_k"], shape["d_v"], shape["tokens"]
    return 2 * hv * (t * 2 * chunk * dk + t * dv * (3 * dk + chunk))


TOLERANCE = 1e-5
TOLERANCE_WHY = (
    "fp32 against float64 on random q, k, v, a random starting state, α over [0.02, 1) and β over "
    "(0.05, 0.95): each token rounds d_k-long dot products (~√d_k·2⁻²⁴ relative) and the update; the "
    "recurrence does not amplify them (α ≤ 1 and I − β·k̂k̂ᵀ is a contraction for β in (0, 1)), so over "
    "T ≤ 70 tokens outputs and state stay near 1e-7 relative; the chunked form adds the exponentials of the "
    "prefix sums γ and a forward substitution, errors of the same order (measured ≤ 1.2e-6 over both kernels, "
    "every parameter set and test shape). 1e-5 leaves margin while a wrong head map (~1), a skipped norm "
    "(≫ 1e-2), a decay applied once too often (α ≥ 0.02: ≥ 1e-2) or one token dropped (≥ 1e-2) is far above it."
)

TEST_SHAPES = (
    # GQA 3 in the tiled order; T = 37 leaves a tail of 5 after chunks of 8, 16 or 32 and is below 64; d_k and
    # d_v off every lane and row multiple. The first shape is the one every parameter set runs on.
    {"n_k_heads": 2, "n_v_heads": 6, "d_k": 40, "d_v": 24, "tokens": 37, "qkv_offset": 3},
    {"n_k_heads": 2, "n_v_heads": 2, "d_k": 64, "d_v": 64, "tokens": 1},    # a decode step
    {"n_k_heads": 1, "n_v_heads": 2, "d_k": 128, "d_v": 128, "tokens": 5, "head_map": "interleave",
     "raw_gates": True},
    {"n_k_heads": 2, "n_v_heads": 4, "d_k": 24, "d_v": 40, "tokens": 70, "head_map": "interleave"},
)


def fuzz_shapes(st):
    """q/k heads, v heads (a GQA ratio up to 4), head sizes off every lane and row multiple, up to 80 tokens
    (several chunks of every size, or less than one), either head map, either gate form, an offset."""
    @st.composite
    def shape(draw):
        hk = draw(st.integers(1, 3))
        return {"n_k_heads": hk, "n_v_heads": hk * draw(st.integers(1, 4)), "d_k": draw(st.integers(1, 160)),
                "d_v": draw(st.integers(1, 160)), "tokens": draw(st.integers(1, 80)),
                "head_map": draw(st.sampled_from(["tile", "interleave"])), "raw_gates": draw(st.booleans()),
                "qkv_offset": draw(st.integers(0, 9))}
    return shape()


# Oclgrind: three chunks of 8 (two of 16) with a tail, GQA 2, d_k and d_v off the lane and row multiples.
OCLGRIND_SHAPES = ({"n_k_heads": 1, "n_v_heads": 2, "d_k": 12, "d_v": 20, "tokens": 19, "qkv_offset": 1},)


def describe(shape) -> str:
    text = (f"Hk={shape['n_k_heads']} Hv={shape['n_v_heads']} dk={shape['d_k']} dv={shape['d_v']} "
            f"T={shape['tokens']}")
    return text + "".join(f" {key}={shape[key]}" for key in ("head_map", "raw_gates", "qkv_offset")
                          if key in shape)


RECURRENT = Spec(
    params=RECURRENT_PARAMS,
    reference=reference.gated_delta_net,
    fuzz_shapes=fuzz_shapes,
    oclgrind_shapes=OCLGRIND_SHAPES,
    make_case=make_case_for(GatedDeltaNetRecurrent),
    programs=lambda device, shape, params: GatedDeltaNetRecurrent(device, params, shape),
    tolerance=TOLERANCE,
    tolerance_why=TOLERANCE_WHY,
    test_shapes=TEST_SHAPES,
    bytes_moved=bytes_moved,
    flops=recurrent_flops,
    describe=describe,
)

CHUNKED = Spec(
    params=CHUNKED_PARAMS,
    reference=reference.gated_delta_net,
    fuzz_shapes=fuzz_shapes,
    oclgrind_shapes=OCLGRIND_SHAPES,
    make_case=make_case_for(GatedDeltaNetChunked),
    programs=lambda device, shape, params: GatedDeltaNetChunked(device, params, shape),
    tolerance=TOLERANCE,
    tolerance_why=TOLERANCE_WHY,
    variant_tolerances={"HALF2": (3e-3, (
        "HALF2 = 1: k̂ and q̂ are rounded to fp16 in the tiles (≤ 2⁻¹¹ = 4.9e-4 of each element; the state, u "
        "and all arithmetic stay fp32), so L, P, k̂·S, q̂·S and the update each move by about that much "
        "relative, and the contraction keeps it from growing over chunks: measured 1.9e-4–3.6e-4 on outputs "
        "and state over the test shapes. 3e-3 leaves margin; the wrong maths of TOLERANCE_WHY stays ≥ 1e-2"))},
    test_shapes=TEST_SHAPES,
    bytes_moved=bytes_moved,
    flops=chunked_flops,
    describe=describe,
)
