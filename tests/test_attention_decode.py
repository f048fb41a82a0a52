"""attention_decode: RoPE + KV append + flash-decoding attention for one token, against perfx.reference."""

import numpy as np
import pytest

from helpers.spec_checks import assert_planned_sets, swept
from perfx import reference
from perfx.errors import PerfxError
from perfx.ops.attention_decode import PARAMS, AttentionDecode
from perfx.ops.kv_cache import KVCache, RopeTable
from perfx.runtime import LIMIT_PRESETS, Device, Limits
from perfx.tuning.attention_decode import LAYER, SPEC, THETA
from perfx.tuning.spec import relative_error

# out against attention over the very rows the kernel stored: only fp32 arithmetic is left (measured
# ≤ 4e-7 on the test shapes), so this is 25× tighter than the spec's tolerance, which also covers a key
# that rounds to fp16 one ulp apart from the float64 rotation.
STORED_TOLERANCE = 1e-5


def _check_case(case, shape, params):
    errors = case.errors(params)
    assert all(e <= SPEC.tolerance_for(params) for e in errors.values()), (SPEC.describe(shape), params, errors)


def strength(shape) -> int:
    """Every pair of values at head_dim 256 (VW and WGS together span the head), every value elsewhere."""
    return 2 if shape["head_dim"] >= 256 else 1


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(SPEC), ids=[SPEC.describe(s) for s in SPEC.test_shapes])
def test_every_candidate(device, rng, index):
    """Each parameter set at one of the shapes (helpers.spec_checks.plan), and at each a covering subset: each
    shape is a build of its own (head_dim, GQA, qk_norm and the cache's form are build defines), and every value of
    each parameter runs there (every PART against each shape's positions and window, VW and WGS against its
    head_dim, HALF with each), at head_dim 256 every pair of values, so what a shape adds (its GQA, head_dim,
    soft-cap, partial rotary or NoPE, offset, a single position, attention sinks, the int8 cache's quantizing
    append and dequantizing loads, a batched step's rows) meets every kind of variant. The shapes with the most
    edges: Gemma 3's layer, head_dim 256 (VW 4 and WGS 64 leave one V row a work-group, ROWS 1; the largest local
    arrays), GQA 4, the q/k norm build, a window that starts inside the first partition of each PART (its early
    positions weigh 0), a scale, and 129 positions: one past a partition of 128 (a combine of 2) and of 32 (5),
    one of 256; gpt-oss's layer with sinks, a window and a combine of several partitions."""
    shape = SPEC.test_shapes[index]
    assert SPEC.params.defaults() in SPEC.params.candidates(shape, device.caps)
    assert_planned_sets(SPEC, device, index, rng, strength)


@pytest.mark.parametrize("shape", [s for s in SPEC.test_shapes if "kv" not in s and "rows" not in s],
                         ids=SPEC.describe)
def test_stored_rows_and_fp32_accuracy(device, rng, shape):
    """Row pos holds the normalised, rotated k and v in fp16; no other row or layer changes; out is accurate to
    fp32. (The int8 cache's rows: tests/test_kv_q8.py.)"""
    h, hkv, d, positions = (shape[k] for k in ("n_heads", "n_kv_heads", "head_dim", "positions"))
    offset, pos = shape.get("qkv_offset", 0), positions - 1
    case = SPEC.make_case(device, shape, rng)
    out = case.run(SPEC.params.defaults())["out"]

    keys, values = case.cache.read_all(device)
    for stored, host in ((keys, case.host_cache[0]), (values, case.host_cache[1])):
        changed = stored.view(np.uint16) != host.view(np.uint16)
        if not shape.get("q_only"):   # a layer reading another's cache (Gemma 4) writes no row at all
            changed[LAYER, :, pos] = False
        assert not changed.any(), "rows other than (layer, pos) were written"

    x = case.qkv[offset:]
    k = case.k_rotated
    k_stored = keys[LAYER, :, pos].astype(np.float64)
    # Half an fp16 ulp of the float64 norm and rotation, plus the fp32 ones' own rounding.
    assert np.all(np.abs(k_stored - k) <= 2.0**-11 * np.abs(k) + 1e-6 * np.abs(k).max())
    if shape.get("v_norm"):   # normed in fp32 and in float64 before both round to fp16: the keys' bound
        v = reference.rmsnorm(x[(h + hkv) * d:].reshape(hkv, d), 1.0, 1e-6)
        assert np.all(np.abs(values[LAYER, :, pos] - v) <= 2.0**-11 * np.abs(v) + 1e-6 * np.abs(v).max())
    elif not shape.get("q_only"):
        v = x[(h + hkv) * d:].reshape(hkv, d)
        np.testing.assert_array_equal(values[LAYER, :, pos], v.astype(np.float16))

    k_all = keys[LAYER, :, : pos + 1].transpose(1, 0, 2)
    v_all = values[LAYER, :, : pos + 1].transpose(1, 0, 2)
    attend = case.features.attend
    want = reference.attention(case.q_rotated[None], k_all, v_all, [pos], **attend).reshape(h * d)
    assert relative_error(out, want) <= STORED_TOLERANCE

    # The checks can fail: an unwritten output, or a reference that misses the new position.
    assert relative_error(np.full_like(out, np.nan), want) == float("inf")
    if pos > 0:
        missing = reference.attention(case.q_rotated[None], k_all[:-1], v_all[:-1], [pos], **attend)
        assert relative_error(out, missing.reshape(h * d)) > SPEC.tolerance


