// Routed-expert GEMVs of a mixture-of-experts FFN: each row's chosen experts (ids written on the device by
// moe_router.cl's router_topk) are read, and no other expert's bytes (llama.cpp's build_moe_ffn, the
// ggml_mul_mat_id products).
//
//   moe_gate_up:  h[r][j][n] = glu(G_e[n]·x[r] + bg, U_e[n]·x[r] + bu),  e = ids[r][j],  n < I
//                 the expert's (2·I, K) matrix holds gate rows, then up rows; glu: ACT 1 SiLU(g)·u, 2 GELU(g)·u
//                 (tanh), 3 gpt-oss's clamped SwiGLU (swiglu_oai.h)
//   moe_down:     y[r][n] (+)= Σ_j weights[r][j] · (D_e[n]·h[r][j] + bd),  e = ids[r][j],  n < N
//                 the weighted sum of the chosen experts in the same work-group: no combine launch
// BIAS 1 (gpt-oss): bias (E, rows) float holds each expert's bias of each of its rows (bg, bu; bd); else unread.
//
// Weights: every expert's matrix of one role stacked, (E, rows, K), in the int4 (BITS 4: two codes a byte, the
// even k in the low nibble) or int8 (BITS 8) form, per group of GROUP along K a float32 (scale, offset) pair,
// w = s·q + m, or with SYM 1 the scale alone (int4: m = −8·s, GGUF Q4_0; int8: m = 0, GGUF Q8_0); with HALF 1 those
// are fp16 (the file's own: Q4_0, Q4_1, Q8_0 hold them so), so a chosen expert costs the file's bytes.
// MXFP4 1 (gpt-oss's experts, as the file holds them: 4.25 bits a weight): codes are e2m1 nibbles two a byte (the
// even k low), scales one E8M0 byte e a group of 32 (a plain uchar array beside the codes, not the file's 17-byte
// blocks: adjacent work-items read adjacent groups, so both arrays stream coalesced and the codes stay 4-byte
// aligned for uint loads); w = 2^(e − 128)·v, v the doubled e2m1 value of the nibble (mxfp4.h: integers, so
// v·x is one rounding as the file's dequantized weight times x, and the group's sum is scaled once, exactly).
// Shapes: x (m, K), h (m, used, I), y (m, N) float; ids, weights (m, used); K a multiple of GROUP.
// Grid: (⌈rows/ROWS⌉·WGS, used (gate_up) or 1 (down), m); each work-group ROWS output rows of one row r (and
// one chosen expert for gate_up); its WGS work-items take whole groups along K in turn (adjacent work-items
// read adjacent groups: coalesced), then one tree sum in local memory. A prompt runs the same kernels with m
// rows, each row through its own experts.

#ifndef WGS
#define WGS 64       // work-items per work-group
#endif
#ifndef ROWS
#define ROWS 1       // output rows per work-group
#endif
#ifndef BITS
#define BITS 4       // the weights' form: 4 or 8 (set from the weights, not tuned)
#endif
#ifndef GROUP
#define GROUP 32     // weights per (scale, offset) along K (set from the weights, not tuned)
#endif
#ifndef SYM
#define SYM 0        // 1: scales alone (set from the weights, not tuned)
#endif
#ifndef HALF
#define HALF 1       // 1: fp16 scales (and offsets), 0: float32 (set from the weights, not tuned)
#endif
#ifndef MXFP4
#define MXFP4 0      // 1: MXFP4 weights, BITS 4 GROUP 32 (set from the weights, not tuned)
#endif
#ifndef ACT
#define ACT 1        // moe_gate_up's gated activation: 1 SiLU, 2 GELU (tanh), 3 clamped SwiGLU (from the model)
#endif
#ifndef BIAS
#define BIAS 0       // 1: each expert's rows have a bias (set from the model, not tuned)
#endif
#if BIAS
#define ROW_BIAS(row) bias[(row)]
#else
#define ROW_BIAS(row) 0.0f
#endif

#include "epilogue.h"
#include "swiglu_oai.h"
#include "mxfp4.h"

#if BITS == 4
#define ROW_BYTES(k) ((size_t)(k) / 2)
#else
#define ROW_BYTES(k) ((size_t)(k))
#endif

