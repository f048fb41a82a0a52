// Prefill attention over a prompt of M tokens at positions p = p0 .. p0+M−1 (Llama family: rotate-half
// RoPE, grouped-query attention, causal), in two launches on the in-order queue:
//   kv_append:          k' = rope(k, p);  keys[layer][kvh][p] = half(k');  values[layer][kvh][p] = half(v)
//   attention_prefill:  q' = rope(q, p);  out[t][h] = Σ_{j ≤ p} softmax_j(q'·K[j] / √D) · V[j]
//                       (j ≥ p − W + 1 too under a sliding window W > 0, Mistral; 0 = off)
// Shapes: qkv (M, (H + 2·Hkv)·D) float, each row [q (H·D) | k (Hkv·D) | v (Hkv·D)] (the fused QKV GEMM);
// out (M, H·D) float; keys / values half [layer][kv_head][pos][D] (perfx/ops/kv_cache.py), positions
// < p0 already there from earlier turns; cos / sin (max_positions, D/2) float. Rotate-half pairs are
// (i, i + D/2): x'[i] = x[i]·cos − x[i+D/2]·sin, x'[i+D/2] = x[i+D/2]·cos + x[i]·sin (reference.rope).
// Query head h reads kv head h / (H/Hkv). D = HEAD_DIM is a build define, a multiple of 2·VW.
//
// The attention reads the keys the append writes, and work-groups of one launch cannot wait for each
// other: hence two launches. The attention is flash-attention style (Dao et al. 2022, algorithm 1):
// K/V tiles of BK positions in local memory, an online softmax (running max and sum) per query row,
// fp32 throughout. A work-group owns WGS consecutive rows of the flattened (token, head of the GQA
// group) index of one kv head, so every K/V tile it loads serves all the query heads that share it.

#ifndef HEAD_DIM
#define HEAD_DIM 64  // D, from the model (set by the wrapper, not tuned)
#endif

#ifndef WGS
#define WGS 32  // work-items per work-group: one query row (token, head of the group) each
#endif

#ifndef BK
#define BK 16  // key/value positions per tile in local memory
#endif

#ifndef VW
#define VW 8  // floats per vector along D: 8 or 4 (PoCL gets its throughput from wide types only)
#endif

#if VW == 8
typedef float8 floatVW;
#define LOADVW vload8
#define STOREVW vstore8
#define LOADHVW vload_half8
#define HSUM(x) hsum4((x).lo + (x).hi)
#else
typedef float4 floatVW;
#define LOADVW vload4
#define STOREVW vstore4
#define LOADHVW vload_half4
#define HSUM(x) hsum4(x)
#endif

#define HALF_D (HEAD_DIM / 2)
#define DV (HEAD_DIM / VW)  // vectors per head row

inline float hsum4(const float4 x)
{
    return (x.s0 + x.s1) + (x.s2 + x.s3);
}

// global (D/8, Hkv, M): one work-item rotates 4 pairs of one key row and stores them with that row's
// values, as fp16 (vstore_half is core OpenCL; no cl_khr_fp16 needed).
__kernel void kv_append(const int p0, const int n_heads, const int n_kv_heads, const int max_positions,
                        const int layer_offset,
                        __global const float* restrict qkv, __global const float* restrict cos_table,
                        __global const float* restrict sin_table,
                        __global half* restrict keys, __global half* restrict values)
{
    const int i = get_global_id(0);
    const int kvh = get_global_id(1);
    const int t = get_global_id(2);
    const int pos = p0 + t;
    const int stride = (n_heads + 2 * n_kv_heads) * HEAD_DIM;
    __global const float* k_row = qkv + t * stride + (n_heads + kvh) * HEAD_DIM;
    __global const float* v_row = k_row + n_kv_heads * HEAD_DIM;
    const float4 c = vload4(i, cos_table + pos * HALF_D);
    const float4 s = vload4(i, sin_table + pos * HALF_D);
    const float4 x1 = vload4(i, k_row);
    const float4 x2 = vload4(i + HALF_D / 4, k_row);
    const int dst = layer_offset + (kvh * max_positions + pos) * HEAD_DIM;
    vstore_half4(x1 * c - x2 * s, i, keys + dst);
    vstore_half4(x2 * c + x1 * s, i + HALF_D / 4, keys + dst);
    vstore_half4(vload4(i, v_row), i, values + dst);
    vstore_half4(vload4(i + HALF_D / 4, v_row), i + HALF_D / 4, values + dst);
}

