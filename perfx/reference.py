"""numpy float64 references: the truth every kernel test, `perfx selftest` and the tuner compare against.

Everything here is plain, unoptimised and in float64, written to be read next to the maths. Shapes use
the kernels' names: N output features, K input features, M tokens, G the quantization group size,
H query heads, Hkv key/value heads, D head_dim, T positions in the cache.
"""

from __future__ import annotations

import math

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


def sigmoid(x) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-f64(x)))


def sigmoid_mul(gate, x) -> np.ndarray:
    """σ(gate)·x: Qwen3.5's gated attention output (the gate from the q projection's second half per head)."""
    return sigmoid(gate) * f64(x)


def rmsnorm_gated(x, z, gamma, eps: float = 1e-6) -> np.ndarray:
    """rmsnorm(x)·γ·SiLU(z) over the last axis: Qwen3.5's gated RMSNorm of the DeltaNet output per v head
    (transformers' Qwen3_5RMSNormGated, llama.cpp's build_norm_gated)."""
    return rmsnorm(x, gamma, eps) * silu(z)


def swiglu(gate, up) -> np.ndarray:
    """SiLU(gate)·up, the Llama MLP's activation."""
    return silu(gate) * f64(up)


SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0   # gpt-oss's clamped SwiGLU (llama.cpp's ggml_swiglu_oai)


def swiglu_oai(gate, up, alpha: float = SWIGLU_OAI_ALPHA, limit: float = SWIGLU_OAI_LIMIT) -> np.ndarray:
    """gpt-oss's gated activation: g = min(gate, limit), u = clamp(up, −limit, limit), g·σ(α·g)·(u + 1)
    (transformers' GptOssExperts, llama.cpp's ggml_swiglu_oai)."""
    g = np.minimum(f64(gate), limit)
    return g * sigmoid(alpha * g) * (np.clip(f64(up), -limit, limit) + 1.0)


def gelu_tanh(x) -> np.ndarray:
    """GELU's tanh form, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))): llama.cpp's ggml_gelu, Hugging Face's
    gelu_pytorch_tanh (Gemma's hidden_activation)."""
    x = f64(x)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def geglu(gate, up) -> np.ndarray:
    """GELU(gate)·up (tanh form), the Gemma MLP's activation."""
    return gelu_tanh(gate) * f64(up)


def per_layer_gate(gate, inputs, p: int, offset: int) -> np.ndarray:
    """GELU(gate)·inputs[:, offset:offset + p] (tanh form): Gemma 4's gate of a layer's per-layer input, its slice
    of each token's per-layer inputs (llama.cpp's gemma4: ggml_gelu of inp_gate·x, times inp_this_layer)."""
    return gelu_tanh(gate) * f64(inputs)[:, offset:offset + p]


def layer_scale(x, scale: float) -> np.ndarray:
    """x·scale: Gemma 4's residual stream times the layer's learned scalar (layer_output_scale)."""
    return f64(x) * float(scale)


def altup_router(x, gamma, w, mix, eps: float, plus: float) -> np.ndarray:
    """plus + mix·tanh(W·(rmsnorm(x)·γ)) per row (m, n_out): Gemma 3n's AltUp router (γ the router norm's over
    the hidden size, as llama.cpp's altup_compute_router_modalities scales it) and its prediction (A·A, A) or
    correction (A, A, plus 1) coefficients."""
    return float(plus) + np.tanh(rmsnorm(x, gamma, eps) @ f64(w).T) @ f64(mix).T


def altup_predict(streams, coefs) -> np.ndarray:
    """AltUp's prediction (A, m, k): each stream plus the streams mixed by the row's (A, A) coefficients
    (coefs (m, A·A), row-major j·A + i)."""
    s = f64(streams)
    a = s.shape[0]
    return s + np.einsum("mji,imk->jmk", f64(coefs).reshape(-1, a, a), s)


