"""The autotuner: verified, timed sweeps of a family's parameter space, one problem at a time, and a
confirmation of the winners that noise cannot fool.

Every candidate is first run and compared with the float64 reference on this device; only a candidate
within the spec's tolerance is timed, and only a timed one may be chosen. One that does not build,
fails at launch or is wrong is recorded with the reason. Each outcome goes to the device's resume log
as it comes (atomically), so an interrupted sweep resumes without re-timing anything.

Search (after CLBlast's and kernel_tuner's tuners): the sets this device cannot run, or its driver refused,
pruned unbuilt; the defaults first, then the likely winners (the tuned entries of this device and of others,
the most alike shape first), then every candidate where the space is small, else a random sample (at least
RANDOM_SAMPLES, more while half the problem's share of the budget lasts) followed by local refinement (each
parameter moved to any other value of its list) around the best, until nothing improves or the problem's share
of the budget is spent. The programs of the candidates to come are built ahead, many at once (``BuildAhead``), and
where the time went is kept per phase (``Split``).

Timing is successive halving, candidate by candidate: each verified candidate is first screened in a few short
runs (a quarter of its case's copies each, the rotation going on so they still read from memory); one whose
fastest run is slower than the best so far by more than the screens' own noise (``RunNoise``) is cut short there
and never chosen, and only the rest are timed in full, in runs that stop once their median is known to a few
percent or is beyond the best's reach. The likely winners come first, so most candidates meet a good best.

Confirmation: a search ranks candidates by one median each, and on a phone (thermal throttling,
big.LITTLE, DVFS) or a busy machine a single lucky sample can crown the wrong one. So the top few, the
entry in force before (the incumbent) and the defaults are timed again, interleaved in a shuffled order
over several rounds, with a reference kernel (the copy kernel) timed between rounds: a round during
which the machine drifted (throttling, another load) is set aside after a cool-down and taken again.
A challenger replaces the incumbent only when its paired bootstrap interval of time ratios lies wholly
below 1; otherwise the incumbent stays ("no significant difference"). The result records its median
time, and its gain over the defaults with that interval.

Refresh: a new kernel source makes every record measured on the old one stale. Rather than sweep again,
``refresh`` verifies each stale record's parameters on the new source and times them against the defaults in
the same interleaved rounds; one at least as fast on the median is pinned to the new source.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from perfx.errors import PerfxError
from perfx.runtime import BuildError, DriverError, KernelLimitError
from perfx.timing import Timing, bootstrap_ratio, copy_kernel, time_launches
from perfx.tuning.database import (Database, measured_on_current_source, normal, params_key, result_record,
                                   served_ms, source_hash)
from perfx.tuning.spec import build_requests, time_case

EXHAUSTIVE_LIMIT = 48   # spaces up to this many candidates are searched exhaustively
RANDOM_SAMPLES = 24     # otherwise: this many random candidates before local refinement, at least
SAMPLE_SHARE = 0.5      # ... and more while this share of the problem's budget lasts
SCREEN_REPEAT = 3       # successive halving's first rung: every verified candidate is timed in this many runs,
SCREEN_SHARE = 0.25     # ... each over this share of its case's copies (the rotation goes on: still from memory),
SCREEN_MARGIN = 0.10    # ... and timed in full only where its fastest run is within the screens' noise of the best
                        # so far (``RunNoise``), never less than this
EARLY_MARGIN = 1.0      # the margin until that noise is known: a fastest run twice the best's time is cut
NOISE_QUANTILE = 0.9    # the noise: how far a screen's run strays above its screen's median, at this quantile,
NOISE_KEPT = 300        # ... over this many of the latest screens' runs
FULL_MIN = 3            # a candidate timed in full: at least this many runs (of every copy), then chunks of FULL_CHUNK
FULL_CHUNK = 2          # ... up to ``repeat`` while it may be the best and its runs do not yet agree
STEADY_SPREAD = 0.04    # ... within this share of their median (interquartile range)
CONFIRM_TOP = 3         # search winners confirmed against the incumbent and the defaults
CONFIRM_ROUNDS = 7      # interleaved rounds of the confirmation
DRIFT_THRESHOLD = 0.25  # the reference kernel this much slower than its baseline: the round is suspect
DRIFT_WINDOW = 16       # the baseline: a low quantile of the reference's latest this many checks (``DriftWatch``),
DRIFT_QUANTILE = 0.25   # ... so a level the machine keeps becomes the baseline, and a lone quiet moment does not
COOL_DOWN_S = 2.0       # the longest wait before re-taking a suspect round: the reference is timed every
COOL_DOWN_POLL_S = 0.1  # ... this many seconds meanwhile, and the wait ends once it is back within the threshold
DRIFT_REACH = 2.0       # a screen this many times past its limit is cut without asking whether the machine drifted
BUILD_AHEAD = 16       # candidates whose programs are built together, ahead of their runs
PROGRAMS_KEPT = 128    # programs the device keeps before it forgets them (``Device.forget_programs``) between batches
PHASES = ("setup", "build", "verify", "time", "drift", "confirm")
STATUSES = ("ok", "slow", "wrong", "build", "limit", "launch", "error", "crashed")


@dataclass
class Outcome:
    """What happened to one candidate in the search. Only "ok" outcomes may be chosen."""

    params: dict
    status: str                      # one of STATUSES
    time_s: float | None = None      # median device time
    spread: float | None = None      # (max − min) / median of the samples
    samples: list = field(default_factory=list)
    error: float | None = None       # worst relative error over the outputs
    reason: str = ""
    private_bytes: int | None = None  # the most private memory per work-item of its kernels (spills on a GPU)

    def as_dict(self) -> dict:
        data = asdict(self)
        data["params"] = normal(self.params)
        if data["error"] is not None and data["error"] == float("inf"):
            data["error"] = None  # JSON has no inf; the reason says it
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Outcome:
        return cls(**{k: data.get(k) for k in ("params", "status", "time_s", "spread", "error", "private_bytes")},
                   samples=list(data.get("samples") or []), reason=data.get("reason") or "")


@dataclass
class Confirmation:
    """The interleaved re-timing of the contenders of one problem."""

    contenders: list[dict]           # parameter sets: the incumbent first, the defaults, then challengers
    rounds: list[list[float]]        # per kept round, each contender's time (same order as contenders)
    chosen: dict                     # the parameters in force after the confirmation
    verdict: str                     # "replaced the incumbent" / "no significant difference" / ...
    ratio: float                     # median ratio chosen / incumbent (1.0 when the incumbent stays)
    interval: tuple[float, float]    # its bootstrap interval
    gain: float                      # defaults / chosen, median ratio
    gain_interval: tuple[float, float]
    suspect_rounds: int = 0          # rounds set aside for drift and taken again
    served: dict = field(default_factory=dict)   # M -> the chosen set's time at each M of ``served_ms`` (``_served``)

    def median(self, params: dict) -> float:
        i = self.contenders.index(params)
        return statistics.median(r[i] for r in self.rounds)

    def as_dict(self) -> dict:
        return {"contenders": [normal(c) for c in self.contenders], "rounds": self.rounds,
                "chosen": normal(self.chosen), "verdict": self.verdict, "ratio": self.ratio,
                "interval": list(self.interval), "gain": self.gain, "gain_interval": list(self.gain_interval),
                "suspect_rounds": self.suspect_rounds, "served": {str(m): t for m, t in self.served.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> Confirmation:
        return cls(data["contenders"], data["rounds"], data["chosen"], data["verdict"], data["ratio"],
                   tuple(data["interval"]), data["gain"], tuple(data["gain_interval"]),
                   data.get("suspect_rounds", 0), {int(m): t for m, t in (data.get("served") or {}).items()})


@dataclass
class ProblemResult:
    family: str
    shape: dict
    label: str
    description: str
    bytes_moved: int
    flops: int
    outcomes: list[Outcome] = field(default_factory=list)
    best: Outcome | None = None      # the search's fastest verified candidate
    default: Outcome | None = None
    confirmation: Confirmation | None = None
    resumed: int = 0          # outcomes read back from the log, not re-run
    complete: bool = False    # the search finished (not cut by the budget)
    note: str = ""            # why the problem could not be tuned, when it could not
    suspect_candidates: int = 0   # search timings re-taken, or screens timed in full, as the machine drifted
    suspect_kept: int = 0         # ... and kept as they were: too slow to win even discounting the drift
    evaluated: int = 0        # candidates run in this sweep (not read back from the log)
    pruned: int = 0           # parameter sets never built: this device cannot run them, or its driver refused them
    seconds: dict = field(default_factory=dict)   # where this sweep's time on the problem went (``Split``)

    @property
    def chosen(self) -> dict | None:
        """The parameters the problem's result holds: the confirmation's choice, else the search's best."""
        if self.confirmation is not None:
            return self.confirmation.chosen
        return self.best.params if self.best else None

    @property
    def time_s(self) -> float | None:
        if self.confirmation is not None:
            return self.confirmation.median(self.confirmation.chosen)
        return self.best.time_s if self.best else None

    @property
    def speedup(self) -> float | None:
        """Defaults' time over the chosen parameters' time (from the confirmation where there was one)."""
        if self.confirmation is not None:
            return self.confirmation.gain
        if self.best and self.default and self.default.status == "ok" and self.best.time_s:
            return self.default.time_s / self.best.time_s
        return None

    def rate(self) -> tuple[float | None, float | None]:
        """(GB/s, GFLOP/s) of the chosen parameters."""
        t = self.time_s
        if not t:
            return None, None
        return self.bytes_moved / t / 1e9, self.flops / t / 1e9 if self.flops else None

    def as_dict(self) -> dict:
        gbps, gflops = self.rate()
        c = self.confirmation
        return {"family": self.family, "shape": normal(self.shape), "label": self.label,
                "description": self.description, "bytes_moved": self.bytes_moved, "flops": self.flops,
                "chosen": normal(self.chosen) if self.chosen else None, "time_s": self.time_s,
                "best": self.best.as_dict() if self.best else None,
                "default": self.default.as_dict() if self.default else None,
                "speedup": self.speedup, "gain_interval": list(c.gain_interval) if c else None,
                "verdict": c.verdict if c else None, "confirmation": c.as_dict() if c else None,
                "gb_per_s": gbps, "gflop_per_s": gflops,
                "candidates": len(self.outcomes), "rejected": sum(o.status not in ("ok", "slow")
                                                                  for o in self.outcomes),
                "resumed": self.resumed, "complete": self.complete, "note": self.note,
                "suspect_candidates": self.suspect_candidates, "suspect_kept": self.suspect_kept,
                "evaluated": self.evaluated, "pruned": self.pruned,
                "seconds": {name: round(value, 3) for name, value in self.seconds.items()},
                "outcomes": [o.as_dict() for o in self.outcomes]}


