// What both attention kernels do to q and k before attending, and to the scores (perfx/reference.py rmsnorm,
// rope and attention). HEAD_DIM (D) is defined by the kernel file, before this is included.
//
//   QK_NORM (Qwen3, Gemma 3): x ← x / √(mean(x²) + eps) · w over the D values of one head, the same w for
//            every head, before RoPE (transformers' q_norm / k_norm).
//   RoPE:    rotate-half (NeoX) over the first n_rot dimensions, pairs (i, i + n_rot/2), table rows of n_rot/2:
//            x'[i] = x[i]·cos − x[i+n_rot/2]·sin, x'[i+n_rot/2] = x[i+n_rot/2]·cos + x[i]·sin; dimensions from
//            n_rot on pass unchanged (partial rotary: Phi-3, Phi-4-mini); n_rot = 0 rotates none (NoPE:
//            SmolLM3's every fourth layer).
//   soft-cap (Gemma 2): s ← cap·tanh(s / cap) on the scaled score, before the mask; cap = 0 is off.
// n_rot, the table, w, eps and cap are launch arguments: one build serves layers that differ in them.

#ifndef PERFX_ATTENTION_H
#define PERFX_ATTENTION_H

#ifndef QK_NORM
#define QK_NORM 0  // per-head RMSNorm of q and k before RoPE (set by the wrapper from the model, not tuned)
#endif

#ifndef KV_Q8
#define KV_Q8 0  // an int8 KV cache, codes and fp16 scales per 32 (set by the wrapper from the cache, not tuned)
#endif

// The KV cache's element (perfx/ops/kv_cache.py): fp16 values, or int8 codes whose fp16 scales, one per
// KV_BLOCK codes along a row, sit in buffers of their own at element index / KV_BLOCK.
#define KV_BLOCK 32
#if KV_Q8
typedef char kv_t;
#else
typedef half kv_t;
#endif

// 1/d of a block whose largest magnitude is amax, d = amax/127 (0 for a block of zeros), by llama.cpp's q8_0
// rule (ggml-quants.c quantize_row_q8_0_ref): codes round(x·(1/d)) (round: ties away from zero, as roundf)
// from the fp32 d, which is stored as fp16.
inline float q8_inverse(const float d)
{
    return d > 0.0f ? 1.0f / d : 0.0f;
}

// 1 / √(mean(x²) + eps) over the D values of one head's row x.
inline float inverse_rms(const __global float* x, const float eps)
{
    float4 sum = (float4)0.0f;
    for (int i = 0; i < HEAD_DIM / 4; i++) {
        const float4 v = vload4(i, x);
        sum = fma(v, v, sum);
    }
    return rsqrt(((sum.s0 + sum.s1) + (sum.s2 + sum.s3)) / HEAD_DIM + eps);
}

// Pair i < D/2 of a row's dimensions: the rotation pair (i, i + n_rot/2) for i < n_rot/2, else two of the
// dimensions from n_rot on, which pass unchanged. The decode kernel spreads a row's pairs over work-items.
inline int2 pair_dims(const int i, const int n_rot)
{
    const int half_rot = n_rot / 2;
    const int past = n_rot + 2 * (i - half_rot);
    return i < half_rot ? (int2)(i, i + half_rot) : (int2)(past, past + 1);
}

// Dimensions dims (pair_dims) of one head's row x, normalised (QK_NORM: times f = inverse_rms(x) and w) and
// rotated by the table rows cos_p / sin_p of its position where they are a rotation pair.
inline float2 rope_pair(const __global float* x, const int2 dims, const float f, const __global float* w,
                        const __global float* cos_p, const __global float* sin_p, const int n_rot)
{
#if QK_NORM
    const float a = x[dims.x] * f * w[dims.x], b = x[dims.y] * f * w[dims.y];
#else
    const float a = x[dims.x], b = x[dims.y];
#endif
    if (dims.x >= n_rot) {
        return (float2)(a, b);
    }
    const float c = cos_p[dims.x], s = sin_p[dims.x];
    return (float2)(a * c - b * s, b * c + a * s);
}

// Element i of one head's row x, normalised and rotated as rope_pair does it: for the prefill kernel, whose
// work-items each hold a run of a row's dimensions.
inline float rope_element(const __global float* x, const int i, const float f, const __global float* w,
                          const __global float* cos_p, const __global float* sin_p, const int n_rot)
{
#if QK_NORM
#define NORMED(j) (x[j] * f * w[j])
#else
#define NORMED(j) x[j]
#endif
    const int half_rot = n_rot / 2;
    float y;
    if (i >= n_rot) {
        y = NORMED(i);
    } else if (i < half_rot) {
        y = NORMED(i) * cos_p[i] - NORMED(i + half_rot) * sin_p[i];
    } else {
        y = NORMED(i) * cos_p[i - half_rot] + NORMED(i - half_rot) * sin_p[i - half_rot];
    }
#undef NORMED
    return y;
}

// The soft-cap for cap > 0. Callers branch on cap > 0 around their loops rather than per score: a select per
// score would be compiled to a tanh per score whether the cap is on or not.
inline float soft_cap(const float s, const float cap)
{
    return cap * tanh(s / cap);
}

#endif
