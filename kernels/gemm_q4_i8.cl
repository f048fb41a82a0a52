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
// Two forms of the products (tuned):
//   DOT 1: the codes are unsigned 0..15 and X's are signed int8, the shape of cl_khr_integer_dot_product's
//     dot_4x8packed_us_int (a GPU's byte dot product: dp4a, Adreno's and NVIDIA's): the low and high nibbles
//     of each texel word, 4 codes a word, against 4 of X's codes, 8 dot products a texel and row of X summed
//     in one int, one scalar accumulator a row of X and weight row, no widening. Only where the device lists
//     the extension, built as OpenCL C 2.0 or newer (some compilers declare the built-ins only there). Intel's
//     CPU compiler makes each dot product a vpmaddwd, a vphaddd and shuffles (no vpdpbusd, and no
//     vectorization across work-items around the call), so on that CPU the int16 pairs stay faster.
//   PAIR 1 (with the int16 pairs, DOT 0): rows of X in pairs, the 8 int lanes of each of the two rows
//     converted into one float16 and scaled by one 16-lane multiply-add (d·s of each row in its half), so a
//     512-bit CPU converts and multiplies once for two rows of X, and its compiler pairs the integer products
//     into 512-bit vpmaddwd / vpdpwssd too; a pass of one row (the remainder of an odd M) is not paired.
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
#ifndef DOT
#define DOT 0  // 1: cl_khr_integer_dot_product byte dot products (a GPU's dp4a), built as OpenCL C 2.0+
#endif
#ifndef PAIR
#define PAIR 0  // 1 (DOT 0): two rows of X a 16-lane conversion and multiply-add
#endif
#ifndef EPILOGUE
#define EPILOGUE EPI_NONE  // none, + bias[column], or SiLU / GELU (gate)·up (kernels/epilogue.h)
#endif

#if DOT && PAIR
#error "PAIR pairs the int lanes of the 16-bit products (DOT 0); byte dot products sum each texel to one int"
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

#if DOT
// A texel of a weight row as its low and high nibbles, 4 codes a byte-packed word, beside the rows of X's
// words: 8 byte dot products a texel, row of X and weight row (unsigned codes × signed x, summed in int; the
// plain form, not dot_acc_sat: a texel's sum cannot overflow, |Σ| ≤ 32·15·128).
#define CODES_T4 uint4
#define UNPACK(tex, lo, hi)                   \
    lo = (tex) & 0x0F0F0F0Fu;                 \
    hi = ((tex) >> 4) & 0x0F0F0F0Fu;
#define TEXEL_DOT(lo, hi, xe, xo)                                                                \
    (((dot_4x8packed_us_int((lo).s0, (xe).s0) + dot_4x8packed_us_int((lo).s1, (xe).s1))         \
      + (dot_4x8packed_us_int((lo).s2, (xe).s2) + dot_4x8packed_us_int((lo).s3, (xe).s3)))      \
     + ((dot_4x8packed_us_int((hi).s0, (xo).s0) + dot_4x8packed_us_int((hi).s1, (xo).s1))       \
        + (dot_4x8packed_us_int((hi).s2, (xo).s2) + dot_4x8packed_us_int((hi).s3, (xo).s3))))
#define ACC_T float   // one int sum a texel, row of X and weight row: a scalar accumulator
#define ACC_TOTAL(a) (a)
#define CONVERT_ACC(v) ((float)(v))
#define X_T uint4
#define LOAD_XQ(i) as_uint4(xqp[i])
#else
// A texel of a weight row as its 32 codes widened to short (the low nibbles, then the high), each product of
// a code and an x widened to int, neighbours summed in pairs: the pattern x86 compilers turn into vpmaddwd.
#define CODES_T4 short16
#define UNPACK(tex, lo, hi)                                            \
    lo = convert_short16(as_uchar16((tex) & 0x0F0F0F0Fu));             \
    hi = convert_short16(as_uchar16(((tex) >> 4) & 0x0F0F0F0Fu));
inline int8 texel_dot8(const short16 lo, const short16 hi, const int16 xe, const int16 xo)
{
    const int16 pe = convert_int16(lo) * xe, po = convert_int16(hi) * xo;
    return (EVEN16(pe) + ODD16(pe)) + (EVEN16(po) + ODD16(po));
}
#define TEXEL_DOT(lo, hi, xe, xo) texel_dot8(lo, hi, xe, xo)
#define ACC_T float8  // 8 int lanes a texel, row of X and weight row, converted to float together
#define ACC_TOTAL(a) SUM8(a)
#define CONVERT_ACC(v) convert_float8(v)
#define X_T int16
#define LOAD_XQ(i) convert_int16(xqp[i])
#endif

#if EPILOGUE == EPI_BIAS
#define EPILOGUE_STORE const float out = tot[r][mm] + bias[grow[r]];
#elif EPI_GATED
#define EPILOGUE_STORE const float out = GATE_ACT(tot[r][mm]) * tot[ROWS + r][mm];
#else
#define EPILOGUE_STORE const float out = tot[r][mm];
#endif

// The R rows of X from m0 of a pass: each row's sums and offsets in tot, through the epilogue into Y.
#define STORE(R)                                                                      \
    _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                \
        _Pragma("unroll") for (int r = 0; r < ROWS; r++) {                            \
            if (col0 + r < n_cols) {                                                  \
                EPILOGUE_STORE                                                        \
                y[(size_t)(m0 + mm) * ldy + y_col0 + col0 + r] = out;                 \
            }                                                                         \
        }                                                                             \
    }                                                                                 \
    m0 += R;

