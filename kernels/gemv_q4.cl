// y (M) = W (N, K) · x (K) (+ bias), W int4 in perfx's device form (kernels/q4.h, perfx/ops/q4_weight.py):
//   codes: 32 per uint4 texel, LAYOUT 0 (rows contiguous along K) or 1 (rows interleaved per texel),
//          read from a buffer (READ 0), image2d row blocks (READ 1, LAYOUT 0) or an image1d_buffer view (READ 2);
//   scale_offset: one half2 (s, m) per group of G along K; w = s·q + m.
// Per group: Σ_k (s·q_k + m)·x_k = s·Σ q_k x_k + m·Σ x_k, so the inner loop is one multiply-add per weight and
// Σ x_k is computed once per group and shared by the ROWS rows of a work-item. With HALF the codes are
// centred, Σ (s·(q_k − 8) + m + 8s)·x_k, and Σ (q_k − 8)·x_k is formed in half (cl_khr_fp16), one half8
// multiply-add per 8 weights; each group's half sum joins an fp32 accumulator, so fp16 rounding never
// builds up across groups.
// Epilogues (EPILOGUE, kernels/epilogue.h, chosen by the wrapper, not tuned):
//   EPI_NONE:     y[o] = W[o]·x + bias[o]                            M = N (fused QKV too: rows concatenated)
//   EPI_SILU_MUL: y[o] = SiLU(W[o]·x + b[o]) · (W[M+o]·x + b[M+o])   M = N/2 (gate rows, then up rows)
//   EPI_GELU_MUL: y[o] = GELU(W[o]·x + b[o]) · (W[M+o]·x + b[M+o])   as SiLU·mul (GELU's tanh form)
// Shape contract: K multiple of G, G ∈ {32, 64, 128}; any M (rows past the end are clamped on load and not
// stored). One launch covers outputs [out_base, out_base + n_out); its gate rows start at row_a of weights
// `wa` and its up rows at row_b of `wb` (image2d row blocks: the wrapper splits launches at image boundaries,
// so a row block never straddles two images); n_rows is the weight's N (the interleaved layout's stride).
//
// Two kernel shapes, one per layout:
//   LAYOUT 0  work-group (LANES, 1), global (LANES, ⌈n_out/ROWS⌉): LANES work-items stride along K by groups
//             for ROWS rows and meet in a reduction: a local-memory tree (SG 0) or sub_group_reduce_add
//             (SG 1; with SUBGROUP = LANES one subgroup holds them all: no local memory, no barrier).
//   LAYOUT 1  work-group (64, LANES), global (64·⌈n_out/(64·ROWS)⌉, LANES): the 64 work-items of a row
//             own neighbouring rows (rows first + 64·r, r < ROWS), so each texel load is coalesced; LANES
//             slices of K meet in local memory. Every work-item needs the same x: read from global memory
//             (XS 0, a uniform load), staged once per work-group in local memory (XS 1), or loaded by lanes
//             0..7 of a subgroup and shared with sub_group_broadcast (XS 2, llama.cpp's Adreno GEMV).
//             With XS 1, x may be staged quantized (I8): int8 per block of 32 with its scale (llama.cpp's
//             Q8_0 activations), and each texel's 32 products formed in int16, summed in int32, then fp32:
//             no float conversion of the codes at all.

#ifndef LAYOUT
#define LAYOUT 0     // 0: rows contiguous along K; 1: rows interleaved per texel (coalesced across work-items)
#endif
#ifndef LANES
#define LANES 16     // LAYOUT 0: work-items along K per work-group; LAYOUT 1: slices of K per work-group
#endif
#ifndef ROWS
#define ROWS 4       // outputs per work-item: each x chunk is loaded once and applied to ROWS rows
#endif
#ifndef READ
#define READ 0       // 0: uint4 buffer, 1: image2d row blocks, 2: image1d_buffer view of the buffer
#endif
#ifndef XS
#define XS 0         // LAYOUT 1: x from global (0), local memory (1) or sub_group_broadcast (2)
#endif
#ifndef SG
#define SG 0         // LAYOUT 0: reduce the lanes in a local-memory tree (0) or with sub_group_reduce_add (1)
#endif
#ifndef HALF
#define HALF 0       // 1: dequantize and multiply in half (cl_khr_fp16), fp32 across groups
#endif
#ifndef I8
#define I8 0         // LAYOUT 1, XS 1: x quantized to int8 per 32 in local memory, int16 products (1)
#endif
#ifndef SUBGROUP
#define SUBGROUP 0   // required subgroup size (0: the driver's), for SG 1 and XS 2 (kernels/gpu.h)
#endif
#ifndef GROUP
#define GROUP 128    // quantization group along K (set from the weight, not tuned)
#endif
#ifndef EPILOGUE
#define EPILOGUE EPI_NONE  // plain (+bias), or SiLU / GELU (gate)·up over paired rows (kernels/epilogue.h)
#endif

