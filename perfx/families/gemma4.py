"""Gemma 4 (text model_type gemma4_text, and the multimodal gemma4 checkpoints whose text_config is run), as
llama.cpp's gemma4 reads it (``src/models/gemma4.cpp``, ``llama-model.cpp``) and transformers' Gemma 4 text model:

- sliding layers with heads of ``key_length_swa`` (256) at RoPE base ``rope.freq_base_swa`` (10 000), and global
  layers with heads of ``key_length`` (512) at ``rope.freq_base`` with proportional RoPE (the file's
  ``rope_freqs``: divisor 1 on the first pairs, 10³⁰ on the rest, which then do not turn);
- per-layer KV head counts and MLP widths (the KV-sharing layers' MLP twice as wide on E2B and E4B);
- the last ``shared_kv_layers`` layers compute q only and read the cache of the last earlier layer of their
  kind (sliding or global), holding none of their own;
- q and k RMS-normed with their weights, v RMS-normed without one, attention scale 1, no attention soft-cap;
- norms used as stored (not 1 + w), the Gemma sandwich norms, a tanh-GELU gate, embeddings times √hidden;
- per-layer embeddings (``embedding_length_per_layer_input``, 256 a layer): a second token table gathered per
  token, added to a projection of the embedding, entering each layer after its MLP as a gated GELU residual;
- a learned scalar on each layer's output, and the final logit soft-cap.

The 26B-A4B model's experts are not run: a file with ``ffn_gate_inp`` is refused by its tensors (the MoE
mechanism is the MoE modules').
"""

from __future__ import annotations

import math

import numpy as np

from perfx.errors import PerfxError
from perfx.families.family import (ChatRules, Family, GGUFHeader, HFConfig, LayerRecipe, Preset, Rope, TensorNames,
                                   float32_value, per_layer)

