// perfx's int4 device form (perfx/ops/q4_weight.py), as every int4 kernel reads it.
//
// W (N, K): codes q ∈ [0, 15], 32 per uint4 texel (code 32t + 8c + j in component c, bits 4j..4j+3), and
// per group of G along K a scale s and an offset m, w = s·q + m. Where texel t of row r lives (LAYOUT, a
// property of the uploaded weight, chosen once at load):
//   LAYOUT 0  rows contiguous along K: texel index r·T + t (T = K/32 texels a row);
//   LAYOUT 1  interleaved: texel index t·N + r, so work-items that own neighbouring rows read neighbouring
//             16 bytes at the same t (coalesced on a GPU; one vector load for a SIMD CPU's lanes).
// How it is read (READ):
//   0  a uint4 buffer;
//   1  image2d_t row blocks (LAYOUT 0 only): x = t, y = row within the block;
//   2  an image1d_buffer_t (RGBA32UI) view of that same buffer, read at the texel index.
// How a group's (s, m) is stored (Q4_SCALES, a property of the weight: where it came from, not tuned), at
// index i = SO_INDEX(r, g) of the scale_offset buffer:
//   0  one half2 (s, m) per group (4 bytes): any offset (GGUF Q4_1, Q4_K, quantize-on-load);
//   1  fp16 scales s[i], then the N·K/G zero points z (4 bits, two a byte, z[i] in the low nibble of byte
//      i/2 for even i), w = s·(q − z), m = −s·z formed in fp32 (exact: 11 by 4 significant bits), 2.5 bytes
//      (AWQ, asymmetric GPTQ);
//   2  fp16 scales only, z = 8 implied, m = −8·s (2 bytes: GGUF Q4_0, symmetric GPTQ/AWQ).
// Group g of row r is at i = r·(K/G) + g (LAYOUT 0) or g·N + r (LAYOUT 1), for the scales and the zeros.
//
// A kernel that includes this defines the ints q4_rows (N, the weight's rows), q4_texels (T) and
// q4_groups (K/G) before it uses TEXEL, SO_INDEX or GROUP_SM.

#ifndef PERFX_Q4_H
#define PERFX_Q4_H

#include "sum8.h"

#ifndef LAYOUT
#define LAYOUT 0
#endif

#ifndef Q4_SCALES
#define Q4_SCALES 0  // how (s, m) is stored: half2 pairs (0), fp16 s + 4-bit zero (1), fp16 s, zero 8 (2)
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

// The (s, m) of group g of row r as a float2, from the weight's scale_offset buffer `so`.
#if Q4_SCALES == 1
inline float2 q4_scale_zero(__global const half* so, const size_t i, const size_t groups)
{
    const float s = vload_half(i, so);
    const uint z = (((__global const uchar*)(so + groups))[i >> 1] >> (((uint)i & 1u) << 2)) & 0xFu;
    return (float2)(s, -s * (float)z);
}
#define GROUP_SM(so, r, g) q4_scale_zero(so, SO_INDEX(r, g), (size_t)q4_rows * q4_groups)
#elif Q4_SCALES == 2
inline float2 q4_scale_only(__global const half* so, const size_t i)
{
    const float s = vload_half(i, so);
    return (float2)(s, -8.0f * s);
}
#define GROUP_SM(so, r, g) q4_scale_only(so, SO_INDEX(r, g))
#else
#define GROUP_SM(so, r, g) vload_half2(SO_INDEX(r, g), so)
#endif

#define NIBBLE_SHIFTS (uint8)(0, 4, 8, 12, 16, 20, 24, 28)
// The 8 codes of one texel component as floats, in x order: 0x4B000000 | q is the float 2^23 + q (exact
// for q < 2^23), one OR and one subtraction. 8 wide on purpose: some CPU compilers fail to select 16-wide
// integer/convert code.
#define CODES_F(bits) (as_float8((((uint8)(bits) >> NIBBLE_SHIFTS) & 0xFu) | 0x4B000000u) - 8388608.0f)
// The same codes centred, q − 8, as half (cl_khr_fp16 enabled by the caller): 0x6400 | q is the half
// 1024 + q (exact: the half ulp at 1024 is 1), minus 1032. Centred codes halve the largest product and
// let the sums of a group cancel, which keeps fp16 partial sums small.
#define CODES_H(bits) \
    (as_half8(convert_ushort8((((uint8)(bits) >> NIBBLE_SHIFTS) & 0xFu) | 0x6400u)) - (half8)(1032.0h))


#endif  // PERFX_Q4_H
