// Gemma 3n's per-token operations around each layer (llama.cpp's src/models/gemma3n-iswa.cpp, transformers'
// Gemma3nTextAltUp and Gemma3nTextLaurelBlock): AltUp's A streams of the residual (A ≤ 8), LAuReL's combination
// and the sparse gate of the first layers. fp32 throughout. Rows are tokens, of k floats at t·k; the A streams
// of m rows lie `stride` floats apart (stream j, row t at j·stride + t·k). Each kernel guards its edges: any
// m ≥ 1, any k ≥ 1.
//
//   altup_router:     r_a = tanh(Σ_c x[t][c]·γ[c]·W[a][c] / sqrt(mean(x[t]²) + eps)), a < A (γ holds the
//                     router norm's γ / hidden); out[t][j] = plus + Σ_a mix[j][a]·r_a, j < n_out (mix (n_out, A):
//                     the prediction coefficients (A·A, A) with plus 0, or the correction's (A, A) with plus 1).
//                     One work-group a row: global = m·WGS, local = WGS.
//   altup_predict:    out[j][t][c] = s[j][t][c] + Σ_i coefs[t][j·A + i]·s[i][t][c] (s, out: A streams, stride).
//                     global = (ceil(k / WGS)·WGS, m), local = (WGS, 1).
//   altup_correct:    s[j][t][c] = pred[j][t][c] + (y[t][c] − pred[0][t][c])·scale[t][j]; first[t][c] =
//                     s[0][t][c]·γ[c] (the active stream, 0, scaled: what the per-layer input's gate reads).
//                     global = (ceil(k / WGS)·WGS, m), local = (WGS, 1).
//   altup_add_normed: s[j][t] += p[t] / sqrt(mean(p[t]²) + eps)·γ for from ≤ j < A (the per-layer input into the
//                     streams past the active one). One work-group a row.
//   altup_rescale:    out[offset + t·k + c] = (accumulate ? out : 0) + weight·y[t][c]·sqrt(Σ target[t]² / Σ y[t]²)
//                     (a projection at the magnitude of the stream it came from or goes to). One work-group a row.
//   laurel_combine:   h = (a / sqrt(mean(a²) + eps)·γ_a + act + xb + l / sqrt(mean(l²) + eps)·γ_l) / √2 into x,
//                     then xb = h / sqrt(mean(h²) + eps)·γ_f: the attention's output (a, through its post-norm),
//                     the active stream (act), LAuReL's x + norm(R·L·x) with x the normed input (xb) and l = R·L·x,
//                     and the FFN's norm. xb is read, then written, by the same work-item. One work-group a row.
//   sparse_gate:      over a row's gate g (gu[t][0..n)) and up (gu[t][n..2n)): cutoff = mean(g) + z·std(g) (std
//                     over n, as transformers' Gemma3nTextMLP; llama.cpp's gemma3n divides by n − 1),
//                     out[t][c] = GELU(max(g[c] − cutoff, 0))·up[c] (tanh GELU, kernels/epilogue.h).
//                     One work-group a row; out must not alias gu.
//
// A work-group's row sums are a local-memory tree (WGS a power of two); a work-item's second sweep reads back
// only what it wrote itself.

#ifndef WGS
#define WGS 128  // work-items a work-group (a power of two)
#endif

#define MAX_STREAMS 8

#include "epilogue.h"

