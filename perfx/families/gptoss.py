"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with a learned sink logit per head, biases on q, k, v and o,
a sliding window of 128 on the even layers and full attention on the odd ones, YaRN RoPE; on every layer a
mixture of experts — a router with a bias, the top 4 of 32 (20b) or 128 (120b) by their logits and a softmax over
the chosen, each expert's gate, up and down with biases and the clamped SwiGLU (α 1.702, limit 7). llama.cpp's
gpt-oss (src/models/openai-moe-iswa.cpp, llama-model.cpp LLM_ARCH_OPENAI_MOE), transformers' GptOssForCausalLM.
"""

from __future__ import annotations

from perfx.errors import PerfxError
from perfx.families.family import (ChatRules, Family, GGUFHeader, HFConfig, LayerRecipe, Preset, Rope, TensorNames,
                                   ToolFormat, float32_value, gguf_experts)
from perfx.reference import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, yarn_attention_factor


def _yarn(factor: float, original: int, beta_fast: float, beta_slow: float, truncate: bool,
          attention_factor: float) -> dict:
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": beta_fast, "beta_slow": beta_slow, "truncate": truncate, "attention_factor": attention_factor}


def _layers(n_layers: int, rope: Rope, window: int, sliding: list[bool]) -> tuple:
    return tuple(LayerRecipe(rope, window if slides else 0) for slides in sliding)


def _recipe(rope: Rope, window: int, sliding: list[bool]) -> dict:
    return {"rope_scaling": rope.scaling, "layers": _layers(len(sliding), rope, window, sliding),
            "qkv_bias": True, "o_bias": True, "attention_sinks": True, "expert_biases": True,
            "expert_activation": "swiglu_oai", "sliding_window": window}


def read_gguf(h: GGUFHeader) -> dict:
    """llama.cpp's gpt-oss: set_swa_pattern(2) (layer i slides where i % 2 == 0), LLAMA_SWA_TYPE_STANDARD (the
    last sliding_window positions), rope.scaling.type "yarn" with its factor and original context (ggml's rope_yarn
    rounds the ramp's ends out: truncate), the experts' softmax over the chosen logits, not renormalised."""
    kind = h.value("rope.scaling.type")
    if kind != "yarn":
        raise PerfxError(f"GGUF {h.arch}.rope.scaling.type = {kind!r}: gpt-oss files carry \"yarn\" (its "
                         "converter writes it); the file was not written by llama.cpp's converter")
    if not h.window:
        raise PerfxError(f"GGUF header lacks {h.arch}.attention.sliding_window, which gpt-oss's converter writes")
    factor = float32_value(h.key("rope.scaling.factor"))
    scaling = _yarn(factor, int(h.key("rope.scaling.original_context_length")),
                    float32_value(h.value("rope.scaling.yarn_beta_fast", 32.0)),
                    float32_value(h.value("rope.scaling.yarn_beta_slow", 1.0)), True,
                    float32_value(h.value("rope.scaling.yarn_attn_factor", 1.0)) * yarn_attention_factor(factor))
    rope = Rope(h.theta, h.rotary, scaling)
    return {**_recipe(rope, h.window, [i % 2 == 0 for i in range(h.n_layers)]),
            **gguf_experts(h, "softmax_weight", norm=False)}


def read_hf(h: HFConfig) -> dict:
    """GptOssConfig: num_local_experts, num_experts_per_tok (experts_per_token), intermediate_size (each expert's),
    sliding_window, layer_types, rope_scaling (yarn: factor, original_max_position_embeddings, beta_fast,
    beta_slow, truncate), swiglu_limit."""
    config = h.config
    try:
        used = int(config.get("num_experts_per_tok") or config["experts_per_token"])
        experts = dict(n_experts=int(config["num_local_experts"]), n_experts_used=used,
                       expert_intermediate=int(config["intermediate_size"]))
    except KeyError as error:
        raise PerfxError(f"config.json lacks {error.args[0]!r}, which every gpt_oss config has") from None
    limit = float(config.get("swiglu_limit", SWIGLU_OAI_LIMIT))
    if limit != SWIGLU_OAI_LIMIT:
        raise PerfxError(f"config.json: swiglu_limit = {limit}; perfx's clamped SwiGLU has gpt-oss's limit "
                         f"{SWIGLU_OAI_LIMIT} (and α {SWIGLU_OAI_ALPHA})")
    s = h.scaling or {}
    if s.get("rope_type", s.get("type")) != "yarn":
        raise PerfxError(f"config.json: rope_scaling {s or None}: gpt-oss checkpoints use YaRN (rope_type \"yarn\")")
    factor = float(s["factor"])
    attention = s.get("attention_factor")
    scaling = _yarn(factor, int(s.get("original_max_position_embeddings", 4096)), float(s.get("beta_fast", 32.0)),
                    float(s.get("beta_slow", 1.0)), bool(s.get("truncate", True)),
                    float(attention) if attention is not None else yarn_attention_factor(factor))
    types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(h.n_layers)]
    if len(types) != h.n_layers:
        raise PerfxError(f"config.json: layer_types lists {len(types)} layers but num_hidden_layers = {h.n_layers}")
    return {**_recipe(Rope(h.theta, h.head_dim, scaling), h.window, [t == "sliding_attention" for t in types]),
            **experts, "intermediate_size": experts["expert_intermediate"], "expert_gating": "softmax_weight",
            "expert_norm": False}


# The harmony format's turn ends: <|return|> ends the final answer, <|call|> a tool call. <|end|> ends a message
# within a turn (the analysis channel before the final one), so it is not one: llama.cpp drops it from its
# end-of-generation list where the vocabulary has <|return|> and <|call|> (llama-vocab.cpp), and the checkpoint's
# generation_config.json lists <|return|>, <|endoftext|>, <|call|>.
STOP_TOKENS = ("<|return|>", "<|call|>", "<|endoftext|>")

# Harmony's messages (perfx.tools.HarmonyParser reads them): the reply is a run of
# <|start|>assistant<|channel|>{analysis|commentary|final}<|message|>...<|end|>, the first's <|start|>assistant in
# the prompt; reasoning in analysis, the answer in final, a call as a commentary message to=functions.NAME whose body
# is its JSON arguments, ended by <|call|>. The template renders the tools (a TypeScript namespace in the developer
# message), the calls and the results itself.
HARMONY_TOOLS = ToolFormat(name="harmony", marker="<|channel|>", body="harmony")

FAMILY = Family(
    name="gptoss", order=15,
    gguf_names=("gpt-oss",), hf_names=("gpt_oss",),
    read_gguf=read_gguf, read_hf=read_hf,
    hf_rms_eps=1e-5, gguf_rope_scaling=True,
    # llama.cpp's gpt-oss normalises the FFN's input with attn_post_norm (post_attention_norm); transformers names
    # the router mlp.router and holds each projection's experts stacked (mlp.experts.gate_up_proj, gate and up
    # interleaved)
    tensors=TensorNames(gguf_vectors={"ffn_norm": "post_attention_norm.weight"}, hf_router="router",
                        hf_experts="gpt_oss"),
    chat=ChatRules(stop_tokens=STOP_TOKENS, tool_formats=(HARMONY_TOOLS,)),
    synthetic={
        # openai/gpt-oss-20b's config.json
        "gpt-oss-20b": Preset(dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                                   num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=24,
                                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, rope_theta=150000.0,
                                   rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                                                 "truncate": False},
                                   sliding_window=128, attention_bias=True, rms_norm_eps=1e-5,
                                   max_position_embeddings=131072, tie_word_embeddings=False),
                              experts="mxfp4"),
    },
)
