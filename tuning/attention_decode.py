"""Tuning spec of ``attention_decode``: RoPE + KV append + flash-decoding attention for one new token.

Shape keys: n_heads, n_kv_heads, head_dim, positions (the context after the append: the new token is at
position positions − 1), optionally qkv_offset (where [q | k | v] starts in the qkv buffer). Cases run
at layer 1 of a two-layer cache, so the layer offset is exercised; ``rotate`` switches to layer 0 for
timing, so a cache larger than the device's caches is not served from them twice in a row.
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops.attention_decode import PARAMS, AttentionDecode
from perfx.ops.kv_cache import KVCache, RopeTable
from perfx.tuning.spec import Case, Spec, cached_per_params

THETA = 10000.0
LAYERS, LAYER = 2, 1


def kv_bytes(shape) -> int:
    """Bytes of K and V (fp16) the attention reads: every position 0..p of every kv head."""
    return 2 * 2 * shape["positions"] * shape["n_kv_heads"] * shape["head_dim"]


def bytes_moved(shape) -> int:
    # The partials ((D + 2) floats per head and partition, written once and read once) are left out:
    # under 1/PART·(H/Hkv)·4 of the K/V bytes.
    h, hkv, d = shape["n_heads"], shape["n_kv_heads"], shape["head_dim"]
    return 4 * (h + 2 * hkv) * d + 2 * 2 * hkv * d + kv_bytes(shape) + 4 * h * d


def flops(shape) -> int:
    # q·k and w·v: 2·D each per (query head, position); RoPE and softmax are lower order.
    return 4 * shape["n_heads"] * shape["positions"] * shape["head_dim"]


def make_case(device, shape, rng) -> Case:
    h, hkv, d, positions = (shape[k] for k in ("n_heads", "n_kv_heads", "head_dim", "positions"))
    offset = shape.get("qkv_offset", 0)
    pos = positions - 1
    max_positions = positions + 3  # a few rows past the new one, which must stay untouched
    qkv = rng.standard_normal(offset + (h + 2 * hkv) * d, dtype=np.float32)
    # The whole cache on the host: random fp16 in the rows before pos (earlier tokens) and in the other
    # layer, NaN from pos on (the row the kernel must write and must not read back, and unused rows).
    host_cache = []
    for _ in range(2):
        block = rng.standard_normal((LAYERS, hkv, max_positions, d), dtype=np.float32).astype(np.float16)
        block[LAYER, :, pos:] = np.nan
        host_cache.append(block)
    cache = KVCache.allocate(device, LAYERS, hkv, max_positions, d)
    rope = RopeTable.upload(device, d, max_positions, THETA)
    qkv_dev = device.upload(qkv)
    out = device.poisoned(h * d, np.float32)

    # Expected, float64: RoPE on q and k; k and v as the cache stores them (fp16), so the tolerance on out
    # covers fp32 arithmetic and not fp16 storage.
    x = qkv[offset:]
    q = reference.rope(x[: h * d].reshape(1, h, d), [pos], THETA)
    k = reference.rope(x[h * d: (h + hkv) * d].reshape(1, hkv, d), [pos], THETA)
    k16 = k.astype(np.float16).astype(np.float64)
    v16 = x[(h + hkv) * d:].reshape(1, hkv, d).astype(np.float16).astype(np.float64)
    keys = np.concatenate([host_cache[0][LAYER, :, :pos].transpose(1, 0, 2).astype(np.float64), k16])
    values = np.concatenate([host_cache[1][LAYER, :, :pos].transpose(1, 0, 2).astype(np.float64), v16])
    expected = {
        "out": reference.attention(q, keys, values, [pos]).reshape(h * d),
        "keys": k16[0],
        "values": v16[0],
    }
    op = cached_per_params(lambda params: AttentionDecode(device, h, hkv, d, max_positions, params))
    state = {"layer": LAYER}

    def launch(params):
        return op(params).enqueue(qkv_dev, out, cache, rope, state["layer"], pos, offset)

    def run(params):
        state["layer"] = LAYER
        cache.write(device, *host_cache)
        out.fill(np.float32(np.nan))
        for event in launch(params):
            event.wait()
        k_dev, v_dev = cache.read(device, LAYER, positions)
        return {"out": out.get(), "keys": k_dev[pos], "values": v_dev[pos]}

    def rotate():
        state["layer"] = 1 - state["layer"]

    case = Case(expected=expected, run=run, launch=launch, rotate=rotate)
    # For tests that look past the outputs: the cache rows around pos, and the inputs.
    case.cache, case.host_cache, case.rope, case.qkv, case.q_rotated = cache, host_cache, rope, qkv, q[0]
    case.op = op
    return case


SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    tolerance=1e-3,
    tolerance_why=(
        "keys: the kernel rotates in fp32 and the reference in float64 before both round to fp16, so an "
        "element near a rounding boundary may land one fp16 ulp apart (≤ 2^-10 of its value, ≤ 9.8e-4 of "
        "the max); values are rounded identically (exact). out is compared with attention over the fp16 "
        "K/V the cache holds, so it carries fp32 arithmetic (measured ≤ 1e-6 on the test shapes) plus the "
        "effect of those rare key flips through q·k/√D (< 1e-4). tests/test_attention_decode.py also "
        "checks out at 1e-5 against attention over the rows the kernel stored."
    ),
    test_shapes=(
        {"n_heads": 4, "n_kv_heads": 4, "head_dim": 64, "positions": 17},
        {"n_heads": 9, "n_kv_heads": 3, "head_dim": 64, "positions": 300, "qkv_offset": 5},
        {"n_heads": 8, "n_kv_heads": 2, "head_dim": 128, "positions": 1},
        {"n_heads": 8, "n_kv_heads": 2, "head_dim": 128, "positions": 300, "qkv_offset": 3},
    ),
    bytes_moved=bytes_moved,
    flops=flops,
    describe=lambda s: (f"H={s['n_heads']} Hkv={s['n_kv_heads']} D={s['head_dim']} T={s['positions']}"
                        + (f" offset={s['qkv_offset']}" if s.get("qkv_offset") else "")),
)
