// Int8 GEMM for prompts with one output column per SIMD lane: the same products and epilogues as gemm_q8.cl's,
//
//   Y (M, N) = X (M, K) · Wᵀ              EPI_NONE
//   Y (M, N) = X (M, K) · Wᵀ + bias (N)   EPI_BIAS
//   Y (M, I) = SiLU(X · Wgᵀ) · (X · Wuᵀ)  EPI_SILU_MUL (W has 2·I rows, gate 0..I−1, up I..2I−1)
//   Y (M, I) = GELU(X · Wgᵀ) · (X · Wuᵀ)  EPI_GELU_MUL
//
// on the same arguments (W in perfx's int8 device form, kernels/q8.h; X, Y, bias float32 row-major; fp32
// accumulation), written as gemm_q4_lanes.cl is, for compilers that vectorize across work-items (Intel's CPU
// runtime and PoCL put 8 or 16 work-items in the lanes of a vector register): everything a work-item holds
// is scalar, so a column set's MB·ROWS accumulators (a sweep's: gate-up sweeps gate rows, then up rows) are
// that many vector registers (gemm_q8's float8 accumulators, split into 8 scalars a lane, are 8 times as many
// and spill), and each X element is the same for every work-item (one load, broadcast to the lanes).
//
// Per weight: its code (a shift pair, int→float) and w = s·q + m once, then MB fused multiply-adds, one per
// row of X in the pass. Codes come 4 at a time, one uint a row, so each lane holds one register a weight row.
// A pass re-reads the work-item's weight rows from cache, not DRAM. M rows go in passes of MB, the last
// M mod MB rows in passes of 4 masked to the rows that exist (kernels/m_masked_passes.h).
//
// Shape contract (as gemm_q8): K a multiple of G ∈ {16, 32} and of 16; any M ≥ 1 and any number of columns
// (edges guarded). One launch covers the columns y_col0 .. y_col0 + n_cols − 1 of Y (row stride ldy); column
// j's gate (or only) row is row row_a0 + j of block a (codes_a, sm_a, bias_a), its up row is row row_b0 + j of
// block b (the wrapper cuts launches where either crosses a block boundary). Work-group (WGS); global
// ⌈n_cols / (ROWS·WGS)⌉·WGS; work-item i owns columns i + j·(global size), j < ROWS, so the lanes of one vector
// own neighbouring columns.

#ifndef WGS
#define WGS 64  // work-items per work-group, each independent
#endif
#ifndef ROWS
#define ROWS 1  // output columns per work-item, a global size apart
#endif
#ifndef MB
#define MB 12  // rows of X per pass: MB·ROWS accumulators a sweep over K (twice that for gate-up, one set waiting)
#endif
#ifndef EPILOGUE
#define EPILOGUE EPI_NONE
#endif

#include "epilogue.h"

#if EPI_GATED
#define WROWS (2 * ROWS)  // gate rows 0..ROWS−1, up rows ROWS..2·ROWS−1
#else
#define WROWS ROWS
#endif

#include "q8.h"

// Code j (0..3, in x order) of a uint holding 4 little-endian int8 codes, as a float: its byte moved to the
// top, then an arithmetic shift back down, sign and all.
#define CODE_OF(bits, j) ((float)(((int)((bits) << (24 - 8 * (j)))) >> 24))

#if EPILOGUE == EPI_BIAS
#define EPILOGUE_STORE const float out = ya + bias_a[row_a0 + min(col[r], n_cols - 1)];
#elif EPI_GATED
#define EPILOGUE_STORE                  \
    const float yb = acc[ROWS + r][mm]; \
    const float out = GATE_ACT(ya) * yb;
#else
#define EPILOGUE_STORE const float out = ya;
#endif

