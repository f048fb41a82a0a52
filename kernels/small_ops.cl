// The small operations of a forward pass, each memory-bound and cheap:
//
//   embedding_f16:  out (M, K) float = table[ids]·scale for an fp16 table (N, K) split by rows over several
//                   buffers; one launch per row block [row_start, row_stop), each copying the rows
//                   whose id falls in its block. An id outside [0, N) gives a row of NaN (written by
//                   the launch of the first block), never a silent wrong row.
//                   Launch: global = (ceil(ceil(K / VW1) / WGS1) · WGS1, M), local = (WGS1, 1).
//   embedding_q4:   out (M, K) float = W[ids]·scale dequantized, w = s·q + m, from the int4 codes buffer in
//                   the weight's LAYOUT (kernels/q4.h): code 32t + 8c + j in component c, bits 4j..4j+3
//                   of texel t; (s, m) per group of G (Q4_SCALES). K multiple of 32, G in {32, 64, 128}: a
//                   texel never straddles two groups. Bad ids give NaN. The same buffer a tied lm_head's
//                   GEMV reads: the table is on the device once.
//                   Launch: global = (ceil((K / 32) / WGS2) · WGS2, M), local = (WGS2, 1).
//                   Both gathers multiply each row by scale in fp32 (1 for most models; Gemma's √hidden, as
//                   llama.cpp's ggml_scale after its get_rows).
//   argmax_partial, argmax_final:
//                   the index of the largest of x (n floats) as one int, ties to the lowest index and
//                   NaN counting as the largest (numpy.argmax). Stage 1: GROUPS3 work-groups of WGS3
//                   each reduce a grid-strided share to one (value, index); stage 2: one work-group of
//                   WGS3 reduces the GROUPS3 pairs. Launch: global = GROUPS3 · WGS3 then WGS3.
//                   The work-group step: a local-memory tree (SG3 0), or (SG3 1) one 64-bit key per pair
//                   that orders like "beats" (value bits made monotonic, NaN largest, then the index
//                   inverted so the lower one wins a tie) and sub_group_reduce_max over it, the subgroups'
//                   winners then compared through local memory (one barrier).
//   swiglu, geglu, sigmoid_mul:
//                   out = SiLU(gate)·up, GELU(gate)·up (GELU's tanh form, kernels/epilogue.h) or σ(gate)·up
//                   (Qwen3.5's gated attention output) over count floats (M rows flat); out may be gate or
//                   up (each work-item reads its elements before writing them).
//   softcap:        x = cap·tanh(x / cap) in place over count floats (Gemma 2's final-logit soft-capping).
//                   Launch of these four: global = ceil(ceil(count / VW4) / WGS4) · WGS4, local = WGS4.
//
// All arithmetic in fp32; fp16 is only read (vload_half, core OpenCL: no cl_khr_fp16 needed).

#ifndef WGS1
#define WGS1 64  // embedding_f16: work-items per work-group
#endif
#ifndef VW1
#define VW1 8  // embedding_f16: halves per work-item, 4 or 8
#endif
#ifndef WGS2
#define WGS2 64  // embedding_q4: work-items (texels of 32 codes) per work-group
#endif
#ifndef LAYOUT
#define LAYOUT 0  // embedding_q4: the table's layout (kernels/q4.h), set from the weight
#endif
#ifndef WGS3
#define WGS3 128  // argmax: work-items per work-group, both stages (a power of two)
#endif
#ifndef GROUPS3
#define GROUPS3 64  // argmax: work-groups of stage 1 = (value, index) pairs reduced by stage 2
#endif
#ifndef VW3
#define VW3 4  // argmax: floats per load, 1 or 4
#endif
#ifndef SG3
#define SG3 0  // argmax: work-group reduction by a local-memory tree (0) or subgroup reductions (1)
#endif
#ifndef WGS4
#define WGS4 64  // swiglu, geglu, sigmoid_mul, softcap: work-items per work-group
#endif
#ifndef VW4
#define VW4 4  // swiglu, geglu, sigmoid_mul, softcap: floats per work-item, 1, 4 or 8
#endif

#include "epilogue.h"

// ---------------------------------------------------------------------------------------------
// Embeddings

#if VW1 == 8
#define LOAD_HALF1(i, p) vload_half8(i, p)
#define STORE1(v, i, p) vstore8(v, i, p)
#elif VW1 == 4
#define LOAD_HALF1(i, p) vload_half4(i, p)
#define STORE1(v, i, p) vstore4(v, i, p)
#else
#error "VW1 must be 4 or 8"
#endif

