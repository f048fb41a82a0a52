// Int4 GEMM for a few rows with int8 activations, weight rows in the vector lanes: the batched decode step's
// products (one row of X a sequence, M = 2..16) and short prompt pieces, with gemm_q4_i8.cl's maths, inputs
// and epilogues,
//
//   Y (M, N) = X (M, K) · Wᵀ              EPI_NONE
//   Y (M, N) = X (M, K) · Wᵀ + bias (N)   EPI_BIAS
//   Y (M, I) = SiLU(X · Wgᵀ) · (X · Wuᵀ)  EPI_SILU_MUL (W has 2·I rows, gate 0..I−1, up I..2I−1)
//   Y (M, I) = GELU(X · Wgᵀ) · (X · Wuᵀ)  EPI_GELU_MUL
//
// W (N, K) in perfx's device form (kernels/q4.h); Y and bias float32, row-major. X arrives as llama.cpp's Q8_1
// blocks of 32 (kernels/q8_1.h, texel order: a block's 16 even codes, then its 16 odd ones; the step d and Σ d·q
// per block), written by the norm before the product or by gemm_q4_i8.cl's gemm_q4_i8_quantize_x. Per group of
// a weight row, Σ_k (s·q_k + m)·x_k ≈ s·Σ_b d_b·Σ_{k∈b} q_k·q_x,k + m·Σ_b d_b·Σ q_x.
//
// Why a kernel of its own: gemm_q4_i8 puts K in the lanes, so per row of X and texel it converts 8 int lanes and
// scales them by that one weight row's d·s, work no number of rows of X shares; on a CPU that floor costs each
// row of X about a third of a GEMV (benchmarks/NOTES.md, issue 43's CPU goal). Here a work-item owns RL
// neighbouring weight rows, one an int lane: byte p of a texel holds the codes (q_2p, q_2p+1) of each row, which
// become one int16 pair a lane; X's pair (x_2p, x_2p+1) is one int broadcast to every lane, and the pairs'
// products summed in neighbours (the pattern x86 compilers turn into vpmaddwd) give RL rows' partial sums at
// once. A texel's RL int sums are then converted and scaled by the RL rows' scales in one vector multiply-add
// per row of X. The weight's nibbles are unpacked once a texel for the R rows of X of a pass; each row of X's
// texel is paired (x_2p | x_2p+1 << 16) once, in one int16, from which each pair is broadcast: from registers
// (XL 0: a GPU's work-item holds it), or from the work-item's own slice of local memory (XL 1: a CPU broadcasts
// from memory inside the multiply-add, vpdpwssd's {1to8}, where a register's lane takes a shuffle first; no
// other work-item reads the slice, so no barrier).
//
// On a GPU each lane is a scalar of the work-item (no cross-lane sums at all); neighbouring work-items own
// neighbouring row blocks, so the interleaved layout's texels (RL·16 bytes together at one t) coalesce. On
// Intel's CPU runtime work-groups of 8 (or 1) keep each work-item's vector code: at 16 and more it may vectorize
// across work-items, where every int8 of a work-item takes 8 registers and spills (benchmarks/NOTES.md).
//
// Shape contract (as gemm_q4_i8): K a multiple of 32 and of G ∈ {32, 64, 128} (group_shift = log2(G / 32));
// any M ≥ 1 (passes of MT rows, the remainder in passes of 8, 4, 2, 1: kernels/m_passes.h) and any number of
// columns (the last work-item's lanes past n_cols read the last column's rows again and store nothing). One
// launch covers the columns y_col0 .. y_col0 + n_cols − 1 of Y (row stride ldy); their weight rows start at
// row_a0 (gate or only) and row_b0 (up), which lie in codes_a / codes_b at row − base_a / row − base_b (images
// hold row blocks; with a buffer both bases are 0). Scales and bias are indexed by global row. Work-group
// (WGS); global ⌈n_cols / (RL·WGS)⌉·WGS.

#ifndef WGS
#define WGS 8  // work-items per work-group, each independent (RL columns apiece)
#endif
#ifndef RL
#define RL 8  // weight rows (output columns) per work-item, one an int lane: 4 or 8
#endif
#ifndef MT
#define MT 4  // rows of X per pass: RL·MT int sums and float totals (twice for gate-up), a power of two
#endif
#ifndef XL
#define XL 1  // X's pairs of a texel broadcast from registers (0) or from the work-item's slice of local memory (1)
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
#include "q4.h"

