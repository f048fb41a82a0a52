// Gated DeltaNet (Qwen3.5 and Qwen3-Next linear attention): the gated delta rule over a recurrent state, fp32.
//
// Per v head h < HV, reading q/k head kh (HEAD_MAP 0: h mod HK, llama.cpp's tiled order, which the GGUF
// converter's _reorder_v_heads sets up; 1: h / (HV/HK), transformers' repeat_interleave), with the state
// S[h][j][i] (j < DV a value row of DK floats: ggml_gated_delta_net's layout, S held transposed), per token:
//   q̂ = q / max(‖q‖, eps) · scale,   k̂ = k / max(‖k‖, eps)                     (ggml_l2_norm)
//   α = exp(g), β   (RAW_GATES 1: g = softplus(a + dt_bias[h]) · ssm_a[h], β = sigmoid(b), as qwen35.cpp)
//   every row j:  S_j ← α·S_j;   δ_j = β·(v_j − S_j·k̂);   S_j += δ_j·k̂;   o_j = S_j·q̂
// The rows never meet: work-groups split a head's rows and share only q, k and the gates.
//
// Inputs of token t < T: qkv + qkv_offset + t·qkv_stride holds float32 [q (HK·DK) | k (HK·DK) | v (HV·DV)];
// gates + gates_offset + t·gates_stride holds [g (HV) | β (HV)] (RAW_GATES: [a (HV) | b (HV)]). Output o of
// token t at out + t·out_stride, HV·DV floats, head-major. state (HV·DV·DK floats) is updated in place.
//
// gated_delta_net_recurrent (decode; any T, token by token): a work-group holds ROWS1 rows, LANES1 lanes a
//   row, each lane DK/LANES1 of the row's floats in registers through all T tokens, so the state is read and
//   written once a launch. One fused reduction a token of five sums over the row (S_j·k, S_j·q, ‖q‖², ‖k‖²,
//   k·q): o_j = α·S_j·q̂ + δ_j·(k̂·q̂), from the state before its update. LANES1 1: a work-item a row, no
//   reduction and no barrier (CPUs: each work-item a SIMD lane, as gemv_q4's LANES 1).
//   Launch: global (ceil(DV/ROWS1)·LANES1·ROWS1, HV), local (LANES1·ROWS1, 1).
//
// gated_delta_net_chunked (prefill): chunks of CHUNK2 tokens, the chunked (WY) form of transformers'
//   torch_chunk_gated_delta_rule and llama.cpp's build_delta_net_chunking. Within a chunk, γ_t = g_0 + … + g_t,
//   Γ[t][s] = exp(γ_t − γ_s) for s ≤ t, L[t][s] = β_t·(k̂_t·k̂_s)·Γ[t][s] (s < t),
//   P[t][s] = (q̂_t·k̂_s)·Γ[t][s] (s ≤ t); then each row j, from S_j at the chunk's start:
//     r_t = β_t·(v_tj − exp(γ_t)·k̂_t·S_j);   u = (I + L)⁻¹·r  (forward substitution: transformers' v_new)
//     o_tj = exp(γ_t)·q̂_t·S_j + Σ_{s≤t} P[t][s]·u_s;   S_j ← exp(γ_last)·S_j + Σ_t exp(γ_last − γ_t)·u_t·k̂_t
//   No exponential grows (g ≤ 0: γ only falls), so a small α underflows to 0 instead of overflowing.
//   A work-group holds ROWS2 rows of one head in local memory, with the chunk's k̂ and q̂ tiles (HALF2: as
//   fp16, half the bytes, so longer chunks fit), L and P: each work-group of a head recomputes the norms, L
//   and P (2·C²·DK) beside its rows' 5·C·DK a chunk.
//   Launch: global (ceil(DV/ROWS2)·WGS2, HV), local (WGS2, 1).

