"""The tuning database: which parameters each kernel family uses on a device, for a shape.

Results files (what is looked up) hold one compact record per (family, shape): the parameters chosen,
their time, GB/s or GFLOP/s, the defaults' time, the gain over the defaults with its 95% interval from
the tuner's interleaved confirmation rounds, the kernel source hash and the device. They come
from two places: perfx's shipped files (``tuning/database/``, read only) and the user's own
(``<cache>/tuning/<device>.json``, written by `perfx tune` and `--import`). Each file says what it
applies to (``match``): one device (its fingerprint: platform, device name, OpenCL C version, driver
version), an architecture (``caps.architecture``, e.g. "adreno-7xx") or a vendor (``caps.vendor_key``).
A device file also names its device's architecture and vendor, so its records serve other devices
of the same architecture or vendor at those levels.

The tuner's resume log (every candidate tried, its time and samples, or why it was rejected) is kept
apart, in ``<cache>/tuning/log/<device>.json``: it is how an interrupted sweep resumes without re-timing
anything, and what ``merge`` uses where it has it; no look-up reads it (kernel_tuner's cache file and
CLBlast's raw tuner output are kept apart from their results in the same way).

Measured records carry the sha256 of the kernel code they were measured with (comments left out, so
editing one stales nothing); a record whose code changed is stale and ignored. Hand-written (reasoned) records have no hash and ``shape: null``
(any shape). Look-up falls back device → architecture → vendor → the defaults; within a level, a
shape matches exactly except its size keys ("m" by nearest M bucket, "positions" by nearest on a log
scale). A record whose parameters do not fit the shape or device is skipped for the next one, and
the reason is kept in the ``Choice`` (`perfx info` shows it).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import re
import statistics
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from perfx.errors import PerfxError
from perfx.kernels import code_only
from perfx.ops.params import Checked
from perfx.resources import cache_dir, kernel_source, read_json, tuning_path, write_atomic, write_json_atomic

FORMAT = 2
LOG_FORMAT = 1
LEVELS = ("device", "architecture", "vendor")

# Prompt lengths (M) of the GEMM path are tuned per bucket; ``None`` is open-ended.
M_BUCKETS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 256), (257, None))
# Buckets of up to this many rows: a family the plan compares with others of its product (``Spec.kinds``) is timed
# at each M of ``served_ms``, not at the representative alone (the remainder of M over a kernel's rows a pass is
# most of its work there, so which kind is fastest changes with M inside the bucket); above it, full passes are.
SERVED_UP_TO = 16
# Shape keys matched by nearest rather than exactly.
SIZE_KEYS = ("m", "positions")
# The fields of a results record, in the order they are written.
RECORD_FIELDS = ("family", "shape", "params", "time_s", "served_times_s", "default_time_s", "gain", "gain_interval",
                 "rounds", "gb_per_s", "gflop_per_s", "source_hash", "device", "devices", "comment")


class TuningDatabaseWarning(UserWarning):
    """A database file could not be read; it was set aside and the rest of the database is used."""


@dataclass(frozen=True)
class Choice:
    params: Checked  # checked for the shape it was looked up by, on this device
    source: str      # "device", "architecture", "vendor" or "default"
    detail: str      # which file and record, or why nothing matched
    time_s: float | None = None  # the tuned median time, where a measurement stands behind the choice
    skipped: tuple[str, ...] = ()  # records that matched but did not fit, each with the reason
    exact: bool = False  # the record was measured at the very shape looked up (time_s is that shape's)
    file: str = ""       # the results file the record came from ("" for the defaults)
    served: dict = field(default_factory=dict)   # M -> the record's time there, at each M of ``served_ms`` it has


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


def served_ms(m: int) -> tuple[int, ...]:
    """The Ms of m's bucket a family compared by kind is timed at (``SERVED_UP_TO``): the bucket's least, its
    representative and its most where it holds few rows (2, 3, 4: the batched decode steps of 2 to 4 sequences and
    the shortest prompts), else the representative alone."""
    index = m_bucket(m)
    low, high = M_BUCKETS[index]
    representative = bucket_representative(index)
    if high is None or high > SERVED_UP_TO:
        return (representative,)
    return tuple(sorted({low, representative, high}))


def served_times(record: dict) -> dict[int, float]:
    """M -> time of a record's ``served_times_s``, where it has them (read from JSON, whose keys are text)."""
    return {int(m): float(t) for m, t in (record.get("served_times_s") or {}).items()}