@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim, positions",
                         [(4, 4, 128, 200), (2, 1, 80, 40)], ids=["gqa1-d128", "gqa2-d80"])
def test_other_head_shapes(device, rng, n_heads, n_kv_heads, head_dim, positions):
    shape = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim, "positions": positions}
    _check_case(SPEC.make_case(device, shape, rng), shape, SPEC.params.defaults())


@pytest.mark.parametrize("max_alloc", [None, 2 * 70 * 64 * 2], ids=["one-piece", "a-layer-a-piece"])
def test_decode_sequence(device, rng, max_alloc):
    """Token after token into an empty cache, across partition boundaries (one partition, then a combine);
    also with the cache in pieces of one layer each, as under a phone's allocation limit."""
    h, hkv, d, steps, layers = 6, 2, 64, 70, 3
    if max_alloc:
        device = Device(limits=Limits(name="small-alloc", max_alloc=max_alloc))
    op = AttentionDecode(device, {"PART": 32}, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "positions": steps})
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


def _random_weights(rng, d):
    return [rng.uniform(0.5, 1.5, d).astype(np.float32) for _ in range(2)]


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
def test_one_kernel_serves_layers_that_differ(device, rng, qk_norm):
    """One AttentionDecode, token after token across partitions (PART 32), for four layers that differ in
    what each launch passes: a local layer (window 7, θ 10⁴, Gemma's scale), a global one (θ 10⁶, soft-cap,
    no window named: the constructor's 3), a NoPE layer (rope=None, window 0 over the constructor's) and a
    partially rotary one (32 of 64 dimensions), each layer with its own q/k norm weights when built with
    qk_norm. The answer is the float64 reference's over the fp16 rows."""
    h, hkv, d, steps = 8, 2, 64, 70
    tables = {theta: RopeTable.upload(device, d, steps, theta) for theta in (1e4, 1e6)}
    partial = RopeTable.upload(device, d, steps, 1e4, rotary_dims=32)
    layers = [
        (tables[1e4], d, 1e4, dict(window=7, scale=0.09)),
        (tables[1e6], d, 1e6, dict(softcap=1.5, scale=0.3)),
        (None, 0, None, dict(window=0)),
        (partial, 32, 1e4, dict(scale=0.11, softcap=4.0, window=40)),
    ]
    weights = [_random_weights(rng, d) for _ in layers]
    op = AttentionDecode(device, {"PART": 32}, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "positions": steps, "window": 3, "qk_norm": qk_norm})
    cache = KVCache.allocate(device, len(layers), hkv, steps, d)
    nan = np.full((len(layers), hkv, steps, d), np.nan, np.float16)
    cache.write(device, nan, nan)
    out = device.poisoned(h * d, np.float32)
    norm_buffers = [[device.upload(w) for w in pair] for pair in weights]
    keys = [[] for _ in layers]
    values = [[] for _ in layers]
    for pos in range(steps):
        for layer, (rope, n_rot, theta, features) in enumerate(layers):
            x = rng.standard_normal((h + 2 * hkv) * d, dtype=np.float32)
            q_w, k_w = norm_buffers[layer]
            norms = dict(q_norm=q_w, k_norm=k_w, eps=1e-6) if qk_norm else {}
            out.fill(np.float32(np.nan))
            op(device.upload(x), out, cache, rope, layer, pos, **features, **norms).wait()
            q, k = x[: h * d].reshape(1, h, d), x[h * d: (h + hkv) * d].reshape(1, hkv, d)
            if qk_norm:
                q, k = (reference.rmsnorm(a, w, 1e-6) for a, w in zip((q, k), weights[layer]))
            if rope is not None:
                q, k = (reference.rope(a, [pos], theta, rotary_dims=n_rot) for a in (q, k))
            keys[layer].append(k[0])
            values[layer].append(x[(h + hkv) * d:].reshape(hkv, d))
            if pos in (0, 6, 31, 32, 33, steps - 1):
                k16 = np.array(keys[layer]).astype(np.float16).astype(np.float64)
                v16 = np.array(values[layer]).astype(np.float16).astype(np.float64)
                attend = {"window": 3, **features}
                want = reference.attention(q, k16, v16, [pos], **attend).reshape(h * d)
                assert relative_error(out.get(), want) <= SPEC.tolerance, (layer, pos)
                if pos == steps - 1 and "window" in features:
                    # The launch's window is not the constructor's: the check can tell them apart.
                    other = reference.attention(q, k16, v16, [pos], **{**features, "window": 3}).reshape(h * d)
                    assert relative_error(out.get(), other) > 10 * SPEC.tolerance


