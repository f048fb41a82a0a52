"""attention_prefill: causal RoPE + KV append + flash attention against perfx.reference, every parameter set."""

import numpy as np
import pytest

from helpers.spec_checks import assert_every_parameter_set
from perfx import reference
from perfx.errors import PerfxError
from perfx.ops.attention_prefill import AttentionPrefill
from perfx.ops.kv_cache import KVCache, RopeTable
from perfx.runtime import Device, Limits
from perfx.tuning.attention_prefill import LAYER, SPEC, THETA
from perfx.tuning.spec import relative_error


def check(case, params):
    errors = case.errors(params)
    assert all(e <= SPEC.tolerance for e in errors.values()), f"{params}: {errors} > {SPEC.tolerance}"
    return errors


@pytest.mark.parametrize("shape", SPEC.test_shapes, ids=SPEC.describe)
def test_every_candidate(device, rng, shape):
    assert SPEC.defaults() in SPEC.candidates(shape, device.caps)
    assert_every_parameter_set(SPEC, device, shape, rng)


# The brief's combinations at the defaults: M ∈ {2, 7, 32, 33, 128, 300}, p0 ∈ {0, 5, 100}, GQA ratios
# 1, 3 and 4, head_dim 64 and 128 (every case runs at layer 1 of a two-layer cache).
SHAPES = [
    dict(n_heads=4, n_kv_heads=4, head_dim=64, m=2, p0=100),
    dict(n_heads=9, n_kv_heads=3, head_dim=64, m=32, p0=0),
    dict(n_heads=8, n_kv_heads=2, head_dim=128, m=7, p0=5),
    dict(n_heads=6, n_kv_heads=2, head_dim=64, m=128, p0=5),
    dict(n_heads=4, n_kv_heads=1, head_dim=128, m=300, p0=100),
    dict(n_heads=8, n_kv_heads=8, head_dim=128, m=300, p0=0),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: SPEC.describe(s))
def test_shapes_at_defaults(device, rng, shape):
    case = SPEC.make_case(device, shape, rng)
    check(case, SPEC.defaults())
    # Nothing past the prompt is written, nor anything in the other layer.
    m, p0 = shape["m"], shape["p0"]
    for after, host in zip(case.cache.read_all(device), case.host_cache):
        assert np.isnan(after[LAYER, :, p0 + m:]).all()
        np.testing.assert_array_equal(after[1 - LAYER], host[1 - LAYER])
        np.testing.assert_array_equal(after[LAYER, :, :p0], host[LAYER, :, :p0])


def test_detects_wrong_answers(device, rng):
    """The comparison can fail: a causal mask off by one, keys rotated wrongly, or NaN left in are caught."""
    shape = dict(n_heads=6, n_kv_heads=2, head_dim=64, m=7, p0=5)
    h, d, m, p0 = shape["n_heads"], shape["head_dim"], shape["m"], shape["p0"]
    case = SPEC.make_case(device, shape, rng)
    outputs = case.run(SPEC.defaults())
    assert relative_error(outputs["out"], case.expected["out"]) <= SPEC.tolerance
    # A reference that lets each query see one position more than causal.
    keys = np.concatenate([case.host_cache[0][LAYER, :, :p0].transpose(1, 0, 2), case.expected["keys"]])
    values = np.concatenate([case.host_cache[1][LAYER, :, :p0].transpose(1, 0, 2), case.expected["values"]])
    positions = np.arange(p0, p0 + m)
    q = reference.rope(case.qkv[:, : h * d].reshape(m, h, d), positions, THETA)
    np.testing.assert_allclose(reference.attention(q, keys, values, positions).reshape(m, h * d),
                               case.expected["out"])
    leaky = reference.attention(q, keys, values, positions + 1).reshape(m, h * d)
    assert relative_error(outputs["out"], leaky) > 10 * SPEC.tolerance
    # Keys rotated at the wrong positions.
    k = case.qkv[:, h * d: (h + shape["n_kv_heads"]) * d].reshape(m, -1, d)
    shifted = reference.rope(k, positions + 1, THETA).astype(np.float16)
    assert relative_error(outputs["keys"], shifted) > 10 * SPEC.tolerance
    assert relative_error(np.full_like(outputs["out"], np.nan), case.expected["out"]) == np.inf


