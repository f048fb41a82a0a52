"""Tiny Gemma 3n models, written as llama.cpp's converter (convert_hf_to_gguf.py, Gemma3NModel) writes them, and an
independent float64 re-implementation of llama.cpp's gemma3n graph (src/models/gemma3n-iswa.cpp) over what such a
file holds, op by op as ggml computes it (its mul_mat and permute index conventions spelled out), but for one
point where llama.cpp departs from transformers' Gemma3nTextModel (the published model's reference): the sparse
gate's standard deviation is over the n values (torch.std(unbiased=False)), where gemma3n.cpp divides by n − 1.

The GGUF: Gemma3Model's keys, then Gemma3NModel's: ``altup.active_idx``, ``altup.num_inputs``,
``embedding_length_per_layer_input``, ``attention.shared_kv_layers``, ``activation_sparsity_scale`` (Φ⁻¹ of each
layer's activation_sparsity_pattern, 0 where none) and ``attention.sliding_window_pattern``; norms as stored
(norm_shift 0); the three AltUp projections stacked into one (A − 1, hidden, hidden) tensor each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

import gguf
import numpy as np

from helpers.gemma4_models import _add_vocab, _gelu, _rms, _rope_neox
from helpers.tiny_models import encode_tensor

TINY = dict(model_type="gemma3n_text", hidden_size=64, intermediate_size=[96] * 6, num_hidden_layers=6,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=5, vocab_size=96,
            hidden_size_per_layer_input=16, num_kv_shared_layers=2, laurel_rank=8, altup_num_inputs=4,
            altup_active_idx=0, rms_norm_eps=1e-6, final_logit_softcapping=30.0, rope_theta=1e6,
            rope_local_base_freq=10000.0, max_position_embeddings=128, tie_word_embeddings=True,
            activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
DEFAULT_TYPES = {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q8_0", "ffn_gate": "Q4_0",
                 "ffn_up": "Q8_0", "ffn_down": "Q8_0", "inp_gate": "Q8_0", "proj": "F16", "laurel_l": "Q8_0",
                 "laurel_r": "F16", "altup_router": "F16", "altup_predict_coef": "F16", "altup_correct_coef": "F16"}


@dataclass
class Gemma3nModel:
    config: dict
    weights: dict[str, np.ndarray]
    held: dict[str, np.ndarray] = field(default_factory=dict)


def sparsity_scales(c: dict) -> list[float]:
    """Gemma3NModel.set_gguf_parameters: Φ⁻¹(p) of each layer's pattern entry (Φ⁻¹(0) = −inf is never used:
    a 0 entry means no sparsity, written as 0)."""
    return [float(np.float32(NormalDist().inv_cdf(p))) if p else 0.0 for p in c["activation_sparsity_pattern"]]


def make_gemma3n(rng: np.random.Generator, **overrides) -> Gemma3nModel:
    c = dict(TINY, **overrides)
    h, p, n, v, a, r = (c[k] for k in ("hidden_size", "hidden_size_per_layer_input", "num_hidden_layers",
                                       "vocab_size", "altup_num_inputs", "laurel_rank"))
    d, heads, kv, ffn = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"][0]

    def matrix(rows, k, scale=1.0):
        return (scale * rng.standard_normal((rows, k)) / np.sqrt(k)).astype(np.float32)

    def norm(size, scale=1.0):
        return (scale * (1 + 0.1 * rng.standard_normal(size))).astype(np.float32)

    w = {"token_embd.weight": (rng.standard_normal((v, h)) / np.sqrt(h)).astype(np.float32),
         "per_layer_token_embd.weight": (0.5 * rng.standard_normal((v, n * p)) / np.sqrt(p)).astype(np.float32),
         "per_layer_model_proj.weight": matrix(n * p, h, 1.0 / np.sqrt(h)),
         "per_layer_proj_norm.weight": norm(p), "output_norm.weight": norm(h),
         "altup_proj.weight": np.stack([matrix(h, h) for _ in range(a - 1)]),
         "altup_unembd_proj.weight": np.stack([matrix(h, h) for _ in range(a - 1)])}
    for i in range(n):
        b = f"blk.{i}."
        w.update({b + "attn_norm.weight": norm(h), b + "attn_q.weight": matrix(heads * d, h),
                  b + "attn_k.weight": matrix(kv * d, h), b + "attn_v.weight": matrix(kv * d, h),
                  b + "attn_output.weight": matrix(h, heads * d),
                  # attention at scale 1: the q and k norms carry 1/√D between them
                  b + "attn_q_norm.weight": norm(d, d ** -0.25), b + "attn_k_norm.weight": norm(d, d ** -0.25),
                  b + "post_attention_norm.weight": norm(h), b + "ffn_norm.weight": norm(h),
                  b + "ffn_gate.weight": matrix(ffn, h), b + "ffn_up.weight": matrix(ffn, h),
                  b + "ffn_down.weight": matrix(h, ffn), b + "post_ffw_norm.weight": norm(h),
                  b + "inp_gate.weight": matrix(p, h), b + "proj.weight": matrix(h, p), b + "post_norm.weight": norm(h),
                  b + "laurel_l.weight": matrix(r, h), b + "laurel_r.weight": matrix(h, r),
                  b + "laurel_post_norm.weight": norm(h), b + "altup_router.weight": matrix(a, h, 4.0),
                  b + "altup_router_norm.weight": norm(h), b + "altup_predict_coef.weight": matrix(a * a, a, 0.3),
                  b + "altup_correct_coef.weight": matrix(a, a, 0.3), b + "altup_correct_scale.weight": norm(h)})
    return Gemma3nModel(c, w)


def write_gemma3n_gguf(path: Path, model: Gemma3nModel, types: dict | None = None, table_type: str = "Q8_0",
                       embedding_type: str = "Q8_0") -> Gemma3nModel:
    c, types = model.config, dict(DEFAULT_TYPES, **(types or {}))
    writer = gguf.GGUFWriter(str(path), "gemma3n")
    writer.add_name("perfx tiny gemma3n")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_rope_freq_base_swa(c["rope_local_base_freq"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_final_logit_softcapping(c["final_logit_softcapping"])
    writer.add_sliding_window(c["sliding_window"])
    writer.add_altup_active_idx(c["altup_active_idx"])
    writer.add_altup_num_inputs(c["altup_num_inputs"])
    writer.add_embedding_length_per_layer_input(c["hidden_size_per_layer_input"])
    writer.add_shared_kv_layers(c["num_kv_shared_layers"])
    writer.add_activation_sparsity_scale(sparsity_scales(c))
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in c["layer_types"]])
    _add_vocab(writer, c["vocab_size"])
    for name, w in model.weights.items():
        module = name.split(".")[-2]
        if w.ndim == 1 or module.endswith("_norm") or module == "altup_correct_scale":
            kind = "F32"
        elif w.ndim == 3 or name == "per_layer_model_proj.weight":
            kind = "F16"
        elif name == "token_embd.weight":
            kind = embedding_type
        elif name == "per_layer_token_embd.weight":
            kind = table_type
        else:
            kind = types[module]
        data, raw_dtype, held = encode_tensor(w.reshape(-1, w.shape[-1]), kind)
        writer.add_tensor(name, data.reshape(w.shape) if raw_dtype is None else data, raw_dtype=raw_dtype)
        model.held[name] = held.reshape(w.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _sources(c: dict) -> list[int]:
    n, first = c["num_hidden_layers"], c["num_hidden_layers"] - c["num_kv_shared_layers"]
    return [-1 if i < first else max(j for j in range(first) if c["layer_types"][j] == c["layer_types"][i])
            for i in range(n)]


def _mul_mat(a, b):
    """ggml_mul_mat(a, b) for 2-D a [K, N] (numpy (N, K)) and b [K, M] (numpy (M, K)): (M, N)."""
    return b @ a.T


def reference_logits(model: Gemma3nModel, tokens) -> np.ndarray:
    """Logits (T, V) of ``tokens`` at positions 0.., following gemma3n-iswa.cpp step by step over ``model.held``."""
    c, w = model.config, model.held
    tokens = np.asarray(tokens)
    t_len, h, p, n = len(tokens), c["hidden_size"], c["hidden_size_per_layer_input"], c["num_hidden_layers"]
    a, act, eps = c["altup_num_inputs"], c["altup_active_idx"], c["rms_norm_eps"]
    heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    pos = np.arange(t_len, dtype=np.float64)
    sparsity = sparsity_scales(c)

    def magnitude(x):   # calc_magnitude: sqrt(sum_rows(x²))
        return np.sqrt((x * x).sum(axis=-1, keepdims=True))

    def router(x, b):   # altup_compute_router_modalities
        return np.tanh(_mul_mat(w[b + "altup_router.weight"], _rms(x, w[b + "altup_router_norm.weight"], eps) / h))

    inp = w["token_embd.weight"][tokens] * math.sqrt(h)
    per = w["per_layer_token_embd.weight"][tokens].reshape(t_len, n, p) * math.sqrt(p)
    proj = (_mul_mat(w["per_layer_model_proj.weight"], inp) / math.sqrt(h)).reshape(t_len, n, p)
    per = (per + _rms(proj, w["per_layer_proj_norm.weight"], eps)) / math.sqrt(2.0)
    # inpL [n_embd, n_tokens, n_altup]: the embedding, then altup_proj of it at its magnitude
    added = np.stack([_mul_mat(w["altup_proj.weight"][i], inp) for i in range(a - 1)])
    added = added * magnitude(inp)[None] / magnitude(added)
    cur = np.concatenate([inp[None], added])                           # (A, T, h)
    keys, values = {}, {}
    mask = np.arange(t_len)
    for il, src in enumerate(_sources(c)):
        b = f"blk.{il}."
        sliding = c["layer_types"][il] == "sliding_attention"
        base = c["rope_local_base_freq"] if sliding else c["rope_theta"]
        # altup_predict: all_coefs [A(k), A(j), T] from mul_mat(predict_coef, modalities); predictions =
        # mul_mat(cur permuted to [A, n_embd, T], all_coefs), permuted back, plus cur
        all_coefs = _mul_mat(w[b + "altup_predict_coef.weight"], router(cur[act], b))   # (T, A²), index k + A·j
        predictions = np.empty_like(cur)
        for j in range(a):
            predictions[j] = cur[j] + sum(all_coefs[:, k + a * j, None] * cur[k] for k in range(a))
        active = predictions[act]
        x = _rms(active, w[b + "attn_norm.weight"], eps)
        laurel = _rms(_mul_mat(w[b + "laurel_r.weight"], _mul_mat(w[b + "laurel_l.weight"], x)),
                      w[b + "laurel_post_norm.weight"], eps) + x
        q = _mul_mat(w[b + "attn_q.weight"], x).reshape(t_len, heads, d)
        q = _rope_neox(_rms(q, w[b + "attn_q_norm.weight"], eps), pos, d, base)
        if src < 0:
            k = _mul_mat(w[b + "attn_k.weight"], x).reshape(t_len, kv, d)
            v = _mul_mat(w[b + "attn_v.weight"], x).reshape(t_len, kv, d)
            keys[il] = _rope_neox(_rms(k, w[b + "attn_k_norm.weight"], eps), pos, d, base)
            values[il] = _rms(v, None, eps)
            src = il
        out = np.zeros((t_len, heads, d))
        for hh in range(heads):
            scores = np.einsum("td,sd->ts", q[:, hh], keys[src][:, hh // (heads // kv)])
            allowed = mask[None, :] <= mask[:, None]
            if sliding:
                allowed &= mask[None, :] > mask[:, None] - c["sliding_window"]
            scores = np.where(allowed, scores, -np.inf)
            e = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[:, hh] = (e / e.sum(axis=1, keepdims=True)) @ values[src][:, hh // (heads // kv)]
        x = _rms(_mul_mat(w[b + "attn_output.weight"], out.reshape(t_len, heads * d)),
                 w[b + "post_attention_norm.weight"], eps) + active
        attn_laurel = (x + laurel) / math.sqrt(2.0)
        x = _rms(attn_laurel, w[b + "ffn_norm.weight"], eps)
        up, gate = _mul_mat(w[b + "ffn_up.weight"], x), _mul_mat(w[b + "ffn_gate.weight"], x)
        if sparsity[il]:   # gaussian_topk, std over n as transformers' (llama.cpp's divides by n − 1)
            mean = gate.mean(axis=1, keepdims=True)
            std = np.sqrt(((gate - mean) ** 2).sum(axis=1, keepdims=True) / gate.shape[1])
            gate = np.maximum(gate - (mean + std * sparsity[il]), 0.0)
        x = _mul_mat(w[b + "ffn_down.weight"], _gelu(gate) * up)
        activated = _rms(x, w[b + "post_ffw_norm.weight"], eps) + attn_laurel
        # altup_correct
        coefs = _mul_mat(w[b + "altup_correct_coef.weight"], router(activated, b)) + 1.0   # (T, A)
        innovation = activated - active
        corrected = np.stack([predictions[j] + innovation * coefs[:, j, None] for j in range(a)])
        first = corrected[act] * w[b + "altup_correct_scale.weight"]
        first = _gelu(_mul_mat(w[b + "inp_gate.weight"], first)) * per[:, il]
        first = _rms(_mul_mat(w[b + "proj.weight"], first), w[b + "post_norm.weight"], eps)
        corrected[1:] = corrected[1:] + first
        cur = corrected
    target = magnitude(cur[act])
    unembd = np.stack([_mul_mat(w["altup_unembd_proj.weight"][i], cur[1 + i]) for i in range(a - 1)])
    unembd = unembd * target[None] / magnitude(unembd)
    x = (cur[0] + unembd.sum(axis=0)) / a
    x = _rms(x, w["output_norm.weight"], eps)
    logits = _mul_mat(w["token_embd.weight"], x)
    cap = c["final_logit_softcapping"]
    return cap * np.tanh(logits / cap)


# GGUF tensor (after blk.{i}.) -> transformers' Gemma 3n name under model.language_model.layers.{i}.
HF_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
                  "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
                  "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
                  "attn_k_norm.weight": "self_attn.k_norm.weight",
                  "post_attention_norm.weight": "post_attention_layernorm.weight",
                  "ffn_norm.weight": "pre_feedforward_layernorm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
                  "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
                  "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
                  "inp_gate.weight": "per_layer_input_gate.weight", "proj.weight": "per_layer_projection.weight",
                  "post_norm.weight": "post_per_layer_input_norm.weight",
                  "laurel_l.weight": "laurel.linear_left.weight", "laurel_r.weight": "laurel.linear_right.weight",
                  "laurel_post_norm.weight": "laurel.post_laurel_norm.weight",
                  "altup_router.weight": "altup.modality_router.weight",
                  "altup_router_norm.weight": "altup.router_norm.weight",
                  "altup_predict_coef.weight": "altup.prediction_coefs.weight",
                  "altup_correct_coef.weight": "altup.correction_coefs.weight",
                  "altup_correct_scale.weight": "altup.correct_output_scale"}
HF_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                   "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",
                   "per_layer_model_proj.weight": "per_layer_model_projection.weight",
                   "per_layer_proj_norm.weight": "per_layer_projection_norm.weight"}


def write_gemma3n_hf(directory: Path, model: Gemma3nModel, text_rows: int | None = None) -> Path:
    """The multimodal checkpoint (Gemma3nForConditionalGeneration) of what ``model``'s GGUF holds: tensors under
    model.language_model., the AltUp projections one matrix each, the per-layer table's first ``text_rows`` rows
    only (vocab_size_per_layer_input: the converter pads the rest with zeros, which they must then be)."""
    import json

    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    prefix, tensors = "model.language_model.", {}
    for name, w in model.held.items():
        if name.startswith("altup"):
            hf = "altup_projections" if name == "altup_proj.weight" else "altup_unembed_projections"
            tensors.update({f"{prefix}{hf}.{i}.weight": np.ascontiguousarray(m, np.float32) for i, m in enumerate(w)})
            continue
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            hf = f"{prefix}layers.{layer}.{HF_LAYER_NAMES[rest]}"
        else:
            hf = prefix + HF_GLOBAL_NAMES[name]
        if name == "per_layer_token_embd.weight" and text_rows is not None:
            assert not np.any(w[text_rows:]), "the converter pads these rows with zeros"
            w = w[:text_rows]
        tensors[hf] = np.ascontiguousarray(w, dtype=np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    text = dict(model.config, **({"vocab_size_per_layer_input": text_rows} if text_rows else {}))
    config = {"model_type": "gemma3n", "architectures": ["Gemma3nForConditionalGeneration"], "text_config": text}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory
