// RMSNorm over M rows of K floats (row m at m·K); γ (K) float; fp32 throughout.
//
//   rmsnorm_residual:  h = x + r, written back into r (the new residual stream);
//                      y = h / sqrt(mean(h²) + eps) · γ
//   rmsnorm:           y = x / sqrt(mean(x²) + eps) · γ
//   rmsnorm_post_residual (Gemma's sandwich norms: a block's output normalised before the residual add):
//                      h = x + p / sqrt(mean(p²) + eps) · γ_post, written back into x (the residual stream);
//                      y = h / sqrt(mean(h²) + eps) · γ_next
//
// Shape contract: any M >= 1, any K >= 1 (a VW-wide main part, then a scalar tail of K mod VW).
// Launch: one work-group per row, global = M · WGS, local = WGS. y must not alias x, r or p.
//
// One pass over the inputs: each work-item keeps VW partial sums of squares over its own columns,
// the work-group adds them in a local-memory tree (SG 0) or with sub_group_reduce_add and one exchange of
// the subgroups' sums through local memory (SG 1, one barrier instead of log2(WGS)), and the second sweep
// reads back only what this same work-item just wrote (r) or read (x): from cache, and visible to it
// without a barrier.
//
// Q8X (K a multiple of 32): y is also written quantized for the GEMVs that read it with int8 activations: per
// block of 32 its Q8_1 codes, xq (K bytes a row), in the order its readers take them (kernels/q8_1.h:
// Q8_1_TEXEL 1 for the int4 GEMV's rows layout, Q8_1_NATURAL 2 for the int8 GEMV), and its step and sum,
// x_step_sum (K/32 float2 a row), so no GEMV launch of a decode step quantizes the vector a norm produced, and
// every GEMV reading it shares one quantization.

#ifndef WGS
#define WGS 128  // work-items per row (a power of two)
#endif
#ifndef VW
#define VW 4  // floats per load: 1, 4 or 8
#endif
#ifndef Q8X
#define Q8X 0  // also write y quantized per block of 32, in this order (kernels/q8_1.h; set by the caller, not tuned)
#endif
#ifndef SG
#define SG 0  // the work-group's sum: a local-memory tree (0) or subgroup reductions (1, cl_khr_subgroups)
#endif

#define USES_SUBGROUPS SG
#include "gpu.h"

#if Q8X
#include "q8_1.h"
#define Q8X_ARGS , __global char* restrict xq, __global float2* restrict x_step_sum
// After y's row is written: y's blocks of 32, each quantized by one work-item.
#define QUANTIZE_Y(k, y)                                                                                    \
    Q8_1_QUANTIZE(y, 0, (k) / 32, get_local_id(0), WGS, xq + (size_t)get_group_id(0) * (k),                \
                  x_step_sum + (size_t)get_group_id(0) * ((k) / 32), Q8X)
#else
#define Q8X_ARGS
#define QUANTIZE_Y(k, y)
#endif

#if VW == 8
typedef float8 floatVW;
#define LOADV(i, p) vload8(i, p)
#define STOREV(v, i, p) vstore8(v, i, p)
#define HSUM(v) ((v).s0 + (v).s1 + (v).s2 + (v).s3 + (v).s4 + (v).s5 + (v).s6 + (v).s7)
#elif VW == 4
typedef float4 floatVW;
#define LOADV(i, p) vload4(i, p)
#define STOREV(v, i, p) vstore4(v, i, p)
#define HSUM(v) ((v).s0 + (v).s1 + (v).s2 + (v).s3)
#elif VW == 1
typedef float floatVW;
#define LOADV(i, p) ((p)[i])
#define STOREV(v, i, p) ((p)[i] = (v))
#define HSUM(v) (v)
#else
#error "VW must be 1, 4 or 8"
#endif