def measured_on_current_source(spec, record: dict) -> bool:
    """Whether a measured record is pinned to the family's current kernel code (``_pin``)."""
    return _pin(record, spec) == source_hash(spec)


def unserved(spec, record: dict) -> bool:
    """Whether a record of a family compared by kind (``Spec.compared_kind``) lacks its times at the Ms its
    bucket serves (``served_ms``): measured before they were taken, or by a search cut short."""
    shape = record.get("shape") or {}
    return (spec.compared_kind and "m" in shape and len(served_ms(shape["m"])) > 1
            and set(served_times(record)) != set(served_ms(shape["m"])))


def source_hash(spec) -> str:
    """sha256 of the code (comments and whitespace runs left out, ``perfx.kernels.code_only``) of the family's
    kernel files (one, or one per variant) and the headers they include: what a measured record is pinned to.
    A comment may be edited without making any record stale; a change to the code makes them all stale."""
    return _source_hash(spec.params.sources)


def _family_files(sources: tuple[str, ...], strip: bool) -> list[str]:
    """Each file, then the headers it includes from kernels/ (gpu.h, q4.h, and theirs), each once: a change to
    any of them makes the family's records stale. ``strip``: an ``#include`` inside a comment is no include."""
    seen: list[str] = []

    def add(name: str):
        if name not in seen:
            seen.append(name)
            for header in re.findall(r'#include "([^"]+)"', _code(name) if strip else kernel_source(name)):
                add(header)
    for source in sources:
        add(source)
    return seen


@lru_cache(maxsize=None)
def _code(name: str) -> str:
    """A kernel file's code alone (``perfx.kernels.code_only``), read once: headers are shared by families."""
    return code_only(kernel_source(name))


@lru_cache(maxsize=None)
def _source_hash(sources: tuple[str, ...]) -> str:
    text = "\n".join(_code(name) for name in _family_files(sources, True))
    return hashlib.sha256(text.encode()).hexdigest()


@lru_cache(maxsize=None)
def legacy_source_hash(sources: tuple[str, ...]) -> str:
    """The hash records were pinned to before the code-only hash: sha256 of the files' full text, comments
    included. A record of a user's own database still carrying it is upgraded when it is read (``_pin``)."""
    return hashlib.sha256("".join(kernel_source(name) for name in _family_files(sources, False)).encode()).hexdigest()


@lru_cache(maxsize=None)
def _legacy_hashes() -> dict[str, str]:
    """legacy (full-text) hash -> code-only hash of every family's sources as they were when the hash changed
    (``legacy_hashes.json``): a record measured then, before the comments were edited, is upgraded when the
    code it was measured with is still the code."""
    table = read_json(tuning_path("legacy_hashes.json"), default={})
    return dict(table.get("hashes", {}))


def _pin(record: dict, spec) -> str | None:
    """The source hash ``record`` is pinned to, a legacy full-text hash of the current code upgraded to the
    current hash (in place, so the next save of a user's file writes the new hash)."""
    pinned = record.get("source_hash")
    if pinned is None:
        return None
    current = source_hash(spec)
    if pinned != current and (_legacy_hashes().get(pinned) == current
                              or pinned == legacy_source_hash(spec.params.sources)):
        record["source_hash"] = pinned = current
    return pinned


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


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def results_json(data: dict) -> str:
    """A results file as text: the header indented, then one record per line (compact, diff-friendly)."""
    head = {k: v for k, v in data.items() if k != "records"}
    lines = json.dumps(head, indent=1, ensure_ascii=False, allow_nan=False)[:-2]
    records = [json.dumps({k: r[k] for k in RECORD_FIELDS if r.get(k) is not None}, ensure_ascii=False,
                          allow_nan=False) for r in data.get("records", [])]
    body = ",\n  ".join(records)
    return f'{lines},\n "records": [\n  {body}\n ]\n}}\n' if records else f'{lines},\n "records": []\n}}\n'


