// Tall-skinny int4 GEMM, the prefill path for small M (a few to ~32 tokens):
//
//   Y (M, N) = X (M, K) · Wᵀ              EPILOGUE 0
//   Y (M, N) = X (M, K) · Wᵀ + bias (N)   EPILOGUE 1 (QKV with a bias, e.g. Qwen)
//   Y (M, I) = SiLU(X · Wgᵀ) · (X · Wuᵀ)  EPILOGUE 2 (gate-up: W has 2·I rows, gate 0..I−1, up I..2I−1)
//
// W (N, K) in perfx's device form: codes q ∈ [0, 15], 32 per uint4 texel (code 32t + 8c + j in
// component c, bits 4j..4j+3), rows contiguous along K, read from a buffer (READ 0) or an image2d_t
// row block (READ 1); one half2 (s, m) per group of G along K, w = s·q + m. X, Y, bias float32,
// row-major. Accumulation in fp32.
//
// Still memory-bound at small M: each work-item owns one output column (one weight row, two for
// the gate-up epilogue) and a 1/KLANES slice of K, dequantizes each texel once and multiplies it
// into MT rows of X held as float8 accumulators; M > MT loops over passes (the weight slice is
// then re-read from cache, not from DRAM). The KLANES partial sums meet in local memory.
//
// Shape contract: K a multiple of 32 and of G ∈ {32, 64, 128} (group_shift = log2(G / 32));
// any M ≥ 1 and any number of columns (edges guarded). One launch covers the columns
// y_col0 .. y_col0 + n_cols − 1 of Y (row stride ldy); their weight rows start at row_a0 (gate or
// only) and row_b0 (up), which lie in codes_a / codes_b at row − base_a / row − base_b (images
// hold row blocks; with a buffer both bases are 0). Scales and bias are indexed by global row.

#ifndef NWG
#define NWG 8  // output columns per work-group (work-group dimension 1)
#endif
#ifndef KLANES
#define KLANES 4  // work-items along K per column, their partial sums added in local memory
#endif
#ifndef MT
#define MT 8  // rows of X per pass, each a float8 accumulator in registers
#endif
#ifndef READ
#define READ 1  // 0: codes from a uint4 buffer; 1: from an image2d_t (texture cache on GPUs)
#endif
#ifndef EPILOGUE
#define EPILOGUE 0  // 0: none; 1: + bias[column]; 2: SiLU(gate)·up
#endif

#if EPILOGUE == 2
#define NOUT 2
#else
#define NOUT 1
#endif

#if READ == 1
#define CODES __read_only image2d_t
__constant sampler_t SAMPLER = CLK_NORMALIZED_COORDS_FALSE | CLK_ADDRESS_NONE | CLK_FILTER_NEAREST;
#define LOAD_TEXEL(codes, row, t) read_imageui(codes, SAMPLER, (int2)((t), (row)))
#else
#define CODES __global const uint4* restrict
#define LOAD_TEXEL(codes, row, t) (codes)[(size_t)(row) * texels + (t)]
#endif

// Eight codes of one texel component as floats, w = s·q + m.
inline float8 dequant8(const uint v, const float2 sm) {
    const uint8 q = (uint8)(v, v >> 4, v >> 8, v >> 12, v >> 16, v >> 20, v >> 24, v >> 28) & (uint8)0xFu;
    return mad(convert_float8(q), (float8)sm.x, (float8)sm.y);
}

inline float sum8(const float8 v) {
    const float4 h = v.lo + v.hi;
    return (h.x + h.y) + (h.z + h.w);
}

// acc[mm] += X[row, 32t .. 32t + 31] · w for the rows of this pass; rows past M are skipped
// (a uniform branch), so a pass over the last few rows costs only those rows.
#define MULTIPLY_TEXEL(acc, w0, w1, w2, w3)                                            \
    _Pragma("unroll")                                                                  \
    for (int mm = 0; mm < MT; mm++) {                                                  \
        if (mm < rows) {                                                               \
            const __global float* xr = x + (size_t)(m0 + mm) * k + 32 * t;             \
            acc[mm] = mad(vload8(0, xr), w0, acc[mm]);                                 \
            acc[mm] = mad(vload8(1, xr), w1, acc[mm]);                                 \
            acc[mm] = mad(vload8(2, xr), w2, acc[mm]);                                 \
            acc[mm] = mad(vload8(3, xr), w3, acc[mm]);                                 \
        }                                                                              \
    }

