"""What every model source shares: the host form of a layer, the base class, fusion, the head rule and checks.

Every source gives the same host form (``LayerWeights``): the norms and the FFN every layer has (gate and up
fused into one matrix), and the weights of the layer's kind (``mixing``) as its mixer declares, reads and
checks them (``perfx.mixers.Mixer``: attention's Q, K and V fused into one matrix, rows in Hugging Face's
rotate-half order; a conv layer's projections and taps; ...). The sources ask a layer's mixer what it holds and
never branch on its kind. Each linear layer is a ``perfx.formats.Q4Matrix``
(4-bit), a ``perfx.formats.Q8Matrix`` (8-bit: GGUF Q5_x, Q6_K, Q8_0) or an fp16 ndarray (N, K). A source
checks the whole file's header when it is opened, then hands out one layer at a time, so host memory
stays near the largest layer, not the model. ``weight_forms`` says from the header alone which device
form (``Form``) each matrix will take, so the kernel shapes a model runs are known before its weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from perfx.config import ModelConfig
from perfx.errors import PerfxError
# Form, form_of, fuse_rows and permute_linear_rows (the host matrices' forms and rows) live in perfx.formats, below
# the mixers, which fuse their own matrices; the sources and their tests take them from here too
from perfx.formats import (F16_FORM, Q8_QUANTIZE_GROUP, Form, HostMatrix, Q4Matrix, Q8Matrix, form_of, fuse_rows,
                           fused_form, permute_linear_rows, to_fp16)
from perfx.mixers import mixer_class
from perfx.moe import EXPERT_ROLES, SHARED_LINEARS, MoEWeights, fused_held_form

Linear = HostMatrix  # a weight W (N, K): the int4 or int8 device form, or fp16
QUANTIZE_CHOICES = (None, "q4")
# The lm_head and the token embedding: "q8" keeps a quantized file's own form (Q8_0, Q6_K, ... in the int8
# form, Q4 in the int4 form) and quantizes an fp16 table to int8; "fp16" holds an 8-bit table as fp16 (a
# 4-bit one stays 4-bit) and keeps fp16 tables as they are. An untied embedding follows the head's rule
# too: a decode step reads one row of it, but on a phone its 262 MB (Llama-2-7B, fp16) are device memory.
LM_HEAD_CHOICES = ("q8", "fp16")
# The untied token embedding: "head" follows the head's rule (above); "q4" holds it in the int4 form with 4-bit zero
# points (AWQ's maths, round to nearest, group 128 or the largest that divides hidden; a file's own 4-bit table is
# kept): a decode step reads one row of it, and llama.cpp's Q4 files store token_embd in 4 bits too. A tied
# embedding is the lm_head, read whole every token: the head's rule keeps it.
EMBEDDING_CHOICES = ("head", "q4")
# The FFN every layer kind has: its gate-up fused, and down
FFN_LINEARS = {"gate_up": ("gate", "up"), "down": ("down",)}
# Gemma 4's per-layer input matrices, where the recipe has per-layer embeddings
PLE_LINEARS = {"ple_gate": ("ple_gate",), "ple_proj": ("ple_proj",)}
# Gemma 3n's LAuReL pair: matrices the device runs as GEMVs and GEMMs, in the forms the file holds them
LAUREL_LINEARS = {"laurel_l": ("laurel_l",), "laurel_r": ("laurel_r",)}
# Gemma 3n's per-layer AltUp and LAuReL weights: LAuReL's left (r, hidden) and right (hidden, r)
# matrices and its norm; AltUp's router (A, hidden), its norm, the prediction (A², A) and correction (A, A)
# coefficients and the corrected output's scale
ALTUP_LINEARS = ("laurel_l", "laurel_r", "altup_router", "altup_predict", "altup_correct")
ALTUP_VECTORS = ("laurel_norm", "altup_router_norm", "altup_correct_scale")


def _floats(w: Linear) -> np.ndarray:
    """A matrix as float32 values, whatever form the file holds it in."""
    return np.asarray(w if isinstance(w, np.ndarray) else w.dequantize(), np.float32)


@dataclass
class LayerWeights:
    """One decoder layer, host side, in the layout the device forward uses: what every layer kind has, and the
    kind's own weights (``mixing``), the dataclass its mixer declares (``perfx.mixers.Mixer.Weights``)."""

    attn_norm: np.ndarray          # (hidden,) float32: the norm before the mixer (attention, the conv, ...)
    ffn_norm: np.ndarray           # (hidden,) float32
    gate_up: Linear | None         # (2·intermediate, hidden): gate rows, then up rows (None: a MoE layer)
    down: Linear | None            # (hidden, intermediate)
    mixing: object                 # the layer kind's weights: perfx.mixers.attention.AttentionWeights, ...
    post_attn_norm: np.ndarray | None = None   # (hidden,) float32: RMSNorm of the mixer's output (Gemma)
    post_ffn_norm: np.ndarray | None = None    # (hidden,) float32: RMSNorm of the FFN output (Gemma)
    moe: MoEWeights | None = None  # the mixture of experts in place of gate_up and down (perfx.moe)
    # Gemma 4's per-layer input, after the FFN: x + rmsnorm(ple_proj·(GELU(ple_gate·x) ⊙ its slice))·ple_norm
    ple_gate: Linear | None = None             # (per_layer_input, hidden)
    ple_proj: Linear | None = None             # (hidden, per_layer_input)
    ple_norm: np.ndarray | None = None         # (hidden,) float32
    out_scale: np.ndarray | None = None        # (1,) float32: the layer's output residual times this (Gemma 4)
    altup: dict | None = None                  # Gemma 3n's AltUp and LAuReL weights (ALTUP_LINEARS, ALTUP_VECTORS)

    def linears(self) -> dict[str, Linear]:
        """Every matrix of the layer by role: the mixer's, then the FFN's."""
        mixing = {role: getattr(self.mixing, role) for role in self.mixing.matrices}
        ffn = {"gate_up": self.gate_up, "down": self.down} if self.moe is None else {}
        ple = {role: getattr(self, role) for role in PLE_LINEARS if getattr(self, role) is not None}
        return {**{role: w for role, w in mixing.items() if w is not None}, **ffn, **ple}


