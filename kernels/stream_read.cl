// sums[g] = Σ src[i] over the floats work-group g reads: the device's read-only stream bandwidth, the ceiling a
// kernel that reads far more than it writes (a decode GEMV: its weight in, a vector out) is also reported against,
// beside copy's (kernels/copy.cl: read + write). Each work-item adds its floats in fp32 and the work-group's
// WGS partial sums meet in local memory; the one float a work-group writes keeps every read live (a compiler
// drops loads whose values reach no store) at a write of 4 bytes per WGS work-items.
//
// Shape contract: count floats in src, any count. Work-item i (of the launch's global size G, a multiple of WGS)
// reads the vectors of VWR floats i, i + G, i + 2G, ... below count / VWR, and the float VWR·(count / VWR) + i where
// i < count mod VWR; work-group g writes sums[g], one float per work-group.

#ifndef VWR
#define VWR 4     // floats per load: 4 or 8 (PoCL on x86 needs wide types to reach its bandwidth)
#endif
#ifndef WGS
#define WGS 64    // work-items per work-group, a power of two (the tree halves it)
#endif

#if VWR == 8
typedef float8 floatR;
#define LOADR vload8
#define SUMR(v) (((v).s0 + (v).s1) + ((v).s2 + (v).s3) + ((v).s4 + (v).s5) + ((v).s6 + (v).s7))
#else
typedef float4 floatR;
#define LOADR vload4
#define SUMR(v) (((v).s0 + (v).s1) + ((v).s2 + (v).s3))
#endif

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void stream_read(const int count, __global const float* restrict src, __global float* restrict sums)
{
    __local float part[WGS];
    const int vectors = count / VWR;
    floatR acc = (floatR)(0.0f);
    for (int i = get_global_id(0); i < vectors; i += get_global_size(0)) {
        acc += LOADR(i, src);
    }
    float total = SUMR(acc);
    const int rest = VWR * vectors + get_global_id(0);
    if (rest < count) {
        total += src[rest];
    }
    const int lid = get_local_id(0);
    part[lid] = total;
    for (int step = WGS / 2; step > 0; step /= 2) {
        barrier(CLK_LOCAL_MEM_FENCE);
        if (lid < step) {
            part[lid] += part[lid + step];
        }
    }
    if (lid == 0) {
        sums[get_group_id(0)] = part[0];
    }
}
