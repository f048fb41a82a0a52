"""Tuning spec of ``attention_prefill``: causal RoPE + KV append + flash attention over a prompt.

Shape keys: n_heads, n_kv_heads, head_dim, m (prompt tokens), p0 (first position; positions < p0 are
already in the cache), optionally the layer features of ``perfx.tuning.attention_decode.Features`` (qk_norm,
which changes the build; rotary_dims, scale, softcap, window, per launch) and kv ("q8": an int8 KV cache,
which changes the build). Cases run at layer 1 of a two-layer cache, so the layer offset is exercised.
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops.attention_prefill import PARAMS, AttentionPrefill
from perfx.ops.kv_cache import KVCache
from perfx.tuning.attention_decode import (EPS, LAYER, LAYERS, Features, as_stored, away_from_q8_ties,
                                           describe_features,
                                           heads, kv_value_bytes, layer_features, random_cache)
from perfx.tuning.spec import Case, Spec, cached_per_params


def causal_keys(shape) -> int:
    """Σ over the m queries of the positions each one sees: query at p0+t sees p0+t+1 keys."""
    m, p0 = shape["m"], shape["p0"]
    return m * p0 + m * (m + 1) // 2


def flops(shape) -> int:
    # q·k and p·v: 2·D each per (query head, visible key); RoPE and softmax are lower order.
    return 4 * shape["head_dim"] * shape["n_heads"] * causal_keys(shape)


def bytes_moved(shape) -> int:
    h, hkv, d, m, p0 = (shape[k] for k in ("n_heads", "n_kv_heads", "head_dim", "m", "p0"))
    qkv = 4 * m * (h + 2 * hkv) * d
    value = kv_value_bytes(shape)
    appended = 2 * value * m * hkv * d          # k and v written as the cache holds them
    cache_read = 2 * value * (p0 + m) * hkv * d  # every K/V row read at least once
    return int(qkv + appended + cache_read + 4 * m * h * d)


def fuzz_shapes(st):
    """Any heads, prompts of 1–40 tokens after 0–60 cached positions, any layer features."""
    @st.composite
    def shape(draw):
        drawn = {**draw(heads(st)), "m": draw(st.integers(1, 40)), "p0": draw(st.integers(0, 60))}
        return {**drawn, **draw(layer_features(st, drawn["head_dim"]))}
    return shape()


def make_case(device, shape, rng) -> Case:
    h, hkv, d, m, p0 = (shape[k] for k in ("n_heads", "n_kv_heads", "head_dim", "m", "p0"))
    kv = shape.get("kv", "f16")
    max_positions = p0 + m + 3  # a few rows past the prompt, which must stay untouched
    q_only = bool(shape.get("q_only"))
    qkv = rng.standard_normal((m, (h + (0 if q_only else 2 * hkv)) * d)).astype(np.float32)
    # The whole cache on the host: random values as the cache holds them in every row before p0 (earlier
    # turns) and in the other layer, NaN from p0 on (rows the append must write, or that must stay unread);
    # q_only: the prompt's rows are there already (another layer appended them), NaN after them.
    host_cache = []
    for _ in range(2):
        block = random_cache(rng, kv, (LAYERS, hkv, max_positions, d))
        block[LAYER, :, p0 + (m if q_only else 0):] = np.nan
        host_cache.append(block)
    cache = KVCache.allocate(device, LAYERS, hkv, max_positions, d, form=kv)
    features = Features.make(device, shape, max_positions, rng)
    positions = np.arange(p0, p0 + m)

    def rotated_keys(rows):
        return features.apply(rows[:, h * d: (h + hkv) * d].reshape(m, hkv, d), positions, 1)
    def new_values(rows):   # v, normed without a weight where the layer norms it (Gemma 4)
        v = rows[:, (h + hkv) * d:].reshape(m, hkv, d).astype(np.float64)
        return reference.rmsnorm(v, 1.0, EPS) if shape.get("v_norm") else v
    if kv == "q8" and not q_only:
        away_from_q8_ties(rng, qkv, h, hkv, d, rotated_keys, new_values)
    qkv_dev = device.upload(qkv)
    out = device.poisoned((m, h * d), np.float32)

    # Expected, float64: norm and RoPE on q and k; k and v as the cache stores them (fp16, or the q8 rule's
    # codes and scales), so the tolerance covers fp32 arithmetic and not the storage.
    q = features.apply(qkv[:, : h * d].reshape(m, h, d), positions, 0)
    if q_only:   # the prompt's rows as they are in the cache: read, never written
        k16, v16 = (host_cache[i][LAYER, :, p0:p0 + m].transpose(1, 0, 2).astype(np.float64) for i in range(2))
    else:
        k16 = as_stored(rotated_keys(qkv), kv)
        v16 = as_stored(new_values(qkv), kv)
    keys = np.concatenate([host_cache[0][LAYER, :, :p0].transpose(1, 0, 2).astype(np.float64), k16])
    values = np.concatenate([host_cache[1][LAYER, :, :p0].transpose(1, 0, 2).astype(np.float64), v16])
    expected = {
        "out": reference.attention(q, keys, values, positions, **features.attend).reshape(m, h * d),
        "keys": k16,
        "values": v16,
    }
    op = cached_per_params(lambda params: AttentionPrefill(device, params, shape))

    def launch(params):
        return op(params).enqueue(qkv_dev, out, cache, features.rope, LAYER, p0, m, **features.launch)

    def run(params):
        cache.write(device, *host_cache)
        out.fill(np.float32(np.nan))
        for event in launch(params):
            event.wait()
        k_dev, v_dev = cache.read(device, LAYER, p0 + m)
        return {"out": out.get(), "keys": k_dev[p0:], "values": v_dev[p0:]}

    case = Case(expected=expected, run=run, launch=launch)
    # For tests that look past the outputs.
    case.qkv, case.cache, case.host_cache, case.features, case.q_rotated = qkv, cache, host_cache, features, q
    return case


# The int8 cache at GQA 1, 3, 4 and 8 and head_dim 64, 128 and 256, on prompts that end past a tile (BK 4..64,
# WGS rows of (token, head)) after cached positions; the last with the q/k norm and a window.
Q8_TEST_SHAPES = (
    {"n_heads": 6, "n_kv_heads": 2, "head_dim": 64, "m": 8, "p0": 5, "kv": "q8"},
    {"n_heads": 4, "n_kv_heads": 1, "head_dim": 128, "m": 33, "p0": 0, "kv": "q8"},
    {"n_heads": 8, "n_kv_heads": 1, "head_dim": 256, "m": 9, "p0": 8, "kv": "q8"},
    {"n_heads": 3, "n_kv_heads": 3, "head_dim": 128, "m": 19, "p0": 17, "qk_norm": True, "window": 20, "kv": "q8"},
)

SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    programs=lambda device, shape, params: AttentionPrefill(device, params, shape),
    tolerance=1e-3,
    tolerance_why=(
        "keys: the kernel rotates in fp32 and the reference in float64 before both round to fp16, so an "
        "element near a rounding boundary may land one fp16 ulp apart (≤ 2^-10 of its value, ≤ 9.8e-4 of "
        "the max; measured ≤ 4e-4, in ~1 element of 7000); values are rounded identically (exact). out is "
        "compared with attention over the fp16 K/V the reference rounds, so it carries fp32 arithmetic "
        "(~2e-7 measured on the small shapes) plus those key flips through q·k/√D (≤ 3.5e-5 measured at "
        "m = 300): 1e-3 leaves a margin of 30× and still catches a causal mask off by one (> 1e-2). kv=q8: the "
        "new k and v are drawn away from the q8 rule's rounding ties (attention_decode.TIE_MARGIN), so the "
        "appended codes and scales equal the float64 rule's (keys and values compare exactly, as codes × "
        "scales) and out, against attention over the dequantized cache, carries fp32 arithmetic only."
    ),
    variant_tolerances={"HALF": (5e-3, (
        "HALF = 1: q·k in half: q rounds to half (≤ u = 2⁻¹¹ of each value; the keys are fp16 already) and "
        "each product and partial sum of a work-item's share of D rounds once more, so a score moves by "
        "~u·√D of |q||k|/√D, a few 1e-3 absolutely at most; softmax and p·V stay fp32, so out moves by about "
        "that much relative. Measured 8.6e-4 (D = 64), 1.0e-3 (D = 128) and 1.1e-3 (D = 256) on the test "
        "shapes; 5e-3 leaves margin and still fails a causal mask off by one (> 1e-2)"))},
    test_shapes=(
        {"n_heads": 6, "n_kv_heads": 2, "head_dim": 64, "m": 8, "p0": 5},
        {"n_heads": 4, "n_kv_heads": 1, "head_dim": 128, "m": 33, "p0": 0},
        # The 2026 families' layers, on prompts that end past a tile (BK 8..64, WGS rows of (token, head)) and
        # continue a chat (p0 > 0): Gemma 3 (D 256, GQA 4, q/k norm, a local layer's window, scale ≠ 1/√D),
        # Gemma 2 (GQA 8, soft-cap: scores of std ~2 against a cap of 1.5), Phi-4-mini (96 of 128 dimensions
        # rotate), SmolLM3's NoPE layers, and all of them at once at D 64 (32 of 64 rotate).
        {"n_heads": 4, "n_kv_heads": 1, "head_dim": 256, "m": 37, "p0": 30, "qk_norm": True, "window": 20,
         "scale": 0.07},
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 256, "m": 9, "p0": 8, "scale": 0.125, "softcap": 1.5},
        {"n_heads": 12, "n_kv_heads": 4, "head_dim": 128, "m": 20, "p0": 3, "rotary_dims": 96},
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 64, "m": 17, "p0": 0, "rotary_dims": 0},
        {"n_heads": 4, "n_kv_heads": 4, "head_dim": 64, "m": 41, "p0": 24, "rotary_dims": 32, "qk_norm": True,
         "softcap": 3.0, "window": 30, "scale": 0.2},
        *Q8_TEST_SHAPES,
        # Gemma 4 (E2B; its scale is 1, its learned q/k norms keeping q·k moderate, which these random norm
        # weights would not: a scale of 1/16 here): a global layer of 8 heads of 512 on one kv head (DSPLIT 8,
        # small tiles), q/k normed, v normed without a weight, a chat continued; a sliding one of 256 with its
        # window; the KV-sharing layers (q alone over the cache another layer appended), fp16 and int8
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 512, "m": 13, "p0": 6, "qk_norm": True, "v_norm": True,
         "scale": 0.0625, "rotary_dims": 128},
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 256, "m": 21, "p0": 3, "qk_norm": True, "v_norm": True,
         "scale": 0.0625, "window": 9, "kv": "q8"},
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 512, "m": 11, "p0": 4, "qk_norm": True, "q_only": True,
         "scale": 0.0625},
        {"n_heads": 4, "n_kv_heads": 2, "head_dim": 256, "m": 17, "p0": 0, "q_only": True, "kv": "q8",
         "window": 6, "scale": 0.0625},
        # gpt-oss (heads of 64, GQA 8): attention sinks on a sliding layer (a window shorter than the prompt, a
        # chat continued) and on a full one with the int8 cache
        {"n_heads": 16, "n_kv_heads": 2, "head_dim": 64, "m": 45, "p0": 7, "window": 24, "sinks": True},
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 64, "m": 19, "p0": 0, "sinks": True, "kv": "q8"},
    ),
    bytes_moved=bytes_moved,
    reference=reference.attention,
    fuzz_shapes=fuzz_shapes,
    oclgrind_shapes=(
        {"n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "m": 5, "p0": 3},
        {"n_heads": 4, "n_kv_heads": 1, "head_dim": 64, "m": 5, "p0": 3, "qk_norm": True, "rotary_dims": 32,
         "softcap": 3.0, "window": 4, "scale": 0.2},
        {"n_heads": 2, "n_kv_heads": 1, "head_dim": 32, "m": 3, "p0": 0, "rotary_dims": 0},
        {"n_heads": 4, "n_kv_heads": 1, "head_dim": 64, "m": 5, "p0": 3, "kv": "q8"},   # the int8 cache
        # Gemma 4: v normed in the append; a layer reading another's cache (no append)
        {"n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "m": 5, "p0": 3, "qk_norm": True, "v_norm": True},
        {"n_heads": 4, "n_kv_heads": 1, "head_dim": 64, "m": 4, "p0": 2, "q_only": True, "kv": "q8"},
    ),
    flops=flops,
    describe=lambda s: (f"H={s['n_heads']} Hkv={s['n_kv_heads']} D={s['head_dim']} m={s['m']} p0={s['p0']}"
                        + describe_features(s)),
)