def _validate(data) -> str | None:
    """None when ``data`` is a results file we can use, else what is wrong with it."""
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
        if not isinstance(record.get("params"), dict):
            return f"record {i}: params must be an object"
    return None


class ResultsFile:
    """One results file of the database, read into memory."""

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
        return next((r for r in self.records if r["family"] == family and shape_key(r.get("shape")) == key), None)

    def put(self, record: dict):
        """Add ``record``, replacing the one of the same family and shape."""
        old = self.find(record["family"], record.get("shape"))
        if old is not None:
            self.records.remove(old)
        self.records.append(record)

    def save(self):
        if not self.writable:
            raise PerfxError(f"{self.path} is a shipped tuning file and is not written to")
        self.data["updated"] = _now()
        write_atomic(self.path, results_json(self.data))


def _set_aside(path: Path, message: str) -> str:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    try:
        os.replace(path, aside)
        return message + f"; set aside as {aside.name}, its entries will be re-tuned"
    except OSError as e:
        return message + f"; could not set it aside ({e}): move or delete it by hand"


def read_results(path: Path, writable: bool) -> ResultsFile | None:
    """A results file, or None (with a warning) when it is unreadable; a corrupt user file is set aside."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        problem = _validate(data)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        problem = f"{type(e).__name__}: {e}"
    if problem is None:
        return ResultsFile(path, data, writable)
    message = f"tuning database file {path} is unreadable ({problem})"
    if writable:
        message = _set_aside(path, message)
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


def result_record(spec, shape: dict, params: dict, time_s: float, default_time_s: float | None,
                  fingerprint: dict) -> dict:
    """A results record of a measured best, with its rate (GB/s and, where it computes, GFLOP/s)."""
    nbytes, flops = int(spec.bytes_moved(shape)), int(spec.flops(shape))
    return {"family": spec.params.family, "shape": normal(shape), "params": normal(params), "time_s": time_s,
            "default_time_s": default_time_s, "gb_per_s": round(nbytes / time_s / 1e9, 3),
            "gflop_per_s": round(flops / time_s / 1e9, 3) if flops else None,
            "source_hash": source_hash(spec), "device": fingerprint_slug(fingerprint)}


class TuningLog:
    """The tuner's resume log of one device: every candidate tried per (family, shape), as it came."""

    def __init__(self, path: Path, device):
        self.path = Path(path)
        self.data = {"perfx_tuning_log": LOG_FORMAT, "device": device.fingerprint,
                     "architecture": device.caps.architecture, "vendor": device.caps.vendor_key, "problems": []}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
                if data.get("perfx_tuning_log") != LOG_FORMAT or not isinstance(data.get("problems"), list):
                    raise ValueError(f"not a perfx tuning log of format {LOG_FORMAT}")
                self.data = data
            except (OSError, UnicodeDecodeError, ValueError) as e:
                warnings.warn(_set_aside(self.path, f"tuning log {self.path} is unreadable ({e})"),
                              TuningDatabaseWarning, stacklevel=2)

    def problem(self, spec, shape: dict) -> dict:
        """The log entry of (family, shape) for the current kernel source; a stale one is started again."""
        key, current = shape_key(shape), source_hash(spec)
        problems = self.data["problems"]
        family = spec.params.family
        entry = next((p for p in problems if p["family"] == family and shape_key(p["shape"]) == key), None)
        if entry is not None and _pin(entry, spec) != current:
            problems.remove(entry)
            entry = None
        if entry is None:
            entry = {"family": spec.params.family, "shape": normal(shape), "source_hash": current, "complete": False,
                     "candidates": []}
            problems.append(entry)
        return entry

    def save(self):
        """Compact: the whole log is written twice a candidate (before it runs, and with its outcome), so its cost
        grows with the square of a sweep's candidates, and an indented dump takes Python's pure-Python encoder."""
        self.data["updated"] = _now()
        write_atomic(self.path, json.dumps(self.data, ensure_ascii=False, allow_nan=False) + "\n")


