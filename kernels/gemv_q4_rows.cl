// The int4 GEMV on rows contiguous along K (perfx's portable layout, the CPU/PoCL winner); the maths, the
// arguments and the epilogues are kernels/gemv_q4.h's.
//   work-group (LANES, 1), global (LANES, ⌈n_out/ROWS⌉): LANES work-items stride along K by groups for ROWS
//   rows and meet in a reduction: a local-memory tree (SG 0) or sub_group_reduce_add (SG 1; with
//   SUBGROUP = LANES one subgroup holds them all: no local memory, no barrier).

#ifndef LANES
#define LANES 16     // work-items along K per work-group
#endif
#ifndef ROWS
#define ROWS 4       // outputs per work-item: each x chunk is loaded once and applied to ROWS rows
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

__kernel REQD_SUBGROUP __attribute__((reqd_work_group_size(LANES, 1, 1)))
void gemv_q4(GEMV_Q4_ARGS)
{
    const int q4_rows = n_rows;
    const int q4_texels = k / 32;
    const int q4_groups = k / GROUP;
    const int lane = get_local_id(0);   // which lane along K
    const int first = get_group_id(1) * ROWS;
#if LANES > 1
    __local float partial[WROWS][LANES];  // declared at kernel scope, as OpenCL C 1.2 requires
#endif
    int wrow[WROWS], grow[WROWS];
    own_rows(first, n_out, out_base, half_rows, row_a, row_b, wrow, grow);

    float acc[WROWS];
    #pragma unroll
    for (int r = 0; r < WROWS; ++r) acc[r] = 0.0f;
    LANE_ACCUMULATORS
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
    LANE_SUMS

#if LANES > 1
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
    store_outputs(acc, grow, first, n_out, out_base, bias, has_bias, y);
}
