// x quantized to int8 per block of 32, llama.cpp's Q8_1 activations (perfx.reference.quantize_activations_q8):
// q_x = rint(x·127/max|x|), the block's step d = max|x|/127 and the sum of its quantized values Σ d·q_x (an
// all-zero block: d = 0, codes 0). Every producer of int4 × int8 activations (the rows GEMV's own launch, the
// interleaved GEMV's local copy, the rmsnorm that feeds the GEMVs) rounds through this one macro, so the
// codes a GEMV reads do not depend on which of them made them.
//
// Q8_1_BLOCK(x, b, R, D, S) declares R0..R3 (float8, the rounded codes of floats 32b..32b+31 of the __global
// x, in order; four variables, not an array: Oclgrind 21.10 crashes on an array of float8), D (the step) and S
// (the sum). Q8_1_EVEN(R) / Q8_1_ODD(R): the block's even and odd codes as char16,
// the order a q4 texel holds its low and high nibbles (kernels/q4.h), so one AND or a shift frees 16 codes
// that meet their x in place.

#ifndef PERFX_Q8_1_H
#define PERFX_Q8_1_H

#include "sum8.h"

#define Q8_1_BLOCK(x, b, R, D, S)                                                                            \
    float8 R##0, R##1, R##2, R##3;                                                                           \
    float D, S;                                                                                              \
    {                                                                                                        \
        const float8 q8v0_ = vload8(4 * (b), (x)), q8v1_ = vload8(4 * (b) + 1, (x));                         \
        const float8 q8v2_ = vload8(4 * (b) + 2, (x)), q8v3_ = vload8(4 * (b) + 3, (x));                     \
        const float8 q8m8_ = fmax(fmax(fabs(q8v0_), fabs(q8v1_)), fmax(fabs(q8v2_), fabs(q8v3_)));           \
        const float4 q8m4_ = fmax(q8m8_.lo, q8m8_.hi);                                                       \
        const float q8amax_ = fmax(fmax(q8m4_.s0, q8m4_.s1), fmax(q8m4_.s2, q8m4_.s3));                      \
        const float q8inv_ = q8amax_ > 0.0f ? 127.0f / q8amax_ : 0.0f;                                       \
        R##0 = rint(q8v0_ * q8inv_);                                                                         \
        R##1 = rint(q8v1_ * q8inv_);                                                                         \
        R##2 = rint(q8v2_ * q8inv_);                                                                         \
        R##3 = rint(q8v3_ * q8inv_);                                                                         \
        D = q8amax_ / 127.0f;                                                                                \
        S = SUM8((R##0 + R##1) + (R##2 + R##3)) * D;                                                         \
    }

// The components named one by one, and one 16-wide conversion: Oclgrind 21.10 crashes on .even / .odd of a
// float8 passed to a conversion.
#define Q8_1_EVEN(R) convert_char16_sat((float16)(                                                          \
    (R##0).s0, (R##0).s2, (R##0).s4, (R##0).s6, (R##1).s0, (R##1).s2, (R##1).s4, (R##1).s6,                  \
    (R##2).s0, (R##2).s2, (R##2).s4, (R##2).s6, (R##3).s0, (R##3).s2, (R##3).s4, (R##3).s6))
#define Q8_1_ODD(R) convert_char16_sat((float16)(                                                           \
    (R##0).s1, (R##0).s3, (R##0).s5, (R##0).s7, (R##1).s1, (R##1).s3, (R##1).s5, (R##1).s7,                  \
    (R##2).s1, (R##2).s3, (R##2).s5, (R##2).s7, (R##3).s1, (R##3).s3, (R##3).s5, (R##3).s7))

#endif  // PERFX_Q8_1_H
