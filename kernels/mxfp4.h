// MXFP4 (OCP microscaling, gpt-oss's experts) decoded in registers: the routed-expert kernels (gemv_moe.cl,
// gemm_moe.cl). Its own header, not q4.h, because every family including q4.h is pinned to its code.
#ifndef PERFX_MXFP4_H
#define PERFX_MXFP4_H

// The doubled e2m1 value of the low nibble of n (sign, 2-bit exponent ee, 1-bit mantissa m): 0, ±1, ±2, ±3, ±4,
// ±6, ±8, ±12 (ggml's kvalues_mxfp4, perfx.formats.MXFP4_VALUES), built as float bits with selects, no table: a
// per-lane table index would serialise constant-memory reads on a GPU. ee > 0: 2^ee·(1 + m/2); ee = 0: m.
inline float e2m1_doubled(const uint n)
{
    const uint ee = (n >> 1) & 3u, m = n & 1u;
    const uint magnitude = ee ? ((ee + 127u) << 23) | (m << 22) : (m ? 0x3f800000u : 0u);
    return as_float(magnitude | ((n & 8u) << 28));
}
#define E2M1(n) e2m1_doubled((uint)(n))

// 2^(e − 128) of an E8M0 byte e, the scale of the doubled values (ggml's ggml_e8m0_to_fp32_half; subnormal for
// e < 2, which a device that flushes subnormals reads as 0: weights below 2^-126 of a trained model)
#define E8M0_HALF(e) as_float((uint)(e) < 2u ? 0x00200000u << (uint)(e) : ((uint)(e) - 1u) << 23)

#endif
