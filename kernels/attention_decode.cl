// Decode attention for one new token at position p of one layer (Llama family: rotate-half RoPE,
// grouped-query attention), flash-decoding style, in one launch:
//   attention_partial:  q' = rope(norm(q), p), k' = rope(norm(k), p) (attention.h: norm with QK_NORM only,
//                       partial rotary, NoPE);  keys[layer][g][p] = half(k'), values[layer][g][p] = half(v);
//                       per (query head h, partition j of PART positions):
//                       m_j = max_t s_t,  l_j = Σ_t e^(s_t − m_j),  o_j = Σ_t e^(s_t − m_j)·V[t],
//                       s_t = cap(scale·q'_h·K[t]) over the positions t ≤ p of partition j (scale a launch
//                       argument, 1/√D for Llama; cap the soft-cap of attention.h, or none)
//   the combine, by the last work-group of a head group to finish (a counter per kv head and group of HEADS
//   query heads in global memory):
//                       out[h] = Σ_j e^(m_j − M)·o_j / Σ_j e^(m_j − M)·l_j for the HEADS heads h of the group,
//                       M a running max over the partitions (online softmax), j in order (deterministic)
// When p < PART there is one partition and it writes out[h] = o_0 / l_0 itself.
// SINKS 1 (gpt-oss): sinks[h], a learned logit of head h, joins each softmax's denominator with no value:
// out[h] = Σ_j e^(m_j − M)·o_j / (Σ_j e^(m_j − M)·l_j + e^(sinks[h] − M)), M the max of the m_j and sinks[h] (the
// online softmax started from the sink: m = sinks[h], l = 1, o = 0).
// The combine inside the launch saves a launch a layer (and its host enqueue), not device work: every
// work-group writes its partials, makes them visible (a global fence before the counter's atomic increment),
// and the one that takes the counter to n_parts reads them back and resets the counter for the next launch.
// The partials cross work-groups as atomic stores and loads (SHARED_STORE, SHARED_LOAD): coherent past a GPU's
// non-coherent first-level caches, and a hand-off a race checker (Oclgrind) sees as synchronised; they are
// few (H × partitions × (D + 2) floats). counters (Hkv·GQA/HEADS int, one per grid row of dimension 1) start
// at 0 (the wrapper zeroes them once).
// Q8_OUT 1: the work-group that writes out (the only one with one partition, else the combining one) also
// writes its heads as Q8_1 blocks of 32 (out_codes, out_step_sum), the int8 activations of the o projection.
// A sliding window W > 0 (Mistral; 0 = off) bounds the positions attended to t ≥ p − W + 1: earlier ones
// get weight 0 and are not read; a partition left with none reports m = −inf, l = 0 and the combine skips it.
// W is a launch argument, so one build serves layers of different windows (Gemma 2 and 3).
// p is read from positions[pos_index] on the device (the decode step's token and position travel in one
// upload), so a launch recorded once serves every p of its ⌈(p+1)/PART⌉ partitions: the grid changes every
// PART positions, the arguments never.
// Shapes: qkv float [q (H·D) | k (Hkv·D) | v (Hkv·D)] from element qkv_offset (the fused QKV GEMV);
// out (H·D) float; keys / values half [layer][kv_head][pos][D] (perfx/ops/kv_cache.py), positions < p
// already there, or with KV_Q8 int8 codes in that layout and key_scales / value_scales half
// [layer][kv_head][pos][D/32] (attention.h); cos / sin (max_positions, n_rot/2) float; q_norm / k_norm (D)
// float (QK_NORM).
// Gemma 4: V_NORM RMS-normalises v per head (no weight) before the cache; Q_ONLY reads rows of q alone (a layer
// that shares an earlier layer's cache: nothing appended, row p read from the cache like the rest).
// HEADS (a divisor of GQA, the wrapper's choice) is the query heads one work-group serves: GQA/HEADS work-groups
// share a kv head and partition (grid dimension 1 is Hkv·GQA/HEADS), each reading its K/V rows, so that local
// memory, which grows with HEADS·D, stays within a GPU's 32 KiB at D = 512; the first of them appends.
// BATCH 8 (the rows of a batched decode step, perfx/batch.py; 1: one row, as above) serves up to 8 rows in one
// launch, each its own sequence: row r (of n_rows, a launch argument) is qkv row row0 + r (qkv_stride floats
// apart), its position positions[pos_index + row0 + r], its out row row0 + r (H·D floats apart), its KV cache
// the r-th of keys, keys1 .. keys7 (values, key_scales, value_scales alike; each sequence's cache is an
// allocation of its own, laid out alike, so one layer_offset serves all). Grid dimension 2 is n_rows × the most
// partitions of a row: row r's work-groups past its own ⌈(p+1)/PART⌉ return at once. Row r's partials are the
// r-th block of H·max_parts (m, l) and (o) rows, its counters the r-th block of Hkv·GQA/HEADS. Q8_OUT is one
// row's (the decode step's) only. Its 57 arguments take about 400 bytes: within the 1024 of
// CL_DEVICE_MAX_PARAMETER_SIZE that OpenCL's full profile guarantees (an embedded profile's 256 would refuse it).
// Query head h reads kv head h / GQA, GQA = H/Hkv. D = HEAD_DIM (even, a multiple of VW), GQA and QK_NORM
// are build defines from the model; partials are [H][max_parts] (m, l) and [H][max_parts][D] (o), float.
//
// Flash-decoding (Dao, Haziza, Massa, Sizov 2023; vLLM's paged attention v2): a long context is split
// over (kv head, partition) work-groups so it does not run on Hkv work-groups only. One work-group serves
// the GQA query heads that share its kv head, so each K/V element is read once. Work-groups of one launch
// cannot wait for each other, so none reads row p from the cache: the one work-group per kv head whose
// partition holds p (the last) writes the new k', v to the cache and uses them from local memory, rounded
// to fp16 as the cache holds them (later tokens read the same values). With KV_Q8 that work-group quantizes
// the row (one work-item per block of 32: a few blocks a row) and keeps its codes and scales, so it too
// attends to what later tokens will read; rows are dequantized as they are loaded, in fp32 (a VW vector of
// codes lies within one block, so it takes one scale). fp32 arithmetic throughout, except
// with HALF: the key rows are read as half vectors and q·k is formed in half (cl_khr_fp16) against a half
// copy of the rotated q; softmax and the weighted V sums stay fp32.

