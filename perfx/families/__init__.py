"""The architectures perfx runs, one family file each (``perfx/families/<arch>.py``), and the reading they share.

A module of this package that defines ``FAMILY = Family(...)`` (``perfx.families.family``) registers it, so
adding an architecture is adding its file, with no list to edit (docs/families.md). ``FAMILIES`` holds them by
name in ``Family.order``; ``family_of`` finds one by any name a file gives its architecture (GGUF
general.architecture or Hugging Face model_type). ``gguf_values`` and ``hf_values`` read what every
architecture shares, then hand the family's reader the rest: their result is ``ModelConfig``'s fields.
"""

from __future__ import annotations

import importlib
import pkgutil

from perfx.errors import PerfxError
from perfx.families.family import Family, GGUFHeader, HFConfig, Rope, factor_table, float32_value, header_key
from perfx.gguf_file import GGUFFile

BASE_MODULE = "family"   # the package's one module that is not a family file


def discover_families(package: str = __name__) -> dict[str, Family]:
    """name -> Family for the ``FAMILY`` of every module of ``package`` (but ``family``), in ``Family.order``;
    two families may not claim one name (a GGUF architecture or a model_type)."""
    found: dict[str, Family] = {}
    claimed: dict[str, str] = {}
    for info in sorted(pkgutil.iter_modules(importlib.import_module(package).__path__), key=lambda m: m.name):
        if info.name == BASE_MODULE:
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, Family):
            raise PerfxError(f"{module.__name__} defines no FAMILY = Family(...): every module of {package} but "
                             f"{BASE_MODULE} is one architecture's family file")
        if family.name in found:
            raise PerfxError(f"two families named {family.name!r} (the second in {module.__name__})")
        for name in dict.fromkeys(family.gguf_names + family.hf_names):
            other = claimed.setdefault(name, family.name)
            if other != family.name:
                raise PerfxError(f"families {other!r} and {family.name!r} both claim the architecture {name!r}")
        found[family.name] = family
    return dict(sorted(found.items(), key=lambda item: (item[1].order, item[0])))


