"""Where perfx's files live, and how it reads and writes JSON ones.

``kernels/`` and ``tuning/`` sit at the top of the repository and are installed as the packages
``perfx.kernels`` and ``perfx.tuning``; nothing in perfx looks for them relative to the current
directory. Downloads, tuning results and logs go to the user's cache (``cache_dir``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from importlib import resources
from pathlib import Path

from perfx.errors import PerfxError


def kernel_path(name: str) -> Path:
    """Path of an OpenCL source in ``kernels/``, e.g. ``kernel_path("gemv_q4_rows.cl")``."""
    path = Path(str(resources.files("perfx.kernels").joinpath(name)))
    if not path.is_file():
        raise FileNotFoundError(f"perfx kernel source {name!r} not found in {path.parent}")
    return path


def kernel_source(name: str) -> str:
    return kernel_path(name).read_text()


def tuning_path(name: str = "") -> Path:
    """Path inside ``tuning/`` (the shipped specs and tuning database)."""
    return Path(str(resources.files("perfx.tuning").joinpath(name)))


def cache_dir() -> Path:
    """Where perfx keeps downloads, tuning results and logs: ``$PERFX_CACHE``, else the platform's user cache."""
    override = os.environ.get("PERFX_CACHE")
    if override:
        return Path(override).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    elif os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    else:
        # Linux and Android (Termux): the XDG base-directory spec ignores relative paths.
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "perfx"


def read_json(path: Path | str, default=None):
    """The JSON value in ``path``. A missing file gives ``default`` where one is given, else a PerfxError;
    an unreadable or invalid one always gives a PerfxError that names the file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if default is not None:
            return default
        raise PerfxError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PerfxError(f"{path} could not be read ({error}); the file is corrupt or truncated: fetch it "
                         "again") from None
    try:
        return json.loads(text)
    except ValueError as error:
        raise PerfxError(f"{path} is not valid JSON ({error}); the file is corrupt or truncated: fetch it "
                         "again") from None


def write_atomic(path: Path | str, text: str) -> None:
    """Write a file so that it is either the old one or the whole new one, even if killed midway."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                         delete=False, encoding="utf-8")
    try:
        with handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(handle.name, 0o644)  # a temporary file is created 0600; nothing perfx writes is secret
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path | str, data) -> None:
    write_atomic(path, json.dumps(data, indent=1, ensure_ascii=False, allow_nan=False) + "\n")
