// out (M, K) float = W[ids]·scale dequantized, w = s·q + m, from an int8 table in perfx's int8 device form
// (perfx/ops/q8_weight.py): int8 codes (rows, K) row-major per row block, per group of G ∈ {16, 32} along
// K an (s, m) pair or (SYM 1) s alone, half (SM_F32 0) or float (SM_F32 1): kernels/q8.h. The table (a
// tied embedding is the lm_head itself) may be split by rows over several blocks: one launch per block
// [row_start, row_stop), each writing the rows whose id falls in it. An id outside [0, n_total) gives a row of NaN (written
// by the launch of the first block), never a silent wrong row.
//
// s·q is exact in fp32 (an fp16 s times an 8-bit code, or a float32 s of ≤ 18 significant bits times a
// code of ≤ 6 bits), so each weight is rounded once, by the add of m (not at all under SYM), and once more by scale (1 for most
// models; Gemma's √hidden, as llama.cpp's ggml_scale after its get_rows), in fp32.
// Shape contract: K a multiple of G (and so of 8). Launch: global = (⌈(K / 8) / WGS⌉ · WGS, M), local = (WGS, 1).

#ifndef WGS
#define WGS 64  // work-items per work-group, 8 weights each
#endif

#include "q8.h"

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void embedding_q8(const int k, const int n_total, const int row_start, const int row_stop, const float scale,
                  __global const int* restrict ids, __global const char* restrict codes, SM_T scales,
                  __global float* restrict out)
{
    const int c = get_global_id(0);  // which chunk of 8 weights of the row
    const int m = get_global_id(1);
    if (8 * c >= k) {
        return;
    }
    const int id = ids[m];
    const bool bad = id < 0 || id >= n_total;
    if (bad ? row_start != 0 : (id < row_start || id >= row_stop)) {
        return;
    }
    __global float* dst = out + (size_t)m * k;
    if (bad) {
        vstore8((float8)(NAN), c, dst);
        return;
    }
    const size_t row = (size_t)(id - row_start);
    const float2 sm = LOAD_SM(scales, row * (k / GROUP) + (8 * c) / GROUP);
    // chunks of 8 codes are 8-byte aligned (rows of K bytes, K a multiple of 16)
    vstore8(DEQUANT(convert_float8(((const __global char8*)(codes + row * k))[c]), sm) * scale, c, dst);
}
