// gpt-oss's clamped SwiGLU, the routed experts' activation (gemv_moe.cl, gemm_moe.cl). Its own header, not
// epilogue.h, because every family including epilogue.h is pinned to its code: only the MoE families read it.
#ifndef PERFX_SWIGLU_OAI_H
#define PERFX_SWIGLU_OAI_H

// g' = min(g, 7), u' = clamp(u, −7, 7), g'·σ(1.702·g')·(u' + 1) (llama.cpp's ggml_swiglu_oai, transformers'
// GptOssExperts; perfx.reference.swiglu_oai)
#define SWIGLU_OAI(g, u) (fmin((g), 7.0f) / (1.0f + exp(-1.702f * fmin((g), 7.0f))) * (clamp((u), -7.0f, 7.0f) + 1.0f))

#endif
