// Prefill attention over a prompt of M tokens at positions p = p0 .. p0+M−1 (Llama family: rotate-half
// RoPE, grouped-query attention, causal), in two launches on the in-order queue:
//   kv_append:          k' = rope(norm(k), p);  keys[layer][kvh][p] = half(k'); values[layer][kvh][p] = half(v)
//   attention_prefill:  q' = rope(norm(q), p);  out[t][h] = Σ_{j ≤ p} softmax_j(cap(scale·q'·K[j])) · V[j]
//                       (j ≥ p − W + 1 too under a sliding window W > 0, Mistral, Gemma; 0 = off)
// SINKS 1 (gpt-oss): sinks[h], a learned logit of head h, joins each row's softmax denominator with no value (the
// online softmax starts from it: running max sinks[h], sum 1).
// norm (QK_NORM only), rope (partial rotary, NoPE) and cap (the soft-cap) are attention.h's; scale (1/√D for
// Llama), W, the table and the norm weights are launch arguments, so one build serves every layer.
// Shapes: qkv (M, (H + 2·Hkv)·D) float, each row [q (H·D) | k (Hkv·D) | v (Hkv·D)] (the fused QKV GEMM);
// out (M, H·D) float; keys / values half [layer][kv_head][pos][D] (perfx/ops/kv_cache.py), positions
// < p0 already there from earlier turns, or with KV_Q8 int8 codes in that layout and key_scales /
// value_scales half [layer][kv_head][pos][D/32] (attention.h: kv_append quantizes each block of 32, the
// attention dequantizes as it loads its tiles); cos / sin (max_positions, n_rot/2) float; q_norm / k_norm (D).
// Query head h reads kv head h / (H/Hkv). D = HEAD_DIM is a build define, a multiple of 2·VW and of 8.
// Gemma 4: V_NORM RMS-normalises v per head (no weight) in the append; Q_ONLY: qkv rows hold q alone (M, H·D),
// the layer reading another layer's cache, positions p0.. included (the wrapper launches no append).
//
// The attention reads the keys the append writes, and work-groups of one launch cannot wait for each
// other: hence two launches. The attention is flash-attention style (Dao et al. 2022, algorithm 1):
// K/V tiles of BK positions in local memory, an online softmax (running max and sum) per query row,
// fp32 softmax and output. A work-group owns WGS consecutive rows of the flattened (token, head of the
// GQA group) index of one kv head, so every K/V tile it loads serves all the query heads that share it.
//
// Registers: a query row is served by DSPLIT work-items, each holding D/DSPLIT of its rotated q and of its
// output accumulator (at D = 128 one work-item would hold q[128] and acc[128] in registers, which spills on
// a GPU); the partial q·k of a tile meet through local memory (one barrier per tile), and every work-item of
// the row runs the same online softmax over the whole scores. HALF keeps the K/V tiles in local memory as
// half (half the bytes: twice the positions per tile) and forms q·k in half per work-item (cl_khr_fp16);
// softmax, p·V and the accumulators stay fp32.

#ifndef HEAD_DIM
#define HEAD_DIM 64  // D, from the model (set by the wrapper, not tuned)
#endif

#ifndef WGS
#define WGS 32  // query rows (token, head of the group) per work-group
#endif

#ifndef BK
#define BK 16  // key/value positions per tile in local memory
#endif

#ifndef VW
#define VW 8  // floats per vector along D: 8 or 4 (PoCL gets its throughput from wide types only)
#endif

#ifndef DSPLIT
#define DSPLIT 2  // work-items per query row, each with D/DSPLIT of q and of the output accumulator
#endif

#ifndef HALF
#define HALF 0  // K/V tiles in local memory as half, q·k in half (cl_khr_fp16)
#endif

#ifndef V_NORM
#define V_NORM 0  // v RMS-normed per head without a weight before the cache (set by the wrapper)
#endif

#ifndef Q_ONLY
#define Q_ONLY 0  // qkv rows hold q alone (set by the wrapper)
#endif

#ifndef SINKS
#define SINKS 0  // a learned logit per query head in the softmax's denominator (gpt-oss; set by the wrapper)
#endif

#include "attention.h"

#if VW == 8
typedef float8 floatVW;
#define LOADVW vload8
#define STOREVW vstore8
#define LOADHVW vload_half8
#define CONVERT_FLOATVW convert_float8
#define HSUM(x) hsum4((x).lo + (x).hi)
#else
typedef float4 floatVW;
#define LOADVW vload4
#define STOREVW vstore4
#define LOADHVW vload_half4
#define CONVERT_FLOATVW convert_float4
#define HSUM(x) hsum4(x)
#endif