# Gemma 4's turns: <|turn>role ... <turn|> (the system role its own turn), the model's turn opened bare
GEMMA4_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ message['content'] | trim }}{{ '<turn|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)
GEMMA4_CHAT = ChatRules(stop_tokens=("<turn|>", "<eos>"), fallback_template=GEMMA4_TEMPLATE,
                        template_tokens=("<|turn>", "<turn|>"))
# What llama.cpp's converter writes rope_freqs' unturned pairs as (float32)
UNTURNED = float(np.float32(1e30))


def shared_sources(sliding: list[bool], shared: int, where: str) -> list[int]:
    """Layer i's KV source: −1 for the layers with their own cache, else the last of the first n − shared layers
    of its kind (transformers' kv_shared_layer_index; llama.cpp's n_layer_kv_from_start)."""
    n = len(sliding)
    if not 0 <= shared < n:
        raise PerfxError(f"{where} = {shared}: the KV-sharing layers must be fewer than the model's {n} layers")
    first = n - shared
    out = []
    for i, kind in enumerate(sliding):
        if i < first:
            out.append(-1)
            continue
        own = [j for j in range(first) if sliding[j] == kind]
        if not own:
            raise PerfxError(f"{where} = {shared}: layer {i} is {'sliding' if kind else 'global'} but no earlier "
                             "layer of its kind holds a cache to share")
        out.append(own[-1])
    return out


def _layers(sliding, sources, heads_swa, heads_full, kv_heads, ffn, window, local: Rope, full: Rope) -> tuple:
    return tuple(LayerRecipe(local if s else full, window if s else 0, head_dim=heads_swa if s else heads_full,
                             kv_heads=kv, ffn=f, kv_from=src)
                 for s, src, kv, f in zip(sliding, sources, kv_heads, ffn))


def _recipe(layers: tuple, hidden: int, per_layer_input: int, softcap: float, layer_scale: bool) -> dict:
    return dict(layers=layers, head_dim=max(r.head_dim for r in layers), n_kv_heads=max(r.kv_heads for r in layers),
                intermediate_size=max(r.ffn for r in layers), qk_norm=True, value_norm=True, post_norms=True,
                ffn_activation="gelu_tanh", attention_scale=1.0, embedding_scale=math.sqrt(hidden),
                final_softcap=softcap, per_layer_input=per_layer_input, layer_scale=layer_scale,
                rotary_dims=max(r.rope.dims for r in layers))


def read_gguf(h: GGUFHeader) -> dict:
    n, arch = h.n_layers, h.arch
    sliding = [bool(v) for v in per_layer(h.key("attention.sliding_window_pattern"), n,
                                          f"{arch}.attention.sliding_window_pattern")]
    heads_swa = int(h.key("attention.key_length_swa"))
    if int(h.value("attention.value_length_swa", heads_swa)) != heads_swa:
        raise PerfxError(f"GGUF {arch}.attention.value_length_swa differs from key_length_swa = {heads_swa}; "
                         "Gemma 4 has equal key and value head sizes (llama.cpp refuses it too)")
    kv_heads = per_layer(h.key("attention.head_count_kv"), n, f"{arch}.attention.head_count_kv")
    ffn = per_layer(h.key("feed_forward_length"), n, f"{arch}.feed_forward_length")
    sources = shared_sources(sliding, int(h.value("attention.shared_kv_layers", 0)),
                             f"GGUF {arch}.attention.shared_kv_layers")
    local = Rope(float32_value(h.key("rope.freq_base_swa", 10000.0)),
                 int(h.value("rope.dimension_count_swa", heads_swa)), None)
    if "ffn_gate_inp" in " ".join(name for name in h.reader.tensors if name.startswith("blk.")):
        raise PerfxError("GGUF gemma4 with expert tensors (ffn_gate_inp: the 26B-A4B model): perfx runs the dense "
                         "Gemma 4 models (E2B, E4B, 31B)")
    return _recipe(_layers(sliding, sources, heads_swa, h.head_dim, kv_heads, ffn, h.window, local, h.rope),
                   h.hidden, int(h.value("embedding_length_per_layer_input", 0)),
                   float32_value(h.value("final_logit_softcapping") or 0.0),
                   "blk.0.layer_output_scale.weight" in h.reader.tensors)


def read_hf(h: HFConfig) -> dict:
    config, n = h.config, h.n_layers
    types = config.get("layer_types")
    if types is None or len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise PerfxError(f"config.json: layer_types must name {n} layers, each 'sliding_attention' or "
                         "'full_attention'; the config is incomplete")
    sliding = [t == "sliding_attention" for t in types]
    heads_full = int(config.get("global_head_dim") or h.head_dim)
    kv_swa = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    kv_full = int(config.get("num_global_key_value_heads") or kv_swa)
    shared = int(config.get("num_kv_shared_layers") or 0)
    sources = shared_sources(sliding, shared, "config.json num_kv_shared_layers")
    inter = int(config["intermediate_size"])
    wide = bool(config.get("use_double_wide_mlp"))
    ffn = [2 * inter if wide and i >= n - shared else inter for i in range(n)]
    params = config.get("rope_parameters") or {}
    full_params, local_params = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    local = Rope(float(local_params.get("rope_theta", 10000.0)),
                 int(h.head_dim * float(local_params.get("partial_rotary_factor", 1.0))), None)
    theta = float(full_params.get("rope_theta", 1e6))
    turned = int(heads_full * float(full_params.get("partial_rotary_factor", 1.0)) / 2)
    if full_params.get("rope_type", "default") not in ("default", "proportional"):
        raise PerfxError(f"config.json: global layers' rope_type {full_params['rope_type']!r}: perfx runs Gemma 4's "
                         "proportional RoPE")
    # proportional RoPE over the whole head: the first pairs turn at θ^(−2i/D), the rest not at all, as
    # llama.cpp's converter writes it into rope_freqs
    factors = [1.0] * turned + [UNTURNED] * (heads_full // 2 - turned)
    full = Rope(theta, heads_full, {"rope_type": "default", "freq_factors": factors})
    return dict(_recipe(_layers(sliding, sources, h.head_dim, heads_full, [kv_swa if s else kv_full for s in sliding],
                                ffn, h.window, local, full),
                        h.hidden, int(config.get("hidden_size_per_layer_input") or 0),
                        float(config.get("final_logit_softcapping") or 0.0), True),
                rope_theta=theta, rope_scaling=full.scaling, sliding_window=h.window)


def text_config(config: dict) -> tuple[str, dict]:
    """A multimodal checkpoint's text model."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise PerfxError("config.json of model_type gemma4 has no text_config; the file is incomplete")
    return "gemma4_text", {"model_type": "gemma4_text", **text}


# google/gemma-4-E2B's text_config
E2B = dict(model_type="gemma4_text", vocab_size=262144, hidden_size=1536, intermediate_size=6144,
           num_hidden_layers=35, num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
           sliding_window=512, max_position_embeddings=131072, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
           hidden_activation="gelu_pytorch_tanh", hidden_size_per_layer_input=256, num_kv_shared_layers=20,
           use_double_wide_mlp=True, tie_word_embeddings=True,
           layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
           rope_parameters={"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6,
                                               "rope_type": "proportional"},
                            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}})

# transformers' Gemma 4 names (as gguf-py's tensor map reads them): the Gemma norms, the per-layer input's
# gate, projection and norm, the layer scalar
GEMMA4_TENSORS = TensorNames(hf_vectors={"ffn_norm": "pre_feedforward_layernorm.weight",
                                         "post_attn_norm": "post_attention_layernorm.weight",
                                         "post_ffn_norm": "post_feedforward_layernorm.weight",
                                         "ple_norm": "post_per_layer_input_norm.weight", "out_scale": "layer_scalar"},
                             hf_linears={"ple_gate": "per_layer_input_gate", "ple_proj": "per_layer_projection"})

FAMILY = Family(
    name="gemma4", order=13,
    gguf_names=("gemma4",), hf_names=("gemma4_text", "gemma4"),
    read_gguf=read_gguf, read_hf=read_hf,
    hf_head_dim=256, hf_tied=True, hf_multimodal={"gemma4": text_config},
    tensors=GEMMA4_TENSORS,
    chat=GEMMA4_CHAT,
    synthetic={"gemma-4-e2b": Preset(E2B)},
)
