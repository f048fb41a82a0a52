// fp16 register-tiled int4 GEMM, a prefill path for GPUs with cl_khr_fp16 (after llama.cpp's Adreno
// mul_mat_Ab_Bi_8x4: half arithmetic in registers, no local memory, no barriers):
//
//   Y (M, N) = X (M, K) · Wᵀ              EPI_NONE
//   Y (M, N) = X (M, K) · Wᵀ + bias (N)   EPI_BIAS
//   Y (M, I) = SiLU(X · Wgᵀ) · (X · Wuᵀ)  EPI_SILU_MUL (W has 2·I rows: gate 0..I−1, up I..2I−1)
//   Y (M, I) = GELU(X · Wgᵀ) · (X · Wuᵀ)  EPI_GELU_MUL (the same rows; GELU's tanh form)
//
// W (N, K) in perfx's device form (kernels/q4.h): codes in the weight's LAYOUT, from a buffer (READ 0),
// image2d_t row blocks (READ 1) or an image1d_buffer_t view (READ 2); (s, m) per group of G in its Q4_SCALES form.
// X arrives as half (M, K), converted once per call by convert_f16 below; Y and bias float32, row-major.
//
// A work-item owns TN consecutive output columns (TN weight rows, one halfTN vector: twice that for the
// gate-up epilogue) and TM rows of X, and walks the whole of K: per texel component it unpacks the codes of
// its TN rows side by side, (q − 8) as halfTN, and multiplies them by one half of X per row of X, so one
// halfTN multiply-add serves TN outputs. The half sums cover one texel (32 values of K) and then join fp32
// totals: s·Σ(q − 8)·x + (m + 8s)·Σx, with Σx of each texel in fp32. No local memory, no barriers: each
// work-item's weights are read once per TM rows of X, and neighbouring work-items read neighbouring rows
// (coalesced with the interleaved layout).
//
// Shape contract as gemm_q4_skinny.cl: K a multiple of 32 and of G (group_shift = log2(G / 32)), any M ≥ 1
// and any number of columns (edges clamped on load, not stored). Launch arguments as there, with x half.
// Work-group (WGS, 1); global (WGS·⌈n_cols / (TN·WGS)⌉, ⌈M / TM⌉).

#ifndef WGS
#define WGS 64  // work-items per work-group (independent: no local memory, no barriers)
#endif
#ifndef TN
#define TN 4  // output columns per work-item, one halfTN vector (4 or 8)
#endif
#ifndef TM
#define TM 4  // rows of X per work-item
#endif
#ifndef READ
#define READ 0  // 0: codes from a uint4 buffer; 1: image2d_t row blocks; 2: an image1d_buffer_t view of the buffer
#endif
#ifndef LAYOUT
#define LAYOUT 0  // the weight's layout (kernels/q4.h): 0 rows along K, 1 interleaved (set from the weight)
#endif
#ifndef HALF
#define HALF 1  // fp16 arithmetic: the reason this kernel exists (a capability check, not a choice)
#endif
#ifndef EPILOGUE
#define EPILOGUE EPI_NONE  // none, + bias[column], or SiLU / GELU (gate)·up (kernels/epilogue.h)
#endif

#include "epilogue.h"

#include "q4.h"
#pragma OPENCL EXTENSION cl_khr_fp16 : enable

#if TN == 8
typedef half8 halfN;
typedef float8 floatN;
typedef uint8 uintN;
typedef ushort8 ushortN;
#define CONVERT_FLOATN convert_float8
#define CONVERT_USHORTN convert_ushort8
#define AS_HALFN as_half8
#define VSTOREN vstore8
#elif TN == 4
typedef half4 halfN;
typedef float4 floatN;
typedef uint4 uintN;
typedef ushort4 ushortN;
#define CONVERT_FLOATN convert_float4
#define CONVERT_USHORTN convert_ushort4
#define AS_HALFN as_half4
#define VSTOREN vstore4
#else
#error "TN must be 4 or 8"
#endif

#if EPI_GATED
#define SETS 2  // gate rows, then up rows
#else
#define SETS 1
#endif

// x (count floats) → half, once per call: the activations of every row of X for all the GEMM's columns.
__kernel void convert_f16(const int count, __global const float* restrict x, __global half* restrict out)
{
    const int i = get_global_id(0);
    if (8 * i + 8 <= count) {
        vstore_half8(vload8(i, x), i, out);
    } else {
        for (int e = 8 * i; e < count; ++e) vstore_half(x[e], e, out);
    }
}

