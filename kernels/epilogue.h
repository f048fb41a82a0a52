// The fused epilogues of the GEMV and GEMM families, one code each and the same in every kernel file
// (perfx/ops/epilogue.py holds the same table by name), and the activations, written once.
//
//   EPI_NONE      y = W·x                        the GEMVs add the weight's bias here where it has one
//                                                (has_bias, a launch argument), whatever the epilogue
//   EPI_BIAS      y = W·x + bias                 the GEMMs: its own build, so the plain one reads no bias
//   EPI_SILU_MUL  y = SiLU(W_g·x) · (W_u·x)      SwiGLU (Llama, Qwen, ...): W holds gate rows, then up rows
//   EPI_GELU_MUL  y = GELU(W_g·x) · (W_u·x)      GeGLU (Gemma), GELU's tanh form
//
// A kernel file sets EPILOGUE (chosen by the wrapper, never tuned) before it includes this header; EPI_GATED
// then says whether it pairs gate and up rows and GATE_ACT is the gate's activation. Both activations take
// a float or a float vector and run in fp32 whatever the kernel's arithmetic.

#ifndef PERFX_EPILOGUE_H
#define PERFX_EPILOGUE_H

#define EPI_NONE 0
#define EPI_BIAS 1
#define EPI_SILU_MUL 2
#define EPI_GELU_MUL 3

// SiLU(v) = v·σ(v) = v / (1 + e^−v). For v ≪ 0, e^−v overflows to +inf and the quotient is −0: exact.
#define SILU(v) ((v) / (1.0f + exp(-(v))))

// GELU, tanh form: 0.5·v·(1 + tanh(√(2/π)·v·(1 + 0.044715·v²))), llama.cpp's ggml_gelu and Hugging Face's
// gelu_pytorch_tanh. The builtin tanh saturates to ±1; where v² overflows (|v| > 1.8e19) its argument is
// ±inf and tanh(±inf) = ±1, so every finite v gives a finite result (v, or −0, at the tails).
#define GELU_TANH(v) (0.5f * (v) * (1.0f + tanh(0.7978845608f * (v) * (1.0f + 0.044715f * (v) * (v)))))

#ifdef EPILOGUE
#define EPI_GATED (EPILOGUE == EPI_SILU_MUL || EPILOGUE == EPI_GELU_MUL)
#if EPILOGUE == EPI_GELU_MUL
#define GATE_ACT(v) GELU_TANH(v)
#else
#define GATE_ACT(v) SILU(v)
#endif
#endif

#endif  // PERFX_EPILOGUE_H
