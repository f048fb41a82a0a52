"""short_conv: every parameter set at a test shape, each shape at the defaults, against the float64 reference,
the reference against PyTorch's definition written out, prefill = token by token, resuming from the ring, and
bad input."""

import numpy as np
import pytest

from helpers.spec_checks import assert_planned_sets, swept
from perfx import reference
from perfx.errors import PerfxError
from perfx.ops.short_conv import ConvHistory, ShortConv
from perfx.tuning.short_conv import SPEC
from perfx.tuning.spec import relative_error


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(SPEC), ids=[SPEC.describe(s) for s in SPEC.test_shapes])
def test_every_parameter_set(device, rng, index):
    assert_planned_sets(SPEC, device, index, rng)


def test_reference_is_a_padded_conv1d(rng):
    """The reference against LFM2's slow_forward written out: conv1d(B·x) with L − 1 zeros in front, kept to m
    positions, times C; and a sequence split in two with the first half's state equals it whole."""
    h, length, m = 5, 3, 9
    x = rng.standard_normal((m, 3 * h))
    w = rng.standard_normal((h, length))
    b, c, v = x[:, :h], x[:, h:2 * h], x[:, 2 * h:]
    padded = np.concatenate([np.zeros((length - 1, h)), b * v])
    want = c * np.array([[np.dot(w[ch], padded[t:t + length, ch]) for ch in range(h)] for t in range(m)])
    whole, state = reference.short_conv(x, w)
    np.testing.assert_allclose(whole, want, rtol=1e-12, atol=1e-12)
    first, mid = reference.short_conv(x[:4], w)
    second, end = reference.short_conv(x[4:], w, mid)
    np.testing.assert_allclose(np.concatenate([first, second]), whole, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(end, state, rtol=1e-12, atol=1e-12)


def test_prefill_then_decode_and_resume_from_the_ring(device, rng):
    """Positions 0..9 in one launch equal 0..5 then one at a time; resuming at 7 after reaching 10 (a rolled-back
    draft) gives position 7's output again, from the ring alone."""
    h, length, m = 70, 3, 10
    x = rng.standard_normal((m, 3 * h)).astype(np.float32)
    w = rng.standard_normal((h, length)).astype(np.float32)
    want, _ = reference.short_conv(x, w)
    op = ShortConv(device, shape={"l": length})
    rings = ConvHistory(device, 1, h)
    y = device.empty((m, h), np.float32)
    op(device.upload(x), device.upload(w), rings, 0, y, m, 0).wait()
    assert relative_error(y.get(), want) <= SPEC.tolerance
    w_d, one = device.upload(w), device.empty((1, h), np.float32)
    op(device.upload(x[:6]), w_d, rings, 0, y, 6, 0).wait()
    for pos in range(6, m):
        op(device.upload(x[pos:pos + 1]), w_d, rings, 0, one, 1, pos).wait()
        assert relative_error(one.get()[0], want[pos]) <= SPEC.tolerance, pos
    assert rings.resumable(length, last=m - 1, at=7) and not rings.resumable(length, last=m - 1, at=m + 1)
    op(device.upload(x[7:8]), w_d, rings, 0, one, 1, 7).wait()
    assert relative_error(one.get()[0], want[7]) <= SPEC.tolerance
    assert not rings.resumable(length, last=200, at=100)   # overwritten since


def test_errors(device):
    with pytest.raises(PerfxError, match="length 9 is not supported"):
        ShortConv(device, shape={"l": 9})
    with pytest.raises(PerfxError, match="activation"):
        ShortConv(device, shape={"l": 3, "gated": True, "act": "silu"})
    op, rings = ShortConv(device, shape={"l": 3}), ConvHistory(device, 2, 16)
    small = device.empty(16, np.float32)
    with pytest.raises(PerfxError, match="x must hold 2×48"):
        op(small, small, rings, 0, small, 2, 0)
    with pytest.raises(PerfxError, match="layer 2 is outside"):
        op(small, small, rings, 2, small, 1, 0)
