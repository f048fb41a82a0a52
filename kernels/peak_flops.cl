// The device's peak fp32 arithmetic, the ceiling compute-bound kernels are reported against:
// each work-item runs 8 independent chains of ITERS multiply-adds on floatVW vectors,
// 2·8·VW·ITERS flops per work-item. a and b are kernel arguments so nothing folds at compile time;
// with a = 1 − ε and b = ε the chains stay finite whatever ITERS.
//
// Launch: any 1-D global size (a multiple of the local size if one is given); out holds one float
// per work-item, written so the chains are not dead code.

#ifndef VW
#define VW 4  // floats per vector: 1, 2, 4, 8 or 16 (PoCL reaches its peak only with wide types)
#endif
#ifndef ITERS
#define ITERS 256  // multiply-adds per chain
#endif

#if VW == 1
typedef float floatV;
#define SUM(v) (v)
#elif VW == 2
typedef float2 floatV;
#define SUM(v) ((v).s0 + (v).s1)
#elif VW == 4
typedef float4 floatV;
#define SUM(v) ((v).s0 + (v).s1 + (v).s2 + (v).s3)
#elif VW == 8
typedef float8 floatV;
#define SUM(v) ((v).s0 + (v).s1 + (v).s2 + (v).s3 + (v).s4 + (v).s5 + (v).s6 + (v).s7)
#else
typedef float16 floatV;
#define SUM(v) ((v).s0 + (v).s1 + (v).s2 + (v).s3 + (v).s4 + (v).s5 + (v).s6 + (v).s7 + \
                (v).s8 + (v).s9 + (v).sa + (v).sb + (v).sc + (v).sd + (v).se + (v).sf)
#endif

__kernel void peak_mad(__global float* out, const float a, const float b)
{
    const float seed = (float)get_global_id(0) * 1e-7f;
    floatV x0 = (floatV)(seed), x1 = x0 + 0.1f, x2 = x0 + 0.2f, x3 = x0 + 0.3f;
    floatV x4 = x0 + 0.4f, x5 = x0 + 0.5f, x6 = x0 + 0.6f, x7 = x0 + 0.7f;
    const floatV av = (floatV)(a), bv = (floatV)(b);
    // x·a + b rather than mad(): PoCL's LLVM aborts on mad() of float16; compilers contract this into
    // one fused multiply-add where the device has one.
    for (int i = 0; i < ITERS; i++) {
        x0 = x0 * av + bv; x1 = x1 * av + bv; x2 = x2 * av + bv; x3 = x3 * av + bv;
        x4 = x4 * av + bv; x5 = x5 * av + bv; x6 = x6 * av + bv; x7 = x7 * av + bv;
    }
    out[get_global_id(0)] = SUM(x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7);
}
