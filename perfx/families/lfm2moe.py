"""LFM2-MoE (LFM2-8B-A1B): LFM2's hybrid of gated short convolutions and attention, its first layers with LFM2's
dense MLP and the rest a mixture of experts — a sigmoid router over 32 experts with a selection bias, the top 4
renormalised (llama.cpp's lfm2moe, transformers' Lfm2MoeSparseMoeBlock)."""

from __future__ import annotations

from perfx.errors import PerfxError
from perfx.families import lfm2
from perfx.families.family import ChatRules, Family, GGUFHeader, HFConfig, Preset, TensorNames, gguf_experts


def read_gguf(h: GGUFHeader) -> dict:
    # LFM2's layers, then the experts: sigmoid gating (expert_gating_func 2), renormalised (build_moe_ffn's norm_w)
    return {**lfm2.read_gguf(h), **gguf_experts(h, "sigmoid", norm=True)}


def read_hf(h: HFConfig) -> dict:
    """Lfm2MoeConfig: LFM2's layer pattern, the dense layers' intermediate_size as it is, num_experts,
    num_experts_per_tok, moe_intermediate_size, num_dense_layers, use_expert_bias, norm_topk_prob,
    routed_scaling_factor."""
    config = h.config
    recipe = lfm2.read_hf(h)
    try:
        experts = dict(n_experts=int(config["num_experts"]), n_experts_used=int(config["num_experts_per_tok"]),
                       expert_intermediate=int(config["moe_intermediate_size"]))
    except KeyError as error:
        raise PerfxError(f"config.json lacks {error.args[0]!r}, which every lfm2_moe config has") from None
    return {**recipe, "intermediate_size": int(config["intermediate_size"]), **experts, "expert_gating": "sigmoid",
            "expert_norm": bool(config.get("norm_topk_prob", True)),
            "expert_scale": float(config.get("routed_scaling_factor") or 1.0),
            "expert_bias": bool(config.get("use_expert_bias", True)),
            "dense_layers": int(config.get("num_dense_layers", 2))}


_LAYERS = ["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)]

FAMILY = Family(
    name="lfm2moe", order=12,
    gguf_names=("lfm2moe",), hf_names=("lfm2_moe",),
    read_gguf=read_gguf, read_hf=read_hf,
    layer_kinds=("attention", "conv"),
    hf_rms_eps=1e-5, hf_tied=True,
    tensors=TensorNames(gguf_final_norm=lfm2.FAMILY.tensors.gguf_final_norm,
                        hf_linears=lfm2.FAMILY.tensors.hf_linears, hf_vectors=lfm2.FAMILY.tensors.hf_vectors,
                        hf_final_norm=lfm2.FAMILY.tensors.hf_final_norm),
    chat=ChatRules(stop_tokens=("<|im_end|>", "<|endoftext|>")),
    synthetic={
        "lfm2-8b-a1b": Preset(dict(model_type="lfm2_moe", vocab_size=65536, hidden_size=2048, intermediate_size=7168,
                                   moe_intermediate_size=1792, num_experts=32, num_experts_per_tok=4,
                                   num_dense_layers=2, use_expert_bias=True, norm_topk_prob=True,
                                   num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=8,
                                   rope_theta=1e6, max_position_embeddings=128000, conv_L_cache=3,
                                   layer_types=_LAYERS, tie_embedding=True)),
    },
)
