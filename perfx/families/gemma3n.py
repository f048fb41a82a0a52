"""Gemma 3n (text model_type gemma3n_text, and the multimodal gemma3n checkpoints' text_config), as llama.cpp's
gemma3n reads it (``src/models/gemma3n-iswa.cpp``, ``llama-model.cpp``): Gemma 4's per-layer embeddings and KV
sharing (``perfx.families.gemma4``), q/k/v norms and attention scale 1, with

- AltUp: four copies ("streams") of the residual, the active one through the layer; each layer predicts every
  stream from all of them (coefficients from a router on the active one), and corrects them by the layer's
  output (``altup_inputs``, ``altup_active``);
- LAuReL: a rank-64 residual x + norm(R·(L·x)) beside the attention, averaged with it (``laurel_rank``);
- activation sparsity on the first layers: the gate keeps what exceeds its mean plus a multiple of its
  standard deviation (``sparsity``, the file's ``activation_sparsity_scale``: Φ⁻¹(0.95) on the first 10).

The device forward (``perfx.model``) runs AltUp, LAuReL and the sparse gates through ``kernels/altup.cl``; the
float64 one is ``perfx.forward64``.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

from perfx.errors import PerfxError
from perfx.families.family import (ChatRules, Family, GGUFHeader, HFConfig, LayerRecipe, Preset, Rope, TensorNames,
                                   float32_value, per_layer)
from perfx.families.gemma2 import GEMMA_CHAT
from perfx.families.gemma4 import GEMMA4_TENSORS, shared_sources


def _recipe(hidden: int, sliding: list[bool], sources: list[int], window: int, local: Rope, full: Rope,
            per_layer_input: int, altup: tuple[int, int], laurel: int, sparsity: list[float], softcap: float) -> dict:
    return dict(layers=tuple(LayerRecipe(local if s else full, window if s else 0, kv_from=src)
                             for s, src in zip(sliding, sources)),
                qk_norm=True, value_norm=True, post_norms=True, ffn_activation="gelu_tanh", attention_scale=1.0,
                embedding_scale=math.sqrt(hidden), final_softcap=softcap, per_layer_input=per_layer_input,
                altup_inputs=altup[0], altup_active=altup[1], laurel_rank=laurel, sparsity=tuple(sparsity))


def read_gguf(h: GGUFHeader) -> dict:
    n, arch = h.n_layers, h.arch
    sliding = [bool(v) for v in per_layer(h.key("attention.sliding_window_pattern"), n,
                                          f"{arch}.attention.sliding_window_pattern")]
    sources = shared_sources(sliding, int(h.value("attention.shared_kv_layers", 0)),
                             f"GGUF {arch}.attention.shared_kv_layers")
    sparsity = h.value("activation_sparsity_scale", [0.0] * n)
    if len(sparsity) != n:
        raise PerfxError(f"GGUF {arch}.activation_sparsity_scale lists {len(sparsity)} layers but the model has {n}")
    laurel = h.reader.tensors.get("blk.0.laurel_l.weight")
    if laurel is None:
        raise PerfxError(f"GGUF {arch}: tensor blk.0.laurel_l.weight is missing; the file is incomplete")
    local = Rope(float32_value(h.key("rope.freq_base_swa", 10000.0)), h.rotary, None)
    ffn = per_layer(h.key("feed_forward_length"), n, f"{arch}.feed_forward_length")
    if len(set(ffn)) > 1:
        raise PerfxError(f"GGUF {arch}.feed_forward_length = {ffn}: perfx runs Gemma 3n with one MLP width")
    return dict(_recipe(h.hidden, sliding, sources, h.window, local, h.rope,
                        int(h.key("embedding_length_per_layer_input")),
                        (int(h.key("altup.num_inputs")), int(h.key("altup.active_idx"))), int(laurel.shape[-1]),
                        [float(np.float32(s)) for s in sparsity],
                        float32_value(h.value("final_logit_softcapping") or 0.0)),
                intermediate_size=ffn[0])


def read_hf(h: HFConfig) -> dict:
    config, n = h.config, h.n_layers
    types = config.get("layer_types")
    if types is None or len(types) != n:
        raise PerfxError(f"config.json: layer_types must name {n} layers; the config is incomplete")
    sliding = [t == "sliding_attention" for t in types]
    sources = shared_sources(sliding, int(config.get("num_kv_shared_layers") or 0), "config.json num_kv_shared_layers")
    pattern = config.get("activation_sparsity_pattern") or [0.0] * n
    # Φ⁻¹(p) in float32, as the converter writes activation_sparsity_scale (and llama.cpp multiplies by it)
    sparsity = [float(np.float32(NormalDist().inv_cdf(p))) if p else 0.0 for p in pattern]
    local = Rope(h.local_theta, h.head_dim, None)
    return _recipe(h.hidden, sliding, sources, h.window, local, h.rope, int(config["hidden_size_per_layer_input"]),
                   (int(config.get("altup_num_inputs", 4)), int(config.get("altup_active_idx", 0))),
                   int(config.get("laurel_rank", 64)), sparsity, float(config.get("final_logit_softcapping") or 0.0))


def text_config(config: dict) -> tuple[str, dict]:
    """A multimodal checkpoint's text model."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise PerfxError("config.json of model_type gemma3n has no text_config; the file is incomplete")
    return "gemma3n_text", {"model_type": "gemma3n_text", **text}


# google/gemma-3n-E2B's text_config
E2B = dict(model_type="gemma3n_text", vocab_size=262400, hidden_size=2048, intermediate_size=8192,
           num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=2, head_dim=256, sliding_window=512,
           max_position_embeddings=32768, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
           hidden_activation="gelu_pytorch_tanh", hidden_size_per_layer_input=256, num_kv_shared_layers=10,
           laurel_rank=64, altup_num_inputs=4, altup_active_idx=0, rope_theta=1e6, rope_local_base_freq=10000.0,
           activation_sparsity_pattern=[0.95] * 10 + [0.0] * 20, tie_word_embeddings=True,
           layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 6)

FAMILY = Family(
    name="gemma3n", order=14,
    gguf_names=("gemma3n",), hf_names=("gemma3n_text", "gemma3n"),
    read_gguf=read_gguf, read_hf=read_hf,
    hf_head_dim=256, hf_tied=True, hf_multimodal={"gemma3n": text_config},
    tensors=TensorNames(
        hf_vectors={**GEMMA4_TENSORS.hf_vectors, "laurel_norm": "laurel.post_laurel_norm.weight",
                    "altup_router_norm": "altup.router_norm.weight",
                    "altup_correct_scale": "altup.correct_output_scale"},
        hf_linears={**GEMMA4_TENSORS.hf_linears, "laurel_l": "laurel.linear_left", "laurel_r": "laurel.linear_right",
                    "altup_router": "altup.modality_router", "altup_predict": "altup.prediction_coefs",
                    "altup_correct": "altup.correction_coefs"}),
    chat=GEMMA_CHAT,
    synthetic={"gemma-3n-e2b": Preset(E2B)},
)
