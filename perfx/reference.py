"""numpy float64 references: the truth every kernel test, `perfx selftest` and the tuner compare against.

Everything here is plain, unoptimised and in float64, written to be read next to the maths. Shapes use
the kernels' names: N output features, K input features, M tokens, G the quantization group size,
H query heads, Hkv key/value heads, D head_dim, T positions in the cache.
"""

from __future__ import annotations

import numpy as np


def f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# Normalisation and activations


def rmsnorm(x, gamma, eps: float = 1e-5) -> np.ndarray:
    """y = x / sqrt(mean(x²) + eps) · γ, over the last axis."""
    x = f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * f64(gamma)


def rmsnorm_residual(x, residual, gamma, eps: float = 1e-5) -> tuple[np.ndarray, np.ndarray]:
    """h = x + residual (the new residual stream) and y = rmsnorm(h)·γ."""
    h = f64(x) + f64(residual)
    return h, rmsnorm(h, gamma, eps)


def rmsnorm_post_residual(p, x, post_gamma, next_gamma, eps: float = 1e-5) -> tuple[np.ndarray, np.ndarray]:
    """Gemma's sandwich norms: h = x + rmsnorm(p)·γ_post (the new residual stream), y = rmsnorm(h)·γ_next."""
    h = f64(x) + rmsnorm(p, post_gamma, eps)
    return h, rmsnorm(h, next_gamma, eps)


def silu(x) -> np.ndarray:
    x = f64(x)
    with np.errstate(over="ignore"):   # exp(−x) = inf for x ≪ 0: x / inf = −0, the right limit
        return x / (1.0 + np.exp(-x))


def swiglu(gate, up) -> np.ndarray:
    """SiLU(gate)·up, the Llama MLP's activation."""
    return silu(gate) * f64(up)


def gelu_tanh(x) -> np.ndarray:
    """GELU's tanh form, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))): llama.cpp's ggml_gelu, Hugging Face's
    gelu_pytorch_tanh (Gemma's hidden_activation)."""
    x = f64(x)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def geglu(gate, up) -> np.ndarray:
    """GELU(gate)·up (tanh form), the Gemma MLP's activation."""
    return gelu_tanh(gate) * f64(up)


def softcap(x, cap: float) -> np.ndarray:
    """cap·tanh(x / cap): Gemma 2's soft-capping of the final logits (final_logit_softcapping)."""
    return cap * np.tanh(f64(x) / cap)


def short_conv(x, weight, history=None, gated: bool = True, act: str = "none"):
    """The causal depthwise convolution of length L over m new positions, and the state it leaves.

    ``x`` (m, 3H) rows [B | C | x] (LFM2's in_proj output, ``gated``) or (m, H); ``weight`` (H, L);
    ``history`` (L − 1, H): u of the L − 1 positions before these, oldest first (None: zeros, the start).
    u = B·x (gated) or x; y[t] = Σ_i w[:, i]·u[t − L + 1 + i], then C·y (gated) or act(y) ("none", "silu").
    Returns (y (m, H), the new history (L − 1, H)): PyTorch's conv1d with padding L − 1, cut to m (LFM2's
    slow_forward), and llama.cpp's ggml_ssm_conv over the state and the new columns.
    """
    x, weight = f64(x), f64(weight)
    h, length = weight.shape
    b, c, v = (x[:, :h], x[:, h:2 * h], x[:, 2 * h:]) if gated else (None, None, x)
    u = b * v if gated else v
    past = np.zeros((length - 1, h)) if history is None else f64(history)
    seq = np.concatenate([past, u])
    y = np.stack([(seq[t:t + length] * weight.T).sum(axis=0) for t in range(len(u))])
    y = c * y if gated else (silu(y) if act == "silu" else y)
    return y, seq[len(seq) - (length - 1):]


def argmax(x) -> int:
    """The index of the largest element, the lowest index on a tie: greedy sampling's choice."""
    return int(np.argmax(f64(x)))


def softmax(x, axis: int = -1) -> np.ndarray:
    x = f64(x)
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


# ---------------------------------------------------------------------------------------------
# 4-bit weights and matrix products