FAMILIES: dict[str, Family] = discover_families()


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF general.architecture values perfx reads, family by family."""
    return tuple(name for f in FAMILIES.values() for name in f.gguf_names)


def hf_architectures() -> tuple[str, ...]:
    """The Hugging Face model_type values perfx reads, family by family."""
    return tuple(name for f in FAMILIES.values() for name in f.hf_names)


def family_of(architecture: str) -> Family:
    """The family that reads ``architecture`` (a GGUF general.architecture or a model_type)."""
    for family in FAMILIES.values():
        if architecture in family.gguf_names or architecture in family.hf_names:
            return family
    raise PerfxError(f"model architecture {architecture!r} is not supported; perfx runs "
                     f"{', '.join(hf_architectures())}")


# -- GGUF header --------------------------------------------------------------------------------------------

def gguf_values(reader: GGUFFile) -> dict:
    """``ModelConfig`` fields from an open GGUF file: the ``{arch}.*`` keys, vocabulary and head sizes, as
    llama.cpp reads them; the family's ``read_gguf`` adds its recipe."""
    arch = reader.value("general.architecture")
    known = gguf_architectures()
    if arch not in known:
        raise PerfxError(f"GGUF architecture {arch!r} is not supported; perfx reads GGUF files of "
                         f"architecture {', '.join(known)}")
    family = family_of(arch)

    def key(name, default=None):
        return header_key(reader, arch, name, default)

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
    elif scaling_type not in (None, "none") and not family.gguf_rope_scaling:
        raise PerfxError(f"GGUF rope scaling type {scaling_type!r} is not supported (supported: linear)")
    factors = _rope_freqs(reader, rotary)
    if factors is not None:
        scaling = dict(scaling or {"rope_type": "default"}, freq_factors=factors)
    theta = float32_value(key("rope.freq_base", 10000.0))
    window = int(reader.value(f"{arch}.attention.sliding_window") or 0)
    recipe = dict(rms_eps=float32_value(key("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=theta,
                  rope_scaling=scaling, sliding_window=window, rotary_dims=rotary)
    rope = Rope(theta, rotary, scaling)
    recipe.update(family.read_gguf(GGUFHeader(reader, arch, n_layers, hidden, n_heads, head_dim, rotary, theta,
                                              window, rope)))
    n_kv_heads = recipe.pop("n_kv_heads", None)   # LFM2's: head_count_kv is per layer there
    common = dict(
        architecture=arch, vocab_size=int(vocab), hidden_size=hidden,
        # Gemma 4's feed_forward_length is per layer: its reader gives the widest
        intermediate_size=int(recipe.pop("intermediate_size", None) or key("feed_forward_length")), n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=int(n_kv_heads or key("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        max_positions=int(key("context_length", 4096)),
        tie_embeddings="output.weight" not in reader.tensors,
        qkv_bias=any(name in reader.tensors for name in ("blk.0.attn_q.bias", "blk.0.attn_qkv.bias")),
    )
    return {**common, **recipe}


def _rope_freqs(reader: GGUFFile, rotary: int) -> list[float] | None:
    """Llama 3.x GGUFs carry their "llama3" rope scaling as a tensor, rope_freqs.weight: one float32 divisor
    of the inverse frequencies per pair of rotated dimensions (llama.cpp's freq_factors of ggml_rope_ext),
    None when absent."""
    tensor = reader.tensors.get("rope_freqs.weight")
    return None if tensor is None else factor_table(tensor, "rope_freqs.weight", rotary)


def _embedding_rows(reader: GGUFFile) -> int:
    if "token_embd.weight" in reader.tensors:
        return reader.tensors["token_embd.weight"].shape[-1]
    raise PerfxError("GGUF has neither a vocabulary size nor a token_embd.weight tensor")


# -- Hugging Face config.json -------------------------------------------------------------------------------

def hf_values(config: dict) -> dict:
    """``ModelConfig`` fields from the dict of a Hugging Face ``config.json`` (of a multimodal checkpoint,
    its text model's); the family's ``read_hf`` adds its recipe."""
    architecture = config.get("model_type")
    known = hf_architectures()
    family = family_of(architecture) if architecture in known else None
    if family is not None and architecture in family.hf_multimodal:
        architecture, config = family.hf_multimodal[architecture](config)
    if family is None:
        named = config.get("architectures") or []
        raise PerfxError(f"model_type {architecture!r} {named} is not supported; perfx runs "
                         f"{', '.join(known)} models")
    try:
        hidden = int(config["hidden_size"])
        n_heads = int(config["num_attention_heads"])
        values = dict(vocab_size=int(config["vocab_size"]), n_layers=int(config["num_hidden_layers"]))
        inter = config.get("intermediate_size")
        if inter is not None:   # Gemma 3n lists one per layer (all alike in its releases): the widest
            values["intermediate_size"] = int(max(inter) if isinstance(inter, list) else inter)
    except KeyError as error:
        raise PerfxError(f"config.json lacks {error.args[0]!r}, which every {architecture} config "
                         "has; the file is incomplete") from None
    n_layers = values["n_layers"]
    n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    head_dim = int(config.get("head_dim") or family.hf_head_dim or hidden // n_heads)
    window = int(config.get("sliding_window") or 0)
    theta, scaling, local_theta = _hf_rope(config)
    recipe = dict(rms_eps=float(config.get("rms_norm_eps", config.get("norm_eps", family.hf_rms_eps))),
                  rope_theta=theta, rope_scaling=scaling, sliding_window=window,
                  qkv_bias=bool(config.get("attention_bias", False)))
    recipe.update(family.read_hf(HFConfig(config, architecture, n_layers, hidden, head_dim, theta, scaling,
                                          local_theta, window, Rope(theta, head_dim, scaling))))
    if "intermediate_size" not in values and "intermediate_size" not in recipe:
        # Qwen3.5-MoE's has none: its reader gives the shared expert's width
        raise PerfxError(f"config.json lacks 'intermediate_size', which every {architecture} config has; the file "
                         "is incomplete")
    # what the family's recipe gives overrides the common reading (Gemma 4: the widest layer's head_dim)
    return {**dict(
        architecture=architecture, hidden_size=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads,
        head_dim=head_dim, max_positions=int(config.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(config.get("tie_word_embeddings", config.get("tie_embedding", family.hf_tied))),
        **values), **recipe}


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