class Database:
    """The user's results files (one per device, written) and the shipped ones (read only), plus the
    user's resume logs. Files are re-read when they change on disk, so a sweep in another process is seen.
    """

    def __init__(self, user_dir: Path | str | None = None, shipped_dir: Path | str | None = None,
                 enabled: bool = True):
        """``enabled`` False: no file is read, every look-up gives the defaults (PERFX_TUNING=off, --no-tuning)."""
        self.user_dir = Path(user_dir) if user_dir is not None else cache_dir() / "tuning"
        self.shipped_dir = Path(shipped_dir) if shipped_dir is not None else tuning_path("database")
        self.enabled = enabled
        self._cache: dict[Path, tuple] = {}

    # -- files ---------------------------------------------------------------------------------

    def _load(self, path: Path, writable: bool) -> ResultsFile | None:
        try:
            stat = path.stat()
        except OSError:
            return None
        stamp = (stat.st_mtime_ns, stat.st_size)
        cached = self._cache.get(path)
        if cached and cached[0] == stamp:
            return cached[1]
        loaded = read_results(path, writable)
        if loaded is not None:
            self._cache[path] = (stamp, loaded)
        return loaded

    def files(self) -> list[ResultsFile]:
        """User files first, then shipped ones (so a user's measurement wins at the same level)."""
        if not self.enabled:
            return []
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

    def log_path(self, fingerprint: dict) -> Path:
        return self.user_dir / "log" / f"{fingerprint_slug(fingerprint)}.json"

    def device_file(self, device) -> ResultsFile:
        """This device's own (writable) results file, created in memory when there is none yet."""
        path = self.device_path(device.fingerprint)
        loaded = self._load(path, True) if path.exists() else None
        if loaded is None:
            loaded = ResultsFile(path, {
                "perfx_tuning": FORMAT, "match": {"device": device.fingerprint},
                "architecture": device.caps.architecture, "vendor": device.caps.vendor_key,
                "created": _now(), "records": []}, True)
        return loaded

    def log(self, device) -> TuningLog:
        return TuningLog(self.log_path(device.fingerprint), device)

    # -- what this device's driver refused --------------------------------------------------------

    def refused_path(self, fingerprint: dict) -> Path:
        return self.user_dir / "refused" / f"{fingerprint_slug(fingerprint)}.json"

    def refused(self, device) -> dict[tuple, str]:
        """(family, params key, source hash) -> why, for each parameter set this device's driver refused
        (it did not build, or broke the kernel's own limits) when a model was loaded."""
        if not self.enabled:
            return {}
        entries = read_json(self.refused_path(device.fingerprint), default=[])
        return {(e["family"], params_key(e["params"]), _legacy_hashes().get(e.get("source_hash"), e.get("source_hash"))):
                e["reason"] for e in entries
                if isinstance(e, dict) and {"family", "params", "reason"} <= set(e)}

    def refuse(self, device, spec, params: dict, reason: str):
        """Remember that this driver refused ``params``: later loads skip them without building again."""
        path = self.refused_path(device.fingerprint)
        entries = read_json(path, default=[])
        entries.append({"family": spec.params.family, "params": normal(params), "source_hash": source_hash(spec),
                        "reason": reason, "when": _now()})
        write_json_atomic(path, entries)

    def save_result(self, device, record: dict):
        """Put a results record (``result_record``) into this device's file, written atomically."""
        file = self.device_file(device)
        file.put(record)
        self._saved(file)

    def _saved(self, file: ResultsFile):
        file.save()
        stat = file.path.stat()
        self._cache[file.path] = ((stat.st_mtime_ns, stat.st_size), file)

    # -- look-up -------------------------------------------------------------------------------

    def _applicable(self, device):
        """(level, file, record) of every record in the files that apply to this device."""
        for file in self.files():
            level = file.level_for(device)
            if level is not None:
                for record in file.records:
                    yield level, file, record

    def _matches(self, device, spec, shape: dict):
        """(level index, distance, file, record) of every usable record for this family and shape."""
        current = source_hash(spec)
        found = []
        for level, file, record in self._applicable(device):
            if record["family"] != spec.params.family:
                continue
            pinned = _pin(record, spec)
            if pinned is not None and pinned != current:
                continue  # measured with another kernel source: stale
            distance = shape_distance(shape, record.get("shape"))
            if distance is not None:
                found.append((LEVELS.index(level), distance, file, record))
        found.sort(key=lambda item: (item[0], item[1]))
        return found

    def choices(self, device, spec, shape: dict) -> list[Choice]:
        """Every parameter set that may run ``spec`` at ``shape`` on ``device``, most specific first: each
        fitting database record, then the defaults (or, where they do not fit, the first set that does).
        Sets this device's driver refused before are skipped, with the reason kept.

        This is where a set is checked on its way to a launch: each choice's ``params`` is a ``Checked`` set
        for this shape and device, which the wrappers take without checking again."""
        result, skipped = [], []
        refused = self.refused(device)
        current = source_hash(spec)

        def refusal(params):
            key = (spec.params.family, params_key(params))
            why = refused.get((*key, current)) or refused.get((*key, legacy_source_hash(spec.params.sources)))
            return f"refused by this driver: {why}" if why else None

        def checked(params):
            """(the Checked set, None), or (None, why it may not run here)."""
            why = spec.params.why_invalid(params, shape, device.caps) or refusal(params)
            return (None, why) if why else (Checked(params, spec.params, shape, device.caps), None)

        for _, distance, file, record in self._matches(device, spec, shape):
            level = file.level_for(device)
            params, why = checked({**spec.params.defaults(record["params"]), **record["params"]})
            if why is not None:
                skipped.append(f"{file.path.name} ({level}): {why}")
                continue
            if any(c.params == params for c in result):
                continue
            what = "shape *" if record.get("shape") is None else spec.describe(record["shape"])
            result.append(Choice(params, level, f"{file.path.name}: {spec.params.family} {what}",
                                 record.get("time_s"), tuple(skipped), exact=distance == (0, 0.0),
                                 file=str(file.path), served=served_times(record)))
        defaults, why = checked(spec.params.defaults())
        if why is not None:
            skipped.append(f"the defaults: {why}")
            defaults = next((p for p in spec.params.candidates(shape, device.caps) if refusal(p) is None), None)
        if defaults is not None and not any(c.params == defaults for c in result):
            detail = "no tuned entry fits" if skipped else "no tuned entry"
            result.append(Choice(defaults, "default", detail, None, tuple(skipped)))
        return result

    def sets_in_force(self, device, spec) -> list[dict]:
        """The distinct parameter sets this family's records that apply to ``device`` choose (stale ones left
        out), most specific level first: what the device runs once tuned, whatever the shape."""
        current, found = source_hash(spec), {}
        for level, file, record in sorted(self._applicable(device), key=lambda item: LEVELS.index(item[0])):
            if record["family"] != spec.params.family:
                continue
            pinned = _pin(record, spec)
            if pinned is not None and pinned != current:
                continue
            params = {**spec.params.defaults(record["params"]), **record["params"]}
            found.setdefault(params_key(params), params)
        return list(found.values())

    def entries_in_force(self, device, all_specs: dict) -> list[dict]:
        """Every record that applies to this device, the level it applies at, and whether it is stale."""
        rows = []
        hashes = {}
        refused = self.refused(device)
        for level, file, record in self._applicable(device):
            family = record["family"]
            spec = all_specs.get(family)
            note = ""
            if spec is None:
                note = "ignored: no such kernel family"
            else:
                if family not in hashes:
                    hashes[family] = source_hash(spec)
                pinned = _pin(record, spec)
                refusal = refused.get((family, params_key({**spec.params.defaults(record["params"]), **record["params"]}),
                                       hashes[family]))
                if pinned is not None and pinned != hashes[family]:
                    note = "stale: kernel source changed, will be re-tuned"
                elif refusal:
                    note = f"refused by this driver, the next choice runs instead: {refusal}"
            shape = record.get("shape")
            rows.append({"family": family, "shape": shape,
                         "shape_text": "*" if shape is None or spec is None else spec.describe(shape),
                         "params": record.get("params"), "level": level, "file": str(file.path),
                         "time_s": record.get("time_s"), "served": served_times(record), "note": note})
        rows.sort(key=lambda r: (r["family"], LEVELS.index(r["level"]), r["shape_text"]))
        return rows

    def stale_records(self, device, all_specs: dict) -> list[tuple]:
        """(spec, record) of every measured record that applies to this device but was measured on another
        kernel source, or of a family compared by kind timed at its bucket's representative alone (``unserved``),
        most specific level first, one per (family, shape): what `perfx tune --refresh` checks again. A shape
        this device's own file already holds a current record for is left out, so an interrupted refresh resumes
        where it stopped."""
        current = {name: source_hash(spec) for name, spec in all_specs.items()}

        def due(record) -> bool:
            spec = all_specs[record["family"]]
            return _pin(record, spec) != current[record["family"]] or unserved(spec, record)
        own = self.device_file(device)
        fresh = {(r["family"], shape_key(r.get("shape"))) for r in own.records
                 if r["family"] in all_specs and r.get("shape") is not None and not due(r)}
        found = []
        for level, file, record in self._applicable(device):
            family = record["family"]
            pinned = _pin(record, all_specs[family]) if family in all_specs else None
            if family not in all_specs or pinned is None or record.get("shape") is None or not due(record):
                continue
            found.append((LEVELS.index(level), all_specs[family], record))
        found.sort(key=lambda item: item[0])
        result, seen = [], set(fresh)
        for _, spec, record in found:
            key = (record["family"], shape_key(record["shape"]))
            if key not in seen:
                seen.add(key)
                result.append((spec, record))
        return result

    # -- sharing -------------------------------------------------------------------------------

    def export(self, device, path: Path | str) -> int:
        """Write this device's results (compact, the shipped format) to ``path``; returns how many records."""
        file = self.device_file(device)
        write_atomic(Path(path), results_json(file.data))
        return len(file.records)

    def import_file(self, path: Path | str) -> tuple[Path, int]:
        """Merge a results file (from ``export`` or ``merge``) into the user database; a record replaces
        the one of the same family and shape here."""
        path = Path(path)
        data = read_json(path)
        problem = _validate(data)
        if problem:
            raise PerfxError(f"cannot import {path}: not a perfx tuning results file ({problem})")
        match = data["match"]
        if "device" in match:
            target = self.device_path(match["device"])
        else:
            level, value = next(iter(match.items()))
            target = self.user_dir / f"{level}-{re.sub(r'[^a-z0-9]+', '-', str(value).lower())}.json"
        existing = self._load(target, True) if target.exists() else None
        file = existing or ResultsFile(target, {**{k: v for k, v in data.items() if k != "records"},
                                                "records": []}, True)
        for record in data["records"]:
            file.put(record)
        self._saved(file)
        return target, len(data["records"])


