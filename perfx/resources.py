"""Where the kernel sources and tuning data live, installed or in a source checkout.

``kernels/`` and ``tuning/`` sit at the top of the repository and are installed as the packages
``perfx.kernels`` and ``perfx.tuning``; nothing in perfx looks for them relative to the current
directory.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def kernel_path(name: str) -> Path:
    """Path of an OpenCL source in ``kernels/``, e.g. ``kernel_path("gemv_q4.cl")``."""
    path = Path(str(resources.files("perfx.kernels").joinpath(name)))
    if not path.is_file():
        raise FileNotFoundError(f"perfx kernel source {name!r} not found in {path.parent}")
    return path


def kernel_source(name: str) -> str:
    return kernel_path(name).read_text()


def tuning_path(name: str = "") -> Path:
    """Path inside ``tuning/`` (the shipped specs and tuning database)."""
    return Path(str(resources.files("perfx.tuning").joinpath(name)))
