// Tiled int4 GEMM, the prefill path for large M (compute-bound):
//
//   Y (M, N) = X (M, K) · Wᵀ              EPI_NONE
//   Y (M, N) = X (M, K) · Wᵀ + bias (N)   EPI_BIAS
//   Y (M, I) = SiLU(X · Wgᵀ) · (X · Wuᵀ)  EPI_SILU_MUL (W has 2·I rows: gate 0..I−1, up I..2I−1)
//   Y (M, I) = GELU(X · Wgᵀ) · (X · Wuᵀ)  EPI_GELU_MUL (the same rows; GELU's tanh form)
//
// W (N, K) in perfx's device form (kernels/q4.h): 32 codes per uint4 texel in the weight's LAYOUT, from a
// buffer (READ 0), image2d_t row blocks (READ 1) or an image1d_buffer_t view (READ 2), (s, m) per group
// of G in its Q4_SCALES form, w = s·q + m.
// X, Y, bias float32 row-major; fp32 accumulation.
//
// The parameterization follows CLBlast's xgemm (src/kernels/level3/xgemm_part1.opencl): a
// work-group of MDIMC × NDIMC work-items computes an MWG × NWG tile of Y, stepping over K in
// KWG-wide tiles. Per K-tile, X (MWG × KWG) and the dequantized W (NWG × KWG) are stored k-major
// in local memory — W is dequantized once per tile, not once per use — and each work-item
// accumulates an MWI × NWI register block (MWI = MWG/MDIMC, NWI = NWG/NDIMC) with VWN-wide vectors
// along N. Rows and columns of a work-item are strided by MDIMC / NDIMC·VWN (CLBlast's STRM/STRN
// = 1), so neighbouring work-items read neighbouring local memory and store neighbouring columns.
//
// Shape contract: K a multiple of 32 and of G (group_shift = log2(G / 32)); any M ≥ 1 and any
// number of columns: tiles past the edges of M, N and K are zero-filled and not stored. Launch
// arguments as in gemm_q4_skinny.cl.

#ifndef MWG
#define MWG 32  // rows of Y per work-group tile
#endif
#ifndef NWG
#define NWG 64  // columns of Y per work-group tile
#endif
#ifndef KWG
#define KWG 32  // K per local-memory tile (a multiple of 32: whole texels)
#endif
#ifndef MDIMC
#define MDIMC 8  // work-items along M
#endif
#ifndef NDIMC
#define NDIMC 8  // work-items along N
#endif
#ifndef VWN
#define VWN 8  // vector width along N of the register block and local loads: 1, 2, 4, 8 or 16
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

#define MWI (MWG / MDIMC)
#define NWI (NWG / NDIMC)
#define NVW (NWI / VWN)  // vectors per work-item along N
#define WGS (MDIMC * NDIMC)
#define TPK (KWG / 32)   // texels per row of a K-tile

#if VWN == 1
typedef float floatN;
#define LOADN(p) (*(p))
#define STOREN(v, p) (*(p) = (v))
#elif VWN == 2
typedef float2 floatN;
#define LOADN(p) vload2(0, p)
#define STOREN(v, p) vstore2(v, 0, p)
#elif VWN == 4
typedef float4 floatN;
#define LOADN(p) vload4(0, p)
#define STOREN(v, p) vstore4(v, 0, p)
#elif VWN == 8
typedef float8 floatN;
#define LOADN(p) vload8(0, p)
#define STOREN(v, p) vstore8(v, 0, p)
#elif VWN == 16
typedef float16 floatN;
#define LOADN(p) vload16(0, p)
#define STOREN(v, p) vstore16(v, 0, p)
#endif

#include "q4.h"
#define CODES CODES_T

inline float8 dequant8(const uint v, const float2 sm) {
    const uint8 q = (uint8)(v, v >> 4, v >> 8, v >> 12, v >> 16, v >> 20, v >> 24, v >> 28) & (uint8)0xFu;
    return mad(convert_float8(q), (float8)sm.x, (float8)sm.y);
}

// p[0], p[stride], ... p[7·stride] = v: one texel component into the k-major local tile.
inline void store8_strided(__local float* p, const int stride, const float8 v) {
    p[0] = v.s0; p[stride] = v.s1; p[2 * stride] = v.s2; p[3 * stride] = v.s3;
    p[4 * stride] = v.s4; p[5 * stride] = v.s5; p[6 * stride] = v.s6; p[7 * stride] = v.s7;
}

// Dequantize the K-tile of NWG weight rows (rows row0 + 0..NWG−1, in codes at row − base) into
// ws[k][n]; columns past n_cols and texels past K become zeros.
// Neighbouring work-items take neighbouring texels of a row (LAYOUT 0) or of a column of rows (LAYOUT 1):
// the order in which each layout's texels lie in memory.
inline void load_w_tile(__local float* ws, CODES codes, const int row0, const int base, const int n_base,
                        const int n_cols, const int t0, const int q4_texels, const int q4_groups,
                        const int q4_rows, const int group_shift, __global const half* restrict scale_offset,
                        const int tid)
{
    for (int j = tid; j < NWG * TPK; j += WGS) {
#if LAYOUT == 1
        const int ni = j % NWG;
        const int tt = j / NWG;
#else
        const int ni = j / TPK;
        const int tt = j % TPK;
#endif
        const int t = t0 + tt;
        __local float* p = ws + 32 * tt * NWG + ni;
        if (n_base + ni < n_cols && t < q4_texels) {
            const int row = row0 + n_base + ni;
            const uint4 q = TEXEL(codes, row - base, t);
            const float2 sm = GROUP_SM(scale_offset, row, t >> group_shift);
            store8_strided(p, NWG, dequant8(q.x, sm));
            store8_strided(p + 8 * NWG, NWG, dequant8(q.y, sm));
            store8_strided(p + 16 * NWG, NWG, dequant8(q.z, sm));
            store8_strided(p + 24 * NWG, NWG, dequant8(q.w, sm));
        } else {
            for (int i = 0; i < 32; i++) p[i * NWG] = 0.0f;
        }
    }
}