# ---------------------------------------------------------------------------------------------
# What every source shares


class ModelSource(ABC):
    """A model opened lazily. Subclasses read tensors; the fusion, checks and quantize-on-load live here."""

    format = "?"
    int4_group: int | None = None   # the int4 group size the file fixes (GGUF Q4: 32, AWQ: its own), if any

    def __init__(self, config: ModelConfig, quantize: str | None = None, lm_head: str = "q8",
                 embedding: str = "head"):
        if lm_head not in LM_HEAD_CHOICES:
            raise PerfxError(f"lm_head={lm_head!r} is not supported; choose one of {LM_HEAD_CHOICES}")
        if embedding not in EMBEDDING_CHOICES:
            raise PerfxError(f"embedding={embedding!r} is not supported; choose one of {EMBEDDING_CHOICES}")
        self.config = config
        self.quantize = quantize
        self.lm_head_form = lm_head
        self.embedding_form = embedding
        self.notes: list[str] = []      # what was done differently from the file (fallbacks), for describe()
        self.generation_config: dict = {}
        self._tokenizer = None
        self._tokenizer_loaded = False
        if quantize == "q4":
            c = self.config
            for what, k in (("hidden", c.hidden_size), ("attention output", c.q_dim),
                            ("intermediate", c.intermediate_size)):
                group = quantize_group(k)
                if group is None:
                    self.notes.append(f"quantize q4: K = {k} ({what}) is not a multiple of 32; "
                                      "those layers stay fp16")
                elif group != 128:
                    self.notes.append(f"quantize q4: group 128 does not divide K = {k} ({what}); "
                                      f"using group {group} there")

    # -- what subclasses provide --------------------------------------------------------------

    # File-backed sources provide these two and inherit ``layer``; the synthetic source builds whole
    # layers itself and overrides ``layer`` instead.
    def _linear(self, name: str, layer: int) -> Linear:
        """One projection ("q", "k", "v", "o", "gate", "up", "down") in Hugging Face row order."""
        raise NotImplementedError(f"{type(self).__name__} reads no single projections")

    def _vector(self, name: str, layer: int | None) -> np.ndarray | None:
        """A float32 vector ("attn_norm", "ffn_norm", "final_norm", "q_bias", ...), None if absent."""
        raise NotImplementedError(f"{type(self).__name__} reads no single vectors")

    def _load_tokenizer(self):
        return None

    def _part_form(self, name: str, layer: int) -> Form | None:
        """The form ``_linear(name, layer)`` gives, from the header alone; None where the source cannot tell."""
        return None

    def _fused(self, label: str, layer: int) -> Linear | None:
        """"qkv" or "gate_up" as the file stores it fused (Phi-3's qkv_proj and gate_up_proj), None where the
        file stores the parts (then they are fused here). Asked only for the roles the layer's mixer allows
        (``Mixer.file_fused``)."""
        return None

    def _conv_weight(self, layer: int) -> np.ndarray:
        """A layer's short-convolution taps (channels, L) float32, channels as its mixer says (``Mixer.taps``)."""
        raise NotImplementedError(f"{type(self).__name__} reads no convolutions")

    def _experts(self, layer: int) -> MoEWeights:
        """A MoE layer's router, selection bias and experts (``perfx.moe``), each expert's gate and up fused."""
        raise NotImplementedError(f"{type(self).__name__} reads no mixture-of-experts layers")

    def _expert_form(self, part: str, layer: int) -> Form | None:
        """The held form (``perfx.moe.held_form``) of an expert projection ("gate_exps", "up_exps", "down_exps")
        from the header alone; None where the source cannot tell."""
        return None

    def _fused_form(self, label: str, layer: int) -> Form | None:
        """The form of ``_fused(label, layer)`` from the header alone; None where the file stores the parts."""
        return None

    def _table_form(self, name: str) -> Form | None:
        """The form the file gives "embedding" or "lm_head" in, from the header alone; None if unknown."""
        return None

    @abstractmethod
    def _embedding(self) -> Linear:
        """The token embedding (V, hidden) as the file holds it: fp16, or the int4/int8 form of a GGUF's."""

    @abstractmethod
    def _lm_head(self) -> Linear:
        """The output projection (V, hidden) of an untied model, as the file holds it."""

    @abstractmethod
    def describe(self) -> dict:
        """Format, quantization, file size and path, architecture, and any notes about the load."""

    # -- shared ----------------------------------------------------------------------------------

    @property
    def tokenizer(self):
        """perfx.tokenizer.Tokenizer of this model, or None when the model carries none."""
        if not self._tokenizer_loaded:
            self._tokenizer = self._load_tokenizer()
            self._tokenizer_loaded = True
        return self._tokenizer

    def final_norm(self) -> np.ndarray:
        """The last RMSNorm's γ (hidden,) float32."""
        return self._vector("final_norm", None)

    def embedding(self) -> Linear:
        """The token embedding (V, hidden), in the head's form (``lm_head``), or int4 with zero points where
        ``embedding`` is "q4" and it is not tied (``EMBEDDING_CHOICES``); when tied it is the lm_head too."""
        if self._embedding_q4_group() is not None:
            return to_q4_zeros(self._embedding(), self._embedding_q4_group())
        return self._as_head(self._embedding())

    def _embedding_q4_group(self) -> int | None:
        """The int4 group of the token embedding under ``embedding="q4"``, None where the head's rule holds."""
        if self.embedding_form != "q4" or self.config.tie_embeddings:
            return None
        return quantize_group(self.config.hidden_size)

    def lm_head(self) -> Linear | None:
        """The output projection (V, hidden) in the head's form (``lm_head``), None when tied to the embedding."""
        return None if self.config.tie_embeddings else self._as_head(self._lm_head())

    def _as_head(self, w: Linear) -> Linear:
        """The head rule (``LM_HEAD_CHOICES``): int8 by default, the file's own quantized form kept."""
        if self.lm_head_form == "fp16":
            return to_fp16(w) if isinstance(w, Q8Matrix) else w
        if isinstance(w, np.ndarray) and w.shape[1] % Q8_QUANTIZE_GROUP == 0:
            return Q8Matrix.quantize(w, Q8_QUANTIZE_GROUP)
        return w

    def _head_form(self, form: Form | None) -> Form | None:
        if form is None:
            return None
        if self.lm_head_form == "fp16":
            return F16_FORM if form.kind == "q8" else form
        if form.kind == "f16" and self.config.hidden_size % Q8_QUANTIZE_GROUP == 0:
            return Form("q8", Q8_QUANTIZE_GROUP)
        return form

    def _quantized_form(self, form: Form, k: int) -> Form:
        if self.quantize != "q4" or form.kind != "f16":
            return form
        group = quantize_group(k)
        return form if group is None else Form("q4", group)

    def int4_scales(self) -> dict[str, set[int]]:
        """Matrix role -> the scales' forms (``perfx.formats`` Q4_PAIRS, Q4_ZEROS, Q4_SYMMETRIC) of its int4 weights
        over the layers, read from the header alone, so that the kernels of each are built ahead; empty where the
        source does not tell (its int4 weights then share the first layer's form)."""
        return {}

    def weight_forms(self) -> dict[str, set[Form]] | None:
        """The device forms each matrix role takes over the layers ("qkv", "o", "gate_up", "down",
        "embedding", "lm_head"), read from the header alone; None where the source cannot tell."""
        c = self.config
        forms: dict[str, set[Form]] = {}
        for i in range(c.n_layers):
            for label, names in self.layer_linears(i).items():
                forms.setdefault(label, set())
                parts = [self._fused_form(label, i)] if len(names) > 1 and label in self.file_fused(i) else [None]
                if parts[0] is None:
                    parts = [self._part_form(self.part_read_as(name, i), i) for name in names]
                if any(p is None for p in parts):
                    return None
                k = self.expected_shape(self.part_read_as(names[0], i), i)[1]
                forms[label].add(self._quantized_form(fused_form(parts), k))
            if c.is_moe(i):
                for role, names in EXPERT_ROLES.items():
                    parts = list(dict.fromkeys(self._expert_form(name, i) for name in names))
                    if any(p is None for p in parts):
                        return None
                    forms.setdefault(role, set()).add(fused_held_form(parts))
        embedding = self._head_form(self._table_form("embedding"))
        if embedding is None:
            return None
        if self._embedding_q4_group() is not None and embedding.kind != "q4":
            embedding = Form("q4", self._embedding_q4_group())
        if c.per_layer_input:
            ple = self._per_layer_forms()
            if ple is None:
                return None
            forms.update(ple)
        if c.tie_embeddings:
            forms["embedding"] = forms["lm_head"] = {embedding}
        else:
            head = self._head_form(self._table_form("lm_head"))
            if head is None:
                return None
            forms["embedding"], forms["lm_head"] = {embedding}, {head}
        return forms

    def layer(self, i: int) -> LayerWeights:
        """Layer i's weights, read and converted now (nothing is kept between calls): the FFN and norms here, the
        kind's own weights by its mixer (``Mixer.read``)."""
        c = self.config
        if not 0 <= i < c.n_layers:
            raise PerfxError(f"layer {i} does not exist: the model has {c.n_layers} layers")
        norms = {}
        if c.post_norms:
            norms.update(post_attn_norm=self._vector("post_attn_norm", i),
                         post_ffn_norm=self._vector("post_ffn_norm", i))
        if c.is_moe(i):
            ffn = dict(gate_up=None, down=None, moe=self._experts(i))
            if c.expert_shared:   # the shared expert: the gated MLP's roles, from its own projections
                ffn["moe"].shared_gate_up = self.read_matrix("gate_up", SHARED_LINEARS["gate_up"], i)
                ffn["moe"].shared_down = self.read_matrix("down", SHARED_LINEARS["down"], i)
        else:
            ffn = dict(gate_up=self.read_matrix("gate_up", FFN_LINEARS["gate_up"], i),
                       down=self.read_matrix("down", FFN_LINEARS["down"], i))
        if c.per_layer_input:
            norms.update(ple_gate=self.read_matrix("ple_gate", ("ple_gate",), i),
                         ple_proj=self.read_matrix("ple_proj", ("ple_proj",), i), ple_norm=self._vector("ple_norm", i))
        if c.layer_scale:
            norms["out_scale"] = self._vector("out_scale", i)
        if c.altup_inputs:
            # LAuReL's pair as any matrix; the router and its coefficients (a few rows) as floats, which the
            # device's AltUp kernels read themselves
            norms["altup"] = {**{name: (self.read_matrix(name, (name,), i) if name in LAUREL_LINEARS
                                        else _floats(self.read_part(name, i))) for name in ALTUP_LINEARS},
                              **{name: self._vector(name, i) for name in ALTUP_VECTORS}}
        return LayerWeights(attn_norm=self._vector("attn_norm", i), ffn_norm=self._vector("ffn_norm", i),
                            mixing=self.mixer(i).read(self, i), **ffn, **norms)

    def per_layer_tables(self) -> tuple | None:
        """Gemma 4's per-layer embeddings: the token table (V, n_layers·P), the projection of the embedding
        (n_layers·P, hidden) and its norm (P,) float32; None where the recipe has none."""
        if not self.config.per_layer_input:
            return None
        return self._per_layer_tables()

    def altup_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Gemma 3n's AltUp projections (A − 1, hidden, hidden) float64: of the embedding into the other streams,
        and of those streams back at the end."""
        return self._altup_tables()

    def _altup_tables(self) -> tuple[np.ndarray, np.ndarray]:
        raise PerfxError(f"{type(self).__name__} does not read Gemma 3n's AltUp projections")

    def _per_layer_forms(self) -> dict[str, set[Form]] | None:
        """The forms of Gemma 4's per-layer table ("ple_table") and embedding projection ("ple_model") from the
        header, None where the source cannot tell."""
        return None

    def _per_layer_tables(self) -> tuple:
        raise PerfxError(f"{type(self).__name__} does not read Gemma 4's per-layer embeddings")

    def layers(self):
        """Iterate over the layers in order, one loaded at a time."""
        for i in range(self.config.n_layers):
            yield self.layer(i)

    # -- what a layer's mixer reads through (``Mixer.read``) -------------------------------------------

    def mixer(self, layer: int):
        """The mixer class of ``layer``'s kind: what its layers hold, read and check."""
        return mixer_class(self.config.layers[layer].kind)

    def whole(self, role: str, layer: int) -> Linear | None:
        """A role as the file stores it fused (Phi-3's qkv_proj), where the layer's mixer allows it, else None."""
        return self._fused(role, layer) if role in self.file_fused(layer) else None

    def file_fused(self, layer: int) -> tuple[str, ...]:
        """The roles of ``layer`` a file may hold fused."""
        return self.mixer(layer).file_fused

    def read_part(self, name: str, layer: int) -> Linear:
        """One source projection in Hugging Face row order, as the file holds it (or its stand-in where the file
        lacks it and the recipe allows: Gemma 4's K as V)."""
        return self._linear(self.part_read_as(name, layer), layer)

    def has_part(self, name: str, layer: int) -> bool:
        """Whether the file holds projection ``name`` of ``layer``."""
        return True

    def part_read_as(self, name: str, layer: int) -> str:
        """The projection read for ``name``: itself, or the stand-in its layer's mixer names for it where the
        file lacks it (``Mixer.stand_ins``: Gemma 4's global layers without attn_v use K as V)."""
        stand_in = self.mixer(layer).stand_ins(self.config).get(name)
        return stand_in if stand_in is not None and not self.has_part(name, layer) else name

    def read_matrix(self, role: str, parts: tuple[str, ...], layer: int) -> Linear:
        """A role: the file's fused matrix, or its projections stacked (``fuse_rows``); then the quantize rule."""
        w = self.whole(role, layer) if len(parts) > 1 else None
        if w is None:
            w = (self.read_part(parts[0], layer) if len(parts) == 1
                 else fuse_rows([self.read_part(p, layer) for p in parts]))
        return self._quantized(w)

    def read_vector(self, name: str, layer: int) -> np.ndarray:
        return self._vector(name, layer)

    def read_taps(self, layer: int) -> np.ndarray:
        return self._conv_weight(layer)

    def quantized(self, w: Linear) -> Linear:
        """W under the quantize-on-load rule (``quantize="q4"``)."""
        return self._quantized(w)

    # -- what a layer holds, from the config ---------------------------------------------------------

    def layer_linears(self, layer: int) -> dict[str, tuple[str, ...]]:
        """The matrix roles of a layer and the projections each fuses: its mixer's, then the dense FFN's (none on
        a MoE layer, whose experts are ``_experts``', but its shared expert's), then Gemma 4's per-layer input's, then
        Gemma 3n's LAuReL pair."""
        c = self.config
        ffn = FFN_LINEARS if not c.is_moe(layer) else SHARED_LINEARS if c.expert_shared else {}
        ple = PLE_LINEARS if self.config.per_layer_input else {}
        laurel = LAUREL_LINEARS if self.config.altup_inputs else {}
        return {**self.mixer(layer).host_linears(self.config.at(layer)), **ffn, **ple, **laurel}

    def layer_parts(self, layer: int) -> list[str]:
        """The projections a layer's matrices are read from, each once, in order."""
        return list(dict.fromkeys(p for parts in self.layer_linears(layer).values() for p in parts))

    def _kinds(self):
        return [mixer_class(kind) for kind in dict.fromkeys(r.kind for r in self.config.layers)]

    def expected_shape(self, name: str, layer: int | None = None) -> tuple[int, int]:
        """(N, K) of a projection or role, from the config (``layer``'s view of it where given: Gemma 4's layers
        differ in their shapes)."""
        c = self.config if layer is None else self.config.at(layer)
        p = c.per_layer_input
        a, r = c.altup_inputs, c.laurel_rank
        shapes = {"ple_gate": (p, c.hidden_size), "ple_proj": (c.hidden_size, p),
                  "laurel_l": (r, c.hidden_size), "laurel_r": (c.hidden_size, r), "altup_router": (a, c.hidden_size),
                  "altup_predict": (a * a, a), "altup_correct": (a, a),
                  "per_layer_table": (c.vocab_size, c.n_layers * p), "per_layer_proj": (c.n_layers * p, c.hidden_size),
                  "gate": (c.intermediate_size, c.hidden_size), "up": (c.intermediate_size, c.hidden_size),
                  "down": (c.hidden_size, c.intermediate_size), "gate_up": (2 * c.intermediate_size, c.hidden_size),
                  "gate_shexp": (c.expert_shared, c.hidden_size), "up_shexp": (c.expert_shared, c.hidden_size),
                  "down_shexp": (c.hidden_size, c.expert_shared),
                  "embedding": (c.vocab_size, c.hidden_size), "lm_head": (c.vocab_size, c.hidden_size)}
        for mixer in self._kinds():
            shapes.update(mixer.host_shapes(c))
        return shapes[name]

    def expected_vector(self, name: str, layer: int | None = None) -> int:
        c = self.config if layer is None else self.config.at(layer)
        sizes = {"out_scale": 1, "per_layer_norm": c.per_layer_input}
        for mixer in self._kinds():
            sizes.update(mixer.host_vectors(c))
        return sizes.get(name, c.hidden_size)

    def vector_names(self, layer: int = 0) -> tuple[str, ...]:
        """The per-layer vectors this model's recipe reads on ``layer``."""
        c = self.config
        return (("attn_norm", "ffn_norm") + tuple(self.mixer(layer).host_vectors(c.at(layer)))
                + (("post_attn_norm", "post_ffn_norm") if c.post_norms else ())
                + (("ple_norm",) if c.per_layer_input else ()) + (("out_scale",) if c.layer_scale else ())
                + (ALTUP_VECTORS if c.altup_inputs else ()))

    def _quantized(self, w: Linear) -> Linear:
        # fp16 only, as _quantized_form says: a file's int8 matrix (Q8_0, Q6_K) keeps its form
        if self.quantize != "q4" or not isinstance(w, np.ndarray):
            return w
        group = quantize_group(w.shape[1])
        return w if group is None else Q4Matrix.quantize(w, group)


