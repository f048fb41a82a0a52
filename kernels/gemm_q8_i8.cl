// Int8 GEMM for a few rows with int8 activations: the batched decode step's matrices held as int8 (the lm_head,
// GGUF's 5-, 6- and 8-bit layers) over M = 2..16 rows, with the same products and epilogues as gemm_q8.cl's,
//
//   Y (M, N) = X (M, K) · Wᵀ              EPI_NONE
//   Y (M, N) = X (M, K) · Wᵀ + bias (N)   EPI_BIAS
//   Y (M, I) = SiLU(X · Wgᵀ) · (X · Wuᵀ)  EPI_SILU_MUL (W has 2·I rows, gate 0..I−1, up I..2I−1)
//   Y (M, I) = GELU(X · Wgᵀ) · (X · Wuᵀ)  EPI_GELU_MUL
//
// W (N, K) in perfx's int8 device form (kernels/q8.h: int8 codes, rows along K in row blocks, (s, m) or s alone
// per group of G ∈ {16, 32}); Y and bias float32, row-major. X arrives quantized as the int8 GEMV's x does
// (kernels/gemv_q8.cl I8 1): gemm_q8_i8_quantize_x rounds X (M, K) per group of G to int8, q_x =
// rint(x·127/max|x|), with the group's step d = max|x|/127 and Σ d·q_x (llama.cpp's Q8_1). Per group of a
// weight row: Σ (s·q + m)·d·q_x = s·d·Σ q·q_x + m·Σ d·q_x, the products exact in int (|q·q_x| ≤ 128·127, two
// of them within int16: the pair-summed form x86's vpmaddwd computes), then fp32.
//
// Why a kernel of its own: gemm_q8 converts each code to float and multiplies it into each row of X, so on a
// CPU a few rows cost nearly what as many GEMVs do. Here a work-item widens the codes of a group of each of its
// weight rows once and applies them to the MT rows of X of its pass in integer products. The structure is
// gemm_q8's (a work-item owns ROWS whole weight rows: no local memory, no barriers).
//
// Two forms of the products (tuned), as gemm_q4_i8.cl's: DOT 1, 4 codes against 4 of X's in one
// cl_khr_integer_dot_product dot_4x8packed_ss_int (signed × signed; a GPU's dp4a), G/4 a group and row of X,
// one scalar accumulator a row of X and weight row (only where the device lists the extension); PAIR 1 (with
// DOT 0), two rows of X converted and scaled in one float16.
//
// Shape contract (as gemm_q8): K a multiple of G; any M ≥ 1 (passes of MT rows, the remainder in passes of 8,
// 4, 2, 1: kernels/m_passes.h) and any number of columns (edges guarded). One launch covers the columns
// y_col0 .. y_col0 + n_cols − 1 of Y (row stride ldy); column j's gate (or only) row is row row_a0 + j of block
// a (codes_a, sm_a, bias_a), its up row is row row_b0 + j of block b (the wrapper cuts launches where either
// crosses a block boundary). Work-group (WGS); global ⌈n_cols / ROWS / WGS⌉·WGS.

#ifndef WGS
#define WGS 16  // work-items per work-group, each independent (ROWS columns apiece)
#endif
#ifndef ROWS
#define ROWS 1  // output columns per work-item: each group of X is loaded once and applied to ROWS rows
#endif
#ifndef MT
#define MT 4  // rows of X per pass: ROWS·MT float8 accumulators (twice for gate-up), a power of two
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
#error "PAIR pairs the int lanes of the 16-bit products (DOT 0); byte dot products sum each group to one int"
#endif

#include "epilogue.h"

#if EPI_GATED
#define WROWS (2 * ROWS)  // gate rows 0..ROWS−1, up rows ROWS..2·ROWS−1
#else
#define WROWS ROWS
#endif

#include "int_pairs.h"
#include "q8.h"

// 16 codes (weights or quantized x) at a time: rows of K bytes, K a multiple of 16.
#define CHARS16(p, c) (((const __global char16*)(p))[c])
// X through a float8 pointer: rows of K floats, K a multiple of 16, so every chunk is float8-aligned.
#define LOAD_X8(p, c) (((const __global float8*)(p))[c])

