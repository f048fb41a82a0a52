// Routed-expert products of a prompt, its rows grouped by expert on the device (llama.cpp's mul_mat_id for
// batches: each expert's weights read once a tile of its rows, not once a row), from the expert ids the router
// wrote (moe_router.cl), with no host round trip.
//
//   moe_group:            pairs p = r·used + j (row r's j-th chosen expert ids[p]) grouped by expert, in row
//                         order within an expert: counts[e], offsets[e] = Σ_{e' < e} counts[e'],
//                         order[offsets[e] + i] = the i-th pair of expert e. One work-group: a work-item an
//                         expert scans the pairs (a histogram, a prefix sum, a scatter; no atomics: the order
//                         is the same every run).
//   moe_gate_up_grouped:  h[p][n] = glu(G_e[n]·x[p / used] + bg, U_e[n]·x[p / used] + bu) for the pairs of expert
//                         e, TM pairs a work-group: each weight group read once for TM rows (glu as gemv_moe.cl's)
//   moe_down_grouped:     out[p][n] = weights[p] · (D_e[n]·h[p] + bd)
// BIAS 1 (gpt-oss): bias (E, rows) float, each expert's bias of each of its rows (bg, bu; bd); else unread.
//   moe_combine:          y[r][n] (+)= Σ_j out[r·used + j][n], j in order (the same sum every run)
//
// Weights as gemv_moe.cl holds them: (E, rows, K) int4 (two codes a byte, the even k low; BITS 4) or int8 codes,
// per GROUP along K (scale, offset) or the scale alone (SYM 1: int4 m = −8·s, int8 m = 0), fp16 (HALF 1) or float;
// or MXFP4 1: e2m1 nibbles (the even k low) and one E8M0 byte a group of 32, w = 2^(e − 128)·v (mxfp4.h).
// Grid of the grouped products: (⌈N/TN⌉·TN, E, ⌈m/TM⌉); a work-group whose tile lies past its expert's count
// returns at once (the counts are on the device only). Each work-item one output column n; the TM rows' x of the
// current group sit in local memory.

#ifndef TN
#define TN 64        // work-items (output columns) per work-group
#endif
#ifndef TM
#define TM 8         // rows (pairs) of one expert per work-group
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
#define ACT 1        // the gated activation: 1 SiLU, 2 GELU (tanh), 3 clamped SwiGLU (set from the model, not tuned)
#endif
#ifndef BIAS
#define BIAS 0       // 1: each expert's rows have a bias (set from the model, not tuned)
#endif
#if BIAS
#define ROW_BIAS(row) bias[(row)]
#else
#define ROW_BIAS(row) 0.0f
#endif
#ifndef MAX_E
#define MAX_E 512    // the most experts moe_group counts in local memory (perfx.config.MAX_EXPERTS)
#endif

#include "epilogue.h"
#include "swiglu_oai.h"
#include "mxfp4.h"

#if BITS == 4
#define ROW_BYTES(k) ((size_t)(k) / 2)
#else
#define ROW_BYTES(k) ((size_t)(k))
#endif
#if HALF
#define SCALE(i) vload_half((i), (const __global half*)scales)
#else
#define SCALE(i) scales[(i)]
#endif

__kernel void moe_group(const int pairs, const int n_experts, __global const int* restrict ids,
                        __global int* restrict counts, __global int* restrict offsets, __global int* restrict order)
{
    const int lid = get_local_id(0), size = get_local_size(0);
    __local int count[MAX_E], start[MAX_E];
    for (int e = lid; e < n_experts; e += size) {
        int c = 0;
        for (int p = 0; p < pairs; ++p) c += ids[p] == e;
        count[e] = c;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid == 0) {
        int running = 0;
        for (int e = 0; e < n_experts; ++e) { start[e] = running; running += count[e]; }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int e = lid; e < n_experts; e += size) {
        int c = start[e];
        for (int p = 0; p < pairs; ++p)
            if (ids[p] == e) order[c++] = p;
        counts[e] = count[e];
        offsets[e] = start[e];
    }
}

// Σ_c q[c]·xs[t][c] over one group of weight row `row`, for the TM rows of xs: into acc[t]
inline void group_products(const __global uchar* restrict codes, const __global float* restrict scales,
                           const size_t row, const int k, const int g, __local const float* xs,
                           __local const float* xsum, float* acc)
{
    float q[GROUP];
#if MXFP4
    const __global uint* w = (const __global uint*)(codes + row * ROW_BYTES(k) + (size_t)g * (GROUP / 2));
    for (int i = 0; i < GROUP / 8; ++i) {
        const uint v = w[i];
        for (int c = 0; c < 8; ++c) q[8 * i + c] = E2M1(v >> (4 * c));
    }
#elif BITS == 4
    const __global uint* w = (const __global uint*)(codes + row * ROW_BYTES(k) + (size_t)g * (GROUP / 2));
    for (int i = 0; i < GROUP / 8; ++i) {
        const uint v = w[i];
        for (int c = 0; c < 8; ++c) q[8 * i + c] = (float)((v >> (4 * c)) & 15u);
    }
#else
    const __global char* w = (const __global char*)(codes + row * ROW_BYTES(k) + (size_t)g * GROUP);
    for (int i = 0; i < GROUP / 4; ++i) {
        const float4 v = convert_float4(vload4(i, w));
        q[4 * i] = v.s0; q[4 * i + 1] = v.s1; q[4 * i + 2] = v.s2; q[4 * i + 3] = v.s3;
    }
#endif
    const size_t at = row * (size_t)(k / GROUP) + g;
#if MXFP4
    const float s = E8M0_HALF(((const __global uchar*)scales)[at]), m = 0.0f;
#elif SYM
    const float s = SCALE(at);
#if BITS == 4
    const float m = -8.0f * s;
#else
    const float m = 0.0f;
#endif
#else
    const float s = SCALE(2 * at), m = SCALE(2 * at + 1);
#endif
    for (int t = 0; t < TM; ++t) {
        float dot = 0.0f;
        for (int c = 0; c < GROUP; ++c) dot = fma(q[c], xs[t * GROUP + c], dot);
        acc[t] += s * dot + m * xsum[t];
    }
}