// One sweep over K for the R rows of X from m0, accumulating the ROWS weight rows from R0 (0: gate or only,
// ROWS: up) into acc[R0 ..]. A gate-up pass makes two sweeps, gate rows then up rows, rather than one over both:
// each sweep's loop is then the plain product's, MB multiply-adds per decoded weight with the x broadcasts
// folded into them, where one loop over both sets of rows kept each broadcast x for two rows in a register of
// its own and spilled (Intel's CPU compiler: twice the instructions a group, and slower, benchmarks/NOTES.md).
// The gate accumulators wait in registers, or in a spill slot once a pass, not a weight.
#define SWEEP(R, R0)                                                                                     \
    for (int g = 0; g < groups; g++) {                                                                   \
        float2 sm[ROWS];                                                                                 \
        _Pragma("unroll") for (int r = 0; r < ROWS; r++) sm[r] = LOAD_SM(prow[R0 + r], g);               \
        _Pragma("unroll") for (int i = 0; i < GROUP / 4; i++) {                                          \
            const int c = g * (GROUP / 4) + i;                                                           \
            uint bits[ROWS];                                                                             \
            _Pragma("unroll") for (int r = 0; r < ROWS; r++) bits[r] = wrow[R0 + r][c];                  \
            _Pragma("unroll") for (int j = 0; j < 4; j++) {                                              \
                float w[ROWS];                                                                           \
                _Pragma("unroll") for (int r = 0; r < ROWS; r++)                                         \
                    w[r] = DEQUANT(CODE_OF(bits[r], j), sm[r]);                                          \
                _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                       \
                    const float xv = xp[(size_t)xrow[mm] * k + 4 * c + j];                               \
                    _Pragma("unroll") for (int r = 0; r < ROWS; r++)                                     \
                        acc[R0 + r][mm] = fma(w[r], xv, acc[R0 + r][mm]);                                \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }

#if EPI_GATED
#define SWEEPS(R) SWEEP(R, 0) SWEEP(R, ROWS)
#else
#define SWEEPS(R) SWEEP(R, 0)
#endif

// One pass over K for the R rows of X from m0 (R a compile-time constant), then the epilogue and the stores
// (LEFT of its rows exist, kernels/m_masked_passes.h).
#define PASS(R, LEFT)                                                                                    \
    {                                                                                                    \
        PASS_ROWS(R, LEFT)                                                                               \
        float acc[WROWS][R];                                                                             \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                                \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) acc[r][mm] = 0.0f;                          \
        const __global float* xp = x + (size_t)m0 * k;                                                   \
        SWEEPS(R)                                                                                        \
        _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                               \
            _Pragma("unroll") for (int r = 0; r < ROWS; r++) {                                           \
                if (col[r] < n_cols) {                                                                   \
                    const float ya = acc[r][mm];                                                         \
                    EPILOGUE_STORE                                                                       \
                    y[(size_t)(m0 + xrow[mm]) * ldy + y_col0 + col[r]] = out;                            \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        m0 += R;                                                                                         \
    }

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void gemm_q8_lanes(const int m_rows, const int n_cols, const int k, const int ldy, const int y_col0,
                   const int row_a0, const int row_b0, __global const float* restrict x,
                   __global float* restrict y, __global const char* restrict codes_a,
                   __global const char* restrict codes_b, SM_T sm_a, SM_T sm_b,
                   __global const float* restrict bias_a)
{
    const int groups = k / GROUP;

    // Columns of this work-item (a global size apart, so a vector's lanes hold neighbouring columns), and the
    // codes (4 a uint: rows start at multiples of K bytes, K a multiple of 16) and scales (and offsets) of their
    // weight rows. Columns past n_cols read the last valid column again (harmless) and store nothing.
    int col[ROWS];
    __global const uint* wrow[WROWS];
    SM_T prow[WROWS];
    _Pragma("unroll")
    for (int r = 0; r < ROWS; r++) {
        col[r] = get_global_id(0) + r * get_global_size(0);
        const int c = min(col[r], n_cols - 1);
        wrow[r] = (__global const uint*)(codes_a + (size_t)(row_a0 + c) * k);
        prow[r] = sm_a + (size_t)(row_a0 + c) * groups * SM_PER_GROUP;
#if EPI_GATED
        wrow[ROWS + r] = (__global const uint*)(codes_b + (size_t)(row_b0 + c) * k);
        prow[ROWS + r] = sm_b + (size_t)(row_b0 + c) * groups * SM_PER_GROUP;
#endif
    }

    int m0 = 0;
#define M_PASS MB
#include "m_masked_passes.h"
}
