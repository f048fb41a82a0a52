"""Model hyper-parameters, read from a Hugging Face ``config.json`` or a GGUF header."""

from __future__ import annotations

from dataclasses import dataclass, field

import gguf
import numpy as np

from perfx.errors import PerfxError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
# GGUF files name their architecture in general.architecture; Mistral GGUFs are written as "llama".
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")


@dataclass
class ModelConfig:
    """Shapes and constants of a Llama-family decoder. Every field the forward pass needs, nothing else."""

    architecture: str          # "llama", "mistral" or "qwen2"
    vocab_size: int            # V
    hidden_size: int           # hidden, the residual stream width
    intermediate_size: int     # the MLP's inner width
    n_layers: int
    n_heads: int               # H query heads
    n_kv_heads: int            # Hkv key/value heads (GQA when < H)
    head_dim: int              # D
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None    # Hugging Face rope_scaling ("llama3", "linear") or None; a GGUF's
                                        # rope_freqs tensor rides along as "freq_factors" (D/2 divisors)
    max_positions: int = 4096
    tie_embeddings: bool = False        # lm_head is the embedding matrix
    qkv_bias: bool = False              # Qwen2 has biases on the Q, K and V projections
    sliding_window: int = 0             # Mistral: a position attends to the last W positions only (0: all)
    extra: dict = field(default_factory=dict, repr=False, compare=False)  # e.g. Mistral's sliding_window

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise PerfxError(f"model architecture {self.architecture!r} is not supported; "
                             f"perfx runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.n_heads % self.n_kv_heads:
            raise PerfxError(f"n_heads = {self.n_heads} is not a multiple of n_kv_heads = {self.n_kv_heads}")
        if self.head_dim % 2:
            raise PerfxError(f"head_dim = {self.head_dim} must be even for rotary embeddings")

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

    @classmethod
    def from_hf(cls, config: dict) -> ModelConfig:
        """From the dict of a Hugging Face ``config.json``."""
        architecture = config.get("model_type")
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
        n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
        head_dim = int(config.get("head_dim") or hidden // n_heads)
        # Qwen2 always has Q/K/V biases; Llama has them when attention_bias is set.
        qkv_bias = architecture == "qwen2" or bool(config.get("attention_bias", False))
        extra = {}
        if config.get("sliding_window") and architecture == "mistral":
            extra["sliding_window"] = int(config["sliding_window"])
        # Qwen2 configs carry a sliding_window too, but use it only with use_sliding_window (off in every
        # released Qwen2 model, and not what transformers does for them by default): Mistral's alone counts.
        default_eps = 1e-6 if architecture == "qwen2" else 1e-5
        return cls(
            architecture=architecture, hidden_size=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads,
            head_dim=head_dim, rms_eps=float(config.get("rms_norm_eps", default_eps)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rope_scaling=config.get("rope_scaling") or None,
            max_positions=int(config.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)), qkv_bias=qkv_bias,
            sliding_window=int(extra.get("sliding_window", 0)), extra=extra, **values,
        )

    @classmethod
    def from_gguf(cls, reader) -> ModelConfig:
        """From a ``gguf.GGUFReader``: the ``{arch}.*`` keys, vocabulary and head sizes."""
        arch = gguf_field(reader, "general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise PerfxError(f"GGUF architecture {arch!r} is not supported; perfx reads GGUF files of "
                             f"architecture {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")

        def key(name, default=None):
            value = gguf_field(reader, f"{arch}.{name}")
            if value is None and default is None:
                raise PerfxError(f"GGUF header lacks {arch}.{name}; the file was not written by a "
                                 "complete llama.cpp converter")
            return default if value is None else value

        hidden = int(key("embedding_length"))
        n_heads = int(key("attention.head_count"))
        vocab = gguf_field(reader, f"{arch}.vocab_size")
        if vocab is None:
            tokens = reader.get_field("tokenizer.ggml.tokens")
            vocab = len(tokens.data) if tokens is not None else _embedding_rows(reader)
        head_dim = gguf_field(reader, f"{arch}.attention.key_length") or gguf_field(
            reader, f"{arch}.rope.dimension_count") or hidden // n_heads
        scaling = None
        scaling_type = gguf_field(reader, f"{arch}.rope.scaling.type")
        if scaling_type == "linear":
            scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        elif scaling_type not in (None, "none"):
            raise PerfxError(f"GGUF rope scaling type {scaling_type!r} is not supported (supported: linear)")
        factors = _rope_freqs(reader, int(head_dim))
        if factors is not None:
            scaling = dict(scaling or {"rope_type": "default"}, freq_factors=factors)
        return cls(
            architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")), n_layers=int(key("block_count")),
            n_heads=n_heads, n_kv_heads=int(key("attention.head_count_kv", n_heads)), head_dim=int(head_dim),
            rms_eps=_float32_value(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=_float32_value(key("rope.freq_base", 10000.0)), rope_scaling=scaling,
            max_positions=int(key("context_length", 4096)),
            tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
            qkv_bias=any(t.name == "blk.0.attn_q.bias" for t in reader.tensors),
            sliding_window=int(gguf_field(reader, f"{arch}.attention.sliding_window") or 0),
        )


def gguf_field(reader, name: str, default=None):
    """The value of a GGUF header field as plain Python (str, int, float, bool or list), else ``default``.

    Strings are decoded with U+FFFD for bytes that are not UTF-8 (gguf's ``ReaderField.contents`` raises
    instead): a vocabulary may hold such tokens, and llama.cpp loads them.
    """
    entry = reader.get_field(name)
    if entry is None:
        return default

    def text(part) -> str:
        return bytes(part).decode("utf-8", errors="replace")

    if entry.types[0] == gguf.GGUFValueType.ARRAY:
        if entry.types[-1] == gguf.GGUFValueType.STRING:
            return [text(entry.parts[i]) for i in entry.data]
        return [item for i in entry.data for item in entry.parts[i].tolist()]
    if entry.types[0] == gguf.GGUFValueType.STRING:
        return text(entry.parts[-1])
    return entry.parts[-1].tolist()[0]


def _float32_value(value) -> float:
    """GGUF stores these as float32: 1e-5 comes back as 9.99999974e-06. Take the shortest decimal that
    rounds to the same float32, which is what config.json said."""
    return float(str(np.float32(value)))


def _rope_freqs(reader, head_dim: int) -> list[float] | None:
    """Llama 3.x GGUFs carry their "llama3" rope scaling as a tensor, rope_freqs.weight: D/2 float32
    divisors of the inverse frequencies (llama.cpp's freq_factors of ggml_rope_ext), None when absent."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    if tensor.tensor_type.name not in ("F32", "F16"):
        raise PerfxError(f"GGUF tensor rope_freqs.weight has type {tensor.tensor_type.name}; llama.cpp writes "
                         "it as F32 (the file is not from a llama.cpp converter)")
    values = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    if values.size != head_dim // 2:
        raise PerfxError(f"GGUF tensor rope_freqs.weight has {values.size} values, but RoPE over head_dim "
                         f"{head_dim} needs one per dimension pair, {head_dim // 2}; the file is corrupt or "
                         "its header lies about the head size")
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise PerfxError("GGUF tensor rope_freqs.weight holds a value that is not a positive finite number; "
                         "the frequency divisors of a corrupt file")
    return [float(v) for v in values]


def _embedding_rows(reader) -> int:
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])
    raise PerfxError("GGUF has neither a vocabulary size nor a token_embd.weight tensor")