__kernel __attribute__((reqd_work_group_size(WGS1, 1, 1)))
void embedding_f16(const int k, const int n_total, const int row_start, const int row_stop, const float scale,
                   __global const int* restrict ids, __global const half* restrict table,
                   __global float* restrict out)
{
    const int c = get_global_id(0);  // which VW1-chunk of the row
    const int m = get_global_id(1);
    const int id = ids[m];
    const bool bad = id < 0 || id >= n_total;
    if (c * VW1 >= k || (bad ? row_start != 0 : (id < row_start || id >= row_stop))) {
        return;
    }
    __global float* dst = out + (size_t)m * k;
    if (bad) {
        for (int i = c * VW1; i < min(k, (c + 1) * VW1); ++i) {
            dst[i] = NAN;
        }
        return;
    }
    // vload_halfN and vstoreN need only element alignment, so any K works; the last chunk may be short.
    __global const half* src = table + (size_t)(id - row_start) * k;
    if ((c + 1) * VW1 <= k) {
        STORE1(LOAD_HALF1(0, src + c * VW1) * scale, 0, dst + c * VW1);
    } else {
        for (int i = c * VW1; i < k; ++i) {
            dst[i] = vload_half(i, src) * scale;
        }
    }
}

#include "q4.h"

__kernel __attribute__((reqd_work_group_size(WGS2, 1, 1)))
void embedding_q4(const int k, const int n_total, const int group, const float scale,
                  __global const int* restrict ids, __global const uint4* restrict codes,
                  __global const half* restrict scale_offset, __global float* restrict out)
{
    const int t = get_global_id(0);  // which texel (32 codes) of the row
    const int m = get_global_id(1);
    const int texels = k / 32;
    const int q4_rows = n_total, q4_texels = texels, q4_groups = k / group;  // kernels/q4.h
    if (t >= texels) {
        return;
    }
    const int id = ids[m];
    __global float* dst = out + (size_t)m * k + 32 * t;
    if (id < 0 || id >= n_total) {
        for (int i = 0; i < 32; ++i) {
            dst[i] = NAN;
        }
        return;
    }
    const uint4 texel = codes[TEXEL_INDEX(id, t)];
    const float2 sm = GROUP_SM(scale_offset, id, 32 * t / group);
    const uint words[4] = {texel.s0, texel.s1, texel.s2, texel.s3};
    for (int c = 0; c < 4; ++c) {
        const uint word = words[c];
        const float8 q = (float8)((float)(word & 0xF), (float)((word >> 4) & 0xF), (float)((word >> 8) & 0xF),
                                  (float)((word >> 12) & 0xF), (float)((word >> 16) & 0xF),
                                  (float)((word >> 20) & 0xF), (float)((word >> 24) & 0xF),
                                  (float)(word >> 28));
        vstore8(fma(q, (float8)(sm.x), (float8)(sm.y)) * scale, c, dst);
    }
}

// ---------------------------------------------------------------------------------------------
// Argmax

// Does (a, ia) win over (b, ib)? numpy.argmax: the first NaN, else the largest, ties to the lowest index.
bool beats(const float a, const int ia, const float b, const int ib)
{
    if (isnan(a)) {
        return !isnan(b) || ia < ib;
    }
    if (isnan(b)) {
        return false;
    }
    return a > b || (a == b && ia < ib);
}

#define USES_SUBGROUPS SG3
#include "gpu.h"

