// The int4 GEMV on rows contiguous along K (perfx's portable layout, the CPU/PoCL winner); the maths, the
// arguments and the epilogues are kernels/gemv_q4.h's.
//   work-group LANES·WGR, global LANES·WGR·⌈⌈n_out/ROWS⌉/WGR⌉ (one dimension, the lanes of a row set
//   neighbours): WGR row sets of ROWS neighbouring rows each, so one work-group streams WGR·ROWS consecutive
//   rows (on a CPU a work-group costs its dispatch: one per row doubled the time of the default model's GEMVs,
//   and a second dimension (LANES, WGR) measured as slow as one row a work-group);
//   the LANES work-items of a row set stride along K and meet in a reduction: a local-memory
//   tree (SG 0) or sub_group_reduce_add (SG 1; with SUBGROUP = LANES one subgroup holds them all: no local
//   memory, no barrier).
//   I8 1: x quantized to int8 per block of 32 once per product by gemv_q4_quantize_x (llama.cpp's Q8_1
//   activations: per block the step and the sum of the quantized values), in the order a texel holds its codes
//   (the block's even elements, then its odd ones), so one AND, or a shift and an AND, frees 16 codes that
//   meet their x in place; the 32 products of a texel are formed in int, pairs of neighbours summed (the
//   pattern x86 compilers turn into vpmaddwd), and fp32 takes over once per block.
//   I8 2: the same codes and blocks, each 4 nibbles (one AND or a shift and an AND of a texel's word) against
//   4 x codes in one cl_khr_integer_dot_product 4×8-bit dot (unsigned × signed, summed in int): a GPU's byte
//   dot product (dp4a) where its driver lists the extension, 8 a texel where I8 1 forms 32 products. Intel's
//   CPU compiler makes each one a vpmaddwd, vphaddd and shuffles per work-item (2.5 instructions a weight
//   against I8 1's 0.56), so the tuner leaves it to GPUs.

#ifndef LANES
#define LANES 16     // work-items along K per work-group
#endif
#ifndef ROWS
#define ROWS 4       // outputs per work-item: each x chunk is loaded once and applied to ROWS rows
#endif
#ifndef WGR
#define WGR 1        // work-items along the rows per work-group, each owning ROWS neighbouring rows
#endif
#ifndef READ
#define READ 0       // 0: uint4 buffer, 1: image2d row blocks, 2: image1d_buffer view of the buffer
#endif
#ifndef SG
#define SG 0         // reduce the lanes in a local-memory tree (0) or with sub_group_reduce_add (1)
#endif
#ifndef HALF
#define HALF 0       // 1: dequantize and multiply in half (cl_khr_fp16), fp32 across groups
#endif
#ifndef I8
#define I8 0         // x quantized to int8 per 32 once per product (gemv_q4_quantize_x), int products (1, 2)
#endif
#ifndef SUBGROUP
#define SUBGROUP 0   // required subgroup size (0: the driver's), for SG 1 (kernels/gpu.h)
#endif
#ifndef GROUP
#define GROUP 128    // quantization group along K (set from the weight, not tuned)
#endif
#ifndef EPILOGUE
#define EPILOGUE EPI_NONE  // plain (+bias), or SiLU / GELU (gate)·up over paired rows (kernels/epilogue.h)
#endif

#define LAYOUT 0
#define ROW_STRIDE 1
#define USES_SUBGROUPS (SG == 1)
#include "gpu.h"
#include "gemv_q4.h"
#include "int_pairs.h"

#if I8
// x (K floats) quantized per block of 32 for I8, one work-item a block: q_x = rint(x·127/max|x|) as int8, the
// block's even elements then its odd ones (xq[2b], xq[2b + 1]: the order of a texel's low and high nibbles),
// and the block's step d = max|x|/127 with the sum of its quantized values Σ d·q_x (x_step_sum[b]). An
// all-zero block has d = 0 and codes 0.
__kernel void gemv_q4_quantize_x(const int k, __global const float* restrict x, __global char16* restrict xq,
                                 __global float2* restrict x_step_sum)
{
    const int b = get_global_id(0);
    if (b >= k / 32) return;
    const float8 v0 = vload8(4 * b, x), v1 = vload8(4 * b + 1, x);
    const float8 v2 = vload8(4 * b + 2, x), v3 = vload8(4 * b + 3, x);
    const float8 m8 = fmax(fmax(fabs(v0), fabs(v1)), fmax(fabs(v2), fabs(v3)));
    const float4 m4 = fmax(m8.lo, m8.hi);
    const float amax = fmax(fmax(m4.s0, m4.s1), fmax(m4.s2, m4.s3));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const float8 r0 = rint(v0 * inv), r1 = rint(v1 * inv), r2 = rint(v2 * inv), r3 = rint(v3 * inv);
    const float8 sum8 = (r0 + r1) + (r2 + r3);
    xq[2 * b] = (char16)(convert_char4_sat(r0.even), convert_char4_sat(r1.even),
                         convert_char4_sat(r2.even), convert_char4_sat(r3.even));
    xq[2 * b + 1] = (char16)(convert_char4_sat(r0.odd), convert_char4_sat(r1.odd),
                             convert_char4_sat(r2.odd), convert_char4_sat(r3.odd));
    x_step_sum[b] = (float2)(amax / 127.0f, SUM8(sum8) * (amax / 127.0f));
}
#define I8_ARGS , __global const char16* restrict xq, __global const float2* restrict x_step_sum
#else
#define I8_ARGS
#endif

