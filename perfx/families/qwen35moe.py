"""Qwen3.5-MoE (Qwen3.5-35B-A3B; GGUF qwen35moe, Hugging Face qwen3_5_moe_text and the multimodal qwen3_5_moe whose
text_config is run): Qwen3.5's hybrid of Gated DeltaNet and gated attention layers, and on every layer a mixture of
experts — a softmax router over all experts, the top k renormalised — beside a shared expert, a SwiGLU MLP every
token runs, its output times σ(x·w_gate) (llama.cpp's qwen35moe, transformers' Qwen3_5MoeSparseMoeBlock)."""

from __future__ import annotations

from perfx.errors import PerfxError
from perfx.families import qwen35
from perfx.families.family import ChatRules, Family, GGUFHeader, HFConfig, Preset, TensorNames, gguf_experts


def read_gguf(h: GGUFHeader) -> dict:
    """Qwen3.5's layers (``qwen35.read_gguf``), then the experts as llama.cpp's qwen35moe reads them: softmax gating,
    the chosen weights always renormalised (build_moe_ffn's norm_w), and the σ-gated shared expert every layer holds
    (ffn_gate_inp_shexp, ffn_{gate,up,down}_shexp) of expert_shared_feed_forward_length, else feed_forward_length."""
    shared = h.value("expert_shared_feed_forward_length") or h.key("feed_forward_length")
    if int(shared) < 1:
        raise PerfxError(f"GGUF {h.arch}.expert_shared_feed_forward_length = {shared}: the shared expert every "
                         f"{h.arch} layer holds needs a positive width; the header is corrupt")
    # the shared expert is the only gated MLP of the model: its width is the recipe's intermediate_size
    return {**qwen35.read_gguf(h), **gguf_experts(h, "softmax", norm=True), "expert_shared": int(shared),
            "expert_shared_gate": True, "intermediate_size": int(shared)}


def read_hf(h: HFConfig) -> dict:
    """Qwen3_5MoeTextConfig: Qwen3.5's keys, num_experts, num_experts_per_tok, moe_intermediate_size,
    shared_expert_intermediate_size; its router renormalises the chosen weights unconditionally
    (Qwen3_5MoeTopKRouter has no norm_topk_prob)."""
    config = h.config
    try:
        experts = dict(n_experts=int(config["num_experts"]), n_experts_used=int(config["num_experts_per_tok"]),
                       expert_intermediate=int(config["moe_intermediate_size"]),
                       expert_shared=int(config["shared_expert_intermediate_size"]))
    except KeyError as error:
        raise PerfxError(f"config.json lacks {error.args[0]!r}, which every qwen3_5_moe config has") from None
    if experts["expert_shared"] < 1:
        raise PerfxError(f"config.json: shared_expert_intermediate_size = {experts['expert_shared']} must be "
                         "positive (every Qwen3.5-MoE layer holds a shared expert)")
    return {**qwen35.read_hf(h), **experts, "expert_gating": "softmax", "expert_norm": True,
            "expert_shared_gate": True, "intermediate_size": experts["expert_shared"]}


def text_config(config: dict) -> tuple[str, dict]:
    """The multimodal checkpoint's (every published one) text model, tied as the checkpoint says."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise PerfxError("config.json of model_type qwen3_5_moe has no text_config; the file is incomplete")
    return "qwen3_5_moe_text", {**text, "model_type": "qwen3_5_moe_text", "tie_word_embeddings": config.get(
        "tie_word_embeddings", text.get("tie_word_embeddings", False))}


# Qwen3.5-35B-A3B's text model: transformers' Qwen3_5MoeTextConfig defaults, which its docstring names as that
# checkpoint's (vocab 248320, hidden 2048, 40 layers, 16 heads / 2 KV of 256, DeltaNet 16 q/k and 32 v heads of 128,
# 256 experts of 512, 8 used, a shared expert of 512, untied); rope_theta 1e7, a quarter of each head rotated and
# 262144 positions as the Qwen3.5 presets (qwen35.py).
_35B_A3B = dict(model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_conv_kernel_dim=4, full_attention_interval=4, moe_intermediate_size=512,
                shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8, rope_theta=1e7,
                partial_rotary_factor=0.25, max_position_embeddings=262144, tie_word_embeddings=False)

FAMILY = Family(
    name="qwen35moe", order=16,
    gguf_names=("qwen35moe",), hf_names=("qwen3_5_moe_text", "qwen3_5_moe"),
    read_gguf=read_gguf, read_hf=read_hf,
    layer_kinds=("attention", "delta"),
    hf_multimodal={"qwen3_5_moe": text_config},
    tensors=qwen35.FAMILY.tensors,
    # its GGUFs name Qwen3.5's pre-tokenizer, "qwen35", which qwen35.py brings
    chat=ChatRules(stop_tokens=("<|im_end|>", "<|endoftext|>")),
    synthetic={"qwen3.5-35b-a3b": Preset(_35B_A3B)},
)
