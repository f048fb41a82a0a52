// y (M) = W (N, K) · x (K) (+ bias), W int8 in perfx's int8 device form (perfx/ops/q8_weight.py):
//   codes: int8, rows contiguous along K, the matrix held as row blocks (one buffer each, within the
//          device's largest allocation);
//   scales: per group of G along K, (rows, K/G) per block, an (s, m) pair (w = s·q + m: Q5_1, Q5_K,
//          quantized heads) or, for the symmetric types (SYM 1: Q8_0, Q5_0, Q6_K), s alone (w = s·q), as
//          half (SM_F32 0, exact where fp16 holds every value) or float (SM_F32 1: Q5_K's and Q6_K's d·sc
//          need up to 18 significant bits): kernels/q8.h.
// Per group: Σ_k (s·q_k + m)·x_k = s·Σ q_k x_k + m·Σ x_k, so the inner loop is one multiply-add per
// weight and Σ x_k is computed once per group (8 lanes wide) and shared by the ROWS rows of a work-item
// (and not at all under SYM).
// Epilogues (EPILOGUE, kernels/epilogue.h, chosen by the wrapper, not tuned):
//   EPI_NONE:     y[o] = W[o]·x + bias[o]                            (also fused QKV: rows concatenated)
//   EPI_SILU_MUL: y[o] = SiLU(Wg[o]·x + bg[o]) · (Wu[o]·x + bu[o])   (gate rows, then up rows)
//   EPI_GELU_MUL: y[o] = GELU(Wg[o]·x + bg[o]) · (Wu[o]·x + bu[o])   (as SiLU·mul, GELU's tanh form)
// Shape contract: K a multiple of G, G ∈ {16, 32}; any number of outputs (rows past the end are clamped
// on load and not stored). One launch covers outputs o ∈ [0, n_out), stored at y[y_base + o]; the gate
// (or only) row of output o is row row_a + o of block a (codes_a, sm_a, bias_a), its up row is row
// row_b + o of block b: the wrapper cuts launches where either crosses from one block to the next.
// Work-group: LANES·WGR, global: LANES·WGR·⌈⌈n_out/ROWS⌉/WGR⌉ (one dimension, the lanes of a row set
// neighbours): WGR row sets of ROWS neighbouring rows (one work-group streams WGR·ROWS consecutive rows; on a
// CPU fewer work-groups than rows, each costing its dispatch: kernels/gemv_q4_rows.cl). The LANES work-items of
// a set stride along K by groups and meet in a local-memory tree reduction. Accumulation in fp32.
// I8 1 (int8 activations): gemv_q8_quantize_x, launched once per product before it (global: K/G), rounds x
// per group of G to int8, q_x = rint(x·127/max|x|), with the group's step d = max|x|/127 and the sum of its
// quantized values Σ d·q_x (llama.cpp's Q8_1 activations, perfx.reference.quantize_activations_q8), and
// every work-group reads that one copy. Per group: Σ (s·q + m)·d·q_x = s·d·Σ q·q_x + m·Σ d·q_x, the products
// exact in int (|q·q_x| ≤ 128·127, two of them still within int16: the pair-summed form x86's vpmaddwd
// computes), summed in int32 over the group, then fp32. The kernel's product is then exactly W·x̂ for the
// quantized x̂, the offset term included.
// I8 2: the same, each 4 codes against 4 x codes in one cl_khr_integer_dot_product 4×8-bit dot
// (dot_4x8packed_ss_int, a GPU's dp4a, where the driver lists the extension): G/4 a group and row. Intel's CPU
// compiler makes each a vpmaddwd, vphaddd and shuffles per work-item, so the tuner leaves it to GPUs.

