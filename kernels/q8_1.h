// x quantized to int8 per block of 32, llama.cpp's Q8_1 activations (perfx.reference.quantize_activations_q8):
// q_x = rint(x·127/max|x|), the block's step d = max|x|/127 and the sum of its quantized values Σ d·q_x (an
// all-zero block: d = 0, codes 0). Every producer of int4 × int8 activations (the rows GEMV's own launch, the
// interleaved GEMV's local copy, the rmsnorm that feeds the GEMVs) rounds through this one macro, so the
// codes a GEMV reads do not depend on which of them made them.
//
// Q8_1_BLOCK(x, b, R, D, S) declares R (float8[4], the rounded codes of floats 32b..32b+31 of the __global x,
// in order), D (the step) and S (the sum). Q8_1_EVEN(R) / Q8_1_ODD(R): the block's even and odd codes as char16,
// the order a q4 texel holds its low and high nibbles (kernels/q4.h), so one AND or a shift frees 16 codes
// that meet their x in place.

#ifndef PERFX_Q8_1_H
#define PERFX_Q8_1_H

#include "sum8.h"

#define Q8_1_BLOCK(x, b, R, D, S)                                                                            \
    float8 R[4];                                                                                             \
    float D, S;                                                                                              \
    {                                                                                                        \
        const float8 q8v0_ = vload8(4 * (b), (x)), q8v1_ = vload8(4 * (b) + 1, (x));                         \
        const float8 q8v2_ = vload8(4 * (b) + 2, (x)), q8v3_ = vload8(4 * (b) + 3, (x));                     \
        const float8 q8m8_ = fmax(fmax(fabs(q8v0_), fabs(q8v1_)), fmax(fabs(q8v2_), fabs(q8v3_)));           \
        const float4 q8m4_ = fmax(q8m8_.lo, q8m8_.hi);                                                       \
        const float q8amax_ = fmax(fmax(q8m4_.s0, q8m4_.s1), fmax(q8m4_.s2, q8m4_.s3));                      \
        const float q8inv_ = q8amax_ > 0.0f ? 127.0f / q8amax_ : 0.0f;                                       \
        R[0] = rint(q8v0_ * q8inv_);                                                                         \
        R[1] = rint(q8v1_ * q8inv_);                                                                         \
        R[2] = rint(q8v2_ * q8inv_);                                                                         \
        R[3] = rint(q8v3_ * q8inv_);                                                                         \
        D = q8amax_ / 127.0f;                                                                                \
        S = SUM8((R[0] + R[1]) + (R[2] + R[3])) * D;                                                         \
    }

#define Q8_1_EVEN(R) ((char16)(convert_char4_sat((R)[0].even), convert_char4_sat((R)[1].even),              \
                               convert_char4_sat((R)[2].even), convert_char4_sat((R)[3].even)))
#define Q8_1_ODD(R) ((char16)(convert_char4_sat((R)[0].odd), convert_char4_sat((R)[1].odd),                  \
                              convert_char4_sat((R)[2].odd), convert_char4_sat((R)[3].odd)))

#endif  // PERFX_Q8_1_H
