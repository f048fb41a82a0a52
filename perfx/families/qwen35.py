"""Qwen3.5 (text model_type qwen3_5_text, the multimodal qwen3_5 checkpoints whose text_config is run, GGUF
qwen35): three Gated DeltaNet linear-attention layers (layer kind "delta") to one gated attention layer with
q/k norms and a quarter of each head rotated; norms that multiply by 1 + w in its checkpoints; a pre-tokenizer
of its own."""

from __future__ import annotations

from perfx.errors import PerfxError
from perfx.families.family import ChatRules, Family, GGUFHeader, HFConfig, LayerRecipe, Preset, Rope, TensorNames

FULL_ATTENTION_INTERVAL = 4   # llama.cpp's and transformers' default: every 4th layer full attention
# Qwen3.5's pre-tokenizer regex (llama.cpp's "qwen35"): Qwen2's, with combining marks kept with their letters.
REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
         r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _recipe(recurrent: list[bool], rope: Rope, conv_length: int, hk: int, hv: int, dk: int, dv: int,
            head_map: str) -> dict:
    if all(recurrent):
        raise PerfxError("a Qwen3.5 model with no full-attention layer: perfx needs at least one")
    return dict(qk_norm=True, attention_gate=True, conv_length=conv_length, delta_k_heads=hk, delta_v_heads=hv,
                delta_k_dim=dk, delta_v_dim=dv, delta_head_map=head_map,
                layers=tuple(LayerRecipe(None, 0, "delta") if r else LayerRecipe(rope, 0) for r in recurrent))


def read_gguf(h: GGUFHeader) -> dict:
    """Qwen3.5 as llama.cpp's qwen35.cpp reads it: the linear-attention layers from attention.recurrent_layers,
    else every layer but each full_attention_interval-th; ssm.group_count q/k heads and ssm.time_step_rank v
    heads, both of ssm.state_size (llama.cpp sizes the v heads' tensors by it and the state by
    ssm.inner_size / time_step_rank, so the two must agree); ssm.conv_kernel taps. Text positions make its
    interleaved M-RoPE the NeoX rotation of rope.dimension_count dimensions."""
    arch, key, n_layers = h.arch, h.key, h.n_layers
    hk, hv = int(key("ssm.group_count")), int(key("ssm.time_step_rank"))
    dk, inner = int(key("ssm.state_size")), int(key("ssm.inner_size"))
    if hk < 1 or hv < 1 or inner != hv * dk:
        raise PerfxError(f"GGUF {arch}.ssm.inner_size = {inner} must be {arch}.ssm.time_step_rank {hv} × "
                         f"{arch}.ssm.state_size {dk} = {hv * dk} (llama.cpp's v head size is state_size); the "
                         "header is corrupt")
    flags = h.value("attention.recurrent_layers")
    if flags is not None:
        recurrent = [bool(f) for f in flags][:n_layers]
        if len(recurrent) != n_layers:
            raise PerfxError(f"GGUF {arch}.attention.recurrent_layers lists {len(flags)} layers but the model has "
                             f"{n_layers}; the file is corrupt")
    else:
        interval = int(key("full_attention_interval", FULL_ATTENTION_INTERVAL))
        if interval < 1:
            raise PerfxError(f"GGUF {arch}.full_attention_interval = {interval} must be at least 1")
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    return _recipe(recurrent, h.rope, int(key("ssm.conv_kernel")), hk, hv, dk, dk, "tile")


