// Constrained decoding's mask on the device (perfx/constrain.py): the logits of the tokens a grammar forbids
// set to −∞ before the argmax or the draw reads them, so the logits never leave the device; the host uploads
// one bit a token.
//
// Maths: for each row r, logits[r][i] = −∞ where bit (i mod 32) of mask[r][i / 32] is 0, unchanged where it is
// 1, for 0 ≤ i < V.
// Shape contract: logits (rows, V) floats, in place; mask (rows, ceil(V / 32)) uint32 words, llguidance's
// bitmask layout (bits past V are ignored). One row a sequence: a batch of replies each under its own grammar.
// Launch: global = (ceil(ceil(V / VW) / WGS) · WGS, rows), local = (WGS, 1). Work-item g of row r owns tokens
// [g·VW, g·VW + VW), all in one mask word (VW divides 32): neighbouring work-items write neighbouring logits
// (coalesced), a wave's work-items read the same few words (one transaction), and an allowed logit is neither
// read nor written.

#ifndef WGS
#define WGS 128  // work-items per work-group
#endif
#ifndef VW
#define VW 1  // tokens per work-item: 1, 4 or 8 (a divisor of 32)
#endif

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void logit_mask(const int v, __global float* restrict logits, __global const uint* restrict mask)
{
    const int first = get_global_id(0) * VW;
    if (first >= v) {
        return;
    }
    const size_t row = get_global_id(1);
    __global float* const out = logits + row * (size_t)v;
    const uint bits = mask[row * (size_t)((v + 31) >> 5) + (first >> 5)] >> (first & 31);
    #pragma unroll
    for (int j = 0; j < VW; ++j) {
        if (first + j < v && !((bits >> j) & 1u)) {
            out[first + j] = -INFINITY;
        }
    }
}