// The TN rows' codes of one texel component at nibble j, centred, as halfTN: (q − 8) exact in half.
#define CODES_N(w, j) (AS_HALFN(CONVERT_USHORTN(((w) >> (4 * (j))) & 0xFu) | (ushortN)0x6400) - (halfN)1032.0h)

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void gemm_q4_f16(const int m_rows, const int n_cols, const int k, const int group_shift,
                 const int ldy, const int y_col0, const int row_a0, const int row_b0,
                 const int base_a, const int base_b, const int n_rows,
                 __global const half* restrict x, __global float* restrict y,
                 CODES_T codes_a, CODES_T codes_b,
                 __global const half* restrict scale_offset, __global const float* restrict bias)
{
    const int col0 = get_global_id(0) * TN;   // first output column of this work-item, in the launch
    const int m0 = get_global_id(1) * TM;     // first row of X
    const int q4_texels = k >> 5;
    const int q4_groups = q4_texels >> group_shift;
    const int q4_rows = n_rows;

    // Weight rows in codes_a / codes_b and global rows (scales, bias) of set s, column r. Columns past
    // n_cols and rows of X past m_rows read the last valid ones again and store nothing.
    int wrow[SETS][TN], grow[SETS][TN];
    for (int r = 0; r < TN; ++r) {
        const int c = min(col0 + r, n_cols - 1);
        wrow[0][r] = row_a0 + c - base_a;
        grow[0][r] = row_a0 + c;
#if EPI_GATED
        wrow[1][r] = row_b0 + c - base_b;
        grow[1][r] = row_b0 + c;
#endif
    }
    const __global half* xr[TM];
    for (int mm = 0; mm < TM; ++mm) xr[mm] = x + (size_t)min(m0 + mm, m_rows - 1) * k;

    floatN total[SETS][TM];
    for (int s = 0; s < SETS; ++s)
        for (int mm = 0; mm < TM; ++mm) total[s][mm] = (floatN)0.0f;

    for (int g = 0; g < q4_groups; ++g) {
        floatN scale[SETS], offset[SETS];
        for (int s = 0; s < SETS; ++s) {
            float sc[TN], of[TN];
            for (int r = 0; r < TN; ++r) {
                const float2 sm = GROUP_SM(scale_offset, grow[s][r], g);
                sc[r] = sm.x;
                of[r] = sm.y + 8.0f * sm.x;  // the centred codes move 8·s into the offset
            }
#if TN == 8
            scale[s] = vload8(0, sc);
            offset[s] = vload8(0, of);
#else
            scale[s] = vload4(0, sc);
            offset[s] = vload4(0, of);
#endif
        }
        for (int t = g << group_shift; t < (g + 1) << group_shift; ++t) {
            uint4 tex[SETS][TN];
            for (int s = 0; s < SETS; ++s)
                for (int r = 0; r < TN; ++r)
                    tex[s][r] = s == 0 ? TEXEL(codes_a, wrow[0][r], t) : TEXEL(codes_b, wrow[SETS - 1][r], t);
            halfN acc[SETS][TM];
            for (int s = 0; s < SETS; ++s)
                for (int mm = 0; mm < TM; ++mm) acc[s][mm] = (halfN)0.0h;
            float xsum[TM];
            for (int mm = 0; mm < TM; ++mm) xsum[mm] = 0.0f;
            for (int c = 0; c < 4; ++c) {
                uintN w[SETS];
                for (int s = 0; s < SETS; ++s) {
                    uint v[TN];
                    for (int r = 0; r < TN; ++r)
                        v[r] = c == 0 ? tex[s][r].x : c == 1 ? tex[s][r].y : c == 2 ? tex[s][r].z : tex[s][r].w;
#if TN == 8
                    w[s] = (uint8)(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
#else
                    w[s] = (uint4)(v[0], v[1], v[2], v[3]);
#endif
                }
                half8 xv[TM];
                for (int mm = 0; mm < TM; ++mm) {
                    xv[mm] = vload8(4 * t + c, xr[mm]);
                    const float8 xf = convert_float8(xv[mm]);
                    xsum[mm] += SUM8(xf);
                }
                #pragma unroll
                for (int j = 0; j < 8; ++j) {
                    halfN q[SETS];
                    for (int s = 0; s < SETS; ++s) q[s] = CODES_N(w[s], j);
                    for (int mm = 0; mm < TM; ++mm) {
                        const half xj = j == 0 ? xv[mm].s0 : j == 1 ? xv[mm].s1 : j == 2 ? xv[mm].s2
                                      : j == 3 ? xv[mm].s3 : j == 4 ? xv[mm].s4 : j == 5 ? xv[mm].s5
                                      : j == 6 ? xv[mm].s6 : xv[mm].s7;
                        for (int s = 0; s < SETS; ++s) acc[s][mm] = mad(q[s], (halfN)xj, acc[s][mm]);
                    }
                }
            }
            // One texel's half sums join the fp32 totals: fp16 rounding never builds up beyond 32 terms.
            for (int s = 0; s < SETS; ++s)
                for (int mm = 0; mm < TM; ++mm)
                    total[s][mm] += scale[s] * CONVERT_FLOATN(acc[s][mm]) + offset[s] * xsum[mm];
        }
    }

    for (int mm = 0; mm < TM; ++mm) {
        if (m0 + mm >= m_rows) break;
        float out[TN];
#if EPI_GATED
        const floatN gate = total[0][mm], up = total[1][mm];
        VSTOREN(GATE_ACT(gate) * up, 0, out);
#else
        VSTOREN(total[0][mm], 0, out);
#endif
        for (int r = 0; r < TN; ++r) {
            if (col0 + r >= n_cols) break;
#if EPILOGUE == EPI_BIAS
            out[r] += bias[grow[0][r]];
#endif
            y[(size_t)(m0 + mm) * ldy + y_col0 + col0 + r] = out[r];
        }
    }
}
