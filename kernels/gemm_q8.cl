// Tall-skinny int8 GEMM, the prefill path (and the lm_head over many positions, for perplexity):
//
//   Y (M, N) = X (M, K) · Wᵀ              EPI_NONE
//   Y (M, N) = X (M, K) · Wᵀ + bias (N)   EPI_BIAS (QKV with a bias, e.g. Qwen)
//   Y (M, I) = SiLU(X · Wgᵀ) · (X · Wuᵀ)  EPI_SILU_MUL (gate-up: W has 2·I rows, gate 0..I−1, up I..2I−1)
//   Y (M, I) = GELU(X · Wgᵀ) · (X · Wuᵀ)  EPI_GELU_MUL (the same rows; GELU's tanh form)
//
// W (N, K) in perfx's int8 device form (perfx/ops/q8_weight.py): int8 codes, rows contiguous along K,
// held as row blocks (one buffer each); per group of G ∈ {16, 32} along K an (s, m) pair, w = s·q + m, or
// (SYM 1) s alone, w = s·q, in half (SM_F32 0) or float (SM_F32 1): kernels/q8.h. X, Y, bias float32, row-major. Accumulation in fp32.
//
// The structure of gemm_q4_skinny: memory-bound at the M of a prompt chunk on a phone, so each weight is
// read once per pass and the sums of MT rows of X stay in registers. One work-item owns ROWS output
// columns (ROWS weight rows, twice that for the gate-up epilogue) and the whole of K, with no local
// memory and no barriers. Per 8 codes it dequantizes each row's weights once, w = s·q + m, and multiplies
// them into MT rows of X held as float8 accumulators. M rows go in passes of MT, the last M mod MT rows
// in passes of MT/2, MT/4, ..., 1; each pass re-reads the work-item's weight rows from cache.
//
// Shape contract: K a multiple of G; any M ≥ 1 and any number of columns (edges guarded). One launch
// covers the columns y_col0 .. y_col0 + n_cols − 1 of Y (row stride ldy); column j's gate (or only) row
// is row row_a0 + j of block a (codes_a, sm_a, bias_a), its up row is row_b0 + j of block b (the wrapper
// cuts launches where either crosses a block boundary). Work-group (WGS); global ⌈n_cols / ROWS / WGS⌉·WGS.

#ifndef WGS
#define WGS 64  // work-items per work-group, each independent (ROWS columns apiece)
#endif
#ifndef ROWS
#define ROWS 1  // output columns per work-item: each x chunk is loaded once and applied to ROWS rows
#endif
#ifndef MT
#define MT 4  // rows of X per pass, ROWS·MT float8 accumulators in registers (a power of two)
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

#include "q8.h"

// The 8 weights of codes 8c..8c+7 of a row, s·q + m, in x order. Plain * and + rather than mad():
// PoCL calls mad(float8) out of line and spills the accumulators around each call.
#define DEQUANT8(p, c, sm) DEQUANT(CODES8(p, c), sm)
// X rows start at multiples of K floats, K a multiple of 16: every 8-float chunk is float8-aligned.
#define LOAD_X8(p, i) (((const __global float8*)(p))[i])

// One pass over K for the R rows of X from m0 (R a compile-time constant), then the epilogue and stores.
#define PASS(R)                                                                                  \
    {                                                                                            \
        float8 acc[WROWS][R];                                                                    \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                        \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) acc[r][mm] = (float8)0.0f;          \
        const __global float* xp = x + (size_t)m0 * k;                                           \
        for (int g = 0; g < groups; g++) {                                                       \
            float2 sm[WROWS];                                                                    \
            _Pragma("unroll") for (int r = 0; r < WROWS; r++) sm[r] = LOAD_SM(prow[r], g);     \
            _Pragma("unroll") for (int i = 0; i < CHUNKS_PER_GROUP; i++) {                       \
                const int c = g * CHUNKS_PER_GROUP + i;                                          \
                float8 w[WROWS];                                                                 \
                _Pragma("unroll") for (int r = 0; r < WROWS; r++) w[r] = DEQUANT8(wrow[r], c, sm[r]); \
                _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                               \
                    const float8 xv = LOAD_X8(xp + (size_t)mm * k, c);                           \
                    _Pragma("unroll") for (int r = 0; r < WROWS; r++) acc[r][mm] += w[r] * xv;   \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                       \
            _Pragma("unroll") for (int r = 0; r < ROWS; r++) {                                   \
                if (col0 + r < n_cols) {                                                         \
                    const float ya = SUM8(acc[r][mm]);                                           \
                    EPILOGUE_STORE                                                               \
                    y[(size_t)(m0 + mm) * ldy + y_col0 + col0 + r] = out;                        \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        m0 += R;                                                                                 \
    }

#if EPILOGUE == EPI_BIAS
#define EPILOGUE_STORE const float out = ya + bias_a[row_a0 + col0 + r];
#elif EPI_GATED
#define EPILOGUE_STORE                         \
    const float yb = SUM8(acc[ROWS + r][mm]);  \
    const float out = GATE_ACT(ya) * yb;
#else
#define EPILOGUE_STORE const float out = ya;
#endif

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void gemm_q8(const int m_rows, const int n_cols, const int k, const int ldy, const int y_col0,
             const int row_a0, const int row_b0, __global const float* restrict x, __global float* restrict y,
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