# -- merging many devices' results into architecture and vendor defaults ----------------------------


@dataclass
class _DeviceResults:
    slug: str
    architecture: str
    vendor: str
    best: dict = field(default_factory=dict)      # (family, shape key) -> record
    timings: dict = field(default_factory=dict)   # (family, shape key) -> {params key: time_s}


def _device_results(data: dict, origin: str) -> _DeviceResults:
    """One device's results (and candidate times, where a log or report brings them) from a file's data."""
    if data.get("perfx_tuning_log") == LOG_FORMAT:   # a resume log: every candidate's time
        fingerprint = data.get("device") or {}
        results = _DeviceResults(fingerprint_slug(fingerprint), data.get("architecture", ""), data.get("vendor", ""))
        for problem in data.get("problems", []):
            key = (problem["family"], shape_key(problem["shape"]))
            times = {params_key(c["params"]): c["time_s"] for c in problem.get("candidates", [])
                     if c.get("status") == "ok" and c.get("time_s")}
            if times:
                results.timings[key] = times
                best = min(times, key=times.get)
                results.best[key] = {"family": problem["family"], "shape": problem["shape"],
                                     "params": json.loads(best), "time_s": times[best],
                                     "source_hash": problem.get("source_hash")}
        return results
    problem = _validate(data)
    if problem or "device" not in data["match"]:
        raise PerfxError(f"cannot merge {origin}: " + (problem or "it is not one device's results (merge "
                                                       "takes device files from export, logs or reports)"))
    results = _DeviceResults(fingerprint_slug(data["match"]["device"]), data.get("architecture", ""),
                             data.get("vendor", ""))
    for record in data["records"]:
        results.best[(record["family"], shape_key(record.get("shape")))] = record
    return results


