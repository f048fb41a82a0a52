"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3's attention with q/k norms, and on every layer a mixture of experts — a softmax
router over 128 experts, the top 8 with their weights renormalised (llama.cpp's qwen3moe, transformers'
Qwen3MoeSparseMoeBlock)."""

from __future__ import annotations

from perfx.errors import PerfxError
from perfx.families.family import ChatRules, Family, GGUFHeader, HFConfig, Preset, TensorNames, gguf_experts


def read_gguf(h: GGUFHeader) -> dict:
    # llama.cpp's qwen3moe always renormalises the chosen weights (build_moe_ffn's norm_w)
    return {"qk_norm": True, **gguf_experts(h, "softmax", norm=True)}


def read_hf(h: HFConfig) -> dict:
    """Qwen3MoeConfig: num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob; every layer sparse
    (decoder_sparse_step 1, no mlp_only_layers) in every release."""
    config = h.config
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1)) != 1:
        raise PerfxError("config.json: mlp_only_layers or decoder_sparse_step != 1: perfx runs Qwen3-MoE checkpoints "
                         "whose every layer is a mixture of experts (every published one)")
    try:
        experts = dict(n_experts=int(config["num_experts"]), n_experts_used=int(config["num_experts_per_tok"]),
                       expert_intermediate=int(config["moe_intermediate_size"]))
    except KeyError as error:
        raise PerfxError(f"config.json lacks {error.args[0]!r}, which every qwen3_moe config has") from None
    return {"sliding_window": 0, "qk_norm": True, **experts, "expert_gating": "softmax",
            "expert_norm": bool(config.get("norm_topk_prob", False))}


FAMILY = Family(
    name="qwen3moe", order=11,
    gguf_names=("qwen3moe",), hf_names=("qwen3_moe",),
    read_gguf=read_gguf, read_hf=read_hf,
    tensors=TensorNames(),
    chat=ChatRules(stop_tokens=("<|im_end|>", "<|endoftext|>")),
    synthetic={
        "qwen3-30b-a3b": Preset(dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                                     intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                                     num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48,
                                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_theta=1e6,
                                     max_position_embeddings=40960, tie_word_embeddings=False)),
    },
)