#if EPI_GATED
#define SETS 2  // weight-row sets a work-item applies: gate rows, then up rows
#else
#define SETS 1
#endif

// The lane types: RL rows as int / float / uint lanes, and each row's int16 pair of codes (2·RL shorts).
#if RL == 8
#define INT_RL int8
#define UINT_RL uint8
#define FLOAT_RL float8
#define SHORT_P short16
#define INT_P int16
#define AS_SHORT_P as_short16
#define CONVERT_INT_P convert_int16
#define CONVERT_FLOAT_RL convert_float8
#define PAIR_SUM(p) ((int8)((p).s0, (p).s2, (p).s4, (p).s6, (p).s8, (p).sa, (p).sc, (p).se) \
                     + (int8)((p).s1, (p).s3, (p).s5, (p).s7, (p).s9, (p).sb, (p).sd, (p).sf))
#define VLOAD_RL vload8
#define VSTORE_RL vstore8
#elif RL == 4
#define INT_RL int4
#define UINT_RL uint4
#define FLOAT_RL float4
#define SHORT_P short8
#define INT_P int8
#define AS_SHORT_P as_short8
#define CONVERT_INT_P convert_int8
#define CONVERT_FLOAT_RL convert_float4
#define PAIR_SUM(p) ((int4)((p).s0, (p).s2, (p).s4, (p).s6) + (int4)((p).s1, (p).s3, (p).s5, (p).s7))
#define VLOAD_RL vload4
#define VSTORE_RL vstore4
#else
#error "RL (weight rows a work-item, one an int lane) is 4 or 8"
#endif

// Component S (s0 .. s3) of the RL texels tex[0..RL−1]: the rows' words side by side, one a lane.
#if RL == 8
#define WORDS(tex, S) ((uint8)(tex[0].S, tex[1].S, tex[2].S, tex[3].S, tex[4].S, tex[5].S, tex[6].S, tex[7].S))
#else
#define WORDS(tex, S) ((uint4)(tex[0].S, tex[1].S, tex[2].S, tex[3].S))
#endif

// The (s, m) of group g of the RL rows `rows` (global rows) as two lane vectors.
#define SM_OF(rows, g, j) const float2 sm##j = GROUP_SM(scale_offset, rows[j], g);
#if RL == 8
#define GROUP_SM_RL(s, m, rows, g)                                                                          \
    {                                                                                                       \
        SM_OF(rows, g, 0) SM_OF(rows, g, 1) SM_OF(rows, g, 2) SM_OF(rows, g, 3)                             \
        SM_OF(rows, g, 4) SM_OF(rows, g, 5) SM_OF(rows, g, 6) SM_OF(rows, g, 7)                             \
        s = (float8)(sm0.x, sm1.x, sm2.x, sm3.x, sm4.x, sm5.x, sm6.x, sm7.x);                               \
        m = (float8)(sm0.y, sm1.y, sm2.y, sm3.y, sm4.y, sm5.y, sm6.y, sm7.y);                               \
    }
#else
#define GROUP_SM_RL(s, m, rows, g)                                                                          \
    {                                                                                                       \
        SM_OF(rows, g, 0) SM_OF(rows, g, 1) SM_OF(rows, g, 2) SM_OF(rows, g, 3)                             \
        s = (float4)(sm0.x, sm1.x, sm2.x, sm3.x);                                                           \
        m = (float4)(sm0.y, sm1.y, sm2.y, sm3.y);                                                           \
    }
#endif

#if EPILOGUE == EPI_BIAS
#define EPILOGUE_OUT(mm) (acc[0][mm] + bias_rl)
#elif EPI_GATED
// the activation lane by lane, as gemm_q4_i8's scalars take it: PoCL's LLVM fails to select exp of a float8
inline FLOAT_RL gated_lanes(const FLOAT_RL gate, const FLOAT_RL up)
{
    float g[RL], u[RL];
    VSTORE_RL(gate, 0, g);
    VSTORE_RL(up, 0, u);
    _Pragma("unroll") for (int j = 0; j < RL; j++) g[j] = GATE_ACT(g[j]) * u[j];
    return VLOAD_RL(0, g);
}
#define EPILOGUE_OUT(mm) gated_lanes(acc[0][mm], acc[1][mm])
#else
#define EPILOGUE_OUT(mm) (acc[0][mm])
#endif

