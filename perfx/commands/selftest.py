"""`perfx selftest`: every kernel family checked on the user's own device against the float64 references.

This is how a user with a Snapdragon phone learns that perfx's kernels compute the right thing on
*their* driver: each spec's test shapes at the defaults and at the sets the device's tuning entries choose, and
(without ``--quick``) every parameter set the tuner may choose on this device at one of them (``--exhaustive``: at
each of them; ``plan`` says why one is enough), fresh random inputs, outputs poisoned first.

A phone shares its 8–12 GB with Android and builds kernels slowly, so the run is bounded and resumable:

- memory: one case (a family's inputs at one test shape, on the device and on the host) at a time, checked
  at every parameter set and released before the next; after each family (and before the builds of the next
  checks would take it past ``PROGRAMS_KEPT``) the device forgets the programs built (``Device.forget_programs``),
  which pyopencl's binary cache rebuilds cheaply if a later case needs them again;
- builds: the programs of the next ``BUILD_AHEAD`` checks of a case are built together on every core
  (``Device.build_many``: in worker processes where the driver builds one program at a time within a process, each
  worker holding one program at a time), where the family's spec names them (``Spec.programs``); ``--json``
  reports this process's peak resident memory and the largest build worker's;
- progress: the checks done, with their results, go to a file in the user's cache as they come (atomically,
  pinned to the device and to each family's kernel sources); the same command after an interrupt, a budget
  spent or a crash resumes there, ``--restart`` starts afresh, and a finished run removes the file;
- splitting: ``--shard I/N`` runs one of N disjoint parts (by family and parameter set, so each kernel is
  built in one part only); ``--budget SECONDS`` stops cleanly when the time is spent (exit status 3);
- processes: on a CPU device the cases are checked in a worker process per core (``--processes N``), each
  building its own kernels and holding one case at a time; this process keeps the progress and the plan's order.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

from perfx.errors import PerfxError
from perfx.model import host_peak_bytes
from perfx.progress import Progress, format_table
from perfx.resources import cache_dir, read_json, write_json_atomic
from perfx.runtime import (BUILD_WORKERS_ENV, DEVICE_HELP, Device, KernelLimitError, build_workers_peak_bytes,
                           one_library_environ, resident_bytes, resident_peak_bytes, running_build_workers,
                           shutdown_build_workers)
from perfx.tuning import SPECS, Spec, select_specs
from perfx.tuning.spec import build_requests, covering_plan
from perfx.tuning.database import default_database, fingerprint_slug, normal, params_key, source_hash

PROGRESS_FORMAT = 1
SAVE_EVERY_S = 10.0       # progress is written after each case, and at least this often within one
# The device forgets the programs it built after a family, or before the next checks' builds pass this many: a family's
# shapes often share builds (the same defines), rebuilt from pyopencl's binary cache if forgotten, but the
# largest family (gemv_q4) builds hundreds of programs a shape, and each holds its machine code, more just after
# it is compiled than loaded from the cache (what they cost: benchmarks/NOTES.md, selftest with bounded memory).
# Since a case checks only the sets planned at its shape, few programs are reused within a family: keeping 64
# instead of 128 rebuilt nothing more and lowered the peak (NOTES, the covering selftest).
PROGRAMS_KEPT = 64
# The checks whose programs are built together, ahead of them: enough for every core, few enough that what they
# hold stays well under PROGRAMS_KEPT.
BUILD_AHEAD = 32
EXIT_INCOMPLETE = 3       # --budget spent before every check ran, none failed: run the same command again

EPILOG = """\
What it checks:
  Every kernel family at its test shapes (small, off the tiles), against float64 references: at each shape the
  defaults and the parameter sets this device's tuning entries choose, and every other set the tuner may choose
  at one of the shapes (each set compiled and checked once; --exhaustive: at every shape, several times longer).

Long runs:
  A full selftest builds thousands of kernels: minutes on a desktop CPU, much longer on a phone.
  Its progress is written to perfx's cache as it goes: after Ctrl-C, a crash or a spent --budget, the same
  command resumes where it stopped (it says so); --restart starts afresh. A finished run removes its progress.
  A change of the device, its driver or a family's kernel sources makes the checks done before run again.

  perfx selftest --budget 300      # stop cleanly after about 5 minutes; run it again until it exits 0 or 1
  perfx selftest --shard 2/4       # the second of 4 disjoint parts (run 1/4 .. 4/4, here or in parallel)
  perfx selftest --processes 1     # check in this process (the default on a CPU device: a process per core)

