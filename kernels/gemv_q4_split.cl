// The int4 GEMV shaped for a GPU's thousands of work-groups, on rows contiguous along K (perfx's rows layout,
// LAYOUT 0 of kernels/q4.h, as Q4DeviceWeight uploads it): K split into SPLIT slices across work-groups, the
// partial sums reduced deterministically by a second, small launch.
//
// y (M) = W (N, K) · x (K) (+ bias), W int4 in perfx's device form (kernels/q4.h, perfx/ops/q4_weight.py):
//   codes: 32 per uint4 texel, texel t of row r at r·T + t (T = K/32); (s, m) per group of G along K
//   (Q4_SCALES), w = s·q + m. Per texel: Σ_k (s·q_k + m)·x_k = s·Σ q_k x_k + m·Σ x_k, the texel's 32 products
//   in 8 lanes, s and m of its group applied per texel (a texel never straddles a group: G ≥ 32).
// gemv_q4_split: work-group LANES·WGR work-items, WGR row sets of ROWS neighbouring rows, the LANES work-items
//   of a row set neighbours along K: at pass i, lane l reads texel t0 + l + LANES·i of each of its rows, so the
//   work-items of a warp/wave read one contiguous run of LANES·16 bytes per row (whole 32-byte sectors where
//   the run starts on one: slices start on an even texel, rows of K a multiple of 64 on 32 bytes). Global
//   (LANES·WGR·⌈⌈N/ROWS⌉/WGR⌉, SLICES): dimension 1 is the slice of K, texels [s·TS, min(T, (s + 1)·TS)), TS
//   = ⌈T/SPLIT⌉ rounded up to even, SLICES = ⌈T/TS⌉ (SPLIT, or fewer where rounding TS up would leave the
//   last ones empty). The lanes meet in a local-memory tree; lane 0 of a row set writes the slice's partial
//   sums, partial[s·N + row], for every row of W (gate and up rows alike). No atomics.
// gemv_q4_split_reduce: one work-item an output o < M, the SLICES partials summed in slice order (the same
//   order every run: deterministic), + bias, then the epilogue (kernels/epilogue.h):
//   EPI_NONE:     y[o] = Σ_s partial[s][o] + bias[o]                                   M = N
//   EPI_SILU_MUL: y[o] = SiLU(Σ_s partial[s][o] + b[o]) · (Σ_s partial[s][M + o] + b[M + o])   M = N/2
//   EPI_GELU_MUL: as SiLU·mul with GELU's tanh form.
// K is a build define (KTEXELS = K/32, set by the wrapper, one build per K): the slice bounds and the row
// stride are constants, so a compiler may unroll and issue a pass's loads ahead.
// Shape contract: K a multiple of G, G ∈ {32, 64, 128}; any N (rows past the end are clamped on load and not
// stored); partial holds SPLIT·N floats.

#ifndef SPLIT
#define SPLIT 1      // slices of K across work-groups (partial sums reduced by gemv_q4_split_reduce)
#endif
#ifndef LANES
#define LANES 8      // work-items along K per row set, neighbours reading neighbouring 16-byte texels
#endif
#ifndef ROWS
#define ROWS 2       // rows per work-item: each x chunk loaded once and applied to ROWS rows
#endif
#ifndef WGR
#define WGR 4        // row sets per work-group (work-group LANES·WGR, ROWS·WGR rows)
#endif
#ifndef KTEXELS
#define KTEXELS 18   // K/32, texels a row (set from the weight by the wrapper, not tuned)
#endif
#ifndef GROUP
#define GROUP 128    // quantization group along K (set from the weight, not tuned)
#endif
#ifndef EPILOGUE
#define EPILOGUE EPI_NONE  // plain (+bias), or SiLU / GELU (gate)·up over paired rows (the reduce launch's)
#endif
#ifndef BIAS
#define BIAS 0       // 1: the reduction adds the weight's bias (set from the weight by the wrapper, not tuned)
#endif

#define LAYOUT 0
#define READ 0
#include "epilogue.h"
#include "q4.h"