#if SG3
// A key that orders (value, index) pairs as "beats" does: the float's bits made monotonic (NaN above
// everything), then the index inverted, so the larger key is the larger value, ties to the lower index.
ulong pair_key(const float value, const int index)
{
    const uint bits = as_uint(value);
    const uint ordered = isnan(value) ? 0xFFFFFFFFu : (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((ulong)ordered << 32) | (ulong)(~(uint)index);
}

// The winner of the work-group's pairs, in slot 0, by subgroup reductions of their keys.
void reduce_pairs(float best, int index, __local float* values, __local int* indices, __local ulong* keys)
{
    const ulong key = sub_group_reduce_max(pair_key(best, index));
    if (get_sub_group_local_id() == 0) {
        keys[get_sub_group_id()] = key;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (get_local_id(0) == 0) {
        ulong top = keys[0];
        for (uint s = 1; s < get_num_sub_groups(); ++s) {
            top = max(top, keys[s]);
        }
        const uint ordered = (uint)(top >> 32);
        const uint bits = ordered == 0xFFFFFFFFu ? 0x7FC00000u
                          : (ordered & 0x80000000u) ? (ordered & 0x7FFFFFFFu) : ~ordered;
        values[0] = as_float(bits);
        indices[0] = (int)~(uint)top;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}
#else
// Tree over the work-group's pairs; the winner ends in slot 0.
void reduce_pairs(float best, int index, __local float* values, __local int* indices, __local ulong* keys)
{
    const int lid = get_local_id(0);
    values[lid] = best;
    indices[lid] = index;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = WGS3 / 2; stride > 0; stride >>= 1) {
        if (lid < stride && beats(values[lid + stride], indices[lid + stride], values[lid], indices[lid])) {
            values[lid] = values[lid + stride];
            indices[lid] = indices[lid + stride];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
}
#endif

#if VW3 == 4
#define LOAD3(i, p) vload4(i, p)
typedef float4 floatVW3;
#elif VW3 == 1
#define LOAD3(i, p) ((p)[i])
typedef float floatVW3;
#else
#error "VW3 must be 1 or 4"
#endif

__kernel __attribute__((reqd_work_group_size(WGS3, 1, 1)))
void argmax_partial(const int n, __global const float* restrict x, __global float* restrict partial_values,
                    __global int* restrict partial_indices)
{
    __local float values[WGS3];
    __local int indices[WGS3];
    __local ulong keys[SG3 ? WGS3 : 1];  // the subgroups' keys (SG3 1)
    // An empty slot: −inf at an index past every real one, so any element (even −inf itself) beats it.
    float best = -INFINITY;
    int index = INT_MAX;
    const int chunks = n / VW3;
    for (int c = get_global_id(0); c < chunks; c += get_global_size(0)) {
        const floatVW3 v = LOAD3(c, x);
#if VW3 == 4
        const float lane_values[4] = {v.s0, v.s1, v.s2, v.s3};
        for (int j = 0; j < 4; ++j) {
            if (beats(lane_values[j], 4 * c + j, best, index)) {
                best = lane_values[j];
                index = 4 * c + j;
            }
        }
#else
        if (beats(v, c, best, index)) {
            best = v;
            index = c;
        }
#endif
    }
    for (int i = chunks * VW3 + get_global_id(0); i < n; i += get_global_size(0)) {
        if (beats(x[i], i, best, index)) {
            best = x[i];
            index = i;
        }
    }
    reduce_pairs(best, index, values, indices, keys);
    if (get_local_id(0) == 0) {
        partial_values[get_group_id(0)] = values[0];
        partial_indices[get_group_id(0)] = indices[0];
    }
}

__kernel __attribute__((reqd_work_group_size(WGS3, 1, 1)))
void argmax_final(__global const float* restrict partial_values, __global const int* restrict partial_indices,
                  __global int* restrict out)
{
    __local float values[WGS3];
    __local int indices[WGS3];
    __local ulong keys[SG3 ? WGS3 : 1];
    float best = -INFINITY;
    int index = INT_MAX;
    for (int p = get_local_id(0); p < GROUPS3; p += WGS3) {
        if (beats(partial_values[p], partial_indices[p], best, index)) {
            best = partial_values[p];
            index = partial_indices[p];
        }
    }
    reduce_pairs(best, index, values, indices, keys);
    if (get_local_id(0) == 0) {
        out[0] = indices[0];
    }
}

// ---------------------------------------------------------------------------------------------
// Elementwise: the gated activations of an unfused MLP, and the logits' soft cap

#if VW4 == 8
typedef float8 floatVW4;
#define LOAD4(i, p) vload8(i, p)
#define STORE4(v, i, p) vstore8(v, i, p)
#elif VW4 == 4
typedef float4 floatVW4;
#define LOAD4(i, p) vload4(i, p)
#define STORE4(v, i, p) vstore4(v, i, p)
#elif VW4 == 1
typedef float floatVW4;
#define LOAD4(i, p) ((p)[i])
#define STORE4(v, i, p) ((p)[i] = (v))
#else
#error "VW4 must be 1, 4 or 8"
#endif

// out = ACT(gate)·up, VW4 floats per work-item and the last count mod VW4 one by one.
#define GATED_BODY(ACT)                                            \
    const int c = get_global_id(0);                                \
    if ((c + 1) * VW4 <= count) {                                  \
        const floatVW4 g = LOAD4(c, gate);                         \
        STORE4(ACT(g) * LOAD4(c, up), c, out);                     \
    } else {                                                       \
        for (int i = c * VW4; i < count; ++i) {                    \
            const float g = gate[i];                               \
            out[i] = ACT(g) * up[i];                               \
        }                                                          \
    }

__kernel __attribute__((reqd_work_group_size(WGS4, 1, 1)))
void swiglu(const int count, __global const float* gate, __global const float* up, __global float* out)
{
    GATED_BODY(SILU)
}

__kernel __attribute__((reqd_work_group_size(WGS4, 1, 1)))
void geglu(const int count, __global const float* gate, __global const float* up, __global float* out)
{
    GATED_BODY(GELU_TANH)
}

// σ(v) = 1 / (1 + e^−v): for v ≪ 0, e^−v overflows to +inf and σ is +0, its limit.
#define SIGMOID(v) (1.0f / (1.0f + exp(-(v))))

// Qwen3.5's gated attention: the attention output (up) times σ(gate), the gate projected from the layer input.
__kernel __attribute__((reqd_work_group_size(WGS4, 1, 1)))
void sigmoid_mul(const int count, __global const float* gate, __global const float* up, __global float* out)
{
    GATED_BODY(SIGMOID)
}

__kernel __attribute__((reqd_work_group_size(WGS4, 1, 1)))
void softcap(const int count, const float cap, __global float* restrict x)
{
    const int c = get_global_id(0);
    if ((c + 1) * VW4 <= count) {
        STORE4(tanh(LOAD4(c, x) / cap) * cap, c, x);
    } else {
        for (int i = c * VW4; i < count; ++i) {
            x[i] = tanh(x[i] / cap) * cap;
        }
    }
}