#define USES_SUBGROUPS (SG == 1 || XS == 2)
#include "epilogue.h"
#include "gpu.h"
#include "q4.h"

#if HALF
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
typedef half8 dot8;                       // the per-group dot product's type
#define DOT_X(v) convert_half8(v)         // x as the dot product reads it
#define DOT_CODES(bits) CODES_H(bits)
#define DOT_FLOAT(v) convert_float8(v)
#define OFFSET(sm) ((sm).y + 8.0f * (sm).x) // the centred codes move 8·s into the offset
#else
typedef float8 dot8;
#define DOT_X(v) (v)
#define DOT_CODES(bits) CODES_F(bits)
#define DOT_FLOAT(v) (v)
#define OFFSET(sm) ((sm).y)
#endif

#define TEXELS_PER_GROUP (GROUP / 32)
#if EPI_GATED
#define ROW_SETS 2   // gate and up
#else
#define ROW_SETS 1
#endif
#define WROWS (ROWS * ROW_SETS)

#if LAYOUT == 1
#define WGN 64       // work-items along N of a LAYOUT 1 work-group (a half wave on Adreno)
#define ROW_STRIDE WGN
#else
#define ROW_STRIDE 1
#endif

#if EPI_GATED
#define LOAD_ROW(r, t) ((r) < ROWS ? TEXEL(wa, wrow[r], t) : TEXEL(wb, wrow[r], t))
#else
#define LOAD_ROW(r, t) TEXEL(wa, wrow[r], t)
#endif

#if LAYOUT == 1 && XS == 2
// x[32t + 4·l .. 4·l + 3] from lane l of the subgroup (lanes 0..7 hold a texel's 32 values).
inline float4 broadcast4(const float4 v, const uint lane)
{
    return (float4)(sub_group_broadcast(v.s0, lane), sub_group_broadcast(v.s1, lane),
                    sub_group_broadcast(v.s2, lane), sub_group_broadcast(v.s3, lane));
}
#endif

#if LAYOUT == 1 && XS == 1 && I8
typedef uint4 xstage_t;   // per texel: x of its even codes, x of its odd codes (int8 × 16 each)
#elif LAYOUT == 1 && XS == 1 && HALF
typedef half xstage_t;
#else
typedef float xstage_t;
#endif