// The loop over K of a pass, around the products of texel t for the pass's rows of X (the arguments after R):
// the weight rows' (s, m) per group, their texels unpacked once per texel for every row of X; per group and row
// of X the offset m·Σ d·q_x in a scalar.
#define OVER_K(R, ...)                                                                                    \
    const __global char16* xqp = xq + (size_t)m0 * 2 * texels;                                            \
    const __global float2* xdp = x_step_sum + (size_t)m0 * texels;                                        \
    for (int g = 0; g < groups; g++) {                                                                    \
        float2 sm[WROWS];                                                                                 \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++) sm[r] = GROUP_SM(scale_offset, grow[r], g);     \
        float xsum[R];                                                                                    \
        _Pragma("unroll") for (int mm = 0; mm < R; mm++) xsum[mm] = 0.0f;                                 \
        for (int t = g << group_shift; t < (g + 1) << group_shift; t++) {                                 \
            CODES_T4 lo[WROWS], hi[WROWS];                                                                \
            _Pragma("unroll") for (int r = 0; r < WROWS; r++) {                                           \
                const uint4 tex = TEXEL_OF(r, t);                                                         \
                UNPACK(tex, lo[r], hi[r])                                                                 \
            }                                                                                             \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) xsum[mm] += xdp[(size_t)mm * texels + t].y;  \
            __VA_ARGS__                                                                                   \
        }                                                                                                 \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                                 \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) off[r][mm] = sm[r].y * xsum[mm] + off[r][mm]; \
    }

// One pass over K for the R rows of X from m0 (R a compile-time constant), then the epilogue and the stores.
// Per texel and row of X: 32 products |q·q_x| ≤ 15·127 (a pair's sum fits int16, the texel's int32), in int
// (ACC_T's lanes), then fp32 times d·s.
#define PASS_SINGLE(R)                                                                                    \
    {                                                                                                     \
        ACC_T acc[WROWS][R];                                                                              \
        float off[WROWS][R], tot[WROWS][R];                                                               \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                                 \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                            \
                acc[r][mm] = (ACC_T)0.0f;                                                                 \
                off[r][mm] = 0.0f;                                                                        \
            }                                                                                             \
        OVER_K(R,                                                                                         \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                            \
                const float xd = xdp[(size_t)mm * texels + t].x;                                          \
                const X_T xe = LOAD_XQ((size_t)mm * 2 * texels + 2 * t);                                  \
                const X_T xo = LOAD_XQ((size_t)mm * 2 * texels + 2 * t + 1);                              \
                _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                         \
                    acc[r][mm] = CONVERT_ACC(TEXEL_DOT(lo[r], hi[r], xe, xo)) * (xd * sm[r].x) + acc[r][mm]; \
            })                                                                                            \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                                 \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) tot[r][mm] = ACC_TOTAL(acc[r][mm]) + off[r][mm]; \
        STORE(R)                                                                                          \
    }

#if PAIR
// PAIR 1 (with DOT 0): rows of X in pairs, the 8 int lanes of each row's products of a texel converted into
// the halves of one float16, so one multiply-add (by d·s of each row of X in its half) serves two rows; a
// 512-bit CPU's compiler makes the two conversions one as well. (Converting an int16 built of the two halves
// instead made PoCL's LLVM fail to select an instruction.)
#define PASS_PAIRED(R)                                                                                    \
    {                                                                                                     \
        float16 acc[WROWS][R / 2];                                                                        \
        float off[WROWS][R], tot[WROWS][R];                                                               \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++) {                                               \
            _Pragma("unroll") for (int p = 0; p < R / 2; p++) acc[r][p] = (float16)0.0f;                  \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) off[r][mm] = 0.0f;                           \
        }                                                                                                 \
        OVER_K(R,                                                                                         \
            _Pragma("unroll") for (int p = 0; p < R / 2; p++) {                                           \
                const size_t a = (size_t)(2 * p) * texels + t, b = a + texels;                            \
                const float16 d = (float16)((float8)xdp[a].x, (float8)xdp[b].x);                          \
                const int16 xea = convert_int16(xqp[2 * a]), xoa = convert_int16(xqp[2 * a + 1]);         \
                const int16 xeb = convert_int16(xqp[2 * b]), xob = convert_int16(xqp[2 * b + 1]);         \
                _Pragma("unroll") for (int r = 0; r < WROWS; r++) {                                       \
                    const float16 dot = (float16)(convert_float8(texel_dot8(lo[r], hi[r], xea, xoa)),     \
                                                  convert_float8(texel_dot8(lo[r], hi[r], xeb, xob)));    \
                    acc[r][p] = dot * (d * sm[r].x) + acc[r][p];                                          \
                }                                                                                         \
            })                                                                                            \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                                 \
            _Pragma("unroll") for (int p = 0; p < R / 2; p++) {                                           \
                tot[r][2 * p] = SUM8(acc[r][p].lo) + off[r][2 * p];                                       \
                tot[r][2 * p + 1] = SUM8(acc[r][p].hi) + off[r][2 * p + 1];                               \
            }                                                                                             \
        STORE(R)                                                                                          \
    }
// Passes of 2, 4, 8 or 16 rows go in pairs; one of a single row (the remainder of an odd M) has no pair. R is
// a number (MT is passed as one), so PASS(R) names its pass.
#define PASS(R) PASS_ROWS(R)
#define PASS_ROWS(R) PASS_##R
#define PASS_1 PASS_SINGLE(1)
#define PASS_2 PASS_PAIRED(2)
#define PASS_4 PASS_PAIRED(4)
#define PASS_8 PASS_PAIRED(8)
#define PASS_16 PASS_PAIRED(16)
#else
#define PASS(R) PASS_SINGLE(R)
#endif

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