def quantize_group(k: int) -> int | None:
    """The largest supported group size dividing K (128 preferred), None when none does."""
    return next((g for g in (128, 64, 32) if k % g == 0), None)


def to_q4_zeros(w: Linear, group: int, rows: int = 8192) -> Q4Matrix:
    """W in the int4 zero-point form, round to nearest (``Q4Matrix.quantize(zeros=True)``) a block of rows at a time;
    an int4 matrix (a GGUF's Q4 token_embd) is kept as the file has it."""
    if isinstance(w, Q4Matrix):
        return w
    return Q4Matrix.concat([Q4Matrix.quantize(to_fp16(w[i:i + rows] if isinstance(w, np.ndarray) else
                                                      w.rows(i, min(i + rows, w.shape[0]))), group, zeros=True)
                            for i in range(0, w.shape[0], rows)])


def check_finite(w: Linear, where, tensor: str) -> Linear:
    """W itself, or a PerfxError naming the tensor if a float value (an int4/int8 matrix's scale, offset) is
    NaN or Inf.

    Checked at load: a NaN weight would otherwise surface tokens later, as NaN logits or as noise.
    """
    quantized = isinstance(w, (Q4Matrix, Q8Matrix))
    parts = (("scales", w.scales), ("offsets", w.offsets)) if quantized else (("values", w),)
    for what, values in parts:
        values = np.asarray(values)
        if values.dtype.kind != "f":
            continue
        finite = np.isfinite(values)
        if not finite.all():
            first = tuple(int(i) for i in np.argwhere(~finite)[0])
            raise PerfxError(f"{where}: tensor {tensor} has {int(values.size - finite.sum())} NaN or Inf "
                             f"{what} (the first at index {first}, {values[first]}); the file is corrupt or "
                             "was saved from a diverged model, and perfx does not run it")
    return w