#define TEXELS_PER_GROUP (GROUP / 32)
#define SLICE_TEXELS ((((KTEXELS) + SPLIT - 1) / SPLIT + 1) / 2 * 2)   // TS: ⌈T/SPLIT⌉ rounded up to even
#define SLICES (((KTEXELS) + SLICE_TEXELS - 1) / SLICE_TEXELS)           // ⌈T/TS⌉ ≤ SPLIT: none empty

__kernel __attribute__((reqd_work_group_size(LANES * WGR, 1, 1)))
void gemv_q4_split(const int n_rows, __global const uint4* restrict codes, __global const half* restrict scale_offset,
                   __global const float* restrict x, __global float* restrict partial)
{
    const int q4_rows = n_rows;
    const int q4_texels = KTEXELS;
    const int q4_groups = KTEXELS / TEXELS_PER_GROUP;
#if LANES > 1
    __local float sums[WGR * ROWS][LANES];   // declared at kernel scope, as OpenCL C 1.2 requires
#endif
    const int lane = get_local_id(0) % LANES;
    const int set = get_local_id(0) / LANES;
    const int slice = get_group_id(1);
    const int first = (get_group_id(0) * WGR + set) * ROWS;
    const int t0 = slice * SLICE_TEXELS;
    const int t1 = min(t0 + SLICE_TEXELS, KTEXELS);

    int row[ROWS];
    float8 acc8[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        row[r] = min(first + r, n_rows - 1);
        acc8[r] = (float8)(0.0f);
    }
    for (int t = t0 + lane; t < t1; t += LANES) {
        const float8 f0 = vload8(4 * t, x), f1 = vload8(4 * t + 1, x);
        const float8 f2 = vload8(4 * t + 2, x), f3 = vload8(4 * t + 3, x);
        const float8 xsum = (f0 + f1) + (f2 + f3);
        const int g = t / TEXELS_PER_GROUP;
        #pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const uint4 tex = TEXEL(codes, row[r], t);
            const float8 dot = (CODES_F(tex.x) * f0 + CODES_F(tex.y) * f1)
                             + (CODES_F(tex.z) * f2 + CODES_F(tex.w) * f3);
            const float2 sm = GROUP_SM(scale_offset, row[r], g);
            acc8[r] = dot * sm.x + (xsum * sm.y + acc8[r]);
        }
    }

#if LANES > 1
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) sums[set * ROWS + r][lane] = SUM8(acc8[r]);
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = LANES / 2; stride > 0; stride >>= 1) {
        if (lane < stride) {
            #pragma unroll
            for (int r = 0; r < ROWS; ++r) sums[set * ROWS + r][lane] += sums[set * ROWS + r][lane + stride];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lane != 0) return;
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (first + r < n_rows) partial[(size_t)slice * n_rows + first + r] = sums[set * ROWS + r][0];
    }
#else
    #pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (first + r < n_rows) partial[(size_t)slice * n_rows + first + r] = SUM8(acc8[r]);
    }
#endif
}

// y[o] for o < n_out from the SLICES slices' partial sums (n_rows of them a slice): summed in slice order, the
// bias where the weight has one (BIAS: a build of its own, so a weight without one reads nothing there), the
// epilogue; gate-up pairs row o with row half_rows + o.
__kernel void gemv_q4_split_reduce(const int n_out, const int half_rows, const int n_rows,
                                   __global const float* restrict partial, __global const float* restrict bias,
                                   __global float* restrict y)
{
    const int o = get_global_id(0);
    if (o >= n_out) return;
    float v = 0.0f;
    #pragma unroll
    for (int s = 0; s < SLICES; ++s) v += partial[(size_t)s * n_rows + o];
#if BIAS
    v += bias[o];
#endif
#if EPI_GATED
    float up = 0.0f;
    #pragma unroll
    for (int s = 0; s < SLICES; ++s) up += partial[(size_t)s * n_rows + half_rows + o];
#if BIAS
    up += bias[half_rows + o];
#endif
    v = GATE_ACT(v) * up;
#endif
    y[o] = v;
}