#ifndef LANES
#define LANES 16     // work-items along K per work-group (power of two)
#endif
#ifndef ROWS
#define ROWS 4       // outputs per work-item: each x chunk is loaded once and applied to ROWS rows
#endif
#ifndef WGR
#define WGR 1        // work-items along the rows per work-group, each owning ROWS neighbouring rows
#endif
#ifndef I8
#define I8 0         // x quantized to int8 per group once per product (gemv_q8_quantize_x), int products:
                     // int16 pairs (1), byte dot products (2)
#endif
#ifndef EPILOGUE
#define EPILOGUE EPI_NONE  // plain (+bias), or SiLU / GELU (gate)·up over paired rows (kernels/epilogue.h)
#endif

#include "epilogue.h"

#if EPI_GATED
#define WROWS (2 * ROWS)   // gate rows 0..ROWS−1, up rows ROWS..2·ROWS−1
#else
#define WROWS ROWS
#endif

#include "int_pairs.h"
#include "q8.h"

// x through a float8 pointer too: rows of K floats, K a multiple of 16, so every chunk is float8-aligned.
#define LOAD_X8(p, c) (((const __global float8*)(p))[c])
// 16 codes (weights or quantized x) at a time: rows of K bytes, K a multiple of 16.
#define CHARS16(p, c) (((const __global char16*)(p))[c])

// x per group of GROUP as int8 codes q_x (K bytes) and (d, Σ d·q_x) per group (K/G float2), one work-item a
// group; an all-zero group has d = 0 and codes 0.
__kernel void gemv_q8_quantize_x(const int k, __global const float* restrict x, __global char* restrict xq,
                                 __global float2* restrict x_step_sum)
{
    const int g = get_global_id(0);
    if (g >= k / GROUP) return;
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

__kernel __attribute__((reqd_work_group_size(LANES * WGR, 1, 1)))
void gemv_q8(const int n_out, const int k, const int y_base, const int row_a, const int row_b,
             __global const char* restrict codes_a, __global const char* restrict codes_b,
             SM_T sm_a, SM_T sm_b, __global const float* restrict bias_a,
             __global const float* restrict bias_b, const int has_bias,
             __global const float* restrict x, __global float* restrict y
#if I8
             , __global const char* restrict xq, __global const float2* restrict x_step_sum
#endif
             )
{
#if LANES > 1
    __local float partial[WGR][WROWS][LANES];   // declared at kernel scope, as OpenCL C 1.2 requires
#endif
    const int lane = get_local_id(0) % LANES;
    const int first = get_global_id(0) / LANES * ROWS;    // first output of this work-item, within the launch
    const int groups = k / GROUP;

    // Each row's codes and its first group's scale (and offset). Outputs past n_out read the last valid row
    // again (harmless) and are not stored.
    __global const char* wrow[WROWS];
    SM_T prow[WROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int o = min(first + r, n_out - 1);
        wrow[r] = codes_a + (size_t)(row_a + o) * k;
        prow[r] = sm_a + (size_t)(row_a + o) * groups * SM_PER_GROUP;
#if EPI_GATED
        wrow[ROWS + r] = codes_b + (size_t)(row_b + o) * k;
        prow[ROWS + r] = sm_b + (size_t)(row_b + o) * groups * SM_PER_GROUP;
#endif
    }

    // Each group's sums join 8-lane accumulators, s·(q·x per lane) + m·(x per lane), and the lanes are summed
    // once after the last group: a sum of 8 lanes per group and row costs as much as the group's 32 products.
    float8 acc8[WROWS];
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc8[r] = (float8)(0.0f);

#if I8
    // Per group and row: the integer dot product in 8 int lanes (products of adjacent pairs summed: what x86
    // compilers turn into vpmaddwd; splitting even and odd codes before the multiply gave vpmullw and shuffles,
    // 1.15 instructions a weight against 0.47), then one multiply-add 8 wide by s·d; the offset m·Σ d·q_x per
    // row in a scalar (none under SYM).
    float offset[WROWS];
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) offset[r] = 0.0f;
    for (int g = lane; g < groups; g += LANES) {
        const float2 xd = x_step_sum[g];
#if I8 == 2
        uint xw[GROUP / 4];
        #pragma unroll
        for (int i = 0; i < GROUP / 4; ++i) xw[i] = ((const __global uint*)xq)[g * (GROUP / 4) + i];
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) {
            // rows start at multiples of K bytes, K a multiple of 16: every word of codes is aligned
            const __global uint* w = (const __global uint*)wrow[r] + g * (GROUP / 4);
            int dot = 0;   // |Σ| ≤ 32·128·128: no overflow, so the plain dot (the saturating one is checked)
            #pragma unroll
            for (int i = 0; i < GROUP / 4; ++i) dot += dot_4x8packed_ss_int(w[i], xw[i]);
            const float2 sm = LOAD_SM(prow[r], g);
#if SYM
            offset[r] = (float)dot * (sm.x * xd.x) + offset[r];   // a scalar: acc8 stays 0
#else
            offset[r] = (float)dot * (sm.x * xd.x) + (sm.y * xd.y + offset[r]);
#endif
        }
#else
        short16 xv[GROUP / 16];
        #pragma unroll
        for (int i = 0; i < GROUP / 16; ++i) xv[i] = convert_short16(CHARS16(xq, g * (GROUP / 16) + i));
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) {
            int8 dot = (int8)(0);
            #pragma unroll
            for (int i = 0; i < GROUP / 16; ++i) {
                const int16 p = convert_int16(CHARS16(wrow[r], g * (GROUP / 16) + i)) * convert_int16(xv[i]);
                dot += EVEN16(p) + ODD16(p);   // vpmaddwd's pattern: adjacent products of sign-extended int16
            }
            const float2 sm = LOAD_SM(prow[r], g);
            acc8[r] = convert_float8(dot) * (sm.x * xd.x) + acc8[r];
#if !SYM
            offset[r] = sm.y * xd.y + offset[r];
#endif
        }