#ifndef LANES1
#define LANES1 16  // recurrent: work-items a state row (a power of two)
#endif
#ifndef ROWS1
#define ROWS1 4  // recurrent: state rows a work-group
#endif
#ifndef CHUNK2
#define CHUNK2 16  // chunked: tokens a chunk
#endif
#ifndef ROWS2
#define ROWS2 16  // chunked: state rows a work-group, held in local memory
#endif
#ifndef WGS2
#define WGS2 64  // chunked: work-items a work-group
#endif
#ifndef HALF2
#define HALF2 0  // chunked: the k̂ and q̂ tiles in local memory as fp16 (cl_khr_fp16); arithmetic stays fp32
#endif

// The shape, set by the wrapper (these defaults only let the file build on its own).
#ifndef HK
#define HK 1  // q/k heads
#endif
#ifndef HV
#define HV 1  // v heads (a multiple of HK)
#endif
#ifndef DK
#define DK 128  // key head size
#endif
#ifndef DV
#define DV 128  // value head size
#endif
#ifndef HEAD_MAP
#define HEAD_MAP 0  // 0: v head h reads q/k head h mod HK (GGUF); 1: h / (HV/HK) (Hugging Face)
#endif
#ifndef RAW_GATES
#define RAW_GATES 0  // 0: gates are g and β; 1: the projections' a and b, with dt_bias and ssm_a
#endif

#if HALF2
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
typedef half tile_t;
#else
typedef float tile_t;
#endif

#define WGS1 (LANES1 * ROWS1)
#define EPL1 ((DK + LANES1 - 1) / LANES1)  // state floats a lane holds
#define DKP (DK + 1)  // local rows padded: work-items reading down a column fall in different banks
#define V_AT (2 * HK * DK)  // where v starts in a token's qkv

int qk_head(const int h)
{
#if HEAD_MAP == 0
    return h % HK;
#else
    return h / (HV / HK);
#endif
}

// (g, β) of head h from one token's gates.
float2 gates_of(__global const float* gt, const int h, __global const float* dt_bias,
                __global const float* ssm_a)
{
#if RAW_GATES
    const float x = gt[h] + dt_bias[h];
    const float sp = x > 20.0f ? x : log1p(exp(x));  // ggml_softplus's cut-off
    return (float2)(sp * ssm_a[h], 1.0f / (1.0f + exp(-gt[HV + h])));
#else
    return (float2)(gt[h], gt[HV + h]);
#endif
}

