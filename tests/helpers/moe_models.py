"""Tiny mixture-of-experts GGUFs written as llama.cpp's converter writes ``qwen3moe`` and ``lfm2moe``
(convert_hf_to_gguf.py: Qwen3MoeModel, LFM2MoeModel): gguf-py's tensor names and keys, every expert of a
projection stacked into one (E, rows, K) tensor, the router (ffn_gate_inp) and the selection bias (exp_probs_b) in
F32 as llama-quantize leaves them, the experts in Q4_0, Q8_0, F16 or F32 by layer.

``write_moe_gguf`` returns the file's path and the float64 weights the file holds, by llama.cpp's definition of
each type (gguf.quants), so a test checks perfx against what the file says, not against what was quantized.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import quants

# model_type -> the GGUF architecture its converter writes
MOE_MODEL_TYPES = {"qwen3_moe": "qwen3moe", "lfm2_moe": "lfm2moe"}
# The experts' type per layer, cycled: every form the routed GEMVs read, and fp16/F32 (held as int8)
EXPERT_TYPES = ("Q4_0", "Q8_0", "F16", "F32")

SHAPES = {
    "qwen3_moe": dict(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_experts=10, num_experts_per_tok=3, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, norm_topk_prob=True,
                      max_position_embeddings=256, tie_word_embeddings=False),
    # layer 0 dense (num_dense_layers), conv/attention as LFM2
    "lfm2_moe": dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_experts=8, num_experts_per_tok=2, num_dense_layers=1, num_hidden_layers=4,
                     num_attention_heads=2, num_key_value_heads=1, rope_theta=1e6, norm_eps=1e-5, conv_L_cache=3,
                     layer_types=["conv", "full_attention", "conv", "full_attention"], max_position_embeddings=256,
                     tie_embedding=True, use_expert_bias=True, norm_topk_prob=True),
}


def add_plain_vocab(writer: gguf.GGUFWriter, size: int, extra_special: tuple[str, ...] = ()):
    """Control pieces (``extra_special`` after pad, eos, bos, unk) then plain ones, under the SentencePiece model
    llama.cpp opens without a merges list; a tiny model's forward needs only the size."""
    special = ["<pad>", "<eos>", "<bos>", "<unk>", *extra_special]
    tokens = special + [f"w{i}" for i in range(size - len(special))]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([t.encode() for t in tokens])
    writer.add_token_scores([0.0] * size)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(special) + [gguf.TokenType.NORMAL] * (size - len(special)))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)


def _encode(w: np.ndarray, kind: str):
    """(data for add_tensor, raw_dtype or None, the float64 the file holds) of an array (2-D or stacked 3-D)."""
    if kind in ("F32", "F16"):
        data = w.astype(np.float32 if kind == "F32" else np.float16)
        return data, None, data.astype(np.float64)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)
    return raw, qtype, quants.dequantize(raw, qtype).astype(np.float64).reshape(w.shape)


