"""K-quant blocks for tests: gguf-py dequantizes Q4_K, Q5_K and Q6_K but has no quantizer for them.

``quantize_k(w, kind)`` packs W (N, K) round-to-nearest into llama.cpp's block layout (ggml-common.h:
block_q4_K, block_q5_K, block_q6_K); ``random_k_blocks`` makes blocks of random bits with finite scales,
which reach every bit position a reader must get right. Either way the truth a test compares against
is ``gguf.quants.dequantize`` of the bytes, llama.cpp's own definition, so a packing slip here could only
make a test model's weights noisier, never a reader's mistake pass.
"""

from __future__ import annotations

import numpy as np

from perfx.formats import Q4_K_BLOCK, Q5_K_BLOCK, Q6_K_BLOCK, QK_K

K_BLOCKS = {"Q4_K": Q4_K_BLOCK, "Q5_K": Q5_K_BLOCK, "Q6_K": Q6_K_BLOCK}


def _pack_scales_mins(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(…, 8) six-bit scales and mins -> (…, 12) bytes, the inverse of ggml's get_scale_min_k4."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((*sc.shape[:-1], 12), np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
    return out


def _pack_low_nibbles(q: np.ndarray) -> np.ndarray:
    """(…, 8, 32) codes (low 4 bits used) -> (…, 128) bytes: chunk c = sub-blocks 2c (low) and 2c + 1 (high)."""
    q = (q & 0x0F).astype(np.uint8).reshape(*q.shape[:-2], 4, 2, 32)
    return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*q.shape[:-3], 128)


def _asymmetric(w: np.ndarray, levels: int):
    """Super-blocks (B, 8, 32) -> (d, dmin, sc, mn, q) with w ≈ d·sc·q − dmin·mn."""
    low = np.minimum(w.min(axis=-1), 0.0)
    high = w.max(axis=-1)
    scale = np.maximum((high - low) / levels, 1e-12)
    minimum = -low
    d = (scale.max(axis=-1) / 63).astype(np.float16)
    dmin = (np.maximum(minimum.max(axis=-1), 1e-12) / 63).astype(np.float16)
    d32, dmin32 = np.maximum(d.astype(np.float32), 2**-24), np.maximum(dmin.astype(np.float32), 2**-24)
    sc = np.clip(np.rint(scale / d32[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(minimum / dmin32[:, None]), 0, 63).astype(np.uint8)
    s = (d.astype(np.float32)[:, None] * sc)[..., None]
    m = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    q = np.clip(np.rint((w + m) / np.maximum(s, 1e-30)), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def quantize_k(w: np.ndarray, kind: str) -> np.ndarray:
    """W (N, K), K a multiple of 256 -> raw blocks (N, K/256 · block bytes) uint8 of ``kind``."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    assert k % QK_K == 0, f"K = {k} is not a multiple of {QK_K}"
    blocks = np.zeros(n * k // QK_K, K_BLOCKS[kind])
    if kind in ("Q4_K", "Q5_K"):
        d, dmin, sc, mn, q = _asymmetric(w.reshape(-1, 8, 32), 15 if kind == "Q4_K" else 31)
        blocks["d"], blocks["dmin"] = d, dmin
        blocks["scales"] = _pack_scales_mins(sc, mn)
        blocks["qs"] = _pack_low_nibbles(q)
        if kind == "Q5_K":
            high = (q >> 4) & 1                                             # (B, 8, 32)
            blocks["qh"] = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[:, None], axis=1)
    else:  # Q6_K: 16 sub-blocks of 16, int8 scales, codes q − 32
        sub = w.reshape(-1, 16, 16)
        scale = np.maximum(np.abs(sub).max(axis=-1) / 31, 1e-12)
        d = (scale.max(axis=-1) / 127).astype(np.float16)
        d32 = np.maximum(d.astype(np.float32), 2**-24)
        sc = np.clip(np.rint(scale / d32[:, None]), 1, 127).astype(np.int8)
        s = (d.astype(np.float32)[:, None] * sc)[..., None]
        q = (np.clip(np.rint(sub / s), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)   # halves of 128
        low, high = q & 0x0F, q >> 4
        blocks["ql"] = (low[..., :64] | (low[..., 64:] << 4)).reshape(-1, 128)
        qh = high.reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[:, None]
        blocks["qh"] = np.bitwise_or.reduce(qh, axis=2).reshape(-1, 64)
        blocks["scales"], blocks["d"] = sc, d
    return blocks.view(np.uint8).reshape(n, -1)


def random_k_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks of random bits (every code, scale and min pattern) with finite, Llama-sized fp16 d and dmin."""
    dtype = K_BLOCKS[kind]
    count = n * k // QK_K
    blocks = np.frombuffer(rng.bytes(count * dtype.itemsize), dtype=dtype).copy()
    blocks["d"] = rng.uniform(1e-4, 2e-3, count).astype(np.float16)
    if kind != "Q6_K":
        blocks["dmin"] = rng.uniform(1e-4, 2e-3, count).astype(np.float16)
    return blocks.view(np.uint8).reshape(n, -1)