@dataclass
class Refreshed:
    """An entry measured on an older kernel source, checked again on the current one: its parameters
    verified against the float64 reference and timed against the defaults in interleaved rounds."""

    family: str
    shape: dict
    description: str
    params: dict
    kept: bool = False               # re-pinned to the current source (as fast as the defaults or faster)
    reason: str = ""                 # why it was kept, or left for a sweep
    time_s: float | None = None      # median of its rounds
    default_time_s: float | None = None
    gain: float | None = None        # defaults / entry, median ratio
    gain_interval: tuple[float, float] | None = None
    rounds: int = 0
    served: dict = field(default_factory=dict)   # M -> the saved set's time at each M of ``served_ms``

    def as_dict(self) -> dict:
        data = asdict(self)
        data["shape"], data["params"] = normal(self.shape), normal(self.params)
        data["served"] = {str(m): t for m, t in self.served.items()}
        return data


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    head = lines[0] if lines else type(error).__name__
    detail = next((line for line in lines[1:] if "error" in line.lower()), "")
    return f"{head} {detail}".strip()[:300]


def _likeness(want: dict, have: dict | None) -> tuple:
    """How unlike a record's shape is the one wanted, for ordering candidates (smaller first): the keys that
    differ, then the summed |log| ratios of the sizes both have. A shape-less record comes last."""
    if have is None:
        return (float("inf"), 0.0)
    want, have = normal(want), normal(have)
    differing = sum(want.get(key) != have.get(key) for key in set(want) | set(have))
    sizes = sum(abs(math.log(max(want[key], 1) / max(have[key], 1))) for key in set(want) & set(have)
                if isinstance(want[key], (int, float)) and isinstance(have[key], (int, float))
                and not isinstance(want[key], bool) and not isinstance(have[key], bool))
    return (differing, sizes)