def altup_correct(pred, y, scale, gamma) -> tuple[np.ndarray, np.ndarray]:
    """AltUp's correction: every stream plus the active one's innovation y − pred[0] times the row's scale
    (m, A); and the corrected active stream times γ (the per-layer input's gate reads it)."""
    p = f64(pred)
    s = p + (f64(y) - p[0])[None] * f64(scale).T[:, :, None]
    return s, s[0] * f64(gamma)


def altup_add_normed(p, gamma, streams, first: int, eps: float) -> np.ndarray:
    """The streams from ``first`` on plus rmsnorm(p)·γ (the per-layer input into AltUp's other streams)."""
    s = f64(streams).copy()
    s[first:] += rmsnorm(p, gamma, eps)[None]
    return s


def altup_rescale(target, y, weight: float = 1.0) -> np.ndarray:
    """weight·y·|target|/|y| per row: a projection at its stream's magnitude (llama.cpp's calc_magnitude)."""
    y, target = f64(y), f64(target)
    return float(weight) * y * np.sqrt(np.sum(target * target, axis=-1, keepdims=True) / np.sum(y * y, axis=-1,
                                                                                                  keepdims=True))


def laurel_combine(a, l, act, xb, gamma_a, gamma_l, gamma_f, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Gemma 3n after the attention: h = (rmsnorm(a)·γ_a + act + xb + rmsnorm(l)·γ_l)/√2 (the attention's output
    through its post-norm, the active stream, and LAuReL's xb + norm(R·L·xb)), and rmsnorm(h)·γ_f."""
    h = (rmsnorm(a, gamma_a, eps) + f64(act) + f64(xb) + rmsnorm(l, gamma_l, eps)) / np.sqrt(2.0)
    return h, rmsnorm(h, gamma_f, eps)


def gaussian_top_k(gate, multiple: float) -> np.ndarray:
    """Gemma 3n's activation sparsity: ReLU(gate − (mean + multiple·std)) over each row, std over the n values
    (transformers' Gemma3nTextMLP._gaussian_topk: torch.std(unbiased=False); llama.cpp's gemma3n divides by n − 1)."""
    gate = f64(gate)
    cutoff = gate.mean(axis=-1, keepdims=True) + multiple * gate.std(axis=-1, keepdims=True)
    return np.maximum(gate - cutoff, 0.0)


def sparse_gate(gate_up, z: float) -> np.ndarray:
    """GELU(gaussian_top_k(gate, z))·up over rows of gate, then up (tanh GELU)."""
    gu = f64(gate_up)
    n = gu.shape[-1] // 2
    return gelu_tanh(gaussian_top_k(gu[..., :n], z)) * gu[..., n:]


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
# Sampling: the host sampler's distribution (perfx.generate.Sampler) and the device's counter-based draw


def apply_repetition_penalty(logits, previous_ids, penalty: float) -> np.ndarray:
    """CTRL-style penalty as in Hugging Face: positive logits divided, negative multiplied (float64)."""
    logits = np.array(logits, dtype=np.float64)
    if penalty == 1.0 or len(previous_ids) == 0:
        return logits
    ids = np.unique(np.asarray(previous_ids, dtype=np.int64))
    picked = logits[ids]
    logits[ids] = np.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def sampling_probs(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   min_p: float = 0.0) -> np.ndarray:
    """The distribution sampled from (float64): temperature, then top-k, top-p (nucleus) and min-p filters."""
    logits = np.asarray(logits, dtype=np.float64) / max(float(temperature), 1e-8)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    keep = np.ones_like(probs, dtype=bool)
    order = np.argsort(-probs, kind="stable")
    if top_k and top_k < len(probs):
        keep[order[top_k:]] = False
    if top_p < 1.0:
        cumulative = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (the token crossing it included)
        cut = int(np.searchsorted(cumulative, top_p, side="left")) + 1
        keep[order[cut:]] = False
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


PHILOX_M = (0xD2511F53, 0xCD9E8D57)   # Philox-4x32-10's multipliers (Salmon et al., SC 2011; Random123)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)   # its key increments (the golden ratio, √3 − 1)


def philox4x32(counter, key, rounds: int = 10) -> tuple[int, int, int, int]:
    """Philox-4x32-``rounds`` of four 32-bit counter words under two 32-bit key words: a block of four
    32-bit words, a function of (counter, key) alone (no state)."""
    c = [int(w) & 0xFFFFFFFF for w in counter]
    k0, k1 = (int(w) & 0xFFFFFFFF for w in key)
    for _ in range(rounds):
        p0, p1 = PHILOX_M[0] * c[0], PHILOX_M[1] * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & 0xFFFFFFFF, p1 & 0xFFFFFFFF,
             ((p0 >> 32) ^ c[3] ^ k1) & 0xFFFFFFFF, p0 & 0xFFFFFFFF]
        k0, k1 = (k0 + PHILOX_W[0]) & 0xFFFFFFFF, (k1 + PHILOX_W[1]) & 0xFFFFFFFF
    return tuple(c)


def sampling_uniform(seed: int, counter: int, position: int = 0) -> float:
    """The uniform in [0, 1) a draw uses: the top 24 bits of word 0 of Philox-4x32-10 under key = the seed's
    two 32-bit halves, counter = (the counter's two halves, position, 0), times 2⁻²⁴ (exact in float32)."""
    word = philox4x32((counter, counter >> 32, position, 0), (seed, seed >> 32))[0]
    return (word >> 8) * 2.0 ** -24


def draw_token(probs, u: float) -> int:
    """Inverse CDF in the sampler's order (probability descending, ties to the lower index): the first token
    whose cumulative probability exceeds u times the total."""
    probs = f64(probs)
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    rank = int(np.searchsorted(cumulative, u * cumulative[-1], side="right"))
    return int(order[min(rank, len(order) - 1)])


def allowed_tokens(mask, v: int) -> np.ndarray:
    """The tokens a bitmask allows (constrained decoding): token i where bit i mod 32 of word i / 32 is set
    (llguidance's layout), for i < v; a bool array of v."""
    words = np.asarray(mask).astype(np.uint32)
    return ((words[np.arange(v) // 32] >> (np.arange(v) % 32).astype(np.uint32)) & 1).astype(bool)


def logit_mask(logits, mask) -> np.ndarray:
    """The logits with every token the bitmask forbids at −∞ (float64): one row (V) and its mask, or rows
    (rows, V) and a mask a row (rows, ceil(V / 32))."""
    out = f64(logits).copy()
    rows = out.reshape(-1, out.shape[-1])   # a view of out
    for row, words in zip(rows, np.asarray(mask).reshape(len(rows), -1)):
        row[~allowed_tokens(words, len(row))] = -np.inf
    return out


def sample(logits, history, temperature: float, top_k: int, top_p: float, min_p: float, penalty: float,
           seed: int, counter: int, position: int = 0) -> int:
    """The token a draw at (seed, counter, position) chooses: from ``sampling_probs`` of the penalised logits,
    or, at temperature 0, their argmax."""
    penalised = apply_repetition_penalty(logits, history, penalty)
    if temperature == 0:
        return argmax(penalised)
    return draw_token(sampling_probs(penalised, temperature, top_k, top_p, min_p),
                      sampling_uniform(seed, counter, position))


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


def dequantize_q4_zeros(codes, scales, zeros, group: int) -> np.ndarray:
    """W (N, K) from the int4 zero-point forms: w = s·(q − z), one fp16 s and one integer z per group of G
    (AWQ's and GPTQ's maths; z = 8 for GGUF Q4_0 and symmetric checkpoints)."""
    codes = f64(codes)
    n, k = codes.shape
    s = np.repeat(f64(scales), group, axis=1)[:, :k]
    z = np.repeat(f64(zeros), group, axis=1)[:, :k]
    return s * (codes - z)


def quantize_activations_q8(x, block: int = 32) -> np.ndarray:
    """x as the int8-activation kernels see it (llama.cpp's Q8_0/Q8_1): per block of 32, codes
    round(x·127/max|x|) (ties to even, as OpenCL's rint) times max|x|/127, returned as float64 values."""
    blocks = f64(x).reshape(-1, block)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    inv = np.divide(127.0, amax, out=np.zeros_like(amax), where=amax > 0)
    return (np.rint(blocks * inv) * (amax / 127.0)).reshape(-1)


def q8_1_rounding_excess(y, codes, step_sum, texel_order: bool = True) -> float:
    """How far int8 blocks of y are from a correct Q8_1 quantization of it (0.0 where they are one): ``codes``
    (K int8 a row) hold each block of 32 as its even elements then its odd ones (``texel_order``: the order a q4
    texel holds its codes, kernels/q8_1.h), else in y's own order; ``step_sum`` (K/32 (step, sum) pairs a row).
    Each block's step must be max|y|/127, each code within half a step of its value (ties either way) and the
    sum Σ step·code, all to fp32's rounding; the result is the largest excess over those bounds, relative to the
    row's max |y| (NaN where a block was not written)."""
    y = f64(y).reshape(-1, 32)
    if texel_order:
        q = np.asarray(codes, np.int8).reshape(-1, 2, 16).astype(np.float64)
        values = np.empty_like(y)
        values[:, 0::2], values[:, 1::2] = q[:, 0], q[:, 1]
    else:
        values = np.asarray(codes, np.int8).reshape(-1, 32).astype(np.float64)
    step, total = (f64(step_sum).reshape(-1, 2)[:, i:i + 1] for i in (0, 1))
    amax = np.abs(y).max(axis=1, keepdims=True)
    fp32 = 2.0 ** -20   # a few fp32 roundings of the block's step and its 127/max
    excess = np.concatenate([
        np.abs(step * 127 - amax) - fp32 * amax,
        np.abs(values * step - y) - step * (0.5 + 128 * fp32),
        np.abs(total - step * values.sum(axis=1, keepdims=True)) - fp32 * step * np.abs(values).sum(axis=1,
                                                                                                    keepdims=True),
    ], axis=1)
    return float(np.max(np.maximum(excess, 0.0)) / max(float(amax.max()), 1e-30))


KV_BLOCK = 32   # values per fp16 scale in an int8 KV cache row (llama.cpp's QK8_0)


def quantize_kv_q8(x) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8, scales fp16) of x along its last axis in blocks of 32, by llama.cpp's q8_0 rule
    (ggml-quants.c quantize_row_q8_0_ref, the rule of its q8_0 KV cache): d = max|x|/127, q = round(x/d)
    with ties away from zero (roundf), d stored as fp16; a block of zeros has d = 0 and codes 0. In float64;
    a block holding NaN gets a NaN scale (codes 0), so a cache row it fills reads back as NaN."""
    x = f64(x)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // KV_BLOCK, KV_BLOCK)
    with np.errstate(invalid="ignore"):
        amax = np.abs(blocks).max(axis=-1, keepdims=True)
        d = amax / 127.0
        q = np.divide(blocks, d, out=np.zeros_like(blocks), where=d > 0)
        codes = np.where(np.isfinite(q), np.sign(q) * np.floor(np.abs(q) + 0.5), 0.0)
    return codes.astype(np.int8).reshape(x.shape), d[..., 0].astype(np.float16)


def dequantize_kv_q8(codes, scales) -> np.ndarray:
    """x̂ = q·d in float64, each fp16 scale d over its block of 32 codes along the last axis."""
    return f64(codes) * np.repeat(f64(scales), KV_BLOCK, axis=-1)


def kv_q8(x) -> np.ndarray:
    """x as an int8 KV cache holds it: quantized (``quantize_kv_q8``), then dequantized."""
    return dequantize_kv_q8(*quantize_kv_q8(x))


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

    Types: "linear" (all divided by ``factor``), "llama3" (Llama 3.1's scaling, transformers
    ``_compute_llama3_parameters``: wavelengths longer than original_max_position_embeddings /
    low_freq_factor are divided by ``factor``, shorter than … / high_freq_factor kept, and those between
    interpolated smoothly) and "yarn" (``yarn_inv_freq``; its attention factor scales the table). ``freq_factors`` (D/2 values, any type; a GGUF's rope_freqs tensor) divide the
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
    elif kind == "yarn":
        inv = yarn_inv_freq(inv, head_dim, theta, scaling)
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
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3, longrope, "
                         "yarn)")
    return inv if factors is None else inv / factors


def yarn_inv_freq(inv, head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """YaRN (Peng et al. 2023; transformers' ``_compute_yarn_parameters``, ggml's rope_yarn): each frequency
    between its extrapolated value (as trained) and its interpolated one (divided by ``factor``), by a linear ramp
    over the pair index from the dimension that turns ``beta_fast`` times over ``original_max_position_embeddings``
    positions (extrapolated below) to the one that turns ``beta_slow`` times (interpolated above). ``truncate``
    (default true; ggml always) rounds those two dimensions out to whole pairs first."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast", 32.0)), float(scaling.get("beta_slow", 1.0))

    def dimension(rotations):
        return head_dim * np.log(original / (rotations * 2 * np.pi)) / (2 * np.log(float(theta)))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0.0), min(high, head_dim - 1.0)
    ramp = np.clip((np.arange(inv.size) - low) / max(high - low, 1e-3), 0.0, 1.0)   # 0: extrapolate, 1: interpolate
    return inv / factor * ramp + inv * (1.0 - ramp)