// A row of X's 16 pairs of a texel, made as one vector and read one int at a time (XL 0).
union pairs16 {
    int16 v;
    int s[16];
};
#if XL
// (a vector store, not vstore16: PoCL's LLVM fails to select vstore16 to local or private memory)
#define PAIRS_DECLARE(R) __local int16* xpair = x_local[get_local_id(0)];
#define PAIRS_STORE(mm, pairs) xpair[mm] = (pairs);
#define PAIR_OF(mm, P) (((__local const int*)(xpair + (mm)))[P])
#else
#define PAIRS_DECLARE(R) union pairs16 xpair[R];
#define PAIRS_STORE(mm, pairs) xpair[mm].v = (pairs);
#define PAIR_OF(mm, P) xpair[mm].s[P]
#endif

// The products of byte I of the RL texels' word (the codes q_2p, q_2p+1 of pair p, an int16 pair a lane) with
// X's pair p (component P of each row's pairs) broadcast, for the R rows of X.
#define BYTE_PRODUCTS(R, I, P)                                                                                \
    {                                                                                                         \
        const UINT_RL b = words >> (8 * (I));                                                                 \
        const INT_P wq = CONVERT_INT_P(AS_SHORT_P((b & 0xFu) | ((b & 0xF0u) << 12)));                         \
        _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                                    \
            const INT_P xq2 = CONVERT_INT_P(AS_SHORT_P((INT_RL)PAIR_OF(mm, P)));                              \
            dot[mm] += PAIR_SUM(wq * xq2);                                                                    \
        }                                                                                                     \
    }
// Word S of the RL texels: its bytes are the pairs P0 .. P3.
#define WORD_PRODUCTS(R, S, P0, P1, P2, P3)                                                                   \
    {                                                                                                         \
        const UINT_RL words = WORDS(tex, S);                                                                  \
        BYTE_PRODUCTS(R, 0, P0) BYTE_PRODUCTS(R, 1, P1) BYTE_PRODUCTS(R, 2, P2) BYTE_PRODUCTS(R, 3, P3)       \
    }

