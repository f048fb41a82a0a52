"""The autotuner: verified, timed sweeps of a family's parameter space, one problem at a time.

Every candidate is first run and compared with the float64 reference on this device; only a
candidate within the spec's tolerance is timed, and only a timed one may be chosen. One that does
not build, fails at launch or is wrong is recorded with the reason. Each outcome goes to the
device's resume log as it comes (atomically), so an interrupted sweep resumes without re-timing
anything; the best of a problem goes to the device's results file when its search ends.

Search (after CLBlast's and kernel_tuner's tuners): the defaults first (the speed-up baseline), then
every candidate where the space is small, else a random sample followed by local refinement (each
parameter moved to its neighbouring values) around the best, until nothing improves or the
problem's share of the budget is spent. A candidate whose first timed run is clearly slower than the
best so far is cut short.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import pyopencl as cl

from perfx.errors import PerfxError
from perfx.runtime import BuildError
from perfx.timing import time_launches
from perfx.tuning.database import Database, normal, params_key, result_record

EXHAUSTIVE_LIMIT = 48   # spaces up to this many candidates are searched exhaustively
RANDOM_SAMPLES = 24     # otherwise: this many random candidates before local refinement
CUT_FACTOR = 2.0        # a first run this many times slower than the best so far is cut short
STATUSES = ("ok", "slow", "wrong", "build", "launch", "error")


@dataclass
class Outcome:
    """What happened to one candidate. Only "ok" outcomes may be chosen."""

    params: dict
    status: str                      # one of STATUSES
    time_s: float | None = None      # median device time
    spread: float | None = None      # (max − min) / median of the samples
    samples: list = field(default_factory=list)
    error: float | None = None       # worst relative error over the outputs
    reason: str = ""

    def as_dict(self) -> dict:
        data = asdict(self)
        data["params"] = normal(self.params)
        if data["error"] is not None and data["error"] == float("inf"):
            data["error"] = None  # JSON has no inf; the reason says it
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Outcome:
        return cls(**{k: data.get(k) for k in ("params", "status", "time_s", "spread", "error")},
                   samples=list(data.get("samples") or []), reason=data.get("reason") or "")


@dataclass
class ProblemResult:
    family: str
    shape: dict
    label: str
    description: str
    bytes_moved: int
    flops: int
    outcomes: list[Outcome] = field(default_factory=list)
    best: Outcome | None = None
    default: Outcome | None = None
    resumed: int = 0          # outcomes read back from the database, not re-run
    complete: bool = False    # the search finished (not cut by the budget)
    note: str = ""            # why the problem could not be tuned, when it could not

    @property
    def speedup(self) -> float | None:
        if self.best and self.default and self.default.status == "ok" and self.best.time_s:
            return self.default.time_s / self.best.time_s
        return None

    def rate(self, outcome: Outcome | None = None) -> tuple[float | None, float | None]:
        """(GB/s, GFLOP/s) of an outcome (the best by default)."""
        outcome = outcome or self.best
        if outcome is None or not outcome.time_s:
            return None, None
        return (self.bytes_moved / outcome.time_s / 1e9,
                self.flops / outcome.time_s / 1e9 if self.flops else None)

    def as_dict(self) -> dict:
        gbps, gflops = self.rate()
        return {"family": self.family, "shape": normal(self.shape), "label": self.label,
                "description": self.description, "bytes_moved": self.bytes_moved, "flops": self.flops,
                "best": self.best.as_dict() if self.best else None,
                "default": self.default.as_dict() if self.default else None,
                "speedup": self.speedup, "gb_per_s": gbps, "gflop_per_s": gflops,
                "candidates": len(self.outcomes), "rejected": sum(o.status not in ("ok", "slow")
                                                                  for o in self.outcomes),
                "resumed": self.resumed, "complete": self.complete, "note": self.note,
                "outcomes": [o.as_dict() for o in self.outcomes]}


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    head = lines[0] if lines else type(error).__name__
    detail = next((line for line in lines[1:] if "error" in line.lower()), "")
    return f"{head} {detail}".strip()[:300]


def neighbours(space: dict, params: dict) -> list[dict]:
    """Parameter sets one step away: one parameter moved to an adjacent value of its list."""
    result = []
    for name, values in space.items():
        values = list(values)
        if params.get(name) not in values:
            continue
        i = values.index(params[name])
        for j in (i - 1, i + 1):
            if 0 <= j < len(values):
                result.append({**params, name: values[j]})
    return result


class Tuner:
    """Tunes problems on one device into one database.

    ``budget_s`` is shared among the problems still to do; ``progress`` (a perfx.progress.Progress
    over problems) gets a note after every candidate.
    """

    def __init__(self, device, database: Database | None = None, budget_s: float = 600.0, seed: int = 0,
                 progress=None, warmup: int = 2, repeat: int = 10, exhaustive_limit: int = EXHAUSTIVE_LIMIT,
                 random_samples: int = RANDOM_SAMPLES):
        self.device = device
        self.database = database if database is not None else Database()
        self.log = self.database.log(device)
        self.budget_s, self.seed, self.progress = budget_s, seed, progress
        self.warmup, self.repeat = warmup, repeat
        self.exhaustive_limit, self.random_samples = exhaustive_limit, random_samples
        self.started = time.perf_counter()

    def time_left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def tune(self, jobs) -> list[ProblemResult]:
        """Tune ``jobs``, a list of (spec, shape, label); results in the same order."""
        results = []
        for i, (spec, shape, label) in enumerate(jobs):
            share = max(self.time_left(), 0.0) / (len(jobs) - i)
            results.append(self.tune_problem(spec, shape, label, time.perf_counter() + share))
            if self.progress is not None:
                self.progress.update(note=self._note(results[-1], share))
        return results

    def _note(self, result: ProblemResult, left: float) -> str:
        best = f"best {result.best.time_s * 1e6:.0f} us" if result.best else "no valid candidate yet"
        return (f"{result.family} {result.description}: {len(result.outcomes)} candidates, {best}, "
                f"{max(self.time_left(), 0):.0f}s left")

    # -- one problem ---------------------------------------------------------------------------

    def tune_problem(self, spec, shape: dict, label: str = "", deadline: float | None = None) -> ProblemResult:
        """Search one (family, shape) until done or ``deadline`` (perf_counter seconds) passes."""
        deadline = time.perf_counter() + max(self.time_left(), 0.0) if deadline is None else deadline
        caps = self.device.caps
        result = ProblemResult(spec.family, dict(shape), label, spec.describe(shape),
                               int(spec.bytes_moved(shape)), int(spec.flops(shape)))
        record = self.log.problem(spec, shape)
        tried: dict[str, Outcome] = {}
        for data in record["candidates"]:
            outcome = Outcome.from_dict(data)
            tried[params_key(outcome.params)] = outcome
        candidates = spec.candidates(shape, caps)
        valid = {params_key(p) for p in candidates}
        # Outcomes of parameter sets the spec no longer allows (its space changed) are kept on disk but
        # never chosen.
        result.outcomes = [o for key, o in tried.items() if key in valid]
        result.resumed = len(result.outcomes)
        self._update_best(result, spec)
        defaults = spec.defaults()
        if not candidates:
            result.note = "no parameter set is valid for this shape on this device"
            return result
        if defaults in candidates:
            candidates.remove(defaults)
            candidates.insert(0, defaults)
        exhaustive = len(candidates) <= self.exhaustive_limit
        order = candidates[:1] + random.Random(f"{self.seed}{result.description}").sample(
            candidates[1:], len(candidates) - 1)
        if not exhaustive:
            order = order[:1 + self.random_samples]
        if record.get("complete") and result.best is not None:
            result.complete = True
            self._save_result(spec, result)
            return result

        case = None

        def evaluate(params) -> bool:
            """Run one candidate unless already known; False when out of time."""
            nonlocal case
            key = params_key(params)
            if key in tried or key not in valid:
                return True
            if time.perf_counter() > deadline and result.default is not None:
                return False
            if case is None:
                case = spec.make_case(self.device, shape, np.random.default_rng(self.seed))
            outcome = self._evaluate(spec, case, params, result.best)
            tried[key] = outcome
            result.outcomes.append(outcome)
            self._update_best(result, spec)
            record["candidates"].append(outcome.as_dict())
            self.log.save()
            if self.progress is not None:
                self.progress.update(0, self._note(result, deadline - time.perf_counter()))
            return True

        try:
            finished = all(evaluate(params) for params in order)
            if finished and not exhaustive:
                # Local refinement: walk to the best neighbour until none is better.
                while finished:
                    seen_best = result.best
                    if seen_best is None:
                        break
                    finished = all(evaluate(p) for p in neighbours(spec.space, seen_best.params))
                    if result.best is seen_best:
                        break
        except (PerfxError, cl.Error) as e:  # make_case failed: the problem does not fit this device
            result.note = f"could not set up the problem: {_first_line(e)}"
            return result
        result.complete = finished and result.best is not None
        if record.get("complete") != result.complete:
            record["complete"] = result.complete
            self.log.save()
        self._save_result(spec, result)
        return result

    def _save_result(self, spec, result: ProblemResult):
        """The problem's best, in the device's results file (what look-ups read)."""
        if result.best is None:
            return
        default = result.default.time_s if result.default and result.default.status == "ok" else None
        self.database.save_result(self.device, result_record(spec, result.shape, result.best.params,
                                                             result.best.time_s, default,
                                                             self.device.fingerprint))

    def _update_best(self, result: ProblemResult, spec):
        ok = [o for o in result.outcomes if o.status == "ok" and o.time_s]
        result.best = min(ok, key=lambda o: o.time_s) if ok else None
        defaults = spec.defaults()
        result.default = next((o for o in result.outcomes if o.params == defaults), None)

    def _evaluate(self, spec, case, params: dict, best: Outcome | None) -> Outcome:
        """Verify, then time, one candidate."""
        try:
            errors = case.errors(params)
        except BuildError as e:
            return Outcome(params, "build", reason=f"build failed: {_first_line(e)}")
        except (PerfxError, cl.Error) as e:
            return Outcome(params, "launch", reason=f"launch failed: {_first_line(e)}")
        except Exception as e:  # a crash in the wrapper for this parameter set: record it, go on
            return Outcome(params, "error", reason=f"{type(e).__name__}: {_first_line(e)}")
        worst_name = max(errors, key=lambda name: errors[name]) if errors else None
        worst = errors[worst_name] if errors else 0.0
        tolerance = spec.tolerance_for(params)
        if not worst <= tolerance:  # NaN and inf fail too
            return Outcome(params, "wrong", error=worst,
                           reason=f"wrong: {worst_name} relative error {worst:.2e} > tolerance {tolerance:.0e}")
        launch = lambda: case.launch(params)  # noqa: E731
        try:
            if best is not None:
                probe = time_launches(launch, warmup=1, repeat=1, rotate=case.rotate)
                if probe.median_s > CUT_FACTOR * best.time_s:
                    return Outcome(params, "slow", probe.median_s, 0.0, probe.samples, worst,
                                   f"cut short: first run {probe.median_s / best.time_s:.1f}x the best so far")
            cap = CUT_FACTOR * best.time_s * self.repeat + 0.05 if best is not None else None
            timing = time_launches(launch, warmup=self.warmup, repeat=self.repeat, rotate=case.rotate,
                                   max_seconds=cap)
        except (PerfxError, cl.Error) as e:
            return Outcome(params, "launch", error=worst, reason=f"launch failed while timing: {_first_line(e)}")
        return Outcome(params, "ok", timing.median_s, timing.spread, timing.samples, worst)
