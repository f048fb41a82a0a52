"""attention_prefill: causal RoPE + KV append + flash attention against perfx.reference, every parameter set."""

import numpy as np
import pytest

from helpers.spec_checks import assert_planned_sets, swept
from perfx import reference
from perfx.errors import PerfxError
from perfx.ops.attention_decode import AttentionDecode
from perfx.ops.attention_prefill import PARAMS, REGISTER_BUDGET, AttentionPrefill, registers
from perfx.ops.kv_cache import KVCache, RopeTable
from perfx.runtime import LIMIT_PRESETS, Device, Limits
from perfx.tuning.attention_decode import THETA
from perfx.tuning.attention_prefill import LAYER, SPEC
from perfx.tuning.spec import relative_error


def strength(shape) -> int:
    """Every pair of values at head_dim 256 (DSPLIT and BK against its registers and local memory, HALF with
    each), every value elsewhere."""
    return 2 if shape["head_dim"] >= 256 else 1


def check(case, params):
    errors = case.errors(params)
    tolerance = SPEC.tolerance_for(params)
    assert all(e <= tolerance for e in errors.values()), f"{params}: {errors} > {tolerance}"
    return errors


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(SPEC), ids=[SPEC.describe(s) for s in SPEC.test_shapes])
def test_every_candidate(device, rng, index):
    """Each candidate at one of the shapes where it runs (helpers.spec_checks.plan; the first, head_dim 64, runs
    every set the tuner may choose at any head_dim: the register budget and local memory only remove sets as
    head_dim grows; GQA 3, 24 query rows, no multiple of any WGS; 8 tokens after 5 cached, each work-group's last
    position, 11 or 13, no multiple of any BK tile). At each shape a covering subset: each (head_dim, qk_norm,
    the cache's form) is a build of its own, and there every value of each parameter runs, so what a shape adds
    (its head_dim, GQA, q/k norm, window, soft-cap, partial rotary or NoPE, attention sinks, the int8 cache) meets
    every kind of variant."""
    shape = SPEC.test_shapes[index]
    if shape["head_dim"] <= 128:
        assert SPEC.params.defaults() in SPEC.params.candidates(shape, device.caps)
    assert_planned_sets(SPEC, device, index, rng, strength)


def test_head_dim_256_has_fp32_sets_that_fit_a_phone(rng):
    """At D = 256 the defaults (DSPLIT 2) are over the register budget; with an Adreno's 32 KiB of local
    memory the wrapper, asked for nothing, takes an fp32 set that fits (DSPLIT 4, K/V tiles of 8), and it is
    right."""
    phone = Device(limits=LIMIT_PRESETS["adreno740"])
    shape = SPEC.test_shapes[2]
    assert shape["head_dim"] == 256 and shape["qk_norm"]
    assert SPEC.params.why_invalid(SPEC.params.defaults(), shape, phone.caps) is not None
    params = AttentionPrefill(phone, None, {"n_heads": shape["n_heads"], "n_kv_heads": shape["n_kv_heads"], "head_dim": 256, "qk_norm": True}).params
    assert params["HALF"] == 0 and params["DSPLIT"] == 4 and params["BK"] == 8, params
    assert registers(params, shape) <= REGISTER_BUDGET and PARAMS.local_memory(params, shape) <= 32 << 10
    check(SPEC.make_case(phone, shape, rng), params)


def test_head_dim_128_stays_within_the_register_budget(device):
    """At D = 128 one work-item per query row (q[128] and acc[128]) is over the budget: never a candidate."""
    shape = SPEC.test_shapes[1]
    assert shape["head_dim"] == 128
    candidates = SPEC.params.candidates(shape, device.caps)
    assert candidates and all(p["DSPLIT"] >= 2 for p in candidates)
    assert any(p["DSPLIT"] == 1 for p in SPEC.params.candidates(SPEC.test_shapes[0], device.caps))


# Prompt lengths and contexts at the defaults: M ∈ {2, 7, 32, 33, 128, 300}, p0 ∈ {0, 5, 100}, GQA ratios
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
    check(case, SPEC.params.defaults())
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
    outputs = case.run(SPEC.params.defaults())
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
    attention = AttentionPrefill(device, None, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d})
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
    attention = AttentionPrefill(device, None, {"n_heads": 4, "n_kv_heads": 2, "head_dim": 64})
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
        AttentionPrefill(device, None, {"n_heads": 4, "n_kv_heads": 2, "head_dim": 60})
    with pytest.raises(PerfxError, match="cannot share"):
        AttentionPrefill(device, None, {"n_heads": 9, "n_kv_heads": 2, "head_dim": 64})
    with pytest.raises(PerfxError, match="local memory"):
        AttentionPrefill(Device(limits=Limits(name="small", local_mem=16384)), {"BK": 64, "DSPLIT": 4}, {"n_heads": 4, "n_kv_heads": 2, "head_dim": 128})
    with pytest.raises(PerfxError, match="at most 160 registers"):
        AttentionPrefill(device, {"DSPLIT": 1}, {"n_heads": 4, "n_kv_heads": 2, "head_dim": 128})