def read_hf(h: HFConfig) -> dict:
    """Qwen3.5's text config (transformers' Qwen3_5TextConfig): layer_types (or full_attention_interval),
    linear_* sizes, partial_rotary_factor (0.25 by default) of head_dim rotated. The checkpoint's v heads are
    grouped by q/k head (transformers' repeat_interleave), which the kernels read as head_map interleave."""
    config, n_layers = h.config, h.n_layers
    kinds = config.get("layer_types")
    if kinds is None:
        interval = int(config.get("full_attention_interval") or FULL_ATTENTION_INTERVAL)
        kinds = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    if len(kinds) != n_layers or not set(kinds) <= {"linear_attention", "full_attention"}:
        raise PerfxError(f"config.json: layer_types {kinds} must name {n_layers} layers, each 'linear_attention' or "
                         "'full_attention'; the config is corrupt")
    head_dim = int(config.get("head_dim") or 256)
    factor = config.get("partial_rotary_factor") or (config.get("rope_parameters") or {}).get(
        "partial_rotary_factor", 0.25)
    rotary = int(head_dim * float(factor))
    hk, hv = int(config.get("linear_num_key_heads", 16)), int(config.get("linear_num_value_heads", 32))
    dk, dv = int(config.get("linear_key_head_dim", 128)), int(config.get("linear_value_head_dim", 128))
    recipe = _recipe([k == "linear_attention" for k in kinds], Rope(h.theta, rotary, None),
                     int(config.get("linear_conv_kernel_dim", 4)), hk, hv, dk, dv, "interleave")
    return dict(recipe, rotary_dims=rotary)


def text_config(config: dict) -> tuple[str, dict]:
    """The multimodal checkpoint's (every published one) text model, tied as the checkpoint says."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise PerfxError("config.json of model_type qwen3_5 has no text_config; the file is incomplete")
    return "qwen3_5_text", {**text, "model_type": "qwen3_5_text", "tie_word_embeddings": config.get(
        "tie_word_embeddings", text.get("tie_word_embeddings", False))}


# Qwen3.5's text models (config.json text_config): 18 Gated DeltaNet layers and 6 gated attention layers
# (full_attention_interval 4), 16 q/k and 16 v heads of 128, conv kernel 4, attention heads of 256 with a
# quarter rotated. The values are Qwen/Qwen3.5-0.8B's config.json (hidden 1024, intermediate 3584, 8 heads
# / 2 KV of 256, rope_theta 1e7, partial_rotary_factor 0.25, 262144 positions, tied) and Qwen/Qwen3.5-2B's
# (hidden 2048, intermediate 6144, 24 layers, 8 heads / 2 KV, vocab 248320; its DeltaNet sizes as the
# 0.8B's); where they were checked is in benchmarks/NOTES.md.
def _config(hidden: int, inter: int) -> dict:
    return dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
                rope_theta=1e7, partial_rotary_factor=0.25, max_position_embeddings=262144,
                tie_word_embeddings=True)


FAMILY = Family(
    name="qwen35", order=8,
    gguf_names=("qwen35",), hf_names=("qwen3_5_text", "qwen3_5"),
    read_gguf=read_gguf, read_hf=read_hf,
    layer_kinds=("attention", "delta"),
    hf_multimodal={"qwen3_5": text_config},
    tensors=TensorNames(
        # llama.cpp's qwen35 takes the FFN's norm from post_attention_norm (transformers' post_attention_layernorm)
        gguf_vectors={"ffn_norm": "post_attention_norm.weight"},
        # transformers' modeling_qwen3_5, Qwen3_5GatedDeltaNet: a linear_attn layer projects with in_proj_qkv
        # (q, k, v; the v heads grouped by q/k head: the kernels' "interleave" head map, so no rows move),
        # in_proj_z, in_proj_a and in_proj_b, convolves with conv1d (channels, 1, L), and keeps dt_bias, A_log
        # and its gated norm
        hf_linears={"delta_qkv": "linear_attn.in_proj_qkv", "delta_z": "linear_attn.in_proj_z",
                    "delta_a": "linear_attn.in_proj_a", "delta_b": "linear_attn.in_proj_b",
                    "delta_out": "linear_attn.out_proj"},
        hf_vectors={"dt_bias": "linear_attn.dt_bias", "ssm_a": "linear_attn.A_log",
                    "delta_norm": "linear_attn.norm.weight"},
        # every other RMSNorm multiplies by (1 + w) (Qwen3_5RMSNorm), the gated one by w (Qwen3_5RMSNormGated)
        hf_norm_offset=1.0),
    chat=ChatRules(stop_tokens=("<|im_end|>", "<|endoftext|>"), pre_tokenizers={"qwen35": ((REGEX,), False, False)}),
    synthetic={"qwen3.5-0.8b": Preset(_config(1024, 3584)), "qwen3.5-2b": Preset(_config(2048, 6144))},
)