// global (ceil(M·group / WGS)·WGS, Hkv), local (WGS, 1). Row r of kv head kvh is token r / group, query
// head kvh·group + r % group. Rows past M·group (the last work-group's padding) redo the last row so
// they stay finite, and write nothing.
__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void attention_prefill(const int m, const int p0, const int group, const int n_heads, const int n_kv_heads,
                       const int max_positions, const int layer_offset, const float scale,
                       __global const float* restrict qkv, __global const float* restrict cos_table,
                       __global const float* restrict sin_table, __global const half* restrict keys,
                       __global const half* restrict values, __global float* restrict out, const int window)
{
    __local float k_tile[BK * HEAD_DIM];
    __local float v_tile[BK * HEAD_DIM];

    const int lid = get_local_id(0);
    const int kvh = get_group_id(1);
    const int rows = m * group;
    const int row = min((int)get_global_id(0), rows - 1);
    const int t = row / group;
    const int h = kvh * group + row % group;
    const int pos = p0 + t;
    // Causal: the work-group needs the positions up to its last row's.
    const int last_row = min((int)get_group_id(0) * WGS + WGS - 1, rows - 1);
    const int kv_len = p0 + last_row / group + 1;
    // Sliding window: this row sees positions lo..pos; the work-group's first row has the smallest lo.
    const int lo = window > 0 ? max(0, pos - window + 1) : 0;
    const int group_lo = window > 0 ? max(0, p0 + ((int)get_group_id(0) * WGS) / group - window + 1) : 0;

    // q' = rope(q)·(1/√D) in registers; the scale folded in once instead of per score.
    const int stride = (n_heads + 2 * n_kv_heads) * HEAD_DIM;
    __global const float* q_row = qkv + t * stride + h * HEAD_DIM;
    __global const float* c_row = cos_table + pos * HALF_D;
    __global const float* s_row = sin_table + pos * HALF_D;
    floatVW q[DV];
    floatVW acc[DV];
    for (int d = 0; d < DV / 2; d++) {
        const floatVW x1 = LOADVW(d, q_row);
        const floatVW x2 = LOADVW(d + DV / 2, q_row);
        const floatVW c = LOADVW(d, c_row);
        const floatVW s = LOADVW(d, s_row);
        q[d] = (x1 * c - x2 * s) * scale;
        q[d + DV / 2] = (x2 * c + x1 * s) * scale;
        acc[d] = (floatVW)0.0f;
        acc[d + DV / 2] = (floatVW)0.0f;
    }
    // Finite start values: no inf − inf anywhere, and the first tile always holds position 0 ≤ pos.
    float m_run = -FLT_MAX;
    float l_run = 0.0f;

    const int head_base = layer_offset + kvh * max_positions * HEAD_DIM;
    for (int t0 = group_lo / BK * BK; t0 < kv_len; t0 += BK) {
        barrier(CLK_LOCAL_MEM_FENCE);  // every row is done with the previous tile
        // Positions past kv_len are zero-filled: the cache there may hold anything (NaN included), and
        // a masked weight of 0 times NaN would still be NaN.
        for (int i = lid; i < BK * DV; i += WGS) {
            const int j = t0 + i / DV;
            floatVW k = (floatVW)0.0f;
            floatVW v = (floatVW)0.0f;
            if (j < kv_len) {
                k = LOADHVW(i, keys + head_base + t0 * HEAD_DIM);
                v = LOADHVW(i, values + head_base + t0 * HEAD_DIM);
            }
            STOREVW(k, i, k_tile);
            STOREVW(v, i, v_tile);
        }
        barrier(CLK_LOCAL_MEM_FENCE);

        const int visible = min(BK, pos + 1 - t0);  // positions of this tile the row may see
        const int hidden = lo - t0;                  // ... from this one on (the window's start)
        if (visible > 0 && hidden < BK) {
            float score[BK];
            float tile_max = -FLT_MAX;
            for (int j = 0; j < BK; j++) {
                floatVW dot = (floatVW)0.0f;
                for (int d = 0; d < DV; d++) {
                    dot = fma(q[d], LOADVW(j * DV + d, k_tile), dot);
                }
                score[j] = j < visible && j >= hidden ? HSUM(dot) : -FLT_MAX;
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
                    acc[d] = fma((floatVW)p, LOADVW(j * DV + d, v_tile), acc[d]);
                }
            }
            m_run = m_new;
        }
    }

    if ((int)get_global_id(0) < rows) {
        const float inv = 1.0f / l_run;
        __global float* out_row = out + (t * n_heads + h) * HEAD_DIM;
        for (int d = 0; d < DV; d++) {
            STOREVW(acc[d] * inv, d, out_row);
        }
    }
}