#ifndef HEAD_DIM
#define HEAD_DIM 64  // D, from the model (set by the wrapper, not tuned)
#endif

#ifndef GQA
#define GQA 1  // query heads per kv head, H / Hkv (set by the wrapper, not tuned)
#endif

#ifndef PART
#define PART 128  // positions per partition: one work-group each per kv head
#endif

#ifndef WGS
#define WGS 64  // work-items per attention_partial work-group (a power of two)
#endif

#ifndef VW
#define VW 8  // halfs per K/V load (vload_half4 / vload_half8) and floats per vector along D
#endif

#ifndef HALF
#define HALF 0  // q·k in half against half key rows (cl_khr_fp16)
#endif

#ifndef HEADS
#define HEADS GQA  // query heads per work-group, a divisor of GQA (set by the wrapper: local memory at D = 512)
#endif

#ifndef V_NORM
#define V_NORM 0  // v RMS-normed per head without a scale before the cache (Gemma 4; set by the wrapper)
#endif

#ifndef Q_ONLY
#define Q_ONLY 0  // qkv rows hold q alone: the layer reads another layer's cache, row p included (Gemma 4)
#endif

#ifndef SINKS
#define SINKS 0  // a learned logit per query head in the softmax's denominator (gpt-oss; set by the wrapper)
#endif

#ifndef Q8_OUT
#define Q8_OUT 0  // also write out as Q8_1 blocks of 32, for the o projection's int8 activations (set by the caller)
#endif

#ifndef BATCH
#define BATCH 1  // rows a launch may serve: 1, or 8 (a batched decode step's; set by the wrapper, not tuned)
#endif

#if BATCH != 1 && BATCH != 8
#error "BATCH is 1 or 8"
#endif
#if BATCH > 1 && Q8_OUT
#error "Q8_OUT is one row's"
#endif