def test_falls_back_where_the_defaults_do_not_fit(rng):
    """A device with work-groups of at most 16 gets the first allowed parameter set, and right answers."""
    small = Device(limits=Limits(name="wg16", max_work_group=16))
    shape = dict(n_heads=9, n_kv_heads=3, head_dim=64, m=33, p0=5)
    attention = AttentionPrefill(small, None, {"n_heads": 9, "n_kv_heads": 3, "head_dim": 64})
    assert attention.params["WGS"] == 16
    case = SPEC.make_case(small, shape, rng)
    check(case, attention.params)
    # the smallest K/V tiles at head_dim 128 (4 positions in half) take 2 KiB
    with pytest.raises(PerfxError, match="no parameter set fits"):
        AttentionPrefill(Device(limits=Limits(name="tiny", local_mem=1024)), None, {"n_heads": 4, "n_kv_heads": 2, "head_dim": 128})


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("rotary_dims", [96, 0, 128], ids=["rotate-96", "nope", "rotate-128"])
def test_prefill_then_decode_agree(device, rng, qk_norm, rotary_dims):
    """A chat's turns through both kernels on one cache: a prompt prefilled at p0 = 0, a second at p0 = 21,
    then tokens decoded one by one, with the same layer features (norm weights, partial or no RoPE, scale,
    soft-cap, window). Each output is the float64 reference's over the whole conversation, so the kernels
    store and read k alike."""
    h, hkv, d, m1, m2, steps = 8, 2, 128, 21, 12, 5
    total = m1 + m2 + steps
    features = dict(scale=0.1, softcap=2.0, window=25)
    cache = KVCache.allocate(device, 2, hkv, total, d)
    rope = RopeTable.upload(device, d, total, THETA, rotary_dims=rotary_dims) if rotary_dims else None
    weights = [rng.uniform(0.5, 1.5, d).astype(np.float32) for _ in range(2)]
    if qk_norm:
        features.update(q_norm=device.upload(weights[0]), k_norm=device.upload(weights[1]), eps=1e-5)
    prefill = AttentionPrefill(device, None, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "qk_norm": qk_norm})
    decode = AttentionDecode(device, {"PART": 32}, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "positions": total, "qk_norm": qk_norm})
    qkv = rng.standard_normal((total, (h + 2 * hkv) * d)).astype(np.float32)
    outs = []
    for start, m in ((0, m1), (m1, m2)):
        out = device.poisoned((m, h * d), np.float32)
        prefill(device.upload(qkv[start:start + m]), out, cache, rope, 1, start, m, **features).wait()
        outs.append(out.get())
    for pos in range(m1 + m2, total):
        out = device.poisoned(h * d, np.float32)
        decode(device.upload(qkv[pos]), out, cache, rope, 1, pos, **features).wait()
        outs.append(out.get()[None])

    positions = np.arange(total)
    q, k = qkv[:, : h * d].reshape(total, h, d), qkv[:, h * d: (h + hkv) * d].reshape(total, hkv, d)
    if qk_norm:
        q, k = reference.rmsnorm(q, weights[0], 1e-5), reference.rmsnorm(k, weights[1], 1e-5)
    if rotary_dims:
        q, k = (reference.rope(a, positions, THETA, rotary_dims=rotary_dims) for a in (q, k))
    k16 = k.astype(np.float16).astype(np.float64)
    v16 = qkv[:, (h + hkv) * d:].reshape(total, hkv, d).astype(np.float16).astype(np.float64)
    want = reference.attention(q, k16, v16, positions, scale=0.1, softcap=2.0, window=25).reshape(total, h * d)
    assert relative_error(np.concatenate(outs), want) <= SPEC.tolerance
    keys, _ = cache.read(device, 1, total)
    assert relative_error(keys, k16) <= SPEC.tolerance
    # The check can fail: without the soft-cap the answer differs.
    uncapped = reference.attention(q, k16, v16, positions, scale=0.1, window=25).reshape(total, h * d)
    assert relative_error(np.concatenate(outs), uncapped) > 10 * SPEC.tolerance


def test_layer_feature_errors(device):
    cache = KVCache.allocate(device, 1, 2, 40, 64)
    qkv = device.upload(np.ones((4, 8 * 64), np.float32))
    out = device.empty((4, 4 * 64), np.float32)
    with pytest.raises(PerfxError, match="attention_prefill: built with qk_norm=True: pass q_norm and k_norm"):
        AttentionPrefill(device, None, {"n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "qk_norm": True})(qkv, out, cache, None, 0, 0, 4)
    with pytest.raises(PerfxError, match="attention_prefill: softcap must be ≥ 0"):
        AttentionPrefill(device, None, {"n_heads": 4, "n_kv_heads": 2, "head_dim": 64})(qkv, out, cache, None, 0, 0, 4, softcap=float("nan"))
    with pytest.raises(PerfxError, match="RoPE table"):
        AttentionPrefill(device, None, {"n_heads": 4, "n_kv_heads": 2, "head_dim": 64})(qkv, out, cache, RopeTable.upload(device, 64, 3, THETA), 0, 0, 4)