// The TM rows' x of group g into local memory (zeros past the tile's rows), and their sums.
inline void load_rows(__local float* xs, __local float* xsum, const __global float* restrict x, const int k,
                      const int g, __local const int* rows, const int valid, const int lid)
{
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int i = lid; i < TM * GROUP; i += TN) {
        const int t = i / GROUP, c = i % GROUP;
        xs[i] = t < valid ? x[(size_t)rows[t] * k + (size_t)g * GROUP + c] : 0.0f;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (lid < TM) {
        float sum = 0.0f;
        for (int c = 0; c < GROUP; ++c) sum += xs[lid * GROUP + c];
        xsum[lid] = sum;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
}

__kernel __attribute__((reqd_work_group_size(TN, 1, 1)))
void moe_gate_up_grouped(const int inter, const int k, const int used, __global const int* restrict counts,
                         __global const int* restrict offsets, __global const int* restrict order,
                         __global const float* restrict x, __global const uchar* restrict codes,
                         __global const float* restrict scales, __global const float* restrict bias,
                         __global float* restrict h)
{
    const int lid = get_local_id(0), n = get_global_id(0), e = get_group_id(1);
    const int first = get_group_id(2) * TM, count = counts[e];
    if (first >= count) return;   // the whole work-group: its expert has fewer pairs
    const int valid = min(TM, count - first);
    __local float xs[TM * GROUP], xsum[TM];
    __local int pair[TM], rows[TM];
    if (lid < TM) {
        const int p = lid < valid ? order[offsets[e] + first + lid] : 0;
        pair[lid] = p;
        rows[lid] = p / used;
    }
    float gate[TM], up[TM];
    for (int t = 0; t < TM; ++t) gate[t] = up[t] = 0.0f;
    for (int g = 0; g < k / GROUP; ++g) {
        load_rows(xs, xsum, x, k, g, rows, valid, lid);
        if (n < inter) {
            group_products(codes, scales, (size_t)e * 2 * inter + n, k, g, xs, xsum, gate);
            group_products(codes, scales, (size_t)e * 2 * inter + inter + n, k, g, xs, xsum, up);
        }
    }
    if (n < inter) {
        const size_t row = (size_t)e * 2 * inter + n;
        const float bg = ROW_BIAS(row), bu = ROW_BIAS(row + inter);
        for (int t = 0; t < valid; ++t) {
#if ACT == 3
            h[(size_t)pair[t] * inter + n] = SWIGLU_OAI(gate[t] + bg, up[t] + bu);
#elif ACT == 2
            h[(size_t)pair[t] * inter + n] = GELU_TANH(gate[t] + bg) * (up[t] + bu);
#else
            h[(size_t)pair[t] * inter + n] = SILU(gate[t] + bg) * (up[t] + bu);
#endif
        }
    }
}

__kernel __attribute__((reqd_work_group_size(TN, 1, 1)))
void moe_down_grouped(const int n_out, const int k, __global const int* restrict counts,
                      __global const int* restrict offsets, __global const int* restrict order,
                      __global const float* restrict weights, __global const float* restrict h,
                      __global const uchar* restrict codes, __global const float* restrict scales,
                      __global const float* restrict bias, __global float* restrict out)
{
    const int lid = get_local_id(0), n = get_global_id(0), e = get_group_id(1);
    const int first = get_group_id(2) * TM, count = counts[e];
    if (first >= count) return;
    const int valid = min(TM, count - first);
    __local float xs[TM * GROUP], xsum[TM];
    __local int pair[TM];
    if (lid < TM) pair[lid] = lid < valid ? order[offsets[e] + first + lid] : 0;
    float acc[TM];
    for (int t = 0; t < TM; ++t) acc[t] = 0.0f;
    for (int g = 0; g < k / GROUP; ++g) {
        load_rows(xs, xsum, h, k, g, pair, valid, lid);
        if (n < n_out) group_products(codes, scales, (size_t)e * n_out + n, k, g, xs, xsum, acc);
    }
    if (n < n_out) {
        const float bd = ROW_BIAS((size_t)e * n_out + n);
        for (int t = 0; t < valid; ++t) out[(size_t)pair[t] * n_out + n] = weights[pair[t]] * (acc[t] + bd);
    }
}

__kernel void moe_combine(const int n_out, const int used, __global const float* restrict out,
                          __global float* restrict y, const int accumulate)
{
    const int n = get_global_id(0), r = get_global_id(1);
    if (n >= n_out) return;
    float sum = accumulate ? y[(size_t)r * n_out + n] : 0.0f;
    for (int j = 0; j < used; ++j) sum += out[((size_t)r * used + j) * n_out + n];
    y[(size_t)r * n_out + n] = sum;
}
