"""Qwen3: Llama's recipe with a per-head RMSNorm of q and k before RoPE, and a head_dim of its own."""

from __future__ import annotations

from perfx.families.family import ChatRules, Family, GGUFHeader, HFConfig, Preset, TensorNames
from perfx.families.qwen2 import HERMES_TOOLS


def read_gguf(h: GGUFHeader) -> dict:
    return {"qk_norm": True}


def read_hf(h: HFConfig) -> dict:
    # its sliding_window is off unless use_sliding_window, as Qwen2's
    return {"sliding_window": 0, "qk_norm": True}


FAMILY = Family(
    name="qwen3", order=2,
    gguf_names=("qwen3",), hf_names=("qwen3",),
    read_gguf=read_gguf, read_hf=read_hf,
    tensors=TensorNames(),
    chat=ChatRules(stop_tokens=("<|im_end|>", "<|endoftext|>"), tool_formats=(HERMES_TOOLS,),
                   prompted_tools=HERMES_TOOLS),
    synthetic={
        "qwen3-1.7b": Preset(dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                  rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True)),
    },
)