def neighbours(space: dict, params: dict) -> list[dict]:
    """Parameter sets one step away: one parameter moved to any other value of its list (adjacent values
    first). Any value, not only the adjacent ones: many parameters are choices, not sizes (READ 0/1/2:
    from image1d_buffer to buffer is one step, though image2d between them may not fit the layout)."""
    result = []
    for name, values in space.items():
        values = list(values)
        if params.get(name) not in values:
            continue
        i = values.index(params[name])
        for j in sorted(range(len(values)), key=lambda j: (abs(j - i), j)):
            if j != i:
                result.append({**params, name: values[j]})
    return result


class DriftWatch:
    """Times a fixed reference kernel (the copy kernel) now and then; says when the machine has drifted from its
    level (thermal throttling, another load), so a timing taken then is re-taken, and waits until the reference is
    back (``cool_down``). Drift is slow (heat builds over seconds): the reference is timed at most every
    ``every_s`` seconds.

    The baseline is the ``quantile`` of the reference's latest ``window`` checks, not the quietest time ever seen:
    where the reference wanders from one check to the next (a CPU's), the quietest of hundreds is an outlier that
    most later checks exceed by the threshold, each setting a round aside on an idle machine. A low quantile of a
    window follows a level the machine keeps (a throttled phone, another program that stays) once it fills most of
    the window, is not raised by a few slow checks, and leaves a departure from that level, a spike or heat
    building, as drift."""

    def __init__(self, reference, threshold: float = DRIFT_THRESHOLD, every_s: float = 0.5,
                 window: int = DRIFT_WINDOW, quantile: float = DRIFT_QUANTILE, poll_s: float = COOL_DOWN_POLL_S,
                 clock=time.perf_counter, sleep=time.sleep):
        self.reference, self.threshold, self.every_s = reference, threshold, every_s
        self.quantile, self.poll_s, self.clock, self.sleep = quantile, poll_s, clock, sleep
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        self.baseline: float | None = None
        self.events = 0
        self.last = -float("inf")
        self.ratio = 1.0   # the reference's time over the baseline, when it last said the machine drifted
        self.waited_s = 0.0   # seconds spent in cool-downs

    def drifted(self) -> bool:
        if self.clock() - self.last < self.every_s:
            return False
        self.last = self.clock()
        now = self.reference()
        if self.baseline is None:
            self._add(now, self.reference(), self.reference())
            return False
        # judged against the level before this check; then the check joins the window, so a slow-down that lasts
        # moves the baseline, and a spike, one check of many above the quantile, does not
        drifted = now > (1 + self.threshold) * self.baseline
        if drifted:
            self.events += 1
            self.ratio = now / self.baseline
        self._add(now)
        return drifted

    def _add(self, *times: float) -> None:
        self.recent.extend(times)
        self.baseline = float(np.quantile(list(self.recent), self.quantile))

    def cool_down(self, limit_s: float) -> float:
        """After a check said the machine drifted: waits until the reference is back within the threshold of the
        baseline, timing it at once and then every ``poll_s`` seconds, at most ``limit_s``; the seconds waited. A
        transient load (another program's burst) ends the wait at the first poll, where a fixed pause cost the
        whole of it each time; heat, slow for seconds, is waited out up to the limit. The next check is made
        whenever it is asked for, so the timing re-taken after the wait is checked too. The polls do not join the
        window: they would fill it with one slow spell."""
        started = self.clock()
        while self.clock() - started < limit_s:
            if self.reference() <= (1 + self.threshold) * self.baseline:
                break
            left = limit_s - (self.clock() - started)
            if left > 0:
                self.sleep(min(self.poll_s, left))
        self.last = -float("inf")
        waited = self.clock() - started
        self.waited_s += waited
        return waited


class RunNoise:
    """How far one run of a screen strays above its candidate's median, lately: the NOISE_QUANTILE
    of the runs' ratios to their own screen's median, over the last NOISE_KEPT of them. A screened candidate whose
    fastest run is slower than the best's median by more than this is cut: were it truly as fast as the best, each
    of its runs would have strayed that far (odds of 1 in 10 each, 1 in 1000 for three)."""

    def __init__(self, floor: float = SCREEN_MARGIN, quantile: float = NOISE_QUANTILE, kept: int = NOISE_KEPT):
        self.floor, self.quantile = floor, quantile
        self.ratios: collections.deque[float] = collections.deque(maxlen=kept)

    def add(self, samples: list[float]) -> None:
        median = statistics.median(samples) if samples else 0.0
        if median > 0:
            self.ratios.extend(s / median for s in samples)

    def margin(self) -> float:
        if len(self.ratios) < 3 * SCREEN_REPEAT:
            return EARLY_MARGIN
        return max(self.floor, float(np.quantile(list(self.ratios), self.quantile)) - 1)


class Split:
    """Where a sweep's time goes: seconds in each of PHASES (setting up a problem's case, building, verifying,
    timing, re-timing after drift, confirming). A phase inside another counts once, in the inner one; the builds
    the thread waited for inside any phase (``compile_seconds``: a device's ``Device.compile_seconds``) count as
    building, wherever they happened."""

    def __init__(self, compile_seconds=lambda: 0.0):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.compile_seconds = compile_seconds
        self._inner: list[list[float]] = []   # per open phase: [seconds, compile seconds] of the phases inside it

    @contextlib.contextmanager
    def phase(self, name: str):
        started, compiled = time.perf_counter(), self.compile_seconds()
        self._inner.append([0.0, 0.0])
        try:
            yield
        finally:
            inner_s, inner_compiled = self._inner.pop()
            elapsed, built = time.perf_counter() - started, self.compile_seconds() - compiled
            own_built = built - inner_compiled
            self.seconds[name] += elapsed - inner_s - own_built
            self.seconds["build"] += own_built
            if self._inner:
                self._inner[-1][0] += elapsed
                self._inner[-1][1] += built

    def since(self, before: dict) -> dict:
        return {name: self.seconds[name] - before.get(name, 0.0) for name in PHASES}