def yarn_attention_factor(factor: float) -> float:
    """YaRN's magnitude correction of cos and sin, 0.1·ln(factor) + 1 (transformers' get_mscale, ggml's mscale)."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_tables(positions, head_dim: int, theta: float, scaling: dict | None = None):
    """cos and sin, each (len(positions), D/2): the table the kernels read."""
    angles = np.outer(f64(positions), rope_inv_freq(head_dim, theta, scaling))
    # LongRoPE's and YaRN's attention factor multiplies cos and sin (transformers' attention_scaling, llama.cpp's attn_factor)
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
              softcap: float = 0.0, sinks=None) -> np.ndarray:
    """softmax(q·Kᵀ·scale)·V with GQA; scale defaults to 1/√D.

    q (M, H, D) at absolute positions q_positions (M); k, v (T, Hkv, D) for positions 0..T−1.
    Query head h reads key/value head h // (H / Hkv). A ``softcap`` c > 0 (Gemma 2) maps each scaled score
    s to c·tanh(s/c) before the mask. With ``causal``, query at position p sees positions 0..p; a sliding
    ``window`` W > 0 keeps only the last W of them, p − W + 1..p (transformers' sliding-window mask: key j
    is seen when p − W < j ≤ p). ``sinks`` (H), gpt-oss's attention sinks: one more logit per head in each
    softmax's denominator, with no value (transformers' GptOssAttention, llama.cpp's ggml_soft_max_add_sinks).
    Returns (M, H, D).
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
    if sinks is None:
        return np.einsum("hmt,thd->mhd", softmax(scores, axis=-1), vh)
    sink = np.broadcast_to(f64(sinks)[:, None, None], (h, m, 1))
    weights = softmax(np.concatenate([scores, sink], axis=-1), axis=-1)[..., :t]
    return np.einsum("hmt,thd->mhd", weights, vh)



