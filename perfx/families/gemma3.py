"""Gemma 3 (text model_type gemma3_text, and the multimodal gemma3 checkpoints whose text_config is run): the
Gemma recipe (``perfx.families.gemma2``) with q/k norms, no attention soft-cap, five sliding layers to a global
one, and the sliding layers' own RoPE base (10 000, no scaling)."""

from __future__ import annotations

from perfx.errors import PerfxError
from perfx.families.family import Family, GGUFHeader, HFConfig, Preset, Rope, float32_value
from perfx.families.gemma2 import GEMMA_CHAT, GEMMA_TENSORS, gemma_gguf, gemma_hf


def read_gguf(h: GGUFHeader) -> dict:
    # local layers: base 10 000 (or the file's freq_base_swa) and no scaling (llama.cpp's gemma3)
    local = Rope(float32_value(h.key("rope.freq_base_swa", 10000.0)), h.rotary, None)
    return dict(gemma_gguf(h, 62, 6, local), qk_norm=True,
                final_softcap=float32_value(h.value("final_logit_softcapping") or 0.0))


def read_hf(h: HFConfig) -> dict:
    return dict(gemma_hf(h, 6, Rope(h.local_theta, h.head_dim, None)), qk_norm=True)


def text_config(config: dict) -> tuple[str, dict]:
    """A multimodal checkpoint's text model."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise PerfxError("config.json of model_type gemma3 has no text_config; the file is incomplete")
    return "gemma3_text", {"model_type": "gemma3_text", **text}


def _config(hidden: int, inter: int, layers: int) -> dict:
    return dict(model_type="gemma3_text", vocab_size=262144, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                query_pre_attn_scalar=256, sliding_window=512, rope_theta=1e6, rope_local_base_freq=1e4,
                max_position_embeddings=32768, sliding_window_pattern=6)


FAMILY = Family(
    name="gemma3", order=4,
    gguf_names=("gemma3",), hf_names=("gemma3_text", "gemma3"),
    read_gguf=read_gguf, read_hf=read_hf,
    hf_head_dim=256, hf_tied=True, hf_multimodal={"gemma3": text_config},
    tensors=GEMMA_TENSORS,
    chat=GEMMA_CHAT,
    synthetic={"gemma-3-270m": Preset(_config(640, 2048, 18)), "gemma-3-1b": Preset(_config(1152, 6912, 26))},
)