// The sums of `count` values over the work-group, in place in sums[0..count) of every work-item.
void group_sums(float* sums, const int count, __local float* scratch)
{
    const int lid = get_local_id(0);
    for (int v = 0; v < count; ++v) {
        scratch[v * WGS + lid] = sums[v];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int span = WGS / 2; span > 0; span >>= 1) {
        if (lid < span) {
            for (int v = 0; v < count; ++v) {
                scratch[v * WGS + lid] += scratch[v * WGS + lid + span];
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int v = 0; v < count; ++v) {
        sums[v] = scratch[v * WGS];
    }
    barrier(CLK_LOCAL_MEM_FENCE);   // the scratch may be reused at once
}

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void altup_router(const int k, const int streams, const int n_out, const float eps, const float plus,
                  __global const float* restrict x, __global const float* restrict gamma,
                  __global const float* restrict w, __global const float* restrict mix, __global float* restrict out)
{
    __local float scratch[(MAX_STREAMS + 1) * WGS];
    __local float routed[MAX_STREAMS];
    const int t = get_group_id(0), lid = get_local_id(0);
    const __global float* row = x + (size_t)t * k;
    float sums[MAX_STREAMS + 1];
    for (int a = 0; a <= MAX_STREAMS; ++a) {
        sums[a] = 0.0f;
    }
    for (int c = lid; c < k; c += WGS) {
        const float v = row[c];
        const float g = v * gamma[c];
        sums[MAX_STREAMS] = fma(v, v, sums[MAX_STREAMS]);
        for (int a = 0; a < streams; ++a) {
            sums[a] = fma(g, w[a * k + c], sums[a]);
        }
    }
    sums[streams] = sums[MAX_STREAMS];
    group_sums(sums, streams + 1, scratch);
    const float inv = rsqrt(sums[streams] / k + eps);
    if (lid < streams) {
        routed[lid] = tanh(sums[lid] * inv);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int j = lid; j < n_out; j += WGS) {
        float v = plus;
        for (int a = 0; a < streams; ++a) {
            v = fma(mix[j * streams + a], routed[a], v);
        }
        out[t * n_out + j] = v;
    }
}

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void altup_predict(const int k, const int streams, const int stride, __global const float* restrict s,
                   __global const float* restrict coefs, __global float* restrict out)
{
    __local float c[MAX_STREAMS * MAX_STREAMS];
    const int col = get_global_id(0), t = get_global_id(1), lid = get_local_id(0);
    for (int i = lid; i < streams * streams; i += WGS) {
        c[i] = coefs[t * streams * streams + i];
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    if (col >= k) {
        return;
    }
    const size_t at = (size_t)t * k + col;
    float v[MAX_STREAMS];
    for (int i = 0; i < streams; ++i) {
        v[i] = s[i * (size_t)stride + at];
    }
    for (int j = 0; j < streams; ++j) {
        float p = v[j];
        for (int i = 0; i < streams; ++i) {
            p = fma(c[j * streams + i], v[i], p);
        }
        out[j * (size_t)stride + at] = p;
    }
}

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void altup_correct(const int k, const int streams, const int stride, __global const float* restrict pred,
                   __global const float* restrict y, __global const float* restrict scale,
                   __global const float* restrict gamma, __global float* restrict s, __global float* restrict first)
{
    const int col = get_global_id(0), t = get_global_id(1);
    if (col >= k) {
        return;
    }
    const size_t at = (size_t)t * k + col;
    const float innovation = y[at] - pred[at];
    for (int j = 0; j < streams; ++j) {
        const float v = fma(innovation, scale[t * streams + j], pred[j * (size_t)stride + at]);
        s[j * (size_t)stride + at] = v;
        if (j == 0) {
            first[at] = v * gamma[col];
        }
    }
}

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void altup_add_normed(const int k, const int streams, const int stride, const int from, const float eps,
                      __global const float* restrict p, __global const float* restrict gamma,
                      __global float* restrict s)
{
    __local float scratch[WGS];
    const int t = get_group_id(0), lid = get_local_id(0);
    const __global float* row = p + (size_t)t * k;
    float sums[1] = {0.0f};
    for (int c = lid; c < k; c += WGS) {
        sums[0] = fma(row[c], row[c], sums[0]);
    }
    group_sums(sums, 1, scratch);
    const float inv = rsqrt(sums[0] / k + eps);
    for (int c = lid; c < k; c += WGS) {
        const float v = row[c] * inv * gamma[c];
        for (int j = from; j < streams; ++j) {
            s[j * (size_t)stride + (size_t)t * k + c] += v;
        }
    }
}

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void altup_rescale(const int k, const int offset, const float weight, const int accumulate,
                   __global const float* restrict target, __global const float* restrict y, __global float* out)
{
    __local float scratch[2 * WGS];
    const int t = get_group_id(0), lid = get_local_id(0);
    const __global float* want = target + (size_t)t * k;
    const __global float* row = y + (size_t)t * k;
    float sums[2] = {0.0f, 0.0f};
    for (int c = lid; c < k; c += WGS) {
        sums[0] = fma(want[c], want[c], sums[0]);
        sums[1] = fma(row[c], row[c], sums[1]);
    }
    group_sums(sums, 2, scratch);
    const float ratio = weight * sqrt(sums[0] / sums[1]);
    __global float* dst = out + offset + (size_t)t * k;
    for (int c = lid; c < k; c += WGS) {
        dst[c] = (accumulate ? dst[c] : 0.0f) + row[c] * ratio;
    }
}

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void laurel_combine(const int k, const float eps, __global const float* restrict a, __global const float* restrict l,
                    __global const float* restrict act, __global const float* restrict gamma_a,
                    __global const float* restrict gamma_l, __global const float* restrict gamma_f,
                    __global float* restrict x, __global float* restrict xb)
{
    __local float scratch[2 * WGS];
    const int t = get_group_id(0), lid = get_local_id(0);
    const size_t row = (size_t)t * k;
    float sums[2] = {0.0f, 0.0f};
    for (int c = lid; c < k; c += WGS) {
        sums[0] = fma(a[row + c], a[row + c], sums[0]);
        sums[1] = fma(l[row + c], l[row + c], sums[1]);
    }
    group_sums(sums, 2, scratch);
    const float inv_a = rsqrt(sums[0] / k + eps), inv_l = rsqrt(sums[1] / k + eps);
    float squares[1] = {0.0f};
    for (int c = lid; c < k; c += WGS) {
        const float h = (a[row + c] * inv_a * gamma_a[c] + act[row + c] + xb[row + c]
                         + l[row + c] * inv_l * gamma_l[c]) * M_SQRT1_2_F;
        x[row + c] = h;
        squares[0] = fma(h, h, squares[0]);
    }
    group_sums(squares, 1, scratch);
    const float inv_h = rsqrt(squares[0] / k + eps);
    for (int c = lid; c < k; c += WGS) {
        xb[row + c] = x[row + c] * inv_h * gamma_f[c];
    }
}

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void sparse_gate(const int n, const float z, __global const float* restrict gu, __global float* restrict out)
{
    __local float scratch[WGS];
    const int t = get_group_id(0), lid = get_local_id(0);
    const __global float* gate = gu + (size_t)t * 2 * n;
    float sums[1] = {0.0f};
    for (int c = lid; c < n; c += WGS) {
        sums[0] += gate[c];
    }
    group_sums(sums, 1, scratch);
    const float mean = sums[0] / n;
    // the deviations in a second pass: a one-pass Σg² − n·mean² loses the spread to cancellation in fp32
    sums[0] = 0.0f;
    for (int c = lid; c < n; c += WGS) {
        const float d = gate[c] - mean;
        sums[0] = fma(d, d, sums[0]);
    }
    group_sums(sums, 1, scratch);
    const float cutoff = mean + z * sqrt(sums[0] / n);
    for (int c = lid; c < n; c += WGS) {
        const float g = fmax(gate[c] - cutoff, 0.0f);
        out[(size_t)t * n + c] = GELU_TANH(g) * gate[n + c];
    }
}
