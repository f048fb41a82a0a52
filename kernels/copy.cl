// dst (N) = src (N), N float4s: the device's copy bandwidth, the ceiling every memory-bound kernel
// of perfx is reported against (bytes read + bytes written per second).

#ifndef VWC
#define VWC 4  // floats per load: 4 or 8 (PoCL on x86 needs wide types to reach its bandwidth)
#endif

#if VWC == 8
typedef float8 floatC;
#define LOADC vload8
#define STOREC vstore8
#else
typedef float4 floatC;
#define LOADC vload4
#define STOREC vstore4
#endif

__kernel void copy_vectors(const int n, __global const float* restrict src, __global float* restrict dst)
{
    for (int i = get_global_id(0); i < n; i += get_global_size(0)) {
        STOREC(LOADC(i, src), i, dst);
    }
}
