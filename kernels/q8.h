// perfx's int8 device form (perfx/ops/q8_weight.py), as every int8 kernel reads it.
//
// W (N, K): int8 codes, rows contiguous along K (row blocks of the weight may live in several buffers);
// per group of G ∈ {16, 32} along K either an (s, m) pair, w = s·q + m, or, for the symmetric types whose
// offset is always 0 (Q8_0, Q5_0, Q6_K: SYM 1), the scale s alone, w = s·q: 2 or 4 bytes a group fewer to
// read. Held as half (SM_F32 0: where fp16 holds the file's scales exactly) or float (SM_F32 1: Q5_K and
// Q6_K, whose d·sc needs up to 18 bits). Each row's (rows, K/G) values are SM_PER_GROUP a group.

#ifndef PERFX_Q8_H
#define PERFX_Q8_H

#include "sum8.h"

#ifndef GROUP
#define GROUP 32     // quantization group along K, 16 or 32 (set from the weight, not tuned)
#endif
#ifndef SM_F32
#define SM_F32 0     // scales (and offsets): 0 half, 1 float (set from the weight, not tuned)
#endif
#ifndef SYM
#define SYM 0        // 1: scales alone, every offset 0 (set from the weight's type, not tuned)
#endif

#define CHUNKS_PER_GROUP (GROUP / 8)
#define SM_PER_GROUP (SYM ? 1 : 2)

#if SM_F32
#define SM_T __global const float* restrict
#else
#define SM_T __global const half* restrict
#endif

// Group i's (s, m) from a row's values; m is 0 under SYM, and DEQUANT leaves it out, so a symmetric weight
// costs one multiply (m·… terms that are known zeros are not left for the compiler: x·0 + a is no
// identity in IEEE arithmetic, so it would keep them).
#if SYM && SM_F32
#define LOAD_SM(p, i) ((float2)((p)[i], 0.0f))
#elif SYM
// fp16 scales alone are read 32 bits at a time, the half2 at the even index below i, and the one wanted picked:
// a CPU compiler that puts work-items in vector lanes turns a 16-bit load into a scalar load and an insert a
// lane (x86 gathers 32-bit elements at the least), which left Gemma 3's 262144-row head slower with its scales
// alone than with pairs. The read past the last group of a row stays in the buffer: the wrapper pads it.
inline float scale_of(SM_T p, const int i)
{
    const float2 two = vload_half2(0, p + (i & ~1));
    return (i & 1) ? two.y : two.x;
}
#define LOAD_SM(p, i) ((float2)(scale_of((p), (i)), 0.0f))
#elif SM_F32
#define LOAD_SM(p, i) vload2((i), (p))
#else
#define LOAD_SM(p, i) vload_half2((i), (p))
#endif
#if SYM
#define DEQUANT(q, sm) ((q) * (sm).x)
#else
#define DEQUANT(q, sm) ((q) * (sm).x + (sm).y)
#endif

// 8 codes as floats, in x order (8 wide: some CPU compilers fail to select 16-wide convert code).
// Loaded through a char8 pointer rather than vload8, which PoCL calls out of line: rows start at multiples
// of K bytes and K is a multiple of 16, so every chunk of 8 codes is 8-byte aligned.
#define CODES8(p, c) convert_float8(((const __global char8*)(p))[c])

#endif
