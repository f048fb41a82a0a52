// The int4 GEMV on rows interleaved per texel (texel t of row r at t·N + r, kernels/q4.h), the GPU-class
// shape of llama.cpp's Adreno GEMV; the maths, the arguments and the epilogues are kernels/gemv_q4.h's.
//   work-group (64, SLICES), global (64·⌈n_out/(64·ROWS)⌉, SLICES): the 64 work-items of a row own
//   neighbouring rows (rows first + 64·r, r < ROWS), so each texel load is coalesced; SLICES slices of K meet
//   in local memory. Every work-item needs the same x: read from global memory (XS 0, a uniform load), staged
//   once per work-group in local memory (XS 1), or loaded by lanes 0..7 of a subgroup and shared with
//   sub_group_broadcast (XS 2, llama.cpp's Adreno GEMV), or staged in local memory in the codes' byte order
//   (XS 3: per texel the x of its even codes, then of its odd ones, so one AND, or a shift and an AND, frees 16
//   codes in the order x is held, each turned to float by one widening and one convert: no shift per code). With
//   XS 1, x may be staged quantized (I8): int8 per
//   block of 32 with its scale and the sum of the block's quantized values (llama.cpp's Q8_1 activations),
//   and each texel's 32 products formed in int16, summed in int32, then fp32: no float conversion of the
//   codes at all.

#ifndef SLICES
#define SLICES 1     // slices of K per work-group, each 64 work-items wide
#endif
#ifndef ROWS
#define ROWS 4       // outputs per work-item, 64 rows apart: each x chunk is applied to ROWS rows
#endif
#ifndef READ
#define READ 0       // 0: uint4 buffer, 2: image1d_buffer view of the buffer
#endif
#ifndef XS
#define XS 0         // x from global memory (0), local memory (1), sub_group_broadcast (2), local in byte order (3)
#endif
#ifndef HALF
#define HALF 0       // 1: dequantize and multiply in half (cl_khr_fp16), fp32 across groups
#endif
#ifndef I8
#define I8 0         // XS 1: x quantized to int8 per 32 in local memory, int16 products (1)
#endif
#ifndef SUBGROUP
#define SUBGROUP 0   // required subgroup size (0: the driver's), for XS 2 (kernels/gpu.h)
#endif
#ifndef GROUP
#define GROUP 128    // quantization group along K (set from the weight, not tuned)
#endif
#ifndef EPILOGUE
#define EPILOGUE EPI_NONE  // plain (+bias), or SiLU / GELU (gate)·up over paired rows (kernels/epilogue.h)
#endif

#define LAYOUT 1
#define WGN 64       // work-items along N of a work-group (a half wave on Adreno)
#define ROW_STRIDE WGN
#define USES_SUBGROUPS (XS == 2)
#include "gpu.h"
#include "gemv_q4.h"

#if XS == 2
// x[32t + 4·l .. 4·l + 3] from lane l of the subgroup (lanes 0..7 hold a texel's 32 values).
inline float4 broadcast4(const float4 v, const uint lane)
{
    return (float4)(sub_group_broadcast(v.s0, lane), sub_group_broadcast(v.s1, lane),
                    sub_group_broadcast(v.s2, lane), sub_group_broadcast(v.s3, lane));
}
#endif

#if XS == 1 && I8
typedef uint4 xstage_t;   // per texel: x of its even codes, x of its odd codes (int8 × 16 each)
#elif XS == 1 && HALF
typedef half xstage_t;
#else
typedef float xstage_t;
#endif