Exit status: 0 every check passed (or was refused by the driver's limits); 1 a check failed (complete or not);
2 an error; 3 incomplete, the budget spent and no check failed so far: run the same command to go on;
130 interrupted (Ctrl-C), progress kept.
"""


def add_arguments(parser):
    parser.add_argument("--device", help=DEVICE_HELP)
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--quick", action="store_true", help="defaults only, one shape per family (about a minute)")
    scope.add_argument("--exhaustive", action="store_true",
                       help="every parameter set at every test shape (several times the default's builds); by "
                            "default each set is checked at one test shape, and the defaults and the sets this "
                            "device's tuning entries choose at every one")
    parser.add_argument("--kernels", help="comma-separated kernel families; a prefix names a group (default: all)")
    parser.add_argument("--shard", metavar="I/N", type=parse_shard,
                        help="run only part I of N (1 ≤ I ≤ N): the checks split by family and parameter set, "
                             "the N parts disjoint and together the whole selftest")
    parser.add_argument("--budget", metavar="SECONDS", type=float,
                        help="stop cleanly once SECONDS have passed (the check under way finishes), progress kept: "
                             f"exit status {EXIT_INCOMPLETE} if checks remain; the same command resumes")
    parser.add_argument("--processes", metavar="N", type=parse_processes,
                        help="check in N worker processes at once (default: on a CPU device, one per core, at most "
                             f"{MAX_PROCESSES}, or {PROCESSES_ENV}; elsewhere 1, this process)")
    parser.add_argument("--restart", action="store_true",
                        help="forget the progress of an earlier, unfinished run of the same command and start afresh")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every check, not only failures")
    parser.epilog = EPILOG
    parser.formatter_class = _RawEpilog


class _RawEpilog(argparse.HelpFormatter):
    """Keeps the epilog's lines and examples as written (the options' help is wrapped as usual)."""

    def _fill_text(self, text, width, indent):
        if "\n" not in text:   # the description: one paragraph, wrapped
            return super()._fill_text(text, width, indent)
        return "".join(indent + line for line in text.splitlines(keepends=True))


def scope_of(args) -> str:
    """The plan's scope (``plan``) the command-line options ask for."""
    return "quick" if args.quick else "exhaustive" if getattr(args, "exhaustive", False) else "covering"


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N), 1 ≤ I ≤ N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give I/N, e.g. 2/4") from None
    if not 1 <= index <= count:
        raise argparse.ArgumentTypeError(f"{text!r}: I runs from 1 to N")
    return index, count