// X (count = M·K floats, K a multiple of G, so no group straddles two rows) per group of GROUP as int8 codes
// (count bytes, in X's order) and (d, Σ d·q_x) per group, one work-item a group; an all-zero group has d = 0
// and codes 0.
__kernel void gemm_q8_i8_quantize_x(const int count, __global const float* restrict x, __global char* restrict xq,
                                    __global float2* restrict x_step_sum)
{
    const int g = get_global_id(0);
    if (g >= count / GROUP) return;
    float8 v[CHUNKS_PER_GROUP];
    float8 m8 = (float8)(0.0f);
    #pragma unroll
    for (int i = 0; i < CHUNKS_PER_GROUP; ++i) {
        v[i] = LOAD_X8(x, g * CHUNKS_PER_GROUP + i);
        m8 = fmax(m8, fabs(v[i]));
    }
    const float4 m4 = fmax(m8.lo, m8.hi);
    const float amax = fmax(fmax(m4.s0, m4.s1), fmax(m4.s2, m4.s3));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    float8 sum8 = (float8)(0.0f);
    #pragma unroll
    for (int i = 0; i < CHUNKS_PER_GROUP; ++i) {
        const float8 r = rint(v[i] * inv);
        sum8 += r;
        ((__global char8*)xq)[g * CHUNKS_PER_GROUP + i] = convert_char8_sat(r);
    }
    x_step_sum[g] = (float2)(amax / 127.0f, SUM8(sum8) * (amax / 127.0f));
}

#if EPILOGUE == EPI_BIAS
#define EPILOGUE_STORE const float out = tot[r][mm] + bias_a[row_a0 + col0 + r];
#elif EPI_GATED
#define EPILOGUE_STORE const float out = GATE_ACT(tot[r][mm]) * tot[ROWS + r][mm];
#else
#define EPILOGUE_STORE const float out = tot[r][mm];
#endif

#if SYM
#define ADD_OFFSET(r, mm, sm, xd)   // every offset is 0
#else
#define ADD_OFFSET(r, mm, sm, xd) off[r][mm] = (sm).y * (xd).y + off[r][mm];
#endif

#if DOT
// A group of a weight row as words of 4 codes, against the row of X's words: G/4 byte dot products (signed ×
// signed, summed in int: |Σ| ≤ 32·128·127 cannot overflow, so the plain form, not dot_acc_sat).
#define CODES_T16 uint4
#define LOAD_CODES(p, c) as_uint4(CHARS16(p, c))
#define X_T uint4
#define LOAD_X(p, c) as_uint4(CHARS16(p, c))
inline int group_dot(const uint4* w, const uint4* x)
{
    int sum = 0;
    #pragma unroll
    for (int i = 0; i < GROUP / 16; i++)
        sum += (dot_4x8packed_ss_int(w[i].s0, x[i].s0) + dot_4x8packed_ss_int(w[i].s1, x[i].s1))
               + (dot_4x8packed_ss_int(w[i].s2, x[i].s2) + dot_4x8packed_ss_int(w[i].s3, x[i].s3));
    return sum;
}
#define ACC_T float   // one int sum a group, row of X and weight row: a scalar accumulator
#define ACC_TOTAL(a) (a)
#define CONVERT_ACC(v) ((float)(v))
#else
// A group of a weight row widened to short, each product widened to int, neighbours summed in pairs (the
// pattern x86 compilers turn into vpmaddwd), in 8 int lanes.
#define CODES_T16 short16
#define LOAD_CODES(p, c) convert_short16(CHARS16(p, c))
#define X_T int16
#define LOAD_X(p, c) convert_int16(CHARS16(p, c))
inline int8 group_dot(const short16* w, const int16* x)
{
    int8 sum = (int8)(0);
    #pragma unroll
    for (int i = 0; i < GROUP / 16; i++) {
        const int16 p = convert_int16(w[i]) * x[i];
        sum += EVEN16(p) + ODD16(p);
    }
    return sum;
}
#define ACC_T float8
#define ACC_TOTAL(a) SUM8(a)
#define CONVERT_ACC(v) convert_float8(v)
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

// The loop over K's groups of a pass, around the products (the arguments): a group of each weight row read
// (and widened) once for every row of X.
#define OVER_K(...)                                                                                       \
    const __global char* xqp = xq + (size_t)m0 * k;                                                       \
    const __global float2* xdp = x_step_sum + (size_t)m0 * groups;                                        \
    for (int g = 0; g < groups; g++) {                                                                    \
        float2 sm[WROWS];                                                                                 \
        CODES_T16 w[WROWS][GROUP / 16];                                                                   \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++) {                                               \
            sm[r] = LOAD_SM(prow[r], g);                                                                  \
            _Pragma("unroll") for (int i = 0; i < GROUP / 16; i++)                                        \
                w[r][i] = LOAD_CODES(wrow[r], g * (GROUP / 16) + i);                                      \
        }                                                                                                 \
        __VA_ARGS__                                                                                       \
    }

