// x quantized to int8 per block of 32, llama.cpp's Q8_1 activations (perfx.reference.quantize_activations_q8):
// q_x = rint(x·127/max|x|), the block's step d = max|x|/127 and the sum of its quantized values Σ d·q_x (an
// all-zero block: d = 0, codes 0). Every producer of int4 × int8 activations (the rows GEMV's own launch, the
// interleaved GEMV's local copy, the rmsnorm that feeds the GEMVs, the decode attention that feeds the o
// projection) rounds through this one macro, so the codes a GEMV reads do not depend on which of them made them.
//
// Q8_1_BLOCK(x, b, R, D, S) declares R0..R3 (float8, the rounded codes of floats 32b..32b+31 of the __global
// x, in order; four variables, not an array: Oclgrind has crashed on an array of float8), D (the step) and S
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
// their x in place. One scalar conversion and store a code: Oclgrind has crashed on the vector forms (.even /
// .odd or swizzles of a float8 or of a conversion's result), and a CPU compiler without 512-bit vectors on a
// float16 passed to a built-in. A norm quantizes only K/32 blocks, after its row is written.
#define Q8_1_STORE4(v, dst, o)                                                                               \
    (dst)[(o)] = convert_char_sat((v).s0); (dst)[(o) + 1] = convert_char_sat((v).s2);                        \
    (dst)[(o) + 2] = convert_char_sat((v).s4); (dst)[(o) + 3] = convert_char_sat((v).s6);                    \
    (dst)[(o) + 16] = convert_char_sat((v).s1); (dst)[(o) + 17] = convert_char_sat((v).s3);                  \
    (dst)[(o) + 18] = convert_char_sat((v).s5); (dst)[(o) + 19] = convert_char_sat((v).s7);
#define Q8_1_STORE(R, dst)                                                                                   \
    Q8_1_STORE4(R##0, dst, 0) Q8_1_STORE4(R##1, dst, 4) Q8_1_STORE4(R##2, dst, 8) Q8_1_STORE4(R##3, dst, 12)

// Q8_1_STORE_NATURAL(R, dst): the 32 codes in x's own order, as the int8 GEMV reads them (kernels/gemv_q8.cl's
// gemv_q8_quantize_x writes the same bytes).
#define Q8_1_STORE_NATURAL(R, dst)                                                                           \
    ((__global char8*)(dst))[0] = convert_char8_sat(R##0); ((__global char8*)(dst))[1] = convert_char8_sat(R##1); \
    ((__global char8*)(dst))[2] = convert_char8_sat(R##2); ((__global char8*)(dst))[3] = convert_char8_sat(R##3);

// The orders a producer writes its blocks' codes in (the ORDER of Q8_1_QUANTIZE; the Q8X of rmsnorm.cl):
#define Q8_1_TEXEL 1     // even codes then odd: the int4 GEMV's rows layout (kernels/gemv_q4_rows.cl, I8)
#define Q8_1_NATURAL 2   // in order: the int8 GEMV (kernels/gemv_q8.cl, I8)

// Q8_1_QUANTIZE(x, first, count, id, size, codes, step_sum, ORDER): blocks first .. first + count − 1 of the
// __global float* x, one work-item a block (work-item id of size), codes (char*, 32 a block) and step_sum
// (float2 a block) indexed from x's start. It begins with a barrier, which makes the work-group's stores of x
// visible to the work-item that quantizes them: every work-item of the group must reach it.
#define Q8_1_QUANTIZE(x, first, count, id, size, codes, step_sum, ORDER)                                       \
    barrier(CLK_GLOBAL_MEM_FENCE);                                                                           \
    for (int qb_ = (id); qb_ < (count); qb_ += (size)) {                                                     \
        Q8_1_BLOCK(x, (first) + qb_, qv_, qstep_, qsum_)                                                     \
        if ((ORDER) == Q8_1_NATURAL) {                                                                       \
            Q8_1_STORE_NATURAL(qv_, (codes) + 32 * ((first) + qb_))                                          \
        } else {                                                                                             \
            Q8_1_STORE(qv_, (codes) + 32 * ((first) + qb_))                                                  \
        }                                                                                                    \
        (step_sum)[(first) + qb_] = (float2)(qstep_, qsum_);                                                 \
    }

#endif  // PERFX_Q8_1_H
