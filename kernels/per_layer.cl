// Gemma 4's per-layer operations (llama.cpp's src/models/gemma4.cpp), after each layer's MLP; memory-bound, small:
//
//   per_layer_gate: out[t][j] = GELU(gate[t][j]) · inputs[t·stride + offset + j], t < m, j < P: the gate of the
//                   layer's per-layer input (gate, out (m, P) float, out may be gate; inputs (m, stride) float,
//                   each token's per-layer inputs of every layer, this layer's from column offset). GELU is the
//                   tanh form (kernels/epilogue.h), llama.cpp's ggml_gelu.
//                   Launch: global = ceil(m·P / WGS) · WGS, local = WGS.
//   layer_scale:    x[i] = x[i] · scale[0], i < count: the residual stream times the layer's learned scalar,
//                   read from the device (layer_output_scale, one float).
//                   Launch: global = ceil(ceil(count / VW) / WGS) · WGS, local = WGS.
//
// fp32 throughout.

#ifndef WGS
#define WGS 64  // work-items per work-group
#endif

#ifndef VW
#define VW 4  // floats per work-item of layer_scale: 1, 4 or 8
#endif

#include "epilogue.h"

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void per_layer_gate(const int m, const int p, const int stride, const int offset, __global const float* gate,
                    __global const float* restrict inputs, __global float* out)
{
    const int i = get_global_id(0);
    if (i >= m * p) {
        return;
    }
    const int t = i / p;
    const float g = gate[i];
    out[i] = GELU_TANH(g) * inputs[t * stride + offset + i % p];
}

#if VW == 8
#define LOADS(i, p) vload8(i, p)
#define STORES(v, i, p) vstore8(v, i, p)
#elif VW == 4
#define LOADS(i, p) vload4(i, p)
#define STORES(v, i, p) vstore4(v, i, p)
#elif VW == 1
#define LOADS(i, p) ((p)[i])
#define STORES(v, i, p) ((p)[i] = (v))
#else
#error "VW must be 1, 4 or 8"
#endif

__kernel __attribute__((reqd_work_group_size(WGS, 1, 1)))
void layer_scale(const int count, __global const float* restrict scale, __global float* restrict x)
{
    const int c = get_global_id(0);
    const float s = scale[0];
    if ((c + 1) * VW <= count) {
        STORES(LOADS(c, x) * s, c, x);
    } else {
        for (int i = c * VW; i < count; ++i) {
            x[i] *= s;
        }
    }
}
