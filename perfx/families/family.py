"""What a family file holds (``Family``), what the common reading hands its recipe readers (``GGUFHeader``,
``HFConfig``), and the reading helpers more than one family uses.

A family file (``perfx/families/<arch>.py``) defines one ``FAMILY = Family(...)``; ``perfx.families`` finds
it by itself. Everything every architecture shares (the shapes, heads, RoPE base and scaling, norm epsilon,
context length, tied embeddings) is read once, in ``perfx.families``; a family's readers return only what
its recipe adds or changes, as ``ModelConfig`` fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from perfx.errors import PerfxError
from perfx.gguf_file import GGUFFile
from perfx.recipe import LayerRecipe, Rope

__all__ = ["ChatRules", "Family", "GGUFHeader", "HFConfig", "LayerRecipe", "Preset", "Rope", "TensorNames",
           "ToolFormat", "factor_table", "float32_value", "header_key", "per_layer"]


@dataclass(frozen=True)
class TensorNames:
    """Where the family's tensors differ from the common names (``perfx.sources.gguf`` GGUF_LINEAR /
    GGUF_VECTOR, ``perfx.sources.huggingface`` HF_LINEAR / HF_VECTOR): only the differences."""

    gguf_permuted_qk: bool = False      # the GGUF converter permutes Wq/Wk rows for llama.cpp's interleaved
                                        # RoPE (LLAMA_ROPE_TYPE_NORM); they are put back in rotate-half order
    gguf_vectors: Mapping[str, str] = field(default_factory=dict)    # per-layer vectors: part -> tensor
    gguf_final_norm: str = "output_norm.weight"
    hf_linears: Mapping[str, str] = field(default_factory=dict)      # part -> module under layers.{i}.
    hf_vectors: Mapping[str, str] = field(default_factory=dict)      # part -> tensor under layers.{i}.
    hf_final_norm: str = "norm.weight"
    hf_norm_offset: float = 0.0         # 1.0: the checkpoint stores w of an RMSNorm that multiplies by 1 + w
                                        # (GGUF converters store 1 + w)
    hf_router: str = "gate"             # a MoE block's router module (gpt-oss: "router", with a bias)
    hf_experts: str = "rows"            # how a checkpoint holds the experts: "rows", one module each or stacked
                                        # (E, rows, K); "gpt_oss", stacked (E, K, 2·I) with gate and up interleaved
                                        # (or MXFP4 _blocks and _scales of (E, rows, K))


@dataclass(frozen=True)
class ToolFormat:
    """How a family's models write tool calls, and how its chat templates take the tools (``perfx.tools`` renders
    and parses with it).

    A call is ``{"name": ..., <arguments>: {...}}`` in JSON (``body`` "json": one object or a list of them
    between ``opener`` and ``closer``), or ``[f(a=1), g()]`` (``body`` "pythonic", LFM2's; a JSON list is read
    there too). No ``opener``: the reply itself is the call, a bare JSON object (Llama 3.x). ``body`` "harmony":
    gpt-oss's messages, read by ``perfx.tools.HarmonyParser`` (channels and recipients, not opener and closer).
    """

    name: str
    marker: str = ""            # text in a chat template that renders this format ("": taught by instructions only)
    opener: str = ""            # the text a call (or a list of calls) starts with
    closer: str = ""            # ... and ends with ("": it runs to the end of the reply)
    also_openers: tuple[str, ...] = ()  # other texts that open a call (Llama 3.1's <|python_tag|>)
    separator: str = ""         # between the opener, the call and the closer, as the template writes them
    body: str = "json"          # "json", "pythonic" (always a list) or "harmony" (gpt-oss's channels and recipients)
    listed: bool = False        # several calls are one list between one opener and closer (else one call each)
    arguments_key: str = "arguments"    # the key a call writes its arguments under ("parameters": Llama 3.x)
    tools_variable: str = "tools"       # the template variable the tools go in (SmolLM3's: xml_tools)
    tools_in_system: bool = False       # the tools go in the system message's "tools" field, as JSON (Phi-4-mini)
    instructions: str = ""      # the system-message text that teaches the format where the template renders no
                                # tools; {tools} stands for the tools' JSON, one a line
    results: tuple[str, str] = ("<tool_response>\n", "\n</tool_response>")   # around a tool's result where the
                                # template renders no tool messages (it is then a user message)


@dataclass(frozen=True)
class ChatRules:
    """What the tokenizer does for this family's models beyond what the files say."""

    stop_tokens: tuple[str, ...]        # the tokens that end its turns; each ends generation wherever it is in
                                        # the vocabulary (llama.cpp's end-of-generation list holds them all)
    fallback_template: str | None = None    # the template a model of it without one gets (None: ChatML) ...
    template_tokens: tuple[str, ...] = ()   # ... when its vocabulary holds these tokens
    rstrip_names: tuple[str, ...] = ()  # general.name holding one of these: llama.cpp drops the whitespace
    rstrip_keep: tuple[str, ...] = ()   # after every special token but these (llama-vocab.cpp, load)
    pre_tokenizers: Mapping[str, tuple] = field(default_factory=dict)   # GGUF tokenizer.ggml.pre values only
                                        # this family writes: name -> (regexes, ignore_merges, add_bos default)
    tool_formats: tuple[ToolFormat, ...] = ()   # the tool-call formats its templates render, found by their marker
    prompted_tools: ToolFormat | None = None    # the format its models are taught in the system message where the
                                                # template renders no tools (None: perfx.tools' generic one)


