"""Mistral's sliding window in both attention kernels: a position attends to the last W positions only.

Each kernel runs on a cache it filled itself; the answer is the float64 reference attention over the very
rows it stored (fp16), with the window, so only fp32 arithmetic is left (1e-5, as test_attention_decode's
stored-rows check). Windows smaller than a decode partition and a prefill tile, and partitions wholly before
the window (skipped by the combine), are covered; the check can fail (no window gives another answer).
"""

import numpy as np
import pytest

from perfx import reference
from perfx.ops.attention_decode import AttentionDecode
from perfx.ops.attention_prefill import AttentionPrefill
from perfx.ops.kv_cache import KVCache, RopeTable
from perfx.tuning.spec import relative_error

THETA = 10000.0
TOLERANCE = 1e-5


def _rotated_q(qkv_rows, positions, h, d):
    return reference.rope(qkv_rows[:, : h * d].reshape(len(positions), h, d), positions, THETA)


@pytest.mark.parametrize("window, params", [(20, {"BK": 16, "WGS": 32}), (5, {"BK": 32, "WGS": 16}),
                                            (1, {"BK": 16, "WGS": 64}), (0, {"BK": 16, "WGS": 32})])
def test_prefill_attends_to_the_window_only(device, rng, window, params):
    h, hkv, d, m, p0 = 6, 2, 64, 45, 7
    cache = KVCache.allocate(device, 1, hkv, 64, d)
    rope = RopeTable.upload(device, d, 64, THETA)
    op = AttentionPrefill(device, {**params, "VW": 8}, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "window": window})
    earlier = rng.standard_normal((p0, (h + 2 * hkv) * d), dtype=np.float32)   # a previous turn's p0 tokens
    AttentionPrefill(device, None, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d})(device.upload(earlier), device.empty((p0, h * d), np.float32), cache, rope,
                                       0, 0, p0).wait()
    qkv = rng.standard_normal((m, (h + 2 * hkv) * d), dtype=np.float32)
    out = device.poisoned((m, h * d), np.float32)
    op(device.upload(qkv), out, cache, rope, 0, p0, m).wait()
    keys, values = cache.read(device, 0, p0 + m)
    positions = np.arange(p0, p0 + m)
    q = _rotated_q(qkv, positions, h, d)
    want = reference.attention(q, keys, values, positions, window=window).reshape(m, h * d)
    assert relative_error(out.get(), want) <= TOLERANCE
    if window:
        everything = reference.attention(q, keys, values, positions).reshape(m, h * d)
        assert relative_error(out.get(), everything) > 100 * TOLERANCE


@pytest.mark.parametrize("window, part", [(20, 32), (40, 32), (3, 128), (100, 32), (0, 32)])
def test_decode_attends_to_the_window_only(device, rng, window, part):
    """Positions up to 105 with PART 32: with W = 20 the first three partitions lie wholly before the window."""
    h, hkv, d, steps = 6, 2, 64, 106
    cache = KVCache.allocate(device, 1, hkv, steps, d)
    rope = RopeTable.upload(device, d, steps, THETA)
    op = AttentionDecode(device, {"PART": part, "WGS": 64, "VW": 8}, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "positions": steps, "window": window})
    qkv = rng.standard_normal((steps, (h + 2 * hkv) * d), dtype=np.float32)
    out = device.poisoned(h * d, np.float32)
    for pos in range(steps):
        op(device.upload(qkv[pos]), out, cache, rope, 0, pos).wait()
        if pos in (0, 2, 31, 32, 70, steps - 1):
            keys, values = cache.read(device, 0, pos + 1)
            q = _rotated_q(qkv[pos:pos + 1], [pos], h, d)
            want = reference.attention(q, keys, values, [pos], window=window).reshape(h * d)
            assert relative_error(out.get(), want) <= TOLERANCE, pos
    if window and window < steps:
        everything = reference.attention(q, keys, values, [pos]).reshape(h * d)
        assert relative_error(out.get(), everything) > 100 * TOLERANCE


def test_reference_window_is_transformers_mask():
    """Key j is seen from query p when p − W < j ≤ p (transformers' sliding_window_overlay and causal mask)."""
    t = 6
    q = np.zeros((t, 1, 2))          # equal scores: the output is the mean of the visible values
    k = np.zeros((t, 1, 2))
    v = np.arange(t, dtype=np.float64).reshape(t, 1, 1).repeat(2, axis=2)
    out = reference.attention(q, k, v, np.arange(t), window=3)[:, 0, 0]
    np.testing.assert_allclose(out, [0, 0.5, 1, 2, 3, 4])


@pytest.mark.parametrize("built, launched", [(0, 9), (9, 0), (9, None)], ids=["0-then-9", "9-then-0", "9-kept"])
def test_the_launch_names_the_window(device, rng, built, launched):
    """A launch's window replaces the constructor's (None keeps it), in both kernels: one kernel object serves
    Gemma's local (windowed) and global layers."""
    h, hkv, d, m, steps = 4, 2, 64, 30, 40
    want_window = built if launched is None else launched
    cache = KVCache.allocate(device, 1, hkv, steps, d)
    rope = RopeTable.upload(device, d, steps, THETA)
    qkv = rng.standard_normal((steps, (h + 2 * hkv) * d), dtype=np.float32)
    prefill = AttentionPrefill(device, None, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "window": built})
    decode = AttentionDecode(device, {"PART": 32}, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "positions": steps, "window": built})
    out = device.poisoned((m, h * d), np.float32)
    prefill(device.upload(qkv[:m]), out, cache, rope, 0, 0, m, window=launched).wait()
    keys, values = cache.read(device, 0, m)
    positions = np.arange(m)
    q = _rotated_q(qkv[:m], positions, h, d)
    want = reference.attention(q, keys, values, positions, window=want_window)
    assert relative_error(out.get(), want.reshape(m, h * d)) <= TOLERANCE
    out = device.poisoned(h * d, np.float32)
    for pos in range(m, steps):
        decode(device.upload(qkv[pos]), out, cache, rope, 0, pos, window=launched).wait()
    keys, values = cache.read(device, 0, steps)
    q = _rotated_q(qkv[steps - 1:], [steps - 1], h, d)
    want = reference.attention(q, keys, values, [steps - 1], window=want_window).reshape(h * d)
    assert relative_error(out.get(), want) <= TOLERANCE
    other = reference.attention(q, keys, values, [steps - 1], window=9 - want_window).reshape(h * d)
    assert relative_error(out.get(), other) > 100 * TOLERANCE