// Vector i of a run of q8 K/V rows (KV_Q8) as floats: codes times their block's scale (a VW vector lies
// within one block of 32); scales: the run's first row's.
#define LOAD_Q8(i, codes, scales) (CONVERT_FLOATVW(LOADVW(i, codes)) * vload_half((i) * VW / KV_BLOCK, scales))

#define DP (HEAD_DIM / DSPLIT)  // dimensions per work-item
#define DV (DP / VW)            // vectors per work-item
#define RV (HEAD_DIM / VW)      // vectors per head row

#if HALF
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
typedef half tile_t;
#if VW == 8
typedef half8 halfVW;
#define LOADTILE(i, p) vload8(i, p)
#define TO_HALF convert_half8
#define TO_FLOAT convert_float8
#else
typedef half4 halfVW;
#define LOADTILE(i, p) vload4(i, p)
#define TO_HALF convert_half4
#define TO_FLOAT convert_float4
#endif
#else
typedef float tile_t;
#define LOADTILE(i, p) LOADVW(i, p)
#endif

inline float hsum4(const float4 x)
{
    return (x.s0 + x.s1) + (x.s2 + x.s3);
}

// global (D/8, Hkv, M), local (D/8, 1, 1): a work-group per key row, each work-item normalises and rotates 8
// of its elements and stores them with that row's values, as fp16 (vstore_half is core OpenCL; no cl_khr_fp16
// needed), or with KV_Q8 as int8 codes: a block of 32 is four work-items' runs of 8, whose maxima meet in
// local memory. With QK_NORM the row's sum of squares meets there too.
__kernel void kv_append(const int p0, const int n_heads, const int n_kv_heads, const int max_positions,
                        const int layer_offset,
                        __global const float* restrict qkv, __global const float* restrict cos_table,
                        __global const float* restrict sin_table, const int n_rot,
                        __global const float* restrict k_norm, const float eps,
                        __global kv_t* restrict keys, __global kv_t* restrict values,
                        __global half* restrict key_scales, __global half* restrict value_scales)
{
    const int i = get_local_id(0);
    const int kvh = get_global_id(1);
    const int t = get_global_id(2);
    const int pos = p0 + t;
    const int stride = (n_heads + 2 * n_kv_heads) * HEAD_DIM;
    __global const float* k_row = qkv + t * stride + (n_heads + kvh) * HEAD_DIM;
    __global const float* v_row = k_row + n_kv_heads * HEAD_DIM;
    float f = 1.0f;
#if QK_NORM
    __local float squares[HEAD_DIM / 8];
    const float8 x = vload8(i, k_row);
    const float4 x4 = x.lo * x.lo + x.hi * x.hi;
    squares[i] = (x4.s0 + x4.s1) + (x4.s2 + x4.s3);
    barrier(CLK_LOCAL_MEM_FENCE);
    float sum = 0.0f;
    for (int j = 0; j < HEAD_DIM / 8; j++) {
        sum += squares[j];
    }
    f = rsqrt(sum / HEAD_DIM + eps);
#endif
#if V_NORM
    __local float v_squares[HEAD_DIM / 8];
    const float8 vn = vload8(i, v_row);
    const float4 vn4 = vn.lo * vn.lo + vn.hi * vn.hi;
    v_squares[i] = (vn4.s0 + vn4.s1) + (vn4.s2 + vn4.s3);
    barrier(CLK_LOCAL_MEM_FENCE);
    float v_sum = 0.0f;
    for (int j = 0; j < HEAD_DIM / 8; j++) {
        v_sum += v_squares[j];
    }
    const float fv = rsqrt(v_sum / HEAD_DIM + eps);
#else
    const float fv = 1.0f;
#endif
    __global const float* cos_p = cos_table + pos * (n_rot / 2);
    __global const float* sin_p = sin_table + pos * (n_rot / 2);
    float k[8];
    for (int e = 0; e < 8; e++) {
        k[e] = rope_element(k_row, 8 * i + e, f, k_norm, cos_p, sin_p, n_rot);
    }
    const int dst = layer_offset + (kvh * max_positions + pos) * HEAD_DIM;
#if KV_Q8
    __local float maxima[2][HEAD_DIM / 8];
    const float8 kx = vload8(0, k), vx = vload8(i, v_row) * fv;
    const float4 k4 = fmax(fabs(kx.lo), fabs(kx.hi)), v4 = fmax(fabs(vx.lo), fabs(vx.hi));
    maxima[0][i] = fmax(fmax(k4.s0, k4.s1), fmax(k4.s2, k4.s3));
    maxima[1][i] = fmax(fmax(v4.s0, v4.s1), fmax(v4.s2, v4.s3));
    barrier(CLK_LOCAL_MEM_FENCE);
    const int first = i / (KV_BLOCK / 8) * (KV_BLOCK / 8);  // this block's first work-item
    float k_max = 0.0f, v_max = 0.0f;
    for (int j = first; j < first + KV_BLOCK / 8; j++) {
        k_max = fmax(k_max, maxima[0][j]);
        v_max = fmax(v_max, maxima[1][j]);
    }
    const float dk = k_max / 127.0f, dv = v_max / 127.0f;
    vstore8(convert_char8_sat(round(kx * q8_inverse(dk))), i, keys + dst);
    vstore8(convert_char8_sat(round(vx * q8_inverse(dv))), i, values + dst);
    if (i == first) {
        vstore_half(dk, (dst + 8 * i) / KV_BLOCK, key_scales);
        vstore_half(dv, (dst + 8 * i) / KV_BLOCK, value_scales);
    }
#else
    vstore_half8(vload8(0, k), i, keys + dst);
    vstore_half8(vload8(i, v_row) * fv, i, values + dst);
#endif
}

