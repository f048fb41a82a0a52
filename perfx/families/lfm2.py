"""LFM2 (LiquidAI): most layers a gated short convolution (layer kind "conv"), the rest attention with q/k
norms; transformers' names of its own (operator_norm, feed_forward w1/w3/w2, out_proj, embedding_norm as the
final norm, which llama.cpp's converter calls token_embd_norm)."""

from __future__ import annotations

from perfx.errors import PerfxError
from perfx.families.family import (ChatRules, Family, GGUFHeader, HFConfig, LayerRecipe, Preset, TensorNames,
                                   ToolFormat, per_layer)

# LFM2's: its template lists the tools between <|tool_list_start|> and <|tool_list_end|> and wraps a tool's
# result in <|tool_response_start|> ... <|tool_response_end|>; the model writes Python calls,
# <|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|> (llama.cpp's copy of the template writes a
# JSON list there, which is read too).
LFM2_TOOLS = ToolFormat(name="lfm2", marker="<|tool_list_start|>", opener="<|tool_call_start|>",
                        closer="<|tool_call_end|>", body="pythonic", listed=True,
                        results=("<|tool_response_start|>", "<|tool_response_end|>"))


def read_gguf(h: GGUFHeader) -> dict:
    # llama.cpp's lfm2: a layer with no kv heads (head_count_kv is per layer) is a short-conv layer
    kv_heads = per_layer(h.key("attention.head_count_kv"), h.n_layers, f"{h.arch}.attention.head_count_kv")
    attention = [kv for kv in kv_heads if kv]
    if not attention or len(set(attention)) > 1:
        raise PerfxError(f"GGUF {h.arch}.attention.head_count_kv = {kv_heads}: perfx runs LFM2 files with "
                         "one kv head count on every attention layer and at least one attention layer")
    return dict(n_kv_heads=attention[0], qk_norm=True, conv_length=int(h.key("shortconv.l_cache")), layers=tuple(
        LayerRecipe(h.rope, h.window) if kv else LayerRecipe(None, 0, "conv") for kv in kv_heads))


def read_hf(h: HFConfig) -> dict:
    """The layer pattern (layer_types, or the older full_attn_idxs; every layer attention without either),
    q/k norms, the convolution's length and the MLP's width, as transformers' Lfm2Config reads them."""
    config, n_layers = h.config, h.n_layers
    kinds = config.get("layer_types")
    if kinds is None:
        full = config.get("full_attn_idxs")
        full = range(n_layers) if full is None else set(full)
        kinds = ["full_attention" if i in full else "conv" for i in range(n_layers)]
    if len(kinds) != n_layers or not set(kinds) <= {"full_attention", "conv"}:
        raise PerfxError(f"config.json: layer_types {kinds} must name {n_layers} layers, each 'full_attention' or "
                         "'conv'; the config is corrupt")
    if config.get("conv_bias"):
        raise PerfxError("config.json: conv_bias true: perfx runs LFM2 checkpoints without convolution biases "
                         "(every published one)")
    return dict(qk_norm=True, conv_length=int(config.get("conv_L_cache", 3)), layers=tuple(
        LayerRecipe(h.rope, 0) if kind == "full_attention" else LayerRecipe(None, 0, "conv") for kind in kinds),
        intermediate_size=_ffn_size(config))


def _ffn_size(config: dict) -> int:
    """The MLP's width as transformers' Lfm2MLP computes it from block_ff_dim / intermediate_size."""
    size = int(config.get("block_ff_dim", config["intermediate_size"]))
    if config.get("block_auto_adjust_ff_dim", True):
        size = int(2 * size / 3)
        multiplier = config.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            size = int(multiplier * size)
            multiple = int(config.get("block_multiple_of", 256))
            size = multiple * ((size + multiple - 1) // multiple)
    return size


_LAYERS = ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)]


def _config(hidden: int, ff: int, heads: int) -> dict:
    # LiquidAI's hybrids: 16 layers, 6 of them attention (the rest gated short convolutions, L = 3)
    return dict(model_type="lfm2", vocab_size=65536, hidden_size=hidden, block_ff_dim=ff, intermediate_size=ff,
                num_hidden_layers=16, num_attention_heads=heads, num_key_value_heads=8, rope_theta=1e6,
                max_position_embeddings=128000, conv_L_cache=3, layer_types=_LAYERS, tie_embedding=True)


FAMILY = Family(
    name="lfm2", order=7,
    gguf_names=("lfm2",), hf_names=("lfm2",),
    read_gguf=read_gguf, read_hf=read_hf,
    layer_kinds=("attention", "conv"),
    hf_rms_eps=1e-5, hf_tied=True,
    tensors=TensorNames(
        # llama.cpp's lfm2 reads its final norm from token_embd_norm (transformers' embedding_norm, applied last)
        gguf_final_norm="token_embd_norm.weight",
        hf_linears={"o": "self_attn.out_proj", "gate": "feed_forward.w1", "up": "feed_forward.w3",
                    "down": "feed_forward.w2", "conv_in": "conv.in_proj", "conv_out": "conv.out_proj"},
        hf_vectors={"attn_norm": "operator_norm.weight", "ffn_norm": "ffn_norm.weight",
                    "q_norm": "self_attn.q_layernorm.weight", "k_norm": "self_attn.k_layernorm.weight"},
        hf_final_norm="embedding_norm.weight"),
    chat=ChatRules(stop_tokens=("<|im_end|>", "<|endoftext|>"), tool_formats=(LFM2_TOOLS,)),
    synthetic={"lfm2-350m": Preset(_config(1024, 6656, 16)), "lfm2-1.2b": Preset(_config(2048, 12288, 32))},
)