def merge(inputs: list[dict], level: str, min_devices: int = 2) -> list[dict]:
    """Architecture- or vendor-level results files from many devices' results, CLBlast's way.

    ``inputs`` are device results files (``export``), resume logs or `perfx report` tuning sections. Per
    (family, shape) within one architecture (or vendor), the parameters chosen are the best on average:
    among the sets timed on every device there (where logs bring every candidate's time), the one with
    the highest mean of (the device's best time / its time); where only each device's best is known, the
    set that is best on the most devices (ties: the faster mean relative time where known). A group with
    fewer than ``min_devices`` devices yields nothing: one machine's results do not speak for its vendor.
    """
    if level not in ("architecture", "vendor"):
        raise PerfxError(f"merge level must be architecture or vendor, not {level!r}")
    devices: dict[str, _DeviceResults] = {}
    for i, data in enumerate(inputs):
        results = _device_results(data, f"input {i + 1}")
        previous = devices.get(results.slug)
        if previous is not None:  # the same device twice (a report and an export): keep both halves
            previous.best.update(results.best)
            previous.timings.update(results.timings)
        else:
            devices[results.slug] = results
    groups: dict[str, list[_DeviceResults]] = defaultdict(list)
    for results in devices.values():
        name = results.architecture if level == "architecture" else results.vendor
        if name:
            groups[name].append(results)
    files = []
    for name, members in sorted(groups.items()):
        if len(members) < min_devices:
            continue
        keys = sorted({key for m in members for key in m.best})
        records = []
        for key in keys:
            record = _best_on_average([m for m in members if key in m.best], key)
            if record is not None:
                records.append(record)
        if records:
            files.append({"perfx_tuning": FORMAT, "match": {level: name}, "created": _now(),
                          "comment": f"merged from {len(members)} devices' tuning results by `perfx tune --merge`",
                          "records": records})
    return files