__kernel REQD_SUBGROUP
#if LAYOUT == 1
__attribute__((reqd_work_group_size(WGN, LANES, 1)))
#else
__attribute__((reqd_work_group_size(LANES, 1, 1)))
#endif
void gemv_q4(const int n_out, const int k, const int out_base, const int half_rows,
             const int row_a, const int row_b, const int n_rows, CODES_T wa, CODES_T wb,
             __global const half* restrict scale_offset, __global const float* restrict bias, const int has_bias,
             __global const float* restrict x, __global float* restrict y, __local xstage_t* restrict x_local)
{
    const int q4_rows = n_rows;
    const int q4_texels = k / 32;
    const int q4_groups = k / GROUP;
#if LAYOUT == 1
    const int lane = get_local_id(1);   // which slice of K
    const int first = get_group_id(0) * (WGN * ROWS) + get_local_id(0);
#if LANES > 1
    __local float partial[LANES - 1][WROWS][WGN];
#endif
#else
    const int lane = get_local_id(0);   // which lane along K
    const int first = get_group_id(1) * ROWS;
#if LANES > 1
    __local float partial[WROWS][LANES];  // declared at kernel scope, as OpenCL C 1.2 requires
#endif
#endif

    // Weight rows (within wa / wb) and global rows (for scales and bias) of each of the WROWS rows.
    // Outputs past n_out read the last valid row again (harmless) and are not stored.
    int wrow[WROWS], grow[WROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int o = min(first + r * ROW_STRIDE, n_out - 1);
        wrow[r] = row_a + o;
        grow[r] = out_base + o;
#if EPI_GATED
        wrow[ROWS + r] = row_b + o;
        grow[ROWS + r] = half_rows + out_base + o;
#endif
    }

#if LAYOUT == 1 && XS == 1 && I8
    // x once per work-group, quantized per block of 32 (one texel's worth, llama.cpp's Q8_1): q_x =
    // round(x·127/max|x|), stored as the texel's codes pair with it (byte j of word c holds codes 8c + 2j and
    // 8c + 2j + 1 in its low and high nibble: even and odd codes), with the block's scale and the sum of the
    // quantized x (Q8_1's s). The offset term m·Σx then errs with the same x_q as the products: the error is
    // Σ (s·q + m)(x_q − x), of a centred weight (m ≈ −8s), where the exact Σx would leave s·q·(x_q − x) of
    // an uncentred one, about twice as large.
    __local float* x_scale = (__local float*)(x_local + 2 * q4_texels);
    __local float* x_sum = x_scale + q4_texels;
    for (int b = get_local_id(1) * WGN + get_local_id(0); b < q4_texels; b += WGN * LANES) {
        const float8 v0 = vload8(4 * b, x), v1 = vload8(4 * b + 1, x);
        const float8 v2 = vload8(4 * b + 2, x), v3 = vload8(4 * b + 3, x);
        const float8 m8 = fmax(fmax(fabs(v0), fabs(v1)), fmax(fabs(v2), fabs(v3)));
        const float4 m4 = fmax(m8.lo, m8.hi);
        const float amax = fmax(fmax(m4.s0, m4.s1), fmax(m4.s2, m4.s3));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const float8 r0 = rint(v0 * inv), r1 = rint(v1 * inv), r2 = rint(v2 * inv), r3 = rint(v3 * inv);
        const float8 sum8 = (r0 + r1) + (r2 + r3);
        x_scale[b] = amax / 127.0f;
        x_sum[b] = SUM8(sum8) * (amax / 127.0f);
        x_local[2 * b] = (uint4)(as_uint(convert_char4_sat(r0.even)), as_uint(convert_char4_sat(r1.even)),
                                 as_uint(convert_char4_sat(r2.even)), as_uint(convert_char4_sat(r3.even)));
        x_local[2 * b + 1] = (uint4)(as_uint(convert_char4_sat(r0.odd)), as_uint(convert_char4_sat(r1.odd)),
                                     as_uint(convert_char4_sat(r2.odd)), as_uint(convert_char4_sat(r3.odd)));
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#elif LAYOUT == 1 && XS == 1
    // x once per work-group (as half with HALF: half the local memory).
    for (int e = get_local_id(1) * WGN + get_local_id(0); e < k; e += WGN * LANES) {
        x_local[e] = (xstage_t)x[e];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#endif
#if LAYOUT == 1 && XS == 2
    const uint sg_lane = get_sub_group_local_id();
#endif

    float acc[WROWS];
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc[r] = 0.0f;

#if LAYOUT == 1 && XS == 1 && I8
    // Per texel: 32 products q·q_x in int16 (|q·q_x| ≤ 15·127: four summed ≤ 7620 still fit), then int32, then
    // fp32 accumulators, times the block's and the group's scales (per 32 codes, so the horizontal sum
    // waits for the end); per group m·Σ x with the exact Σ x.
    float4 acc4[WROWS];
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc4[r] = (float4)(0.0f);
    for (int g = lane; g < q4_groups; g += LANES) {
        float scale[WROWS];
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) {
            const float2 sm = vload_half2(SO_INDEX(grow[r], g), scale_offset);
            scale[r] = sm.x;
            float xs = 0.0f;
            for (int i = 0; i < TEXELS_PER_GROUP; ++i) xs += x_sum[g * TEXELS_PER_GROUP + i];
            acc[r] += sm.y * xs;
        }
        #pragma unroll
        for (int i = 0; i < TEXELS_PER_GROUP; ++i) {
            const int t = g * TEXELS_PER_GROUP + i;
            const short16 xe = convert_short16(as_char16(x_local[2 * t]));
            const short16 xo = convert_short16(as_char16(x_local[2 * t + 1]));
            const float xd = x_scale[t];
            #pragma unroll
            for (int r = 0; r < WROWS; ++r) {
                const uint4 tex = LOAD_ROW(r, t);
                const short16 p = convert_short16(as_uchar16(tex & 0x0F0F0F0Fu)) * xe
                                + convert_short16(as_uchar16((tex >> 4) & 0x0F0F0F0Fu)) * xo;
                const int8 s8 = convert_int8(p.lo + p.hi);   // |sum of four products| ≤ 7620: short holds it
                acc4[r] = mad(convert_float4(s8.lo + s8.hi), (float4)(xd * scale[r]), acc4[r]);
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc[r] += (acc4[r].s0 + acc4[r].s1) + (acc4[r].s2 + acc4[r].s3);
#else
    for (int g = lane; g < q4_groups; g += LANES) {
        dot8 dot[WROWS];
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) dot[r] = (dot8)(0.0f);
        float8 xsum = (float8)(0.0f);
        #pragma unroll
        for (int i = 0; i < TEXELS_PER_GROUP; ++i) {
            const int t = g * TEXELS_PER_GROUP + i;
            // x[32t + 8c + j], j = 0..7, pairs with component c of the texel.
#if LAYOUT == 1 && XS == 1
            const float8 f0 = convert_float8(vload8(4 * t, x_local));
            const float8 f1 = convert_float8(vload8(4 * t + 1, x_local));
            const float8 f2 = convert_float8(vload8(4 * t + 2, x_local));
            const float8 f3 = convert_float8(vload8(4 * t + 3, x_local));
#elif LAYOUT == 1 && XS == 2
            float4 mine = (float4)(0.0f);
            if (sg_lane < 8) {
                mine = vload4(8 * t + sg_lane, x);
            }
            const float8 f0 = (float8)(broadcast4(mine, 0), broadcast4(mine, 1));
            const float8 f1 = (float8)(broadcast4(mine, 2), broadcast4(mine, 3));
            const float8 f2 = (float8)(broadcast4(mine, 4), broadcast4(mine, 5));
            const float8 f3 = (float8)(broadcast4(mine, 6), broadcast4(mine, 7));
#else
            const float8 f0 = vload8(4 * t, x), f1 = vload8(4 * t + 1, x);
            const float8 f2 = vload8(4 * t + 2, x), f3 = vload8(4 * t + 3, x);
#endif
            xsum += (f0 + f1) + (f2 + f3);
            const dot8 x0 = DOT_X(f0), x1 = DOT_X(f1), x2 = DOT_X(f2), x3 = DOT_X(f3);
            #pragma unroll
            for (int r = 0; r < WROWS; ++r) {
                const uint4 tex = LOAD_ROW(r, t);
                dot[r] += (DOT_CODES(tex.x) * x0 + DOT_CODES(tex.y) * x1)
                        + (DOT_CODES(tex.z) * x2 + DOT_CODES(tex.w) * x3);
            }
        }
        const float xs = SUM8(xsum);
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) {
            const float2 sm = vload_half2(SO_INDEX(grow[r], g), scale_offset);
            const float8 d = DOT_FLOAT(dot[r]);
            acc[r] += sm.x * SUM8(d) + OFFSET(sm) * xs;
        }
    }
#endif

#if LAYOUT == 1
#if LANES > 1
    // Slices 1.. hand their partial sums to slice 0 through local memory.
    const int row_lane = get_local_id(0);
    if (lane > 0) {
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) partial[lane - 1][r][row_lane] = acc[r];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lane != 0) return;
    for (int s = 0; s < LANES - 1; ++s) {
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) acc[r] += partial[s][r][row_lane];
    }
#endif
#elif LANES > 1
#if SG == 1
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc[r] = sub_group_reduce_add(acc[r]);
#if SUBGROUP != LANES
    // Several subgroups: their first lanes meet in local memory (one barrier).
    if (get_sub_group_local_id() == 0) {
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) partial[r][get_sub_group_id()] = acc[r];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lane != 0) return;
    const int subgroups = get_num_sub_groups();
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) {
        float sum = partial[r][0];
        for (int s = 1; s < subgroups; ++s) sum += partial[r][s];
        acc[r] = sum;
    }
#else
    if (lane != 0) return;
#endif
#else
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
#endif

    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int o = first + r * ROW_STRIDE;
        if (o >= n_out) break;
        float v = acc[r] + (has_bias ? bias[grow[r]] : 0.0f);
#if EPI_GATED
        const float up = acc[ROWS + r] + (has_bias ? bias[grow[ROWS + r]] : 0.0f);
        v = GATE_ACT(v) * up;
#endif
        y[out_base + o] = v;
    }
}
