// perfx's int4 device form (perfx/ops/q4_weight.py), as every int4 kernel reads it.
//
// W (N, K): codes q ∈ [0, 15], 32 per uint4 texel (code 32t + 8c + j in component c, bits 4j..4j+3), and
// one half2 (s, m) per group of G along K, w = s·q + m. Where texel t of row r lives (LAYOUT, a property
// of the uploaded weight, chosen once at load):
//   LAYOUT 0  rows contiguous along K: texel index r·T + t (T = K/32 texels a row);
//   LAYOUT 1  interleaved: texel index t·N + r, so work-items that own neighbouring rows read neighbouring
//             16 bytes at the same t (coalesced on a GPU; one vector load for a SIMD CPU's lanes).
// How it is read (READ):
//   0  a uint4 buffer;
//   1  image2d_t row blocks (LAYOUT 0 only): x = t, y = row within the block;
//   2  an image1d_buffer_t (RGBA32UI) view of that same buffer, read at the texel index.
// Scale/offset pairs follow the layout: group g of row r at r·(K/G) + g (LAYOUT 0) or g·N + r (LAYOUT 1).
//
// A kernel that includes this defines the ints q4_rows (N, the weight's rows), q4_texels (T) and
// q4_groups (K/G) before it uses TEXEL or SO_INDEX.

#ifndef PERFX_Q4_H
#define PERFX_Q4_H

#include "sum8.h"

#ifndef LAYOUT
#define LAYOUT 0
#endif

#if LAYOUT == 1
#define TEXEL_INDEX(row, t) ((size_t)(t) * q4_rows + (row))
#define SO_INDEX(row, g) ((size_t)(g) * q4_rows + (row))
#else
#define TEXEL_INDEX(row, t) ((size_t)(row) * q4_texels + (t))
#define SO_INDEX(row, g) ((size_t)(row) * q4_groups + (g))
#endif

#if READ == 1
#if LAYOUT != 0
#error "image2d row blocks (READ 1) hold rows contiguous along K (LAYOUT 0) only"
#endif
#define CODES_T __read_only image2d_t
__constant sampler_t q4_sampler = CLK_NORMALIZED_COORDS_FALSE | CLK_ADDRESS_NONE | CLK_FILTER_NEAREST;
#define TEXEL(codes, row, t) read_imageui(codes, q4_sampler, (int2)((t), (row)))
#elif READ == 2
#define CODES_T __read_only image1d_buffer_t
#define TEXEL(codes, row, t) read_imageui(codes, (int)TEXEL_INDEX(row, t))
#else
#define CODES_T __global const uint4* restrict
#define TEXEL(codes, row, t) (codes)[TEXEL_INDEX(row, t)]
#endif

#define NIBBLE_SHIFTS (uint8)(0, 4, 8, 12, 16, 20, 24, 28)
// The 8 codes of one texel component as floats, in x order: 0x4B000000 | q is the float 2^23 + q (exact
// for q < 2^23), one OR and one subtraction. 8 wide on purpose: PoCL 3.0's LLVM 14 fails to select 16-wide
// integer/convert code on AVX2 x86.
#define CODES_F(bits) (as_float8((((uint8)(bits) >> NIBBLE_SHIFTS) & 0xFu) | 0x4B000000u) - 8388608.0f)
// The same codes centred, q − 8, as half (cl_khr_fp16 enabled by the caller): 0x6400 | q is the half
// 1024 + q (exact: the half ulp at 1024 is 1), minus 1032. Centred codes halve the largest product and
// let the sums of a group cancel, which keeps fp16 partial sums small.
#define CODES_H(bits) \
    (as_half8(convert_ushort8((((uint8)(bits) >> NIBBLE_SHIFTS) & 0xFu) | 0x6400u)) - (half8)(1032.0h))


#endif  // PERFX_Q4_H
