"""attention_decode: RoPE + KV append + flash-decoding attention for one token, against perfx.reference."""

import numpy as np
import pytest

from helpers.spec_checks import assert_every_parameter_set
from perfx import reference
from perfx.errors import PerfxError
from perfx.ops.attention_decode import AttentionDecode
from perfx.ops.kv_cache import KVCache, RopeTable
from perfx.runtime import Device, Limits
from perfx.tuning.attention_decode import LAYER, SPEC, THETA
from perfx.tuning.spec import relative_error

# out against attention over the very rows the kernel stored: only fp32 arithmetic is left (measured
# ≤ 4e-7 on the test shapes), so this is 25× tighter than the spec's tolerance, which also covers a key
# that rounds to fp16 one ulp apart from the float64 rotation.
STORED_TOLERANCE = 1e-5


def _check_case(case, shape, params):
    errors = case.errors(params)
    assert all(e <= SPEC.tolerance for e in errors.values()), (SPEC.describe(shape), params, errors)


@pytest.mark.parametrize("shape", SPEC.test_shapes, ids=SPEC.describe)
def test_every_candidate(device, rng, shape):
    assert SPEC.defaults() in SPEC.candidates(shape, device.caps)
    assert_every_parameter_set(SPEC, device, shape, rng)


@pytest.mark.parametrize("shape", SPEC.test_shapes, ids=SPEC.describe)
def test_stored_rows_and_fp32_accuracy(device, rng, shape):
    """Row pos holds the rotated k and v in fp16; no other row or layer changes; out is accurate to fp32."""
    h, hkv, d, positions = (shape[k] for k in ("n_heads", "n_kv_heads", "head_dim", "positions"))
    offset, pos = shape.get("qkv_offset", 0), positions - 1
    case = SPEC.make_case(device, shape, rng)
    out = case.run(SPEC.defaults())["out"]

    keys, values = case.cache.read_all(device)
    for stored, host in ((keys, case.host_cache[0]), (values, case.host_cache[1])):
        changed = stored.view(np.uint16) != host.view(np.uint16)
        changed[LAYER, :, pos] = False
        assert not changed.any(), "rows other than (layer, pos) were written"

    x = case.qkv[offset:]
    k = reference.rope(x[h * d: (h + hkv) * d].reshape(1, hkv, d), [pos], THETA)[0]
    v = x[(h + hkv) * d:].reshape(hkv, d)
    k_stored = keys[LAYER, :, pos].astype(np.float64)
    # Half an fp16 ulp of the float64 rotation, plus the fp32 rotation's own rounding.
    assert np.all(np.abs(k_stored - k) <= 2.0**-11 * np.abs(k) + 1e-6 * np.abs(k).max())
    np.testing.assert_array_equal(values[LAYER, :, pos], v.astype(np.float16))

    k_all = keys[LAYER, :, : pos + 1].transpose(1, 0, 2)
    v_all = values[LAYER, :, : pos + 1].transpose(1, 0, 2)
    want = reference.attention(case.q_rotated[None], k_all, v_all, [pos]).reshape(h * d)
    assert relative_error(out, want) <= STORED_TOLERANCE

    # The checks can fail: an unwritten output, or a reference that misses the new position.
    assert relative_error(np.full_like(out, np.nan), want) == float("inf")
    if pos > 0:
        missing = reference.attention(case.q_rotated[None], k_all[:-1], v_all[:-1], [pos]).reshape(h * d)
        assert relative_error(out, missing) > SPEC.tolerance


@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim, positions",
                         [(4, 4, 128, 200), (2, 1, 80, 40)], ids=["gqa1-d128", "gqa2-d80"])
def test_other_head_shapes(device, rng, n_heads, n_kv_heads, head_dim, positions):
    shape = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim, "positions": positions}
    _check_case(SPEC.make_case(device, shape, rng), shape, SPEC.defaults())


