"""Tiny gpt-oss models written as the real tools write them.

``write_gptoss_gguf``: as llama.cpp's converter writes ``gpt-oss`` (convert_hf_to_gguf.py GptOssModel): gguf-py's
tensor names and keys (rope.scaling.type yarn, factor, original_context_length; sliding_window;
expert_feed_forward_length), q/k/v/o biases, attn_sinks.weight, post_attention_norm (the FFN's norm), the router
with its bias, each expert projection stacked (E, rows, K) with its (E, rows) bias, gate and up apart or fused
(ffn_gate_up_exps, gate rows first: the converter's fuse_gate_up_exps), experts in MXFP4 (as the converter repacks
openai's), Q8_0 or F32 by layer; 1-D tensors and biases F32, as the converter keeps them.

``write_gptoss_hf``: a Hugging Face directory of the same model as openai's checkpoints hold it
(GptOssForCausalLM): mlp.router, mlp.experts.gate_up_proj (E, hidden, 2·I) with gate and up interleaved, or, for
MXFP4 experts, ``_blocks`` (E, rows, K/32, 16) two codes a byte with the even element low, and ``_scales``.

``vocab="harmony"``: a byte-level vocabulary as gpt-oss's (gpt2 BPE, pre-tokenizer "gpt-4o"), every byte a token and
harmony's markers as special tokens, with gpt-oss's real chat template (tests/data/templates): a model that a test
script can make write harmony's channels and calls, through the template a real file carries.

Both return or take the float64 values the file holds (gguf.quants' definition of each type), so a test checks
perfx against what the file says.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import quants

from helpers.moe_models import add_plain_vocab

TEMPLATE = Path(__file__).parent.parent / "data" / "templates" / "openai-gpt-oss-120b.jinja"
# o200k_harmony's special tokens that harmony's messages use, in their order there
HARMONY_SPECIALS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                    "<|end|>", "<|message|>", "<|call|>")


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte (its bytes_to_unicode), by byte."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


HARMONY_MERGES = ("Ġ a", "Ġ t")     # a BPE vocabulary has merges; these few do not matter to the tests


def harmony_tokens() -> list[str]:
    return _byte_chars() + [m.replace(" ", "") for m in HARMONY_MERGES] + list(HARMONY_SPECIALS)


def add_harmony_vocab(writer: gguf.GGUFWriter):
    tokens = harmony_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (len(tokens) - len(HARMONY_SPECIALS))
                           + [gguf.TokenType.CONTROL] * len(HARMONY_SPECIALS))
    writer.add_token_merges(list(HARMONY_MERGES))
    writer.add_bos_token_id(tokens.index("<|startoftext|>"))
    writer.add_eos_token_id(tokens.index("<|return|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE.read_text(encoding="utf-8"))


# The experts' type per layer, cycled
EXPERT_TYPES = ("MXFP4", "Q8_0", "F32")

TINY = dict(model_type="gpt_oss", vocab_size=96, hidden_size=64, intermediate_size=64, num_local_experts=6,
            num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            rope_theta=150000.0, rms_norm_eps=1e-5, sliding_window=8, max_position_embeddings=4096,
            rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                          "original_max_position_embeddings": 128, "truncate": True},
            attention_bias=True, swiglu_limit=7.0, tie_word_embeddings=False,
            layer_types=["sliding_attention", "full_attention"] * 2, architectures=["GptOssForCausalLM"])


def _encode(w: np.ndarray, kind: str):
    if kind == "F32":
        data = w.astype(np.float32)
        return data, None, data.astype(np.float64)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)
    return raw, qtype, quants.dequantize(raw, qtype).astype(np.float64).reshape(w.shape)


def write_gptoss_gguf(path: Path, rng: np.random.Generator, expert_types=EXPERT_TYPES, fused_gate_up: bool = False,
                      drop=(), change=None, keys=None, vocab: bool = False, **overrides) -> tuple[Path, dict]:
    """A tiny random gpt-oss GGUF; (path, {tensor name: float64 held}, and "raw:<name>" the MXFP4 bytes). A bad
    file for the tests: the tensors ``drop`` left out, ``change`` {name: array} written in their place, ``keys``
    {key: value} written in place of the converter's (None: left out). ``vocab``: a small vocabulary too, which
    llama.cpp needs to open the file; "harmony": gpt-oss's kind of vocabulary, and its chat template."""
    c = dict(TINY, **overrides)
    if vocab == "harmony":
        c["vocab_size"] = len(harmony_tokens())
    hidden, n_layers, e = c["hidden_size"], c["num_hidden_layers"], c["num_local_experts"]
    heads, kv, d, inter = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["intermediate_size"]
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    if keys:
        add_key_value = writer.add_key_value

        def replaced(key, value, vtype, *args, **kwargs):
            if key in keys and keys[key] is None:
                return None
            return add_key_value(key, keys.get(key, value), vtype, *args, **kwargs)
        writer.add_key_value = replaced
    writer.add_name("perfx tiny gpt-oss")
    writer.add_block_count(n_layers)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_key_length(d)
    writer.add_value_length(d)
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_vocab_size(c["vocab_size"])
    if vocab == "harmony":
        add_harmony_vocab(writer)
    elif vocab:
        add_plain_vocab(writer, c["vocab_size"])
    writer.add_expert_count(e)
    writer.add_expert_used_count(c["num_experts_per_tok"])
    # GptOssModel.set_gguf_parameters
    writer.add_sliding_window(c["sliding_window"])
    writer.add_expert_feed_forward_length(inter)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(c["rope_scaling"]["factor"])
    writer.add_rope_scaling_orig_ctx_len(c["rope_scaling"]["original_max_position_embeddings"])
    held: dict[str, np.ndarray] = {}

    def add(name, w, kind="F32"):
        if name in drop:
            return
        if change and name in change:
            w, kind = change[name], "F32"
        data, raw_dtype, value = _encode(w, kind)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
        held[name] = value
        if kind == "MXFP4":
            held["raw:" + name] = np.asarray(data)

    def matrix(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def vector(*shape, scale=0.1, mean=0.0):
        return (mean + scale * rng.standard_normal(shape)).astype(np.float32)

    add("token_embd.weight", (0.5 * rng.standard_normal((c["vocab_size"], hidden))).astype(np.float32), "Q8_0")
    for i in range(n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", vector(hidden, mean=1.0))
        add(p + "post_attention_norm.weight", vector(hidden, mean=1.0))
        for name, rows in (("attn_q", heads * d), ("attn_k", kv * d), ("attn_v", kv * d)):
            add(p + name + ".weight", matrix(rows, hidden), "Q8_0")
            add(p + name + ".bias", vector(rows))
        add(p + "attn_output.weight", matrix(hidden, heads * d), "Q8_0")
        add(p + "attn_output.bias", vector(hidden))
        add(p + "attn_sinks.weight", vector(heads, scale=1.0))
        add(p + "ffn_gate_inp.weight", 2 * matrix(e, hidden))
        add(p + "ffn_gate_inp.bias", vector(e))
        kind = expert_types[i % len(expert_types)]
        # gate and up wide enough that the clamp at ±7 bites on some rows
        gate, up = 4 * matrix(e, inter, hidden), 4 * matrix(e, inter, hidden)
        gate_b, up_b = vector(e, inter), vector(e, inter)
        if fused_gate_up:
            add(p + "ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1), kind)
            add(p + "ffn_gate_up_exps.bias", np.concatenate([gate_b, up_b], axis=1))
            for part, half in (("gate", slice(None, inter)), ("up", slice(inter, None))):
                held[p + f"ffn_{part}_exps.weight"] = held[p + "ffn_gate_up_exps.weight"][:, half]
                held[p + f"ffn_{part}_exps.bias"] = held[p + "ffn_gate_up_exps.bias"][:, half]
        else:
            add(p + "ffn_gate_exps.weight", gate, kind)
            add(p + "ffn_gate_exps.bias", gate_b)
            add(p + "ffn_up_exps.weight", up, kind)
            add(p + "ffn_up_exps.bias", up_b)
        add(p + "ffn_down_exps.weight", matrix(e, hidden, inter), kind)
        add(p + "ffn_down_exps.bias", vector(e, hidden))
    add("output_norm.weight", vector(hidden, mean=1.0))
    add("output.weight", matrix(c["vocab_size"], hidden), "Q8_0")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path), held


def _hf_mxfp4(raw: np.ndarray, e: int, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """GGUF MXFP4 bytes (E, rows, K/32 blocks of 17: the exponent, then element j low and j + 16 high of byte j)
    as openai's _blocks (E, rows, K/32, 16: elements 2b low, 2b + 1 high) and _scales (E, rows, K/32)."""
    blocks = np.asarray(raw, np.uint8).reshape(e, rows, k // 32, 17)
    qs = blocks[..., 1:]
    nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)      # the 32 elements in order
    packed = (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)
    return packed, np.ascontiguousarray(blocks[..., 0])


def write_gptoss_hf(directory: Path, held: dict, **overrides) -> Path:
    """openai's layout of the model ``write_gptoss_gguf`` wrote: float32 tensors, the experts of MXFP4 layers as
    _blocks and _scales (quantization_config mxfp4), the others as stacked gate_up_proj / down_proj."""
    from safetensors.numpy import save_file

    c = dict(TINY, **overrides)
    directory.mkdir(parents=True, exist_ok=True)
    e, inter, hidden = c["num_local_experts"], c["intermediate_size"], c["hidden_size"]
    mxfp4 = any(name.startswith("raw:") for name in held)
    config = dict(c, **({"quantization_config": {"quant_method": "mxfp4",
                                                 "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                            "model.layers.*.mlp.router",
                                                                            "model.embed_tokens", "lm_head"]}}
                        if mxfp4 else {}))
    (directory / "config.json").write_text(json.dumps(config))
    out = {"model.embed_tokens.weight": held["token_embd.weight"], "model.norm.weight": held["output_norm.weight"],
           "lm_head.weight": held["output.weight"]}
    for i in range(c["num_hidden_layers"]):
        p, g = f"model.layers.{i}.", f"blk.{i}."
        out[p + "input_layernorm.weight"] = held[g + "attn_norm.weight"]
        out[p + "post_attention_layernorm.weight"] = held[g + "post_attention_norm.weight"]
        for x in "qkv":
            out[p + f"self_attn.{x}_proj.weight"] = held[g + f"attn_{x}.weight"]
            out[p + f"self_attn.{x}_proj.bias"] = held[g + f"attn_{x}.bias"]
        out[p + "self_attn.o_proj.weight"] = held[g + "attn_output.weight"]
        out[p + "self_attn.o_proj.bias"] = held[g + "attn_output.bias"]
        out[p + "self_attn.sinks"] = held[g + "attn_sinks.weight"]
        out[p + "mlp.router.weight"] = held[g + "ffn_gate_inp.weight"]
        out[p + "mlp.router.bias"] = held[g + "ffn_gate_inp.bias"]
        m = p + "mlp.experts."
        gate, up = held[g + "ffn_gate_exps.weight"], held[g + "ffn_up_exps.weight"]
        bias = np.empty((e, 2 * inter))
        bias[:, 0::2], bias[:, 1::2] = held[g + "ffn_gate_exps.bias"], held[g + "ffn_up_exps.bias"]
        out[m + "gate_up_proj_bias"] = bias
        out[m + "down_proj_bias"] = held[g + "ffn_down_exps.bias"]
        if "raw:" + g + "ffn_gate_exps.weight" in held:
            gb, gs = _hf_mxfp4(held["raw:" + g + "ffn_gate_exps.weight"], e, inter, hidden)
            ub, us = _hf_mxfp4(held["raw:" + g + "ffn_up_exps.weight"], e, inter, hidden)
            blocks, scales = np.empty((e, 2 * inter, hidden // 32, 16), np.uint8), np.empty((e, 2 * inter, hidden // 32),
                                                                                          np.uint8)
            blocks[:, 0::2], blocks[:, 1::2], scales[:, 0::2], scales[:, 1::2] = gb, ub, gs, us
            out[m + "gate_up_proj_blocks"], out[m + "gate_up_proj_scales"] = blocks, scales
            out[m + "down_proj_blocks"], out[m + "down_proj_scales"] = _hf_mxfp4(
                held["raw:" + g + "ffn_down_exps.weight"], e, hidden, inter)
        else:
            gate_up = np.empty((e, 2 * inter, hidden))
            gate_up[:, 0::2], gate_up[:, 1::2] = gate, up
            out[m + "gate_up_proj"] = gate_up.transpose(0, 2, 1)           # (E, hidden, 2·I)
            out[m + "down_proj"] = held[g + "ffn_down_exps.weight"].transpose(0, 2, 1)   # (E, I, hidden)
    save_file({k: np.ascontiguousarray(v) if v.dtype == np.uint8 else np.ascontiguousarray(v, dtype=np.float32)
               for k, v in out.items()}, str(directory / "model.safetensors"))
    return directory