// One pass over K for the R rows of X from m0 (R a compile-time constant), then the epilogue and the stores.
// Per group, weight row and row of X: G integer products (ACC_T's lanes), then fp32 times s·d; the offset
// m·Σ d·q_x in a scalar.
#define PASS_SINGLE(R)                                                                                    \
    {                                                                                                     \
        ACC_T acc[WROWS][R];                                                                              \
        float off[WROWS][R], tot[WROWS][R];                                                               \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                                 \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                            \
                acc[r][mm] = (ACC_T)0.0f;                                                                 \
                off[r][mm] = 0.0f;                                                                        \
            }                                                                                             \
        OVER_K(                                                                                           \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                            \
                const float2 xd = xdp[(size_t)mm * groups + g];                                           \
                X_T xv[GROUP / 16];                                                                       \
                _Pragma("unroll") for (int i = 0; i < GROUP / 16; i++)                                    \
                    xv[i] = LOAD_X(xqp + (size_t)mm * k, g * (GROUP / 16) + i);                           \
                _Pragma("unroll") for (int r = 0; r < WROWS; r++) {                                       \
                    acc[r][mm] = CONVERT_ACC(group_dot(w[r], xv)) * (sm[r].x * xd.x) + acc[r][mm];        \
                    ADD_OFFSET(r, mm, sm[r], xd)                                                          \
                }                                                                                         \
            })                                                                                            \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                                 \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) tot[r][mm] = ACC_TOTAL(acc[r][mm]) + off[r][mm]; \
        STORE(R)                                                                                          \
    }

#if PAIR
// PAIR 1 (with DOT 0): rows of X in pairs, the 8 int lanes of each row's products of a group converted into the
// halves of one float16, so one multiply-add (by s·d of each row of X in its half) serves two rows
// (kernels/gemm_q4_i8.cl's PAIR).
#define PASS_PAIRED(R)                                                                                    \
    {                                                                                                     \
        float16 acc[WROWS][R / 2];                                                                        \
        float off[WROWS][R], tot[WROWS][R];                                                               \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++) {                                               \
            _Pragma("unroll") for (int p = 0; p < R / 2; p++) acc[r][p] = (float16)0.0f;                  \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) off[r][mm] = 0.0f;                           \
        }                                                                                                 \
        OVER_K(                                                                                           \
            _Pragma("unroll") for (int p = 0; p < R / 2; p++) {                                           \
                const float2 xda = xdp[(size_t)(2 * p) * groups + g];                                     \
                const float2 xdb = xdp[(size_t)(2 * p + 1) * groups + g];                                 \
                const float16 d = (float16)((float8)xda.x, (float8)xdb.x);                                \
                X_T xa[GROUP / 16], xb[GROUP / 16];                                                       \
                _Pragma("unroll") for (int i = 0; i < GROUP / 16; i++) {                                  \
                    xa[i] = LOAD_X(xqp + (size_t)(2 * p) * k, g * (GROUP / 16) + i);                      \
                    xb[i] = LOAD_X(xqp + (size_t)(2 * p + 1) * k, g * (GROUP / 16) + i);                  \
                }                                                                                         \
                _Pragma("unroll") for (int r = 0; r < WROWS; r++) {                                       \
                    const float16 dot = (float16)(convert_float8(group_dot(w[r], xa)),                    \
                                                  convert_float8(group_dot(w[r], xb)));                   \
                    acc[r][p] = dot * (d * sm[r].x) + acc[r][p];                                          \
                    ADD_OFFSET(r, 2 * p, sm[r], xda)                                                      \
                    ADD_OFFSET(r, 2 * p + 1, sm[r], xdb)                                                  \
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
void gemm_q8_i8(const int m_rows, const int n_cols, const int k, const int ldy, const int y_col0,
                const int row_a0, const int row_b0, __global const char* restrict xq,
                __global const float2* restrict x_step_sum, __global float* restrict y,
                __global const char* restrict codes_a, __global const char* restrict codes_b,
                SM_T sm_a, SM_T sm_b, __global const float* restrict bias_a)
{
    const int col0 = get_global_id(0) * ROWS;  // first output column of this work-item, in the launch
    const int groups = k / GROUP;

    // Codes and scales (and offsets) of the WROWS rows. Columns past n_cols read the last valid column again
    // (harmless) and store nothing.
    __global const char* wrow[WROWS];
    SM_T prow[WROWS];
    _Pragma("unroll")
    for (int r = 0; r < ROWS; r++) {
        const int c = min(col0 + r, n_cols - 1);
        wrow[r] = codes_a + (size_t)(row_a0 + c) * k;
        prow[r] = sm_a + (size_t)(row_a0 + c) * groups * SM_PER_GROUP;
#if EPI_GATED
        wrow[ROWS + r] = codes_b + (size_t)(row_b0 + c) * k;
        prow[ROWS + r] = sm_b + (size_t)(row_b0 + c) * groups * SM_PER_GROUP;
#endif
    }

    int m0 = 0;
#include "m_passes.h"
}
