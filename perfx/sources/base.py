"""What every model source shares: the host form of a layer, the base class, fusion and checks.

Every source gives the same host form (``LayerWeights``): Q, K and V fused into one matrix, gate and
up into another, rows in Hugging Face's rotate-half order, each linear layer either a
``perfx.formats.Q4Matrix`` (4-bit sources) or an fp16 ndarray (N, K). A source checks the whole
file's header when it is opened, then hands out one layer at a time, so host memory stays near the
largest layer, not the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Union

import numpy as np

from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.formats import Q4Matrix

Linear = Union[Q4Matrix, np.ndarray]  # a weight W (N, K): 4-bit device form, or fp16
QUANTIZE_CHOICES = (None, "q4")
LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass
class LayerWeights:
    """One decoder layer, host side, in the layout the device forward uses."""

    attn_norm: np.ndarray          # (hidden,) float32
    qkv: Linear                    # (H·D + 2·Hkv·D, hidden): q, k, v rows, Hugging Face rotate-half order
    qkv_bias: np.ndarray | None    # (H·D + 2·Hkv·D,) float32, Qwen2 only
    o: Linear                      # (hidden, H·D)
    ffn_norm: np.ndarray           # (hidden,) float32
    gate_up: Linear                # (2·intermediate, hidden): gate rows, then up rows
    down: Linear                   # (hidden, intermediate)


# ---------------------------------------------------------------------------------------------
# What every source shares


class ModelSource(ABC):
    """A model opened lazily. Subclasses read tensors; the fusion, checks and quantize-on-load live here."""

    format = "?"
    int4_group: int | None = None   # the int4 group size the file fixes (GGUF Q4: 32, AWQ: its own), if any

    def __init__(self, config: ModelConfig, quantize: str | None = None):
        self.config = config
        self.quantize = quantize
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

    @abstractmethod
    def embedding(self) -> Linear:
        """The token embedding (V, hidden): fp16, or a Q4Matrix for a 4-bit GGUF embedding."""

    @abstractmethod
    def lm_head(self) -> Linear | None:
        """The output projection (V, hidden), None when it is tied to the embedding."""

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

    def layer(self, i: int) -> LayerWeights:
        """Layer i's weights, read and converted now (nothing is kept between calls)."""
        c = self.config
        if not 0 <= i < c.n_layers:
            raise PerfxError(f"layer {i} does not exist: the model has {c.n_layers} layers")
        qkv = fuse_rows([self._linear(name, i) for name in ("q", "k", "v")])
        bias = None
        if c.qkv_bias:
            bias = np.concatenate([self._vector(f"{name}_bias", i) for name in ("q", "k", "v")])
        return LayerWeights(
            attn_norm=self._vector("attn_norm", i), qkv=self._quantized(qkv), qkv_bias=bias,
            o=self._quantized(self._linear("o", i)), ffn_norm=self._vector("ffn_norm", i),
            gate_up=self._quantized(fuse_rows([self._linear("gate", i), self._linear("up", i)])),
            down=self._quantized(self._linear("down", i)))

    def layers(self):
        """Iterate over the layers in order, one loaded at a time."""
        for i in range(self.config.n_layers):
            yield self.layer(i)

    def expected_shape(self, name: str) -> tuple[int, int]:
        """(N, K) of a projection, from the config."""
        c = self.config
        return {"q": (c.q_dim, c.hidden_size), "k": (c.kv_dim, c.hidden_size), "v": (c.kv_dim, c.hidden_size),
                "o": (c.hidden_size, c.q_dim), "gate": (c.intermediate_size, c.hidden_size),
                "up": (c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
                "embedding": (c.vocab_size, c.hidden_size), "lm_head": (c.vocab_size, c.hidden_size)}[name]

    def expected_vector(self, name: str) -> int:
        c = self.config
        return {"q_bias": c.q_dim, "k_bias": c.kv_dim, "v_bias": c.kv_dim}.get(name, c.hidden_size)

    def _quantized(self, w: Linear) -> Linear:
        if self.quantize != "q4" or isinstance(w, Q4Matrix):
            return w
        group = quantize_group(w.shape[1])
        return w if group is None else Q4Matrix.quantize(w, group)


def quantize_group(k: int) -> int | None:
    """The largest supported group size dividing K (128 preferred), None when none does."""
    return next((g for g in (128, 64, 32) if k % g == 0), None)


def fuse_rows(parts: list[Linear]) -> Linear:
    """Stack projections along N. 4-bit parts of one group stay 4-bit; any other mix becomes fp16."""
    if all(isinstance(p, Q4Matrix) for p in parts) and len({p.group for p in parts}) == 1:
        return Q4Matrix.concat(parts)
    # e.g. an AWQ model with one projection in modules_to_not_convert, or a GGUF mixing Q4 and Q8_0
    return np.concatenate([p.dequantize().astype(np.float16) if isinstance(p, Q4Matrix) else p for p in parts])


def permute_linear_rows(w: Linear, permutation: np.ndarray) -> Linear:
    """Reorder the rows of W; for a Q4Matrix codes, scales and offsets move together (exact)."""
    if isinstance(w, Q4Matrix):
        return Q4Matrix(w.codes[permutation], w.scales[permutation], w.offsets[permutation], w.group)
    return np.ascontiguousarray(w[permutation])


def check_finite(w: Linear, where, tensor: str) -> Linear:
    """W itself, or a PerfxError naming the tensor if a float value (a Q4Matrix's scale, offset) is NaN or Inf.

    Checked at load: a NaN weight would otherwise surface tokens later, as NaN logits or as noise.
    """
    parts = (("scales", w.scales), ("offsets", w.offsets)) if isinstance(w, Q4Matrix) else (("values", w),)
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
