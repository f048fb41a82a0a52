"""Model loading: a Hugging Face directory (safetensors, fp16/bf16 or AWQ int4) or a GGUF file, read lazily.

``open_model`` checks the whole file's header up front (every tensor present, of a known type, of the
shape the config implies), then hands out one layer at a time: files are memory-mapped and each
tensor is converted on its own, so host memory stays near the largest layer, not the model.

Every source gives the same host form (``LayerWeights``): Q, K and V fused into one matrix, gate and
up into another, rows in Hugging Face's rotate-half order, each linear layer either a
``perfx.formats.Q4Matrix`` (4-bit sources) or an fp16 ndarray (N, K).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np

from perfx import formats
from perfx.config import ModelConfig, gguf_field
from perfx.errors import PerfxError
from perfx.formats import Q4Matrix
from perfx.reference import unpermute_qk

Linear = Union[Q4Matrix, np.ndarray]  # a weight W (N, K): 4-bit device form, or fp16
QUANTIZE_CHOICES = (None, "q4")
AWQ_VERSIONS = ("gemm", "gemv")
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


def open_model(path_or_name, quantize: str | None = None) -> ModelSource:
    """Open a model lazily: a Hugging Face directory, a ``.gguf`` file or ``"synthetic:<name>"``.

    ``quantize="q4"`` turns fp16 linear layers (all of an fp16/bf16 checkpoint; the unquantized ones of
    the others) into 4-bit, round-to-nearest with group 128 (or 64/32 where 128 does not divide K; the
    source's ``notes`` say where). The embedding and lm_head stay fp16, as in AWQ checkpoints.
    Raises PerfxError for anything it cannot read, naming the file, tensor or setting.
    """
    if quantize not in QUANTIZE_CHOICES:
        raise PerfxError(f"quantize={quantize!r} is not supported; choose one of {QUANTIZE_CHOICES}")
    if isinstance(path_or_name, str) and path_or_name.startswith("synthetic:"):
        from perfx.synthetic import open_synthetic
        return open_synthetic(path_or_name)
    path = Path(path_or_name).expanduser()
    if not path.exists():
        raise PerfxError(f"Model not found: {path}. Pass a Hugging Face model directory (config.json and "
                         "model.safetensors), a .gguf file, or synthetic:<name>.")
    if path.is_dir():
        return HFSource(path, quantize)
    with open(path, "rb") as stream:
        magic = stream.read(4)
    if magic == b"GGUF":
        return GGUFSource(path, quantize)
    if path.suffix == ".safetensors":
        raise PerfxError(f"{path} is a single safetensors file; pass the directory that holds it with its "
                         "config.json instead.")
    raise PerfxError(f"{path} is neither a model directory nor a GGUF file (it does not start with the "
                     "GGUF magic bytes); pass a Hugging Face model directory or a .gguf file.")


# ---------------------------------------------------------------------------------------------
# What every source shares


class ModelSource(ABC):
    """A model opened lazily. Subclasses read tensors; the fusion, checks and quantize-on-load live here."""

    format = "?"

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


def _shape_error(where: str, tensor: str, shape, expected, config: ModelConfig) -> PerfxError:
    return PerfxError(f"{where}: tensor {tensor} has shape {tuple(shape)} but the model's config "
                      f"({config.architecture}, hidden {config.hidden_size}, {config.n_heads} heads × "
                      f"{config.head_dim}, {config.n_kv_heads} kv heads, "
                      f"intermediate {config.intermediate_size}, vocab {config.vocab_size}) needs "
                      f"{tuple(expected)}; the weights and config.json/header belong to different models")


# ---------------------------------------------------------------------------------------------
# Hugging Face directories (safetensors)

HF_LINEAR = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
HF_VECTOR = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
             "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
             "v_bias": "self_attn.v_proj.bias"}
SAFETENSORS_DTYPES = {"F16": np.float16, "F32": np.float32, "BF16": None, "I32": np.int32}


class HFSource(ModelSource):
    """A Hugging Face model directory: config.json, model.safetensors (or an index of shards)."""

    format = "safetensors"

    def __init__(self, directory: Path, quantize: str | None = None):
        self.directory = directory
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise PerfxError(f"{directory} is not a Hugging Face model directory: it has no config.json. "
                             "Pass a directory with config.json and model.safetensors, or a .gguf file.")
        hf_config = _read_json(config_path)
        super().__init__(ModelConfig.from_hf(hf_config), quantize)
        generation = directory / "generation_config.json"
        self.generation_config = _read_json(generation) if generation.is_file() else {}
        self.awq = _awq_settings(hf_config.get("quantization_config"), config_path)
        self._files = self._open_files()
        self._check_tensors()

    # -- files -------------------------------------------------------------------------------------

    def _open_files(self) -> dict[str, tuple[Path, object]]:
        """Tensor name -> (file, safe_open handle); every file's header is read (and checked) here."""
        from safetensors import safe_open

        single, index = self.directory / "model.safetensors", self.directory / "model.safetensors.index.json"
        if single.is_file():
            paths = {None: single}
        elif index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise PerfxError(f"{index} has no weight_map; the index is corrupt, download it again")
            paths = {name: self.directory / file for name, file in weight_map.items()}
        else:
            found = sorted(p.name for p in self.directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
            raise PerfxError(f"{self.directory} has no model.safetensors or model.safetensors.index.json"
                             + (f" (found {', '.join(found)}: perfx reads only safetensors; convert with "
                                "transformers' save_pretrained(safe_serialization=True))" if found else ""))
        handles = {}
        for path in set(paths.values()):
            if not path.is_file():
                raise PerfxError(f"shard {path.name} listed in the index is missing from {self.directory}")
            try:
                handles[path] = safe_open(str(path), framework="numpy")
            except Exception as error:  # SafetensorError and friends: truncated, corrupt header
                raise PerfxError(f"{path} is not a readable safetensors file ({error}); the download is "
                                 "truncated or corrupt, fetch it again") from None
        files = {}
        for path, handle in handles.items():
            for name in handle.keys():
                files[name] = (path, handle)
        return files

    def _info(self, name: str) -> tuple[tuple[int, ...], str]:
        if name not in self._files:
            raise PerfxError(f"{self.directory}: tensor {name} is missing; the checkpoint is incomplete "
                             "or is not a Llama-family model")
        path, handle = self._files[name]
        piece = handle.get_slice(name)
        return tuple(piece.get_shape()), piece.get_dtype()

    def _tensor(self, name: str, expected: tuple[int, ...] | None = None) -> np.ndarray:
        shape, dtype = self._info(name)
        if expected is not None and shape != tuple(expected):
            raise _shape_error(str(self.directory), name, shape, expected, self.config)
        path, handle = self._files[name]
        if dtype not in SAFETENSORS_DTYPES:
            raise PerfxError(f"{path.name}: tensor {name} has dtype {dtype}; perfx reads F16, BF16, F32 "
                             "(and I32 for AWQ)")
        try:
            tensor = _read_bf16(path, name, shape) if dtype == "BF16" else handle.get_tensor(name)
        except PerfxError:
            raise
        except Exception as error:
            raise PerfxError(f"{path}: could not read tensor {name} ({error}); the file is corrupt, "
                             "fetch it again") from None
        return check_finite(tensor, path, name)

    def _module(self, name: str, layer: int) -> str:
        return f"model.layers.{layer}.{HF_LINEAR[name]}"

    def _is_awq(self, module: str) -> bool:
        return self.awq is not None and f"{module}.qweight" in self._files

    def _check_tensors(self):
        """Every tensor the model needs exists with the right shape: fail at open, not at layer 20."""
        c = self.config
        self._check_shape("model.embed_tokens.weight", self.expected_shape("embedding"))
        self._check_shape("model.norm.weight", (c.hidden_size,))
        if not c.tie_embeddings:
            self._check_linear("lm_head", self.expected_shape("lm_head"))
        for i in range(c.n_layers):
            for name in LINEAR_NAMES:
                self._check_linear(self._module(name, i), self.expected_shape(name))
            for name in ("attn_norm", "ffn_norm") + (("q_bias", "k_bias", "v_bias") if c.qkv_bias else ()):
                self._check_shape(f"model.layers.{i}.{HF_VECTOR[name]}", (self.expected_vector(name),))

    def _check_shape(self, name: str, expected):
        shape, _ = self._info(name)
        if shape != tuple(expected):
            raise _shape_error(str(self.directory), name, shape, expected, self.config)

    def _check_linear(self, module: str, expected):
        if not self._is_awq(module):
            return self._check_shape(f"{module}.weight", expected)
        for suffix, shape in _awq_shapes(self.awq, *expected).items():
            self._check_shape(f"{module}.{suffix}", shape)

    # -- tensors -----------------------------------------------------------------------------------

    def _read_linear(self, module: str, expected) -> Linear:
        if not self._is_awq(module):
            return self._tensor(f"{module}.weight", expected).astype(np.float16)
        version, group = self.awq["version"], self.awq["group"]
        parts = [self._tensor(f"{module}.{suffix}") for suffix in ("qweight", "qzeros", "scales")]
        read = formats.from_awq_gemm if version == "gemm" else formats.from_awq_gemv
        return read(*parts, group)

    def _linear(self, name: str, layer: int) -> Linear:
        return self._read_linear(self._module(name, layer), self.expected_shape(name))

    def _vector(self, name: str, layer: int | None) -> np.ndarray:
        tensor = "model.norm.weight" if name == "final_norm" else f"model.layers.{layer}.{HF_VECTOR[name]}"
        return self._tensor(tensor, (self.expected_vector(name),)).astype(np.float32)

    def embedding(self) -> np.ndarray:
        return self._tensor("model.embed_tokens.weight", self.expected_shape("embedding")).astype(np.float16)

    def lm_head(self) -> Linear | None:
        if self.config.tie_embeddings:
            return None
        return self._read_linear("lm_head", self.expected_shape("lm_head"))

    def _load_tokenizer(self):
        if not any((self.directory / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            return None
        from perfx.tokenizer import Tokenizer
        return Tokenizer.from_hf_dir(self.directory)

    def describe(self) -> dict:
        files = sorted({path for path, _ in self._files.values()})
        dtypes = sorted({self._info(name)[1] for name in self._files})
        if self.awq:
            quantization = f"awq-{self.awq['version']} int4, group {self.awq['group']}"
        else:
            quantization = "/".join(d.lower() for d in dtypes)
        if self.quantize:
            quantization += f", quantized to {self.quantize} on load"
        return {"format": "safetensors", "path": str(self.directory), "files": [p.name for p in files],
                "file_size": sum(p.stat().st_size for p in files), "quantization": quantization,
                "architecture": self.config.architecture, "notes": list(self.notes)}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PerfxError(f"{path} is not valid JSON ({error}); the file is corrupt, fetch it again") from None


def _read_bf16(path: Path, name: str, shape) -> np.ndarray:
    """numpy has no bfloat16: map the tensor's bytes from the safetensors header and widen to float32.

    bf16 is the top half of an IEEE float32, so a 16-bit shift is exact.
    """
    with open(path, "rb") as stream:
        header_size = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(header_size))
    start, stop = header[name]["data_offsets"]
    raw = np.memmap(path, dtype=np.uint16, mode="r", offset=8 + header_size + start,
                    shape=((stop - start) // 2,))
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)


def _awq_settings(quantization: dict | None, config_path: Path) -> dict | None:
    """The AWQ parameters perfx needs, or None for an unquantized checkpoint; PerfxError for anything else."""
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method != "awq":
        raise PerfxError(f"{config_path}: quantization method {method!r} is not supported; perfx reads AWQ "
                         "int4 (version gemm or gemv) and fp16/bf16 checkpoints (add quantize='q4' to quantize "
                         "on load), or GGUF files with Q4_0/Q4_1/Q8_0/F16/F32 tensors")
    bits = quantization.get("w_bit", quantization.get("bits"))
    group = quantization.get("q_group_size", quantization.get("group_size"))
    version = str(quantization.get("version", "gemm")).lower()
    if bits != 4:
        raise PerfxError(f"{config_path}: AWQ with {bits}-bit weights is not supported; perfx's int4 kernels "
                         "need w_bit = 4 (group size 32, 64 or 128)")
    if group not in formats.GROUP_SIZES:
        raise PerfxError(f"{config_path}: AWQ group size {group} is not supported; perfx supports "
                         f"q_group_size {formats.GROUP_SIZES}")
    if version not in AWQ_VERSIONS:
        raise PerfxError(f"{config_path}: AWQ version {version!r} is not supported; perfx reads the "
                         f"{' and '.join(AWQ_VERSIONS)} packings (re-save the model with AutoAWQ "
                         "version 'gemm')")
    if quantization.get("zero_point", True) is not True:
        raise PerfxError(f"{config_path}: AWQ without zero points (zero_point false) is not supported; perfx "
                         "reads zero_point true checkpoints (AutoAWQ's default)")
    return {"version": version, "group": int(group),
            "modules_to_not_convert": list(quantization.get("modules_to_not_convert") or [])}


def _awq_shapes(awq: dict, n: int, k: int) -> dict[str, tuple[int, int]]:
    group = awq["group"]
    if k % group:
        raise PerfxError(f"AWQ group size {group} does not divide K = {k}; the checkpoint contradicts "
                         "its config")
    if awq["version"] == "gemm":
        return {"qweight": (k, n // 8), "qzeros": (k // group, n // 8), "scales": (k // group, n)}
    width = formats.awq_zeros_width(k, group)
    return {"qweight": (n, k // 8), "qzeros": (n, width), "scales": (n, 8 * width)}


# ---------------------------------------------------------------------------------------------
# GGUF

GGUF_LINEAR = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
               "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down"}
GGUF_VECTOR = {"attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight",
               "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias"}
GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "F32")


class GGUFSource(ModelSource):
    """A GGUF file (architecture llama or qwen2): Q4_0/Q4_1 stay 4-bit, Q8_0/F16/F32 become fp16."""

    format = "gguf"

    def __init__(self, path: Path, quantize: str | None = None):
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as error:  # ValueError, struct/mmap errors on a truncated or corrupt header
            raise PerfxError(f"{path} is not a readable GGUF file ({type(error).__name__}: {error}); it is "
                             "truncated or corrupt, fetch it again") from None
        super().__init__(ModelConfig.from_gguf(self.reader), quantize)
        self._tensors = {t.name: t for t in self.reader.tensors}
        self._check_tensors()

    def _check_tensors(self):
        c = self.config
        self._check("token_embd.weight", self.expected_shape("embedding"))
        self._check("output_norm.weight", (c.hidden_size,))
        if not c.tie_embeddings:
            self._check("output.weight", self.expected_shape("lm_head"))
        for i in range(c.n_layers):
            for name, tensor in GGUF_LINEAR.items():
                self._check(f"blk.{i}.{tensor}.weight", self.expected_shape(name))
            for name in ("attn_norm", "ffn_norm") + (("q_bias", "k_bias", "v_bias") if c.qkv_bias else ()):
                self._check(f"blk.{i}.{GGUF_VECTOR[name]}", (self.expected_vector(name),))

    def _check(self, name: str, expected):
        t = self._tensors.get(name)
        if t is None:
            raise PerfxError(f"{self.path}: tensor {name} is missing; the GGUF is incomplete or not a "
                             f"{self.config.architecture} model")
        kind = t.tensor_type.name
        if kind not in GGUF_TYPES:
            raise PerfxError(f"{self.path}: tensor {name} has type {kind}, which perfx does not read; "
                             f"supported GGUF tensor types are {', '.join(GGUF_TYPES)} (pick a Q4_0, Q4_1 or "
                             "Q8_0 file, or convert with llama-quantize --pure)")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists ne[0] (K) first
        if len(expected) == 1:
            shape = (int(np.prod(shape)),)
        if shape != tuple(expected):
            raise _shape_error(str(self.path), name, shape, expected, self.config)
        return t

    def _read(self, name: str, expected) -> Linear:
        """A matrix (N, K): Q4_0/Q4_1 as Q4Matrix, anything else as fp16."""
        t = self._check(name, expected)
        n, k = expected
        kind = t.tensor_type.name
        if kind == "Q4_0":
            w = formats.from_gguf_q4_0(t.data, n, k, name)
        elif kind == "Q4_1":
            w = formats.from_gguf_q4_1(t.data, n, k, name)
        elif kind == "Q8_0":
            w = formats.dequantize_gguf_q8_0(t.data, n, k, name).astype(np.float16)
        else:
            w = np.asarray(t.data).reshape(n, k).astype(np.float16)
        return check_finite(w, self.path, name)

    def _linear(self, name: str, layer: int) -> Linear:
        w = self._read(f"blk.{layer}.{GGUF_LINEAR[name]}.weight", self.expected_shape(name))
        return self._unpermute(name, w)

    def _unpermute(self, name: str, w):
        """Undo llama.cpp's permutation of Wq/Wk rows (and biases), made for its interleaved RoPE."""
        if self.config.architecture != "llama" or name not in ("q", "k", "q_bias", "k_bias"):
            return w
        heads = self.config.n_heads if name.startswith("q") else self.config.n_kv_heads
        return permute_linear_rows(w, unpermute_qk(np.arange(w.shape[0]), heads))

    def _vector(self, name: str, layer: int | None) -> np.ndarray:
        tensor = "output_norm.weight" if name == "final_norm" else f"blk.{layer}.{GGUF_VECTOR[name]}"
        t = self._check(tensor, (self.expected_vector(name),))
        if t.tensor_type.name not in ("F32", "F16"):
            raise PerfxError(f"{self.path}: vector {tensor} is {t.tensor_type.name}; expected F32 or F16")
        vector = check_finite(np.asarray(t.data, dtype=np.float32).reshape(-1), self.path, tensor)
        return self._unpermute(name, vector)

    def embedding(self) -> Linear:
        return self._read("token_embd.weight", self.expected_shape("embedding"))

    def lm_head(self) -> Linear | None:
        if self.config.tie_embeddings:
            return None
        return self._read("output.weight", self.expected_shape("lm_head"))

    def _load_tokenizer(self):
        if self.reader.get_field("tokenizer.ggml.model") is None:
            return None
        from perfx.tokenizer import Tokenizer
        return Tokenizer.from_gguf(self.reader)

    def describe(self) -> dict:
        counts: dict[str, int] = {}
        for t in self.reader.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        quantization = ", ".join(f"{kind} ×{n}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        if self.quantize:
            quantization += f", fp16 layers quantized to {self.quantize} on load"
        return {"format": "gguf", "path": str(self.path), "files": [self.path.name],
                "file_size": self.path.stat().st_size, "quantization": quantization,
                "name": gguf_field(self.reader, "general.name"),
                "architecture": self.config.architecture, "notes": list(self.notes)}
