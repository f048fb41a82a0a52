// perfx's int8 device form (perfx/ops/q8_weight.py), as every int8 kernel reads it.
//
// W (N, K): int8 codes, rows contiguous along K (row blocks of the weight may live in several buffers);
// one (s, m) pair per group of G ∈ {16, 32} along K, w = s·q + m, held as half2 (SM_F32 0: where fp16 holds
// the file's scales exactly) or float2 (SM_F32 1: Q5_K and Q6_K, whose d·sc needs up to 18 bits).

#ifndef PERFX_Q8_H
#define PERFX_Q8_H

#include "sum8.h"

#ifndef GROUP
#define GROUP 32     // quantization group along K, 16 or 32 (set from the weight, not tuned)
#endif
#ifndef SM_F32
#define SM_F32 0     // (s, m) pairs: 0 half2, 1 float2 (set from the weight, not tuned)
#endif

#define CHUNKS_PER_GROUP (GROUP / 8)

#if SM_F32
#define PAIRS_T __global const float* restrict
#define LOAD_PAIR(p, i) vload2((i), (p))
#else
#define PAIRS_T __global const half* restrict
#define LOAD_PAIR(p, i) vload_half2((i), (p))
#endif

// 8 codes as floats, in x order (8 wide: PoCL 3.0's LLVM 14 fails to select 16-wide convert code on AVX2).
// Loaded through a char8 pointer rather than vload8, which PoCL calls out of line: rows start at multiples
// of K bytes and K is a multiple of 16, so every chunk of 8 codes is 8-byte aligned.
#define CODES8(p, c) convert_float8(((const __global char8*)(p))[c])

#endif