// The sum of every work-item's value, returned to all of them. A second call on the same scratch needs a
// barrier first: every work-item reads the first total from it.
float work_group_total(const float value, __local float* scratch)
{
#if SG
    // Each subgroup's sum, then every work-item adds the few subgroup sums itself.
    const float mine = sub_group_reduce_add(value);
    if (get_sub_group_local_id() == 0) {
        scratch[get_sub_group_id()] = mine;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    float total = 0.0f;
    for (uint s = 0; s < get_num_sub_groups(); ++s) {
        total += scratch[s];
    }
    return total;
#else
    const int lid = get_local_id(0);
    scratch[lid] = value;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = WGS / 2; stride > 0; stride >>= 1) {
        if (lid < stride) {
            scratch[lid] += scratch[lid + stride];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    return scratch[0];
#endif
}

// Σ v² over this work-item's columns of one row: VW-wide partial sums, then the scalar tail.
float squares_of(const int k, __global const float* restrict v)
{
    const int lid = get_local_id(0);
    const int chunks = k / VW;
    floatVW squares = (floatVW)(0.0f);
    for (int c = lid; c < chunks; c += WGS) {
        const floatVW e = LOADV(c, v);
        squares = fma(e, e, squares);
    }
    float total = HSUM(squares);
    for (int i = chunks * VW + lid; i < k; i += WGS) {
        total = fma(v[i], v[i], total);
    }
    return total;
}

// y = h · inv · γ over one row, h read from src (written or read earlier by this work-item).
void scale_row(const int k, const float inv, __global const float* src, __global const float* restrict gamma,
               __global float* restrict y)
{
    const int lid = get_local_id(0);
    const int chunks = k / VW;
    for (int c = lid; c < chunks; c += WGS) {
        STOREV(LOADV(c, src) * inv * LOADV(c, gamma), c, y);
    }
    for (int i = chunks * VW + lid; i < k; i += WGS) {
        y[i] = src[i] * inv * gamma[i];
    }
}

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void rmsnorm_residual(const int k, const float eps, __global const float* restrict x,
                      __global float* restrict r, __global const float* restrict gamma,
                      __global float* restrict y Q8X_ARGS)
{
    __local float scratch[WGS];
    const size_t base = (size_t)get_group_id(0) * k;
    x += base;
    r += base;
    y += base;

    const int lid = get_local_id(0);
    const int chunks = k / VW;
    floatVW squares = (floatVW)(0.0f);
    for (int c = lid; c < chunks; c += WGS) {
        const floatVW h = LOADV(c, x) + LOADV(c, r);
        STOREV(h, c, r);
        squares = fma(h, h, squares);
    }
    float total = HSUM(squares);
    for (int i = chunks * VW + lid; i < k; i += WGS) {
        const float h = x[i] + r[i];
        r[i] = h;
        total = fma(h, h, total);
    }
    const float inv = 1.0f / sqrt(work_group_total(total, scratch) / (float)k + eps);
    scale_row(k, inv, r, gamma, y);
    QUANTIZE_Y(k, y)
}

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void rmsnorm(const int k, const float eps, __global const float* restrict x,
             __global const float* restrict gamma, __global float* restrict y Q8X_ARGS)
{
    __local float scratch[WGS];
    const size_t base = (size_t)get_group_id(0) * k;
    x += base;
    y += base;
    const float inv = 1.0f / sqrt(work_group_total(squares_of(k, x), scratch) / (float)k + eps);
    scale_row(k, inv, x, gamma, y);
    QUANTIZE_Y(k, y)
}

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void rmsnorm_post_residual(const int k, const float eps, __global const float* restrict p,
                           __global float* restrict x, __global const float* restrict post_gamma,
                           __global const float* restrict next_gamma, __global float* restrict y Q8X_ARGS)
{
    __local float scratch[WGS];
    const size_t base = (size_t)get_group_id(0) * k;
    p += base;
    x += base;
    y += base;
    const float inv_p = 1.0f / sqrt(work_group_total(squares_of(k, p), scratch) / (float)k + eps);

    // h = x + p·inv_p·γ_post into x, and Σ h²: p read again from cache, x read and written once.
    const int lid = get_local_id(0);
    const int chunks = k / VW;
    floatVW squares = (floatVW)(0.0f);
    for (int c = lid; c < chunks; c += WGS) {
        const floatVW h = LOADV(c, x) + LOADV(c, p) * inv_p * LOADV(c, post_gamma);
        STOREV(h, c, x);
        squares = fma(h, h, squares);
    }
    float total = HSUM(squares);
    for (int i = chunks * VW + lid; i < k; i += WGS) {
        const float h = x[i] + p[i] * inv_p * post_gamma[i];
        x[i] = h;
        total = fma(h, h, total);
    }
    barrier(CLK_LOCAL_MEM_FENCE);   // scratch is reused: every work-item has read inv_p's total from it
    const float inv = 1.0f / sqrt(work_group_total(total, scratch) / (float)k + eps);
    scale_row(k, inv, x, next_gamma, y);
    QUANTIZE_Y(k, y)
}
