"""Gemma 2, and the Gemma recipe Gemma 3 shares (``perfx.families.gemma3``): RMSNorm also after attention and
the FFN, a tanh-GELU gate, embeddings times √hidden, an attention scale of its own, logit soft-caps (Gemma 2),
sliding-window layers between global ones, norms that multiply by 1 + w, tied embeddings."""

from __future__ import annotations

import math

from perfx.errors import PerfxError
from perfx.families.family import (ChatRules, Family, GGUFHeader, HFConfig, LayerRecipe, Preset, Rope, TensorNames,
                                   ToolFormat, float32_value)

# What google/gemma-3-*-it's template renders for text messages (the system message opens the first user turn,
# "assistant" is "model"): a Gemma GGUF without a template (some converters leave it out) answers in its own
# turns, where ChatML's text means nothing to it.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ (prefix if loop.first else '') + message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Gemma's templates have no tools: Google's function-calling guide prompts for Python calls in a tool_code
# block, and gives the results back in a tool_output block (a user turn: the templates take no other roles).
GEMMA_TOOLS = ToolFormat(
    name="gemma", opener="```tool_code\n", closer="\n```", body="pythonic", listed=True,
    instructions=("You have access to functions. If you decide to invoke any of the function(s), you MUST put it in "
                  "the format of\n```tool_code\n[func_name1(params_name1=params_value1, "
                  "params_name2=params_value2...), func_name2(params)]\n```\nYou SHOULD NOT include any other text "
                  "in the response if you call a function.\n\n{tools}"),
    results=("```tool_output\n", "\n```"))
GEMMA_CHAT = ChatRules(stop_tokens=("<end_of_turn>", "<eos>"), fallback_template=GEMMA_TEMPLATE,
                       template_tokens=("<start_of_turn>", "<end_of_turn>"), prompted_tools=GEMMA_TOOLS)
# post_attention_layernorm is the attention output's own norm here, and the FFN's pre-norm is
# pre_feedforward_layernorm; the checkpoints store w of norms that multiply by 1 + w
GEMMA_TENSORS = TensorNames(hf_vectors={"ffn_norm": "pre_feedforward_layernorm.weight",
                                        "post_attn_norm": "post_attention_layernorm.weight",
                                        "post_ffn_norm": "post_feedforward_layernorm.weight"},
                            hf_norm_offset=1.0)


def gemma_gguf(h: GGUFHeader, large_layers: int, pattern: int, local: Rope) -> dict:
    """The Gemma recipe as llama.cpp reads it: 1/√key_length, except the 27B models (``large_layers`` layers)
    which scale by 1/√(hidden/H); layer i slides when i % pattern < pattern − 1 (set_swa_pattern), with the
    ``local`` RoPE; no window: every layer global."""
    large = h.n_layers == large_layers
    return dict(post_norms=True, ffn_activation="gelu_tanh", embedding_scale=math.sqrt(h.hidden),
                attention_scale=1.0 / math.sqrt(h.hidden / h.n_heads if large else h.head_dim),
                layers=tuple(LayerRecipe(local, h.window) if h.window and i % pattern < pattern - 1
                             else LayerRecipe(h.rope, 0) for i in range(h.n_layers)))


def gemma_hf(h: HFConfig, pattern: int, local: Rope) -> dict:
    """The Gemma recipe as transformers reads it: query_pre_attn_scalar^−½, the soft-caps where set, the
    sliding layers from layer_types or the pattern, with the ``local`` RoPE."""
    config = h.config
    scalar = float(config.get("query_pre_attn_scalar") or h.head_dim)
    sliding = _hf_sliding_layers(config, h.n_layers, pattern)
    return dict(post_norms=True, ffn_activation=_hf_activation(config), attention_scale=scalar ** -0.5,
                embedding_scale=math.sqrt(h.hidden),
                attn_softcap=float(config.get("attn_logit_softcapping") or 0.0),
                final_softcap=float(config.get("final_logit_softcapping") or 0.0),
                layers=tuple(LayerRecipe(local, h.window) if s else LayerRecipe(h.rope, 0) for s in sliding))


def _hf_activation(config: dict) -> str:
    name = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu"):
        # Gemma's "gelu" is the tanh approximation too (transformers maps it so for Gemma checkpoints)
        return "gelu_tanh"
    if name in ("silu", "swish"):
        return "silu"
    raise PerfxError(f"config.json: activation {name!r} is not supported (gelu_pytorch_tanh or silu)")


def _hf_sliding_layers(config: dict, n_layers: int, pattern: int) -> list[bool]:
    """Which layers have the sliding window: transformers' layer_types where given, else its pattern
    (Gemma 3: every `sliding_window_pattern`-th layer global; Gemma 2: even layers slide)."""
    types = config.get("layer_types")
    if types is not None:
        if len(types) != n_layers:
            raise PerfxError(f"config.json: layer_types lists {len(types)} layers but the model has {n_layers}")
        return [t == "sliding_attention" for t in types]
    if not config.get("sliding_window"):
        return [False] * n_layers
    if pattern == 2:
        return [i % 2 == 0 for i in range(n_layers)]
    pattern = int(config.get("sliding_window_pattern") or pattern)
    return [(i + 1) % pattern != 0 for i in range(n_layers)]


def read_gguf(h: GGUFHeader) -> dict:
    # llama.cpp's defaults where the soft-cap keys are absent; even layers slide, with the global RoPE
    return dict(gemma_gguf(h, 46, 2, h.rope),
                attn_softcap=float32_value(h.key("attn_logit_softcapping", 50.0)),
                final_softcap=float32_value(h.key("final_logit_softcapping", 30.0)))


def read_hf(h: HFConfig) -> dict:
    return gemma_hf(h, 2, h.rope)


FAMILY = Family(
    name="gemma2", order=3,
    gguf_names=("gemma2",), hf_names=("gemma2",),
    read_gguf=read_gguf, read_hf=read_hf,
    hf_head_dim=256, hf_tied=True,
    tensors=GEMMA_TENSORS,
    chat=GEMMA_CHAT,
    synthetic={
        # google/gemma-2-2b's config.json
        "gemma-2-2b": Preset(dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                                  num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                  query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                                  final_logit_softcapping=30.0, rope_theta=10000.0, max_position_embeddings=8192,
                                  hidden_activation="gelu_pytorch_tanh")),
    },
)