def attention_kv_q8(q, k, v, q_positions, **features) -> np.ndarray:
    """``attention`` over the keys and values an int8 KV cache holds: k and v quantized by ``quantize_kv_q8``
    and dequantized in float64 before attending."""
    return attention(q, kv_q8(k), kv_q8(v), q_positions, **features)

# ---------------------------------------------------------------------------------------------
# Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention), as llama.cpp computes it
#
# ggml_gated_delta_net (ggml/src/ggml-cpu/ops.cpp) per v head, state S (d_k × d_v), S[i][j] with i a key and
# j a value index, held transposed in memory, state[h][j][i] (the layout every function and kernel here
# uses: a value row j is d_k contiguous floats). Per token, with q, k L2-normalised (ggml_l2_norm in
# src/models/qwen35.cpp, x / max(‖x‖, eps)) and q scaled by 1/√d_k:
#     S ← exp(g)·S;   δ_j = β·(v_j − Σ_i S[i][j]·k_i);   S[i][j] += k_i·δ_j;   o_j = Σ_i S[i][j]·q_i.
# Head mapping of v head h to its q/k head: "tile" h mod Hk (llama.cpp: the GGUF converter reorders the v
# heads, _reorder_v_heads, so that a tiled repeat fits) or "interleave" h // (Hv / Hk) (transformers'
# repeat_interleave over a Hugging Face checkpoint).

