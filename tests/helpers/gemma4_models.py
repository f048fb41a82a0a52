"""Tiny Gemma 4 models, written as llama.cpp's converter (convert_hf_to_gguf.py, Gemma4Model) writes them, and an
independent float64 re-implementation of llama.cpp's gemma4 graph (src/models/gemma4.cpp) over what such a file
holds.

The GGUF: Gemma3Model's keys (block count, context, embedding length, head counts, key_length, RoPE base, norm
epsilon, sliding window, final soft-cap), then Gemma4Model's: ``shared_kv_layers``,
``embedding_length_per_layer_input``,
``sliding_window_pattern`` (one bool a layer), ``key_length`` / ``value_length`` = global_head_dim and their ``_swa``
forms = head_dim, ``feed_forward_length`` per layer (doubled on the KV-sharing layers with use_double_wide_mlp),
``head_count_kv`` per layer (where num_global_key_value_heads is set), ``rope.dimension_count`` = global_head_dim
and ``_swa``; the ``rope_freqs`` tensor (1 on the turned pairs, 1e30 on the rest: proportional RoPE). Norms as
stored (norm_shift 0). Tensors under gguf-py's GEMMA4 names; the K-equals-V global layers hold no attn_v.

``reference_logits`` is written from llama.cpp's graph alone, not from perfx: it shares no code with
perfx.forward64, which it checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from helpers.moe_models import add_plain_vocab
from helpers.tiny_models import encode_tensor

# layer_types of the tiny model: two sliding, one global, twice; the last two layers share KV (4 → 3, 5 → 2)
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, global_head_dim=64, sliding_window=5, vocab_size=96, hidden_size_per_layer_input=16,
            num_kv_shared_layers=2, use_double_wide_mlp=True, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
            max_position_embeddings=128, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            rope_parameters={"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6,
                                                "rope_type": "proportional"},
                             "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
            tie_word_embeddings=True, model_type="gemma4_text")
# llama-quantize's choices on rows of 64 (Q8_0 / Q4_0); vectors and rows of 16 stay F32 / F16
DEFAULT_TYPES = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
                 "ffn_up": "Q8_0", "ffn_down": "Q8_0", "inp_gate": "Q8_0", "proj": "F16"}


@dataclass
class Gemma4Model:
    config: dict                                  # the text config.json
    weights: dict[str, np.ndarray]                # GGUF tensor name -> float32 weights (N, K) / vectors
    held: dict[str, np.ndarray] = field(default_factory=dict)   # what the file holds, float64, after writing


def layer_shapes(c: dict) -> list[dict]:
    """Per layer: sliding, head size, KV heads, MLP width, KV source (−1: its own)."""
    n, shared = c["num_hidden_layers"], c.get("num_kv_shared_layers", 0)
    first = n - shared
    out = []
    for i, t in enumerate(c["layer_types"]):
        sliding = t == "sliding_attention"
        source = -1
        if i >= first:
            source = max(j for j in range(first) if c["layer_types"][j] == t)
        ffn = c["intermediate_size"] * (2 if c.get("use_double_wide_mlp") and i >= first else 1)
        kv = c["num_key_value_heads"] if sliding else (c.get("num_global_key_value_heads") or c["num_key_value_heads"])
        out.append(dict(sliding=sliding, head=c["head_dim"] if sliding else c["global_head_dim"], kv=kv, ffn=ffn,
                        source=source))
    return out


def make_gemma4(rng: np.random.Generator, k_eq_v: bool = False, **overrides) -> Gemma4Model:
    """Random weights of the tiny shape: matrices N(0, 1/K) so each layer adds O(1); norms near 1 (stored as used;
    q's and k's near D^(−1/4));
    layer scalars near 1; ``k_eq_v``: the global layers have no v projection (the 26B / 31B models' form)."""
    c = dict(TINY, **overrides)
    c["attention_k_eq_v"] = k_eq_v
    h, p, n, v = c["hidden_size"], c["hidden_size_per_layer_input"], c["num_hidden_layers"], c["vocab_size"]

    def matrix(rows, k, scale=1.0):
        return (scale * rng.standard_normal((rows, k)) / np.sqrt(k)).astype(np.float32)

    def norm(size):
        return (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    w = {"token_embd.weight": (rng.standard_normal((v, h)) / np.sqrt(h)).astype(np.float32),
         "per_layer_token_embd.weight": (0.5 * rng.standard_normal((v, n * p)) / np.sqrt(p)).astype(np.float32),
         "per_layer_model_proj.weight": matrix(n * p, h, 1.0 / np.sqrt(h)),
         "per_layer_proj_norm.weight": norm(p), "output_norm.weight": norm(h)}
    for i, s in enumerate(layer_shapes(c)):
        b, q_dim, kv_dim = f"blk.{i}.", c["num_attention_heads"] * s["head"], s["kv"] * s["head"]
        w[b + "attn_norm.weight"] = norm(h)
        w[b + "attn_q.weight"] = matrix(q_dim, h)
        # Gemma 4 attends at scale 1: its learned q and k norms carry 1/√D between them (q·k of O(1))
        w[b + "attn_q_norm.weight"] = norm(s["head"]) * s["head"] ** -0.25
        # the converter writes what the checkpoint holds; llama.cpp reads k and v only where the layer has a cache
        w[b + "attn_k.weight"] = matrix(kv_dim, h)
        w[b + "attn_k_norm.weight"] = norm(s["head"]) * s["head"] ** -0.25
        if not (k_eq_v and not s["sliding"]):
            w[b + "attn_v.weight"] = matrix(kv_dim, h)
        w[b + "attn_output.weight"] = matrix(h, q_dim)
        w[b + "post_attention_norm.weight"] = norm(h)
        w[b + "ffn_norm.weight"] = norm(h)
        w[b + "ffn_gate.weight"] = matrix(s["ffn"], h)
        w[b + "ffn_up.weight"] = matrix(s["ffn"], h)
        w[b + "ffn_down.weight"] = matrix(h, s["ffn"])
        w[b + "post_ffw_norm.weight"] = norm(h)
        w[b + "inp_gate.weight"] = matrix(p, h)
        w[b + "proj.weight"] = matrix(h, p)
        w[b + "post_norm.weight"] = norm(h)
        w[b + "layer_output_scale.weight"] = np.array([0.8 + 0.4 * rng.random()], np.float32)
    return Gemma4Model(c, w)


def rope_freqs(c: dict) -> np.ndarray:
    """Gemma4Model.generate_extra_tensors: proportional RoPE as divisors, 1 on the turned pairs, 1e30 on the rest."""
    full = c["rope_parameters"]["full_attention"]
    d = c["global_head_dim"]
    turned = int(d * full["partial_rotary_factor"] / 2)
    return np.array([1.0] * turned + [1e30] * (d // 2 - turned), np.float32)


def write_gemma4_gguf(path: Path, model: Gemma4Model, types: dict | None = None, table_type: str = "Q8_0",
                      embedding_type: str = "Q8_0", skip_shared_kv: bool = False) -> Gemma4Model:
    """The GGUF of ``model`` (module docstring); ``types``: tensor -> type for the layers' matrices;
    ``skip_shared_kv``: leave out the KV-sharing layers' k tensors (llama.cpp does not need them). Fills
    ``model.held`` with what the file holds."""
    c, types = model.config, dict(DEFAULT_TYPES, **(types or {}))
    shapes = layer_shapes(c)
    writer = gguf.GGUFWriter(str(path), "gemma4")
    writer.add_name("perfx tiny gemma4")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_rope_freq_base(c["rope_parameters"]["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(c["rope_parameters"]["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_final_logit_softcapping(c["final_logit_softcapping"])
    writer.add_sliding_window(c["sliding_window"])
    writer.add_shared_kv_layers(c["num_kv_shared_layers"])
    writer.add_embedding_length_per_layer_input(c["hidden_size_per_layer_input"])
    writer.add_sliding_window_pattern([s["sliding"] for s in shapes])
    writer.add_key_length(c["global_head_dim"])
    writer.add_value_length(c["global_head_dim"])
    writer.add_key_length_swa(c["head_dim"])
    writer.add_value_length_swa(c["head_dim"])
    if c.get("use_double_wide_mlp"):
        writer.add_feed_forward_length([s["ffn"] for s in shapes])
    else:
        writer.add_feed_forward_length(c["intermediate_size"])
    if c.get("num_global_key_value_heads") is not None:
        writer.add_head_count_kv([s["kv"] for s in shapes])
    else:
        writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_dimension_count(c["global_head_dim"])
    writer.add_rope_dimension_count_swa(c["head_dim"])
    _add_vocab(writer, c["vocab_size"])
    writer.add_tensor("rope_freqs.weight", rope_freqs(c))
    model.held = {"rope_freqs.weight": rope_freqs(c).astype(np.float64)}
    for name, w in model.weights.items():
        module = name.split(".")[-2]
        if skip_shared_kv and name.startswith("blk.") and shapes[int(name.split(".")[1])]["source"] >= 0 and \
                module in ("attn_k", "attn_v", "attn_k_norm"):
            continue
        if w.ndim == 1:
            kind = "F32"
        elif name == "token_embd.weight":
            kind = embedding_type
        elif name == "per_layer_token_embd.weight":
            kind = table_type
        elif name == "per_layer_model_proj.weight":
            kind = "F16"
        else:
            kind = types[module]
        data, raw_dtype, held = encode_tensor(w, kind)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
        model.held[name] = held.reshape(w.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _add_vocab(writer: gguf.GGUFWriter, vocab: int):
    """A small vocabulary of Gemma 4's control pieces (its turns') and plain ones."""
    add_plain_vocab(writer, vocab, ("<|turn>", "<turn|>"))


# -- llama.cpp's gemma4 graph, in float64 over what the file holds --------------------------------------------

def _rms(x, w=None, eps=1e-6):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def _gelu(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _rope_neox(x, pos, n_rot, base, factors=None):
    """ggml_rope_ext, NEOX mode: pairs (i, i + n_rot/2), θ_i = pos·base^(−2i/n_rot) / freq_factor_i."""
    half = n_rot // 2
    i = np.arange(half, dtype=np.float64)
    theta = base ** (-2.0 * i / n_rot)
    if factors is not None:
        theta = theta / factors
    ang = pos[:, None, None] * theta[None, None, :]
    x0, x1 = x[..., :half], x[..., half:n_rot]
    return np.concatenate([x0 * np.cos(ang) - x1 * np.sin(ang), x0 * np.sin(ang) + x1 * np.cos(ang), x[..., n_rot:]],
                          axis=-1)


def reference_logits(model: Gemma4Model, tokens) -> np.ndarray:
    """Logits (T, V) of ``tokens`` at positions 0.., following gemma4.cpp step by step over ``model.held``."""
    c, w = model.config, model.held
    tokens = np.asarray(tokens)
    t_len, h, p, n = len(tokens), c["hidden_size"], c["hidden_size_per_layer_input"], c["num_hidden_layers"]
    eps, pos = c["rms_norm_eps"], np.arange(len(tokens), dtype=np.float64)
    x = w["token_embd.weight"][tokens] * math.sqrt(h)                                   # inp_scaled
    per = w["per_layer_token_embd.weight"][tokens].reshape(t_len, n, p) * math.sqrt(p)   # build_inp_per_layer
    proj = (x @ w["per_layer_model_proj.weight"].T / math.sqrt(h)).reshape(t_len, n, p)  # project_per_layer_inputs
    per = (_rms(proj, w["per_layer_proj_norm.weight"], eps) + per) / math.sqrt(2.0)
    keys, values = {}, {}
    mask_pos = np.arange(t_len)
    for il, s in enumerate(layer_shapes(c)):
        b, d, heads = f"blk.{il}.", s["head"], c["num_attention_heads"]
        full = not s["sliding"]
        base = c["rope_parameters"]["full_attention" if full else "sliding_attention"]["rope_theta"]
        factors = w["rope_freqs.weight"] if full else None
        cur = _rms(x, w[b + "attn_norm.weight"], eps)
        q = (cur @ w[b + "attn_q.weight"].T).reshape(t_len, heads, d)
        q = _rope_neox(_rms(q, w[b + "attn_q_norm.weight"], eps), pos, d, base, factors)
        if s["source"] < 0:
            k = (cur @ w[b + "attn_k.weight"].T).reshape(t_len, s["kv"], d)
            v_w = w.get(b + "attn_v.weight")
            v = (cur @ (w[b + "attn_k.weight"] if v_w is None else v_w).T).reshape(t_len, s["kv"], d)
            keys[il] = _rope_neox(_rms(k, w[b + "attn_k_norm.weight"], eps), pos, d, base, factors)
            values[il] = _rms(v, None, eps)
            src = il
        else:
            src = s["source"]
        kk, vv = keys[src], values[src]
        out = np.zeros((t_len, heads, d))
        group = heads // s["kv"]
        for hh in range(heads):
            scores = np.einsum("td,sd->ts", q[:, hh], kk[:, hh // group]) * 1.0   # f_attention_scale = 1
            allowed = mask_pos[None, :] <= mask_pos[:, None]
            if s["sliding"]:
                allowed &= mask_pos[None, :] > mask_pos[:, None] - c["sliding_window"]
            scores = np.where(allowed, scores, -np.inf)
            e = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[:, hh] = (e / e.sum(axis=1, keepdims=True)) @ vv[:, hh // group]
        cur = out.reshape(t_len, heads * d) @ w[b + "attn_output.weight"].T
        attn_out = _rms(cur, w[b + "post_attention_norm.weight"], eps) + x
        cur = _rms(attn_out, w[b + "ffn_norm.weight"], eps)
        cur = (_gelu(cur @ w[b + "ffn_gate.weight"].T) * (cur @ w[b + "ffn_up.weight"].T)) @ w[b + "ffn_down.weight"].T
        cur = _rms(cur, w[b + "post_ffw_norm.weight"], eps) + attn_out
        g = _gelu(cur @ w[b + "inp_gate.weight"].T) * per[:, il]
        cur = cur + _rms(g @ w[b + "proj.weight"].T, w[b + "post_norm.weight"], eps)
        x = cur * w[b + "layer_output_scale.weight"][0]
    x = _rms(x, w["output_norm.weight"], eps)
    logits = x @ w["token_embd.weight"].T
    cap = c["final_logit_softcapping"]
    return cap * np.tanh(logits / cap)


# GGUF tensor (after blk.{i}.) -> transformers' name under model.layers.{i}. (gguf-py's tensor map for gemma4)
HF_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
                  "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
                  "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
                  "attn_k_norm.weight": "self_attn.k_norm.weight",
                  "post_attention_norm.weight": "post_attention_layernorm.weight",
                  "ffn_norm.weight": "pre_feedforward_layernorm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
                  "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
                  "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
                  "inp_gate.weight": "per_layer_input_gate.weight", "proj.weight": "per_layer_projection.weight",
                  "post_norm.weight": "post_per_layer_input_norm.weight", "layer_output_scale.weight": "layer_scalar"}
HF_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                   "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",
                   "per_layer_model_proj.weight": "per_layer_model_projection.weight",
                   "per_layer_proj_norm.weight": "per_layer_projection_norm.weight"}


def write_gemma4_hf(directory: Path, model: Gemma4Model, multimodal: bool = True) -> Path:
    """A Hugging Face directory of what ``model``'s GGUF holds (``model.held``, float32): the multimodal
    checkpoint's form (Gemma4ForConditionalGeneration: config.json's text_config, tensors under
    model.language_model.), or the text model's (``multimodal`` False: model.)."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    prefix = "model.language_model." if multimodal else "model."
    tensors = {}
    for name, w in model.held.items():
        if name == "rope_freqs.weight":
            continue   # the converter's; config.json's rope_parameters say the same
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            hf = f"{prefix}layers.{layer}.{HF_LAYER_NAMES[rest]}"
        else:
            hf = prefix + HF_GLOBAL_NAMES[name]
        tensors[hf] = np.ascontiguousarray(w, dtype=np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    text = dict(model.config)
    config = ({"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}
              if multimodal else {**text, "architectures": ["Gemma4ForCausalLM"]})
    (directory / "config.json").write_text(__import__("json").dumps(config, indent=1))
    return directory
