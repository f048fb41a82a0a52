"""The tuning database: which parameters each kernel family uses on a device, for a shape.

JSON files, one per device in the user's cache (``<cache>/tuning/``, ``PERFX_CACHE`` moves it) plus
the read-only files shipped in ``tuning/database/``. Every file says what it applies to (``match``):
one device (its fingerprint: platform, device name, OpenCL C version, driver version), an
architecture (``caps.architecture``, e.g. "adreno-7xx") or a vendor (``caps.vendor_key``). A device
file also names its device's architecture and vendor, so a measured record serves other devices of
the same architecture or vendor at those levels.

A record holds one (family, shape): the best parameters, the defaults' time and every candidate
tried with its outcome (time and spread, or why it was rejected), so an interrupted sweep resumes
without re-timing anything. Measured records carry the sha256 of the kernel source they were
measured with; a record whose source changed is stale and ignored. Hand-written (reasoned) records
have no hash and ``shape: null`` (any shape): what they ask for is checked with ``spec.why_invalid``.

Look-up falls back device → architecture → vendor → the spec's defaults; within a level, a shape
matches exactly except its size keys ("m" by nearest M bucket, "positions" by nearest on a log scale).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from perfx.errors import PerfxError

FORMAT = 1
LEVELS = ("device", "architecture", "vendor")

# Prompt lengths (M) of the GEMM path are tuned per bucket; ``None`` is open-ended.
M_BUCKETS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 256), (257, None))
# Shape keys matched by nearest rather than exactly.
SIZE_KEYS = ("m", "positions")


class TuningDatabaseWarning(UserWarning):
    """A database file could not be read; it was set aside and the rest of the database is used."""


@dataclass(frozen=True)
class Choice:
    params: dict
    source: str      # "device", "architecture", "vendor" or "default"
    detail: str      # which file and record, or why nothing matched
    time_s: float | None = None  # the tuned median time, where a measurement stands behind the choice


def m_bucket(m: int) -> int:
    """Index in ``M_BUCKETS`` of the bucket holding M."""
    for i, (low, high) in enumerate(M_BUCKETS):
        if m >= low and (high is None or m <= high):
            return i
    raise ValueError(f"M = {m} must be at least 1")


def bucket_representative(index: int) -> int:
    """The M tuned for a bucket: the geometric middle, 512 for the open bucket."""
    low, high = M_BUCKETS[index]
    return 512 if high is None else max(low, round(math.sqrt(low * high)))


def source_hash(spec) -> str:
    """sha256 of the family's kernel file: what a measured record is pinned to."""
    return _source_hash(spec.source)


@lru_cache(maxsize=None)
def _source_hash(source: str) -> str:
    from perfx.resources import kernel_source
    return hashlib.sha256(kernel_source(source).encode()).hexdigest()


def normal(value):
    """JSON's view of a value: tuples become lists, so shapes compare the same before and after a save."""
    return json.loads(json.dumps(value))


def shape_key(shape: dict | None) -> str:
    return "*" if shape is None else json.dumps(normal(shape), sort_keys=True)


def params_key(params: dict) -> str:
    return json.dumps(normal(params), sort_keys=True)


def fingerprint_slug(fingerprint: dict) -> str:
    text = f"{fingerprint.get('platform', '')}-{fingerprint.get('device', '')}"
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:48]
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:10]
    return f"{slug}-{digest}"


def write_json_atomic(path: Path, data) -> None:
    """Write JSON so that the file is either the old one or the whole new one, even if killed midway."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", suffix=".tmp",
                                         delete=False, encoding="utf-8")
    try:
        with handle:
            json.dump(data, handle, indent=1, sort_keys=False, allow_nan=False)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(handle.name, 0o644)  # a temporary file is created 0600; the database is not secret
        os.replace(handle.name, path)
    except BaseException:
        Path(handle.name).unlink(missing_ok=True)
        raise


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _validate(data, path: Path) -> str | None:
    """None when ``data`` is a database file we can use, else what is wrong with it."""
    if not isinstance(data, dict):
        return "not a JSON object"
    if data.get("perfx_tuning") != FORMAT:
        return f"perfx_tuning format {data.get('perfx_tuning')!r}, expected {FORMAT}"
    match = data.get("match")
    if not isinstance(match, dict) or len(match) != 1 or next(iter(match)) not in LEVELS:
        return "'match' must name exactly one of device, architecture, vendor"
    if "device" in match and not isinstance(match["device"], dict):
        return "'match.device' must be a fingerprint object"
    records = data.get("records")
    if not isinstance(records, list):
        return "'records' must be a list"
    for i, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("family"), str):
            return f"record {i} has no family"
        if not isinstance(record.get("shape"), (dict, type(None))):
            return f"record {i}: shape must be an object or null"
        if not isinstance(record.get("params"), (dict, type(None))):
            return f"record {i}: params must be an object or null"
        if not isinstance(record.get("candidates", []), list):
            return f"record {i}: candidates must be a list"
    return None


class DatabaseFile:
    """One JSON file of the database, read into memory."""

    def __init__(self, path: Path, data: dict, writable: bool):
        self.path, self.data, self.writable = Path(path), data, writable

    @property
    def level(self) -> str:
        return next(iter(self.data["match"]))

    @property
    def records(self) -> list[dict]:
        return self.data["records"]

    def level_for(self, device) -> str | None:
        """The most specific level at which this file applies to ``device``, None if it does not."""
        match, caps = self.data["match"], device.caps
        if "device" in match:
            if match["device"] == device.fingerprint:
                return "device"
            if self.data.get("architecture") == caps.architecture:
                return "architecture"
            return "vendor" if self.data.get("vendor") == caps.vendor_key else None
        if "architecture" in match:
            return "architecture" if match["architecture"] == caps.architecture else None
        return "vendor" if match["vendor"] == caps.vendor_key else None

    def find(self, family: str, shape: dict | None) -> dict | None:
        key = shape_key(shape)
        for record in self.records:
            if record["family"] == family and shape_key(record.get("shape")) == key:
                return record
        return None

    def save(self):
        if not self.writable:
            raise PerfxError(f"{self.path} is a shipped tuning file and is not written to")
        self.data["updated"] = _now()
        write_json_atomic(self.path, self.data)


def read_file(path: Path, writable: bool) -> DatabaseFile | None:
    """A database file, or None (with a warning) when it is unreadable; a corrupt one is set aside."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        problem = _validate(data, path)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        problem = f"{type(e).__name__}: {e}"
    if problem is None:
        return DatabaseFile(path, data, writable)
    message = f"tuning database file {path} is unreadable ({problem})"
    if writable:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        aside = path.with_name(f"{path.name}.corrupt-{stamp}")
        try:
            os.replace(path, aside)
            message += f"; set aside as {aside.name}, its entries will be re-tuned"
        except OSError as e:
            message += f"; could not set it aside ({e}): move or delete it by hand"
    else:
        message += "; ignored (it ships with perfx: reinstall perfx)"
    warnings.warn(message, TuningDatabaseWarning, stacklevel=3)
    return None


def _size_distance(key: str, want, have) -> tuple:
    if key == "m":
        return (abs(m_bucket(int(want)) - m_bucket(int(have))), abs(math.log(want / have)))
    return (0, abs(math.log(max(want, 1) / max(have, 1))))


def shape_distance(want: dict, have: dict | None) -> tuple | None:
    """How far a record's shape is from the one wanted; None when it does not match at all."""
    if have is None:
        return (math.inf, math.inf)  # a shape-less record matches anything, last
    want, have = normal(want), normal(have)
    if {k: v for k, v in want.items() if k not in SIZE_KEYS} != {k: v for k, v in have.items()
                                                                 if k not in SIZE_KEYS}:
        return None
    distance = (0, 0.0)
    for key in SIZE_KEYS:
        if (key in want) != (key in have):
            return None
        if key in want:
            d = _size_distance(key, want[key], have[key])
            distance = (distance[0] + d[0], distance[1] + d[1])
    return distance


class Database:
    """The user's tuning files (one per device, written) and the shipped ones (read only).

    Files are re-read when they change on disk, so a sweep in another process is seen.
    """

    def __init__(self, user_dir: Path | str | None = None, shipped_dir: Path | str | None = None):
        if user_dir is None:
            from perfx.default_model import cache_dir
            user_dir = cache_dir() / "tuning"
        if shipped_dir is None:
            from perfx.resources import tuning_path
            shipped_dir = tuning_path("database")
        self.user_dir, self.shipped_dir = Path(user_dir), Path(shipped_dir)
        self._cache: dict[Path, tuple] = {}

    # -- files ---------------------------------------------------------------------------------

    def _load(self, path: Path, writable: bool) -> DatabaseFile | None:
        try:
            stat = path.stat()
        except OSError:
            return None
        stamp = (stat.st_mtime_ns, stat.st_size)
        cached = self._cache.get(path)
        if cached and cached[0] == stamp:
            return cached[1]
        loaded = read_file(path, writable)
        if loaded is not None:
            self._cache[path] = (stamp, loaded)
        return loaded

    def files(self) -> list[DatabaseFile]:
        """User files first, then shipped ones (so a user's measurement wins at the same level)."""
        result = []
        for directory, writable in ((self.user_dir, True), (self.shipped_dir, False)):
            if directory.is_dir():
                for path in sorted(directory.glob("*.json")):
                    loaded = self._load(path, writable)
                    if loaded is not None:
                        result.append(loaded)
        return result

    def device_path(self, fingerprint: dict) -> Path:
        return self.user_dir / f"{fingerprint_slug(fingerprint)}.json"

    def device_file(self, device) -> DatabaseFile:
        """This device's own (writable) file, created in memory when there is none yet."""
        path = self.device_path(device.fingerprint)
        loaded = self._load(path, True) if path.exists() else None
        if loaded is None:
            loaded = DatabaseFile(path, {
                "perfx_tuning": FORMAT, "match": {"device": device.fingerprint},
                "architecture": device.caps.architecture, "vendor": device.caps.vendor_key,
                "created": _now(), "records": []}, True)
        return loaded

    def _saved(self, file: DatabaseFile):
        file.save()
        stat = file.path.stat()
        self._cache[file.path] = ((stat.st_mtime_ns, stat.st_size), file)

    # -- what the tuner writes -----------------------------------------------------------------

    def tuning_record(self, device, spec, shape: dict) -> dict:
        """The device's record of (family, shape) for the current kernel source; a stale one is reset."""
        file = self.device_file(device)
        record = file.find(spec.family, shape)
        current = source_hash(spec)
        if record is not None and record.get("source_hash") != current:
            file.records.remove(record)
            record = None
        if record is None:
            record = {"family": spec.family, "shape": normal(shape), "source_hash": current, "params": None,
                      "complete": False, "candidates": []}
            file.records.append(record)
        return record

    def save_record(self, device, record: dict):
        """Write the device's file (atomically) after ``record`` (from ``tuning_record``) changed."""
        file = self.device_file(device)
        if not any(r is record for r in file.records):
            existing = file.find(record["family"], record.get("shape"))
            if existing is not None:
                file.records.remove(existing)
            file.records.append(record)
        record["updated"] = _now()
        self._saved(file)

    # -- look-up -------------------------------------------------------------------------------

    def _matches(self, device, spec, shape: dict):
        """(level index, distance, file, record) of every usable record for this family and shape."""
        current = source_hash(spec)
        found = []
        for file in self.files():
            level = file.level_for(device)
            if level is None:
                continue
            for record in file.records:
                if record["family"] != spec.family or not record.get("params"):
                    continue
                pinned = record.get("source_hash")
                if pinned is not None and pinned != current:
                    continue  # measured with another kernel source: stale
                distance = shape_distance(shape, record.get("shape"))
                if distance is not None:
                    found.append((LEVELS.index(level), distance, file, record))
        found.sort(key=lambda item: (item[0], item[1]))
        return found

    def lookup(self, device, family, shape: dict) -> Choice:
        """The parameters to use for ``family`` (a name or a Spec) at ``shape`` on ``device``, and their source."""
        spec = family if hasattr(family, "space") else _spec(family)
        family = spec.family
        rejected = []
        for _, _, file, record in self._matches(device, spec, shape):
            params = {**spec.defaults(), **record["params"]}
            why = _outside_space(spec, params) or spec.why_invalid(params, shape, device.caps)
            level = file.level_for(device)
            if why is None:
                what = "shape *" if record.get("shape") is None else spec.describe(record["shape"])
                return Choice(params, level, f"{file.path.name}: {family} {what}", record.get("time_s"))
            rejected.append(f"{file.path.name} ({level}): {why}")
        detail = "no tuned entry" + (f"; skipped {'; '.join(rejected)}" if rejected else "")
        return Choice(spec.defaults(), "default", detail)

    def entries_in_force(self, device) -> list[dict]:
        """Every record that applies to this device, the level it applies at, and whether it is stale."""
        rows = []
        hashes = {}
        all_specs = _specs()
        for file in self.files():
            level = file.level_for(device)
            if level is None:
                continue
            for record in file.records:
                family = record["family"]
                spec = all_specs.get(family)
                note = ""
                if spec is None:
                    note = "ignored: no such kernel family"
                elif not record.get("params"):
                    note = "incomplete: no candidate verified yet"
                else:
                    if family not in hashes:
                        hashes[family] = source_hash(spec)
                    pinned = record.get("source_hash")
                    if pinned is not None and pinned != hashes[family]:
                        note = "stale: kernel source changed, will be re-tuned"
                shape = record.get("shape")
                rows.append({"family": family, "shape": shape,
                             "shape_text": "*" if shape is None or spec is None else spec.describe(shape),
                             "params": record.get("params"), "level": level, "file": str(file.path),
                             "time_s": record.get("time_s"), "note": note})
        rows.sort(key=lambda r: (r["family"], LEVELS.index(r["level"]), r["shape_text"]))
        return rows

    # -- sharing -------------------------------------------------------------------------------

    def export(self, device, path: Path | str) -> int:
        """Write this device's measured records to ``path`` (same format); returns how many."""
        file = self.device_file(device)
        write_json_atomic(Path(path), file.data)
        return len(file.records)

    def import_file(self, path: Path | str) -> tuple[Path, int]:
        """Merge a file from ``export`` into the user database; a record replaces the same one here."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise PerfxError(f"cannot import {path}: {type(e).__name__}: {e}") from e
        problem = _validate(data, path)
        if problem:
            raise PerfxError(f"cannot import {path}: not a perfx tuning file ({problem})")
        match = data["match"]
        if "device" in match:
            target = self.device_path(match["device"])
        else:
            level, value = next(iter(match.items()))
            target = self.user_dir / f"{level}-{re.sub(r'[^a-z0-9]+', '-', str(value).lower())}.json"
        existing = self._load(target, True) if target.exists() else None
        merged = existing.data if existing is not None else {k: v for k, v in data.items() if k != "records"}
        merged.setdefault("records", [])
        keys = {(r["family"], shape_key(r.get("shape"))) for r in data["records"]}
        merged["records"] = [r for r in merged["records"] if (r["family"], shape_key(r.get("shape"))) not in keys]
        merged["records"].extend(data["records"])
        file = DatabaseFile(target, merged, True)
        self._saved(file)
        return target, len(data["records"])


def _outside_space(spec, params: dict) -> str | None:
    for name, value in params.items():
        if name in spec.space and normal(value) not in [normal(v) for v in spec.space[name]]:
            return f"{name}={value} is not one of {list(spec.space[name])}"
    return None


def _specs() -> dict:
    from perfx.tuning import specs
    return specs()


def _spec(family: str):
    all_specs = _specs()
    if family not in all_specs:
        raise PerfxError(f"unknown kernel family {family!r}; known: {', '.join(all_specs)}")
    return all_specs[family]


_default: dict[str, Database] = {}


def default_database() -> Database:
    """The process's database, for the cache dir in force (``PERFX_CACHE`` read each time)."""
    from perfx.default_model import cache_dir
    key = str(cache_dir())
    if key not in _default:
        _default[key] = Database()
    return _default[key]


def lookup(device, family, shape: dict) -> Choice:
    """Parameters for ``family`` at ``shape`` on ``device``: device → architecture → vendor → defaults."""
    return default_database().lookup(device, family, shape)


def entries_in_force(device) -> list[dict]:
    """The database records that apply to ``device`` (for `perfx info`), stale ones marked."""
    return default_database().entries_in_force(device)