__kernel __attribute__((reqd_work_group_size(WGS1, 1, 1)))
void gated_delta_net_recurrent(const int tokens, __global const float* restrict qkv, const int qkv_offset,
                               const int qkv_stride, __global const float* restrict gates,
                               const int gates_offset, const int gates_stride,
                               __global const float* restrict dt_bias, __global const float* restrict ssm_a,
                               __global float* restrict state, __global float* restrict out,
                               const int out_stride, const float scale, const float eps)
{
#if LANES1 > 1
    __local float sums[5][WGS1];
#endif
    const int lid = get_local_id(0);
    const int lane = lid % LANES1;
    const int row = lid / LANES1;
    const int h = get_group_id(1);
    const int j = get_group_id(0) * ROWS1 + row;
    const bool live = j < DV;  // the last work-group's rows past DV only join the barriers
    const int kh = qk_head(h);
    __global float* s_row = state + ((size_t)h * DV + (live ? j : 0)) * DK;

    float s[EPL1];
    for (int e = 0; e < EPL1; ++e) {
        const int i = lane + e * LANES1;
        s[e] = (live && i < DK) ? s_row[i] : 0.0f;
    }
    for (int t = 0; t < tokens; ++t) {
        __global const float* x = qkv + qkv_offset + (size_t)t * qkv_stride;
        __global const float* q = x + kh * DK;
        __global const float* k = x + (HK + kh) * DK;
        float ke[EPL1];
        float sk = 0.0f, sq = 0.0f, nq = 0.0f, nk = 0.0f, kq = 0.0f;
        for (int e = 0; e < EPL1; ++e) {
            const int i = lane + e * LANES1;
            const float qi = i < DK ? q[i] : 0.0f;
            ke[e] = i < DK ? k[i] : 0.0f;
            sk = fma(s[e], ke[e], sk);
            sq = fma(s[e], qi, sq);
            nq = fma(qi, qi, nq);
            nk = fma(ke[e], ke[e], nk);
            kq = fma(ke[e], qi, kq);
        }
#if LANES1 > 1
        // The row's five sums, a tree over its lanes.
        sums[0][lid] = sk;
        sums[1][lid] = sq;
        sums[2][lid] = nq;
        sums[3][lid] = nk;
        sums[4][lid] = kq;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int stride = LANES1 / 2; stride > 0; stride >>= 1) {
            if (lane < stride) {
                for (int c = 0; c < 5; ++c) {
                    sums[c][lid] += sums[c][lid + stride];
                }
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
        const int first = row * LANES1;
        sk = sums[0][first];
        sq = sums[1][first];
        nq = sums[2][first];
        nk = sums[3][first];
        kq = sums[4][first];
        barrier(CLK_LOCAL_MEM_FENCE);  // the next token writes sums again
#endif

        const float2 gb = gates_of(gates + gates_offset + (size_t)t * gates_stride, h, dt_bias, ssm_a);
        const float alpha = exp(gb.x);
        const float iq = 1.0f / fmax(sqrt(nq), eps);
        const float ik = 1.0f / fmax(sqrt(nk), eps);
        const float vj = live ? x[V_AT + h * DV + j] : 0.0f;
        const float delta = gb.y * (vj - alpha * sk * ik);
        if (live && lane == 0) {
            out[(size_t)t * out_stride + h * DV + j] = scale * iq * (alpha * sq + delta * kq * ik);
        }
        const float dk = delta * ik;
        for (int e = 0; e < EPL1; ++e) {
            s[e] = fma(alpha, s[e], dk * ke[e]);
        }
    }
    for (int e = 0; e < EPL1; ++e) {
        const int i = lane + e * LANES1;
        if (live && i < DK) {
            s_row[i] = s[e];
        }
    }
}

__kernel __attribute__((reqd_work_group_size(WGS2, 1, 1)))
void gated_delta_net_chunked(const int tokens, __global const float* restrict qkv, const int qkv_offset,
                             const int qkv_stride, __global const float* restrict gates, const int gates_offset,
                             const int gates_stride, __global const float* restrict dt_bias,
                             __global const float* restrict ssm_a, __global float* restrict state,
                             __global float* restrict out, const int out_stride, const float scale,
                             const float eps)
{
    __local tile_t kt[CHUNK2 * DKP];     // k̂ of the chunk's tokens
    __local tile_t qt[CHUNK2 * DKP];     // q̂ (scaled)
    __local float st[ROWS2 * DKP];       // this work-group's state rows
    __local float lm[CHUNK2 * CHUNK2];   // L, below the diagonal
    __local float pm[CHUNK2 * CHUNK2];   // P, on and below the diagonal
    __local float yt[CHUNK2 * ROWS2];    // k̂_t·S_j, then u
    __local float zt[CHUNK2 * ROWS2];    // q̂_t·S_j
    __local float gam[CHUNK2], bet[CHUNK2], egam[CHUNK2], tail[CHUNK2], inv[2 * CHUNK2];

    const int lid = get_local_id(0);
    const int h = get_group_id(1);
    const int j0 = get_group_id(0) * ROWS2;
    const int rows = min(ROWS2, DV - j0);
    const int kh = qk_head(h);
    __global float* s_rows = state + ((size_t)h * DV + j0) * DK;

    for (int w = lid; w < rows * DK; w += WGS2) {
        st[(w / DK) * DKP + w % DK] = s_rows[w];
    }
    for (int c0 = 0; c0 < tokens; c0 += CHUNK2) {
        const int n = min(CHUNK2, tokens - c0);
        // The chunk's gates, their prefix sum and the decays from it; 1/‖q_t‖ (with the scale) and 1/‖k_t‖.
        if (lid == 0) {
            float acc = 0.0f;
            for (int t = 0; t < n; ++t) {
                const float2 gb = gates_of(gates + gates_offset + (size_t)(c0 + t) * gates_stride, h, dt_bias,
                                           ssm_a);
                acc += gb.x;
                gam[t] = acc;
                bet[t] = gb.y;
                egam[t] = exp(acc);
            }
            for (int t = 0; t < n; ++t) {
                tail[t] = exp(acc - gam[t]);
            }
        }
        for (int w = lid; w < 2 * n; w += WGS2) {
            __global const float* v = qkv + qkv_offset + (size_t)(c0 + w % n) * qkv_stride
                                      + (w < n ? 0 : HK * DK) + kh * DK;
            float squares = 0.0f;
            for (int i = 0; i < DK; ++i) {
                squares = fma(v[i], v[i], squares);
            }
            inv[w] = (w < n ? scale : 1.0f) / fmax(sqrt(squares), eps);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        // The tiles of q̂ and k̂ (read coalesced along DK).
        for (int w = lid; w < n * DK; w += WGS2) {
            const int t = w / DK, i = w % DK;
            __global const float* x = qkv + qkv_offset + (size_t)(c0 + t) * qkv_stride;
            qt[t * DKP + i] = (tile_t)(x[kh * DK + i] * inv[t]);
            kt[t * DKP + i] = (tile_t)(x[(HK + kh) * DK + i] * inv[n + t]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        // L and P, and each row's k̂_t·S_j and q̂_t·S_j.
        for (int w = lid; w < n * n; w += WGS2) {
            const int t = w / n, s = w % n;
            if (s <= t) {
                float kk = 0.0f, qk = 0.0f;
                for (int i = 0; i < DK; ++i) {
                    kk = fma((float)kt[t * DKP + i], (float)kt[s * DKP + i], kk);
                    qk = fma((float)qt[t * DKP + i], (float)kt[s * DKP + i], qk);
                }
                const float decay = exp(gam[t] - gam[s]);
                lm[t * CHUNK2 + s] = bet[t] * kk * decay;
                pm[t * CHUNK2 + s] = qk * decay;
            }
        }
        for (int w = lid; w < n * rows; w += WGS2) {
            const int t = w / rows, r = w % rows;
            float y = 0.0f, z = 0.0f;
            for (int i = 0; i < DK; ++i) {
                y = fma((float)kt[t * DKP + i], st[r * DKP + i], y);
                z = fma((float)qt[t * DKP + i], st[r * DKP + i], z);
            }
            yt[t * ROWS2 + r] = y;
            zt[t * ROWS2 + r] = z;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        // u = (I + L)⁻¹·r, one work-item a row: u_t replaces k̂_t·S_j once read.
        for (int r = lid; r < rows; r += WGS2) {
            for (int t = 0; t < n; ++t) {
                const float v = qkv[qkv_offset + (size_t)(c0 + t) * qkv_stride + V_AT + h * DV + j0 + r];
                float u = bet[t] * (v - egam[t] * yt[t * ROWS2 + r]);
                for (int s = 0; s < t; ++s) {
                    u = fma(-lm[t * CHUNK2 + s], yt[s * ROWS2 + r], u);
                }
                yt[t * ROWS2 + r] = u;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        // The chunk's outputs, and the state carried to the next chunk.
        for (int w = lid; w < n * rows; w += WGS2) {
            const int t = w / rows, r = w % rows;
            float o = egam[t] * zt[t * ROWS2 + r];
            for (int s = 0; s <= t; ++s) {
                o = fma(pm[t * CHUNK2 + s], yt[s * ROWS2 + r], o);
            }
            out[(size_t)(c0 + t) * out_stride + h * DV + j0 + r] = o;
        }
        const float last = egam[n - 1];
        for (int w = lid; w < rows * DK; w += WGS2) {
            const int r = w / DK, i = w % DK;
            float acc = last * st[r * DKP + i];
            for (int t = 0; t < n; ++t) {
                acc = fma(tail[t] * yt[t * ROWS2 + r], (float)kt[t * DKP + i], acc);
            }
            st[r * DKP + i] = acc;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int w = lid; w < rows * DK; w += WGS2) {
        s_rows[w] = st[(w / DK) * DKP + w % DK];
    }
}
