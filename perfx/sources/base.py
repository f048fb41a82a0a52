"""What every model source shares: the host form of a layer, the base class, fusion, the head rule and checks.

Every source gives the same host form (``LayerWeights``): Q, K and V fused into one matrix, gate and
up into another, rows in Hugging Face's rotate-half order, each linear layer a ``perfx.formats.Q4Matrix``
(4-bit), a ``perfx.formats.Q8Matrix`` (8-bit: GGUF Q5_x, Q6_K, Q8_0) or an fp16 ndarray (N, K). A source
checks the whole file's header when it is opened, then hands out one layer at a time, so host memory
stays near the largest layer, not the model. ``weight_forms`` says from the header alone which device
form (``Form``) each matrix will take, so the kernel shapes a model runs are known before its weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Union

import numpy as np

from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.formats import Q8_QUANTIZE_GROUP, Q4Matrix, Q8Matrix

Linear = Union[Q4Matrix, Q8Matrix, np.ndarray]  # a weight W (N, K): the int4 or int8 device form, or fp16
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
LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down")
FUSED_LINEARS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
# A conv layer (LFM2) mixes positions with its in-projection (B, C, x rows), a short convolution and its
# out-projection in place of QKV, attention and o.
CONV_LINEARS = {"conv_in": ("conv_in",), "conv_out": ("conv_out",), "gate_up": ("gate", "up"), "down": ("down",)}
# A delta layer (Qwen3.5's Gated DeltaNet) projects to q|k|v (the convolution's input), z (the output norm's
# gate) and a|b (the decay and the update rate, fused: both a row per v head), and back with its out-projection.
DELTA_LINEARS = {"delta_qkv": ("delta_qkv",), "delta_z": ("delta_z",), "delta_ab": ("delta_a", "delta_b"),
                 "delta_out": ("delta_out",), "gate_up": ("gate", "up"), "down": ("down",)}
# Qwen3.5's attention layers: the q projection holds q and the output gate of each head; the gate rows are a
# matrix of their own (attn_gate), q's join k and v in the fused QKV.
GATED_ATTENTION_LINEARS = dict(FUSED_LINEARS, attn_gate=("q",))


@dataclass(frozen=True, order=True)
class Form:
    """The device form of a matrix: kind "q4" (group G), "q8" (group G, float32 scales if f32, scales alone if
    symmetric) or "f16"."""

    kind: str
    group: int = 0
    f32: bool = False
    symmetric: bool = False


F16_FORM = Form("f16")


def form_of(w: Linear) -> Form:
    if isinstance(w, Q4Matrix):
        return Form("q4", w.group)
    if isinstance(w, Q8Matrix):
        return Form("q8", w.group, w.f32, w.symmetric)
    return F16_FORM


def fused_form(parts: list[Form]) -> Form:
    """The form of matrices stacked along N (fused QKV, gate-up), the rule ``fuse_rows`` follows.

    All int4: int4 at the smallest group (regrouping repeats each (s, m): exact). Any fp16 part: fp16. Any
    other mix of int4 and int8: int8 at the smallest group, float32 if any part is, symmetric if every part is
    a symmetric int8 one (int4 parts bring pairs, ``Q8Matrix.from_q4``); int4 codes fit int8 and their fp16 s
    and m stay exact, so e.g. Q4_K q and k beside a Q6_K v fuse exactly at G = 16.
    """
    kinds = {p.kind for p in parts}
    if kinds == {"q4"}:
        return Form("q4", min(p.group for p in parts))
    if "f16" in kinds:
        return F16_FORM
    return Form("q8", min(min(p.group, Q8_QUANTIZE_GROUP) for p in parts), any(p.f32 for p in parts),
                all(p.kind == "q8" and p.symmetric for p in parts))


@dataclass
class LayerWeights:
    """One decoder layer, host side, in the layout the device forward uses."""

    attn_norm: np.ndarray          # (hidden,) float32: the norm before attention (or the conv)
    ffn_norm: np.ndarray           # (hidden,) float32
    gate_up: Linear                # (2·intermediate, hidden): gate rows, then up rows
    down: Linear                   # (hidden, intermediate)
    qkv: Linear | None = None      # (H·D + 2·Hkv·D, hidden): q, k, v rows, Hugging Face rotate-half order
    qkv_bias: np.ndarray | None = None   # (H·D + 2·Hkv·D,) float32, Qwen2 only
    o: Linear | None = None        # (hidden, H·D)
    q_norm: np.ndarray | None = None           # (D,) float32: per-head RMSNorm of q (Qwen3, Gemma 3)
    k_norm: np.ndarray | None = None           # (D,) float32: the same for k
    post_attn_norm: np.ndarray | None = None   # (hidden,) float32: RMSNorm of the attention output (Gemma)
    post_ffn_norm: np.ndarray | None = None    # (hidden,) float32: RMSNorm of the FFN output (Gemma)
    conv_in: Linear | None = None              # (3·hidden, hidden): B, C, x rows (a conv layer, LFM2)
    conv_weight: np.ndarray | None = None      # (hidden, L) float32: the short convolution's taps
    conv_out: Linear | None = None             # (hidden, hidden)
    attn_gate: Linear | None = None            # (H·D, hidden): the output gate's rows of q_proj (Qwen3.5)
    delta_qkv: Linear | None = None            # (2·Hk·d_k + Hv·d_v, hidden): a delta layer's q|k|v (Qwen3.5);
                                               # its taps (channels, L) are conv_weight
    delta_z: Linear | None = None              # (Hv·d_v, hidden): the gated norm's z
    delta_ab: Linear | None = None             # (2·Hv, hidden): a rows, then b rows
    delta_out: Linear | None = None            # (hidden, Hv·d_v)
    dt_bias: np.ndarray | None = None          # (Hv,) float32: added to a before the softplus
    ssm_a: np.ndarray | None = None            # (Hv,) float32: −exp(A_log), the decay's rate
    delta_norm: np.ndarray | None = None       # (d_v,) float32: the gated RMSNorm's γ


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
        file stores the parts (then they are fused here)."""
        return None

    def _conv_weight(self, layer: int) -> np.ndarray:
        """A conv layer's taps (hidden, L) float32."""
        raise NotImplementedError(f"{type(self).__name__} reads no convolutions")

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

    def weight_forms(self) -> dict[str, set[Form]] | None:
        """The device forms each matrix role takes over the layers ("qkv", "o", "gate_up", "down",
        "embedding", "lm_head"), read from the header alone; None where the source cannot tell."""
        c = self.config
        forms: dict[str, set[Form]] = {}
        for i in range(c.n_layers):
            for label, names in self.layer_linears(i).items():
                forms.setdefault(label, set())
                parts = [self._fused_form(label, i)] if len(names) > 1 else [None]
                if parts[0] is None:
                    parts = [self._part_form(name, i) for name in names]
                if any(p is None for p in parts):
                    return None
                k = self.expected_shape(names[0])[1]
                forms[label].add(self._quantized_form(fused_form(parts), k))
        embedding = self._head_form(self._table_form("embedding"))
        if embedding is None:
            return None
        if self._embedding_q4_group() is not None and embedding.kind != "q4":
            embedding = Form("q4", self._embedding_q4_group())
        if c.tie_embeddings:
            forms["embedding"] = forms["lm_head"] = {embedding}
        else:
            head = self._head_form(self._table_form("lm_head"))
            if head is None:
                return None
            forms["embedding"], forms["lm_head"] = {embedding}, {head}
        return forms

    def layer(self, i: int) -> LayerWeights:
        """Layer i's weights, read and converted now (nothing is kept between calls)."""
        c = self.config
        if not 0 <= i < c.n_layers:
            raise PerfxError(f"layer {i} does not exist: the model has {c.n_layers} layers")
        gate_up = self._fused("gate_up", i)
        if gate_up is None:
            gate_up = fuse_rows([self._linear("gate", i), self._linear("up", i)])
        ffn = dict(attn_norm=self._vector("attn_norm", i), ffn_norm=self._vector("ffn_norm", i),
                   gate_up=self._quantized(gate_up), down=self._quantized(self._linear("down", i)))
        if c.layers[i].kind == "conv":
            return LayerWeights(**ffn, conv_in=self._quantized(self._linear("conv_in", i)),
                                conv_weight=self._conv_weight(i), conv_out=self._quantized(self._linear("conv_out", i)))
        if c.layers[i].kind == "delta":
            ab = fuse_rows([self._linear("delta_a", i), self._linear("delta_b", i)])
            return LayerWeights(**ffn, conv_weight=self._conv_weight(i), delta_ab=self._quantized(ab),
                                **{name: self._quantized(self._linear(name, i))
                                   for name in ("delta_qkv", "delta_z", "delta_out")},
                                **{name: self._vector(name, i) for name in ("dt_bias", "ssm_a", "delta_norm")})
        qkv = self._fused("qkv", i)
        gate = None
        if qkv is None and c.attention_gate:
            q, gate = split_gated_q(self._linear("q", i), c.n_heads, c.head_dim)
            qkv = fuse_rows([q, self._linear("k", i), self._linear("v", i)])
            gate = self._quantized(gate)
        elif qkv is None:
            qkv = fuse_rows([self._linear(name, i) for name in ("q", "k", "v")])
        bias = None
        if c.qkv_bias:
            bias = np.concatenate([self._vector(f"{name}_bias", i) for name in ("q", "k", "v")])
        norms = {}
        if c.qk_norm:
            norms.update(q_norm=self._vector("q_norm", i), k_norm=self._vector("k_norm", i))
        if c.post_norms:
            norms.update(post_attn_norm=self._vector("post_attn_norm", i),
                         post_ffn_norm=self._vector("post_ffn_norm", i))
        return LayerWeights(**ffn, qkv=self._quantized(qkv), qkv_bias=bias, o=self._quantized(self._linear("o", i)),
                            attn_gate=gate, **norms)

    def layers(self):
        """Iterate over the layers in order, one loaded at a time."""
        for i in range(self.config.n_layers):
            yield self.layer(i)

    def layer_linears(self, layer: int) -> dict[str, tuple[str, ...]]:
        """The matrix roles of a layer and the projections each fuses (attention or conv layer)."""
        kind = self.config.layers[layer].kind
        if kind != "attention":
            return CONV_LINEARS if kind == "conv" else DELTA_LINEARS
        return GATED_ATTENTION_LINEARS if self.config.attention_gate else FUSED_LINEARS

    def expected_shape(self, name: str) -> tuple[int, int]:
        """(N, K) of a projection, from the config."""
        c = self.config
        h, hv = c.hidden_size, c.delta_v_heads
        return {"conv_in": (3 * h, h), "conv_out": (h, h),
                "delta_qkv": (c.delta_conv_dim, h), "delta_z": (c.delta_value_dim, h), "delta_a": (hv, h),
                "delta_b": (hv, h), "delta_ab": (2 * hv, h), "delta_out": (h, c.delta_value_dim),
                "attn_gate": (c.q_dim, h),
                # Qwen3.5's q projection: q and the gate of each head, 2·D rows a head
                "q": ((2 if c.attention_gate else 1) * c.q_dim, h),
                "k": (c.kv_dim, c.hidden_size), "v": (c.kv_dim, c.hidden_size),
                "o": (c.hidden_size, c.q_dim), "gate": (c.intermediate_size, c.hidden_size),
                "up": (c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
                "qkv": (c.qkv_dim, c.hidden_size), "gate_up": (2 * c.intermediate_size, c.hidden_size),
                "embedding": (c.vocab_size, c.hidden_size), "lm_head": (c.vocab_size, c.hidden_size)}[name]

    def expected_vector(self, name: str) -> int:
        c = self.config
        return {"q_bias": c.q_dim, "k_bias": c.kv_dim, "v_bias": c.kv_dim, "q_norm": c.head_dim,
                "k_norm": c.head_dim, "dt_bias": c.delta_v_heads, "ssm_a": c.delta_v_heads,
                "delta_norm": c.delta_v_dim}.get(name, c.hidden_size)

    def vector_names(self, layer: int = 0) -> tuple[str, ...]:
        """The per-layer vectors this model's recipe reads on ``layer``."""
        c = self.config
        if c.layers[layer].kind == "conv":
            return ("attn_norm", "ffn_norm") + (("post_attn_norm", "post_ffn_norm") if c.post_norms else ())
        if c.layers[layer].kind == "delta":
            return ("attn_norm", "ffn_norm", "dt_bias", "ssm_a", "delta_norm")
        return (("attn_norm", "ffn_norm") + (("q_bias", "k_bias", "v_bias") if c.qkv_bias else ())
                + (("q_norm", "k_norm") if c.qk_norm else ()) + (("post_attn_norm", "post_ffn_norm") if c.post_norms
                                                                 else ()))

    def _quantized(self, w: Linear) -> Linear:
        if self.quantize != "q4" or isinstance(w, Q4Matrix):
            return w
        group = quantize_group(w.shape[1])
        return w if group is None else Q4Matrix.quantize(w, group)


def split_gated_q(w: Linear, n_heads: int, head_dim: int) -> tuple[Linear, Linear]:
    """Qwen3.5's q projection (H·2D rows: q then the gate, head by head) as its q rows and its gate rows, each
    head-major (H·D): exact for every form."""
    rows = np.arange(2 * n_heads * head_dim).reshape(n_heads, 2, head_dim)
    return permute_linear_rows(w, rows[:, 0].reshape(-1)), permute_linear_rows(w, rows[:, 1].reshape(-1))


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


def to_fp16(w: Linear, rows: int = 8192) -> np.ndarray:
    """W as fp16, dequantized a block of rows at a time (a float64 copy of a whole vocabulary is GBs)."""
    if isinstance(w, np.ndarray):
        return w.astype(np.float16)
    return np.concatenate([w.rows(i, min(i + rows, w.shape[0])).dequantize().astype(np.float16)
                           for i in range(0, w.shape[0], rows)])


def fuse_rows(parts: list[Linear]) -> Linear:
    """Stack projections along N in the form ``fused_form`` gives: exact except where an fp16 part makes
    the whole fp16 (e.g. an AWQ model with one projection in modules_to_not_convert)."""
    form = fused_form([form_of(p) for p in parts])
    if form.kind == "q4":
        return Q4Matrix.concat([p.regroup(form.group) for p in parts])
    if form.kind == "q8":
        return Q8Matrix.concat([Q8Matrix.from_q4(p) if isinstance(p, Q4Matrix) else p for p in parts])
    return np.concatenate([to_fp16(p) for p in parts])


def permute_linear_rows(w: Linear, permutation: np.ndarray) -> Linear:
    """Reorder the rows of W; for the int4 and int8 forms codes, scales and offsets move together (exact)."""
    if isinstance(w, (Q4Matrix, Q8Matrix)):
        return w.take_rows(permutation)
    return np.ascontiguousarray(w[permutation])


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
