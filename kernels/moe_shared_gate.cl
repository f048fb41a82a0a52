// The σ gate of a mixture-of-experts block's shared expert (Qwen3.5-MoE's shared_expert_gate, llama.cpp's
// ffn_gate_inp_shexp), applied in place to the shared expert's act(gate)·up rows before its down product:
//
//   moe_shared_gate:  h[r][j] = h[r][j] · σ(Σ_k x[r][k]·w[k]),   r < m, j < n
//
// σ(x·w)·(D·h) = D·(σ(x·w)·h): scaling the n values of h costs n multiplies where scaling the down product's
// output would cost hidden, and needs no second pass over proj, which the routed experts then add into.
// Shapes: x (m, K), w (K), h (m, n) float32. Grid: (⌈n / (WGS·PER)⌉·WGS, m); each work-group takes one row r and
// WGS·PER of its n values: its WGS work-items stride over K (adjacent items read adjacent floats: coalesced), one
// tree sum in local memory gives the row's dot product (each work-group of a row sums the same K values in the same
// order, so every value of the row is scaled by the same σ), then each work-item scales PER values of h.
// fp32 throughout; σ as 1 / (1 + e^−v): e^−v = inf for v ≪ 0 gives 0, the right limit.

#ifndef WGS
#define WGS 64   // work-items per work-group, a power of two (the tree sum halves it)
#endif
#ifndef PER
#define PER 4    // values of h each work-item scales
#endif

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void moe_shared_gate(const int k, const int n, __global const float* restrict x, __global const float* restrict w,
                     __global float* restrict h)
{
    const int lid = get_local_id(0), r = get_global_id(1);
    __local float part[WGS];
    const __global float* xr = x + (size_t)r * k;
    float acc = 0.0f;
    for (int i = lid; i < k; i += WGS) acc += xr[i] * w[i];
    part[lid] = acc;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int span = WGS / 2; span > 0; span >>= 1) {
        if (lid < span) part[lid] += part[lid + span];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float gate = 1.0f / (1.0f + exp(-part[0]));
    __global float* hr = h + (size_t)r * n;
    const int first = get_group_id(0) * WGS * PER;
    for (int i = 0; i < PER; ++i) {
        const int j = first + i * WGS + lid;   // adjacent work-items write adjacent values
        if (j < n) hr[j] *= gate;
    }
}