def shape_error(where: str, tensor: str, shape, expected, config: ModelConfig) -> PerfxError:
    return PerfxError(f"{where}: tensor {tensor} has shape {tuple(shape)} but the model's config "
                      f"({config.architecture}, hidden {config.hidden_size}, {config.n_heads} heads × "
                      f"{config.head_dim}, {config.n_kv_heads} kv heads, "
                      f"intermediate {config.intermediate_size}, vocab {config.vocab_size}) needs "
                      f"{tuple(expected)}; the weights and config.json/header belong to different models")


def fused_split_error(where, tensor: str, shape, label: str, config: ModelConfig, said_by: str, ffn_key: str,
                      advice: str) -> PerfxError:
    """A fused QKV or gate-up tensor whose rows do not split as the header or config says (``said_by``)."""
    c = config
    rows, k = (c.qkv_dim, c.hidden_size) if label == "qkv" else (2 * c.intermediate_size, c.hidden_size)
    parts = (f"{c.n_heads} heads × {c.head_dim} + 2 × {c.n_kv_heads} kv heads × {c.head_dim}" if label == "qkv"
             else f"2 × {ffn_key} {c.intermediate_size}")
    return PerfxError(f"{where}: fused tensor {tensor} has shape {tuple(shape)}, but its rows do not split as "
                      f"{said_by} says ({parts} = {rows} rows of {k}); {advice}")