#if BATCH > 1
// row 0's cache arguments are reassigned to the row's own: not restrict (one restrict pointer may not take
// another's value in C's rules)
#define KV_RESTRICT
#define ROW_KV(i) , __global kv_t* keys##i, __global kv_t* values##i, __global half* key_scales##i,             \
                  __global half* value_scales##i
#define BATCH_ARGS , const int n_rows, const int row0, const int qkv_stride                                    \
                   ROW_KV(1) ROW_KV(2) ROW_KV(3) ROW_KV(4) ROW_KV(5) ROW_KV(6) ROW_KV(7)
#define ROW_CASE(i)                                                                                            \
    case i:                                                                                                    \
        keys = keys##i;                                                                                        \
        values = values##i;                                                                                    \
        key_scales = key_scales##i;                                                                            \
        value_scales = value_scales##i;                                                                        \
        break;
#else
#define KV_RESTRICT restrict
#define BATCH_ARGS
#endif

#include "attention.h"

#if Q8_OUT
#include "q8_1.h"
#if HEAD_DIM % 32
#error "Q8_OUT needs head_dim a multiple of 32: a block must not straddle two heads"
#endif
#define Q8_OUT_ARGS , __global char* restrict out_codes, __global float2* restrict out_step_sum
// Blocks first .. first + count − 1 of out (32 floats each) as Q8_1 blocks in the rows GEMV's order: what its
// own quantizing launch would write, so the o projection launches none.
#define QUANTIZE_OUT(first, count, id, size)                                                             \
    Q8_1_QUANTIZE(out, first, count, id, size, out_codes, out_step_sum, Q8_1_TEXEL)
#else
#define Q8_OUT_ARGS
#endif

#if HALF
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
#if VW == 8
typedef half8 halfV;
#define LOADH vload8
#define TO_HALFV convert_half8
#else
typedef half4 halfV;
#define LOADH vload4
#define TO_HALFV convert_half4
#endif
#endif

#if VW == 8
typedef float8 floatV;
#define LOADV vload8
#define STOREV vstore8
#define LOADHV vload_half8
#define TO_FLOATV convert_float8
#define HSUM(x) hsum4((x).lo + (x).hi)
#else
typedef float4 floatV;
#define LOADV vload4
#define STOREV vstore4
#define LOADHV vload_half4
#define TO_FLOATV convert_float4
#define HSUM(x) hsum4(x)
#endif

// Vector c of a K/V row as floats (LOAD_KV) and, for HALF's q·k, as halfs (LOAD_KH); scales: the row's
// KV_BLOCK scales (KV_Q8), else not read. Rows in global or local memory alike.
#if KV_Q8
#define LOAD_KV(c, row, scales) (TO_FLOATV(LOADV(c, row)) * vload_half((c) * VW / KV_BLOCK, scales))
#define LOAD_KH(c, row, scales) (TO_HALFV(LOADV(c, row)) * (half)vload_half((c) * VW / KV_BLOCK, scales))
#else
#define LOAD_KV(c, row, scales) LOADHV(c, row)
#define LOAD_KH(c, row, scales) LOADH(c, row)
#endif

#define HALF_D (HEAD_DIM / 2)
#define LANES (HEAD_DIM / VW)     // vectors per K/V row
#define ROWS (WGS / LANES)        // V rows accumulated side by side (the spec keeps WGS ≥ LANES)
#define MAXF(a, b) ((a) > (b) ? (a) : (b))
// One local buffer for the norms' sums of squares ((HEADS + 2) × WGS), then the scores (HEADS × PART), then the
// ROWS partial V sums (ROWS × HEADS × D).
#define WORK MAXF(MAXF(HEADS * PART, ROWS * HEADS * HEAD_DIM), (HEADS + 2) * WGS)
#define NORMS (QK_NORM || V_NORM)

inline float hsum4(const float4 x)
{
    return (x.s0 + x.s1) + (x.s2 + x.s3);
}

// A float that other work-groups of the launch read (SHARED_STORE), or that they wrote (SHARED_LOAD).
#define SHARED_STORE(p, i, v) atomic_xchg((volatile __global float*)(p) + (i), (v))
#define SHARED_LOAD(p, i) as_float(atomic_or((volatile __global int*)(p) + (i), 0))

