// y (N) = W (N,K) · x (K); W fp16, x and y float, fp32 accumulation. The lm_head (also when tied to
// the token embeddings).
//
// W is read with vload_half4/8 (core OpenCL: no cl_khr_fp16 needed) and may be split by rows over
// several buffers, each within the device's largest allocation: the wrapper launches once per row
// block, passing that block's rows as n and where its first row lands in y as y_offset.
//
// Shape contract: any N >= 1, any K >= 1. Row r starts at r·K halves; vload_halfN only needs 2-byte
// alignment, so K need not be a multiple of VW (the last K mod VW columns are a scalar tail).
// Launch: global = ceil(N / ROWS) · WGS, local = WGS, where ROWS = WGS / LANES rows per work-group.
//
// Memory-bound: each weight is read once; x (K floats) is reread by every row, from cache.
// The LANES partial sums of a row meet in a local-memory tree (SG 0) or (SG 1) in sub_group_reduce_add over
// subgroups of a required size SUBGROUP that divides LANES (a row's lanes are whole subgroups), with one
// exchange through local memory where a row spans several subgroups.

#ifndef WGS
#define WGS 64  // work-items per work-group
#endif
#ifndef LANES
#define LANES 16  // work-items sharing one row (a power of two dividing WGS); 1 = a row per work-item
#endif
#ifndef VW
#define VW 8  // weights per load: 4 or 8
#endif
#ifndef SG
#define SG 0  // lanes of a row reduced by a local-memory tree (0) or subgroup reductions (1)
#endif
#ifndef SUBGROUP
#define SUBGROUP 0  // required subgroup size (kernels/gpu.h); SG 1 needs it to divide LANES
#endif

#define USES_SUBGROUPS SG
#include "gpu.h"

#define ROWS (WGS / LANES)

#if VW == 8
typedef float8 floatVW;
#define LOAD_W(p) vload_half8(0, p)
#define LOAD_X(p) vload8(0, p)
#define HSUM(v) ((v).s0 + (v).s1 + (v).s2 + (v).s3 + (v).s4 + (v).s5 + (v).s6 + (v).s7)
#elif VW == 4
typedef float4 floatVW;
#define LOAD_W(p) vload_half4(0, p)
#define LOAD_X(p) vload4(0, p)
#define HSUM(v) ((v).s0 + (v).s1 + (v).s2 + (v).s3)
#else
#error "VW must be 4 or 8"
#endif

__kernel REQD_SUBGROUP __attribute__((reqd_work_group_size(WGS, 1, 1)))
void gemv_f16(const int n, const int k, __global const half* restrict w, __global const float* restrict x,
              __global float* restrict y, const int y_offset)
{
    const int lid = get_local_id(0);
    const int lane = lid % LANES;
    const int row = get_group_id(0) * ROWS + lid / LANES;

    float sum = 0.0f;
    if (row < n) {
        __global const half* wrow = w + (size_t)row * k;
        // Adjacent lanes read adjacent VW-chunks: coalesced across the lanes of a row on GPUs.
        const int chunks = k / VW;
        floatVW acc = (floatVW)(0.0f);
        for (int c = lane; c < chunks; c += LANES) {
            acc = fma(LOAD_W(wrow + c * VW), LOAD_X(x + c * VW), acc);
        }
        sum = HSUM(acc);
        for (int i = chunks * VW + lane; i < k; i += LANES) {
            sum = fma(vload_half(i, wrow), x[i], sum);
        }
    }

#if LANES > 1 && SG
    // One sub_group_reduce_add per subgroup; a row of several subgroups adds their sums in local memory.
    sum = sub_group_reduce_add(sum);
#if LANES > SUBGROUP
    __local float partial[WGS / SUBGROUP];
    if (get_sub_group_local_id() == 0) {
        partial[lid / SUBGROUP] = sum;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lane == 0) {
        sum = 0.0f;
        for (int s = 0; s < LANES / SUBGROUP; ++s) {
            sum += partial[lid / SUBGROUP + s];
        }
    }
#endif
#elif LANES > 1
    // Tree over the LANES partial sums of each row (they are contiguous in the work-group).
    __local float partial[WGS];
    partial[lid] = sum;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = LANES / 2; stride > 0; stride >>= 1) {
        if (lane < stride) {
            partial[lid] += partial[lid + stride];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    sum = partial[lid];
#endif

    if (lane == 0 && row < n) {
        y[y_offset + row] = sum;
    }
}
