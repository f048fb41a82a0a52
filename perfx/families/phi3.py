"""Phi-3 and Phi-4-mini (model_type phi3): Llama's recipe with part of each head rotated (Phi-4-mini: 96 of
128), LongRoPE's per-pair factors (short up to the original context, long beyond), QKV and gate-up held fused
(found by their tensors), and llama.cpp's right-stripping of Phi-3's special tokens."""

from __future__ import annotations

import math

from perfx.errors import PerfxError
from perfx.families.family import (ChatRules, Family, GGUFHeader, HFConfig, LayerRecipe, Preset, Rope, TensorNames,
                                   ToolFormat, factor_table, float32_value)

# Phi-4-mini's: its template takes the tools as the system message's "tools" field (a JSON string, between
# <|tool|> tokens), and the model writes its calls as a JSON list between <|tool_call|> and <|/tool_call|>.
# Phi-3's and Phi-3.5's templates have no tools.
PHI4_TOOLS = ToolFormat(name="phi4-mini", marker="<|tool|>", opener="<|tool_call|>", closer="<|/tool_call|>",
                        listed=True, tools_in_system=True)


def read_gguf(h: GGUFHeader) -> dict:
    scaling = _gguf_longrope(h)
    if scaling is None:
        return {}
    return dict(rope_scaling=scaling, layers=tuple(LayerRecipe(Rope(h.theta, h.rotary, scaling), h.window)
                                                  for _ in range(h.n_layers)))


def read_hf(h: HFConfig) -> dict:
    config = h.config
    rotary = int(h.head_dim * float(config.get("partial_rotary_factor")
                                    or (config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)))
    recipe = dict(rotary_dims=rotary)
    scaling = h.scaling
    if scaling:
        scaling = recipe["rope_scaling"] = _hf_longrope(config, scaling, rotary)
    rope = Rope(h.theta, rotary, scaling)
    recipe["layers"] = tuple(LayerRecipe(rope, h.window) for _ in range(h.n_layers))
    return recipe


def _hf_longrope(config: dict, scaling: dict, rotary: int) -> dict:
    """Phi-3's LongRoPE (transformers ``_compute_longrope_parameters``): per-pair factors, short and long,
    and the attention factor that scales cos and sin."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("longrope", "su"):
        return scaling
    original = int(config.get("original_max_position_embeddings")
                   or scaling.get("original_max_position_embeddings") or 0)
    if not original:
        raise PerfxError("config.json: a longrope rope_scaling needs original_max_position_embeddings")
    out = {"rope_type": "longrope", "original_max_position_embeddings": original}
    for name in ("short_factor", "long_factor"):
        factors = scaling.get(name)
        if factors is None or len(factors) != rotary // 2:
            raise PerfxError(f"config.json: rope_scaling.{name} has {len(factors or [])} values, but RoPE over "
                             f"{rotary} dimensions needs {rotary // 2}; the config is corrupt")
        out[name] = [float(f) for f in factors]
    factor = scaling.get("factor") or int(config.get("max_position_embeddings", original)) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    out["attention_factor"] = float(attention)
    return out


def _gguf_longrope(h: GGUFHeader) -> dict | None:
    """A Phi-3 GGUF's LongRoPE: rope_factors_short / rope_factors_long tensors (one per pair of rotated
    dimensions) and {arch}.rope.scaling.attn_factor, which llama.cpp multiplies into cos and sin."""
    tensors = h.reader.tensors
    names = ("rope_factors_short.weight", "rope_factors_long.weight")
    if not any(n in tensors for n in names):
        return None
    out = {"rope_type": "longrope",
           "original_max_position_embeddings": int(h.value("rope.scaling.original_context_length")
                                                   or h.value("context_length") or 4096),
           "attention_factor": float32_value(h.value("rope.scaling.attn_factor") or 1.0)}
    for name, field_name in zip(names, ("short_factor", "long_factor")):
        tensor = tensors.get(name)
        if tensor is None:
            raise PerfxError(f"GGUF has {' or '.join(n for n in names if n in tensors)} but not {name}: a LongRoPE "
                             "file needs both factor tables; the file is incomplete")
        out[field_name] = factor_table(tensor, name, h.rotary)
    return out


FAMILY = Family(
    name="phi3", order=5,
    gguf_names=("phi3",), hf_names=("phi3",),
    read_gguf=read_gguf, read_hf=read_hf,
    hf_rms_eps=1e-5,
    gguf_rope_scaling=True,   # its LongRoPE is in tensors; whatever rope.scaling.type says
    tensors=TensorNames(),    # attn_qkv / qkv_proj and ffn_up / gate_up_proj: the common fused names
    # llama.cpp drops the whitespace after Phi-3's special tokens but these, chosen by general.name
    chat=ChatRules(stop_tokens=("<|end|>", "<|endoftext|>"), rstrip_names=("phi-3", "phi3"),
                   rstrip_keep=("<unk>", "<s>", "<|endoftext|>"), tool_formats=(PHI4_TOOLS,)),
    synthetic={
        "phi-4-mini": Preset(dict(model_type="phi3", vocab_size=200064, hidden_size=3072, intermediate_size=8192,
                                  num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
                                  partial_rotary_factor=0.75, rope_theta=1e4, max_position_embeddings=131072,
                                  original_max_position_embeddings=4096, sliding_window=262144,
                                  tie_word_embeddings=True)),
    },
)