__kernel REQD_SUBGROUP __attribute__((reqd_work_group_size(LANES * WGR, 1, 1)))
void gemv_q4(GEMV_Q4_ARGS I8_ARGS)
{
    const int q4_rows = n_rows;
    const int q4_texels = k / 32;
    const int q4_groups = k / GROUP;
    const int lane = get_local_id(0) % LANES;   // which lane along K
    const int first = get_global_id(0) / LANES * ROWS;
#if LANES > 1
    __local float partial[WGR][WROWS][LANES];  // declared at kernel scope, as OpenCL C 1.2 requires
#endif
    int wrow[WROWS], grow[WROWS];
    own_rows(first, n_out, out_base, half_rows, row_a, row_b, wrow, grow);

    float acc[WROWS];
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc[r] = 0.0f;
    LANE_ACCUMULATORS
#if I8
#if I8 == 2
#define GDOT_T float     // one int sum a texel and row from the dot products
#else
#define GDOT_T float8    // 8 int lanes a texel and row
#endif
    // Per texel and row: 32 int products (|q·q_x| ≤ 15·127, a pair's sum fits int16, the sum of a texel's 32
    // int32), summed in 8 int lanes (I8 2: in one int, 8 dot products of 4), then fp32 times the block's step d
    // (one broadcast for every row); per group and row one multiply-add by s, and the offset m·Σ d·q_x in a
    // scalar.
    float offset[WROWS];
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) offset[r] = 0.0f;
    for (int g = lane; g < q4_groups; g += LANES) {
        GDOT_T gdot[WROWS];
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) gdot[r] = (GDOT_T)(0.0f);
        float xsum = 0.0f;
        #pragma unroll
        for (int i = 0; i < TEXELS_PER_GROUP; ++i) {
            const int t = g * TEXELS_PER_GROUP + i;
            const float2 xd = x_step_sum[t];
            xsum += xd.y;
#if I8 == 2
            const uint4 xe = as_uint4(xq[2 * t]), xo = as_uint4(xq[2 * t + 1]);
            #pragma unroll
            for (int r = 0; r < WROWS; ++r) {
                const uint4 tex = LOAD_ROW(r, t);
                const uint4 lo = tex & 0x0F0F0F0Fu, hi = (tex >> 4) & 0x0F0F0F0Fu;
                // not the saturating dot_acc_sat: a texel's sum cannot overflow (|Σ| ≤ 32·15·128), and the
                // plain form is a GPU's dp4a and add where the saturating one is checked on a CPU
                const int dot = ((dot_4x8packed_us_int(lo.s0, xe.s0) + dot_4x8packed_us_int(lo.s1, xe.s1))
                                 + (dot_4x8packed_us_int(lo.s2, xe.s2) + dot_4x8packed_us_int(lo.s3, xe.s3)))
                                + ((dot_4x8packed_us_int(hi.s0, xo.s0) + dot_4x8packed_us_int(hi.s1, xo.s1))
                                   + (dot_4x8packed_us_int(hi.s2, xo.s2) + dot_4x8packed_us_int(hi.s3, xo.s3)));
                gdot[r] = (float)dot * xd.x + gdot[r];
            }
#else
            const short16 xe = convert_short16(xq[2 * t]), xo = convert_short16(xq[2 * t + 1]);
            #pragma unroll
            for (int r = 0; r < WROWS; ++r) {
                const uint4 tex = LOAD_ROW(r, t);
                const int16 pe = convert_int16(as_uchar16(tex & 0x0F0F0F0Fu)) * convert_int16(xe);
                const int16 po = convert_int16(as_uchar16((tex >> 4) & 0x0F0F0F0Fu)) * convert_int16(xo);
                const int8 dot = (EVEN16(pe) + ODD16(pe)) + (EVEN16(po) + ODD16(po));
                gdot[r] = convert_float8(dot) * xd.x + gdot[r];
            }
#endif
        }
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) {
            const float2 sm = GROUP_SM(scale_offset, grow[r], g);
#if I8 == 2
            offset[r] = gdot[r] * sm.x + (sm.y * xsum + offset[r]);   // a scalar: acc8 stays 0
#else
            acc8[r] = gdot[r] * sm.x + acc8[r];
            offset[r] = sm.y * xsum + offset[r];
#endif
        }
    }
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc[r] = offset[r];
#else
    for (int g = lane; g < q4_groups; g += LANES) {
        dot8 dot[WROWS];
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) dot[r] = (dot8)(0.0f);
        float8 xsum = (float8)(0.0f);
        #pragma unroll
        for (int i = 0; i < TEXELS_PER_GROUP; ++i) {
            const int t = g * TEXELS_PER_GROUP + i;
            const float8 f0 = vload8(4 * t, x), f1 = vload8(4 * t + 1, x);
            const float8 f2 = vload8(4 * t + 2, x), f3 = vload8(4 * t + 3, x);
            xsum += (f0 + f1) + (f2 + f3);
            TEXEL_DOTS(t, f0, f1, f2, f3)
        }
        GROUP_SUMS(g, xsum)
    }
#endif
    LANE_SUMS

#if LANES > 1
#if SG == 1
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc[r] = sub_group_reduce_add(acc[r]);
#if SUBGROUP != LANES
    // Several subgroups: their first lanes meet in local memory (one barrier; WGR is 1 with SG 1).
    if (get_sub_group_local_id() == 0) {
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) partial[0][r][get_sub_group_id()] = acc[r];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lane != 0) return;
    const int subgroups = get_num_sub_groups();
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) {
        float sum = partial[0][r][0];
        for (int s = 1; s < subgroups; ++s) sum += partial[0][r][s];
        acc[r] = sum;
    }
#else
    if (lane != 0) return;
#endif
#else
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
#endif
    store_outputs(acc, grow, first, n_out, out_base, bias, has_bias, y);
}