def test_chat_continues(device, rng):
    """Two prefills (p0 = 0, then p0 = 33) give what one attention over the whole conversation gives."""
    h, hkv, d, m1, m2 = 8, 2, 64, 33, 19
    total = m1 + m2
    cache = KVCache.allocate(device, 3, hkv, total + 5, d)
    rope = RopeTable.upload(device, d, total + 5, THETA)
    attention = AttentionPrefill(device, h, hkv, d)
    qkv = rng.standard_normal((total, (h + 2 * hkv) * d)).astype(np.float32)
    outs = []
    for start, m in ((0, m1), (m1, m2)):
        qkv_dev, out = device.upload(qkv[start:start + m]), device.poisoned((m, h * d), np.float32)
        attention(qkv_dev, out, cache, rope, layer=2, p0=start, m=m).wait()
        outs.append(out.get())
    positions = np.arange(total)
    q = reference.rope(qkv[:, : h * d].reshape(total, h, d), positions, THETA)
    k = reference.rope(qkv[:, h * d: (h + hkv) * d].reshape(total, hkv, d), positions, THETA)
    k16 = k.astype(np.float16).astype(np.float64)
    v16 = qkv[:, (h + hkv) * d:].reshape(total, hkv, d).astype(np.float16).astype(np.float64)
    want = reference.attention(q, k16, v16, positions).reshape(total, h * d)
    assert relative_error(np.concatenate(outs), want) <= SPEC.tolerance
    keys, values = cache.read(device, 2, total)
    assert relative_error(keys, k16) <= SPEC.tolerance
    assert relative_error(values, v16) == 0.0


def test_prompt_longer_than_context(device, rng):
    cache = KVCache.allocate(device, 1, 2, 40, 64)
    rope = RopeTable.upload(device, 64, 40, THETA)
    attention = AttentionPrefill(device, 4, 2, 64)
    qkv = device.upload(rng.standard_normal((16, 8 * 64)).astype(np.float32))
    out = device.empty((16, 4 * 64), np.float32)
    with pytest.raises(PerfxError, match=r"longer than the context.*3 too many"):
        attention(qkv, out, cache, rope, layer=0, p0=27, m=16)
    with pytest.raises(PerfxError, match="layer 1 is outside"):
        attention(qkv, out, cache, rope, layer=1, p0=0, m=16)
    with pytest.raises(PerfxError, match="qkv must be float32"):
        attention(out, out, cache, rope, layer=0, p0=0, m=16)


def test_bad_configurations(device):
    with pytest.raises(PerfxError, match="multiple of 8"):
        AttentionPrefill(device, 4, 2, 60)
    with pytest.raises(PerfxError, match="cannot share"):
        AttentionPrefill(device, 9, 2, 64)
    with pytest.raises(PerfxError, match="local memory"):
        AttentionPrefill(Device(limits=Limits(name="small", local_mem=16384)), 4, 2, 128, {"BK": 64})


def test_falls_back_where_the_defaults_do_not_fit(rng):
    """A device with work-groups of at most 16 gets the first allowed parameter set, and right answers."""
    small = Device(limits=Limits(name="wg16", max_work_group=16))
    shape = dict(n_heads=9, n_kv_heads=3, head_dim=64, m=33, p0=5)
    attention = AttentionPrefill(small, 9, 3, 64)
    assert attention.params["WGS"] == 16
    case = SPEC.make_case(small, shape, rng)
    check(case, attention.params)
    with pytest.raises(PerfxError, match="no parameter set fits"):
        AttentionPrefill(Device(limits=Limits(name="tiny", local_mem=8192)), 4, 2, 128)