HEAD_MAPS = ("tile", "interleave")


def l2_normalize(x, eps: float = 1e-6) -> np.ndarray:
    """x / max(‖x‖, eps) over the last axis: ggml_l2_norm (transformers: x·rsqrt(Σx² + eps), the same to
    ~eps/‖x‖²)."""
    x = f64(x)
    return x / np.maximum(np.sqrt(np.sum(x * x, axis=-1, keepdims=True)), eps)


def softplus(x) -> np.ndarray:
    return np.logaddexp(0.0, f64(x))


def gated_delta_gates(a, b, dt_bias, ssm_a) -> tuple[np.ndarray, np.ndarray]:
    """(g, β) from the projections' a and b (…, Hv): g = softplus(a + dt_bias)·ssm_a, β = sigmoid(b).

    ``ssm_a`` is −exp(A_log), as the GGUF stores it (transformers: −A_log.exp()); ``dt_bias`` the GGUF's
    ssm_dt.bias. g ≤ 0 is the log of the decay α = exp(g).
    """
    g = softplus(f64(a) + f64(dt_bias)) * f64(ssm_a)
    return g, 1.0 / (1.0 + np.exp(-f64(b)))


def delta_net_heads(n_k_heads: int, n_v_heads: int, head_map: str = "tile") -> np.ndarray:
    """The q/k head each v head reads (Hv,)."""
    if head_map not in HEAD_MAPS:
        raise ValueError(f"head_map {head_map!r} is not one of {HEAD_MAPS}")
    h = np.arange(n_v_heads)
    return h % n_k_heads if head_map == "tile" else h // (n_v_heads // n_k_heads)