def write_moe_gguf(path: Path, model_type: str, rng: np.random.Generator, expert_types=EXPERT_TYPES,
                   fused_gate_up: bool = False, vocab: bool = False, **overrides) -> tuple[Path, dict]:
    """A tiny random GGUF of ``model_type`` ("qwen3_moe", "lfm2_moe"); (path, {tensor name: float64 held}).
    ``fused_gate_up``: every expert's gate and up in one ffn_gate_up_exps tensor (gate rows first), as newer
    converters write some architectures. ``vocab``: a small vocabulary too, which llama.cpp needs to open the
    file (perfx's forward needs only the size)."""
    c = dict(SHAPES[model_type], **overrides)
    arch = MOE_MODEL_TYPES[model_type]
    lfm2 = arch == "lfm2moe"
    hidden, n_layers, e = c["hidden_size"], c["num_hidden_layers"], c["num_experts"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"perfx tiny {arch}")
    writer.add_block_count(n_layers)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c.get("rms_norm_eps", c.get("norm_eps")))
    writer.add_vocab_size(c["vocab_size"])
    if vocab:
        add_plain_vocab(writer, c["vocab_size"])
    writer.add_expert_count(e)
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    kinds = ["attention"] * n_layers
    if lfm2:    # LFM2MoeModel.set_gguf_parameters
        kinds = ["attention" if t == "full_attention" else "conv" for t in c["layer_types"]]
        writer.add_head_count_kv([kv if k == "attention" else 0 for k in kinds])
        writer.add_shortconv_l_cache(c["conv_L_cache"])
        writer.add_leading_dense_block_count(c["num_dense_layers"])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    else:       # Qwen3MoeModel: Qwen2MoeModel's keys
        writer.add_head_count_kv(kv)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    held: dict[str, np.ndarray] = {}

    def add(name, w, kind="F32"):
        data, raw_dtype, value = _encode(w, kind)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
        held[name] = value

    def matrix(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    add("token_embd.weight", (0.5 * rng.standard_normal((c["vocab_size"], hidden))).astype(np.float32), "Q8_0")
    inter, moe_inter = c["intermediate_size"], c["moe_intermediate_size"]
    for i in range(n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", norm(hidden))
        add(p + "ffn_norm.weight", norm(hidden))
        if kinds[i] == "conv":
            add(p + "shortconv.in_proj.weight", matrix(3 * hidden, hidden), "Q8_0")
            add(p + "shortconv.conv.weight", matrix(hidden, c["conv_L_cache"]))
            add(p + "shortconv.out_proj.weight", matrix(hidden, hidden), "Q4_0")
        else:
            add(p + "attn_q.weight", matrix(heads * head_dim, hidden), "Q8_0")
            add(p + "attn_k.weight", matrix(kv * head_dim, hidden), "Q4_0")
            add(p + "attn_v.weight", matrix(kv * head_dim, hidden), "Q8_0")
            add(p + "attn_output.weight", matrix(hidden, heads * head_dim), "Q4_0")
            add(p + "attn_q_norm.weight", norm(head_dim))
            add(p + "attn_k_norm.weight", norm(head_dim))
        if i < c.get("num_dense_layers", 0):
            add(p + "ffn_gate.weight", matrix(inter, hidden), "Q4_0")
            add(p + "ffn_up.weight", matrix(inter, hidden), "Q8_0")
            add(p + "ffn_down.weight", matrix(hidden, inter), "Q4_0")
            continue
        kind = expert_types[i % len(expert_types)]
        add(p + "ffn_gate_inp.weight", 2 * matrix(e, hidden))
        if lfm2 and c.get("use_expert_bias", True):
            add(p + "exp_probs_b.bias", (0.3 * rng.standard_normal(e)).astype(np.float32))
        gate, up = matrix(e, moe_inter, hidden), matrix(e, moe_inter, hidden)
        if fused_gate_up:
            add(p + "ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1), kind)
            held[p + "ffn_gate_exps.weight"] = held[p + "ffn_gate_up_exps.weight"][:, :moe_inter]
            held[p + "ffn_up_exps.weight"] = held[p + "ffn_gate_up_exps.weight"][:, moe_inter:]
        else:
            add(p + "ffn_gate_exps.weight", gate, kind)
            add(p + "ffn_up_exps.weight", up, kind)
        add(p + "ffn_down_exps.weight", matrix(e, hidden, moe_inter), kind)
    add("token_embd_norm.weight" if lfm2 else "output_norm.weight", norm(hidden))
    if not c.get("tie_word_embeddings", c.get("tie_embedding", False)):
        add("output.weight", matrix(c["vocab_size"], hidden), "Q8_0")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path), held


def write_moe_hf(directory: Path, model_type: str, held: dict, **overrides) -> Path:
    """A Hugging Face directory of the same model (config.json in the published style, float32 safetensors under
    transformers' names: Qwen3MoeForCausalLM's mlp.gate / mlp.experts.{e}.gate_proj, Lfm2MoeForCausalLM's
    feed_forward.gate / expert_bias / experts.{e}.w1), from what ``write_moe_gguf`` returned it holds."""
    from safetensors.numpy import save_file

    c = dict(SHAPES[model_type], **overrides)
    lfm2 = model_type == "lfm2_moe"
    directory.mkdir(parents=True, exist_ok=True)
    config = {"model_type": model_type, "architectures": ["Lfm2MoeForCausalLM" if lfm2 else "Qwen3MoeForCausalLM"],
              **c}
    if lfm2:
        config["full_attn_idxs"] = [i for i, t in enumerate(c["layer_types"]) if t == "full_attention"]
    (directory / "config.json").write_text(__import__("json").dumps(config))
    names = ({"attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_output": "self_attn.out_proj",
              "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm", "block": "feed_forward",
              "gate": "w1", "up": "w3", "down": "w2"} if lfm2 else
             {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_output": "self_attn.o_proj",
              "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "block": "mlp",
              "gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
    out = {"model.embed_tokens.weight": held["token_embd.weight"]}
    for name, w in held.items():
        if not name.startswith("blk."):
            continue
        _, i, rest = name.split(".", 2)
        p, block = f"model.layers.{i}.", f"model.layers.{i}.{names['block']}."
        tensor = rest.rsplit(".", 1)[0]
        if tensor in ("attn_norm", "ffn_norm", "attn_output", "attn_q_norm", "attn_k_norm"):
            out[p + names[tensor] + ".weight"] = w
        elif tensor in ("attn_q", "attn_k", "attn_v"):
            out[p + f"self_attn.{tensor[-1]}_proj.weight"] = w
        elif tensor.startswith("shortconv."):
            conv = tensor.split(".", 1)[1]
            out[p + f"conv.{conv}.weight"] = w[:, None, :] if conv == "conv" else w
        elif tensor in ("ffn_gate", "ffn_up", "ffn_down"):
            out[block + names[tensor[4:]] + ".weight"] = w
        elif tensor == "ffn_gate_inp":
            out[block + "gate.weight"] = w
        elif tensor == "exp_probs_b":
            out[block + "expert_bias"] = w
        elif tensor == "ffn_gate_up_exps":
            continue   # its halves are held as ffn_gate_exps and ffn_up_exps too
        else:   # ffn_{gate,up,down}_exps
            for e, expert in enumerate(w):
                out[block + f"experts.{e}.{names[tensor[4:-5]]}.weight"] = expert
    out["model.embedding_norm.weight" if lfm2 else "model.norm.weight"] = held[
        "token_embd_norm.weight" if lfm2 else "output_norm.weight"]
    if "output.weight" in held:
        out["lm_head.weight"] = held["output.weight"]
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()},
              str(directory / "model.safetensors"))
    return directory