def _best_on_average(members: list[_DeviceResults], key) -> dict | None:
    hashes = {_legacy_hashes().get(h, h) for h in (m.best[key].get("source_hash") for m in members)}
    if len(hashes) != 1:   # measured with different kernel sources: not comparable
        return None
    timed = [m for m in members if key in m.timings]
    scores: dict[str, float] = {}
    if len(timed) == len(members):
        common = set.intersection(*(set(m.timings[key]) for m in members))
        for params in common:
            scores[params] = statistics.fmean(min(m.timings[key].values()) / m.timings[key][params]
                                              for m in members)
    if not scores:
        votes: dict[str, int] = defaultdict(int)
        for m in members:
            votes[params_key(m.best[key]["params"])] += 1
        scores = {p: float(v) for p, v in votes.items()}
    chosen = max(sorted(scores), key=scores.get)
    times = []
    for m in members:
        if chosen in m.timings.get(key, {}):
            times.append(m.timings[key][chosen])
        elif params_key(m.best[key]["params"]) == chosen and m.best[key].get("time_s"):
            times.append(m.best[key]["time_s"])
    first = members[0].best[key]
    return {"family": first["family"], "shape": first.get("shape"), "params": json.loads(chosen),
            "time_s": statistics.median(times) if times else None, "source_hash": hashes.pop(),
            "devices": sorted(m.slug for m in members)}


_default: dict[tuple, Database] = {}


def tuning_enabled() -> bool:
    """False when ``PERFX_TUNING=off``: every tuning database is ignored, the kernels run their defaults."""
    return os.environ.get("PERFX_TUNING", "").strip().lower() not in ("off", "0", "no", "false")


def default_database(enabled: bool = True) -> Database:
    """The process's database, for the cache dir in force (``PERFX_CACHE`` and ``PERFX_TUNING`` read each
    time); ``enabled`` False ignores every file, as PERFX_TUNING=off does."""
    key = (str(cache_dir()), enabled and tuning_enabled())
    if key not in _default:
        _default[key] = Database(enabled=key[1])
    return _default[key]