// global (ceil(M·group / WGS)·WGS·DSPLIT, Hkv), local (WGS·DSPLIT, 1). Row r of kv head kvh is token
// r / group, query head kvh·group + r % group; work-item lid serves row lid / DSPLIT of the work-group, part
// lid % DSPLIT (dimensions part·DP .. part·DP + DP − 1). Rows past M·group (the last work-group's padding)
// redo the last row so they stay finite, and write nothing.
__kernel __attribute__((reqd_work_group_size(WGS * DSPLIT, 1, 1)))
void attention_prefill(const int m, const int p0, const int group, const int n_heads, const int n_kv_heads,
                       const int max_positions, const int layer_offset, const float scale,
                       __global const float* restrict qkv, __global const float* restrict cos_table,
                       __global const float* restrict sin_table, const int n_rot,
                       __global const float* restrict q_norm, const float eps,
                       __global const kv_t* restrict keys, __global const kv_t* restrict values,
                       __global const half* restrict key_scales, __global const half* restrict value_scales,
                       __global float* restrict out, const int window, const float softcap,
                       __global const float* restrict sinks)
{
    __local tile_t k_tile[BK * HEAD_DIM];
    __local tile_t v_tile[BK * HEAD_DIM];
#if DSPLIT > 1
    __local float partial[WGS][BK][DSPLIT];  // each part's q·k of the tile, per row
#endif

    const int lid = get_local_id(0);
    const int local_row = lid / DSPLIT;
    const int part = lid % DSPLIT;
    const int kvh = get_group_id(1);
    const int rows = m * group;
    const int global_row = get_group_id(0) * WGS + local_row;
    const int row = min(global_row, rows - 1);
    const int t = row / group;
    const int h = kvh * group + row % group;
    const int pos = p0 + t;
    // Causal: the work-group needs the positions up to its last row's.
    const int last_row = min((int)get_group_id(0) * WGS + WGS - 1, rows - 1);
    const int kv_len = p0 + last_row / group + 1;
    // Sliding window: this row sees positions lo..pos; the work-group's first row has the smallest lo.
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const int group_lo = window > 0 ? max(0, p0 + ((int)get_group_id(0) * WGS) / group - window + 1) : 0;

    // This part of q' = rope(norm(q))·scale in registers; the scale folded in once instead of per score.
    // Dimension i pairs with i ± n_rot/2, which another part may hold, and the norm needs the whole row:
    // read from the row in global memory.
    const int stride = (n_heads + (Q_ONLY ? 0 : 2 * n_kv_heads)) * HEAD_DIM;
    __global const float* q_row = qkv + t * stride + h * HEAD_DIM;
    __global const float* c_row = cos_table + pos * (n_rot / 2);
    __global const float* s_row = sin_table + pos * (n_rot / 2);
#if QK_NORM
    const float f = inverse_rms(q_row, eps);
#else
    const float f = 1.0f;
#endif
#if HALF
    halfVW q[DV];
#else
    floatVW q[DV];
#endif
    floatVW acc[DV];
    for (int d = 0; d < DV; d++) {
        float rotated[VW];
        for (int e = 0; e < VW; e++) {
            rotated[e] = rope_element(q_row, (part * DV + d) * VW + e, f, q_norm, c_row, s_row, n_rot) * scale;
        }
#if HALF
        q[d] = TO_HALF(LOADVW(0, rotated));
#else
        q[d] = LOADVW(0, rotated);
#endif
        acc[d] = (floatVW)0.0f;
    }
    // Finite start values: no inf − inf anywhere, and the first tile always holds position 0 ≤ pos.
#if SINKS
    float m_run = sinks[h];   // the sink: a logit with no value
    float l_run = 1.0f;
#else
    float m_run = -FLT_MAX;
    float l_run = 0.0f;
#endif

    const int head_base = layer_offset + kvh * max_positions * HEAD_DIM;
    for (int t0 = group_lo / BK * BK; t0 < kv_len; t0 += BK) {
        barrier(CLK_LOCAL_MEM_FENCE);  // every row is done with the previous tile
        // Positions past kv_len are zero-filled: the cache there may hold anything (NaN included), and
        // a masked weight of 0 times NaN would still be NaN.
        const int tile_base = head_base + t0 * HEAD_DIM;
        for (int i = lid; i < BK * RV; i += WGS * DSPLIT) {
            const int j = t0 + i / RV;
#if HALF
            halfVW k = (halfVW)0.0h, v = (halfVW)0.0h;
            if (j < kv_len) {
#if KV_Q8
                k = TO_HALF(LOAD_Q8(i, keys + tile_base, key_scales + tile_base / KV_BLOCK));
                v = TO_HALF(LOAD_Q8(i, values + tile_base, value_scales + tile_base / KV_BLOCK));
#else
                k = LOADTILE(i, keys + tile_base);
                v = LOADTILE(i, values + tile_base);
#endif
            }
#if VW == 8
            vstore8(k, i, k_tile);
            vstore8(v, i, v_tile);
#else
            vstore4(k, i, k_tile);
            vstore4(v, i, v_tile);
#endif
#else
            floatVW k = (floatVW)0.0f;
            floatVW v = (floatVW)0.0f;
            if (j < kv_len) {
#if KV_Q8
                k = LOAD_Q8(i, keys + tile_base, key_scales + tile_base / KV_BLOCK);
                v = LOAD_Q8(i, values + tile_base, value_scales + tile_base / KV_BLOCK);
#else
                k = LOADHVW(i, keys + tile_base);
                v = LOADHVW(i, values + tile_base);
#endif
            }
            STOREVW(k, i, k_tile);
            STOREVW(v, i, v_tile);
#endif
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        // This part's q·k for every position of the tile.
        float score[BK];
        for (int j = 0; j < BK; j++) {
#if HALF
            halfVW dot = (halfVW)0.0h;
            for (int d = 0; d < DV; d++) {
                dot = mad(q[d], LOADTILE(j * RV + part * DV + d, k_tile), dot);
            }
            score[j] = HSUM(TO_FLOAT(dot));
#else
            floatVW dot = (floatVW)0.0f;
            for (int d = 0; d < DV; d++) {
                dot = fma(q[d], LOADVW(j * RV + part * DV + d, k_tile), dot);
            }
            score[j] = HSUM(dot);
#endif
        }
#if DSPLIT > 1
        // The parts of a row add their q·k: every part then holds the whole scores.
        for (int j = 0; j < BK; j++) {
            partial[local_row][j][part] = score[j];
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int j = 0; j < BK; j++) {
            float sum = 0.0f;
            for (int p = 0; p < DSPLIT; p++) {
                sum += partial[local_row][j][p];
            }
            score[j] = sum;
        }
#endif
        if (softcap > 0.0f) {
            for (int j = 0; j < BK; j++) {
                score[j] = soft_cap(score[j], softcap);
            }
        }

        const int visible = min(BK, pos + 1 - t0);  // positions of this tile the row may see
        const int hidden = lo - t0;                  // ... from this one on (the window's start)
        if (visible > 0 && hidden < BK) {
            float tile_max = -FLT_MAX;
            for (int j = 0; j < BK; j++) {
                score[j] = j < visible && j >= hidden ? score[j] : -FLT_MAX;
                tile_max = fmax(tile_max, score[j]);
            }
            const float m_new = fmax(m_run, tile_max);
            const float correction = exp(m_run - m_new);
            l_run *= correction;
            for (int d = 0; d < DV; d++) {
                acc[d] *= correction;
            }
            for (int j = 0; j < BK; j++) {
                const float p = j < visible && j >= hidden ? exp(score[j] - m_new) : 0.0f;
                l_run += p;
                for (int d = 0; d < DV; d++) {
#if HALF
                    acc[d] = fma((floatVW)p, TO_FLOAT(LOADTILE(j * RV + part * DV + d, v_tile)), acc[d]);
#else
                    acc[d] = fma((floatVW)p, LOADVW(j * RV + part * DV + d, v_tile), acc[d]);
#endif
                }
            }
            m_run = m_new;
        }
    }

    if (global_row < rows) {
        const float inv = 1.0f / l_run;
        __global float* out_row = out + (t * n_heads + h) * HEAD_DIM;
        for (int d = 0; d < DV; d++) {
            STOREVW(acc[d] * inv, part * DV + d, out_row);
        }
    }
}
