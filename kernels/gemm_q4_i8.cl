// Int4 GEMM for a few rows with int8 activations: the batched decode step (one row a sequence, M = 2..16) and
// short prompt chunks, with the same products and epilogues as gemm_q4_skinny.cl's,
//
//   Y (M, N) = X (M, K) · Wᵀ              EPI_NONE
//   Y (M, N) = X (M, K) · Wᵀ + bias (N)   EPI_BIAS
//   Y (M, I) = SiLU(X · Wgᵀ) · (X · Wuᵀ)  EPI_SILU_MUL (W has 2·I rows, gate 0..I−1, up I..2I−1)
//   Y (M, I) = GELU(X · Wgᵀ) · (X · Wuᵀ)  EPI_GELU_MUL
//
// W (N, K) in perfx's device form (kernels/q4.h); Y and bias float32, row-major. X arrives quantized, as the
// rows-I8 GEMV's x does (kernels/gemv_q4_rows.cl): gemm_q4_i8_quantize_x turns X (M, K) into int8 codes per
// block of 32 (llama.cpp's Q8_1: q = rint(x·127/max|x|), the block's step d = max|x|/127 and Σ d·q), each block
// as its even elements then its odd ones (the order a texel holds its low and high nibbles). Per group of a
// weight row, Σ_k (s·q_k + m)·x_k ≈ s·Σ_b d_b·Σ_{k∈b} q_k·q_x,k + m·Σ_b d_b·Σ q_x: the integer
// products need no conversion of the weight to float at all.
//
// Why a kernel of its own: the fp32 GEMMs dequantize each weight (shift, mask, convert, s·q + m) and then
// multiply it into each row of X, so on a CPU a few rows cost nearly what as many GEMVs do. Here a work-item
// unpacks a texel of each of its weight rows once (an AND, or a shift and an AND, frees 16 codes, widened to
// short) and applies it to the MT rows of X of its pass: per row of X and texel, 32 integer products summed in
// neighbouring pairs (the pattern x86 compilers turn into vpmaddwd) into 8 int lanes, converted and scaled by
// d·s in one fp32 multiply-add. The weight is read once a pass; the rows of X are short (int8).
//
// On a GPU a work-item owns ROWS whole weight rows, as gemm_q4_skinny's do (each texel read once, no local
// memory, no barriers); the rows of a work-group are neighbours, so an interleaved weight's reads coalesce.
//
// Shape contract (as gemm_q4_skinny): K a multiple of 32 and of G ∈ {32, 64, 128} (group_shift = log2(G / 32));
// any M ≥ 1 (passes of MT rows, the remainder in passes of 8, 4, 2, 1: kernels/m_passes.h) and any number of
// columns (edges guarded). One launch covers the columns y_col0 .. y_col0 + n_cols − 1 of Y (row stride ldy);
// their weight rows start at row_a0 (gate or only) and row_b0 (up), which lie in codes_a / codes_b at
// row − base_a / row − base_b (images hold row blocks; with a buffer both bases are 0). Scales and bias are
// indexed by global row. Work-group (WGS); global ⌈n_cols / (ROWS·WGS)⌉·WGS.

#ifndef WGS
#define WGS 16  // work-items per work-group, each independent (ROWS columns apiece)
#endif
#ifndef ROWS
#define ROWS 2  // output columns per work-item: each texel of X is loaded once and applied to ROWS rows
#endif
#ifndef MT
#define MT 4  // rows of X per pass: ROWS·MT float8 accumulators (twice for gate-up), a power of two
#endif
#ifndef READ
#define READ 0  // 0: codes from a uint4 buffer; 1: image2d_t row blocks; 2: an image1d_buffer_t view of the buffer
#endif
#ifndef LAYOUT
#define LAYOUT 0  // the weight's layout (kernels/q4.h): 0 rows along K, 1 interleaved (set from the weight)
#endif
#ifndef EPILOGUE
#define EPILOGUE EPI_NONE  // none, + bias[column], or SiLU / GELU (gate)·up (kernels/epilogue.h)
#endif

#include "epilogue.h"

#if EPI_GATED
#define WROWS (2 * ROWS)  // gate rows 0..ROWS−1, up rows ROWS..2·ROWS−1
#else
#define WROWS ROWS
#endif

#include "q4.h"
#include "int_pairs.h"

// X (count = M·K floats, K a multiple of 32, so no block straddles two rows) quantized per block of 32, one
// work-item a block: xq[2b] the block's even elements, xq[2b + 1] its odd ones, x_step_sum[b] = (d, Σ d·q).
// An all-zero block has d = 0 and codes 0.
__kernel void gemm_q4_i8_quantize_x(const int count, __global const float* restrict x,
                                    __global char16* restrict xq, __global float2* restrict x_step_sum)
{
    const int b = get_global_id(0);
    if (b >= count / 32) return;
    const float8 v0 = vload8(4 * b, x), v1 = vload8(4 * b + 1, x);
    const float8 v2 = vload8(4 * b + 2, x), v3 = vload8(4 * b + 3, x);
    const float8 m8 = fmax(fmax(fabs(v0), fabs(v1)), fmax(fabs(v2), fabs(v3)));
    const float4 m4 = fmax(m8.lo, m8.hi);
    const float amax = fmax(fmax(m4.s0, m4.s1), fmax(m4.s2, m4.s3));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const float8 r0 = rint(v0 * inv), r1 = rint(v1 * inv), r2 = rint(v2 * inv), r3 = rint(v3 * inv);
    const float8 sum8 = (r0 + r1) + (r2 + r3);
    xq[2 * b] = (char16)(convert_char4_sat(r0.even), convert_char4_sat(r1.even),
                         convert_char4_sat(r2.even), convert_char4_sat(r3.even));
    xq[2 * b + 1] = (char16)(convert_char4_sat(r0.odd), convert_char4_sat(r1.odd),
                             convert_char4_sat(r2.odd), convert_char4_sat(r3.odd));
    x_step_sum[b] = (float2)(amax / 127.0f, SUM8(sum8) * (amax / 127.0f));
}