// acc[mi][nv] += xs[kk][rows of mi] · ws[kk][columns of nv] for every kk of the tile.
// The block is copied into a fresh array for the tile: PoCL keeps values that live across a
// barrier in per-work-item memory, and a copy local to the region lets LLVM keep it in registers.
#define MULTIPLY_TILE(acc, ws)                                                         \
    {                                                                                  \
        floatN r[MWI][NVW];                                                            \
        _Pragma("unroll")                                                              \
        for (int mi = 0; mi < MWI; mi++) {                                             \
            _Pragma("unroll")                                                          \
            for (int nv = 0; nv < NVW; nv++) r[mi][nv] = acc[mi][nv];                  \
        }                                                                              \
        for (int kk = 0; kk < KWG; kk++) {                                             \
            float a[MWI];                                                              \
            _Pragma("unroll")                                                          \
            for (int mi = 0; mi < MWI; mi++) a[mi] = xs[kk * MWG + mi * MDIMC + tm];  \
            _Pragma("unroll")                                                          \
            for (int nv = 0; nv < NVW; nv++) {                                         \
                const floatN b = LOADN(ws + kk * NWG + (nv * NDIMC + tn) * VWN);       \
                _Pragma("unroll")                                                      \
                for (int mi = 0; mi < MWI; mi++) r[mi][nv] = mad((floatN)a[mi], b, r[mi][nv]); \
            }                                                                          \
        }                                                                              \
        _Pragma("unroll")                                                              \
        for (int mi = 0; mi < MWI; mi++) {                                             \
            _Pragma("unroll")                                                          \
            for (int nv = 0; nv < NVW; nv++) acc[mi][nv] = r[mi][nv];                  \
        }                                                                              \
    }

__kernel __attribute__((reqd_work_group_size(NDIMC, MDIMC, 1)))
void gemm_q4_tiled(const int m_rows, const int n_cols, const int k, const int group_shift,
                   const int ldy, const int y_col0, const int row_a0, const int row_b0,
                   const int base_a, const int base_b, const int n_rows,
                   __global const float* restrict x, __global float* restrict y,
                   CODES codes_a, CODES codes_b,
                   __global const half* restrict scale_offset, __global const float* restrict bias)
{
    const int tn = get_local_id(0);
    const int tm = get_local_id(1);
    const int tid = tm * NDIMC + tn;
    const int n_base = get_group_id(0) * NWG;
    const int m_base = get_group_id(1) * MWG;
    const int texels = k >> 5;
    const int groups = texels >> group_shift;

    __local float xs[KWG * MWG];
    __local float wa[KWG * NWG];
    floatN acc_a[MWI][NVW];
#if EPI_GATED
    __local float wb[KWG * NWG];
    floatN acc_b[MWI][NVW];
#endif
    _Pragma("unroll")
    for (int mi = 0; mi < MWI; mi++) {
        _Pragma("unroll")
        for (int nv = 0; nv < NVW; nv++) {
            acc_a[mi][nv] = (floatN)0.0f;
#if EPI_GATED
            acc_b[mi][nv] = (floatN)0.0f;
#endif
        }
    }

    for (int k0 = 0; k0 < k; k0 += KWG) {
        // X tile, float4 loads along K, stored k-major; rows past M and K past the end are zeros.
        for (int j = tid; j < MWG * KWG / 4; j += WGS) {
            const int mi = j / (KWG / 4);
            const int kq = (j % (KWG / 4)) * 4;
            const int gm = m_base + mi;
            const int gk = k0 + kq;
            const float4 v = (gm < m_rows && gk < k) ? vload4(0, x + (size_t)gm * k + gk) : (float4)0.0f;
            xs[kq * MWG + mi] = v.x;
            xs[(kq + 1) * MWG + mi] = v.y;
            xs[(kq + 2) * MWG + mi] = v.z;
            xs[(kq + 3) * MWG + mi] = v.w;
        }
        load_w_tile(wa, codes_a, row_a0, base_a, n_base, n_cols, k0 >> 5, texels, groups, n_rows, group_shift,
                    scale_offset, tid);
#if EPI_GATED
        load_w_tile(wb, codes_b, row_b0, base_b, n_base, n_cols, k0 >> 5, texels, groups, n_rows, group_shift,
                    scale_offset, tid);
#endif
        barrier(CLK_LOCAL_MEM_FENCE);
        MULTIPLY_TILE(acc_a, wa)
#if EPI_GATED
        MULTIPLY_TILE(acc_b, wb)
#endif
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    _Pragma("unroll")
    for (int mi = 0; mi < MWI; mi++) {
        const int gm = m_base + mi * MDIMC + tm;
        _Pragma("unroll")
        for (int nv = 0; nv < NVW; nv++) {
            float va[VWN];
            STOREN(acc_a[mi][nv], va);
#if EPI_GATED
            float vb[VWN];
            STOREN(acc_b[mi][nv], vb);
#endif
            const int col0 = n_base + (nv * NDIMC + tn) * VWN;
            for (int v = 0; v < VWN; v++) {
                const int col = col0 + v;
                if (gm < m_rows && col < n_cols) {
#if EPILOGUE == EPI_BIAS
                    const float out = va[v] + bias[row_a0 + col];
#elif EPI_GATED
                    const float out = GATE_ACT(va[v]) * vb[v];
#else
                    const float out = va[v];
#endif
                    y[(size_t)gm * ldy + y_col0 + col] = out;
                }
            }
        }
    }
}