@pytest.mark.parametrize("max_alloc", [None, 2 * 70 * 64 * 2], ids=["one-piece", "a-layer-a-piece"])
def test_decode_sequence(device, rng, max_alloc):
    """Token after token into an empty cache, across partition boundaries (one partition, then a combine);
    also with the cache in pieces of one layer each, as under a phone's allocation limit."""
    h, hkv, d, steps, layers = 6, 2, 64, 70, 3
    if max_alloc:
        device = Device(limits=Limits(name="small-alloc", max_alloc=max_alloc))
    op = AttentionDecode(device, h, hkv, d, steps, {"PART": 32})
    cache = KVCache.allocate(device, layers, hkv, steps, d)
    assert len(cache.pieces) == (3 if max_alloc else 1)
    rope = RopeTable.upload(device, d, steps, THETA)
    nan = np.full((layers, hkv, steps, d), np.nan, np.float16)
    cache.write(device, nan, nan)
    out = device.poisoned(h * d, np.float32)
    keys, values = [], []
    for pos in range(steps):
        x = rng.standard_normal((h + 2 * hkv) * d, dtype=np.float32)
        out.fill(np.float32(np.nan))
        op(device.upload(x), out, cache, rope, 1, pos).wait()
        q = reference.rope(x[: h * d].reshape(1, h, d), [pos], THETA)
        keys.append(reference.rope(x[h * d: (h + hkv) * d].reshape(1, hkv, d), [pos], THETA)[0])
        values.append(x[(h + hkv) * d:].reshape(hkv, d))
        k16 = np.array(keys).astype(np.float16).astype(np.float64)
        v16 = np.array(values).astype(np.float16).astype(np.float64)
        want = reference.attention(q, k16, v16, [pos]).reshape(h * d)
        assert relative_error(out.get(), want) <= SPEC.tolerance, pos
    k_dev, v_dev = cache.read(device, 1, steps)
    assert relative_error(k_dev, k16) <= SPEC.tolerance and relative_error(v_dev, v16) == 0
    k_all, _ = cache.read_all(device)
    assert np.isnan(k_all[[0, 2]]).all(), "the other layers (other pieces) stay untouched"


def test_parameters_that_do_not_fit_are_refused_and_the_defaults_give_way(rng):
    """Explicit parameters beyond the device's local memory are an error that says so; with none asked
    for, defaults that do not fit give way to the first set that does, and the answer is right."""
    small = Device(limits=Limits(name="small-local", local_mem=8 << 10))
    shape = SPEC.test_shapes[1]
    h, hkv, d, positions = (shape[k] for k in ("n_heads", "n_kv_heads", "head_dim", "positions"))
    big = {"PART": 256, "WGS": 128, "VW": 8}
    with pytest.raises(PerfxError, match=r"attention_decode: parameters .* bytes of local memory > the "
                                         r"device's 8192"):
        AttentionDecode(small, h, hkv, d, positions, big)
    fitting = AttentionDecode(small, h, hkv, d, positions).params
    assert SPEC.why_invalid(SPEC.defaults(), shape, small.caps) is None or fitting != SPEC.defaults()
    assert SPEC.why_invalid(fitting, shape, small.caps) is None
    _check_case(SPEC.make_case(small, shape, rng), shape, fitting)


def test_errors(device):
    h, hkv, d, max_positions = 4, 2, 64, 8
    op = AttentionDecode(device, h, hkv, d, max_positions)
    cache = KVCache.allocate(device, 2, hkv, max_positions, d)
    rope = RopeTable.upload(device, d, max_positions, THETA)
    qkv = device.upload(np.ones((h + 2 * hkv) * d, np.float32))
    out = device.empty(h * d, np.float32)
    with pytest.raises(PerfxError, match="context full"):
        op(qkv, out, cache, rope, 0, max_positions)
    with pytest.raises(PerfxError, match="layer 2 is outside"):
        op(qkv, out, cache, rope, 2, 0)
    with pytest.raises(PerfxError, match="qkv must hold"):
        op(qkv, out, cache, rope, 0, 0, qkv_offset=1)
    with pytest.raises(PerfxError, match="out must hold"):
        op(qkv, device.empty(h * d - 1, np.float32), cache, rope, 0, 0)
    with pytest.raises(PerfxError, match="does not match"):
        op(qkv, out, KVCache.allocate(device, 1, hkv, max_positions, 128), rope, 0, 0)
    with pytest.raises(PerfxError, match="RoPE table"):
        op(qkv, out, cache, RopeTable.upload(device, d, 4, THETA), 0, 5)
    with pytest.raises(PerfxError, match=r"head_dim 60 is not supported; supported: .*64.*128"):
        AttentionDecode(device, h, hkv, 60, max_positions)
    with pytest.raises(PerfxError, match="cannot share"):
        AttentionDecode(device, 6, 4, d, max_positions)
