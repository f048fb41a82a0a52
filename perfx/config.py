"""Model hyper-parameters and the architecture as a recipe, read from a Hugging Face ``config.json`` or a
GGUF header.

A ``ModelConfig`` holds the shapes, and the recipe the forward follows: where the norms are (before
attention and the FFN always; Gemma's also after them), per-head Q/K RMSNorm (Qwen3, Gemma 3), the FFN
activation (SiLU or tanh-GELU gate), the attention scale and logit soft-cap, the embedding scale, a final
logit soft-cap, and per layer (``LayerRecipe``) its RoPE (base, scaling, rotated dimensions, or none) and
its attention window. The device forward and the float64 reference forward read the recipe and never the
architecture's name: each family below is only a way of filling it in, as llama.cpp reads that family's
GGUF (``src/models/<arch>.cpp``, ``llama-model.cpp``) and transformers its config.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from perfx.errors import PerfxError
from perfx.gguf_file import GGUFFile

# Hugging Face model_type values perfx runs (gemma3 is the multimodal checkpoint: its text_config is read)
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "phi3",
                           "smollm3", "lfm2", "qwen3_5_text", "qwen3_5")
# GGUF general.architecture values; Mistral GGUFs are written as "llama".
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "lfm2", "qwen35")
# GGUF architectures whose converter permutes Wq/Wk rows for llama.cpp's interleaved RoPE (LLAMA_ROPE_TYPE_NORM);
# the others use NeoX (rotate-half) order as Hugging Face does.
GGUF_PERMUTED_QK = ("llama", "smollm3")
FFN_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_KINDS = ("attention", "conv", "delta")
QWEN35_FULL_ATTENTION_INTERVAL = 4   # llama.cpp's and transformers' default: every 4th layer full attention
SMOLLM3_NO_ROPE_STEP = 4   # llama.cpp hard-codes it (no GGUF key): layers with (i + 1) % 4 == 0 have no RoPE


@dataclass(frozen=True)
class Rope:
    """One layer's rotary embedding: base θ, the first ``dims`` dimensions of each head rotated (rotate-half
    pairs (i, i + dims/2)), and Hugging Face's ``rope_scaling`` dict (``perfx.reference.rope_inv_freq``)."""

    theta: float
    dims: int
    scaling: dict | None = field(default=None, hash=False, compare=False)

    def key(self) -> str:
        """Equal for layers that can share one cos/sin table."""
        return json.dumps([self.theta, self.dims, self.scaling], sort_keys=True)

    def for_context(self, ctx: int) -> Rope:
        """LongRoPE (Phi-3) picks its per-pair factors by the context: the short ones up to the original
        context length, the long ones beyond it (llama.cpp's rule, from the cache size)."""
        s = self.scaling
        if not s or s.get("rope_type") != "longrope" or "short_factor" not in s:
            return self
        factors = s["long_factor"] if ctx > s["original_max_position_embeddings"] else s["short_factor"]
        return Rope(self.theta, self.dims, {"rope_type": "longrope", "freq_factors": list(factors),
                                            "attention_factor": s["attention_factor"]})


@dataclass(frozen=True)
class LayerRecipe:
    rope: Rope | None      # None: no rotary embedding on this layer (SmolLM3's NoPE layers)
    window: int = 0        # sliding window: a position attends to the last `window` positions (0: all)
    kind: str = "attention"   # what mixes the positions: "attention", "conv" (LFM2's gated short convolution) or
                              # "delta" (Qwen3.5's Gated DeltaNet linear attention)


