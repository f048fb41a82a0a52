// A causal depthwise convolution of length L over the sequence, with its rolling history on the device
// (LFM2's gated short convolution; with GATED 0 the plain form with an activation, as Qwen3.5's conv).
//
//   GATED 1:  rows of the in-projection [B | C | x] (3·H floats each, perfx's fused in_proj output):
//             u[t] = B[t]·x[t],  y[t] = C[t] · Σ_{i<L} w[c][i]·u[t − L + 1 + i]          (per channel c)
//   GATED 0:  rows of H floats x:  u[t] = x[t],  y[t] = act(Σ_{i<L} w[c][i]·u[t − L + 1 + i])  (ACT 1: SiLU)
//
// Positions p = pos .. pos + m − 1, pos read on the device (positions[pos_index]: the decode step's buffer,
// so a recorded launch serves every position). u of positions before 0 is 0. The history is a ring of R rows
// of H floats per layer: u of position p lives in row p mod R, so the state before any position q is rows
// q − L + 1 .. q − 1, still there while q is within R − L + 1 of the last position written: a rolled-back
// chat turn or speculation resumes from the ring, with no copy of the state ever taken.
// Shapes: w (H, L) float, the layer's ring (R, H) float from element ring_offset, y (m, H) float. One work-item per channel walks the m positions
// in order (its own ring writes are visible to it; no two work-items share a channel): coalesced across the
// work-group, which is how a GPU wants an elementwise recurrence, and sequential in t, which L ≤ 8 and
// m ≤ 256 make cheap.

#ifndef WGS
#define WGS 128      // work-items (channels) per work-group
#endif
#ifndef CONV_L
#define CONV_L 3     // the convolution's length (set from the model, not tuned)
#endif
#ifndef GATED
#define GATED 1      // 1: LFM2's B·x in, C·conv out; 0: plain, with ACT (set from the model, not tuned)
#endif
#ifndef ACT
#define ACT 0        // GATED 0: 0 none, 1 SiLU on the output (set from the model, not tuned)
#endif

#include "epilogue.h"

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void short_conv(const int m, const int hidden, __global const float* restrict in, __global const float* restrict w,
                __global float* restrict rings, const int ring_offset, const int ring_rows,
                __global const int* restrict positions, const int pos_index, __global float* restrict y)
{
    const int c = get_global_id(0);
    if (c >= hidden) return;
    __global float* ring = rings + ring_offset;   // this layer's ring
    const int pos = positions[pos_index];
    float taps[CONV_L];
    #pragma unroll
    for (int i = 0; i < CONV_L; ++i) taps[i] = w[(size_t)c * CONV_L + i];
#if GATED
    const int stride = 3 * hidden;
#else
    const int stride = hidden;
#endif
    for (int t = 0; t < m; ++t) {
        const int p = pos + t;
        const __global float* row = in + (size_t)t * stride;
#if GATED
        const float u = row[c] * row[2 * hidden + c];
#else
        const float u = row[c];
#endif
        float acc = taps[CONV_L - 1] * u;
        #pragma unroll
        for (int j = 1; j < CONV_L; ++j) {
            const int q = p - j;
            acc += q >= 0 ? taps[CONV_L - 1 - j] * ring[(size_t)(q % ring_rows) * hidden + c] : 0.0f;
        }
        ring[(size_t)(p % ring_rows) * hidden + c] = u;
#if GATED
        y[(size_t)t * hidden + c] = row[hidden + c] * acc;
#elif ACT == 1
        y[(size_t)t * hidden + c] = SILU(acc);
#else
        y[(size_t)t * hidden + c] = acc;
#endif
    }
}