def dequantize_q4(codes, scales, offsets, group: int) -> np.ndarray:
    """W (N, K) from the device form: w = s·q + m, one (s, m) per group of G along K.

    codes (N, K) in [0, 15] (int4 form) or [−128, 127] (int8 form: the same maths); scales and offsets (N, K/G).
    """
    codes = f64(codes)
    n, k = codes.shape
    s = np.repeat(f64(scales), group, axis=1)[:, :k]
    m = np.repeat(f64(offsets), group, axis=1)[:, :k]
    return s * codes + m


def quantize_activations_q8(x, block: int = 32) -> np.ndarray:
    """x as the int8-activation kernels see it (llama.cpp's Q8_0/Q8_1): per block of 32, codes
    round(x·127/max|x|) (ties to even, as OpenCL's rint) times max|x|/127, returned as float64 values."""
    blocks = f64(x).reshape(-1, block)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    inv = np.divide(127.0, amax, out=np.zeros_like(amax), where=amax > 0)
    return (np.rint(blocks * inv) * (amax / 127.0)).reshape(-1)


def gemv(w, x, bias=None) -> np.ndarray:
    """y (N) = W (N, K) · x (K) (+ bias)."""
    y = f64(w) @ f64(x)
    return y if bias is None else y + f64(bias)


def gemm(x, w, bias=None) -> np.ndarray:
    """Y (M, N) = X (M, K) · Wᵀ, W (N, K) (+ bias)."""
    y = f64(x) @ f64(w).T
    return y if bias is None else y + f64(bias)


# ---------------------------------------------------------------------------------------------
# RoPE and attention


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """Inverse frequencies θ^(−2i/D), i < D/2, with ``rope_scaling`` applied.

    Types: "linear" (all divided by ``factor``) and "llama3" (Llama 3.1's scaling, transformers
    ``_compute_llama3_parameters``: wavelengths longer than original_max_position_embeddings /
    low_freq_factor are divided by ``factor``, shorter than … / high_freq_factor kept, and those between
    interpolated smoothly). ``freq_factors`` (D/2 values, any type; a GGUF's rope_freqs tensor) divide the
    frequencies pair by pair, as llama.cpp's ggml_rope_ext does with its freq_factors: Llama 3.x GGUFs
    carry their "llama3" scaling that way, as divisors computed by the converter.
    """
    inv = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if not scaling:
        return inv
    factors = scaling.get("freq_factors")
    if factors is not None:
        factors = np.asarray(factors, dtype=np.float64)
        if factors.shape != inv.shape:
            raise ValueError(f"freq_factors has {factors.size} values; head_dim {head_dim} needs {inv.size}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        pass
    elif kind == "linear":
        inv = inv / float(scaling["factor"])
    elif kind == "longrope":
        pass   # Phi-3: its chosen (short or long) factors come as freq_factors; the attention factor scales the table
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * np.pi / inv
        smooth = (original / wavelen - low) / (high - low)
        scaled = np.where(wavelen > original / low, inv / factor, inv)
        between = (wavelen <= original / low) & (wavelen >= original / high)
        inv = np.where(between, (1 - smooth) * inv / factor + smooth * inv, scaled)
    else:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, longrope)")
    return inv if factors is None else inv / factors


def rope_tables(positions, head_dim: int, theta: float, scaling: dict | None = None):
    """cos and sin, each (len(positions), D/2): the table the kernels read."""
    angles = np.outer(f64(positions), rope_inv_freq(head_dim, theta, scaling))
    # LongRoPE's attention factor multiplies cos and sin (transformers' attention_scaling, llama.cpp's attn_factor)
    factor = float((scaling or {}).get("attention_factor", 1.0))
    return np.cos(angles) * factor, np.sin(angles) * factor