// r is a compile-time constant after unrolling: gate (or only) rows from codes_a, up rows from codes_b.
#define TEXEL_OF(r, t) ((r) < ROWS ? TEXEL(codes_a, wrow[r], t) : TEXEL(codes_b, wrow[r], t))

#if EPILOGUE == EPI_BIAS
#define EPILOGUE_STORE const float out = ya + bias[grow[r]];
#elif EPI_GATED
#define EPILOGUE_STORE                                            \
    const float yb = SUM8(acc[ROWS + r][mm]) + off[ROWS + r][mm]; \
    const float out = GATE_ACT(ya) * yb;
#else
#define EPILOGUE_STORE const float out = ya;
#endif

// One pass over K for the R rows of X from m0 (R a compile-time constant), then the epilogue and the stores.
// Per texel and row of X: 32 products |q·q_x| ≤ 15·127, a pair's sum fits int16 and the texel's int32, summed
// in 8 int lanes, then fp32 times d·s; per group and row of X the offset m·Σ d·q_x in a scalar.
#define PASS(R)                                                                                           \
    {                                                                                                     \
        float8 acc[WROWS][R];                                                                             \
        float off[WROWS][R];                                                                              \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                                 \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                            \
                acc[r][mm] = (float8)0.0f;                                                                \
                off[r][mm] = 0.0f;                                                                        \
            }                                                                                             \
        const __global char16* xqp = xq + (size_t)m0 * 2 * texels;                                        \
        const __global float2* xdp = x_step_sum + (size_t)m0 * texels;                                    \
        for (int g = 0; g < groups; g++) {                                                                \
            float2 sm[WROWS];                                                                             \
            _Pragma("unroll") for (int r = 0; r < WROWS; r++) sm[r] = GROUP_SM(scale_offset, grow[r], g); \
            float xsum[R];                                                                                \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) xsum[mm] = 0.0f;                             \
            for (int t = g << group_shift; t < (g + 1) << group_shift; t++) {                             \
                short16 lo[WROWS], hi[WROWS];                                                             \
                _Pragma("unroll") for (int r = 0; r < WROWS; r++) {                                       \
                    const uint4 tex = TEXEL_OF(r, t);                                                     \
                    lo[r] = convert_short16(as_uchar16(tex & 0x0F0F0F0Fu));                               \
                    hi[r] = convert_short16(as_uchar16((tex >> 4) & 0x0F0F0F0Fu));                        \
                }                                                                                         \
                _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                        \
                    const float2 xd = xdp[(size_t)mm * texels + t];                                       \
                    xsum[mm] += xd.y;                                                                     \
                    const int16 xe = convert_int16(xqp[(size_t)mm * 2 * texels + 2 * t]);                 \
                    const int16 xo = convert_int16(xqp[(size_t)mm * 2 * texels + 2 * t + 1]);             \
                    _Pragma("unroll") for (int r = 0; r < WROWS; r++) {                                   \
                        const int16 pe = convert_int16(lo[r]) * xe, po = convert_int16(hi[r]) * xo;       \
                        const int8 dot = (EVEN16(pe) + ODD16(pe)) + (EVEN16(po) + ODD16(po));             \
                        acc[r][mm] = convert_float8(dot) * (xd.x * sm[r].x) + acc[r][mm];                 \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
            _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                             \
                _Pragma("unroll") for (int mm = 0; mm < R; mm++) off[r][mm] = sm[r].y * xsum[mm] + off[r][mm]; \
        }                                                                                                 \
        _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                                \
            _Pragma("unroll") for (int r = 0; r < ROWS; r++) {                                            \
                if (col0 + r < n_cols) {                                                                  \
                    const float ya = SUM8(acc[r][mm]) + off[r][mm];                                       \
                    EPILOGUE_STORE                                                                        \
                    y[(size_t)(m0 + mm) * ldy + y_col0 + col0 + r] = out;                                 \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        m0 += R;                                                                                          \
    }

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void gemm_q4_i8(const int m_rows, const int n_cols, const int k, const int group_shift,
                const int ldy, const int y_col0, const int row_a0, const int row_b0,
                const int base_a, const int base_b, const int n_rows,
                __global const char16* restrict xq, __global const float2* restrict x_step_sum,
                __global float* restrict y, CODES_T codes_a, CODES_T codes_b,
                __global const half* restrict scale_offset, __global const float* restrict bias)
{
    const int col0 = get_global_id(0) * ROWS;  // first output column of this work-item, in the launch
    const int texels = k >> 5;
    const int groups = texels >> group_shift;
    const int q4_rows = n_rows, q4_texels = texels, q4_groups = groups;  // kernels/q4.h

    // Weight rows (within codes_a / codes_b) and global rows (scales, bias) of the WROWS rows. Columns
    // past n_cols read the last valid column again (harmless) and store nothing.
    int wrow[WROWS], grow[WROWS];
    _Pragma("unroll")
    for (int r = 0; r < ROWS; r++) {
        const int c = min(col0 + r, n_cols - 1);
        wrow[r] = row_a0 + c - base_a;
        grow[r] = row_a0 + c;
#if EPI_GATED
        wrow[ROWS + r] = row_b0 + c - base_b;
        grow[ROWS + r] = row_b0 + c;
#endif
    }

    int m0 = 0;
#include "m_passes.h"
}