// One pass over K for the R rows of X from m0 (R a compile-time constant), then the epilogue and the stores.
// Per texel, set and row of X: 32 products |q·q_x| ≤ 15·127 in int lanes (a texel's sum ≤ 60960), then fp32
// times d·s; per group m·Σ d·q_x.
#define PASS(R)                                                                                               \
    {                                                                                                         \
        FLOAT_RL acc[SETS][R];                                                                                \
        _Pragma("unroll") for (int e = 0; e < SETS; e++)                                                      \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) acc[e][mm] = (FLOAT_RL)0.0f;                     \
        const __global char16* xqp = xq + (size_t)m0 * 2 * texels;                                            \
        const __global float2* xdp = x_step_sum + (size_t)m0 * texels;                                        \
        for (int g = 0; g < groups; g++) {                                                                    \
            FLOAT_RL s[SETS], om[SETS];                                                                       \
            _Pragma("unroll") for (int e = 0; e < SETS; e++) GROUP_SM_RL(s[e], om[e], grow[e], g)             \
            float xsum[R];                                                                                    \
            _Pragma("unroll") for (int mm = 0; mm < R; mm++) xsum[mm] = 0.0f;                                 \
            for (int t = g << group_shift; t < (g + 1) << group_shift; t++) {                                 \
                PAIRS_DECLARE(R)                                                                              \
                float xd[R];                                                                                  \
                _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                            \
                    const int16 xe = convert_int16(xqp[(size_t)mm * 2 * texels + 2 * t]);                    \
                    const int16 xo = convert_int16(xqp[(size_t)mm * 2 * texels + 2 * t + 1]);                \
                    PAIRS_STORE(mm, (xe & 0xFFFF) | (xo << 16))                                                \
                    const float2 ds = xdp[(size_t)mm * texels + t];                                           \
                    xd[mm] = ds.x;                                                                            \
                    xsum[mm] += ds.y;                                                                         \
                }                                                                                             \
                _Pragma("unroll") for (int e = 0; e < SETS; e++) {                                            \
                    uint4 tex[RL];                                                                            \
                    _Pragma("unroll") for (int j = 0; j < RL; j++)                                            \
                        tex[j] = e == 0 ? TEXEL(codes_a, wrow[0][j], t) : TEXEL(codes_b, wrow[SETS - 1][j], t); \
                    INT_RL dot[R];                                                                            \
                    _Pragma("unroll") for (int mm = 0; mm < R; mm++) dot[mm] = (INT_RL)0;                     \
                    WORD_PRODUCTS(R, s0, 0, 1, 2, 3) WORD_PRODUCTS(R, s1, 4, 5, 6, 7)                         \
                    WORD_PRODUCTS(R, s2, 8, 9, 10, 11) WORD_PRODUCTS(R, s3, 12, 13, 14, 15)                   \
                    _Pragma("unroll") for (int mm = 0; mm < R; mm++)                                          \
                        acc[e][mm] = CONVERT_FLOAT_RL(dot[mm]) * (s[e] * xd[mm]) + acc[e][mm];                \
                }                                                                                             \
            }                                                                                                 \
            _Pragma("unroll") for (int e = 0; e < SETS; e++)                                                  \
                _Pragma("unroll") for (int mm = 0; mm < R; mm++) acc[e][mm] = om[e] * xsum[mm] + acc[e][mm];  \
        }                                                                                                     \
        _Pragma("unroll") for (int mm = 0; mm < R; mm++) {                                                    \
            const FLOAT_RL out = EPILOGUE_OUT(mm);                                                            \
            __global float* yr = y + (size_t)(m0 + mm) * ldy + y_col0 + col0;                                 \
            if (full) {                                                                                       \
                VSTORE_RL(out, 0, yr);                                                                        \
            } else {                                                                                          \
                float lanes[RL];                                                                              \
                VSTORE_RL(out, 0, lanes);                                                                     \
                _Pragma("unroll") for (int j = 0; j < RL; j++)                                                \
                    if (col0 + j < n_cols) yr[j] = lanes[j];                                                  \
            }                                                                                                 \
        }                                                                                                     \
        m0 += R;                                                                                              \
    }

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void gemm_q4_rows_i8(const int m_rows, const int n_cols, const int k, const int group_shift,
                     const int ldy, const int y_col0, const int row_a0, const int row_b0,
                     const int base_a, const int base_b, const int n_rows,
                     __global const char16* restrict xq, __global const float2* restrict x_step_sum,
                     __global float* restrict y, CODES_T codes_a, CODES_T codes_b,
                     __global const half* restrict scale_offset, __global const float* restrict bias)
{
#if XL
    __local int16 x_local[WGS][MT];           // each work-item's own pairs of the rows of X of a pass
#endif
    const int col0 = get_global_id(0) * RL;  // first output column of this work-item, in the launch
    if (col0 >= n_cols) return;               // no barriers: a work-item past the columns has nothing to do
    const bool full = col0 + RL <= n_cols;
    const int texels = k >> 5;
    const int groups = texels >> group_shift;
    const int q4_rows = n_rows, q4_texels = texels, q4_groups = groups;  // kernels/q4.h

    // Weight rows (within codes_a / codes_b) and global rows (scales, bias) of each lane of each set. Lanes past
    // n_cols read the last column's rows again (harmless) and store nothing.
    int wrow[SETS][RL], grow[SETS][RL];
    _Pragma("unroll")
    for (int j = 0; j < RL; j++) {
        const int c = min(col0 + j, n_cols - 1);
        wrow[0][j] = row_a0 + c - base_a;
        grow[0][j] = row_a0 + c;
#if EPI_GATED
        wrow[1][j] = row_b0 + c - base_b;
        grow[1][j] = row_b0 + c;
#endif
    }
#if EPILOGUE == EPI_BIAS
    float bias_lanes[RL];
    _Pragma("unroll") for (int j = 0; j < RL; j++) bias_lanes[j] = bias[grow[0][j]];
    const FLOAT_RL bias_rl = VLOAD_RL(0, bias_lanes);
#endif

    int m0 = 0;
#include "m_passes.h"
}
