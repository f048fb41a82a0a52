// x quantized to int8 per block of 32, llama.cpp's Q8_1 activations (perfx.reference.quantize_activations_q8):
// q_x = rint(x·127/max|x|), the block's step d = max|x|/127 and the sum of its quantized values Σ d·q_x (an
// all-zero block: d = 0, codes 0). Every producer of int4 × int8 activations (the rows GEMV's own launch, the
// interleaved GEMV's local copy, the rmsnorm that feeds the GEMVs, the decode attention that feeds the o
// projection) rounds through this one macro, so the codes a GEMV reads do not depend on which of them made them.
//
// Q8_1_BLOCK(x, b, R, D, S) declares R0..R3 (float8, the rounded codes of floats 32b..32b+31 of the __global
// x, in order; four variables, not an array: Oclgrind 21.10 crashes on an array of float8), D (the step) and S
// (the sum).

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

// Q8_1_STORE(R, dst): the block's 32 codes to the __global char* dst, its even codes then its odd ones (the
// order a q4 texel holds its low and high nibbles, kernels/q4.h), so one AND or a shift frees 16 codes that meet
// their x in place. One scalar conversion and store a code: Oclgrind 21.10 crashes on the vector forms (.even /
// .odd or swizzles of a float8 or of a conversion's result), PoCL's LLVM 14 without AVX-512 on a float16 passed
// to a built-in. A norm quantizes only K/32 blocks, after its row is written.
#define Q8_1_STORE4(v, dst, o)                                                                               \
    (dst)[(o)] = convert_char_sat((v).s0); (dst)[(o) + 1] = convert_char_sat((v).s2);                        \
    (dst)[(o) + 2] = convert_char_sat((v).s4); (dst)[(o) + 3] = convert_char_sat((v).s6);                    \
    (dst)[(o) + 16] = convert_char_sat((v).s1); (dst)[(o) + 17] = convert_char_sat((v).s3);                  \
    (dst)[(o) + 18] = convert_char_sat((v).s5); (dst)[(o) + 19] = convert_char_sat((v).s7);
#define Q8_1_STORE(R, dst)                                                                                   \
    Q8_1_STORE4(R##0, dst, 0) Q8_1_STORE4(R##1, dst, 4) Q8_1_STORE4(R##2, dst, 8) Q8_1_STORE4(R##3, dst, 12)

#endif  // PERFX_Q8_1_H