class BuildAhead:
    """Builds the programs of a problem's candidates to come, ``batch`` at a time, many at once
    (``Device.build_many``), from what the spec names (``Spec.programs``; nothing where it names none). On a
    GPU-class device the next batch builds in a thread while the candidates before it are verified and timed; on
    a CPU device the compiler would take the cores a timing measures, so each batch is built before its runs,
    between timings. A build that fails is kept by the device, and the candidate's verification reports it."""

    def __init__(self, device, spec, shape: dict, batch: int = BUILD_AHEAD, background: bool | None = None):
        self.device, self.spec, self.shape, self.batch = device, spec, shape, batch
        self.background = device.caps.device_type != "CPU" if background is None else background
        self.requested: set[str] = set()
        self.pending: concurrent.futures.Future | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="perfx-ahead") \
            if self.background and spec.programs is not None else None
        self.background_s = 0.0   # seconds of builds made in the thread, beside the runs

    def before(self, upcoming: list[dict], split: Split) -> None:
        """Called before ``upcoming[0]`` runs, with the candidates that follow it in order."""
        if self.spec.programs is None or not upcoming:
            return
        if params_key(upcoming[0]) not in self.requested:
            with split.phase("build"):
                self._wait()
                if self.device.programs_kept >= PROGRAMS_KEPT:
                    self.device.forget_programs()
                self._build(self._next(upcoming))
        if self._pool is not None and self.pending is None:
            following = self._next(upcoming)
            if following:
                self.pending = self._pool.submit(self._build, following)

    def _next(self, upcoming: list[dict]) -> list[dict]:
        chosen = []
        for params in upcoming:
            key = params_key(params)
            if key not in self.requested:
                self.requested.add(key)
                chosen.append(params)
                if len(chosen) == self.batch:
                    break
        return chosen

    def _build(self, params_list: list[dict]) -> float:
        report = self.device.build_many(build_requests(self.spec, self.device, self.shape, params_list))
        return report.seconds

    def _wait(self):
        if self.pending is not None:
            self.background_s += self.pending.result()
            self.pending = None

    def close(self):
        """Waits for a build under way (the device's programs stay consistent) and ends the thread."""
        self._wait()
        if self._pool is not None:
            self._pool.shutdown()


def _require_right(spec, case, params: dict, wrong: str) -> None:
    """Raise, saying ``wrong``, unless ``params`` is within the spec's tolerance of the float64 reference on ``case``:
    for a set the tuner times without having verified it in this search (the parameters in force, a set at the other
    Ms of its bucket)."""
    errors = case.errors(params)
    if not all(e <= spec.tolerance_for(params) for e in errors.values()):
        raise PerfxError(f"{spec.params.family}: {wrong} ({max(errors.values()):.2e} > "
                         f"{spec.tolerance_for(params):.0e}); run `perfx selftest`")