// w_row · x over group g of a row: s·Σ q·x + m·Σ x
inline float group_dot(const __global uchar* restrict codes, const __global float* restrict scales,
                       const __global float* restrict x, const size_t row, const int k, const int g)
{
    const __global float* xg = x + (size_t)g * GROUP;
    float acc = 0.0f, sx = 0.0f;
#if MXFP4
    const __global uint* w = (const __global uint*)(codes + row * ROW_BYTES(k) + (size_t)g * (GROUP / 2));
    for (int i = 0; i < GROUP / 8; ++i) {
        const uint v = w[i];
        const float4 a = vload4(0, xg + 8 * i), b = vload4(1, xg + 8 * i);
        acc += E2M1(v) * a.s0 + E2M1(v >> 4) * a.s1 + E2M1(v >> 8) * a.s2 + E2M1(v >> 12) * a.s3
             + E2M1(v >> 16) * b.s0 + E2M1(v >> 20) * b.s1 + E2M1(v >> 24) * b.s2 + E2M1(v >> 28) * b.s3;
    }
    return E8M0_HALF(((const __global uchar*)scales)[row * (size_t)(k / GROUP) + g]) * acc;
#elif BITS == 4
    const __global uint* w = (const __global uint*)(codes + row * ROW_BYTES(k) + (size_t)g * (GROUP / 2));
    for (int i = 0; i < GROUP / 8; ++i) {
        const uint v = w[i];
        const float4 a = vload4(0, xg + 8 * i), b = vload4(1, xg + 8 * i);
        acc += (float)(v & 15u) * a.s0 + (float)((v >> 4) & 15u) * a.s1 + (float)((v >> 8) & 15u) * a.s2
             + (float)((v >> 12) & 15u) * a.s3 + (float)((v >> 16) & 15u) * b.s0 + (float)((v >> 20) & 15u) * b.s1
             + (float)((v >> 24) & 15u) * b.s2 + (float)(v >> 28) * b.s3;
        sx += (a.s0 + a.s1) + (a.s2 + a.s3) + (b.s0 + b.s1) + (b.s2 + b.s3);
    }
#else
    const __global char* w = (const __global char*)(codes + row * ROW_BYTES(k) + (size_t)g * GROUP);
    for (int i = 0; i < GROUP / 4; ++i) {
        const float4 q = convert_float4(vload4(i, w));
        const float4 a = vload4(i, xg);
        acc += q.s0 * a.s0 + q.s1 * a.s1 + q.s2 * a.s2 + q.s3 * a.s3;
        sx += (a.s0 + a.s1) + (a.s2 + a.s3);
    }
#endif
#if !MXFP4
    const size_t at = row * (size_t)(k / GROUP) + g;
#if HALF
#define SCALE(i) vload_half((i), (const __global half*)scales)
#else
#define SCALE(i) scales[(i)]
#endif
#if SYM
    const float s = SCALE(at);
#if BITS == 4
    return s * (acc - 8.0f * sx);
#else
    return s * acc;
#endif
#else
    return SCALE(2 * at) * acc + SCALE(2 * at + 1) * sx;
#endif
#undef SCALE
#endif
}

inline float row_part(const __global uchar* restrict codes, const __global float* restrict scales,
                      const __global float* restrict x, const size_t row, const int k, const int lid)
{
    float acc = 0.0f;
    for (int g = lid; g < k / GROUP; g += WGS) acc += group_dot(codes, scales, x, row, k, g);
    return acc;
}

// Sums part[i][0 .. WGS) into part[i][0] for each of the first `count` rows of WGS.
inline void tree_sum(__local float* part, const int count, const int lid)
{
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int span = WGS / 2; span > 0; span >>= 1) {
        if (lid < span)
            for (int i = 0; i < count; ++i) part[i * WGS + lid] += part[i * WGS + lid + span];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
}

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void moe_gate_up(const int inter, const int k, const int used, const int n_experts, __global const int* restrict ids,
                 __global const float* restrict x, __global const uchar* restrict codes,
                 __global const float* restrict scales, __global const float* restrict bias,
                 __global float* restrict h)
{
    const int lid = get_local_id(0), j = get_global_id(1), r = get_global_id(2);
    const int first = get_group_id(0) * ROWS;
    __local float part[2 * ROWS * WGS];
    const int e = ids[(size_t)r * used + j];
    const bool valid = e >= 0 && e < n_experts;
    const __global float* xr = x + (size_t)r * k;
    for (int i = 0; i < ROWS; ++i) {
        const int n = first + i;
        float gate = 0.0f, up = 0.0f;
        if (valid && n < inter) {
            gate = row_part(codes, scales, xr, (size_t)e * 2 * inter + n, k, lid);
            up = row_part(codes, scales, xr, (size_t)e * 2 * inter + inter + n, k, lid);
        }
        part[(2 * i) * WGS + lid] = gate;
        part[(2 * i + 1) * WGS + lid] = up;
    }
    tree_sum(part, 2 * ROWS, lid);
    if (lid < ROWS && first + lid < inter && valid) {
        const size_t row = (size_t)e * 2 * inter + first + lid;
        const float gate = part[(2 * lid) * WGS] + ROW_BIAS(row), up = part[(2 * lid + 1) * WGS] + ROW_BIAS(row + inter);
#if ACT == 3
        const float out = SWIGLU_OAI(gate, up);
#elif ACT == 2
        const float out = GELU_TANH(gate) * up;
#else
        const float out = SILU(gate) * up;
#endif
        h[((size_t)r * used + j) * inter + first + lid] = out;
    } else if (lid < ROWS && first + lid < inter) {
        h[((size_t)r * used + j) * inter + first + lid] = 0.0f;   // an id out of range: no expert, nothing added
    }
}

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void moe_down(const int n_out, const int k, const int used, const int n_experts, __global const int* restrict ids,
              __global const float* restrict weights, __global const float* restrict h,
              __global const uchar* restrict codes, __global const float* restrict scales,
              __global const float* restrict bias, __global float* restrict y, const int accumulate)
{
    const int lid = get_local_id(0), r = get_global_id(2);
    const int first = get_group_id(0) * ROWS;
    __local float part[ROWS * WGS];
    float acc[ROWS];
    for (int i = 0; i < ROWS; ++i) acc[i] = 0.0f;
    for (int j = 0; j < used; ++j) {
        const int e = ids[(size_t)r * used + j];
        if (e < 0 || e >= n_experts) continue;
        const float w = weights[(size_t)r * used + j];
        const __global float* hr = h + ((size_t)r * used + j) * k;
        for (int i = 0; i < ROWS; ++i)
            if (first + i < n_out) {
                // the bias once a row of the expert: by the first work-item, whose part the tree sum adds in
                const size_t row = (size_t)e * n_out + first + i;
                acc[i] += w * (row_part(codes, scales, hr, row, k, lid) + (lid == 0 ? ROW_BIAS(row) : 0.0f));
            }
    }
    for (int i = 0; i < ROWS; ++i) part[i * WGS + lid] = acc[i];
    tree_sum(part, ROWS, lid);
    if (lid < ROWS && first + lid < n_out) {
        const size_t at = (size_t)r * n_out + first + lid;
        y[at] = (accumulate ? y[at] : 0.0f) + part[lid * WGS];
    }
}
