// What the int4 GEMV kernels share, one kernel file per weight layout (gemv_q4_rows.cl: rows contiguous along
// K; gemv_q4_interleaved.cl: rows interleaved per texel): the maths, fp16 arithmetic, the rows a work-item
// owns, the per-texel products and the epilogue store.
//
// y (M) = W (N, K) · x (K) (+ bias), W int4 in perfx's device form (kernels/q4.h, perfx/ops/q4_weight.py):
//   codes: 32 per uint4 texel; scale_offset: (s, m) per group of G along K (Q4_SCALES); w = s·q + m.
// Per group: Σ_k (s·q_k + m)·x_k = s·Σ q_k x_k + m·Σ x_k, so the inner loop is one multiply-add per weight and
// Σ x_k is formed once per group and shared by the rows of a work-item. With HALF the codes are centred,
// Σ (s·(q_k − 8) + m + 8s)·x_k, and Σ (q_k − 8)·x_k is formed in half (cl_khr_fp16), one half8 multiply-add
// per 8 weights; each group's half sum joins an fp32 accumulator, so fp16 rounding never builds up across
// groups.
// Epilogues (EPILOGUE, kernels/epilogue.h, chosen by the wrapper, not tuned):
//   EPI_NONE:     y[o] = W[o]·x + bias[o]                            M = N (fused QKV too: rows concatenated)
//   EPI_SILU_MUL: y[o] = SiLU(W[o]·x + b[o]) · (W[M+o]·x + b[M+o])   M = N/2 (gate rows, then up rows)
//   EPI_GELU_MUL: y[o] = GELU(W[o]·x + b[o]) · (W[M+o]·x + b[M+o])   as SiLU·mul (GELU's tanh form)
// Shape contract: K multiple of G, G ∈ {32, 64, 128}; any M (rows past the end are clamped on load and not
// stored). One launch covers outputs [out_base, out_base + n_out); its gate rows start at row_a of weights
// `wa` and its up rows at row_b of `wb` (image2d row blocks: the wrapper splits launches at image boundaries,
// so a row block never straddles two images); n_rows is the weight's N (the interleaved layout's stride).
// Both kernels take the same arguments (GEMV_Q4_ARGS), so the wrapper launches either the same way.
//
// A kernel file defines LAYOUT, ROWS, HALF, GROUP, EPILOGUE and ROW_STRIDE (how far apart the outputs of one
// work-item are: 1, or its work-group's width) before it includes this.

#ifndef PERFX_GEMV_Q4_H
#define PERFX_GEMV_Q4_H

#include "epilogue.h"
#include "q4.h"

#if HALF
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
typedef half8 dot8;                       // the per-group dot product's type
#define DOT_X(v) convert_half8(v)         // x as the dot product reads it
#define DOT_CODES(bits) CODES_H(bits)
#define DOT_FLOAT(v) convert_float8(v)
#define OFFSET(sm) ((sm).y + 8.0f * (sm).x) // the centred codes move 8·s into the offset
#else
typedef float8 dot8;
#define DOT_X(v) (v)
#define DOT_CODES(bits) CODES_F(bits)
#define DOT_FLOAT(v) (v)
#define OFFSET(sm) ((sm).y)
#endif

#define TEXELS_PER_GROUP (GROUP / 32)
#if EPI_GATED
#define WROWS (2 * ROWS)   // gate rows 0..ROWS−1, then up rows
#else
#define WROWS ROWS
#endif

#define GEMV_Q4_ARGS                                                                                        \
    const int n_out, const int k, const int out_base, const int half_rows, const int row_a, const int row_b, \
    const int n_rows, CODES_T wa, CODES_T wb, __global const half* restrict scale_offset,                    \
    __global const float* restrict bias, const int has_bias, __global const float* restrict x,               \
    __global float* restrict y

#if EPI_GATED
#define LOAD_ROW(r, t) ((r) < ROWS ? TEXEL(wa, wrow[r], t) : TEXEL(wb, wrow[r], t))
#else
#define LOAD_ROW(r, t) TEXEL(wa, wrow[r], t)
#endif

// The weight rows (within wa / wb) and global rows (for scales and bias) of the WROWS rows of the work-item
// whose first output is `first`. Outputs past n_out read the last valid row again (harmless) and are not
// stored.
inline void own_rows(const int first, const int n_out, const int out_base, const int half_rows,
                     const int row_a, const int row_b, int* wrow, int* grow)
{
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int o = min(first + r * ROW_STRIDE, n_out - 1);
        wrow[r] = row_a + o;
        grow[r] = out_base + o;
#if EPI_GATED
        wrow[ROWS + r] = row_b + o;
        grow[ROWS + r] = half_rows + out_base + o;
#endif
    }
}

// One texel of every row: dot[r] += codes · x for the 32 x values f0..f3 (x[32t + 8c + j] pairs with
// component c of the texel, j = 0..7).
#define TEXEL_DOTS(t, f0, f1, f2, f3)                                                                \
    {                                                                                               \
        const dot8 x0 = DOT_X(f0), x1 = DOT_X(f1), x2 = DOT_X(f2), x3 = DOT_X(f3);                  \
        _Pragma("unroll") for (int r = 0; r < WROWS; ++r) {                                         \
            const uint4 tex = LOAD_ROW(r, t);                                                       \
            dot[r] += (DOT_CODES(tex.x) * x0 + DOT_CODES(tex.y) * x1)                               \
                    + (DOT_CODES(tex.z) * x2 + DOT_CODES(tex.w) * x3);                              \
        }                                                                                           \
    }

// The end of group g: acc8[r] += s·(q·x per lane) + m·(x per lane) (xsum: the group's x summed in 8 lanes),
// two multiply-adds 8 wide; the lanes are summed once, after the last group (LANE_SUMS): a sum of 8 lanes per
// group and row costs as much as a 32-weight group's products.
#define GROUP_SUMS(g, xsum)                                                                          \
    {                                                                                               \
        _Pragma("unroll") for (int r = 0; r < WROWS; ++r) {                                         \
            const float2 sm = GROUP_SM(scale_offset, grow[r], g);                      \
            acc8[r] = DOT_FLOAT(dot[r]) * sm.x + ((xsum) * OFFSET(sm) + acc8[r]);                   \
        }                                                                                           \
    }

// The 8-lane accumulators GROUP_SUMS adds to, and their sums (into acc) after the last group.
#define LANE_ACCUMULATORS \
    float8 acc8[WROWS];   \
    _Pragma("unroll") for (int r = 0; r < WROWS; ++r) acc8[r] = (float8)(0.0f);
#define LANE_SUMS _Pragma("unroll") for (int r = 0; r < WROWS; ++r) acc[r] += SUM8(acc8[r]);

// y for the work-item's outputs: the bias where the weight has one, then the epilogue.
inline void store_outputs(const float* acc, const int* grow, const int first, const int n_out,
                          const int out_base, __global const float* restrict bias, const int has_bias,
                          __global float* restrict y)
{
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int o = first + r * ROW_STRIDE;
        if (o >= n_out) break;
        float v = acc[r] + (has_bias ? bias[grow[r]] : 0.0f);
#if EPI_GATED
        const float up = acc[ROWS + r] + (has_bias ? bias[grow[ROWS + r]] : 0.0f);
        v = GATE_ACT(v) * up;
#endif
        y[out_base + o] = v;
    }
}

#endif  // PERFX_GEMV_Q4_H