class Tuner:
    """Tunes problems on one device into one database.

    ``budget_s`` is shared among the problems still to do; ``progress`` (a perfx.progress.Progress
    over problems) gets a note after every candidate. ``timer`` times a launch function (default: ``time_launches``
    on this device; the tests give a simulated noisy one); ``reference`` returns the time of a fixed reference
    kernel (default: the copy kernel on this device); ``cool_down_s`` is the longest pause before a suspect round is
    taken again (``DriftWatch.cool_down``); ``background_builds``: whether candidates' programs build in a thread
    beside the runs (``BuildAhead``; None: on a GPU-class device).
    """

    def __init__(self, device, database: Database | None = None, budget_s: float = 600.0, seed: int = 0,
                 progress=None, warmup: int = 1, repeat: int = 10, screen_repeat: int = SCREEN_REPEAT,
                 exhaustive_limit: int = EXHAUSTIVE_LIMIT,
                 random_samples: int = RANDOM_SAMPLES, sample_share: float = SAMPLE_SHARE,
                 confirm_top: int = CONFIRM_TOP,
                 confirm_rounds: int = CONFIRM_ROUNDS, timer=None, reference=None,
                 cool_down_s: float = COOL_DOWN_S, drift_threshold: float = DRIFT_THRESHOLD,
                 background_builds: bool | None = None):
        self.device = device
        self.database = database if database is not None else Database()
        self.log = self.database.log(device)
        self.budget_s, self.seed, self.progress = budget_s, seed, progress
        self.warmup, self.repeat, self.screen_repeat = warmup, repeat, min(screen_repeat, repeat)
        self.exhaustive_limit, self.random_samples, self.sample_share = exhaustive_limit, random_samples, sample_share
        self.confirm_top, self.confirm_rounds = confirm_top, confirm_rounds
        # the device named, so a timing does not launch once more to find it (perfx.timing.time_launches)
        self.timer = timer or functools.partial(time_launches, device=device)
        self.cool_down_s = cool_down_s
        self.drift = DriftWatch(reference or copy_kernel(device), drift_threshold)
        self.noise = RunNoise()
        self.started = time.perf_counter()
        self._untuned: dict[tuple, dict] = {}   # (family, shape) -> what runs untuned (``_defaults``)
        self.background_builds = background_builds   # None: on a GPU-class device (BuildAhead)
        self.split = Split(device.compile_seconds)
        self.background_build_s = 0.0   # builds made beside the runs (``BuildAhead``), not in the split

    def time_left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def report(self, results: list[ProblemResult]) -> dict:
        """Where the sweep's time went and what it got for it: candidates run (not resumed), a minute of the
        sweep's wall time, and the seconds of each phase (``Split``)."""
        wall = time.perf_counter() - self.started
        evaluated = sum(r.evaluated for r in results)
        return {"wall_s": round(wall, 3), "candidates": evaluated,
                "candidates_per_minute": round(60 * evaluated / wall, 2) if wall > 0 else None,
                "pruned": sum(r.pruned for r in results),
                "seconds": {name: round(value, 3) for name, value in self.split.seconds.items()},
                "other_s": round(wall - sum(self.split.seconds.values()), 3),
                "cooled_down_s": round(self.drift.waited_s, 3),
                "built_beside_runs_s": round(self.background_build_s, 3)}

    def tune(self, jobs) -> list[ProblemResult]:
        """Tune ``jobs``, a list of (spec, shape, label); results in the same order."""
        results = []
        for i, (spec, shape, label) in enumerate(jobs):
            share = max(self.time_left(), 0.0) / (len(jobs) - i)
            results.append(self.tune_problem(spec, shape, label, time.perf_counter() + share))
            if self.progress is not None:
                self.progress.update(note=self._note(results[-1]))
        return results

    def _note(self, result: ProblemResult) -> str:
        best = f"best {result.time_s * 1e6:.0f} us" if result.time_s else "no valid candidate yet"
        return (f"{result.family} {result.description}: {len(result.outcomes)} candidates, {best}, "
                f"{max(self.time_left(), 0):.0f}s left")

    # -- one problem ---------------------------------------------------------------------------

    def tune_problem(self, spec, shape: dict, label: str = "", deadline: float | None = None) -> ProblemResult:
        """Search one (family, shape) until done or ``deadline`` (perf_counter seconds) passes, then confirm."""
        before = dict(self.split.seconds)
        ahead = BuildAhead(self.device, spec, shape, background=self.background_builds)
        try:
            result = self._tune_problem(spec, shape, label, deadline, ahead)
        finally:
            ahead.close()
            self.background_build_s += ahead.background_s
        result.seconds = self.split.since(before)
        if self.device.programs_kept >= PROGRAMS_KEPT:
            self.device.forget_programs()
        return result

    def _tune_problem(self, spec, shape: dict, label: str, deadline: float | None, ahead: BuildAhead) -> ProblemResult:
        deadline = time.perf_counter() + max(self.time_left(), 0.0) if deadline is None else deadline
        result = ProblemResult(spec.params.family, dict(shape), label, spec.describe(shape),
                               int(spec.bytes_moved(shape)), int(spec.flops(shape)))
        record = self.log.problem(spec, shape)
        crashed = record.pop("running", None)
        if crashed is not None:
            # The process died while this parameter set ran (the driver's compiler or the kernel took it down):
            # on resume it is recorded as such and never run again, so the sweep gets past it.
            record["candidates"].append(Outcome(crashed, "crashed", reason="the process died while it ran (a "
                                                "driver crash); not run again").as_dict())
            self.log.save()
        tried: dict[str, Outcome] = {}
        for data in record["candidates"]:
            outcome = Outcome.from_dict(data)
            tried[params_key(outcome.params)] = outcome
        candidates, result.pruned = self._runnable(spec, shape)
        valid = {params_key(p) for p in candidates}
        # Outcomes of parameter sets the spec no longer allows (its space changed) are kept on disk but
        # never chosen.
        result.outcomes = [o for key, o in tried.items() if key in valid]
        result.resumed = len(result.outcomes)
        self._update_best(result, spec)
        if not candidates:
            result.note = "no parameter set is valid for this shape on this device"
            return result
        defaults = self._defaults(spec, shape)
        if record.get("confirmation") and record.get("complete"):
            result.complete = True
            result.confirmation = Confirmation.from_dict(record["confirmation"])
            self._save_result(spec, result)
            return result
        exhaustive = len(candidates) <= self.exhaustive_limit
        order = self._order(spec, shape, candidates, defaults, result.description)
        # Past the first random_samples, sampling goes on while sample_share of this problem's time lasts: the
        # GPU-class variants couple several parameters (I8 needs LAYOUT 1 and XS 1), so one-step refinement
        # cannot walk into them from another region, and a budget the user gave is better spent sampling.
        sample_until = time.perf_counter() + self.sample_share * max(deadline - time.perf_counter(), 0.0)

        case = None
        started = time.perf_counter()
        # The log is written whole at each save, so its cost grows with the sweep: a candidate's outcome is saved
        # with the next candidate's mark (or at the search's end), one save a candidate rather than two. A process
        # killed between two candidates loses only the last outcome, run again on resume.
        unsaved = False

        def untried(params_list) -> list[dict]:
            return [p for p in params_list if params_key(p) not in tried and params_key(p) in valid]

        def evaluate(params, upcoming=()) -> bool:
            """Run one candidate unless already known; False when out of time. ``upcoming``: the candidates
            after it, whose programs are built ahead."""
            nonlocal case, unsaved
            key = params_key(params)
            if key in tried or key not in valid:
                return True
            if time.perf_counter() > deadline and result.default is not None:
                return False
            if case is None:
                with self.split.phase("setup"):
                    case = spec.make_case(self.device, shape, np.random.default_rng(self.seed))
            # No more built ahead than are likely to run before the deadline, at this problem's pace so far: a
            # budget-cut search would otherwise end with a batch built for nothing (a quarter of a short sweep).
            left = max(deadline - time.perf_counter(), 0.0)
            pace = (time.perf_counter() - started) / result.evaluated if result.evaluated else None
            likely = math.ceil(left / pace) if pace else self.device.build_workers()
            ahead.before([params, *untried(upcoming)][:max(1, likely)], self.split)
            record["running"] = dict(params)   # on disk while it runs: a process that dies there is known on resume
            self.log.save()
            unsaved = False
            try:
                outcome = self._evaluate(spec, case, params, result.best, result)
            except BaseException:   # interrupted (Ctrl-C), not crashed: the candidate runs again on resume
                del record["running"]
                self.log.save()
                raise
            del record["running"]
            tried[key] = outcome
            result.outcomes.append(outcome)
            result.evaluated += 1
            self._update_best(result, spec)
            record["candidates"].append(outcome.as_dict())
            unsaved = True
            if self.progress is not None:
                self.progress.update(0, self._note(result))
            return True

        def sample() -> bool:
            """The defaults, the likely winners, then candidates in random order; False when out of time."""
            for n, params in enumerate(order):
                if not exhaustive and n > self.random_samples and time.perf_counter() > sample_until:
                    return True
                if not evaluate(params, order[n + 1:n + 1 + 4 * BUILD_AHEAD]):
                    return False
            return True

        try:
            try:
                finished = record.get("complete", False) or sample()
                if finished and not record.get("complete") and any(params_key(p) not in tried for p in order):
                    # Local refinement: walk to the best neighbour until none is better.
                    while finished:
                        seen_best = result.best
                        if seen_best is None:
                            break
                        around = neighbours(spec.params.space, seen_best.params)
                        finished = all(evaluate(p, around[i + 1:]) for i, p in enumerate(around))
                        if result.best is seen_best:
                            break
                result.complete = finished and result.best is not None
                if record.get("complete") != result.complete:
                    record["complete"] = result.complete
                    unsaved = True
            finally:
                if unsaved:
                    self.log.save()
            if result.complete:
                if case is None:
                    with self.split.phase("setup"):
                        case = spec.make_case(self.device, shape, np.random.default_rng(self.seed))
                with self.split.phase("confirm"):
                    result.confirmation = self._confirm(spec, shape, case, result)
                record["confirmation"] = result.confirmation.as_dict()
                self.log.save()
        except (PerfxError, DriverError) as e:  # make_case failed: the problem does not fit this device
            result.note = f"could not set up the problem: {_first_line(e)}"
            return result
        self._save_result(spec, result)
        return result

    def _runnable(self, spec, shape: dict) -> tuple[list, int]:
        """(the candidates this device may run, how many sets of the space were pruned before any build): the
        space's sets less those beyond this device's work-group size, local memory or capabilities (subgroups,
        fp16, images: ``ParamSpace.candidates``), less those its driver refused before (they failed to build,
        or broke the kernel's own limits, when a model was loaded: ``Database.refused``)."""
        candidates = spec.params.candidates(shape, self.device.caps)
        everywhere = len(spec.params.candidates(shape))
        refused = self.database.refused(self.device)
        if refused:
            current = source_hash(spec)
            family = spec.params.family
            candidates = [p for p in candidates if (family, params_key(p), current) not in refused]
        return candidates, everywhere - len(candidates)

    def _order(self, spec, shape: dict, candidates: list, defaults: dict, description: str) -> list:
        """The order the search runs ``candidates`` in: the defaults (or what runs untuned), then the likely winners,
        then the rest in a random order. The likely winners are the tuned entries that apply to this device
        (its own, its architecture's, its vendor's: ``Database.choices``), then every entry of this family, of
        any device and shape, the most alike shape first (a sweep's earlier problems are among them: the winner
        for a model's q projection is a likely one for its k projection). A good time found early cuts the slow
        candidates after it short at their screens, and a search the budget stops has timed them."""
        by_key = {params_key(p): p for p in candidates}
        first = [params_key(defaults)] if params_key(defaults) in by_key else []
        for choice in self.database.choices(self.device, spec, shape):
            first.append(params_key(choice.params))
        others = []
        for file in self.database.files():
            for record in file.records:
                if record.get("family") != spec.params.family:
                    continue
                params = {**spec.params.defaults(record["params"]), **record["params"]}
                others.append((_likeness(shape, record.get("shape")), params_key(params)))
        first += [key for _, key in sorted(others, key=lambda item: item[0])]
        first = [key for key in dict.fromkeys(first) if key in by_key]
        placed = set(first)
        rest = [p for key, p in by_key.items() if key not in placed]
        return [by_key[key] for key in first] + random.Random(f"{self.seed}{description}").sample(rest, len(rest))

    def _save_result(self, spec, result: ProblemResult):
        """The problem's chosen parameters, in the device's results file (what look-ups read). A search cut
        by the budget saves its best too (unconfirmed, marked so), so a partial sweep is still used."""
        if result.chosen is None:
            return
        c = result.confirmation
        default = (c.median(self._defaults(spec, result.shape)) if c else
                   result.default.time_s if result.default and result.default.status == "ok" else None)
        record = result_record(spec, result.shape, result.chosen, result.time_s, default, self.device.fingerprint)
        if c is not None:
            record.update(gain=round(c.gain, 4), gain_interval=[round(v, 4) for v in c.gain_interval],
                          rounds=len(c.rounds))
            if c.served:
                record["served_times_s"] = {str(m): t for m, t in c.served.items()}
        else:
            record["comment"] = "unconfirmed: the search was cut by the budget"
        self.database.save_result(self.device, record)

    def _update_best(self, result: ProblemResult, spec):
        ok = [o for o in result.outcomes if o.status == "ok" and o.time_s]
        result.best = min(ok, key=lambda o: o.time_s) if ok else None
        defaults = self._defaults(spec, result.shape)
        result.default = next((o for o in result.outcomes if o.params == defaults), None)

    def _defaults(self, spec, shape: dict) -> dict:
        """What the kernel runs untuned: the defaults, or where they do not fit this shape here, the first set
        that does (``ParamSpace.resolve``); the defaults themselves where no set fits (no outcome matches them
        then). Once per problem: the search asks after every candidate."""
        key = (spec.params.family, params_key(shape))
        if key not in self._untuned:
            try:
                self._untuned[key] = dict(spec.params.resolve(None, shape, self.device.caps))
            except PerfxError:
                self._untuned[key] = spec.params.defaults()
        return self._untuned[key]

    def _timing(self, case, params: dict, **kwargs):
        return time_case(case, params, self.timer, **kwargs)

    def _retaken(self, result: ProblemResult, timing, could_win, retime):
        """``timing``, or where the reference kernel says the machine drifted while it ran, the same timing taken
        again (``retime()``) after a cool-down (once), unless ``could_win(timing, ratio)`` says it could not change
        the outcome even taken as ``ratio`` too slow: drift only slows a timing, so one that, divided by the
        reference's slow-down, still loses is kept as it is (on a busy machine the cool-downs took a quarter of a
        sweep). Taken again as it was taken (``_full``: runs until settled), not in ``repeat`` runs whatever."""
        with self.split.phase("drift"):
            if self.drift.drifted():
                if not could_win(timing, self.drift.ratio):
                    result.suspect_kept += 1
                    return timing
                result.suspect_candidates += 1
                self.drift.cool_down(self.cool_down_s)
                timing = retime()
        return timing

    def _verify(self, spec, case, params: dict) -> tuple[Outcome | None, float, dict]:
        """Run one parameter set and compare it with the float64 reference: (None when it is right, else the
        rejected outcome; its worst relative error; its kernels' info)."""
        try:
            with self.device.watch_kernels() as kernels:
                errors = case.errors(params)
        except BuildError as e:
            return Outcome(params, "build", reason=f"build failed: {_first_line(e)}"), 0.0, {}
        except KernelLimitError as e:
            return (Outcome(params, "limit", reason=f"beyond this driver's limits for the kernel: {_first_line(e)}"),
                    0.0, {})
        except (PerfxError, DriverError) as e:
            return Outcome(params, "launch", reason=f"launch failed: {_first_line(e)}"), 0.0, {}
        except Exception as e:  # a crash in the wrapper for this parameter set: record it, go on
            return Outcome(params, "error", reason=f"{type(e).__name__}: {_first_line(e)}"), 0.0, {}
        worst_name = max(errors, key=lambda name: errors[name]) if errors else None
        worst = errors[worst_name] if errors else 0.0
        tolerance = spec.tolerance_for(params)
        if not worst <= tolerance:  # NaN and inf fail too
            return (Outcome(params, "wrong", error=worst, reason=f"wrong: {worst_name} relative error "
                                                                 f"{worst:.2e} > tolerance {tolerance:.0e}"),
                    worst, kernels)
        return None, worst, kernels

    def _evaluate(self, spec, case, params: dict, best: Outcome | None, result: ProblemResult) -> Outcome:
        """Verify, then time, one candidate."""
        with self.split.phase("verify"):
            rejected, worst, kernels = self._verify(spec, case, params)
        if rejected is not None:
            return rejected
        with self.split.phase("time"):
            return self._time_candidate(case, params, best, result, worst, kernels)

    def _time_candidate(self, case, params: dict, best: Outcome | None, result: ProblemResult, worst: float,
                        kernels: dict) -> Outcome:
        """Successive halving, candidate by candidate (the likely winners come first, so the best so far is a good
        one early): a screen of ``screen_repeat`` short runs; one whose fastest run is slower than the best so far
        by more than the screens' noise (``RunNoise``) is cut short there, and only the rest are timed in full, in
        chunks that stop once more runs could not change the ranking (``_settled``)."""
        try:
            screen = self._timing(case, params, share=SCREEN_SHARE, warmup=0, repeat=self.screen_repeat)
            self.noise.add(screen.samples)
            if best is not None:
                margin = self.noise.margin()
                limit = best.time_s * (1 + margin)
                fastest = min(screen.samples)
                if fastest > limit:
                    # Cut, unless the machine drifted while it ran and, discounted by the drift, it is within reach:
                    # then it is timed in full, which costs less than a cool-down and a second screen. The reference
                    # is asked only within DRIFT_REACH of the limit: past it, the machine would have had to slow by
                    # more than that while the screen ran, and each check costs a reference timing.
                    drifted = False
                    if fastest <= DRIFT_REACH * limit:
                        with self.split.phase("drift"):
                            drifted = self.drift.drifted()
                    if not drifted or fastest / self.drift.ratio > limit:
                        result.suspect_kept += drifted
                        return Outcome(params, "slow", fastest, screen.spread, screen.samples, worst,
                                       f"cut short: its fastest of {len(screen.samples)} short runs "
                                       f"{fastest / best.time_s:.2f}x the best so far, beyond the runs' noise "
                                       f"({margin:.0%})")
                    result.suspect_candidates += 1
            # no warm-up: its screen has just run the same kernels
            timing = self._full(case, params, best, warmup=0)
            if best is not None:
                timing = self._retaken(result, timing, lambda timing, ratio: timing.median_s / ratio <= best.time_s,
                                       lambda: self._full(case, params, best, warmup=self.warmup))
        except (PerfxError, DriverError) as e:
            return Outcome(params, "launch", error=worst, reason=f"launch failed while timing: {_first_line(e)}")
        private = max((info.private_mem for info in kernels.values()), default=None)
        return Outcome(params, "ok", timing.median_s, timing.spread, timing.samples, worst, private_bytes=private)

    def _full(self, case, params: dict, best: Outcome | None, warmup: int) -> Timing:
        """A candidate timed in full: FULL_MIN runs of every copy, then FULL_CHUNK more at a time up to ``repeat``
        until ``_settled``."""
        samples: list[float] = []
        while len(samples) < self.repeat and not self._settled(samples, best):
            samples += self._timing(case, params, warmup=0 if samples else warmup,
                                    repeat=min(FULL_CHUNK if samples else FULL_MIN, self.repeat - len(samples))
                                    ).samples
        return Timing(statistics.median(samples), samples)

    def _settled(self, samples: list[float], best: Outcome | None) -> bool:
        """Whether a candidate timed in full has runs enough (FULL_MIN at least): its median is beyond the screens'
        noise of the best so far (it is no contender; the confirmation ranks the top few again, interleaved), or its
        runs agree (their interquartile range within STEADY_SPREAD of their median). Only a contender for the best,
        the time the screens of the candidates after it are held to, takes more."""
        if len(samples) < min(FULL_MIN, self.repeat):
            return False
        median = statistics.median(samples)
        if best is not None and median > best.time_s * (1 + self.noise.margin()):
            return True
        q1, _, q3 = statistics.quantiles(samples, n=4)
        return q3 - q1 <= STEADY_SPREAD * median

    # -- confirmation ----------------------------------------------------------------------------

    def _incumbent(self, spec, shape: dict) -> dict:
        """The parameters in force before this sweep's result: the database's choice (this device's earlier
        result, else the architecture's or vendor's entry, else the defaults)."""
        choices = self.database.choices(self.device, spec, shape)
        return dict(choices[0].params) if choices else self._defaults(spec, shape)

    def _confirm(self, spec, shape: dict, case, result: ProblemResult) -> Confirmation:
        """Re-time the incumbent, the defaults and the search's top few, interleaved and shuffled over rounds;
        keep the incumbent unless a challenger is faster beyond the noise."""
        incumbent, defaults = self._incumbent(spec, shape), self._defaults(spec, shape)
        ranked = sorted((o for o in result.outcomes if o.status == "ok" and o.time_s), key=lambda o: o.time_s)
        contenders = [incumbent]
        for params in [defaults] + [o.params for o in ranked[:self.confirm_top]]:
            if params not in contenders:
                contenders.append(params)
        verified = {params_key(o.params) for o in result.outcomes if o.status in ("ok", "slow")}
        for params in contenders[:2]:  # the incumbent and the defaults may not have been verified here
            if params_key(params) not in verified:
                _require_right(spec, case, params, f"the parameters in force {params} are wrong on this device")
        rounds, suspect = self._interleaved([(case, p) for p in contenders], f"confirm{result.description}")
        columns = list(zip(*rounds))
        medians = [statistics.median(col) for col in columns]
        best = min(range(len(contenders)), key=lambda i: medians[i])
        rng = np.random.default_rng(self.seed)
        chosen, verdict, ratio, interval = incumbent, "the incumbent is fastest", 1.0, (1.0, 1.0)
        if best != 0:
            ratio, low, high = bootstrap_ratio(columns[best], columns[0], rng)
            interval = (low, high)
            if high < 1.0:
                chosen, verdict = contenders[best], "replaced the incumbent"
            else:
                verdict = (f"no significant difference: {ratio:.3f}× the incumbent's time, interval "
                           f"[{low:.3f}, {high:.3f}] includes 1")
        gain, gain_low, gain_high = bootstrap_ratio(columns[contenders.index(defaults)],
                                                    columns[contenders.index(chosen)], rng)
        return Confirmation(contenders, [list(r) for r in rounds], chosen, verdict, ratio, interval, gain,
                            (gain_low, gain_high), suspect, self._served(spec, shape, case, chosen))

    def _interleaved(self, runs: list[tuple], seed_text: str) -> tuple[list[list[float]], int]:
        """``confirm_rounds`` rounds, each timing every run, a (case, parameters) pair, once in a shuffled order; a
        round during which the machine drifted is set aside after a cool-down and taken again. (rounds, rounds set
        aside)."""
        shuffle = random.Random(f"{self.seed}{seed_text}")
        rounds, suspect = [], 0
        while len(rounds) < self.confirm_rounds:
            order = list(range(len(runs)))
            shuffle.shuffle(order)
            times = [0.0] * len(runs)
            for i in order:
                case, params = runs[i]
                times[i] = self._timing(case, params, warmup=1, repeat=3).median_s
            with self.split.phase("drift"):
                retake = self.drift.drifted() and suspect < self.confirm_rounds
                if retake:
                    self.drift.cool_down(self.cool_down_s)
            if retake:
                suspect += 1
                continue
            rounds.append(times)
        return rounds, suspect

    def _served(self, spec, shape: dict, case, params: dict) -> dict[int, float]:
        """M -> the median time of ``params`` at each M of ``served_ms`` (``case`` is the shape's own, at its M),
        interleaved over ``confirm_rounds`` rounds so the times are of one run: what the plan compares the kinds of
        a product by (``perfx.plan``). Empty for a family not compared by kind, or a bucket timed at one M. The set
        is verified at each M first (the shape's own M among them: a refreshed entry may not have been verified
        here)."""
        ms = served_ms(shape["m"]) if spec.compared_kind and "m" in shape else ()
        if len(ms) < 2:
            return {}
        cases = {m: case if m == shape["m"] else spec.make_case(self.device, {**shape, "m": m},
                                                                  np.random.default_rng(self.seed)) for m in ms}
        for m, at in cases.items():
            _require_right(spec, at, params, f"{params} is wrong at M = {m} on this device")
        rounds, _ = self._interleaved([(cases[m], params) for m in ms], f"served{spec.describe(shape)}")
        return {m: statistics.median(column) for m, column in zip(ms, zip(*rounds))}

    # -- refreshing entries of an older kernel source ----------------------------------------------

    def refresh(self, entries) -> list[Refreshed]:
        """Check again ``entries``, (spec, record) pairs measured on an older kernel source (``Database.
        stale_records``): each record's parameters are verified on the current source and timed against the
        defaults, interleaved over ``confirm_rounds`` rounds. One at least as fast as the defaults on the
        median is saved to this device's results, pinned to the current source (the rule by which shipped
        entries are curated), and so is an entry of the defaults, timed again; the rest are left for a sweep. A changed source seldom changes which parameters
        win, and this costs a few seconds an entry where a sweep costs minutes."""
        results = []
        for spec, record in entries:
            results.append(self.refresh_entry(spec, record))
            if self.progress is not None:
                r = results[-1]
                self.progress.update(note=f"{r.family} {r.description}: {'kept' if r.kept else 'left'}")
        return results

    def refresh_entry(self, spec, record: dict) -> Refreshed:
        shape = record["shape"]
        params = {**spec.params.defaults(record["params"]), **record["params"]}
        result = Refreshed(spec.params.family, dict(shape), spec.describe(shape), params)
        why = spec.params.why_invalid(params, shape, self.device.caps)
        if why is not None:
            result.reason = f"no longer valid here: {why}"
            return result
        defaults = self._defaults(spec, shape)
        same = params_key(params) == params_key(defaults)
        try:
            case = spec.make_case(self.device, shape, np.random.default_rng(self.seed))
        except (PerfxError, DriverError) as e:
            result.reason = f"could not set up the problem: {_first_line(e)}"
            return result
        if measured_on_current_source(spec, record):
            # Due only for its times at the Ms its bucket serves (``Database.stale_records``): its parameters and
            # time stand as measured (a sweep confirmed them), and those times are added, of one run.
            saved = {**record, "comment": "its times at each M its bucket serves added by a refresh"}
            result.kept, result.reason, result.time_s = True, "timed at each M its bucket serves", record.get("time_s")
            self._save_refreshed(spec, shape, case, params, saved, result)
            return result
        contenders = [params] if same else [params, defaults]
        for which, candidate in zip(("the entry", "the defaults"), contenders):
            rejected, _, _ = self._verify(spec, case, candidate)
            if rejected is not None:
                result.reason = f"{which} failed on the current source: {rejected.reason}"
                return result
        # An entry of the defaults is timed too: its time is what the plan weighs one kernel against another
        # by (the prefill GEMMs of a bucket).
        rounds, _ = self._interleaved([(case, p) for p in contenders], f"refresh{result.description}")
        columns = [list(column) for column in zip(*rounds)]
        entry, default = columns[0], columns[-1]   # the same column when the entry is the defaults
        gain, low, high = (1.0, 1.0, 1.0) if same else bootstrap_ratio(default, entry, np.random.default_rng(self.seed))
        result.time_s, result.default_time_s = statistics.median(entry), statistics.median(default)
        result.gain, result.gain_interval, result.rounds = gain, (low, high), len(rounds)
        text = "the defaults, timed again" if same else f"{gain:.2f}x [{low:.2f}, {high:.2f}] the defaults' speed"
        if gain < 1.0:
            # The defaults take the entry's place, with their time: the plan weighs one kernel against another by
            # the times of the exact shape (the prefill GEMMs of a bucket), so dropping the entry would drop
            # the kernel from that choice too.
            result.reason = f"slower than the defaults on the median: {text}; the defaults' time kept instead"
            saved = result_record(spec, shape, defaults, result.default_time_s, result.default_time_s,
                                  self.device.fingerprint)
            saved.update(gain=1.0, rounds=len(rounds), comment="refreshed: the defaults, faster than an entry of "
                                                               "an older kernel source, timed on this one")
            self._save_refreshed(spec, shape, case, defaults, saved, result)
            return result
        result.kept, result.reason = True, text
        saved = result_record(spec, shape, params, result.time_s, result.default_time_s, self.device.fingerprint)
        saved.update(gain=round(gain, 4), gain_interval=[round(low, 4), round(high, 4)], rounds=len(rounds),
                     comment="refreshed: an entry of an older kernel source, verified and timed again on this one")
        self._save_refreshed(spec, shape, case, params, saved, result)
        return result

    def _save_refreshed(self, spec, shape: dict, case, params: dict, saved: dict, result: Refreshed):
        """Save a refreshed record, with its times at each M its bucket serves where its family is compared by
        kind (``_served``)."""
        try:
            result.served = self._served(spec, shape, case, params)
        except PerfxError as error:
            result.kept, result.reason = False, str(error)
            return
        if result.served:
            saved["served_times_s"] = {str(m): t for m, t in result.served.items()}
        self.database.save_result(self.device, saved)