@dataclass
class ModelConfig:
    """Shapes, constants and the recipe of a decoder. Every field the forward pass needs, nothing else."""

    architecture: str          # the family, as the file names it (GGUF general.architecture, HF model_type)
    vocab_size: int            # V
    hidden_size: int           # hidden, the residual stream width
    intermediate_size: int     # the MLP's inner width
    n_layers: int
    n_heads: int               # H query heads
    n_kv_heads: int            # Hkv key/value heads (GQA when < H)
    head_dim: int              # D (Gemma, Qwen3: not hidden / H)
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None    # Hugging Face rope_scaling ("llama3", "linear", "longrope") or None; a
                                        # GGUF's rope_freqs tensor rides along as "freq_factors" (D/2 divisors)
    max_positions: int = 4096
    tie_embeddings: bool = False        # lm_head is the embedding matrix
    qkv_bias: bool = False              # Qwen2 has biases on the Q, K and V projections
    sliding_window: int = 0             # the window of the layers that have one (0: none)
    # -- the recipe (defaults: Llama's) --
    rotary_dims: int = 0                # dimensions of each head RoPE rotates (0 given: all; Phi-4-mini 96 of 128)
    qk_norm: bool = False               # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False            # RMSNorm on the attention and FFN outputs before each residual add (Gemma)
    ffn_activation: str = "silu"        # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma)
    attention_scale: float = 0.0        # q·k scale (0: 1/√head_dim; Gemma: query_pre_attn_scalar^−½)
    attn_softcap: float = 0.0           # attention logits s → c·tanh(s/c) (Gemma 2; 0: off)
    final_softcap: float = 0.0          # output logits the same (Gemma 2)
    embedding_scale: float = 1.0        # the gathered embedding times this (Gemma: √hidden)
    layers: tuple = ()                  # LayerRecipe per layer; empty: every layer RoPE(θ, scaling) and the window
    conv_length: int = 0                # the short convolution's length L where layers are "conv" (LFM2: 3) or
                                        # "delta" (Qwen3.5: 4)
    attention_gate: bool = False        # the q projection holds q and a gate per head: attention output ·σ(gate)
    delta_k_heads: int = 0              # "delta" layers: Hk q/k heads of d_k, Hv v heads of d_v (Qwen3.5)
    delta_v_heads: int = 0
    delta_k_dim: int = 0
    delta_v_dim: int = 0
    delta_head_map: str = "tile"        # v head h reads q/k head h mod Hk (GGUF) or h // (Hv/Hk) (Hugging Face)
    extra: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES + SUPPORTED_GGUF_ARCHITECTURES:
            raise PerfxError(f"model architecture {self.architecture!r} is not supported; "
                             f"perfx runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.n_heads % self.n_kv_heads:
            raise PerfxError(f"n_heads = {self.n_heads} is not a multiple of n_kv_heads = {self.n_kv_heads}")
        if self.head_dim % 2:
            raise PerfxError(f"head_dim = {self.head_dim} must be even for rotary embeddings")
        rotary = self.rotary_dims or self.head_dim
        if rotary % 2 or not 0 < rotary <= self.head_dim:
            raise PerfxError(f"the rotary dimensions ({rotary}) must be even and at most head_dim = {self.head_dim}")
        self.rotary_dims = rotary
        if self.ffn_activation not in FFN_ACTIVATIONS:
            raise PerfxError(f"FFN activation {self.ffn_activation!r} is not supported ({', '.join(FFN_ACTIVATIONS)})")
        if not self.layers:
            rope = Rope(float(self.rope_theta), rotary, self.rope_scaling)
            self.layers = tuple(LayerRecipe(rope, int(self.sliding_window)) for _ in range(self.n_layers))
        if len(self.layers) != self.n_layers:
            raise PerfxError(f"the recipe lists {len(self.layers)} layers but the model has {self.n_layers}")
        kinds = {r.kind for r in self.layers}
        if not kinds <= set(LAYER_KINDS):
            raise PerfxError(f"layer kinds {sorted(kinds - set(LAYER_KINDS))} are not supported ({', '.join(LAYER_KINDS)})")
        if kinds & {"conv", "delta"} and not 2 <= self.conv_length <= 8:
            raise PerfxError(f"the short convolution's length {self.conv_length} is not supported (2 .. 8)")
        if "delta" in kinds:
            self._check_delta()

    def _check_delta(self):
        hk, hv, dk, dv = self.delta_k_heads, self.delta_v_heads, self.delta_k_dim, self.delta_v_dim
        if min(hk, hv, dk, dv) < 1 or hv % hk or max(dk, dv) > 256:
            raise PerfxError(f"Gated DeltaNet layers with {hk} q/k heads of {dk} and {hv} v heads of {dv}: perfx "
                             "runs positive sizes, v heads a multiple of the q/k heads, head sizes up to 256")
        if self.delta_head_map not in ("tile", "interleave"):
            raise PerfxError(f"delta_head_map {self.delta_head_map!r}: 'tile' or 'interleave'")

    def layers_of(self, kind: str) -> list[int]:
        """The indices of the layers of one kind ("attention", "conv")."""
        return [i for i, r in enumerate(self.layers) if r.kind == kind]

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_dim(self) -> int:
        """Rows of the fused QKV matrix: q H·D, then k Hkv·D, then v Hkv·D."""
        return self.q_dim + 2 * self.kv_dim

    @property
    def delta_conv_dim(self) -> int:
        """Channels of a delta layer's convolution, its q|k|v in-projection's rows: Hk·d_k + Hk·d_k + Hv·d_v."""
        return 2 * self.delta_k_heads * self.delta_k_dim + self.delta_v_heads * self.delta_v_dim

    @property
    def delta_value_dim(self) -> int:
        """Hv·d_v: a delta layer's output (and z) width."""
        return self.delta_v_heads * self.delta_v_dim

    @property
    def scale(self) -> float:
        """The attention scale in force."""
        return self.attention_scale or 1.0 / math.sqrt(self.head_dim)

    def layer(self, i: int, ctx: int) -> LayerRecipe:
        """Layer i's recipe for a cache of ``ctx`` positions (LongRoPE picks its factors by the context)."""
        recipe = self.layers[i]
        rope = None if recipe.rope is None else recipe.rope.for_context(ctx)
        return LayerRecipe(rope, recipe.window, recipe.kind)

    def describe_recipe(self) -> str:
        """One line of what this model's forward does beyond Llama's (for `perfx info` and the load line)."""
        parts = []
        convs = len(self.layers_of("conv"))
        if convs:
            parts.append(f"short conv (L = {self.conv_length}) on {convs}/{self.n_layers} layers")
        deltas = len(self.layers_of("delta"))
        if deltas:
            parts.append(f"Gated DeltaNet ({self.delta_k_heads}/{self.delta_v_heads} heads of {self.delta_k_dim}/"
                         f"{self.delta_v_dim}, conv L = {self.conv_length}) on {deltas}/{self.n_layers} layers")
        if self.attention_gate:
            parts.append("gated attention output")
        if self.qk_norm:
            parts.append("q/k norm")
        if self.post_norms:
            parts.append("post-norms")
        if self.ffn_activation != "silu":
            parts.append(f"FFN {self.ffn_activation}")
        windows = sorted({r.window for r in self.layers if r.kind == "attention"})
        if windows not in ([0], []):
            sliding = sum(1 for r in self.layers if r.window)
            parts.append(f"window {max(windows)} on {sliding}/{self.n_layers} layers")
        nope = sum(1 for r in self.layers if r.rope is None and r.kind == "attention")
        if nope:
            parts.append(f"no RoPE on {nope}/{self.n_layers} layers")
        bases = sorted({r.rope.theta for r in self.layers if r.rope is not None})
        if len(bases) > 1:
            parts.append("RoPE bases " + "/".join(f"{b:g}" for b in bases))
        if any(r.rope is not None and (r.rope.scaling or {}).get("rope_type") == "longrope" for r in self.layers):
            parts.append("LongRoPE")
        if self.rotary_dims != self.head_dim:
            parts.append(f"rotary {self.rotary_dims}/{self.head_dim}")
        if self.attention_scale:
            parts.append(f"attention scale {self.attention_scale:.4g}")
        if self.attn_softcap or self.final_softcap:
            parts.append(f"soft-caps {self.attn_softcap:g}/{self.final_softcap:g}")
        if self.embedding_scale != 1.0:
            parts.append(f"embedding ×{self.embedding_scale:.4g}")
        return ", ".join(parts) or "Llama recipe"

    # -- Hugging Face config.json ---------------------------------------------------------------------

    @classmethod
    def from_hf(cls, config: dict) -> ModelConfig:
        """From the dict of a Hugging Face ``config.json`` (a multimodal Gemma 3's text_config)."""
        architecture = config.get("model_type")
        if architecture == "qwen3_5":   # the multimodal checkpoint (every published one): its text model
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise PerfxError("config.json of model_type qwen3_5 has no text_config; the file is incomplete")
            config = {**text, "model_type": "qwen3_5_text", "tie_word_embeddings": config.get(
                "tie_word_embeddings", text.get("tie_word_embeddings", False))}
            architecture = "qwen3_5_text"
        if architecture == "gemma3":
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise PerfxError("config.json of model_type gemma3 has no text_config; the file is incomplete")
            config = {"model_type": "gemma3_text", **text}
            architecture = "gemma3_text"
        if architecture not in SUPPORTED_ARCHITECTURES:
            named = config.get("architectures") or []
            raise PerfxError(f"model_type {architecture!r} {named} is not supported; perfx runs "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)} models")
        try:
            hidden = int(config["hidden_size"])
            n_heads = int(config["num_attention_heads"])
            values = dict(
                vocab_size=int(config["vocab_size"]),
                intermediate_size=int(config["intermediate_size"]),
                n_layers=int(config["num_hidden_layers"]),
            )
        except KeyError as error:
            raise PerfxError(f"config.json lacks {error.args[0]!r}, which every {architecture} config "
                             "has; the file is incomplete") from None
        n_layers = values["n_layers"]
        gemma = architecture in ("gemma2", "gemma3_text")
        n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
        head_dim = int(config.get("head_dim") or (256 if gemma else hidden // n_heads))
        # Qwen2 always has Q/K/V biases; the others when attention_bias is set.
        qkv_bias = architecture == "qwen2" or bool(config.get("attention_bias", False))
        window = int(config.get("sliding_window") or 0)
        # Qwen2/Qwen3 configs carry a sliding_window too, but use it only with use_sliding_window (off in every
        # released model, and not what transformers does for them by default).
        if architecture in ("qwen2", "qwen3", "llama", "smollm3"):
            window = 0
        default_eps = 1e-5 if architecture in ("llama", "mistral", "phi3", "lfm2") else 1e-6
        theta, scaling, local_theta = _hf_rope(config)
        recipe = dict(rms_eps=float(config.get("rms_norm_eps", config.get("norm_eps", default_eps))), rope_theta=theta,
                      rope_scaling=scaling, sliding_window=window)
        rope = Rope(theta, head_dim, scaling)
        if architecture == "qwen3":
            recipe["qk_norm"] = True
        elif gemma:
            scalar = float(config.get("query_pre_attn_scalar") or head_dim)
            recipe.update(post_norms=True, ffn_activation=_hf_activation(config),
                          attention_scale=scalar ** -0.5, embedding_scale=math.sqrt(hidden),
                          attn_softcap=float(config.get("attn_logit_softcapping") or 0.0),
                          final_softcap=float(config.get("final_logit_softcapping") or 0.0))
            sliding = _hf_sliding_layers(config, n_layers, 6 if architecture == "gemma3_text" else 2)
            if architecture == "gemma3_text":
                recipe["qk_norm"] = True
                local = Rope(local_theta, head_dim, None)
            else:
                local = rope
            recipe["layers"] = tuple(LayerRecipe(local, window) if s else LayerRecipe(rope, 0) for s in sliding)
        elif architecture == "phi3":
            rotary = int(head_dim * float(config.get("partial_rotary_factor")
                                          or (config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)))
            recipe["rotary_dims"] = rotary
            if scaling:
                scaling = recipe["rope_scaling"] = _hf_longrope(config, scaling, rotary)
            rope = Rope(theta, rotary, scaling)
            recipe["layers"] = tuple(LayerRecipe(rope, window) for _ in range(n_layers))
        elif architecture == "qwen3_5_text":
            recipe.update(_hf_qwen35(config, n_layers, theta))
        elif architecture == "lfm2":
            recipe.update(_hf_lfm2(config, n_layers, rope))
            values["intermediate_size"] = _lfm2_ffn_size(config)
        elif architecture == "smollm3":
            uses = config.get("no_rope_layers")
            if uses is None:
                step = int(config.get("no_rope_layer_interval") or SMOLLM3_NO_ROPE_STEP)
                uses = [int((i + 1) % step != 0) for i in range(n_layers)]
            if len(uses) != n_layers:
                raise PerfxError(f"config.json: no_rope_layers lists {len(uses)} layers but the model has "
                                 f"{n_layers}; the config is corrupt")
            recipe["layers"] = tuple(LayerRecipe(rope if use else None, 0) for use in uses)
        return cls(
            architecture=architecture, hidden_size=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads,
            head_dim=head_dim, max_positions=int(config.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(config.get("tie_word_embeddings", config.get("tie_embedding", gemma or
                                                                               architecture == "lfm2"))),
            qkv_bias=qkv_bias,
            **recipe, **values,
        )

    # -- GGUF header ----------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader: GGUFFile) -> ModelConfig:
        """From an open GGUF file: the ``{arch}.*`` keys, vocabulary and head sizes, as llama.cpp reads them."""
        arch = reader.value("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise PerfxError(f"GGUF architecture {arch!r} is not supported; perfx reads GGUF files of "
                             f"architecture {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")

        def key(name, default=None):
            value = reader.value(f"{arch}.{name}")
            if value is None and default is None:
                raise PerfxError(f"GGUF header lacks {arch}.{name}; the file was not written by a "
                                 "complete llama.cpp converter")
            return default if value is None else value

        hidden = int(key("embedding_length"))
        n_heads = int(key("attention.head_count"))
        # Multi-token-prediction blocks (Qwen3.5) follow the decoder's in block_count; perfx runs the decoder
        n_layers = int(key("block_count")) - int(reader.value(f"{arch}.nextn_predict_layers") or 0)
        vocab = reader.value(f"{arch}.vocab_size")
        if vocab is None:
            tokens = reader.fields.get("tokenizer.ggml.tokens")
            vocab = len(tokens.value) if tokens is not None else _embedding_rows(reader)
        head_dim = int(reader.value(f"{arch}.attention.key_length") or hidden // n_heads)
        value_dim = reader.value(f"{arch}.attention.value_length")
        if value_dim is not None and int(value_dim) != head_dim:
            raise PerfxError(f"GGUF {arch}.attention.value_length = {value_dim} differs from key_length = "
                             f"{head_dim}; perfx's attention needs equal key and value head sizes")
        rotary = int(reader.value(f"{arch}.rope.dimension_count") or head_dim)
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise PerfxError(f"GGUF {arch}.rope.dimension_count = {rotary} must be even and at most the head "
                             f"size {head_dim}; the file is corrupt")
        scaling = None
        scaling_type = reader.value(f"{arch}.rope.scaling.type")
        if scaling_type == "linear":
            scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        elif scaling_type not in (None, "none") and arch != "phi3":
            raise PerfxError(f"GGUF rope scaling type {scaling_type!r} is not supported (supported: linear)")
        factors = _rope_freqs(reader, rotary)
        if factors is not None:
            scaling = dict(scaling or {"rope_type": "default"}, freq_factors=factors)
        theta = _float32_value(key("rope.freq_base", 10000.0))
        window = int(reader.value(f"{arch}.attention.sliding_window") or 0)
        recipe = dict(rms_eps=_float32_value(key("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=theta,
                      rope_scaling=scaling, sliding_window=window, rotary_dims=rotary)
        rope = Rope(theta, rotary, scaling)
        n_kv_override = None
        if arch == "qwen3":
            recipe["qk_norm"] = True
        elif arch in ("gemma2", "gemma3"):
            # llama.cpp: 1/√key_length, except the 27B models (62 and 46 layers) which scale by 1/√(hidden/H)
            large = n_layers == (62 if arch == "gemma3" else 46)
            recipe.update(post_norms=True, ffn_activation="gelu_tanh", embedding_scale=math.sqrt(hidden),
                          attention_scale=1.0 / math.sqrt(hidden / n_heads if large else head_dim))
            if arch == "gemma2":   # llama.cpp's defaults where the keys are absent
                recipe["attn_softcap"] = _float32_value(key("attn_logit_softcapping", 50.0))
                recipe["final_softcap"] = _float32_value(key("final_logit_softcapping", 30.0))
                local, pattern = rope, 2
            else:
                recipe["qk_norm"] = True
                recipe["final_softcap"] = _float32_value(reader.value(f"{arch}.final_logit_softcapping") or 0.0)
                # local layers: base 10 000 (or the file's freq_base_swa) and no scaling (llama.cpp's gemma3)
                local = Rope(_float32_value(key("rope.freq_base_swa", 10000.0)), rotary, None)
                pattern = 6
            # llama.cpp's set_swa_pattern(n): layer i slides when i % n < n − 1; no window, every layer global
            recipe["layers"] = tuple(
                LayerRecipe(local, window) if window and i % pattern < pattern - 1 else LayerRecipe(rope, 0)
                for i in range(n_layers))
        elif arch == "phi3":
            scaling = _gguf_longrope(reader, arch, rotary, theta)
            if scaling is not None:
                recipe["rope_scaling"] = scaling
                recipe["layers"] = tuple(LayerRecipe(Rope(theta, rotary, scaling), window) for _ in range(n_layers))
        elif arch == "smollm3":
            recipe["layers"] = tuple(LayerRecipe(None if (i + 1) % SMOLLM3_NO_ROPE_STEP == 0 else rope, window)
                                     for i in range(n_layers))
        elif arch == "qwen35":
            recipe.update(_gguf_qwen35(reader, arch, key, n_layers, rope))
        elif arch == "lfm2":
            # llama.cpp's lfm2: a layer with no kv heads (head_count_kv is per layer) is a short-conv layer
            kv_heads = _per_layer(key("attention.head_count_kv"), n_layers, f"{arch}.attention.head_count_kv")
            attention = [kv for kv in kv_heads if kv]
            if not attention or len(set(attention)) > 1:
                raise PerfxError(f"GGUF {arch}.attention.head_count_kv = {kv_heads}: perfx runs LFM2 files with "
                                 "one kv head count on every attention layer and at least one attention layer")
            n_kv_override = attention[0]
            recipe.update(qk_norm=True, conv_length=int(key("shortconv.l_cache")), layers=tuple(
                LayerRecipe(rope, window) if kv else LayerRecipe(None, 0, "conv") for kv in kv_heads))
        return cls(
            architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")), n_layers=n_layers,
            n_heads=n_heads, n_kv_heads=int(n_kv_override or key("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            max_positions=int(key("context_length", 4096)),
            tie_embeddings="output.weight" not in reader.tensors,
            qkv_bias=any(name in reader.tensors for name in ("blk.0.attn_q.bias", "blk.0.attn_qkv.bias")),
            **recipe,
        )


def _per_layer(value, n_layers: int, name: str) -> list[int]:
    """A GGUF key that holds one value, or one per layer (llama.cpp reads either), as one per layer."""
    values = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * n_layers
    if len(values) != n_layers:
        raise PerfxError(f"GGUF {name} lists {len(values)} layers but the model has {n_layers}; the file is corrupt")
    return values


def _qwen35_recipe(recurrent: list[bool], rope: Rope, conv_length: int, hk: int, hv: int, dk: int, dv: int,
                   head_map: str) -> dict:
    if all(recurrent):
        raise PerfxError("a Qwen3.5 model with no full-attention layer: perfx needs at least one")
    return dict(qk_norm=True, attention_gate=True, conv_length=conv_length, delta_k_heads=hk, delta_v_heads=hv,
                delta_k_dim=dk, delta_v_dim=dv, delta_head_map=head_map,
                layers=tuple(LayerRecipe(None, 0, "delta") if r else LayerRecipe(rope, 0) for r in recurrent))


def _gguf_qwen35(reader: GGUFFile, arch: str, key, n_layers: int, rope: Rope) -> dict:
    """Qwen3.5 as llama.cpp's qwen35.cpp reads it: the linear-attention layers from attention.recurrent_layers,
    else every layer but each full_attention_interval-th; ssm.group_count q/k heads and ssm.time_step_rank v
    heads, both of ssm.state_size (llama.cpp sizes the v heads' tensors by it and the state by
    ssm.inner_size / time_step_rank, so the two must agree); ssm.conv_kernel taps. Text positions make its
    interleaved M-RoPE the NeoX rotation of rope.dimension_count dimensions."""
    hk, hv = int(key("ssm.group_count")), int(key("ssm.time_step_rank"))
    dk, inner = int(key("ssm.state_size")), int(key("ssm.inner_size"))
    if hk < 1 or hv < 1 or inner != hv * dk:
        raise PerfxError(f"GGUF {arch}.ssm.inner_size = {inner} must be {arch}.ssm.time_step_rank {hv} × "
                         f"{arch}.ssm.state_size {dk} = {hv * dk} (llama.cpp's v head size is state_size); the "
                         "header is corrupt")
    flags = reader.value(f"{arch}.attention.recurrent_layers")
    if flags is not None:
        recurrent = [bool(f) for f in flags][:n_layers]
        if len(recurrent) != n_layers:
            raise PerfxError(f"GGUF {arch}.attention.recurrent_layers lists {len(flags)} layers but the model has "
                             f"{n_layers}; the file is corrupt")
    else:
        interval = int(key("full_attention_interval", QWEN35_FULL_ATTENTION_INTERVAL))
        if interval < 1:
            raise PerfxError(f"GGUF {arch}.full_attention_interval = {interval} must be at least 1")
        recurrent = [(i + 1) % interval != 0 for i in range(n_layers)]
    return _qwen35_recipe(recurrent, rope, int(key("ssm.conv_kernel")), hk, hv, dk, dk, "tile")


def _hf_qwen35(config: dict, n_layers: int, theta: float) -> dict:
    """Qwen3.5's text config (transformers' Qwen3_5TextConfig): layer_types (or full_attention_interval),
    linear_* sizes, partial_rotary_factor (0.25 by default) of head_dim rotated. The checkpoint's v heads are
    grouped by q/k head (transformers' repeat_interleave), which the kernels read as head_map interleave."""
    kinds = config.get("layer_types")
    if kinds is None:
        interval = int(config.get("full_attention_interval") or QWEN35_FULL_ATTENTION_INTERVAL)
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
    recipe = _qwen35_recipe([k == "linear_attention" for k in kinds], Rope(theta, rotary, None),
                            int(config.get("linear_conv_kernel_dim", 4)), hk, hv, dk, dv, "interleave")
    return dict(recipe, rotary_dims=rotary)


def _hf_lfm2(config: dict, n_layers: int, rope: Rope) -> dict:
    """LFM2's layer pattern (layer_types, or the older full_attn_idxs; every layer attention without either),
    q/k norms and the convolution's length, as transformers' Lfm2Config reads them."""
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
        LayerRecipe(rope, 0) if kind == "full_attention" else LayerRecipe(None, 0, "conv") for kind in kinds))


def _lfm2_ffn_size(config: dict) -> int:
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


def _hf_rope(config: dict) -> tuple[float, dict | None, float]:
    """(θ, rope_scaling or None, Gemma 3's local θ) from a config.json: rope_theta / rope_scaling /
    rope_local_base_freq as published checkpoints write them, or transformers 5's rope_parameters (one dict,
    or one per layer type: full_attention and sliding_attention)."""
    params = config.get("rope_parameters")
    if not params:
        return (float(config.get("rope_theta", 10000.0)), config.get("rope_scaling") or None,
                float(config.get("rope_local_base_freq", 10000.0)))
    local = params.get("sliding_attention")
    if "full_attention" in params:
        params = params["full_attention"]
    # Qwen3.5's M-RoPE sections matter only for images: on text every section reads the same position
    scaling = {k: v for k, v in params.items()
               if k not in ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")}
    if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1:
        scaling = None
    return (float(params.get("rope_theta", 10000.0)), scaling,
            float((local or {}).get("rope_theta", config.get("rope_local_base_freq", 10000.0))))


def _hf_activation(config: dict) -> str:
    name = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu"):
        # Gemma's "gelu" is the tanh approximation too (transformers maps it so for Gemma checkpoints)
        return "gelu_tanh"
    if name in ("silu", "swish"):
        return "silu"
    raise PerfxError(f"config.json: activation {name!r} is not supported (gelu_pytorch_tanh or silu)")


def _hf_sliding_layers(config: dict, n_layers: int, pattern: int) -> list[bool]:
    """Which layers have the sliding window: transformers' layer_types where given, else its pattern
    (Gemma 3: every `sliding_window_pattern`-th layer global; Gemma 2: even layers slide)."""
    types = config.get("layer_types")
    if types is not None:
        if len(types) != n_layers:
            raise PerfxError(f"config.json: layer_types lists {len(types)} layers but the model has {n_layers}")
        return [t == "sliding_attention" for t in types]
    if not config.get("sliding_window"):
        return [False] * n_layers
    if pattern == 2:
        return [i % 2 == 0 for i in range(n_layers)]
    pattern = int(config.get("sliding_window_pattern") or pattern)
    return [(i + 1) % pattern != 0 for i in range(n_layers)]


def _hf_longrope(config: dict, scaling: dict, rotary: int) -> dict:
    """Phi-3's LongRoPE (transformers ``_compute_longrope_parameters``): per-pair factors, short and long,
    and the attention factor that scales cos and sin."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("longrope", "su"):
        return scaling
    original = int(config.get("original_max_position_embeddings")
                   or scaling.get("original_max_position_embeddings") or 0)
    if not original:
        raise PerfxError("config.json: a longrope rope_scaling needs original_max_position_embeddings")
    out = {"rope_type": "longrope", "original_max_position_embeddings": original}
    for name in ("short_factor", "long_factor"):
        factors = scaling.get(name)
        if factors is None or len(factors) != rotary // 2:
            raise PerfxError(f"config.json: rope_scaling.{name} has {len(factors or [])} values, but RoPE over "
                             f"{rotary} dimensions needs {rotary // 2}; the config is corrupt")
        out[name] = [float(f) for f in factors]
    factor = scaling.get("factor") or int(config.get("max_position_embeddings", original)) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    out["attention_factor"] = float(attention)
    return out


def _gguf_longrope(reader: GGUFFile, arch: str, rotary: int, theta: float) -> dict | None:
    """A Phi-3 GGUF's LongRoPE: rope_factors_short / rope_factors_long tensors (one per pair of rotated
    dimensions) and {arch}.rope.scaling.attn_factor, which llama.cpp multiplies into cos and sin."""
    tensors = reader.tensors
    names = ("rope_factors_short.weight", "rope_factors_long.weight")
    if not any(n in tensors for n in names):
        return None
    out = {"rope_type": "longrope",
           "original_max_position_embeddings": int(reader.value(f"{arch}.rope.scaling.original_context_length")
                                                   or reader.value(f"{arch}.context_length") or 4096),
           "attention_factor": _float32_value(reader.value(f"{arch}.rope.scaling.attn_factor") or 1.0)}
    for name, field_name in zip(names, ("short_factor", "long_factor")):
        tensor = tensors.get(name)
        if tensor is None:
            raise PerfxError(f"GGUF has {' or '.join(n for n in names if n in tensors)} but not {name}: a LongRoPE "
                             "file needs both factor tables; the file is incomplete")
        out[field_name] = _factor_table(tensor, name, rotary)
    return out


def _factor_table(tensor, name: str, rotary: int) -> list[float]:
    if tensor.tensor_type.name not in ("F32", "F16"):
        raise PerfxError(f"GGUF tensor {name} has type {tensor.tensor_type.name}; llama.cpp writes it as F32 "
                         "(the file is not from a llama.cpp converter)")
    values = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    if values.size != rotary // 2:
        raise PerfxError(f"GGUF tensor {name} has {values.size} values, but RoPE over {rotary} dimensions needs "
                         f"one per dimension pair, {rotary // 2}; the file is corrupt or its header lies about the "
                         "rotary size")
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise PerfxError(f"GGUF tensor {name} holds a value that is not a positive finite number; the frequency "
                         "divisors of a corrupt file")
    return [float(v) for v in values]


def _float32_value(value) -> float:
    """GGUF stores these as float32: 1e-5 comes back as 9.99999974e-06. Take the shortest decimal that
    rounds to the same float32, which is what config.json said."""
    return float(str(np.float32(value)))


def _rope_freqs(reader: GGUFFile, rotary: int) -> list[float] | None:
    """Llama 3.x GGUFs carry their "llama3" rope scaling as a tensor, rope_freqs.weight: one float32 divisor
    of the inverse frequencies per pair of rotated dimensions (llama.cpp's freq_factors of ggml_rope_ext),
    None when absent."""
    tensor = reader.tensors.get("rope_freqs.weight")
    return None if tensor is None else _factor_table(tensor, "rope_freqs.weight", rotary)


def _embedding_rows(reader: GGUFFile) -> int:
    if "token_embd.weight" in reader.tensors:
        return reader.tensors["token_embd.weight"].shape[-1]
    raise PerfxError("GGUF has neither a vocabulary size nor a token_embd.weight tensor")