// out for the HEADS query heads from qh0 on from their n_parts partials, by the work-group that combines them
// (online softmax, partitions in order).
void combine_partitions(const int qh0, const int lid, const int n_parts, const int max_parts,
                        __global float* part_max, __global float* part_sum, __global float* part_out,
                        __global float* out, __global const float* sinks)
{
    for (int e = lid; e < HEADS * HEAD_DIM; e += WGS) {
        const int query_head = qh0 + e / HEAD_DIM;
#if SINKS
        float m = sinks[query_head], l = 1.0f, acc = 0.0f;   // the sink: a logit with no value
#else
        float m = -INFINITY, l = 0.0f, acc = 0.0f;
#endif
        for (int j = 0; j < n_parts; ++j) {
            const int at = query_head * max_parts + j;
            const float m_j = SHARED_LOAD(part_max, at);
            if (m_j == -INFINITY) {
                continue;   // a partition wholly before the sliding window: nothing to add
            }
            const float m_new = fmax(m, m_j);
            const float keep = exp(m - m_new), take = exp(m_j - m_new);  // exp(−inf) = 0 on the first step
            l = l * keep + SHARED_LOAD(part_sum, at) * take;
            acc = acc * keep + SHARED_LOAD(part_out, (size_t)at * HEAD_DIM + e % HEAD_DIM) * take;
            m = m_new;
        }
        out[query_head * HEAD_DIM + e % HEAD_DIM] = acc / l;
    }
}

