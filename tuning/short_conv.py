"""Tuning spec of short_conv: LFM2's gated short convolution (and the plain form) over a history ring.

Shape: ``h`` channels, ``l`` the convolution's length, ``m`` positions from ``pos`` (positions before ``pos``
come from the ring, filled with earlier u), ``gated`` (True: [B | C | x] rows) and ``act`` ("none", "silu";
ungated only), optionally ``rows`` (the ring's R, default the model's).
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops.short_conv import HISTORY_ROWS, PARAMS, ConvHistory, ShortConv
from perfx.tuning.spec import Case, Spec, cached_per_params

LAYERS = 2   # the case runs the second layer of two, so a ring offset that is off shows


def make_case(device, shape, rng) -> Case:
    h, length, m, pos = shape["h"], shape["l"], shape["m"], shape["pos"]
    gated, act = shape.get("gated", True), shape.get("act", "none")
    rows = shape.get("rows", HISTORY_ROWS)
    x = rng.standard_normal((m, (3 if gated else 1) * h)).astype(np.float32)
    weight = (rng.standard_normal((h, length)) / np.sqrt(length)).astype(np.float32)
    # The ring holds u of earlier positions (random values) and unrelated rows around them.
    ring = rng.standard_normal((LAYERS, rows, h)).astype(np.float32)
    history = np.zeros((length - 1, h))
    for j in range(1, length):
        if pos - j >= 0:
            history[length - 1 - j] = ring[1, (pos - j) % rows]
    want, _ = reference.short_conv(x, weight, history, gated, act)
    u = x[:, :h] * x[:, 2 * h:] if gated else x
    expected_ring = ring.copy()
    for t in range(m):
        expected_ring[1, (pos + t) % rows] = u[t]
    rings = ConvHistory(device, LAYERS, h, rows)
    x_d, w_d, y = device.upload(x), device.upload(weight), device.empty((m, h), np.float32)
    wrapper = cached_per_params(lambda params: ShortConv(device, params, shape))

    def launch(params):
        return [wrapper(params)(x_d, w_d, rings, 1, y, m, pos)]

    def run(params):
        device.write(rings.buffer, ring)
        y.fill(np.float32(np.nan))
        for event in launch(params):
            event.wait()
        out = device.read(np.empty_like(ring), rings.buffer)
        return {"y": y.get(), "ring": out}

    return Case(expected={"y": want, "ring": expected_ring}, run=run, launch=launch)


def _bytes_moved(shape) -> int:
    h, m = shape["h"], shape["m"]
    width = 3 if shape.get("gated", True) else 1
    return 4 * (m * width * h + m * h + h * shape["l"] + shape["l"] * h + m * h)


def fuzz_shapes(st):
    """Channels off every work-group multiple, lengths 2..8, runs of positions that start at 0, straddle the
    ring's wrap or sit far past it, both forms."""
    @st.composite
    def shape(draw):
        gated = draw(st.booleans())
        return {"h": draw(st.integers(1, 300)), "l": draw(st.integers(2, 8)), "m": draw(st.integers(1, 20)),
                "pos": draw(st.sampled_from([0, 1, 2, 60, 63, 64, 200])), "gated": gated,
                "act": "none" if gated else draw(st.sampled_from(["none", "silu"]))}
    return shape()


SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    programs=lambda device, shape, params: ShortConv(device, params, shape),
    reference=reference.short_conv,
    fuzz_shapes=fuzz_shapes,
    # Oclgrind interprets every work-item: a few channels past one work-group, the ring wrapping
    oclgrind_shapes=(
        {"h": 70, "l": 3, "m": 4, "pos": 62, "gated": True},
        {"h": 33, "l": 4, "m": 2, "pos": 1, "gated": False, "act": "silu"},
    ),
    tolerance=1e-5,
    tolerance_why=(
        "each output is one product (gated) and a sum of L ≤ 8 fp32 products against a float64 reference: a "
        "few ulp (≤ 1e-6) of the largest term, and the ring rows are copied, so exact; 1e-5 of max|y| leaves "
        "10× and still fails a tap applied to the wrong position (a relative change of O(1/L)) or a missing C"),
    test_shapes=(
        {"h": 200, "l": 3, "m": 7, "pos": 0, "gated": True},          # the start: no history
        {"h": 200, "l": 3, "m": 1, "pos": 1, "gated": True},          # decode, one position of history
        {"h": 131, "l": 3, "m": 5, "pos": 70, "gated": True, "rows": 64},   # the ring wraps inside the launch
        {"h": 96, "l": 4, "m": 9, "pos": 3, "gated": False, "act": "silu"},  # Qwen3.5's form
        {"h": 64, "l": 2, "m": 1, "pos": 500, "gated": False, "act": "none"},
    ),
    bytes_moved=_bytes_moved,
    flops=lambda s: 2 * s["h"] * s["m"] * (s["l"] + 1),
    describe=lambda s: (f"H={s['h']} L={s['l']} m={s['m']} pos={s['pos']}" + ("" if s.get("gated", True)
                                                                            else f" plain {s.get('act', 'none')}")),
)