def rope(x, positions, theta: float, scaling: dict | None = None, rotary_dims: int | None = None) -> np.ndarray:
    """Rotate-half RoPE (Hugging Face ``rotate_half``) on x (..., M, heads, D) at positions (M).

    Over the first n = ``rotary_dims`` dimensions (default D; Phi-3's partial rotary) pairs are (i, i + n/2):
    out[i] = x[i]·cos − x[i+n/2]·sin, out[i+n/2] = x[i+n/2]·cos + x[i]·sin; dimensions from n on pass through.
    llama.cpp's converter permutes the rows of Wq and Wk of Llama-style models so that its interleaved RoPE
    (pairs (2i, 2i+1)) gives the same result; perfx undoes that permutation when loading a GGUF
    (``unpermute_qk``) and uses the rotate-half convention everywhere.
    """
    x = f64(x)
    n = x.shape[-1] if rotary_dims is None else int(rotary_dims)
    cos, sin = rope_tables(positions, n, theta, scaling)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    x1, x2 = x[..., : n // 2], x[..., n // 2:n]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., n:]], axis=-1)


def permute_qk(w, n_heads: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf`` permutation of Wq/Wk rows (HF order -> GGUF order)."""
    w = np.asarray(w)
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w, n_heads: int) -> np.ndarray:
    """Inverse of ``permute_qk``: GGUF row order back to Hugging Face's rotate-half order."""
    w = np.asarray(w)
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def attention(q, k, v, q_positions, causal: bool = True, window: int = 0, scale: float | None = None,
              softcap: float = 0.0) -> np.ndarray:
    """softmax(q·Kᵀ·scale)·V with GQA; scale defaults to 1/√D.

    q (M, H, D) at absolute positions q_positions (M); k, v (T, Hkv, D) for positions 0..T−1.
    Query head h reads key/value head h // (H / Hkv). A ``softcap`` c > 0 (Gemma 2) maps each scaled score
    s to c·tanh(s/c) before the mask. With ``causal``, query at position p sees positions 0..p; a sliding
    ``window`` W > 0 keeps only the last W of them, p − W + 1..p (transformers' sliding-window mask: key j
    is seen when p − W < j ≤ p). Returns (M, H, D).
    """
    q, k, v = f64(q), f64(k), f64(v)
    m, h, d = q.shape
    t, hkv, _ = k.shape
    group = h // hkv
    kh = np.repeat(k, group, axis=1)  # (T, H, D)
    vh = np.repeat(v, group, axis=1)
    scores = np.einsum("mhd,thd->hmt", q, kh) * (1.0 / np.sqrt(d) if scale is None else scale)
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    if causal or window:
        keys, queries = np.arange(t)[None, :], np.asarray(q_positions)[:, None]
        visible = keys <= queries if causal else np.ones((m, t), bool)   # (M, T)
        if window:
            visible &= keys > queries - window
        scores = np.where(visible[None], scores, -np.inf)
    return np.einsum("hmt,thd->mhd", softmax(scores, axis=-1), vh)


# ---------------------------------------------------------------------------------------------
# The whole model: a float64 Llama forward over a perfx.sources.ModelSource (the end-to-end truth)


class ReferenceCache:
    """What a forward keeps of positions 0..T−1: keys and values per attention layer ((T, Hkv, D) float64
    each), and per conv layer the short convolution's state (its last L − 1 inputs)."""

    def __init__(self, n_layers: int):
        self.keys: list[np.ndarray | None] = [None] * n_layers
        self.values: list[np.ndarray | None] = [None] * n_layers
        self.conv: list[np.ndarray | None] = [None] * n_layers
        self.length = 0

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.keys[layer] is not None:
            k, v = np.concatenate([self.keys[layer], k]), np.concatenate([self.values[layer], v])
        self.keys[layer], self.values[layer] = k, v
        return k, v


def linear(x, w, bias=None, rows_per_chunk: int = 8192) -> np.ndarray:
    """Y (M, N) = X (M, K) · Wᵀ (+ bias) for W an ndarray or the int4 or int8 form (Q4Matrix, Q8Matrix).

    W is widened to float64 a block of rows at a time: a float64 copy of a whole 7B lm_head is 1 GB.
    """
    x = f64(x)
    n = w.shape[0]
    y = np.empty((x.shape[0], n))
    for start in range(0, n, rows_per_chunk):
        stop = min(start + rows_per_chunk, n)
        block = w.rows(start, stop).dequantize() if hasattr(w, "dequantize") else f64(w[start:stop])
        y[:, start:stop] = x @ block.T
    return y if bias is None else y + f64(bias)


def embed(embedding, tokens) -> np.ndarray:
    """Rows of the embedding table (an fp16 ndarray, or the int4 or int8 form) for each token."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if hasattr(embedding, "dequantize"):
        return np.stack([embedding.rows(t, t + 1).dequantize()[0] for t in tokens])
    return f64(embedding[tokens])


def _ffn(x, w, c, gate):
    """ffn rmsnorm, the gated MLP (gate rows first, then up) and the residual (through its post-norm)."""
    xb = rmsnorm(x, w.ffn_norm, c.rms_eps)
    gate_up = linear(xb, w.gate_up)
    n_inter = c.intermediate_size
    out = linear(gate(gate_up[:, :n_inter]) * gate_up[:, n_inter:], w.down)
    return x + (rmsnorm(out, w.post_ffn_norm, c.rms_eps) if c.post_norms else out)


def model_forward(source, tokens, start_pos: int = 0, cache: ReferenceCache | None = None, ctx: int | None = None):
    """Logits (M, V) float64 for M tokens at positions start_pos.., and the updated cache.

    ``source`` is a perfx.sources.ModelSource (weights read layer by layer, dequantized to float64);
    ``cache`` holds positions 0..start_pos−1 (None: a new one, start_pos must then be 0). The forward follows
    the config's recipe (``perfx.config``): the maths of transformers' Llama, Mistral, Qwen2, Qwen3, Gemma 2,
    Gemma 3, Phi-3, SmolLM3 and LFM2 models. ``ctx`` is the context the model runs in (LongRoPE picks its factors
    by it); None: the positions this call reaches.
    """
    c = source.config
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    m, h, hkv, d = len(tokens), c.n_heads, c.n_kv_heads, c.head_dim
    q_dim, kv_dim = h * d, hkv * d
    cache = ReferenceCache(c.n_layers) if cache is None else cache
    if cache.length != start_pos:
        raise ValueError(f"cache holds {cache.length} positions but start_pos is {start_pos}")
    positions = np.arange(start_pos, start_pos + m)
    ctx = start_pos + m if ctx is None else ctx
    gate = gelu_tanh if c.ffn_activation == "gelu_tanh" else silu

    embedding = source.embedding()
    x = embed(embedding, tokens) * c.embedding_scale  # (M, hidden) residual stream
    for i in range(c.n_layers):
        w, recipe = source.layer(i), c.layer(i, ctx)
        # attention (or conv) rmsnorm
        xb = rmsnorm(x, w.attn_norm, c.rms_eps)
        if recipe.kind == "conv":
            # LFM2's gated short convolution between its in- and out-projections, then the residual
            y, cache.conv[i] = short_conv(linear(xb, w.conv_in), w.conv_weight, cache.conv[i])
            x = x + linear(y, w.conv_out)
            x = _ffn(x, w, c, gate)
            continue
        # q, k, v for these positions from the fused projection
        qkv = linear(xb, w.qkv, w.qkv_bias)
        q = qkv[:, :q_dim].reshape(m, h, d)
        k = qkv[:, q_dim:q_dim + kv_dim].reshape(m, hkv, d)
        v = qkv[:, q_dim + kv_dim:].reshape(m, hkv, d)
        # per-head q and k norms (Qwen3, Gemma 3), then RoPE where the layer has it (rotate-half)
        if c.qk_norm:
            q, k = rmsnorm(q, w.q_norm, c.rms_eps), rmsnorm(k, w.k_norm, c.rms_eps)
        if recipe.rope is not None:
            r = recipe.rope
            q = rope(q, positions, r.theta, r.scaling, rotary_dims=r.dims)
            k = rope(k, positions, r.theta, r.scaling, rotary_dims=r.dims)
        # append k, v to the cache; causal GQA attention over everything cached
        keys, values = cache.append(i, k, v)
        att = attention(q, keys, values, positions, window=recipe.window, scale=c.scale,
                        softcap=c.attn_softcap).reshape(m, q_dim)
        # output projection (its own norm first where the recipe has post-norms), residual back into x
        out = linear(att, w.o)
        x = x + (rmsnorm(out, w.post_attn_norm, c.rms_eps) if c.post_norms else out)
        x = _ffn(x, w, c, gate)
    cache.length += m
    # final rmsnorm and the classifier (the embedding itself when tied)
    x = rmsnorm(x, source.final_norm(), c.rms_eps)
    head = source.lm_head()
    logits = linear(x, embedding if head is None else head)
    if c.final_softcap:
        logits = c.final_softcap * np.tanh(logits / c.final_softcap)
    return logits, cache