def parse_processes(text: str) -> int:
    """``--processes``: a whole number, at least 1."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of processes, e.g. 2") from None
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1 (1: check in this process)")
    return count


@dataclass
class Check:
    kernel: str
    params: dict
    shape: str
    error: float
    tolerance: float
    passed: bool
    failure: str = ""   # build or launch failure, when it did not run
    refused: str = ""   # the driver's limits for the built kernel (work-group, local memory) exclude these
    #                     parameters here: not run, and not a failure (the tuner never chooses such a set)
    # What making it took in the process that made it, from the end of the case's check before (or the case's
    # start: its inputs and float64 references) to its result, the builds made ahead for it included: wall seconds,
    # and the CPU seconds of that process (which on a CPU device count the driver's compiler and kernel threads,
    # but not build workers'). What a user on a slow device splits off by (``family_seconds``).
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return not self.passed and not self.refused

    @property
    def key(self) -> str:
        return check_key(self.kernel, self.shape, self.params)

    def to_json(self) -> dict:
        """As the progress file holds it: an error that is not finite (did not run, NaN output) as null."""
        data = asdict(self)
        data["error"] = self.error if math.isfinite(self.error) else None
        return data

    @classmethod
    def from_json(cls, data: dict) -> Check:
        data = dict(data)
        data["error"] = float("inf") if data.get("error") is None else float(data["error"])
        return cls(**data)


def check_key(family: str, shape: str, params: dict) -> str:
    """What names one check: family, shape (as the spec describes it) and parameter set."""
    return f"{family}|{shape}|{params_key(params)}"


SCOPES = ("quick", "covering", "exhaustive")


def plan(all_specs: dict[str, Spec], device: Device, scope: str = "covering",
         in_force=None) -> list[tuple[Spec, dict, dict]]:
    """The checks of a selftest, (spec, shape, params), family by family and shape by shape (one case serves a
    run of them), by ``scope``:

    - ``quick``: the defaults (or, where a capability rules them out, the first set that can run) at each family's
      first test shape;
    - ``covering`` (the default): at every test shape the defaults and every set the device's tuning entries
      choose (``in_force(spec)``; default: the tuning database's ``sets_in_force``), and every other parameter
      set the tuner may choose at one test shape where it can run, picked by a hash of the family and the set:
      each set is compiled and checked once, each shape at many sets, and what the device runs at every shape;
    - ``exhaustive``: every parameter set at every test shape (a program each, the shapes' sizes being build
      defines).

    Covering is enough for what a selftest is for, a driver that miscompiles a kernel: a set is compiled with the
    same code paths at any shape that is off the tiles, and the tuner checks each candidate at the model's own
    shapes before it times it, so no set runs untested where ``covering`` left a (shape, set) out."""
    if scope not in SCOPES:
        raise ValueError(f"unknown selftest scope {scope!r}: one of {', '.join(SCOPES)}")
    if in_force is None:
        database = default_database()
        in_force = lambda spec: database.sets_in_force(device, spec)  # noqa: E731
    jobs = []
    for spec in all_specs.values():
        shapes = spec.test_shapes[:1] if scope == "quick" else spec.test_shapes
        per_shape = [spec.params.candidates(shape, device.caps) for shape in shapes]
        defaults = params_key(spec.params.defaults())
        if scope == "exhaustive":
            keep = None
        else:
            keep = set()
            ruling = {params_key(p) for p in in_force(spec)} if scope == "covering" else set()
            for index, candidates in enumerate(per_shape):
                keys = [params_key(p) for p in candidates]
                # the defaults, or where a capability rules them out here the first set that can run
                first = [defaults] if defaults in keys else keys[:1]
                for key in first + [k for k in keys if k in ruling]:
                    keep.add((index, key))
            if scope == "covering":
                keep = covering_plan(spec.params.family, [[params_key(p) for p in c] for c in per_shape], keep)
        for index, (shape, candidates) in enumerate(zip(shapes, per_shape)):
            jobs.extend((spec, shape, params) for params in candidates
                        if keep is None or (index, params_key(params)) in keep)
    return jobs


def shard(jobs: list, index: int, count: int) -> list:
    """Part ``index`` (1..count) of ``jobs``: the distinct (family, parameter set) pairs dealt round in plan order,
    each pair with all its shapes, so every kernel build falls in one part and the parts are about equal."""
    owner: dict[tuple, int] = {}
    for spec, _, params in jobs:
        owner.setdefault((spec.params.family, params_key(params)), len(owner) % count)
    return [job for job in jobs if owner[(job[0].params.family, params_key(job[2]))] == index - 1]


def cases_of(jobs: list) -> list[tuple[Spec, dict, list[dict]]]:
    """``jobs`` as runs of one (family, shape): (spec, shape, [params, ...]), in order."""
    runs: list = []
    for spec, shape, params in jobs:
        if runs and runs[-1][0] is spec and runs[-1][1] is shape:
            runs[-1][2].append(params)
        else:
            runs.append((spec, shape, [params]))
    return runs


def case_rng(seed: int, family: str, shape: str) -> np.random.Generator:
    """The random inputs of one case depend only on the seed, the family and the shape: the same whichever part of
    the selftest runs it (a shard, a resumed run), so split or resumed runs check what a whole run checks."""
    digest = hashlib.sha256(f"{family}|{shape}".encode()).digest()
    return np.random.default_rng([seed, int.from_bytes(digest[:8], "little")])


class BudgetSpent(Exception):
    """``deadline`` passed with checks still to run (``--budget``)."""


def _failure(spec: Spec, shape: str, params: dict, error: Exception) -> Check:
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, KernelLimitError):
        return Check(spec.params.family, params, shape, float("inf"), spec.tolerance_for(params), False, refused=first)
    return Check(spec.params.family, params, shape, float("inf"), spec.tolerance_for(params), False, first)


def build_ahead(device: Device, spec: Spec, shape: dict, params_list: list[dict]) -> None:
    """The programs the next checks build, built at once on every core (``Device.build_many``) where the spec
    names them (``Spec.programs``); a failure is kept by the device, and the check that needs it reports it.
    The device first forgets what it built before where these would take it past PROGRAMS_KEPT."""
    requests = build_requests(spec, device, shape, params_list)
    if device.programs_kept + len(requests) > PROGRAMS_KEPT:
        device.forget_programs()
    device.build_many(requests)


def check_case(device: Device, spec: Spec, shape: dict, params_list: list[dict], rng: np.random.Generator,
               checks: list[Check], after_each=None, deadline: float | None = None) -> None:
    """One case made, checked at each parameter set (appended to ``checks``), then released: its device buffers,
    host arrays and wrappers go before this returns. ``after_each()`` runs after each check; past ``deadline``
    (perf_counter seconds) no further check starts (BudgetSpent)."""
    family, described = spec.params.family, spec.describe(shape)
    case = None
    mark = [time.perf_counter(), time.process_time()]

    def timed(check: Check) -> None:
        now = [time.perf_counter(), time.process_time()]
        check.seconds, check.cpu_seconds = now[0] - mark[0], now[1] - mark[1]
        mark[:] = now
        checks.append(check)
    try:
        try:
            case = spec.make_case(device, shape, rng)
        except PerfxError as e:   # a build or upload failure on this driver: every set of the case reports it
            made_error = e
        else:
            made_error = None
        for i, params in enumerate(params_list):
            if i and deadline is not None and time.perf_counter() >= deadline:
                raise BudgetSpent
            if made_error is None and i % BUILD_AHEAD == 0:
                build_ahead(device, spec, shape, params_list[i:i + BUILD_AHEAD])
            if made_error is not None:
                timed(_failure(spec, described, params, made_error))
            else:
                try:
                    errors = case.errors(params)
                    error = max(errors.values()) if errors else 0.0
                    tolerance = spec.tolerance_for(params)
                    timed(Check(family, params, described, error, tolerance, bool(error <= tolerance)))
                except PerfxError as e:  # a build or launch failure, or a driver limit: report it, go on
                    timed(_failure(spec, described, params, e))
            if after_each is not None:
                after_each()
    finally:
        del case
        gc.collect()   # the case's closures may sit in reference cycles: its buffers go now, not at some later pass


def run_checks(device: Device, all_specs: dict[str, Spec], scope: str = "covering", seed: int = 0,
               show_progress: bool | None = None, checks: list[Check] | None = None, *,
               done: dict[str, Check] | None = None, part: tuple[int, int] | None = None,
               deadline: float | None = None, saved=None, processes: int = 1,
               report: dict | None = None) -> list[Check]:
    """Every planned check (``part``: one shard of them), in order. ``checks``: a list each result is appended to
    as it comes, so a caller interrupted part way (Ctrl-C on a phone's long selftest) still has those done.

    ``done``: check key -> Check from an earlier run, taken as they are instead of run again (resume).
    ``deadline`` (perf_counter seconds): no check starts after it; BudgetSpent is raised with checks left.
    ``saved(final)``: called after each check (``final`` False: it may skip) and after each case (True), to write
    progress. Memory stays bounded: one case at a time (``check_case``), and the device forgets the programs
    built once a family is done, or before building past PROGRAMS_KEPT (``Device.forget_programs``; a case keeps only
    its last few sets' kernels, ``tuning.spec.cached_per_params``).

    ``processes`` above 1: the cases are checked in that many worker processes at once (``_check_in_processes``),
    the results in plan order all the same; ``report`` (a dict), where given, gets how many ran and the largest
    one's peak resident memory."""
    jobs = plan(all_specs, device, scope)
    if part is not None:
        jobs = shard(jobs, *part)
    done = done or {}
    progress = Progress(len(jobs), "selftest", enabled=show_progress)
    checks = [] if checks is None else checks

    def after_each():
        progress.update(note=checks[-1].kernel)
        if saved is not None:
            saved(False)

    try:
        if processes > 1:
            _check_in_processes(device, jobs, processes, seed, progress, checks, done, deadline, saved,
                                {} if report is None else report)
            return checks
        runs = cases_of(jobs)
        for number, (spec, shape, params_list) in enumerate(runs):
            family, described = spec.params.family, spec.describe(shape)
            todo = []
            for params in params_list:
                previous = done.get(check_key(family, described, params))
                if previous is None:
                    todo.append(params)
                else:
                    checks.append(previous)
                    progress.update(note=family)
            if todo:
                if deadline is not None and time.perf_counter() >= deadline:
                    raise BudgetSpent
                check_case(device, spec, shape, todo, case_rng(seed, family, described), checks, after_each,
                           deadline)
                if saved is not None:
                    saved(True)
            family_done = number + 1 == len(runs) or runs[number + 1][0] is not spec
            if family_done or device.programs_kept >= PROGRAMS_KEPT:
                device.forget_programs()
    finally:
        progress.close()
    return checks



# -- checks in worker processes --------------------------------------------------------------------------------
# On a CPU device everything a check costs runs on the host: the build, the work-group functions PoCL generates at
# a kernel's first launch, the float64 reference, the launch itself. In one process most of that is serial (the
# drivers compile one program at a time within a process, and the first launch compiles in the launching
# process), so a selftest there runs its cases in worker processes, one per core, each taking the next case as it
# finishes one: each holds one case and builds its own programs (no build workers of its own), and sends each
# check back as it is made, so this process keeps the progress, the order of the plan and the resume.

PROCESSES_ENV = "PERFX_SELFTEST_PROCESSES"
MAX_PROCESSES = 8
# A worker whose resident memory has passed this after a check is replaced by a fresh one (about a second to
# start), the sets of its part it has not checked going to the next process free: a process's memory grows with
# the programs it has compiled, beyond those it keeps (one PoCL process checking every family peaked at 939 MB,
# checking one family at most 420 MB), and one check can add much at once (a large case's inputs and
# references: 126 MiB; a long kernel's compile). Looked at after each part only, a worker just under the bound
# took a part of heavy checks 280 MiB past it (benchmarks/NOTES.md, the check processes' memory bounded after
# each check).
RECYCLE_BYTES = 384 * 2**20
# A case goes to the workers in parts of CHECKER_PART checks, and a worker keeps the programs of about two parts
# (a family's shared kernels, as the quantizers, serve a case's next part): it builds in itself, one at a time,
# so keeping more buys nothing, and the smaller parts and bound took a PoCL worker's peak from 739 to 661 MiB
# (benchmarks/NOTES.md, the merged tree on a quiet machine, sixth session).
CHECKER_PART = 16
CHECKER_PROGRAMS_KEPT = 2 * CHECKER_PART
_CHECKER_MAIN = "from perfx.commands import selftest; selftest._checker_main()"


def default_processes(device: Device) -> int:
    """How many processes check at once: PERFX_SELFTEST_PROCESSES where set, else the CPU count (at most
    MAX_PROCESSES) on a CPU device, and 1 on any other (its checks run on the device, its builds in
    ``Device.build_many``'s workers)."""
    setting = os.environ.get(PROCESSES_ENV, "").strip()
    if setting:
        try:
            return max(1, int(setting))
        except ValueError:
            raise PerfxError(f"{PROCESSES_ENV}={setting!r}: give a whole number of processes (1: check in this "
                             "one)") from None
    if device.caps.device_type != "CPU":
        return 1
    return max(1, min(os.cpu_count() or 1, MAX_PROCESSES))


def _send(stream, message) -> None:
    pickle.dump(message, stream)
    stream.flush()


class _Grown(Exception):
    """A check worker's resident memory passed its bound with sets of the part left: it hands them back."""


def _checker_main() -> None:
    """A check worker: (selector, limits, seed, memory bound), answered ("ready", the device's fingerprint) once it
    is open; then cases, each (family, shape's index, parameter sets, seconds left or None), answered with
    ("check", Check) for each check and ("done", None), ("budget", None) where the seconds ran out with sets left,
    or ("grown", its peak resident bytes) where after a check its resident memory passed the bound with sets left
    (the command checks those in a fresh process)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr   # anything printed by the way goes to stderr, not into the answers
    selector, limits, seed, bound = pickle.load(stdin)
    device = Device(selector, limits)
    _send(stdout, ("ready", device.fingerprint))
    last_family = None
    while True:
        try:
            family, index, params_list, seconds = pickle.load(stdin)
        except EOFError:
            return
        spec = SPECS[family]
        if family != last_family or device.programs_kept + len(params_list) > CHECKER_PROGRAMS_KEPT:
            device.forget_programs()
        last_family = family
        shape, checks = spec.test_shapes[index], []
        # the sets as the plan made them here (checked for the shape and device), from their items
        checked = {params_key(p): p for p in spec.params.candidates(shape, device.caps)}
        params_list = [checked.get(params_key(params), params) for params in params_list]
        deadline = None if seconds is None else time.perf_counter() + seconds

        def answer():
            check = checks[-1]
            _send(stdout, ("check", dataclasses.replace(check, params=dict(check.params))))
            if len(checks) < len(params_list) and (resident_bytes() or 0) > bound:
                raise _Grown
        try:
            check_case(device, spec, shape, params_list, case_rng(seed, family, spec.describe(shape)), checks,
                       answer, deadline)
        except BudgetSpent:
            _send(stdout, ("budget", None))
        except _Grown:   # its peak sent with it: the process ends before the command could read it
            _send(stdout, ("grown", resident_peak_bytes()))
            return
        else:
            _send(stdout, ("done", None))


class _Checker:
    """One check worker process: one case at a time."""

    # Whether workers start with the ICD loader reading only the device's own library (``one_library_environ``):
    # the other implementations' libraries, loaded for nothing, held a third of a PoCL worker's memory after its
    # first build (Intel's CPU runtime: 115 of 379 MiB), so a worker passed RECYCLE_BYTES after its first check
    # of a heavy family and a fresh process (about a CPU second) was started for each such check
    # (benchmarks/NOTES.md, the PoCL selftest's waste). Off for the rest of the run once a worker so
    # started fails to open the same device.
    one_library = True

    def __init__(self, device: Device, seed: int):
        # its builds in the process itself: the processes already keep every core busy, and a build worker each
        # would hold another Python and compiler; a session of its own, so Ctrl-C is this process's to handle
        self.peak, self.ready = 0, False
        env = {**os.environ, BUILD_WORKERS_ENV: "1"}
        alone = one_library_environ(device.entry.implementation) if _Checker.one_library else None
        if alone is not None:
            # the only platform the loader then lists: the device's index within it
            self._start({**env, **alone}, f"0:{device.entry.device_index}", device, seed)
            if self._opened(device):
                return
            _Checker.one_library = False
            self.stop()
        self._start(env, device.entry.index, device, seed)

    def _start(self, env: dict, selector: str, device: Device, seed: int) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", _CHECKER_MAIN], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, start_new_session=True)
        _send(self.process.stdin, (selector, device.limits, seed, RECYCLE_BYTES))

    def _opened(self, device: Device) -> bool:
        """Whether the worker opened ``device`` itself (the same fingerprint), its first answer read."""
        try:
            kind, fingerprint = pickle.load(self.process.stdout)
        except (EOFError, OSError, ValueError, pickle.UnpicklingError):
            return False
        self.ready = True
        return kind == "ready" and fingerprint == device.fingerprint

    def check(self, spec: Spec, shape: dict, params_list: list[dict], seconds: float | None, on_check) -> str:
        """The case's checks, each passed to ``on_check`` as it comes: "done", "budget", "grown" where the process
        passed RECYCLE_BYTES with checks left (it then ends), "died" where it ended part way, or "broken" where it
        ended before it had opened the device."""
        try:
            if not self.ready:
                pickle.load(self.process.stdout)
                self.ready = True
            _send(self.process.stdin, (spec.params.family, spec.test_shapes.index(shape),
                                       [dict(params) for params in params_list], seconds))
            while True:
                kind, check = pickle.load(self.process.stdout)
                if kind == "grown":
                    self.peak = max(self.peak, check or 0)
                if kind != "check":
                    return kind
                on_check(check)
        except (EOFError, OSError, ValueError, pickle.UnpicklingError):
            return "died" if self.ready else "broken"

    def resident_bytes(self) -> int:
        """Its resident memory now (0 where the system does not tell)."""
        return resident_bytes(self.process.pid) or 0

    def stop(self) -> None:
        """Its peak resident memory noted, its pipe closed, and the process ended."""
        self.peak = max(self.peak, resident_peak_bytes(self.process.pid) or 0)
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _check_in_processes(device: Device, jobs: list, processes: int, seed: int, progress: Progress,
                        checks: list[Check], done: dict[str, Check], deadline: float | None, saved,
                        report: dict) -> None:
    """``run_checks`` in ``processes`` worker processes: the cases not done (in parts of at most CHECKER_PART
    checks), longest first, each handed to the next process free; results appended to ``checks`` as they come,
    and in the plan's order when this returns or raises. A process that dies (a driver's crash) fails the check
    it was making, and a new one takes the rest of the case."""
    order = {check_key(spec.params.family, spec.describe(shape), params): i for i, (spec, shape, params)
             in enumerate(jobs)}
    pending: queue.Queue = queue.Queue()
    cases = []
    for spec, shape, params_list in cases_of(jobs):
        todo = []
        for params in params_list:
            previous = done.get(check_key(spec.params.family, spec.describe(shape), params))
            if previous is None:
                todo.append(params)
            else:
                checks.append(previous)
                progress.update(note=spec.params.family)
        # a long case in parts (its inputs made again for each, from the same seed: the same checks), so that no
        # process is left with a long one while the others have finished
        cases.extend((spec, shape, todo[i:i + CHECKER_PART]) for i in range(0, len(todo), CHECKER_PART))
    # the longest first, so the last to finish is a short one
    for case in sorted(cases, key=lambda case: -len(case[2])):
        pending.put(case)
    results: queue.Queue = queue.Queue()
    stop, finished = threading.Event(), object()
    checkers: list[_Checker] = []
    lock = threading.Lock()

    def feed():
        checker = None
        try:
            while not stop.is_set():
                try:
                    spec, shape, todo = pending.get_nowait()
                except queue.Empty:
                    return
                seconds = None if deadline is None else deadline - time.perf_counter()
                if seconds is not None and seconds <= 0:
                    results.put(("budget", None))
                    return
                if checker is None:
                    with lock:
                        if stop.is_set():
                            return
                        checker = _Checker(device, seed)
                        checkers.append(checker)
                made: list[Check] = []

                def on_check(check, made=made):
                    made.append(check)
                    results.put(("check", check))
                outcome = checker.check(spec, shape, todo, seconds, on_check)
                if outcome == "grown":   # the sets it did not check to the next process free, this one replaced
                    pending.put((spec, shape, todo[len(made):]))
                    checker.stop()
                    checker = None
                    outcome = "done"
                if outcome == "broken" and not stop.is_set():   # not one case checked: every case would fail so
                    status = checker.process.wait()
                    results.put(("broken", status))
                    return
                if outcome == "died" and not stop.is_set():
                    status = checker.process.wait()
                    if len(made) < len(todo):   # else it died after its last check
                        params = todo[len(made)]
                        results.put(("check", Check(spec.params.family, params, spec.describe(shape),
                                                    float("inf"), spec.tolerance_for(params), False,
                                                    f"the selftest's worker process died (exit status {status}) "
                                                    "making this check")))
                    if todo[len(made) + 1:]:
                        pending.put((spec, shape, todo[len(made) + 1:]))
                    checker.stop()
                    checker = None
                    outcome = "done"
                results.put((outcome, None))
                if outcome == "budget":
                    return
                if checker is not None and checker.resident_bytes() > RECYCLE_BYTES:
                    checker.stop()
                    checker = None
        except Exception as error:   # noqa: BLE001 - raised again in the calling thread
            results.put(("error", error))
        finally:
            if checker is not None:
                checker.stop()
            results.put((finished, None))

    threads = [threading.Thread(target=feed, name="perfx-selftest-feed", daemon=True)
               for _ in range(min(processes, len(cases)))]
    budget_spent = False
    try:
        for thread in threads:
            thread.start()
        running = len(threads)
        while running:
            kind, check = results.get()
            if kind is finished:
                running -= 1
            elif kind == "check":
                checks.append(check)
                progress.update(note=check.kernel)
                if saved is not None:
                    saved(False)
            elif kind == "done":
                if saved is not None:
                    saved(True)
            elif kind == "budget":
                budget_spent = True
            elif kind == "error":
                raise check
            elif kind == "broken":
                raise PerfxError(f"a selftest worker process ended (exit status {check}) before it could check "
                                 f"anything: {PROCESSES_ENV}=1 checks in this process, where the error shows")
    finally:
        stop.set()
        with lock:
            for checker in checkers:   # on an interrupt: each ended now, not after the case it is checking
                if checker.process.poll() is None:
                    checker.peak = max(checker.peak, resident_peak_bytes(checker.process.pid) or 0)
                    checker.process.kill()
        for thread in threads:
            thread.join()
        checks.sort(key=lambda c: order[c.key])
        report["processes"] = len(threads)   # at once (one that died or grew past RECYCLE_BYTES was replaced)
        report["processes_peak_rss_bytes"] = max((c.peak for c in checkers), default=0)
    if budget_spent and len(checks) < len(jobs):
        raise BudgetSpent


class SavedProgress:
    """The progress file of one selftest command (device, limits, build options, scope, --kernels, --shard)
    in ``<cache>/selftest/``: the checks done, pinned to the device and each family's kernel sources."""

    def __init__(self, device: Device, all_specs: dict[str, Spec], scope: str, part: tuple[int, int] | None,
                 seed: int = 0):
        self.identity = normal({"device": device.fingerprint, "limits": device.caps.limits,
                         "build_options": device.build_options, "scope": scope, "seed": seed,
                         "families": sorted(all_specs), "shard": f"{part[0]}/{part[1]}" if part else None})
        self.sources = {family: source_hash(spec) for family, spec in all_specs.items()}
        digest = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:12]
        self.path = cache_dir() / "selftest" / f"{fingerprint_slug(device.fingerprint)}-{digest}.json"
        self.written = 0.0

    def load(self) -> tuple[dict[str, Check], str]:
        """(check key -> Check of an earlier run, a note on what was kept or dropped, "" if nothing was)."""
        if not self.path.exists():
            return {}, ""
        try:
            data = read_json(self.path)
            if data.get("perfx_selftest_progress") != PROGRESS_FORMAT or data.get("identity") != self.identity:
                return {}, f"the progress in {self.path} is of another format or run: starting afresh"
            kept, stale = {}, set()
            for item in data["checks"]:
                if data["sources"].get(item["kernel"]) != self.sources.get(item["kernel"]):
                    stale.add(item["kernel"])
                    continue
                check = Check.from_json(item)
                kept[check.key] = check
        except (PerfxError, AttributeError, KeyError, TypeError, ValueError) as e:   # cut short, or not ours
            return {}, f"the progress in {self.path} is unreadable ({e}): starting afresh"
        note = f"resuming: {len(kept)} checks done before (progress in {self.path}; --restart starts afresh)"
        if stale:
            note += f"; the kernels of {', '.join(sorted(map(str, stale)))} changed since: their checks run again"
        return kept, note

    def save(self, checks: list[Check]) -> None:
        write_json_atomic(self.path, {"perfx_selftest_progress": PROGRESS_FORMAT, "identity": self.identity,
                                      "sources": self.sources, "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                        time.gmtime()),
                                      "checks": [c.to_json() for c in checks]})
        self.written = time.perf_counter()

    def saver(self, checks: list[Check]):
        """``saved(final)`` for ``run_checks``: writes after each case, and within one at most every SAVE_EVERY_S."""
        def saved(final: bool):
            if final or time.perf_counter() - self.written >= SAVE_EVERY_S:
                self.save(checks)
        return saved

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def checks_table(checks: list[Check]) -> str:
    rows = [("kernel", "parameters", "shape", "max rel err", "tolerance", "result")]
    for c in checks:
        params = " ".join(f"{k}={v}" for k, v in c.params.items())
        result = ("pass" if c.passed else "refused by the driver: " + c.refused if c.refused
                  else "FAIL: " + c.failure if c.failure else "FAIL")
        rows.append((c.kernel, params, c.shape, f"{c.error:.2e}", f"{c.tolerance:.0e}", result))
    return format_table(rows)


def family_seconds(checks: list[Check]) -> dict[str, dict]:
    """Per family, in the checks' order: how many checks, and the wall and CPU seconds they took in the processes
    that made them (``Check.seconds``; summed over processes, so with N at once about N times its share of the
    run's wall time): the families a slow device's run is best split by (``--kernels``, ``--shard``)."""
    totals: dict[str, dict] = {}
    for c in checks:
        total = totals.setdefault(c.kernel, {"checks": 0, "seconds": 0.0, "cpu_seconds": 0.0})
        total["checks"] += 1
        total["seconds"] += c.seconds
        total["cpu_seconds"] += c.cpu_seconds
    # four decimals: a family of a few fast checks from warm caches must not read as zero
    return {family: {**total, "seconds": round(total["seconds"], 4), "cpu_seconds": round(total["cpu_seconds"], 4)}
            for family, total in totals.items()}


def summary_table(checks: list[Check], all_specs: dict[str, Spec]) -> str:
    rows = [("kernel", "checks", "failed", "refused", "worst passing err", "tolerance", "seconds")]
    for family, spec in all_specs.items():
        mine = [c for c in checks if c.kernel == family]
        worst = max((c.error for c in mine if c.passed), default=0.0)
        rows.append((family, len(mine), sum(c.failed for c in mine), sum(bool(c.refused) for c in mine),
                     f"{worst:.2e}", f"{spec.tolerance:.0e}", f"{sum(c.seconds for c in mine):.1f}"))
    return format_table(rows)


def main(args) -> int:
    device = Device(args.device)
    all_specs = select_specs(args.kernels)
    part = getattr(args, "shard", None)
    budget = getattr(args, "budget", None)
    started = time.perf_counter()
    print(f"perfx selftest on {device.caps.platform} / {device.caps.name} (limits: {device.caps.limits})"
          + (f", part {part[0]} of {part[1]}" if part else ""), file=sys.stderr)
    scope = scope_of(args)
    saved = SavedProgress(device, all_specs, scope, part)
    if getattr(args, "restart", False):
        saved.clear()
    done, note = saved.load()
    if note:
        print(f"perfx selftest: {note}", file=sys.stderr)
    jobs = plan(all_specs, device, scope)
    planned = len(shard(jobs, *part) if part else jobs)
    checks: list[Check] = []
    processes = getattr(args, "processes", None) or default_processes(device)
    in_processes: dict = {}
    stopped = None
    try:
        run_checks(device, all_specs, scope, show_progress=False if args.json else None, checks=checks,
                   done=done, part=part, deadline=None if budget is None else started + budget,
                   saved=saved.saver(checks), processes=processes, report=in_processes)
    except KeyboardInterrupt:
        stopped = "interrupted"
        print(f"perfx selftest: interrupted after {len(checks)} checks; those follow", file=sys.stderr)
    except BudgetSpent:
        stopped = "budget"
    if stopped:
        saved.save(checks)
        if stopped == "budget":
            print(f"perfx selftest: the budget of {budget:g} s is spent: {len(checks)} of {planned} checks done; "
                  f"progress kept in {saved.path}: run the same command again to go on", file=sys.stderr)
    else:
        saved.clear()
    resumed = sum(1 for c in checks if done.get(c.key) is c)
    passed, failed = sum(c.passed for c in checks), sum(c.failed for c in checks)
    refused = len(checks) - passed - failed
    peak, workers_peak, workers = host_peak_bytes(), build_workers_peak_bytes(), running_build_workers()
    shutdown_build_workers()
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps({"device": device.fingerprint, "limits": device.caps.limits, "scope": scope,
                          "quick": scope == "quick",
                          "shard": f"{part[0]}/{part[1]}" if part else None, "interrupted": stopped == "interrupted",
                          "complete": stopped is None, "stopped": stopped, "planned": planned, "resumed": resumed,
                          "passed": passed, "failed": failed, "refused": refused, "seconds": round(elapsed, 2),
                          "peak_rss_bytes": peak, "build_workers_peak_rss_bytes": workers_peak,
                          "build_workers": workers,
                          "check_processes": in_processes.get("processes", 0),
                          "check_processes_peak_rss_bytes": in_processes.get("processes_peak_rss_bytes", 0),
                          "device_peak_bytes": device.peak_allocated_bytes,
                          "families": family_seconds(checks),
                          "checks": [asdict(c) for c in checks]}, indent=1, default=float))
    else:
        shown = checks if args.verbose else [c for c in checks if c.failed]
        if shown:
            print(checks_table(shown))
        print(summary_table(checks, all_specs))
        print(f"{passed} passed, {failed} failed"
              + (f", {refused} refused by the driver's limits for the kernel (never chosen here)" if refused else "")
              + " "
              f"({elapsed:.1f}s, peak resident memory {peak / 2**20:.0f} MiB"
              + (f", each build worker at most {workers_peak / 2**20:.0f} MiB" if workers_peak else "")
              + (f", checked in {in_processes['processes']} processes, each at most "
                 f"{in_processes['processes_peak_rss_bytes'] / 2**20:.0f} MiB" if in_processes.get("processes")
                 else "")
              + (f", {resumed} resumed" if resumed else "") + ")"
              + (", interrupted" if stopped == "interrupted" else "")
              + (f", incomplete: {planned - len(checks)} of {planned} checks left" if stopped == "budget" else ""))
    if stopped == "interrupted":
        return 130
    return 1 if failed else EXIT_INCOMPLETE if stopped == "budget" else 0
