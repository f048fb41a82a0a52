"""Tiny random models of the 2026 phone families, written as the real tools write them.

Families (``FAMILIES``): "gemma3" (Hugging Face model_type gemma3_text), "gemma2", "qwen3", "phi3" (shaped like
Phi-4-mini: partial rotary 0.75, LongRoPE, a sliding window in the config) and "smollm3". Each is a
``TinyModel`` (helpers.tiny_models): ``config`` is the config.json transformers reads, ``weights`` the tensors
of model.safetensors under transformers' names and in its layout. Two writers turn it into files:

- ``write_family_gguf``: a GGUF as llama.cpp's ``convert_hf_to_gguf.py`` writes that architecture from the
  Hugging Face directory, then with the tensor types llama-quantize would leave (any mix of F32, F16, BF16,
  Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and Q4_K, Q5_K, Q6_K where rows are multiples of 256). Tensor names come
  from gguf-py's own map (``gguf.get_tensor_name_map``), the vocabulary from the converter's SentencePiece
  path and gguf-py's ``SpecialVocab`` run on the directory ``write_family_hf`` would write.
- ``write_family_hf``: that directory (config.json, model.safetensors, tokenizer.model, tokenizer_config.json
  with the family's BOS rule, generation_config.json). ``style="hub"`` gives config.json as the published
  checkpoints have it; ``style="transformers5"`` as transformers 5's save_pretrained writes it (rope_parameters,
  layer_types).

``benchmarks/families_llamacpp.py --check`` checks both against the tools: the real converter turns
write_family_hf's directory (either style) into write_family_gguf's file key for key and byte for byte, and
transformers on that directory gives llama.cpp's logits on the file.

The converter is in llama.cpp's conversion/ package (llama.cpp as vendored by llama-cpp-python 0.3.36):
``base.py`` TextModel (the common keys, ``_create_vocab_sentencepiece``, 1-D and ``*_norm`` tensors F32),
``gemma.py`` Gemma2Model / Gemma3Model, ``qwen.py`` Qwen3Model(Qwen2Model), ``phi.py`` Phi3MiniModel,
``llama.py`` SmolLM3Model(LlamaModel). How llama.cpp reads each is in src/models/<arch>.cpp.

gemma3 (Gemma3Model; transformers models/gemma3, Gemma3TextConfig)
  GGUF: TextModel's keys plus ``gemma3.attention.key_length`` / ``value_length`` = head_dim,
  ``gemma3.rope.freq_base`` = rope_theta (global layers), ``gemma3.rope.freq_base_swa`` = rope_local_base_freq,
  ``gemma3.attention.sliding_window`` (unless sliding_window_pattern is 1), ``final_logit_softcapping`` only
  when set, ``rope.scaling.type`` linear + ``rope.scaling.factor`` when rope_scaling is linear. No sliding
  window pattern key: llama.cpp's gemma3.cpp takes period 6 (``load_swa_pattern(ml, 6)``: layer il is
  global when il % 6 == 5), as transformers' layer_types does ((i + 1) % 6 == 0 is full attention).
  Every ``*norm.weight`` is stored + 1 (Gemma3RMSNorm multiplies by 1 + w), q_norm / k_norm included;
  tensors attn_q_norm, attn_k_norm, post_attention_norm, ffn_norm (= pre_feedforward_layernorm),
  post_ffw_norm; no Q/K permutation (NEOX rope); tied (no output.weight); add_space_prefix false, and the
  tokenizer.model has no dummy prefix, as Gemma's. llama.cpp scales queries by 1/sqrt(key_length) (1/sqrt(
  hidden/heads) only for the 62-layer 27B) and ignores query_pre_attn_scalar, so config.json says
  query_pre_attn_scalar = head_dim as the 1B/4B/12B checkpoints do; embeddings are scaled by sqrt(hidden).
  A sliding layer at position p sees p - W + 1 .. p in both (LLAMA_SWA_TYPE_STANDARD). llama.cpp's CPU GELU
  reads an fp16 table, so its Gemma logits sit about 1e-2 from an exact forward even on an F32 file.
gemma2 (Gemma2Model; models/gemma2)
  GGUF: context, embedding, block count, feed forward, heads, kv heads, rms eps, key_length / value_length,
  ``gemma2.attn_logit_softcapping``, ``gemma2.final_logit_softcapping``, ``gemma2.attention.sliding_window``;
  no rope.freq_base at all (llama.cpp's default 10000 = Gemma 2's rope_theta). llama.cpp's gemma2.cpp:
  sliding layers are the even ones (pattern 2), output is always token_embd, scores are capped
  (tanh(s / cap) * cap) after the 1/sqrt(key_length) scale, logits after the lm_head. Norms + 1 as gemma3,
  no q/k norms, lm_head dropped by the converter.
qwen3 (Qwen3Model; models/qwen3)
  GGUF: TextModel's keys (rope.freq_base, key_length / value_length = head_dim, no rope.dimension_count:
  llama.cpp then rotates key_length dims); attn_q_norm / attn_k_norm (plain w); no permutation (NEOX);
  output.weight only when not tied. head_dim != hidden / heads here, as in every Qwen3.
phi3 (Phi3MiniModel; models/phi3)
  GGUF: context = max_position_embeddings, ``phi3.rope.scaling.original_context_length``, ``phi3.rope.
  dimension_count`` = int(partial_rotary_factor * hidden) // heads, ``phi3.rope.freq_base``, ``phi3.attention.
  sliding_window`` (0 when null), ``phi3.rope.scaling.attn_factor`` = sqrt(1 + ln(s) / ln(original)) with
  s = max / original, and F32 tensors rope_factors_long.weight / rope_factors_short.weight (rope dims / 2
  each); no rope.scaling.type key (Phi3MiniModel does not call TextModel's). Fused attn_qkv (q, k, v rows)
  and ffn_up = gate_up_proj (gate rows first), no permutation (NEOX, the first rope dims rotated). llama.cpp
  (phi3.cpp, llama_model::get_rope_factors) takes the long factors when the context it was opened with
  (n_ctx, padded to 256) exceeds original_context_length, the short ones otherwise, for every position, and
  disables the sliding window; transformers picks by the longest position seen. The attn_factor scales
  cos and sin in both cases. A general.name holding "phi3" or "phi-3" makes llama.cpp's vocab loader
  look up Phi-3's own pieces (<|endoftext|>) and fail without them, so the file is named as Phi-4-mini.
smollm3 (SmolLM3Model = LlamaModel with arch smollm3; models/smollm3)
  GGUF: TextModel's keys plus vocab_size and rope.dimension_count (head_dim); Q/K rows permuted as for
  Llama (undo_permute). Nothing marks the NoPE layers: llama.cpp's smollm3.cpp hard-codes
  n_no_rope_layer_step = 4 (layer il skips RoPE when (il + 1) % 4 == 0), which is transformers'
  no_rope_layers (1 = rope) for no_rope_layer_interval 4, so a tiny SmolLM3 needs at least 4 layers.

BOS (tokenizer_config.json add_bos_token, written to the GGUF by SpecialVocab): true for the Gemmas, false
for Qwen3, Phi-3 and SmolLM3, as their published tokenizers say. The tokenizer is the tiny SentencePiece one
for every family (the real Qwen3, SmolLM3 and Phi-4-mini ones are BPE; the converter's SentencePiece path
takes any tokenizer.model first); the pieces listed in added_tokens_decoder (unknown, control,
user-defined) are CONTROL in the GGUF. The chat template is the tiny tokenizer's ChatML one for every family.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np
import sentencepiece

from helpers.tiny_models import CHAT_TEMPLATE, GGUFWritten, TinyModel, encode_tensor, write_hf
from helpers.tiny_tokenizer import piece_types, train_tiny_spm
from perfx.reference import permute_qk, unpermute_qk

# The tiny shapes. Every row length is a multiple of 32 (Q4_0 / Q8_0 blocks); intermediate 256 lets ffn_down
# hold K-quants (rows of 256). GQA everywhere; head_dim != hidden / heads where the family allows it (Gemma,
# Qwen3); Phi-3 and SmolLM3 have no head_dim of their own (llama.cpp's phi3 needs heads * head_dim = hidden).
# Windows of 8 are shorter than a test prompt, so sliding layers differ from global ones; Gemma 2's attention
# cap is 10 rather than its 50, which these scores (about O(1)) would never reach: a missing cap shows.
FAMILIES = {
    "gemma3": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
                   rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window=8,
                   sliding_window_pattern=6, rope_scaling=None, final_logit_softcapping=None,
                   tie_word_embeddings=True),
    "gemma2": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
                   rope_theta=10_000.0, sliding_window=8, attn_logit_softcapping=10.0,
                   final_logit_softcapping=30.0, tie_word_embeddings=True),
    "qwen3": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
                  rope_theta=1_000_000.0, tie_word_embeddings=True),
    "phi3": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, original_max_position_embeddings=256,
                 partial_rotary_factor=0.75, rms_norm_eps=1e-5, rope_theta=10_000.0, sliding_window=1024,
                 tie_word_embeddings=True),
    "smollm3": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                    rope_theta=5_000_000.0, no_rope_layer_interval=4, tie_word_embeddings=True),
    # block_ff_dim 384 → int(2·384/3) = 256 after LFM2's auto-adjust (a multiple of block_multiple_of 256)
    "lfm2": dict(hidden_size=128, intermediate_size=384, block_ff_dim=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, norm_eps=1e-5,
                 rope_theta=1_000_000.0, conv_L_cache=3, layer_types=["conv", "conv", "full_attention", "conv"],
                 tie_embedding=True),
    # Qwen3.5: three Gated DeltaNet layers, then gated attention (full_attention_interval 4); 2 q/k heads
    # under 4 v heads, so the converter's v-head reordering (grouped → tiled) matters; a quarter of the
    # attention head rotated, as in every Qwen3.5
    "qwen35": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6,
                   rope_theta=10_000_000.0, partial_rotary_factor=0.25, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
                   linear_conv_kernel_dim=4, full_attention_interval=4, tie_word_embeddings=True),
    # Qwen3.5-MoE: Qwen3.5's layers, each FFN 2 of 6 experts of 32 and a σ-gated shared expert of 64 (wider than
    # an expert, as a separate width must be); no intermediate_size, as its config.json has none
    "qwen35moe": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10_000_000.0,
                      partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
                      full_attention_interval=4, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, tie_word_embeddings=False),
}

MODEL_TYPE = {"gemma3": "gemma3_text", "gemma2": "gemma2", "qwen3": "qwen3", "phi3": "phi3", "smollm3": "smollm3",
              "lfm2": "lfm2", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}
ARCHITECTURES = {"gemma3": "Gemma3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "lfm2": "Lfm2ForCausalLM",
                 "qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM"}
GEMMAS = ("gemma3", "gemma2")
QWEN35S = ("qwen35", "qwen35moe")   # Qwen3.5's layers, with a dense MLP or the mixture of experts
ADD_BOS = {"gemma3": True, "gemma2": True, "qwen3": False, "phi3": False, "smollm3": False, "lfm2": True,
           "qwen35": False, "qwen35moe": False}

# Per-layer tensor types, cycled over the layers: Q4_0 and Q8_0 on rows of 64 / 128, K-quants on ffn_down.
DEFAULT_TYPES = [
    {"q": "Q4_0", "k": "Q8_0", "v": "Q8_0", "o": "Q4_0", "gate": "Q4_0", "up": "Q8_0", "down": "Q4_K"},
    {"q": "Q8_0", "k": "Q4_0", "v": "Q4_0", "o": "Q8_0", "gate": "Q8_0", "up": "Q4_0", "down": "Q6_K"},
]
DEFAULT_PHI3_TYPES = [
    {"qkv": "Q8_0", "o": "Q4_0", "gate_up": "Q4_0", "down": "Q4_K"},
    {"qkv": "Q4_0", "o": "Q8_0", "gate_up": "Q8_0", "down": "Q6_K"},
]
# Qwen3.5-MoE's: every form the routed GEMVs read (Q4_0 and Q8_0 experts, F16 ones held as int8) and Q4_0 / Q8_0
# shared experts; no K-quants, whose rows of 256 the tiny experts (K = 32) have not
QWEN35MOE_TYPES = [
    {"q": "Q8_0", "k": "Q4_0", "v": "Q8_0", "o": "Q4_0", "gate": "Q4_0", "up": "Q8_0", "down": "Q8_0",
     "gate_exps": "Q4_0", "up_exps": "Q4_0", "down_exps": "Q4_0"},
    {"q": "Q4_0", "k": "Q8_0", "v": "Q4_0", "o": "Q8_0", "gate": "Q8_0", "up": "Q4_0", "down": "Q4_0",
     "gate_exps": "Q8_0", "up_exps": "Q8_0", "down_exps": "F16"},
]
F32_TYPES = [{k: "F32" for k in ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up")}]
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def family_tokenizer(directory: Path, family: str) -> Path:
    """The tiny SentencePiece model for ``family`` (Gemma's kind: no dummy prefix), trained once per directory."""
    prefix = family not in GEMMAS
    path = Path(directory) / ("spm" if prefix else "spm-no-prefix") / "tokenizer.model"
    return path if path.is_file() else train_tiny_spm(path.parent, add_dummy_prefix=prefix)


def rope_dims(config: dict) -> int:
    """The dimensions RoPE rotates per head, as llama.cpp's converter computes them."""
    if config["model_type"] == "phi3":
        return int(config["partial_rotary_factor"] * config["hidden_size"]) // config["num_attention_heads"]
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def make_family_model(family: str, tokenizer_model: Path, rng: np.random.Generator, logit_std: float = 4.0,
                      embed_rms: float = 0.05, **overrides) -> TinyModel:
    """Random weights of the tiny ``FAMILIES[family]`` shape (``overrides`` change its entries).

    Each matrix is N(0, 1/K), so every layer adds O(1) to the residual stream; the embeddings enter it at
    rms ``embed_rms`` (after Gemma's sqrt(hidden)), small beside the layers' sum, so a tied model does not
    just predict its input token again; the final norm (tied) or lm_head sets the logits' spread to about
    ``logit_std``, so the top logit stands clear of the next and greedy decoding is not decided by
    rounding. Gemma norms hold w where the model multiplies by 1 + w.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    shape = dict(FAMILIES[family], **overrides)
    vocab = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_model)).get_piece_size()
    config = _hub_config(family, shape, vocab, rng)
    if family == "lfm2":
        return _make_lfm2(config, Path(tokenizer_model), rng, logit_std, embed_rms)
    if family in QWEN35S:
        return _make_qwen35(config, Path(tokenizer_model), rng, logit_std, embed_rms)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    gemma = family in GEMMAS

    def matrix(n, k):
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def norm(n, scale=1.0):
        w = scale * (1 + 0.1 * rng.standard_normal(n))
        return (w - 1 if gemma else w).astype(np.float32)

    embed_std = embed_rms / np.sqrt(hidden) if gemma else embed_rms
    w = {"model.embed_tokens.weight": (embed_std * rng.standard_normal((vocab, hidden))).astype(np.float32)}
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        if gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm(hidden)
            w[p + "post_feedforward_layernorm.weight"] = norm(hidden)
        if family in ("gemma3", "qwen3"):
            w[p + "self_attn.q_norm.weight"] = norm(head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        if family == "phi3":
            w[p + "self_attn.qkv_proj.weight"] = matrix(q_dim + 2 * kv_dim, hidden)
            w[p + "mlp.gate_up_proj.weight"] = matrix(2 * inter, hidden)
        else:
            w[p + "self_attn.q_proj.weight"] = matrix(q_dim, hidden)
            w[p + "self_attn.k_proj.weight"] = matrix(kv_dim, hidden)
            w[p + "self_attn.v_proj.weight"] = matrix(kv_dim, hidden)
            w[p + "mlp.gate_proj.weight"] = matrix(inter, hidden)
            w[p + "mlp.up_proj.weight"] = matrix(inter, hidden)
        w[p + "self_attn.o_proj.weight"] = matrix(hidden, q_dim)
        w[p + "mlp.down_proj.weight"] = matrix(hidden, inter)
    # logits = rmsnorm(h) * g . row: spread g * |row|, |row| = embed_std * sqrt(hidden) when tied
    tied = config["tie_word_embeddings"]
    w["model.norm.weight"] = norm(hidden, logit_std / (embed_std * np.sqrt(hidden)) if tied else 1.0)
    if not tied:
        w["lm_head.weight"] = logit_std * matrix(vocab, hidden)
    return TinyModel(config, w, Path(tokenizer_model), extra={"family": family})


def _make_lfm2(config: dict, tokenizer_model: Path, rng: np.random.Generator, logit_std: float,
               embed_rms: float) -> TinyModel:
    """LFM2's weights under transformers' names (modeling_lfm2): operator_norm and ffn_norm, conv.in_proj
    (B, C, x rows), conv.conv (hidden, 1, L), conv.out_proj on conv layers, self_attn q/k/v/out_proj with
    q_layernorm / k_layernorm on attention layers, feed_forward w1 (gate), w3 (up), w2 (down), and
    embedding_norm, the final norm. B and C are scaled so the gated product C·(w ⋆ B·x) is O(1)."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, length = hidden // heads, config["conv_L_cache"]
    inter = int(2 * config["block_ff_dim"] / 3)

    def matrix(n, k, scale=1.0):
        return (scale * rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def norm(n, scale=1.0):
        return (scale * (1 + 0.1 * rng.standard_normal(n))).astype(np.float32)

    w = {"model.embed_tokens.weight": (embed_rms * rng.standard_normal((config["vocab_size"], hidden))).astype(
        np.float32)}
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        w[p + "operator_norm.weight"] = norm(hidden)
        w[p + "ffn_norm.weight"] = norm(hidden)
        if kind == "conv":
            w[p + "conv.in_proj.weight"] = matrix(3 * hidden, hidden, 2.0)
            w[p + "conv.conv.weight"] = (rng.standard_normal((hidden, 1, length)) / np.sqrt(length)).astype(np.float32)
            w[p + "conv.out_proj.weight"] = matrix(hidden, hidden)
        else:
            w[p + "self_attn.q_proj.weight"] = matrix(heads * head_dim, hidden)
            w[p + "self_attn.k_proj.weight"] = matrix(kv_heads * head_dim, hidden)
            w[p + "self_attn.v_proj.weight"] = matrix(kv_heads * head_dim, hidden)
            w[p + "self_attn.out_proj.weight"] = matrix(hidden, heads * head_dim)
            w[p + "self_attn.q_layernorm.weight"] = norm(head_dim)
            w[p + "self_attn.k_layernorm.weight"] = norm(head_dim)
        w[p + "feed_forward.w1.weight"] = matrix(inter, hidden)
        w[p + "feed_forward.w3.weight"] = matrix(inter, hidden)
        w[p + "feed_forward.w2.weight"] = matrix(hidden, inter)
    w["model.embedding_norm.weight"] = norm(hidden, logit_std / (embed_rms * np.sqrt(hidden)))
    return TinyModel(config, w, tokenizer_model, extra={"family": "lfm2"})


def _make_qwen35(config: dict, tokenizer_model: Path, rng: np.random.Generator, logit_std: float,
                 embed_rms: float) -> TinyModel:
    """Qwen3.5's weights under transformers' names (modeling_qwen3_5, Qwen3_5ForCausalLM): input_layernorm and
    post_attention_layernorm (1 + w, as every norm but the DeltaNet's own), self_attn q_proj (q and the gate,
    2·D rows a head), k/v/o_proj, q_norm / k_norm on attention layers; linear_attn in_proj_qkv (q, k, v; v
    heads grouped by q/k head), in_proj_z, in_proj_a, in_proj_b, conv1d (channels, 1, L), dt_bias, A_log,
    norm (plain w), out_proj on the others; mlp gate/up/down_proj; model.norm."""
    hidden, heads, kv_heads, head_dim = (config[k] for k in ("hidden_size", "num_attention_heads",
                                                              "num_key_value_heads", "head_dim"))
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    dk, dv, length = config["linear_key_head_dim"], config["linear_value_head_dim"], config["linear_conv_kernel_dim"]
    moe = "num_experts" in config

    def matrix(n, k, scale=1.0):
        return (scale * rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def centred(n, scale=1.0):   # Qwen3_5RMSNorm multiplies by 1 + w
        return (scale * (1 + 0.1 * rng.standard_normal(n)) - 1).astype(np.float32)

    w = {"model.embed_tokens.weight": (embed_rms * rng.standard_normal((config["vocab_size"], hidden))).astype(
        np.float32)}
    for i, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = centred(hidden)
        w[p + "post_attention_layernorm.weight"] = centred(hidden)
        if kind == "linear_attention":
            a = p + "linear_attn."
            # q near k (projections and taps): the gated norm keeps only the direction of o, which at the
            # first positions is about β·(q̂·k̂)·v; for unrelated q and k the sign of q̂·k̂ (≈ ±0.2) would be
            # decided by rounding, and with it the logits
            qkv, taps = matrix(2 * hk * dk + hv * dv, hidden), rng.standard_normal((2 * hk * dk + hv * dv, 1, length))
            qkv[:hk * dk] = qkv[hk * dk:2 * hk * dk] + 0.3 * matrix(hk * dk, hidden)
            taps[:hk * dk] = taps[hk * dk:2 * hk * dk] + 0.3 * rng.standard_normal((hk * dk, 1, length))
            w[a + "in_proj_qkv.weight"] = qkv
            w[a + "in_proj_z.weight"] = matrix(hv * dv, hidden)
            w[a + "in_proj_a.weight"] = matrix(hv, hidden)
            w[a + "in_proj_b.weight"] = matrix(hv, hidden)
            w[a + "conv1d.weight"] = (taps / np.sqrt(length)).astype(np.float32)
            w[a + "dt_bias"] = (0.5 * rng.standard_normal(hv)).astype(np.float32)
            w[a + "A_log"] = np.log(rng.uniform(0.05, 1.0, hv)).astype(np.float32)   # decays from ~0.97 a step
            w[a + "norm.weight"] = (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
            w[a + "out_proj.weight"] = matrix(hidden, hv * dv)
        else:
            w[p + "self_attn.q_proj.weight"] = matrix(2 * heads * head_dim, hidden)
            w[p + "self_attn.k_proj.weight"] = matrix(kv_heads * head_dim, hidden)
            w[p + "self_attn.v_proj.weight"] = matrix(kv_heads * head_dim, hidden)
            w[p + "self_attn.o_proj.weight"] = matrix(hidden, heads * head_dim)
            w[p + "self_attn.q_norm.weight"] = centred(head_dim)
            w[p + "self_attn.k_norm.weight"] = centred(head_dim)
        if not moe:
            inter = config["intermediate_size"]
            w[p + "mlp.gate_proj.weight"] = matrix(inter, hidden)
            w[p + "mlp.up_proj.weight"] = matrix(inter, hidden)
            w[p + "mlp.down_proj.weight"] = matrix(hidden, inter)
            continue
        # Qwen3_5MoeSparseMoeBlock as the hub checkpoints save it: the router mlp.gate, each expert's
        # gate/up/down_proj, the shared expert and its gate (a Linear(hidden, 1)); a router of spread 2 so the
        # top experts stand clear of the next
        e, inter = config["num_experts"], config["moe_intermediate_size"]
        shared = config["shared_expert_intermediate_size"]
        w[p + "mlp.gate.weight"] = matrix(e, hidden, 2.0)
        for j in range(e):
            w[p + f"mlp.experts.{j}.gate_proj.weight"] = matrix(inter, hidden)
            w[p + f"mlp.experts.{j}.up_proj.weight"] = matrix(inter, hidden)
            w[p + f"mlp.experts.{j}.down_proj.weight"] = matrix(hidden, inter)
        w[p + "mlp.shared_expert.gate_proj.weight"] = matrix(shared, hidden)
        w[p + "mlp.shared_expert.up_proj.weight"] = matrix(shared, hidden)
        w[p + "mlp.shared_expert.down_proj.weight"] = matrix(hidden, shared)
        w[p + "mlp.shared_expert_gate.weight"] = matrix(1, hidden, 1.5)
    w["model.norm.weight"] = centred(hidden, logit_std / (embed_rms * np.sqrt(hidden)))
    if moe and not config.get("tie_word_embeddings", False):
        w["lm_head.weight"] = matrix(config["vocab_size"], hidden)
        w["model.norm.weight"] = centred(hidden, logit_std)
    return TinyModel(config, w, tokenizer_model, extra={"family": "qwen35moe" if moe else "qwen35"})


def qwen35_v_tiled(w: np.ndarray, config: dict, axis: int, head: int, skip: int = 0) -> np.ndarray:
    """The converter's _reorder_v_heads: v heads grouped by q/k head (transformers) → tiled (llama.cpp), along
    ``axis`` from element ``skip`` on (in_proj_qkv and conv1d: past q and k), ``head`` elements a v head."""
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    w = np.moveaxis(np.asarray(w), axis, 0)
    part = w[skip:]
    tiled = part.reshape(hk, hv // hk, head, *part.shape[1:]).swapaxes(0, 1).reshape(part.shape)
    return np.moveaxis(np.concatenate([w[:skip], tiled]), 0, axis)


def qwen35_v_grouped(w: np.ndarray, config: dict, axis: int, head: int, skip: int = 0) -> np.ndarray:
    """The inverse of ``qwen35_v_tiled``."""
    hk, hv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    w = np.moveaxis(np.asarray(w), axis, 0)
    part = w[skip:]
    grouped = part.reshape(hv // hk, hk, head, *part.shape[1:]).swapaxes(0, 1).reshape(part.shape)
    return np.moveaxis(np.concatenate([w[:skip], grouped]), 0, axis)


def _qwen35_reorder(hf_name: str, c: dict):
    """(axis, head size, elements skipped) of the v heads the converter reorders in this tensor, or None."""
    if ".linear_attn." not in hf_name or c["linear_num_key_heads"] == c["linear_num_value_heads"]:
        return None
    qk, dv = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"], c["linear_value_head_dim"]
    return {"in_proj_qkv.weight": (0, dv, qk), "in_proj_z.weight": (0, dv, 0), "in_proj_a.weight": (0, 1, 0),
            "in_proj_b.weight": (0, 1, 0), "A_log": (0, 1, 0), "dt_bias": (0, 1, 0), "conv1d.weight": (0, dv, qk),
            "out_proj.weight": (1, dv, 0)}.get(hf_name.split(".linear_attn.")[1])


def _qwen35_centred(hf_name: str) -> bool:
    return hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight")


def qwen35_stored(hf_name: str, w: np.ndarray, c: dict) -> np.ndarray:
    """Qwen3NextModel / _LinearAttentionVReorderBase.modify_tensors on one tensor: v heads tiled where
    Hk ≠ Hv, A_log → −exp(A_log), conv1d squeezed, every norm + 1 but the DeltaNet's own."""
    reorder = _qwen35_reorder(hf_name, c)
    if reorder is not None:
        w = qwen35_v_tiled(w, c, *reorder)
    if hf_name.endswith("A_log"):
        return -np.exp(w.astype(np.float64)).astype(np.float32)
    if hf_name.endswith("conv1d.weight"):
        return w.reshape(w.shape[0], w.shape[-1])
    return w + np.float32(1) if _qwen35_centred(hf_name) else w


def qwen35_unstored(hf_name: str, held: np.ndarray, c: dict) -> np.ndarray:
    """What a GGUF tensor holds, back in transformers' form (the inverse of ``qwen35_stored``)."""
    if hf_name.endswith("A_log"):
        held = np.log(-held)
    elif _qwen35_centred(hf_name):
        held = held - 1
    reorder = _qwen35_reorder(hf_name, c)
    return held if reorder is None else qwen35_v_grouped(held, c, *reorder)


def _hub_config(family: str, shape: dict, vocab: int, rng: np.random.Generator) -> dict:
    """config.json as the family's published checkpoints have it, at the tiny shape."""
    s = dict(shape)
    layers = s["num_hidden_layers"]
    common = {"architectures": [ARCHITECTURES[family]], "model_type": MODEL_TYPE[family], "vocab_size": vocab,
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "attention_bias": False,
              "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "torch_dtype": "bfloat16"}
    if family == "gemma3":
        extra = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": s["head_dim"],
                 "attn_logit_softcapping": None, "cache_implementation": "hybrid"}
    elif family == "gemma2":
        extra = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
                 "query_pre_attn_scalar": s["head_dim"], "cache_implementation": "hybrid"}
    elif family == "qwen3":
        extra = {"hidden_act": "silu", "rope_scaling": None, "sliding_window": None, "use_sliding_window": False,
                 "max_window_layers": layers}
    elif family == "phi3":
        half = rope_dims(dict(s, model_type="phi3")) // 2
        # factors >= 1 rising with the wavelength, as Phi-4-mini's: long ones stretch far more
        ramp = np.linspace(0.0, 1.0, half)
        short = 1.0 + 0.5 * ramp ** 2 + 0.05 * rng.random(half)
        long = 1.0 + 15.0 * ramp ** 2 + 0.5 * rng.random(half)
        extra = {"hidden_act": "silu", "embd_pdrop": 0.0, "resid_pdrop": 0.0, "lm_head_bias": False,
                 "mlp_bias": False,
                 "rope_scaling": {"long_factor": [round(float(x), 4) for x in long],
                                  "short_factor": [round(float(x), 4) for x in short], "type": "longrope"}}
    elif family in QWEN35S:   # Qwen3.5's text_config keys (transformers 5 wrote them: rope_parameters)
        interval = s.pop("full_attention_interval")
        extra = {"hidden_act": "silu", "attn_output_gate": True, "full_attention_interval": interval,
                 "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                 for i in range(layers)],
                 "rope_parameters": {"rope_type": "default", "rope_theta": s.pop("rope_theta"),
                                     "partial_rotary_factor": s.pop("partial_rotary_factor"),
                                     "mrope_interleaved": True, "mrope_section": [11, 11, 10]}}
    elif family == "lfm2":   # LiquidAI/LFM2-350M's config.json keys
        extra = {"block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0, "block_multiple_of": 256,
                 "block_norm_eps": s["norm_eps"], "conv_bias": False, "num_heads": s["num_attention_heads"]}
        common.pop("attention_bias")
    else:  # smollm3
        interval = s.pop("no_rope_layer_interval")
        extra = {"hidden_act": "silu", "mlp_bias": False, "rope_scaling": None, "sliding_window": None,
                 "use_sliding_window": False, "max_window_layers": layers, "pretraining_tp": 1,
                 "layer_types": ["full_attention"] * layers, "no_rope_layer_interval": interval,
                 "no_rope_layers": [int((i + 1) % interval != 0) for i in range(layers)]}
    return {**common, **extra, **s}


def transformers5_config(config: dict) -> dict:
    """``config`` (hub style) as transformers 5's save_pretrained writes it back: rope_parameters in place of
    rope_theta / rope_scaling / rope_local_base_freq, layer_types spelled out, dtype for torch_dtype."""
    c = dict(config)
    family = next(f for f, t in MODEL_TYPE.items() if t == c["model_type"])
    c["dtype"] = c.pop("torch_dtype")
    c["transformers_version"] = "5.24.0"
    if family in QWEN35S:   # its hub config.json is transformers 5's already
        return dict(sorted(c.items()))
    rope = {"rope_theta": c.pop("rope_theta"), "rope_type": "default"}
    scaling = dict(c.pop("rope_scaling", None) or {})
    if family == "phi3":
        rope.update(scaling, rope_type=scaling.get("type", "longrope"),
                    partial_rotary_factor=c["partial_rotary_factor"],
                    original_max_position_embeddings=c["original_max_position_embeddings"])
    elif scaling:
        rope.update(scaling, rope_type=scaling.pop("rope_type", None) or scaling.pop("type"))
    layers = c["num_hidden_layers"]
    if family == "gemma3":
        pattern = c["sliding_window_pattern"]
        c["rope_parameters"] = {"full_attention": rope, "sliding_attention": {
            "rope_theta": c.pop("rope_local_base_freq"), "rope_type": "default"}}
        c["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                            for i in range(layers)]
        c["_sliding_window_pattern"], c["use_bidirectional_attention"] = pattern, False
    else:
        c["rope_parameters"] = rope
    if family == "gemma2":
        c["layer_types"] = ["full_attention" if i % 2 else "sliding_attention" for i in range(layers)]
        c["use_bidirectional_attention"] = None
    if family == "qwen3":
        c["layer_types"] = ["full_attention"] * layers
    if family == "lfm2":   # Lfm2Config reads the old key and writes the standard one back
        c["tie_word_embeddings"] = c.pop("tie_embedding")
    return dict(sorted(c.items()))


# ---------------------------------------------------------------------------------------------
# Hugging Face directories


def write_family_tokenizer(directory: Path, model: TinyModel) -> Path:
    """tokenizer.model, tokenizer_config.json (the family's BOS rule) and generation_config.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    family = model.extra["family"]
    shutil.copy(model.tokenizer_model, directory / "tokenizer.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model.tokenizer_model))
    # save_pretrained lists the control, unknown and user-defined pieces, all special here
    kinds = piece_types(Path(model.tokenizer_model).read_bytes())
    listed = (gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)
    added = {str(i): {"content": processor.id_to_piece(i), "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, kind in enumerate(kinds) if kind in listed}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": ADD_BOS[family], "add_eos_token": False, "added_tokens_decoder": added,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "model_max_length": model.config["max_position_embeddings"], "sp_model_kwargs": {},
        "tokenizer_class": "GemmaTokenizer" if family in GEMMAS else "LlamaTokenizer"}, indent=1))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return directory


def write_family_hf(directory: Path, model: TinyModel, weights: dict[str, np.ndarray] | None = None,
                    dtype: str = "BF16", style: str = "hub") -> Path:
    """A Hugging Face directory of ``model`` (``weights`` replaces its own, e.g. what a GGUF holds).

    ``dtype`` "BF16" (as published), "F16" or "F32"; ``style`` "hub" or "transformers5" (module docstring).
    """
    directory = write_hf(directory, model, weights, dtype=dtype)
    config = json.loads((directory / "config.json").read_text())
    if style == "transformers5":
        config = transformers5_config(config)
    elif style != "hub":
        raise ValueError(f"style {style!r}: 'hub' or 'transformers5'")
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_family_tokenizer(directory, model)
    return directory


# ---------------------------------------------------------------------------------------------
# GGUF as convert_hf_to_gguf.py writes it

SHORT = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
         "down_proj": "down", "qkv_proj": "qkv", "gate_up_proj": "gate_up",
         # LFM2: the conv's in_proj takes q's type, both out_proj o's, w1 / w3 / w2 gate / up / down
         "in_proj": "q", "out_proj": "o", "w1": "gate", "w3": "up", "w2": "down",
         # Qwen3.5's DeltaNet: q|k|v takes q's type, z v's, a and b k's, out_proj o's
         "in_proj_qkv": "q", "in_proj_z": "v", "in_proj_a": "k", "in_proj_b": "k"}
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q8_0": "MOSTLY_Q8_0",
              "Q4_0": "MOSTLY_Q4_0", "Q4_1": "MOSTLY_Q4_1", "Q5_0": "MOSTLY_Q5_0", "Q5_1": "MOSTLY_Q5_1",
              "Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M", "Q6_K": "MOSTLY_Q6_K"}


def write_family_gguf(path: Path, model: TinyModel, types: list[dict] | None = None,
                      embedding_type: str = "Q8_0", output_type: str = "Q8_0") -> GGUFWritten:
    """A GGUF of ``model`` as llama.cpp's converter (and llama-quantize) write its family (module docstring).

    ``types`` is a list of per-layer dicts, cycled over the layers, from module ("q", "k", "v", "o", "gate",
    "up", "down"; Phi-3: "qkv", "o", "gate_up", "down") to tensor type; norms and rope factors are F32 as
    the converter writes them. Returns the weights the file holds by llama.cpp's definition, back in
    transformers' form (row order, Gemma's w rather than 1 + w), so write_family_hf(weights=...) is the
    same model.
    """
    family = model.extra["family"]
    c = model.config
    types = types or {"phi3": DEFAULT_PHI3_TYPES, "qwen35moe": QWEN35MOE_TYPES}.get(family, DEFAULT_TYPES)
    linear_types = [t for layer in types for t in layer.values()]
    file_type = max(set(linear_types), key=linear_types.count)
    writer = gguf.GGUFWriter(str(path), family)
    # llama.cpp's vocab loader gives Phi-3 token attributes to a model whose general.name holds "phi3" or
    # "phi-3", and then needs an <|endoftext|> piece, which the tiny tokenizer has not: named as Phi-4-mini
    writer.add_name("perfx tiny " + ("phi-4-mini" if family == "phi3" else family))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hparams(writer, family, c)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES.get(file_type, "GUESSED")])
    with tempfile.TemporaryDirectory() as hf_dir:    # SpecialVocab reads the ids from config.json
        (Path(hf_dir) / "config.json").write_text(json.dumps(c))
        _add_vocab(writer, write_family_tokenizer(Path(hf_dir), model), c["vocab_size"])
    if family in GEMMAS:
        writer.add_add_space_prefix(False)

    written = GGUFWritten(Path(path), {}, {})
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.upper()], c["num_hidden_layers"])
    heads = {"q_proj": c["num_attention_heads"], "k_proj": c["num_key_value_heads"]}
    experts: dict[tuple[int, str], list[str]] = {}
    for hf_name, w in model.weights.items():
        if family == "gemma2" and hf_name == "lm_head.weight":
            continue          # Gemma2Model.filter_tensors: llama.cpp's gemma2 always reads token_embd
        if ".mlp.experts." in hf_name:    # Qwen2MoeModel.modify_tensors stacks each projection over the experts
            experts.setdefault((int(hf_name.split(".")[2]), hf_name.split(".")[-2]), []).append(hf_name)
            continue
        if hf_name.endswith(".A_log"):        # tensors without a .weight: ssm_a, ssm_dt.bias (from dt_proj.bias)
            gguf_name = names.get_name(hf_name)
        elif hf_name.endswith(".dt_bias"):
            gguf_name = names.get_name(hf_name.replace(".dt_bias", ".dt_proj")) + ".bias"
        else:
            gguf_name = names.get_name(hf_name.removesuffix(".weight")) + ".weight"
        module = hf_name.split(".")[-2]
        hf_shape = w.shape
        if family in QWEN35S:
            w = qwen35_stored(hf_name, w, c)
        if gguf_name.endswith("shortconv.conv.weight"):   # LFM2Model.modify_tensors squeezes; always F32
            w, kind = w.reshape(w.shape[0], w.shape[-1]), "F32"
        elif gguf_name.endswith("ssm_conv1d.weight"):   # always F32
            kind = "F32"
        elif gguf_name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):   # routers: F32, 1-D gate
            w, kind = (w.reshape(-1) if "shexp" in gguf_name else w), "F32"
        elif w.ndim == 1 or gguf_name.endswith("_norm.weight"):
            kind = "F32"
        elif gguf_name == "token_embd.weight":
            kind = embedding_type
        elif gguf_name == "output.weight":
            kind = output_type
        else:
            kind = types[int(hf_name.split(".")[2]) % len(types)][SHORT[module]]
        if kind in K_QUANTS and w.shape[1] % 256:
            raise ValueError(f"{gguf_name}: rows of {w.shape[1]} are no multiple of 256, which {kind} needs "
                             f"(llama-quantize falls back to Q5_0 / Q8_0 there): choose another type")
        permute = heads.get(module) if family == "smollm3" else None
        gemma_norm = family in GEMMAS and hf_name.endswith("norm.weight")
        stored = w + np.float32(1) if gemma_norm else w
        if permute:       # LlamaModel.permute: rotate-half pairs -> interleaved pairs (llama.cpp's NORM rope)
            stored = permute_qk(stored, permute)
        data, raw_dtype, held = encode_tensor(stored, kind)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
        if permute:
            held = unpermute_qk(held, permute)
        if family in QWEN35S:
            held = qwen35_unstored(hf_name, held, c)
        written.weights[hf_name] = (held - 1 if gemma_norm else held).reshape(hf_shape)
        written.types[hf_name] = kind
    for (layer, module), hf_names in experts.items():
        stacked = np.stack([model.weights[name] for name in hf_names])
        gguf_name = f"blk.{layer}.ffn_{SHORT[module]}_exps.weight"
        layer_types = types[layer % len(types)]
        kind = layer_types.get(f"{SHORT[module]}_exps", layer_types[SHORT[module]])
        data, raw_dtype, held = encode_tensor(stacked, kind)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
        for name, expert in zip(hf_names, held.reshape(stacked.shape)):
            written.weights[name], written.types[name] = expert, kind
    if family == "phi3":
        for which in ("long", "short"):
            factors = np.asarray(c["rope_scaling"][f"{which}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{which}.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _add_hparams(writer: gguf.GGUFWriter, family: str, c: dict):
    """The architecture's keys, as the converter's set_gguf_parameters (and generate_extra_tensors) write them."""
    if family == "gemma2":                   # Gemma2Model.set_gguf_parameters, no TextModel keys
        writer.add_context_length(c["max_position_embeddings"])
        writer.add_embedding_length(c["hidden_size"])
        writer.add_block_count(c["num_hidden_layers"])
        writer.add_feed_forward_length(c["intermediate_size"])
        writer.add_head_count(c["num_attention_heads"])
        writer.add_head_count_kv(c["num_key_value_heads"])
        writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
        writer.add_attn_logit_softcapping(c["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(c["final_logit_softcapping"])
        writer.add_sliding_window(c["sliding_window"])
        return
    if family == "phi3":                     # Phi3MiniModel.set_gguf_parameters, generate_extra_tensors
        original, longest = c["original_max_position_embeddings"], c["max_position_embeddings"]
        writer.add_context_length(longest)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_embedding_length(c["hidden_size"])
        writer.add_feed_forward_length(c["intermediate_size"])
        writer.add_block_count(c["num_hidden_layers"])
        writer.add_head_count(c["num_attention_heads"])
        writer.add_head_count_kv(c["num_key_value_heads"])
        writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
        writer.add_rope_dimension_count(rope_dims(c))
        writer.add_rope_freq_base(c["rope_theta"])
        writer.add_sliding_window(c.get("sliding_window") or 0)
        if c["rope_scaling"].get("long_factor"):
            scale = longest / original
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
        return
    if family in QWEN35S:                    # Qwen3_5TextModel: TextModel's keys, Qwen3NextModel's, M-RoPE's
        rope = c["rope_parameters"]
        writer.add_block_count(c["num_hidden_layers"])
        writer.add_context_length(c["max_position_embeddings"])
        writer.add_embedding_length(c["hidden_size"])
        if "intermediate_size" in c:         # TextModel writes it only where config.json has it
            writer.add_feed_forward_length(c["intermediate_size"])
        if "num_experts" in c:               # Qwen2MoeModel.set_gguf_parameters: the experts' keys
            writer.add_expert_count(c["num_experts"])
            writer.add_expert_used_count(c["num_experts_per_tok"])
            writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
            writer.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
        writer.add_head_count(c["num_attention_heads"])
        writer.add_head_count_kv(c["num_key_value_heads"])
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
        writer.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
        writer.add_ssm_state_size(c["linear_key_head_dim"])
        writer.add_ssm_group_count(c["linear_num_key_heads"])
        writer.add_ssm_time_step_rank(c["linear_num_value_heads"])
        writer.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
        # add_recurrent_layers (gguf-py 0.18 has none yet): one bool a layer, from layer_types
        writer.add_array(f"{family}.attention.recurrent_layers", [t == "linear_attention" for t in c["layer_types"]])
        writer.add_full_attention_interval(c["full_attention_interval"])
        writer.add_rope_dimension_count(int(c["head_dim"] * rope["partial_rotary_factor"]))
        writer.add_rope_dimension_sections(rope["mrope_section"] + [0])
        return
    if family == "lfm2":                     # LFM2Model.set_gguf_parameters: TextModel's keys, then its own
        writer.add_block_count(c["num_hidden_layers"])
        writer.add_context_length(c["max_position_embeddings"])
        writer.add_embedding_length(c["hidden_size"])
        writer.add_feed_forward_length(c["intermediate_size"])
        writer.add_head_count(c["num_attention_heads"])
        writer.add_head_count_kv([c["num_key_value_heads"] if kind != "conv" else 0 for kind in c["layer_types"]])
        writer.add_rope_freq_base(c["rope_theta"])
        writer.add_vocab_size(c["vocab_size"])
        writer.add_shortconv_l_cache(c["conv_L_cache"])
        writer.add_layer_norm_rms_eps(c["norm_eps"])
        writer.add_feed_forward_length(int(2 * c["block_ff_dim"] / 3))   # _add_feed_forward_length, over the first
        return
    # TextModel.set_gguf_parameters: gemma3, qwen3, smollm3
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    scaling = c.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear" and scaling.get("factor") is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    writer.add_rope_freq_base(c["rope_theta"])
    if c.get("rope_local_base_freq") is not None:
        writer.add_rope_freq_base_swa(c["rope_local_base_freq"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if c.get("head_dim") is not None:
        writer.add_key_length(c["head_dim"])
        writer.add_value_length(c["head_dim"])
    if family == "gemma3":                   # Gemma3Model.set_gguf_parameters, after TextModel's
        if c.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(c["final_logit_softcapping"])
        if c.get("sliding_window_pattern") != 1:
            writer.add_sliding_window(c["sliding_window"])
    if family == "smollm3":                  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(c["vocab_size"])
        writer.add_rope_dimension_count(rope_dims(c))


def _add_vocab(writer: gguf.GGUFWriter, directory: Path, vocab_size: int):
    """TextModel._set_vocab_sentencepiece on a Hugging Face directory: pieces, scores, types, SpecialVocab."""
    processor = sentencepiece.SentencePieceProcessor(model_file=str(directory / "tokenizer.model"))
    tokens = [f"[PAD{i}]".encode() for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    toktypes = [gguf.TokenType.UNUSED] * vocab_size
    for i in range(min(processor.vocab_size(), vocab_size)):
        tokens[i], scores[i] = processor.id_to_piece(i).encode(), processor.get_score(i)
        toktypes[i] = (gguf.TokenType.UNKNOWN if processor.is_unknown(i) else
                       gguf.TokenType.CONTROL if processor.is_control(i) else
                       gguf.TokenType.UNUSED if processor.is_unused(i) else
                       gguf.TokenType.BYTE if processor.is_byte(i) else gguf.TokenType.NORMAL)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    for key, entry in config.get("added_tokens_decoder", {}).items():
        i = int(key)
        if i < vocab_size:     # every added token here is special: CONTROL, score -1000
            tokens[i], scores[i], toktypes[i] = entry["content"].encode(), -1000.0, gguf.TokenType.CONTROL
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(toktypes)
    gguf.SpecialVocab(directory, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
