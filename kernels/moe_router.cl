// The router of a mixture-of-experts FFN (llama.cpp's build_moe_ffn, src/llama-graph.cpp): the logits of each
// row's experts, and the experts it chooses with their weights, written to device buffers that the routed
// expert GEMVs (gemv_moe.cl) read, so the decode step needs no host round trip.
//
//   router_logits:  logits[r][e] = Σ_k W[e][k]·x[r][k] (+ b[e], LOGIT_BIAS 1: gpt-oss's router bias)
//                   W (E, K) float, x (m, K), logits (m, E), b (E) float
//                   one work-group per (expert, row): WGS work-items stride over K (coalesced), then a tree sum.
//   router_topk:    p = softmax(logits[r]) (GATING 0), σ(logits[r]) (1) or the logits (2: softmax over the chosen)
//                   chosen = the USED experts of largest p + bias (BIAS 1: a selection bias, used only to choose;
//                            ties to the lower id), in that order
//                   w_j = p[chosen_j] (GATING 2: softmax over the chosen logits); NORM 1: w /= max(Σ w, 2^-14)
//                   ids[r][j] = chosen_j (int), weights[r][j] = w_j · scale
//                   one work-group per row: p in local memory, USED rounds of a parallel arg-max.
//
// Shapes: E ≤ MAX_E and used ≤ MAX_USED (the local arrays), used ≤ E. The gating, bias, norm and count are the
// model's (set by the wrapper, never tuned); WGS is tuned.

#ifndef WGS
#define WGS 64       // work-items per work-group (both kernels)
#endif
#ifndef MAX_E
#define MAX_E 512    // the most experts a row holds in local memory (perfx.config.MAX_EXPERTS)
#endif
#ifndef MAX_USED
#define MAX_USED 32  // the most experts a row chooses (perfx.config.MAX_EXPERTS_USED)
#endif
#ifndef GATING
#define GATING 0     // 0 softmax, 1 sigmoid, 2 softmax over the chosen logits
#endif
#ifndef BIAS
#define BIAS 0       // 1: a per-expert selection bias
#endif
#ifndef NORM
#define NORM 0       // 1: the chosen weights renormalised to sum 1
#endif
#ifndef LOGIT_BIAS
#define LOGIT_BIAS 0 // 1: a bias added to each expert's logit (gpt-oss's router), before the gating and the choice
#endif

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void router_logits(const int n_experts, const int k, __global const float* restrict x,
                   __global const float* restrict w, __global const float* restrict logit_bias,
                   __global float* restrict logits)
{
    const int e = get_group_id(0), r = get_global_id(1), lid = get_local_id(0);
    __local float part[WGS];
    const __global float* row = w + (size_t)e * k;
    const __global float* xr = x + (size_t)r * k;
    float acc = 0.0f;
    for (int i = lid; i < k; i += WGS) acc = fma(row[i], xr[i], acc);
    part[lid] = acc;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int span = WGS / 2; span > 0; span >>= 1) {
        if (lid < span) part[lid] += part[lid + span];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
#if LOGIT_BIAS
    if (lid == 0) logits[(size_t)r * n_experts + e] = part[0] + logit_bias[e];
#else
    if (lid == 0) logits[(size_t)r * n_experts + e] = part[0];
#endif
}

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void router_topk(const int n_experts, const int used, __global const float* restrict logits,
                 __global const float* restrict bias, __global int* restrict ids, __global float* restrict weights,
                 const float scale)
{
    const int r = get_group_id(1), lid = get_local_id(0);
    __local float p[MAX_E], select[MAX_E];
    __local float best_v[WGS];
    __local int best_i[WGS];
    __local float chosen_w[MAX_USED];
    const __global float* z = logits + (size_t)r * n_experts;

#if GATING == 0
    // softmax: the row's max, then Σ exp
    float mx = -INFINITY;
    for (int e = lid; e < n_experts; e += WGS) mx = fmax(mx, z[e]);
    best_v[lid] = mx;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int span = WGS / 2; span > 0; span >>= 1) {
        if (lid < span) best_v[lid] = fmax(best_v[lid], best_v[lid + span]);
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    mx = best_v[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    float sum = 0.0f;
    for (int e = lid; e < n_experts; e += WGS) {
        const float v = exp(z[e] - mx);
        p[e] = v;
        sum += v;
    }
    best_v[lid] = sum;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int span = WGS / 2; span > 0; span >>= 1) {
        if (lid < span) best_v[lid] += best_v[lid + span];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float inv = 1.0f / best_v[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int e = lid; e < n_experts; e += WGS) p[e] *= inv;
#elif GATING == 1
    for (int e = lid; e < n_experts; e += WGS) p[e] = 1.0f / (1.0f + exp(-z[e]));
#else
    for (int e = lid; e < n_experts; e += WGS) p[e] = z[e];
#endif
    for (int e = lid; e < n_experts; e += WGS) {
#if BIAS
        select[e] = p[e] + bias[e];
#else
        select[e] = p[e];
#endif
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    for (int j = 0; j < used; ++j) {
        float v = -INFINITY;
        int at = n_experts;
        for (int e = lid; e < n_experts; e += WGS) {
            const float s = select[e];
            if (s > v || (s == v && e < at)) { v = s; at = e; }
        }
        best_v[lid] = v;
        best_i[lid] = at;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int span = WGS / 2; span > 0; span >>= 1) {
            if (lid < span) {
                const float o = best_v[lid + span];
                const int oi = best_i[lid + span];
                if (o > best_v[lid] || (o == best_v[lid] && oi < best_i[lid])) { best_v[lid] = o; best_i[lid] = oi; }
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
        if (lid == 0) {
            const int e = best_i[0];
            ids[(size_t)r * used + j] = e;
            chosen_w[j] = p[e];
            select[e] = -INFINITY;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    if (lid == 0) {
#if GATING == 2
        float mx = -INFINITY;
        for (int j = 0; j < used; ++j) mx = fmax(mx, chosen_w[j]);
        float sum = 0.0f;
        for (int j = 0; j < used; ++j) { chosen_w[j] = exp(chosen_w[j] - mx); sum += chosen_w[j]; }
        for (int j = 0; j < used; ++j) chosen_w[j] /= sum;
#endif
#if NORM
        float total = 0.0f;
        for (int j = 0; j < used; ++j) total += chosen_w[j];
        const float norm = 1.0f / fmax(total, 6.103515625e-5f);
#else
        const float norm = 1.0f;
#endif
        for (int j = 0; j < used; ++j) weights[(size_t)r * used + j] = chosen_w[j] * norm * scale;
    }
}