// global (WGS, Hkv·GQA/HEADS, ceil((p+1)/PART)), local (WGS, 1, 1): work-group (r, j) = query heads
// r·HEADS.. of kv head r / (GQA/HEADS), partition j.
__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void attention_partial(__global const float* restrict qkv, int qkv_offset,
                       __global const float* restrict cos_table, __global const float* restrict sin_table,
                       const int n_rot, __global const float* restrict q_norm,
                       __global const float* restrict k_norm, const float eps,
                       __global kv_t* KV_RESTRICT keys, __global kv_t* KV_RESTRICT values,
                       __global half* KV_RESTRICT key_scales, __global half* KV_RESTRICT value_scales,
                       const int layer_offset, const int max_positions,
                       __global const int* restrict positions, const int pos_index, const int max_parts,
                       __global float* restrict part_max, __global float* restrict part_sum,
                       __global float* restrict part_out, __global float* restrict out, const int window,
                       const float scale, const float softcap, __global const float* restrict sinks,
                       __global volatile int* restrict counters Q8_OUT_ARGS BATCH_ARGS)
{
    const int lid = get_local_id(0);
#if BATCH > 1
    // This work-group's row: its own sequence's position, cache, qkv and out rows, partials and counters.
    const int grid_parts = get_num_groups(2) / n_rows;
    const int batch_row = get_group_id(2) / grid_parts;
    const int pos = positions[pos_index + row0 + batch_row];
    const int part = get_group_id(2) % grid_parts;
    const int n_parts = pos / PART + 1;
    if (part >= n_parts) {
        return;   // a partition only a longer row has (the whole work-group leaves, before any barrier)
    }
    switch (batch_row) {
        ROW_CASE(1) ROW_CASE(2) ROW_CASE(3) ROW_CASE(4) ROW_CASE(5) ROW_CASE(6) ROW_CASE(7)
    }
    qkv_offset += (row0 + batch_row) * qkv_stride;
    out += (size_t)(row0 + batch_row) * get_num_groups(1) * HEADS * HEAD_DIM;
    part_max += (size_t)batch_row * get_num_groups(1) * HEADS * max_parts;
    part_sum += (size_t)batch_row * get_num_groups(1) * HEADS * max_parts;
    part_out += (size_t)batch_row * get_num_groups(1) * HEADS * max_parts * HEAD_DIM;
    counters += batch_row * get_num_groups(1);
#else
    const int pos = positions[pos_index];  // on the device, so a recorded launch serves every position of its grid
    const int part = get_group_id(2);
    const int n_parts = get_num_groups(2);
#endif
    const int g = get_group_id(1) / (GQA / HEADS);          // the kv head
    const int QH0 = g * GQA + get_group_id(1) % (GQA / HEADS) * HEADS;   // this work-group's first query head
    const int n_kv_heads = get_num_groups(1) / (GQA / HEADS);
    const bool writes = QH0 == g * GQA;   // the first work-group of a kv head appends k and v
    const int first = part * PART;
    const int count = min(PART, pos + 1 - first);  // ≥ 1: the wrapper launches ceil((p+1)/PART) partitions
    const bool holds_pos = part == n_parts - 1;   // this partition's last position is p
    const int lo = window > 0 ? max(0, pos - window + 1) - first : 0;  // first t of the window, in the partition

    __local float q[HEADS * HEAD_DIM];       // normalised, rotated, times scale
    __local ushort q_bits[HALF ? HEADS * HEAD_DIM : 1];  // the same as half (HALF)
    // k' then v as fp16 ("__local half x[]" needs cl_khr_fp16)
    __local ushort fresh_bits[KV_Q8 ? 1 : 2 * HEAD_DIM];
    __local float fresh_f[KV_Q8 ? 2 * HEAD_DIM : 1];      // KV_Q8: k' then v in fp32, to quantize
    __local char fresh_codes[KV_Q8 ? 2 * HEAD_DIM : 1];   // ... their codes
    __local ushort fresh_scale_bits[KV_Q8 ? 2 * HEAD_DIM / KV_BLOCK : 1];  // ... and their scales, fp16
    __local float work[WORK];
    __local float red[HEADS * WGS];
    __local float stats[2 * HEADS];          // the partition's max and sum per head
    __local int combines;                  // whether this work-group is the last of its head group to finish
#if KV_Q8
    __local kv_t* fresh = fresh_codes;
#else
    __local kv_t* fresh = (__local half*)fresh_bits;
#endif
    __local half* fresh_scales = (__local half*)fresh_scale_bits;

    const __global float* q_in = qkv + qkv_offset + QH0 * HEAD_DIM;
    const __global float* k_in = qkv + qkv_offset + (n_kv_heads * GQA + g) * HEAD_DIM;
#if NORMS
    // 1/rms of the HEADS query heads (rows 0..HEADS−1), of k (row HEADS) and of v (row HEADS + 1): strided sums
    // of squares, one tree (q's rows alone with Q_ONLY).
    __local float inv_rms[HEADS + 2];
    const int norm_rows = Q_ONLY ? HEADS : HEADS + 2;
    for (int r = 0; r < norm_rows; ++r) {
        const __global float* x = r < HEADS ? q_in + r * HEAD_DIM : k_in + (r - HEADS) * n_kv_heads * HEAD_DIM;
        float sum = 0.0f;
        for (int i = lid; i < HEAD_DIM; i += WGS) {
            sum = fma(x[i], x[i], sum);
        }
        work[r * WGS + lid] = sum;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = WGS / 2; stride > 0; stride >>= 1) {
        if (lid < stride) {
            for (int r = 0; r < norm_rows; ++r) {
                work[r * WGS + lid] += work[r * WGS + lid + stride];
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid < norm_rows) {
        inv_rms[lid] = rsqrt(work[lid * WGS] / HEAD_DIM + eps);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#endif
#if QK_NORM
#define INV_RMS(r) inv_rms[r]
#else
#define INV_RMS(r) 1.0f
#endif
#if V_NORM
#define V_SCALE inv_rms[HEADS + 1]
#else
#define V_SCALE 1.0f
#endif

    // Norm, RoPE and scale on this kv head's HEADS query heads (every partition needs them; HEADS·D elements
    // is cheap).
    const __global float* cos_p = cos_table + pos * (n_rot / 2);
    const __global float* sin_p = sin_table + pos * (n_rot / 2);
    for (int e = lid; e < HEADS * HALF_D; e += WGS) {
        const int h = e / HALF_D;
        const int2 dims = pair_dims(e % HALF_D, n_rot);
        const float2 x = rope_pair(q_in + h * HEAD_DIM, dims, INV_RMS(h), q_norm, cos_p, sin_p, n_rot) * scale;
        const int2 at = dims + h * HEAD_DIM;
        q[at.x] = x.x;
        q[at.y] = x.y;
#if HALF
        vstore_half(x.x, at.x, (__local half*)q_bits);
        vstore_half(x.y, at.y, (__local half*)q_bits);
#endif
    }
    const size_t head_base = (size_t)layer_offset + (size_t)g * max_positions * HEAD_DIM;
    const size_t pos_row = head_base + (size_t)pos * HEAD_DIM;  // row p of kv head g
#if Q_ONLY
    if (holds_pos) {
        // Row p is in the cache already (an earlier layer's launch wrote it): into local memory, as the
        // append would have kept it.
#if KV_Q8
        for (int i = lid; i < 2 * HEAD_DIM; i += WGS) {
            fresh_codes[i] = (i < HEAD_DIM ? keys : values)[pos_row + i % HEAD_DIM];
        }
        for (int b = lid; b < 2 * HEAD_DIM / KV_BLOCK; b += WGS) {
            const int in_row = b % (HEAD_DIM / KV_BLOCK);
            fresh_scale_bits[b] = ((const __global ushort*)(b < HEAD_DIM / KV_BLOCK ? key_scales : value_scales))[
                pos_row / KV_BLOCK + in_row];
        }
#else
        for (int i = lid; i < 2 * HEAD_DIM; i += WGS) {
            fresh_bits[i] = ((const __global ushort*)(i < HEAD_DIM ? keys : values))[pos_row + i % HEAD_DIM];
        }
#endif
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#else
    if (holds_pos) {
        // The only writer of row p for kv head g (its first work-group, where HEADS < GQA): norm and RoPE on
        // k, append k' and v, keep them in local memory.
        const __global float* v_in = k_in + n_kv_heads * HEAD_DIM;
        for (int i = lid; i < HALF_D; i += WGS) {
            const int2 dims = pair_dims(i, n_rot);
            const float2 k = rope_pair(k_in, dims, INV_RMS(HEADS), k_norm, cos_p, sin_p, n_rot);
#if KV_Q8
            fresh_f[dims.x] = k.x;
            fresh_f[dims.y] = k.y;
#else
            vstore_half(k.x, dims.x, fresh);
            vstore_half(k.y, dims.y, fresh);
            if (writes) {
                vstore_half(k.x, pos_row + dims.x, keys);
                vstore_half(k.y, pos_row + dims.y, keys);
            }
#endif
        }
        for (int i = lid; i < HEAD_DIM; i += WGS) {
            const float v = v_in[i] * V_SCALE;
#if KV_Q8
            fresh_f[HEAD_DIM + i] = v;
#else
            vstore_half(v, HEAD_DIM + i, fresh);
            if (writes) {
                vstore_half(v, pos_row + i, values);
            }
#endif
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#if KV_Q8
    if (holds_pos) {
        // Quantize k' (blocks 0..D/32−1) and v (the next D/32), one work-item a block.
        for (int b = lid; b < 2 * HEAD_DIM / KV_BLOCK; b += WGS) {
            const __local float* x = fresh_f + b * KV_BLOCK;
            float amax = 0.0f;
            for (int j = 0; j < KV_BLOCK; j++) {
                amax = fmax(amax, fabs(x[j]));
            }
            const float d = amax / 127.0f;
            const float inv = q8_inverse(d);
            const int in_row = b % (HEAD_DIM / KV_BLOCK);
            __global char* codes = (b < HEAD_DIM / KV_BLOCK ? keys : values) + pos_row + in_row * KV_BLOCK;
            for (int j = 0; j < KV_BLOCK; j++) {
                const char q = convert_char_sat(round(x[j] * inv));
                if (writes) {
                    codes[j] = q;
                }
                fresh_codes[b * KV_BLOCK + j] = q;
            }
            if (writes) {
                vstore_half(d, pos_row / KV_BLOCK + in_row, b < HEAD_DIM / KV_BLOCK ? key_scales : value_scales);
            }
            vstore_half(d, b, fresh_scales);
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);
#endif
#endif

    // Scores: one position per work-item at a time, all HEADS heads from one read of the key row.
    const __global kv_t* k_part = keys + head_base + (size_t)first * HEAD_DIM;
    // The partition's first row of scales (KV_Q8; never read otherwise).
    const size_t scales_part = (head_base + (size_t)first * HEAD_DIM) / KV_BLOCK;
    float run_max[HEADS];
    for (int h = 0; h < HEADS; ++h) {
        run_max[h] = -INFINITY;
    }
    for (int t = lid; t < count; t += WGS) {
        if (t < lo) {   // before the sliding window: weight 0, the key row is not read
            for (int h = 0; h < HEADS; ++h) {
                work[h * PART + t] = -INFINITY;
            }
            continue;
        }
#if HALF
        const __local half* qh = (const __local half*)q_bits;
        const bool is_fresh = holds_pos && t == count - 1;
        const __global kv_t* k_row = k_part + (size_t)t * HEAD_DIM;
        const __global half* k_scales = key_scales + scales_part + t * (HEAD_DIM / KV_BLOCK);
        halfV dot[HEADS];
        for (int h = 0; h < HEADS; ++h) {
            dot[h] = (halfV)0.0h;
        }
        for (int c = 0; c < LANES; ++c) {
            const halfV k = is_fresh ? LOAD_KH(c, fresh, fresh_scales) : LOAD_KH(c, k_row, k_scales);
            for (int h = 0; h < HEADS; ++h) {
                dot[h] = mad(LOADH(c, qh + h * HEAD_DIM), k, dot[h]);
            }
        }
        floatV acc[HEADS];
        for (int h = 0; h < HEADS; ++h) {
            acc[h] = TO_FLOATV(dot[h]);
        }
#else
        floatV acc[HEADS];
        for (int h = 0; h < HEADS; ++h) {
            acc[h] = (floatV)0.0f;
        }
        if (holds_pos && t == count - 1) {
            for (int c = 0; c < LANES; ++c) {
                const floatV k = LOAD_KV(c, fresh, fresh_scales);
                for (int h = 0; h < HEADS; ++h) {
                    acc[h] += LOADV(c, q + h * HEAD_DIM) * k;
                }
            }
        } else {
            const __global kv_t* k_row = k_part + (size_t)t * HEAD_DIM;
            const __global half* k_scales = key_scales + scales_part + t * (HEAD_DIM / KV_BLOCK);
            for (int c = 0; c < LANES; ++c) {
                const floatV k = LOAD_KV(c, k_row, k_scales);
                for (int h = 0; h < HEADS; ++h) {
                    acc[h] += LOADV(c, q + h * HEAD_DIM) * k;
                }
            }
        }
#endif
        for (int h = 0; h < HEADS; ++h) {
            const float s = HSUM(acc[h]);
            work[h * PART + t] = s;
            run_max[h] = fmax(run_max[h], s);
        }
    }

    if (softcap > 0.0f) {
        // The soft-cap, on this work-item's scores; it is monotonic, so it maps their maxima too (−inf, no
        // position in the window, stays).
        for (int t = lid; t < count; t += WGS) {
            for (int h = 0; h < HEADS && t >= lo; ++h) {
                work[h * PART + t] = soft_cap(work[h * PART + t], softcap);
            }
        }
        for (int h = 0; h < HEADS; ++h) {
            run_max[h] = run_max[h] == -INFINITY ? run_max[h] : soft_cap(run_max[h], softcap);
        }
    }

    // The partition's max per head: one tree over WGS for all heads at once.
    for (int h = 0; h < HEADS; ++h) {
        red[h * WGS + lid] = run_max[h];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = WGS / 2; stride > 0; stride >>= 1) {
        if (lid < stride) {
            for (int h = 0; h < HEADS; ++h) {
                red[h * WGS + lid] = fmax(red[h * WGS + lid], red[h * WGS + lid + stride]);
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid < HEADS) {
        stats[lid] = red[lid * WGS];
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    // Weights e^(s − m) in place of the scores (each work-item its own positions), and their sum.
    float run_sum[HEADS];
    for (int h = 0; h < HEADS; ++h) {
        run_sum[h] = 0.0f;
    }
    for (int t = lid; t < count; t += WGS) {
        for (int h = 0; h < HEADS; ++h) {
            const float w = t < lo ? 0.0f : exp(work[h * PART + t] - stats[h]);
            work[h * PART + t] = w;
            run_sum[h] += w;
        }
    }
    for (int h = 0; h < HEADS; ++h) {
        red[h * WGS + lid] = run_sum[h];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = WGS / 2; stride > 0; stride >>= 1) {
        if (lid < stride) {
            for (int h = 0; h < HEADS; ++h) {
                red[h * WGS + lid] += red[h * WGS + lid + stride];
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid < HEADS) {
        stats[HEADS + lid] = red[lid * WGS];
    }

    // o = Σ_t w_t·V[t]: LANES work-items cover one V row, ROWS rows side by side.
    const int lane = lid % LANES, row = lid / LANES;
    floatV o[HEADS];
    for (int h = 0; h < HEADS; ++h) {
        o[h] = (floatV)0.0f;
    }
    if (row < ROWS) {
        const __global kv_t* v_part = values + head_base + (size_t)first * HEAD_DIM;
        for (int t = row < lo ? row + (lo - row + ROWS - 1) / ROWS * ROWS : row; t < count; t += ROWS) {
            floatV v;
            if (holds_pos && t == count - 1) {
                v = LOAD_KV(lane, fresh + HEAD_DIM, fresh_scales + HEAD_DIM / KV_BLOCK);
            } else {
                v = LOAD_KV(lane, v_part + (size_t)t * HEAD_DIM,
                            value_scales + scales_part + t * (HEAD_DIM / KV_BLOCK));
            }
            for (int h = 0; h < HEADS; ++h) {
                o[h] += work[h * PART + t] * v;
            }
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);  // the weights are read: work now takes the ROWS partial sums
    if (row < ROWS) {
        for (int h = 0; h < HEADS; ++h) {
            STOREV(o[h], lane, work + (row * HEADS + h) * HEAD_DIM);
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    for (int e = lid; e < HEADS * HEAD_DIM; e += WGS) {
        float sum = 0.0f;
        for (int r = 0; r < ROWS; ++r) {
            sum += work[r * HEADS * HEAD_DIM + e];
        }
        const int h = e / HEAD_DIM;
        const int query_head = QH0 + h;
        if (n_parts == 1) {
#if SINKS
            const float sink = sinks[query_head], m_all = fmax(stats[h], sink), keep = exp(stats[h] - m_all);
            out[query_head * HEAD_DIM + e % HEAD_DIM] = sum * keep / (stats[HEADS + h] * keep + exp(sink - m_all));
#else
            out[query_head * HEAD_DIM + e % HEAD_DIM] = sum / stats[HEADS + h];
#endif
        } else {
            SHARED_STORE(part_out, ((size_t)query_head * max_parts + part) * HEAD_DIM + e % HEAD_DIM, sum);
        }
    }
    if (n_parts > 1 && lid < HEADS) {
        const int at = (QH0 + lid) * max_parts + part;
        SHARED_STORE(part_max, at, stats[lid]);
        SHARED_STORE(part_sum, at, stats[HEADS + lid]);
    }
    // n_parts and combines are the same for the whole work-group, so each barrier below is met by every
    // work-item of the group or by none
    if (n_parts == 1) {
#if Q8_OUT
        QUANTIZE_OUT(QH0 * HEAD_DIM / 32, HEADS * HEAD_DIM / 32, lid, WGS)
#endif
    } else {
        mem_fence(CLK_GLOBAL_MEM_FENCE);   // this work-item's partials before the group's arrival is counted
        barrier(CLK_GLOBAL_MEM_FENCE | CLK_LOCAL_MEM_FENCE);
        if (lid == 0) {
            combines = atomic_inc(counters + get_group_id(1)) == n_parts - 1;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        if (combines) {
            if (lid == 0) {
                atomic_xchg(counters + get_group_id(1), 0);   // the last arrival: no other group touches it again
            }
            combine_partitions(QH0, lid, n_parts, max_parts, part_max, part_sum, part_out, out, sinks);
#if Q8_OUT
            QUANTIZE_OUT(QH0 * HEAD_DIM / 32, HEADS * HEAD_DIM / 32, lid, WGS)
#endif
        }
    }
}