@pytest.mark.parametrize("gqa", [1, 2, 4, 8])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk-norm"])
def test_head_dim_256_fits_a_phone_at_the_defaults(gqa, qk_norm):
    """Gemma's head_dim 256 with up to 8 query heads per kv head: the defaults stay within an Adreno's 32 KiB
    of local memory (HALF too), so a phone runs them and the tuner may start from them."""
    caps = LIMIT_PRESETS["adreno740"]
    shape = {"n_heads": gqa, "n_kv_heads": 1, "head_dim": 256, "positions": 4096, "qk_norm": qk_norm}
    for half in (0, 1):
        params = {**SPEC.params.defaults(), "HALF": half}
        used = PARAMS.local_memory(params, shape)
        assert used <= caps.local_mem, (params, used)
        assert all(rule.holds(params, shape) for rule in PARAMS.rules)


def test_parameters_that_do_not_fit_are_refused_and_the_defaults_give_way(rng):
    """Explicit parameters beyond the device's local memory are an error that says so; with none asked
    for, defaults that do not fit give way to the first set that does, and the answer is right."""
    small = Device(limits=Limits(name="small-local", local_mem=8 << 10))
    shape = SPEC.test_shapes[1]
    h, hkv, d, positions = (shape[k] for k in ("n_heads", "n_kv_heads", "head_dim", "positions"))
    big = {"PART": 256, "WGS": 128, "VW": 8}
    with pytest.raises(PerfxError, match=r"attention_decode: parameters .* bytes of local memory > the "
                                         r"device's 8192"):
        AttentionDecode(small, big, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "positions": positions})
    fitting = AttentionDecode(small, None, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "positions": positions}).params
    defaults = SPEC.params.defaults()
    assert SPEC.params.why_invalid(defaults, shape, small.caps) is None or fitting != defaults
    assert SPEC.params.why_invalid(fitting, shape, small.caps) is None
    _check_case(SPEC.make_case(small, shape, rng), shape, fitting)


