// Int4 GEMM for prompts with one output column per SIMD lane: the same products and epilogues as
// gemm_q4_skinny.cl's,
//
//   Y (M, N) = X (M, K) · Wᵀ              EPI_NONE
//   Y (M, N) = X (M, K) · Wᵀ + bias (N)   EPI_BIAS
//   Y (M, I) = SiLU(X · Wgᵀ) · (X · Wuᵀ)  EPI_SILU_MUL (W has 2·I rows, gate 0..I−1, up I..2I−1)
//   Y (M, I) = GELU(X · Wgᵀ) · (X · Wuᵀ)  EPI_GELU_MUL
//
// on the same arguments (W in kernels/q4.h's device form, X, Y, bias float32 row-major, fp32 accumulation),
// written for compilers that vectorize across work-items (Intel's CPU runtime and PoCL put 8 work-items in the
// lanes of a 256-bit register). Everything a work-item holds is scalar: its weight is one float per weight
// row, and each X element is the same for every work-item (one load, broadcast to the lanes). So a column
// set's MB·WROWS accumulators are MB·WROWS vector registers, where gemm_q4_skinny's float8 accumulators, split
// into 8 scalars a lane, are 8 times as many registers and spill on this compiler.
//
// Per weight: its code (shift, mask, int→float) and w = s·q + m once, then MB fused multiply-adds, one per
// row of X in the pass; a pass re-reads the work-item's weight rows from cache, not DRAM. M rows go in
// passes of MB, the last M mod MB rows in passes of 4 masked to the rows that exist
// (kernels/m_masked_passes.h).
//
// Shape contract (as gemm_q4_skinny): K a multiple of 32 and of G ∈ {32, 64, 128} (group_shift =
// log2(G / 32)); any M ≥ 1 and any number of columns (edges guarded). One launch covers the columns
// y_col0 .. y_col0 + n_cols − 1 of Y (row stride ldy); their weight rows start at row_a0 (gate or only) and
// row_b0 (up), which lie in codes_a / codes_b at row − base_a / row − base_b (images hold row blocks; with a
// buffer both bases are 0). Scales and bias are indexed by global row. Work-group (WGS); global
// ⌈n_cols / (ROWS·WGS)⌉·WGS; work-item i owns columns i + j·(global size), j < ROWS, so the lanes of one
// vector own neighbouring columns (neighbouring rows of an interleaved weight).

#ifndef WGS
#define WGS 64  // work-items per work-group, each independent
#endif
#ifndef ROWS
#define ROWS 1  // output columns per work-item, a global size apart
#endif
#ifndef MB
#define MB 6  // rows of X per pass: MB·WROWS accumulators a work-item (6: the gate-up epilogue's 12)
#endif
#ifndef READ
#define READ 0  // 0: codes from a uint4 buffer; 1: image2d_t row blocks; 2: an image1d_buffer_t view
#endif
#ifndef LAYOUT
#define LAYOUT 0  // the weight's layout (kernels/q4.h): 0 rows along K, 1 interleaved (set from the weight)
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

#include "q4.h"

#define TEXEL_OF(r, t) ((r) < ROWS ? TEXEL(codes_a, wrow[r], t) : TEXEL(codes_b, wrow[r], t))

// Component c (codes 8c .. 8c + 7) of texel t of weight row r. From a buffer each component is its own 4-byte
// load, made where it is used, so a work-item holds one uint a row rather than a texel's four (which, beside
// the accumulators, spill on a CPU's 16 vector registers); an image read returns the texel, read once.
#if READ == 0
#define TEXEL_LOAD(t)
#define COMPONENT(r, t, c) \
    (((__global const uint*)((r) < ROWS ? codes_a : codes_b))[4 * TEXEL_INDEX(wrow[r], t) + (c)])
#else
#define TEXEL_LOAD(t)          \
    uint4 tex[WROWS];          \
    _Pragma("unroll") for (int r = 0; r < WROWS; r++) tex[r] = TEXEL_OF(r, t);
#define COMPONENT(r, t, c) ((c) == 0 ? tex[r].x : (c) == 1 ? tex[r].y : (c) == 2 ? tex[r].z : tex[r].w)
#endif

#if EPILOGUE == EPI_BIAS
#define EPILOGUE_STORE const float out = ya + bias[grow[r]];
#elif EPI_GATED
#define EPILOGUE_STORE                  \
    const float yb = acc[ROWS + r][mm]; \
    const float out = GATE_ACT(ya) * yb;
#else
#define EPILOGUE_STORE const float out = ya;
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
        for (int g = 0; g < groups; g++) {                                                               \
            float2 sm[WROWS];                                                                            \
            _Pragma("unroll") for (int r = 0; r < WROWS; r++) sm[r] = GROUP_SM(scale_offset, grow[r], g); \
            for (int t = g << group_shift; t < (g + 1) << group_shift; t++) {                             \
                TEXEL_LOAD(t)                                                                             \
                const __global float* xt = xp + 32 * t;                                                   \
                _Pragma("unroll") for (int c = 0; c < 4; c++) {                                           \
                    uint bits[WROWS];                                                                     \
                    _Pragma("unroll") for (int r = 0; r < WROWS; r++) bits[r] = COMPONENT(r, t, c);       \
                    _Pragma("unroll") for (int j = 0; j < 8; j++) {                                       \
                        float w[WROWS];                                                                   \
                        _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                 \
                            w[r] = (float)(int)((bits[r] >> (4 * j)) & 0xFu) * sm[r].x + sm[r].y;         \
                        _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                \
                            const float xv = xt[(size_t)xrow[mm] * k + 8 * c + j];                        \
                            _Pragma("unroll") for (int r = 0; r < WROWS; r++)                             \
                                acc[r][mm] = fma(w[r], xv, acc[r][mm]);                                   \
                        }                                                                                 \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                                \
            _Pragma("unroll") for (int r = 0; r < ROWS; r++) {                                            \
                if (col[r] < n_cols) {                                                                    \
                    const float ya = acc[r][mm];                                                          \
                    EPILOGUE_STORE                                                                        \
                    y[(size_t)(m0 + xrow[mm]) * ldy + y_col0 + col[r]] = out;                             \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
        m0 += R;                                                                                          \
    }

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void gemm_q4_lanes(const int m_rows, const int n_cols, const int k, const int group_shift,
                   const int ldy, const int y_col0, const int row_a0, const int row_b0,
                   const int base_a, const int base_b, const int n_rows,
                   __global const float* restrict x, __global float* restrict y,
                   CODES_T codes_a, CODES_T codes_b,
                   __global const half* restrict scale_offset, __global const float* restrict bias)
{
    const int texels = k >> 5;
    const int groups = texels >> group_shift;
    const int q4_rows = n_rows, q4_texels = texels, q4_groups = groups;  // kernels/q4.h

    // Columns of this work-item (a global size apart, so a vector's lanes hold neighbouring columns), their
    // weight rows (within codes_a / codes_b) and global rows (scales, bias). Columns past n_cols read the last
    // valid column again (harmless) and store nothing.
    int col[ROWS], wrow[WROWS], grow[WROWS];
    _Pragma("unroll")
    for (int r = 0; r < ROWS; r++) {
        col[r] = get_global_id(0) + r * get_global_size(0);
        const int c = min(col[r], n_cols - 1);
        wrow[r] = row_a0 + c - base_a;
        grow[r] = row_a0 + c;
#if EPI_GATED
        wrow[ROWS + r] = row_b0 + c - base_b;
        grow[ROWS + r] = row_b0 + c;
#endif
    }

    int m0 = 0;
#define M_PASS MB
#include "m_masked_passes.h"
}