__kernel REQD_SUBGROUP __attribute__((reqd_work_group_size(WGN, SLICES, 1)))
void gemv_q4(GEMV_Q4_ARGS, __local xstage_t* restrict x_local)
{
    const int q4_rows = n_rows;
    const int q4_texels = k / 32;
    const int q4_groups = k / GROUP;
    const int slice = get_local_id(1);   // which slice of K
    const int first = get_group_id(0) * (WGN * ROWS) + get_local_id(0);
#if SLICES > 1
    __local float partial[SLICES - 1][WROWS][WGN];
#endif
    int wrow[WROWS], grow[WROWS];
    own_rows(first, n_out, out_base, half_rows, row_a, row_b, wrow, grow);

#if XS == 1 && I8
    // x once per work-group, quantized per block of 32 (one texel's worth, llama.cpp's Q8_1): q_x =
    // round(x·127/max|x|), stored as the texel's codes pair with it (byte j of word c holds codes 8c + 2j and
    // 8c + 2j + 1 in its low and high nibble: even and odd codes), with the block's scale and the sum of the
    // quantized x (Q8_1's s). The offset term m·Σx_q then errs with the same x_q as the products: the error
    // is Σ (s·q + m)(x_q − x), of a centred weight (m ≈ −8s), where the exact Σx would leave s·q·(x_q − x)
    // of an uncentred one, about twice as large.
    __local float* x_scale = (__local float*)(x_local + 2 * q4_texels);
    __local float* x_sum = x_scale + q4_texels;
    for (int b = slice * WGN + get_local_id(0); b < q4_texels; b += WGN * SLICES) {
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
#elif XS == 3
    // x once per work-group in the codes' byte order: texel t's even codes 32t + 2i pair with x_local[32t + i],
    // its odd codes 32t + 2i + 1 with x_local[32t + 16 + i] (i < 16).
    for (int e = slice * WGN + get_local_id(0); e < k; e += WGN * SLICES) {
        const int i = e & 31;
        x_local[e] = x[(e & ~31) + (i < 16 ? 2 * i : 2 * (i - 16) + 1)];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#elif XS == 1
    // x once per work-group (as half with HALF: half the local memory).
    for (int e = slice * WGN + get_local_id(0); e < k; e += WGN * SLICES) {
        x_local[e] = (xstage_t)x[e];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#endif
#if XS == 2
    const uint sg_lane = get_sub_group_local_id();
#endif

    float acc[WROWS];
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc[r] = 0.0f;

#if XS == 1 && I8
    // Per texel: 32 products q·q_x in int16 (|q·q_x| ≤ 15·127: four summed ≤ 7620 still fit), then int32, then
    // 8-lane fp32 accumulators, times the block's and the group's scales (per 32 codes, so the horizontal sum
    // waits for the end); per group m·Σ x_q.
    LANE_ACCUMULATORS
    for (int g = slice; g < q4_groups; g += SLICES) {
        float xs = 0.0f;
        for (int i = 0; i < TEXELS_PER_GROUP; ++i) xs += x_sum[g * TEXELS_PER_GROUP + i];
        float scale[WROWS];
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) {
            const float2 sm = GROUP_SM(scale_offset, grow[r], g);
            scale[r] = sm.x;
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
                acc8[r] += convert_float8(s8) * (xd * scale[r]);
            }
        }
    }
    LANE_SUMS
#else
    LANE_ACCUMULATORS
    for (int g = slice; g < q4_groups; g += SLICES) {
        dot8 dot[WROWS];
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) dot[r] = (dot8)(0.0f);
        float8 xsum = (float8)(0.0f);
        #pragma unroll
        for (int i = 0; i < TEXELS_PER_GROUP; ++i) {
            const int t = g * TEXELS_PER_GROUP + i;
#if XS == 3
            const float8 e0 = vload8(4 * t, x_local), e1 = vload8(4 * t + 1, x_local);
            const float8 o0 = vload8(4 * t + 2, x_local), o1 = vload8(4 * t + 3, x_local);
            xsum += (e0 + e1) + (o0 + o1);
            #pragma unroll
            for (int r = 0; r < WROWS; ++r) {
                const uint4 tex = LOAD_ROW(r, t);
                const uchar16 lo = as_uchar16(tex & 0x0F0F0F0Fu), hi = as_uchar16((tex >> 4) & 0x0F0F0F0Fu);
                dot[r] += convert_float8(lo.lo) * e0;   // four multiply-adds in a row: no separate products
                dot[r] += convert_float8(lo.hi) * e1;
                dot[r] += convert_float8(hi.lo) * o0;
                dot[r] += convert_float8(hi.hi) * o1;
            }
#else
#if XS == 1
            const float8 f0 = convert_float8(vload8(4 * t, x_local));
            const float8 f1 = convert_float8(vload8(4 * t + 1, x_local));
            const float8 f2 = convert_float8(vload8(4 * t + 2, x_local));
            const float8 f3 = convert_float8(vload8(4 * t + 3, x_local));
#elif XS == 2
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
            TEXEL_DOTS(t, f0, f1, f2, f3)
#endif
        }
        GROUP_SUMS(g, xsum)
    }
    LANE_SUMS
#endif

#if SLICES > 1
    // Slices 1.. hand their partial sums to slice 0 through local memory.
    const int row_lane = get_local_id(0);
    if (slice > 0) {
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) partial[slice - 1][r][row_lane] = acc[r];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (slice != 0) return;
    for (int s = 0; s < SLICES - 1; ++s) {
        #pragma unroll
        for (int r = 0; r < WROWS; ++r) acc[r] += partial[s][r][row_lane];
    }
#endif
    store_outputs(acc, grow, first, n_out, out_base, bias, has_bias, y);
}