def test_errors(device):
    h, hkv, d, max_positions = 4, 2, 64, 8
    op = AttentionDecode(device, None, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "positions": max_positions})
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
    with pytest.raises(PerfxError, match="quantized out's steps and sums holds 32 bytes where 64 are needed"):
        op(qkv, out, cache, rope, 0, 0, quantized=(device.empty(h * d, np.int8), device.empty((4, 2), np.float32)))
    d40 = 40
    op40 = AttentionDecode(device, None, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d40, "positions": max_positions})
    with pytest.raises(PerfxError, match="needs head_dim a multiple of 32, not 40"):
        op40(device.upload(np.ones((h + 2 * hkv) * d40, np.float32)), device.empty(h * d40, np.float32),
             KVCache.allocate(device, 1, hkv, max_positions, d40), RopeTable.upload(device, d40, max_positions, THETA),
             0, 0, quantized=(device.empty(h * d40, np.int8), device.empty((h * d40 // 32, 2), np.float32)))
    with pytest.raises(PerfxError, match=r"head_dim 60 is not supported; supported: .*64.*128"):
        AttentionDecode(device, None, {"n_heads": h, "n_kv_heads": hkv, "head_dim": 60, "positions": max_positions})
    with pytest.raises(PerfxError, match="cannot share"):
        AttentionDecode(device, None, {"n_heads": 6, "n_kv_heads": 4, "head_dim": d, "positions": max_positions})


def test_layer_feature_errors(device):
    """What a launch passes per layer is checked: the norm weights against the build, the scale, soft-cap,
    window and eps, and the RoPE table's rotary dimensions."""
    h, hkv, d, max_positions = 4, 2, 64, 8
    cache = KVCache.allocate(device, 1, hkv, max_positions, d)
    rope = RopeTable.upload(device, d, max_positions, THETA)
    qkv = device.upload(np.ones((h + 2 * hkv) * d, np.float32))
    out = device.empty(h * d, np.float32)
    w = device.upload(np.ones(d, np.float32))
    normed = AttentionDecode(device, None, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "positions": max_positions, "qk_norm": True})
    with pytest.raises(PerfxError, match=r"built with qk_norm=True: pass q_norm and k_norm.*64 float32"):
        normed(qkv, out, cache, rope, 0, 0)
    with pytest.raises(PerfxError, match=r"k_norm.*holds 252 bytes where 256"):
        normed(qkv, out, cache, rope, 0, 0, q_norm=w, k_norm=device.upload(np.ones(d - 1, np.float32)))
    with pytest.raises(PerfxError, match="q_norm must be float32"):
        normed(qkv, out, cache, rope, 0, 0, q_norm=device.upload(np.ones(d, np.float64)), k_norm=w)
    with pytest.raises(PerfxError, match="eps must be positive"):
        normed(qkv, out, cache, rope, 0, 0, q_norm=w, k_norm=w, eps=0.0)
    plain = AttentionDecode(device, None, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "positions": max_positions})
    with pytest.raises(PerfxError, match="built without the q/k RMSNorm: make it with qk_norm=True"):
        plain(qkv, out, cache, rope, 0, 0, q_norm=w, k_norm=w)
    with pytest.raises(PerfxError, match="scale must be positive"):
        plain(qkv, out, cache, rope, 0, 0, scale=0.0)
    with pytest.raises(PerfxError, match="softcap must be ≥ 0"):
        plain(qkv, out, cache, rope, 0, 0, softcap=-1.0)
    with pytest.raises(PerfxError, match="window must be a whole number ≥ 0"):
        plain(qkv, out, cache, rope, 0, 0, window=-2)
    with pytest.raises(PerfxError, match="RoPE table"):
        plain(qkv, out, cache, RopeTable.upload(device, 128, max_positions, THETA), 0, 0)
    for bad in (31, 0, 66):
        with pytest.raises(PerfxError, match=rf"rotary_dims {bad} must be even and within 2..64.*rope=None"):
            RopeTable.upload(device, d, max_positions, THETA, rotary_dims=bad)


def test_a_shape_without_the_head_sizes_is_refused(device):
    with pytest.raises(PerfxError, match="attention_decode: the shape needs 'positions'"):
        AttentionDecode(device, None, {"n_heads": 4, "n_kv_heads": 2, "head_dim": 64})


@pytest.mark.parametrize("h, hkv, d", [(8, 2, 64), (8, 1, 512)], ids=["gqa4-d64", "gqa8-d512-split"])
def test_the_combine_is_in_the_launch_and_leaves_its_counters_at_zero(device, rng, h, hkv, d):
    """Past one partition the step is still one launch (the last work-group of each kv head and group of query
    heads combines), and the arrival counters are back at zero after it, so the next launch combines again
    (five in a row, each against the reference). At head 512 a kv head's 8 query heads are split over
    work-groups (HEADS < GQA): a counter per group, each group combining its own heads."""
    positions = 300
    op = AttentionDecode(device, {"PART": 32}, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "positions": positions})
    assert (op.heads < h // hkv) == (d == 512) and op.groups == h // op.heads
    cache = KVCache.allocate(device, 1, hkv, positions, d)
    rope = RopeTable.upload(device, d, positions, THETA)
    keys = rng.standard_normal((1, hkv, positions, d)).astype(np.float16)
    values = rng.standard_normal((1, hkv, positions, d)).astype(np.float16)
    cache.write(device, keys, values)
    out = device.poisoned(h * d, np.float32)
    for pos in (100, 101, 290, 31, 64):
        x = rng.standard_normal((h + 2 * hkv) * d, dtype=np.float32)
        out.fill(np.float32(np.nan))
        events = op.enqueue(device.upload(x), out, cache, rope, 0, pos)
        assert len(events) == 1 and op.partitions(pos) == pos // 32 + 1
        events[0].wait()
        counters = np.empty(op.groups, np.int32)
        device.read(counters, op.counters)
        assert not counters.any(), (pos, counters)
        q = reference.rope(x[: h * d].reshape(1, h, d), [pos], THETA)
        k = reference.rope(x[h * d: (h + hkv) * d].reshape(1, hkv, d), [pos], THETA)[0]
        keys[0, :, pos] = k.astype(np.float16)
        values[0, :, pos] = x[(h + hkv) * d:].reshape(hkv, d).astype(np.float16)
        want = reference.attention(q, keys[0, :, : pos + 1].transpose(1, 0, 2).astype(np.float64),
                                   values[0, :, : pos + 1].transpose(1, 0, 2).astype(np.float64), [pos])
        assert relative_error(out.get(), want.reshape(h * d)) <= SPEC.tolerance, pos