@dataclass(frozen=True)
class Preset:
    """A ``synthetic:<name>`` model: a config.json (only what the recipe reads) and its int4 group."""

    config: Mapping
    group: int = 32
    zero_points: bool = False           # int4 with zero points (AWQ's form) rather than (scale, offset) pairs
    experts: str = "q4"                 # the experts' form: int4 as the rest, or "mxfp4" as gpt-oss's files hold them
                                        # (held as the file holds it: e2m1 nibbles, E8M0 scales)


@dataclass(frozen=True)
class GGUFHeader:
    """What the common reading of a GGUF header found, for a family's ``read_gguf``."""

    reader: GGUFFile
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    head_dim: int
    rotary: int                 # rope.dimension_count (or head_dim)
    theta: float
    window: int                 # attention.sliding_window (0: none)
    rope: Rope                  # Rope(theta, rotary, the scaling read)

    def value(self, name: str, default=None):
        """``{arch}.{name}``, or ``default`` when absent."""
        value = self.reader.value(f"{self.arch}.{name}")
        return default if value is None else value

    def key(self, name: str, default=None):
        """``{arch}.{name}``; absent with no default: the file was not written by a complete converter."""
        return header_key(self.reader, self.arch, name, default)


@dataclass(frozen=True)
class HFConfig:
    """What the common reading of a config.json found, for a family's ``read_hf``."""

    config: dict                # the (text model's) config.json
    architecture: str           # its model_type
    n_layers: int
    hidden: int
    head_dim: int
    theta: float
    scaling: dict | None        # rope_scaling / rope_parameters
    local_theta: float          # rope_local_base_freq (Gemma 3's sliding layers)
    window: int                 # sliding_window (0: none)
    rope: Rope                  # Rope(theta, head_dim, scaling)


def _no_unwrap(config: dict) -> tuple[str, dict]:
    return config.get("model_type"), config


