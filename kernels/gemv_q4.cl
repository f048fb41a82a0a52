// y (M) = W (N, K) · x (K) (+ bias), W int4 in perfx's device form (perfx/ops/q4_weight.py):
//   codes: 32 per uint4 texel, rows contiguous along K (code 32t + 8c + j in component c, bits 4j..4j+3),
//          read as a uint4 buffer (READ 0) or as image2d row blocks (READ 1);
//   scale_offset: one half2 (s, m) per group of G along K, (N, K/G); w = s·q + m.
// Per group: Σ_k (s·q_k + m)·x_k = s·Σ q_k x_k + m·Σ x_k, so the inner loop is one fma per weight and
// Σ x_k is computed once per group and shared by the ROWS rows of a work-item.
// Epilogues (EPILOGUE, chosen by the wrapper, not tuned):
//   0 plain:    y[o] = W[o]·x + bias[o]                      M = N (also fused QKV: rows concatenated)
//   1 silu_mul: y[o] = SiLU(W[o]·x + b[o]) · (W[M+o]·x + b[M+o])   M = N/2 (gate rows, then up rows)
// Shape contract: K multiple of G, G ∈ {32, 64, 128}; any M (rows past the end are clamped on load and
// not stored). One launch covers outputs [out_base, out_base + n_out); its gate rows start at row_a of
// weights `wa` and its up rows at row_b of `wb` (the wrapper splits launches at image boundaries, so
// a row block never straddles two images). Work-group: (LANES, 1); global: (LANES, ⌈n_out/ROWS⌉).
// LANES work-items stride along K by groups and meet in a local-memory tree reduction.

#ifndef LANES
#define LANES 16     // work-items along K per work-group (power of two)
#endif
#ifndef ROWS
#define ROWS 4       // outputs per work-item: each x chunk is loaded once and applied to ROWS rows
#endif
#ifndef READ
#define READ 0       // 0: uint4 buffer loads, 1: read_imageui on image2d row blocks (texture cache)
#endif
#ifndef GROUP
#define GROUP 128    // quantization group along K (set from the weight, not tuned)
#endif
#ifndef EPILOGUE
#define EPILOGUE 0   // 0: plain (+bias), 1: SiLU(gate)·up over paired rows (set by the wrapper)
#endif

#define TEXELS_PER_GROUP (GROUP / 32)

#if EPILOGUE == 1
#define ROW_SETS 2   // gate and up
#else
#define ROW_SETS 1
#endif
#define WROWS (ROWS * ROW_SETS)

#if READ == 1
typedef __read_only image2d_t weights_t;
__constant sampler_t texel_sampler = CLK_NORMALIZED_COORDS_FALSE | CLK_ADDRESS_NONE | CLK_FILTER_NEAREST;
#define LOAD_TEXEL(w, row, t) read_imageui(w, texel_sampler, (int2)((t), (row)))
#else
typedef __global const uint4* restrict weights_t;
#define LOAD_TEXEL(w, row, t) w[(size_t)(row) * texels + (t)]
#endif

// The 8 codes of one texel component, in x order: (bits >> 4j) & 0xF for j = 0..7. The float comes from
// the bits: 0x4B000000 | q is the float 2^23 + q (exact for q < 2^23), one OR and one subtraction.
// 8 wide on purpose: PoCL 3.0's LLVM 14 fails to select 16-wide integer/convert code on AVX2 x86.
#define NIBBLE_SHIFTS (uint8)(0, 4, 8, 12, 16, 20, 24, 28)
#define CODES(bits) (as_float8((((uint8)(bits) >> NIBBLE_SHIFTS) & 0xFu) | 0x4B000000u) - 8388608.0f)
#define SUM8(v) ((((v).s0 + (v).s4) + ((v).s2 + (v).s6)) + (((v).s1 + (v).s5) + ((v).s3 + (v).s7)))

inline float silu(const float v) { return v / (1.0f + exp(-v)); }

__kernel __attribute__((reqd_work_group_size(LANES, 1, 1)))
void gemv_q4(const int n_out, const int k, const int out_base, const int half_rows,
             const int row_a, const int row_b, weights_t wa, weights_t wb,
             __global const half* restrict scale_offset, __global const float* restrict bias, const int has_bias,
             __global const float* restrict x, __global float* restrict y)
{
#if LANES > 1
    __local float partial[WROWS][LANES];   // declared at kernel scope, as OpenCL C 1.2 requires
#endif
    const int lane = get_local_id(0);
    const int first = get_group_id(1) * ROWS;    // first output of this work-item, within the launch
    const int groups = k / GROUP;
    const int texels = k / 32;

    // Weight rows (within wa / wb) and global rows (for scales and bias) of each of the WROWS rows.
    // Outputs past n_out read the last valid row again (harmless) and are not stored.
    int wrow[WROWS], grow[WROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int o = min(first + r, n_out - 1);
        wrow[r] = row_a + o;
        grow[r] = out_base + o;
#if EPILOGUE == 1
        wrow[ROWS + r] = row_b + o;
        grow[ROWS + r] = half_rows + out_base + o;
#endif
    }

    float acc[WROWS];
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc[r] = 0.0f;

    for (int g = lane; g < groups; g += LANES) {
        float8 dot[WROWS];
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) dot[r] = (float8)(0.0f);
        float8 xsum = (float8)(0.0f);
        #pragma unroll
        for (int i = 0; i < TEXELS_PER_GROUP; ++i) {
            const int t = g * TEXELS_PER_GROUP + i;
            // x[32t + 8c + j], j = 0..7, pairs with component c of the texel.
            const float8 x0 = vload8(4 * t, x), x1 = vload8(4 * t + 1, x);
            const float8 x2 = vload8(4 * t + 2, x), x3 = vload8(4 * t + 3, x);
            xsum += (x0 + x1) + (x2 + x3);
            #pragma unroll
            for (int r = 0; r < WROWS; ++r) {
#if EPILOGUE == 1
                const uint4 tex = r < ROWS ? LOAD_TEXEL(wa, wrow[r], t) : LOAD_TEXEL(wb, wrow[r], t);
#else
                const uint4 tex = LOAD_TEXEL(wa, wrow[r], t);
#endif
                dot[r] += (CODES(tex.x) * x0 + CODES(tex.y) * x1) + (CODES(tex.z) * x2 + CODES(tex.w) * x3);
            }
        }
        const float xs = SUM8(xsum);
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) {
            const float2 sm = vload_half2(grow[r] * groups + g, scale_offset);
            acc[r] += sm.x * SUM8(dot[r]) + sm.y * xs;
        }
    }

#if LANES > 1
    // Tree reduction of the lanes' partial sums, one slot per (row, lane).
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) partial[r][lane] = acc[r];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = LANES / 2; stride > 0; stride >>= 1) {
        if (lane < stride) {
            #pragma unroll
            for (int r = 0; r < WROWS; ++r) partial[r][lane] += partial[r][lane + stride];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lane != 0) return;
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc[r] = partial[r][0];
#endif

    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (first + r >= n_out) break;
        float v = acc[r] + (has_bias ? bias[grow[r]] : 0.0f);
#if EPILOGUE == 1
        const float up = acc[ROWS + r] + (has_bias ? bias[grow[ROWS + r]] : 0.0f);
        v = silu(v) * up;
#endif
        y[out_base + first + r] = v;
    }
}