#endif
    }
    float acc[WROWS];
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc[r] = SUM8(acc8[r]) + offset[r];
#else
    for (int g = lane; g < groups; g += LANES) {
        float8 dot[WROWS];
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) dot[r] = (float8)(0.0f);
        float8 xsum = (float8)(0.0f);
        #pragma unroll
        for (int i = 0; i < CHUNKS_PER_GROUP; ++i) {
            const int c = g * CHUNKS_PER_GROUP + i;   // x[8c .. 8c + 7] pairs with codes 8c .. 8c + 7
            const float8 xv = LOAD_X8(x, c);
#if !SYM
            xsum += xv;
#endif
            #pragma unroll
            for (int r = 0; r < WROWS; ++r) dot[r] += CODES8(wrow[r], c) * xv;
        }
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) {
            const float2 sm = LOAD_SM(prow[r], g);
#if SYM
            acc8[r] = dot[r] * sm.x + acc8[r];
#else
            acc8[r] = dot[r] * sm.x + (xsum * sm.y + acc8[r]);   // two contracted multiply-adds
#endif
        }
    }
    float acc[WROWS];
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc[r] = SUM8(acc8[r]);
#endif

#if LANES > 1
    // Tree reduction of the lanes' partial sums, one slot per (row set, row, lane).
    const int set = get_local_id(0) / LANES;
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) partial[set][r][lane] = acc[r];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = LANES / 2; stride > 0; stride >>= 1) {
        if (lane < stride) {
            #pragma unroll
            for (int r = 0; r < WROWS; ++r) partial[set][r][lane] += partial[set][r][lane + stride];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lane != 0) return;
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc[r] = partial[set][r][0];
#endif

    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (first + r >= n_out) break;
        float v = acc[r] + (has_bias ? bias_a[row_a + first + r] : 0.0f);
#if EPI_GATED
        const float up = acc[ROWS + r] + (has_bias ? bias_b[row_b + first + r] : 0.0f);
        v = GATE_ACT(v) * up;
#endif
        y[y_base + first + r] = v;
    }
}
