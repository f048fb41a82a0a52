"""Model hyper-parameters and the architecture as a recipe, read from a Hugging Face ``config.json`` or a
GGUF header.

A ``ModelConfig`` holds the shapes, and the recipe the forward follows: where the norms are (before
attention and the FFN always; Gemma's also after them), per-head Q/K RMSNorm (Qwen3, Gemma 3), the FFN
activation (SiLU or tanh-GELU gate), the attention scale and logit soft-cap, the embedding scale, a final
logit soft-cap, and per layer (``LayerRecipe``) its RoPE (base, scaling, rotated dimensions, or none) and
its attention window. The device forward and the float64 reference forward read the recipe and never the
architecture's name: each family (``perfx.families``, one file an architecture) is only a way of filling it in,
as llama.cpp reads that family's GGUF (``src/models/<arch>.cpp``, ``llama-model.cpp``) and transformers its
config.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace

from perfx import families
from perfx.errors import PerfxError
from perfx.gguf_file import GGUFFile
from perfx.recipe import LayerRecipe, Rope
from perfx.reference import MOE_GATINGS

__all__ = ["FFN_ACTIVATIONS", "LAYER_KINDS", "LayerRecipe", "ModelConfig", "Rope",
           "SUPPORTED_ARCHITECTURES", "SUPPORTED_GGUF_ARCHITECTURES"]

# Hugging Face model_type values perfx runs (gemma3 and qwen3_5 are multimodal checkpoints: their text_config is
# read) and GGUF general.architecture values (Mistral GGUFs are written as "llama"): the families' names.
SUPPORTED_ARCHITECTURES = families.hf_architectures()
SUPPORTED_GGUF_ARCHITECTURES = families.gguf_architectures()
FFN_ACTIVATIONS = ("silu", "gelu_tanh")
EXPERT_ACTIVATIONS = FFN_ACTIVATIONS + ("swiglu_oai",)   # swiglu_oai: gpt-oss's clamped SwiGLU
LAYER_KINDS = ("attention", "conv", "delta")
MAX_EXPERTS = 512        # the router's top-k holds a row's experts in local memory (kernels/moe_router.cl)
MAX_EXPERTS_USED = 32


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
    o_bias: bool = False                # a bias on the attention output projection (gpt-oss)
    attention_sinks: bool = False       # a learned logit per query head in each softmax's denominator (gpt-oss)
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
    # -- mixture of experts (perfx.moe): the FFN of the layers from dense_layers on (0 experts: every layer dense)
    n_experts: int = 0                  # E routed experts a MoE layer holds
    n_experts_used: int = 0             # k chosen per token by the router
    expert_intermediate: int = 0        # each expert's FFN width
    expert_gating: str = "softmax"      # "softmax", "sigmoid" or "softmax_weight" (reference.MOE_GATINGS)
    expert_norm: bool = False           # the chosen experts' weights renormalised to sum 1
    expert_scale: float = 1.0           # the weights times this
    expert_bias: bool = False           # a per-expert selection bias, added to choose only (LFM2-MoE)
    dense_layers: int = 0               # leading layers with the dense FFN (LFM2-MoE's leading_dense_block_count)
    expert_biases: bool = False         # biases on the router's logits and on each expert's gate, up and down (gpt-oss)
    expert_activation: str = ""         # the experts' gated activation where it is not ffn_activation's: "swiglu_oai"
                                        # (gpt-oss's clamped SwiGLU, reference.swiglu_oai)
    expert_shared: int = 0              # width of a shared expert: a gated MLP every row runs beside the routed
                                        # experts, its output added to theirs (0: none; Qwen3.5-MoE 512)
    expert_shared_gate: bool = False    # the shared expert's output times σ(x·w_gate), a 1-row gate (Qwen3.5-MoE)
    # Gemma 4: layers of their own shapes (``LayerRecipe`` head_dim, kv_heads, ffn, kv_from; then head_dim,
    # n_kv_heads and intermediate_size above are the largest of the layers'), per-layer embeddings, V normed
    per_layer_input: int = 0            # width of each layer's slice of the per-layer token table (0: none)
    value_norm: bool = False            # v RMS-normed per head without a scale before the cache (Gemma 4)
    layer_scale: bool = False           # each layer's output residual times a learned scalar (Gemma 4)
    kv_shared: bool = False             # (a layer's view, ``at``) the layer reads an earlier layer's cache: q only
    # Gemma 3n: AltUp's streams and active one, LAuReL's rank, each layer's gate sparsity (0: none)
    altup_inputs: int = 0
    altup_active: int = 0
    laurel_rank: int = 0
    sparsity: tuple = ()
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
        if self.n_experts:
            self._check_experts()
        if self.expert_activation and self.expert_activation not in EXPERT_ACTIVATIONS:
            raise PerfxError(f"expert activation {self.expert_activation!r} is not supported "
                             f"({', '.join(EXPERT_ACTIVATIONS)})")
        self._check_layer_shapes()

    def _check_experts(self):
        e, k = self.n_experts, self.n_experts_used
        if not 1 <= k <= e or e > MAX_EXPERTS or k > MAX_EXPERTS_USED:
            raise PerfxError(f"{k} experts used of {e} (expert_used_count / num_experts_per_tok of expert_count / "
                             f"num_experts): perfx runs 1 <= used <= experts <= {MAX_EXPERTS}, used <= "
                             f"{MAX_EXPERTS_USED}")
        if self.expert_intermediate < 1:
            raise PerfxError(f"the experts' FFN width {self.expert_intermediate} (expert_feed_forward_length / "
                             "moe_intermediate_size) must be positive")
        if self.expert_gating not in MOE_GATINGS:
            raise PerfxError(f"expert gating {self.expert_gating!r} is not supported ({', '.join(MOE_GATINGS)})")
        if self.expert_shared < 0:
            raise PerfxError(f"the shared expert's width {self.expert_shared} (expert_shared_feed_forward_length / "
                             "shared_expert_intermediate_size) must not be negative")
        if not 0 <= self.dense_layers <= self.n_layers:
            raise PerfxError(f"{self.dense_layers} leading dense layers (leading_dense_block_count / "
                             f"num_dense_layers) of {self.n_layers} layers")

    def _check_layer_shapes(self):
        for i, r in enumerate(self.layers):
            d, kv = r.head_dim or self.head_dim, r.kv_heads or self.n_kv_heads
            if d % 2 or d > self.head_dim or kv > self.n_kv_heads or self.n_heads % kv:
                raise PerfxError(f"layer {i}: {self.n_heads} heads of {d} over {kv} KV heads do not fit the model's "
                                 f"widest ({self.n_kv_heads} KV heads of {self.head_dim}); the file is corrupt")
            if (r.ffn or self.intermediate_size) > self.intermediate_size:
                raise PerfxError(f"layer {i}: its MLP's {r.ffn} exceed the model's widest {self.intermediate_size}")
            if r.kv_from >= 0:
                source = self.layers[r.kv_from] if r.kv_from < i else None
                if source is None or source.kv_from >= 0 or (source.head_dim, source.kv_heads, source.window) != (
                        r.head_dim, r.kv_heads, r.window):
                    raise PerfxError(f"layer {i} reads layer {r.kv_from}'s KV cache, which is not an earlier layer "
                                     "of its own kind with a cache of its own")

    def is_moe(self, layer: int) -> bool:
        """Whether ``layer``'s FFN is the mixture of experts (perfx.moe) rather than the dense gated MLP."""
        return bool(self.n_experts) and layer >= self.dense_layers

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if self.is_moe(i)]

    @property
    def dense_ffn_layers(self) -> list[int]:
        return [i for i in range(self.n_layers) if not self.is_moe(i)]

    def ffn_width(self, layer: int) -> int:
        """The width of layer ``layer``'s gated MLP: the dense one's, or on a MoE layer its shared expert's (0: the
        layer has none)."""
        if self.is_moe(layer):
            return self.expert_shared
        return self.at(layer).intermediate_size

    @property
    def gated_mlp_layers(self) -> list[int]:
        """The layers that run a gated MLP: the dense layers, and the MoE layers with a shared expert."""
        return [i for i in range(self.n_layers) if self.ffn_width(i)]

    def _check_delta(self):
        hk, hv, dk, dv = self.delta_k_heads, self.delta_v_heads, self.delta_k_dim, self.delta_v_dim
        if min(hk, hv, dk, dv) < 1 or hv % hk or max(dk, dv) > 256:
            raise PerfxError(f"Gated DeltaNet layers with {hk} q/k heads of {dk} and {hv} v heads of {dv}: perfx "
                             "runs positive sizes, v heads a multiple of the q/k heads, head sizes up to 256")
        if self.delta_head_map not in ("tile", "interleave"):
            raise PerfxError(f"delta_head_map {self.delta_head_map!r}: 'tile' or 'interleave'")

    def at(self, i: int) -> ModelConfig:
        """Layer i's view of the config: head_dim, n_kv_heads, intermediate_size and rotary_dims its own, and
        ``kv_shared`` where it reads another layer's cache (the model itself where every layer is alike)."""
        views = self.__dict__.setdefault("_views", {})
        if i not in views:
            r = self.layers[i]
            if not (r.head_dim or r.kv_heads or r.ffn or r.kv_from >= 0):
                views[i] = self
            else:
                # a copy, not a new config: the model's checks hold for the model, not for one layer's shapes
                d = r.head_dim or self.head_dim
                view = copy.copy(self)
                view.__dict__.pop("_views", None)
                view.head_dim, view.n_kv_heads = d, r.kv_heads or self.n_kv_heads
                view.intermediate_size = r.ffn or self.intermediate_size
                view.rotary_dims, view.kv_shared = (r.rope.dims if r.rope is not None else d), r.kv_from >= 0
                views[i] = view
        return views[i]

    @property
    def shaped_layers(self) -> bool:
        """Whether some layer has shapes of its own or reads another layer's cache (Gemma 4)."""
        return any(self.at(i) is not self for i in range(self.n_layers))

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
        return replace(recipe, rope=rope)

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
        if self.n_experts:
            bias = " + selection bias" if self.expert_bias else ""
            shared = ""
            if self.expert_shared:
                shared = f" + a{' σ-gated' if self.expert_shared_gate else ''} shared expert of {self.expert_shared}"
            parts.append(f"{self.n_experts_used} of {self.n_experts} experts ({self.expert_gating}{bias}){shared} on "
                         f"{len(self.moe_layers)}/{self.n_layers} layers")
        if self.attention_gate:
            parts.append("gated attention output")
        if self.attention_sinks:
            parts.append("attention sinks")
        if self.expert_biases:
            parts.append("expert biases")
        if self.qk_norm:
            parts.append("q/k norm")
        if self.post_norms:
            parts.append("post-norms")
        if self.ffn_activation != "silu":
            parts.append(f"FFN {self.ffn_activation}")
        if self.expert_activation:
            parts.append(f"experts' {self.expert_activation}")
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
        if any(r.rope is not None and (r.rope.scaling or {}).get("rope_type") == "yarn" for r in self.layers):
            parts.append("YaRN")
        if self.rotary_dims != self.head_dim:
            parts.append(f"rotary {self.rotary_dims}/{self.head_dim}")
        if self.attention_scale:
            parts.append(f"attention scale {self.attention_scale:.4g}")
        if self.attn_softcap or self.final_softcap:
            parts.append(f"soft-caps {self.attn_softcap:g}/{self.final_softcap:g}")
        if self.embedding_scale != 1.0:
            parts.append(f"embedding ×{self.embedding_scale:.4g}")
        dims = sorted({r.head_dim for r in self.layers if r.head_dim})
        if len(dims) > 1:
            parts.append("head sizes " + "/".join(map(str, dims)))
        shared = sum(1 for r in self.layers if r.kv_from >= 0)
        if shared:
            parts.append(f"KV shared on {shared}/{self.n_layers} layers")
        if self.per_layer_input:
            parts.append(f"per-layer embeddings of {self.per_layer_input}")
        if self.value_norm:
            parts.append("v norm")
        if self.layer_scale:
            parts.append("layer output scales")
        if self.altup_inputs:
            parts.append(f"AltUp ×{self.altup_inputs}, LAuReL rank {self.laurel_rank}, sparse gates on "
                         f"{sum(1 for s in self.sparsity if s)}/{self.n_layers} layers")
        return ", ".join(parts) or "Llama recipe"

    # -- reading a file: the family's (perfx.families) ------------------------------------------------------

    @classmethod
    def from_hf(cls, config: dict) -> ModelConfig:
        """From the dict of a Hugging Face ``config.json`` (a multimodal checkpoint's text_config), as its
        family reads it."""
        return cls(**families.hf_values(config))

    @classmethod
    def from_gguf(cls, reader: GGUFFile) -> ModelConfig:
        """From an open GGUF file: the ``{arch}.*`` keys, vocabulary and head sizes, as llama.cpp reads them,
        and the family's recipe."""
        return cls(**families.gguf_values(reader))