__kernel __attribute__((reqd_work_group_size(KLANES, NWG, 1)))
void gemm_q4_skinny(const int m_rows, const int n_cols, const int k, const int group_shift,
                    const int ldy, const int y_col0, const int row_a0, const int row_b0,
                    const int base_a, const int base_b,
                    __global const float* restrict x, __global float* restrict y,
                    CODES codes_a, CODES codes_b,
                    __global const half* restrict scale_offset, __global const float* restrict bias)
{
    const int lane = get_local_id(0);
    const int r = get_local_id(1);
    const int col = get_group_id(1) * NWG + r;
    const bool live = col < n_cols;
    // Columns past the edge compute a valid neighbour (and store nothing): every item joins the barriers.
    const int c = live ? col : n_cols - 1;
    const int texels = k >> 5;
    const int groups = texels >> group_shift;
    const int row_a = row_a0 + c;
    const int row_b = row_b0 + c;
#if KLANES > 1
    __local float partial[NWG][KLANES][NOUT * MT];
#endif

    for (int m0 = 0; m0 < m_rows; m0 += MT) {
        const int rows = min(MT, m_rows - m0);
        float8 acc_a[MT];
#if EPILOGUE == 2
        float8 acc_b[MT];
#endif
        _Pragma("unroll")
        for (int mm = 0; mm < MT; mm++) {
            acc_a[mm] = (float8)0.0f;
#if EPILOGUE == 2
            acc_b[mm] = (float8)0.0f;
#endif
        }

        for (int t = lane; t < texels; t += KLANES) {
            const uint4 qa = LOAD_TEXEL(codes_a, row_a - base_a, t);
            const float2 sa = vload_half2(row_a * groups + (t >> group_shift), scale_offset);
            const float8 a0 = dequant8(qa.x, sa), a1 = dequant8(qa.y, sa);
            const float8 a2 = dequant8(qa.z, sa), a3 = dequant8(qa.w, sa);
            MULTIPLY_TEXEL(acc_a, a0, a1, a2, a3)
#if EPILOGUE == 2
            const uint4 qb = LOAD_TEXEL(codes_b, row_b - base_b, t);
            const float2 sb = vload_half2(row_b * groups + (t >> group_shift), scale_offset);
            const float8 b0 = dequant8(qb.x, sb), b1 = dequant8(qb.y, sb);
            const float8 b2 = dequant8(qb.z, sb), b3 = dequant8(qb.w, sb);
            MULTIPLY_TEXEL(acc_b, b0, b1, b2, b3)
#endif
        }

#if KLANES > 1
        _Pragma("unroll")
        for (int mm = 0; mm < MT; mm++) {
            partial[r][lane][mm] = sum8(acc_a[mm]);
#if EPILOGUE == 2
            partial[r][lane][MT + mm] = sum8(acc_b[mm]);
#endif
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        // Lane l finishes rows l, l + KLANES, ... of this pass.
        for (int mm = lane; mm < rows; mm += KLANES) {
            float ya = 0.0f;
            for (int l = 0; l < KLANES; l++) ya += partial[r][l][mm];
#if EPILOGUE == 2
            float yb = 0.0f;
            for (int l = 0; l < KLANES; l++) yb += partial[r][l][MT + mm];
#endif
#else
        for (int mm = 0; mm < rows; mm++) {
            const float ya = sum8(acc_a[mm]);
#if EPILOGUE == 2
            const float yb = sum8(acc_b[mm]);
#endif
#endif
            if (live) {
#if EPILOGUE == 1
                const float out = ya + bias[row_a];
#elif EPILOGUE == 2
                const float out = ya / (1.0f + exp(-ya)) * yb;
#else
                const float out = ya;
#endif
                y[(size_t)(m0 + mm) * ldy + y_col0 + col] = out;
            }
        }
#if KLANES > 1
        barrier(CLK_LOCAL_MEM_FENCE);  // the next pass overwrites partial[]
#endif
    }
}