@dataclass(frozen=True)
class Family:
    """One architecture as perfx reads it: its names, how its recipe is read from a GGUF header and from a
    config.json, its tensor names, its chat rules and its synthetic models."""

    name: str                           # the family (the module's name)
    order: int                          # its place in the lists of what perfx runs (the order perfx gained them)
    gguf_names: tuple[str, ...]         # GGUF general.architecture values
    hf_names: tuple[str, ...]           # Hugging Face model_type values
    read_gguf: Callable[[GGUFHeader], dict]     # the recipe beyond the common keys, as ModelConfig fields
    read_hf: Callable[[HFConfig], dict]         # the same from config.json
    tensors: TensorNames
    chat: ChatRules
    synthetic: Mapping[str, Preset]     # the synthetic:<name> models of the family
    layer_kinds: tuple[str, ...] = ("attention",)   # what mixes the positions in its layers (recipe.LayerRecipe)
    # config.json defaults where the common keys are absent
    hf_head_dim: int = 0                # head_dim (0: hidden / heads)
    hf_rms_eps: float = 1e-6            # rms_norm_eps
    hf_tied: bool = False               # tie_word_embeddings
    # model_type of a multimodal checkpoint -> (the text model's model_type, its config), the text model run
    hf_multimodal: Mapping[str, Callable[[dict], tuple[str, dict]]] = field(default_factory=dict)
    gguf_rope_scaling: bool = False     # read_gguf reads the rope scaling itself (any rope.scaling.type is its own)


# -- reading helpers more than one family uses ------------------------------------------------------------

def header_key(reader: GGUFFile, arch: str, name: str, default=None):
    """``{arch}.{name}`` of a GGUF header; absent with no default: a PerfxError naming the key."""
    value = reader.value(f"{arch}.{name}")
    if value is None and default is None:
        raise PerfxError(f"GGUF header lacks {arch}.{name}; the file was not written by a "
                         "complete llama.cpp converter")
    return default if value is None else value


def per_layer(value, n_layers: int, name: str) -> list[int]:
    """A GGUF key that holds one value, or one per layer (llama.cpp reads either), as one per layer."""
    values = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * n_layers
    if len(values) != n_layers:
        raise PerfxError(f"GGUF {name} lists {len(values)} layers but the model has {n_layers}; the file is corrupt")
    return values


def factor_table(tensor, name: str, rotary: int) -> list[float]:
    """A GGUF tensor of RoPE frequency divisors, one per pair of rotated dimensions."""
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


def float32_value(value) -> float:
    """GGUF stores these as float32: 1e-5 comes back as 9.99999974e-06. Take the shortest decimal that
    rounds to the same float32, which is what config.json said."""
    return float(str(np.float32(value)))


# llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE values ({arch}.expert_gating_func) -> perfx.config's gating
GGUF_GATINGS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


def gguf_experts(h: GGUFHeader, gating: str, norm: bool) -> dict:
    """The mixture-of-experts fields of a GGUF header (``perfx.moe``): expert_count, expert_used_count,
    expert_feed_forward_length, expert_gating_func (``gating`` where absent), expert_weights_scale,
    leading_dense_block_count, and whether layers hold a selection bias. ``norm``: whether llama.cpp's graph of the
    architecture renormalises the chosen weights (build_moe_ffn's norm_w, fixed per architecture there)."""
    count, used = int(h.key("expert_count")), int(h.key("expert_used_count"))
    code = h.value("expert_gating_func")
    if code is not None and int(code) not in GGUF_GATINGS:
        raise PerfxError(f"GGUF {h.arch}.expert_gating_func = {code}: perfx runs {GGUF_GATINGS} "
                         "(llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE)")
    dense = int(h.value("leading_dense_block_count", 0))
    # llama.cpp's qwen3moe without the key: feed_forward_length / expert_used_count
    width = h.value("expert_feed_forward_length") or int(h.key("feed_forward_length")) // max(used, 1)
    bias = any(name.endswith(".exp_probs_b.bias") for name in h.reader.tensors)
    return dict(n_experts=count, n_experts_used=used, expert_intermediate=int(width),
                expert_gating=gating if code is None else GGUF_GATINGS[int(code)],
                expert_norm=norm,
                expert_scale=float32_value(h.value("expert_weights_scale", 1.0)) or 1.0,
                expert_bias=bias, dense_layers=dense)