def gated_delta_net_step(q, k, v, g, beta, state, head_map: str = "tile", scale: float | None = None,
                         eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """One token over all heads: q, k (Hk, d_k) as projected (normalised here), v (Hv, d_v), g and β (Hv),
    state (Hv, d_v, d_k). Returns (o (Hv, d_v), the new state); ``scale`` defaults to 1/√d_k."""
    q, k, v, g, beta = f64(q), f64(k), f64(v), f64(g), f64(beta)
    state = f64(state).copy()
    heads = delta_net_heads(q.shape[0], v.shape[0], head_map)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    qn, kn = l2_normalize(q, eps)[heads] * scale, l2_normalize(k, eps)[heads]   # (Hv, d_k)
    out = np.empty_like(v)
    for h in range(v.shape[0]):
        s = state[h] * np.exp(g[h])                      # (d_v, d_k): row j holds S[:, j]
        delta = beta[h] * (v[h] - s @ kn[h])
        s += np.outer(delta, kn[h])
        out[h] = s @ qn[h]
        state[h] = s
    return out, state


def gated_delta_net(q, k, v, g, beta, state=None, head_map: str = "tile", scale: float | None = None,
                    eps: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """The recurrence token by token over a sequence: q, k (T, Hk, d_k), v (T, Hv, d_v), g and β (T, Hv),
    state (Hv, d_v, d_k) or None (zeros). Returns (o (T, Hv, d_v), the final state)."""
    v = f64(v)
    state = np.zeros((v.shape[1], v.shape[2], f64(k).shape[2])) if state is None else f64(state)
    out = np.empty_like(v)
    for t in range(v.shape[0]):
        out[t], state = gated_delta_net_step(q[t], k[t], v[t], g[t], beta[t], state, head_map, scale, eps)
    return out, state


# ---------------------------------------------------------------------------------------------
# Weights of any form


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


# -- mixture of experts ----------------------------------------------------------------------------------------

MOE_GATINGS = ("softmax", "sigmoid", "softmax_weight")


def moe_route(logits, used: int, gating: str = "softmax", bias=None, norm: bool = False,
              scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The router's choice for each row of logits (M, E): (ids (M, used) int64, weights (M, used) float64).

    llama.cpp's build_moe_ffn (src/llama-graph.cpp): probabilities p = softmax(logits) ("softmax", Qwen3-MoE),
    σ(logits) ("sigmoid", LFM2-MoE) or the logits themselves ("softmax_weight", gpt-oss); the experts chosen
    by the largest p + bias (the selection bias is used only to choose), ties to the lower id; their weights
    p of the chosen, or for "softmax_weight" the softmax over the chosen logits; renormalised to sum 1 with
    ``norm`` (the sum clamped at 2⁻¹⁴, as llama.cpp clamps it); times ``scale``.
    """
    logits = f64(logits)
    if gating not in MOE_GATINGS:
        raise ValueError(f"gating {gating!r} is not one of {MOE_GATINGS}")
    probs = softmax(logits) if gating == "softmax" else sigmoid(logits) if gating == "sigmoid" else logits
    select = probs + (0.0 if bias is None else f64(bias))
    # a stable sort of −select: the larger first, equal ones by id
    ids = np.argsort(-select, axis=-1, kind="stable")[:, :used]
    weights = np.take_along_axis(probs, ids, axis=-1)
    if gating == "softmax_weight":
        weights = softmax(weights)
    if norm:
        weights = weights / np.maximum(weights.sum(axis=-1, keepdims=True), 2.0 ** -14)
    return ids, weights * scale


GLU_ACTIVATIONS = {"silu": swiglu, "gelu_tanh": geglu, "swiglu_oai": swiglu_oai}


def moe_experts(xb, ids, weights, gate_up, down, act: str = "silu", gate_up_bias=None,
                down_bias=None) -> np.ndarray:
    """Σ_j weights[r, j] · (down_e(act(gate_e·x_r, up_e·x_r)) + bd_e) over each row's chosen experts e = ids[r, j].

    ``gate_up[e]`` is expert e's (2·I, K) matrix, gate rows then up rows; ``down[e]`` its (hidden, I); host
    matrices in any form ``linear`` reads. ``act``: SiLU(g)·u, GELU(g)·u or gpt-oss's clamped ``swiglu_oai``;
    ``gate_up_bias`` (E, 2·I) and ``down_bias`` (E, hidden): gpt-oss's per-expert biases (None: none). Rows are
    gathered per expert, so each expert is dequantized once.
    """
    xb = f64(xb)
    out = np.zeros((xb.shape[0], down[0].shape[0]))
    glu = GLU_ACTIVATIONS[act]
    for e in np.unique(ids):
        rows, slots = np.nonzero(ids == e)
        h = linear(xb[rows], gate_up[e], None if gate_up_bias is None else gate_up_bias[e])
        inter = h.shape[1] // 2
        y = linear(glu(h[:, :inter], h[:, inter:]), down[e], None if down_bias is None else down_bias[e])
        np.add.at(out, rows, f64(weights)[rows, slots][:, None] * y)
    return out


def moe_shared_gate(x, gate, h) -> np.ndarray:
    """h (M, S) times σ(x·gate) a row, x (M, K), gate (K,): a shared expert's σ gate (Qwen3.5-MoE's
    shared_expert_gate, llama.cpp's ffn_gate_inp_shexp), applied to its act(gate)·up rows (the down product is
    linear, so this equals scaling its output)."""
    return f64(h) * sigmoid(f64(x) @ f64(gate))[:, None]


def moe_experts_down(h, ids, weights, down, down_bias=None) -> np.ndarray:
    """Σ_j weights[r, j] · (down_e(h[r, j]) + bd_e) over each row's chosen experts: the down half of ``moe_experts``
    from the experts' act(gate, up) rows h (M, used, I)."""
    h = f64(h)
    out = np.zeros((h.shape[0], down[0].shape[0]))
    for r in range(h.shape[0]):
        for j, e in enumerate(ids[r]):
            out[r] += f64(weights)[r, j] * linear(h[r, j:j + 1], down[e], None if down_bias is None else
                                                  down_bias[e])[0]
    return out
