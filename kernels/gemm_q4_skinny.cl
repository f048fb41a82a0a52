// Tall-skinny int4 GEMM, the prefill path for small M (a few to ~32 tokens):
//
//   Y (M, N) = X (M, K) · Wᵀ              EPI_NONE
//   Y (M, N) = X (M, K) · Wᵀ + bias (N)   EPI_BIAS (QKV with a bias, e.g. Qwen)
//   Y (M, I) = SiLU(X · Wgᵀ) · (X · Wuᵀ)  EPI_SILU_MUL (gate-up: W has 2·I rows, gate 0..I−1, up I..2I−1)
//   Y (M, I) = GELU(X · Wgᵀ) · (X · Wuᵀ)  EPI_GELU_MUL (the same rows; GELU's tanh form)
//
// W (N, K) in perfx's device form (kernels/q4.h): codes q ∈ [0, 15], 32 per uint4 texel, in the weight's
// LAYOUT (rows along K, or interleaved), read from a buffer (READ 0), image2d_t row blocks (READ 1) or an
// image1d_buffer_t view of the buffer (READ 2); (s, m) per group of G along K in its Q4_SCALES form, w = s·q + m.
// X, Y, bias float32, row-major. Accumulation in fp32.
//
// Still memory-bound at small M, so each weight is read once and all M rows' sums stay in registers:
// one work-item owns ROWS output columns (ROWS weight rows, twice that for the gate-up epilogue) and
// the whole of K, with no local memory and no barriers (the structure of gemv_q4, which is what PoCL
// runs well). Per texel component it dequantizes 8 weights of each row once, w = s·q + m, and
// multiplies them into MT rows of X held as float8 accumulators; the x chunk is loaded once and applied
// to every row. M rows go in passes of MT, the last M mod MT rows in passes of MT/2, MT/4, ..., 1 (so
// M = 1 costs one row, not MT); each pass re-reads the work-item's weight rows from cache, not DRAM.
// Codes become floats through the bits: 0x4B000000 | q is the float 2²³ + q, one OR and one subtraction
// (8 wide: some CPU compilers fail to select 16-wide integer/convert code and mad(float16)).
//
// Shape contract: K a multiple of 32 and of G ∈ {32, 64, 128} (group_shift = log2(G / 32));
// any M ≥ 1 and any number of columns (edges guarded). One launch covers the columns
// y_col0 .. y_col0 + n_cols − 1 of Y (row stride ldy); their weight rows start at row_a0 (gate or
// only) and row_b0 (up), which lie in codes_a / codes_b at row − base_a / row − base_b (images
// hold row blocks; with a buffer both bases are 0). Scales and bias are indexed by global row.
// Work-group (WGS); global ⌈n_cols / (ROWS·WGS)⌉·WGS.

#ifndef WGS
#define WGS 64  // work-items per work-group, each independent (ROWS columns apiece)
#endif
#ifndef ROWS
#define ROWS 1  // output columns per work-item: each x chunk is loaded once and applied to ROWS rows
#endif
#ifndef MT
#define MT 4  // rows of X per pass, ROWS·MT float8 accumulators in registers (a power of two)
#endif
#ifndef READ
#define READ 1  // 0: codes from a uint4 buffer; 1: image2d_t row blocks; 2: an image1d_buffer_t view of the buffer
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

// The 8 weights of one texel component, s·q + m, in x order. Plain * and + rather than mad() and
// vload8(): PoCL calls those as functions, out of line, and spills the accumulators around each call.
#define DEQUANT8(bits, sm) \
    ((as_float8((((uint8)(bits) >> NIBBLE_SHIFTS) & 0xFu) | 0x4B000000u) - 8388608.0f) * (sm).x + (sm).y)
// X rows start at multiples of K floats, K a multiple of 32: every 8-float chunk is float8-aligned.
#define LOAD_X8(p, i) (((const __global float8*)(p))[i])

// r is a compile-time constant after unrolling: gate (or only) rows from codes_a, up rows from codes_b.
#define TEXEL_OF(r, t) ((r) < ROWS ? TEXEL(codes_a, wrow[r], t) : TEXEL(codes_b, wrow[r], t))

// One pass over K for the R rows of X from m0 (R a compile-time constant), then the epilogue and
// the stores.
#define PASS(R)                                                                                  \
    {                                                                                            \
        float8 acc[WROWS][R];                                                                    \
        _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                        \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) acc[r][mm] = (float8)0.0f;          \
        const __global float* xp = x + (size_t)m0 * k;                                           \
        for (int g = 0; g < groups; g++) {                                                       \
            float2 sm[WROWS];                                                                    \
            _Pragma("unroll") for (int r = 0; r < WROWS; r++)                                    \
                sm[r] = GROUP_SM(scale_offset, grow[r], g);                                \
            for (int t = g << group_shift; t < (g + 1) << group_shift; t++) {                    \
                uint4 tex[WROWS];                                                                \
                _Pragma("unroll") for (int r = 0; r < WROWS; r++) tex[r] = TEXEL_OF(r, t);       \
                _Pragma("unroll") for (int c = 0; c < 4; c++) {                                  \
                    float8 w[WROWS];                                                             \
                    _Pragma("unroll") for (int r = 0; r < WROWS; r++)                            \
                        w[r] = DEQUANT8(c == 0 ? tex[r].x : c == 1 ? tex[r].y                    \
                                        : c == 2 ? tex[r].z : tex[r].w, sm[r]);                  \
                    _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                           \
                        const float8 xv = LOAD_X8(xp + (size_t)mm * k, 4 * t + c);               \
                        _Pragma("unroll") for (int r = 0; r < WROWS; r++)                        \
                            acc[r][mm] += w[r] * xv;                                             \
                    }                                                                            \
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
#define EPILOGUE_STORE const float out = ya + bias[grow[r]];
#elif EPI_GATED
#define EPILOGUE_STORE                         \
    const float yb = SUM8(acc[ROWS + r][mm]);  \
    const float out = GATE_ACT(ya) * yb;
#else
#define EPILOGUE_STORE const float out = ya;
#endif

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void gemm_q4_skinny(const int m_rows, const int n_cols, const int k, const int group_shift,
                    const int ldy, const int y_col0, const int row_a0, const int row_b0,
                    const int base_a, const int base_b, const int n_rows,
                    __global const float* restrict x, __global float* restrict y,
                    CODES_T codes_a, CODES_T codes_b,
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
