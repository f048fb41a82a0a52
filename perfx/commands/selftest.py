"""`perfx selftest`: every kernel family checked on the user's own device against the float64 references.

This is how a user with a Snapdragon phone learns that perfx's kernels compute the right thing on
*their* driver: each spec's test shapes, at the defaults and (without ``--quick``) at every parameter
set the tuner may choose on this device, fresh random inputs, outputs poisoned first.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from perfx.errors import PerfxError
from perfx.progress import Progress, format_table
from perfx.runtime import DEVICE_HELP, Device, KernelLimitError
from perfx.tuning import Spec, select_specs


def add_arguments(parser):
    parser.add_argument("--device", help=DEVICE_HELP)
    parser.add_argument("--quick", action="store_true", help="defaults only, one shape per family (about a minute)")
    parser.add_argument("--kernels", help="comma-separated kernel families; a prefix names a group (default: all)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every check, not only failures")


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

    @property
    def failed(self) -> bool:
        return not self.passed and not self.refused


def plan(all_specs: dict[str, Spec], device: Device, quick: bool) -> list[tuple[Spec, dict, dict]]:
    jobs = []
    for spec in all_specs.values():
        shapes = spec.test_shapes[:1] if quick else spec.test_shapes
        for shape in shapes:
            candidates = spec.params.candidates(shape, device.caps)
            defaults = spec.params.defaults()
            if quick:  # the defaults, or where they cannot run here (a capability) the first set that can
                candidates = [c for c in candidates if c == defaults] or candidates[:1]
            jobs.extend((spec, shape, params) for params in candidates)
    return jobs


def run_checks(device: Device, all_specs: dict[str, Spec], quick: bool = False, seed: int = 0,
               show_progress: bool | None = None, checks: list[Check] | None = None) -> list[Check]:
    """Every planned check, in order. ``checks``: a list each result is appended to as it comes, so a caller
    interrupted part way (Ctrl-C on a phone's long selftest) still has those done."""
    jobs = plan(all_specs, device, quick)
    progress = Progress(len(jobs), "selftest", enabled=show_progress)
    checks = [] if checks is None else checks
    cases = {}
    rng = np.random.default_rng(seed)
    for spec, shape, params in jobs:
        key = (spec.params.family, spec.describe(shape))
        try:
            if key not in cases:
                cases[key] = spec.make_case(device, shape, rng)
            errors = cases[key].errors(params)
            error = max(errors.values()) if errors else 0.0
            tolerance = spec.tolerance_for(params)
            checks.append(Check(spec.params.family, params, key[1], error, tolerance, bool(error <= tolerance)))
        except KernelLimitError as e:
            checks.append(Check(spec.params.family, params, key[1], float("inf"), spec.tolerance_for(params),
                                False, refused=str(e).splitlines()[0]))
        except PerfxError as e:  # a build or launch failure on this driver: report it, go on
            checks.append(Check(spec.params.family, params, key[1], float("inf"), spec.tolerance_for(params),
                                False, str(e).splitlines()[0]))
        progress.update(note=spec.params.family)
    progress.close()
    return checks


def checks_table(checks: list[Check]) -> str:
    rows = [("kernel", "parameters", "shape", "max rel err", "tolerance", "result")]
    for c in checks:
        params = " ".join(f"{k}={v}" for k, v in c.params.items())
        result = ("pass" if c.passed else "refused by the driver: " + c.refused if c.refused
                  else "FAIL: " + c.failure if c.failure else "FAIL")
        rows.append((c.kernel, params, c.shape, f"{c.error:.2e}", f"{c.tolerance:.0e}", result))
    return format_table(rows)


def summary_table(checks: list[Check], all_specs: dict[str, Spec]) -> str:
    rows = [("kernel", "checks", "failed", "refused", "worst passing err", "tolerance")]
    for family, spec in all_specs.items():
        mine = [c for c in checks if c.kernel == family]
        worst = max((c.error for c in mine if c.passed), default=0.0)
        rows.append((family, len(mine), sum(c.failed for c in mine), sum(bool(c.refused) for c in mine),
                     f"{worst:.2e}", f"{spec.tolerance:.0e}"))
    return format_table(rows)


def main(args) -> int:
    device = Device(args.device)
    all_specs = select_specs(args.kernels)
    started = time.perf_counter()
    print(f"perfx selftest on {device.caps.platform} / {device.caps.name} (limits: {device.caps.limits})",
          file=sys.stderr)
    checks, interrupted = [], False
    try:
        run_checks(device, all_specs, quick=args.quick, show_progress=False if args.json else None, checks=checks)
    except KeyboardInterrupt:
        interrupted = True
        print(f"perfx selftest: interrupted after {len(checks)} checks; those follow", file=sys.stderr)
    passed, failed = sum(c.passed for c in checks), sum(c.failed for c in checks)
    refused = len(checks) - passed - failed
    if args.json:
        print(json.dumps({"device": device.fingerprint, "limits": device.caps.limits, "quick": args.quick,
                          "interrupted": interrupted, "passed": passed, "failed": failed, "refused": refused,
                          "checks": [asdict(c) for c in checks]}, indent=1, default=float))
    else:
        shown = checks if args.verbose else [c for c in checks if c.failed]
        if shown:
            print(checks_table(shown))
        print(summary_table(checks, all_specs))
        print(f"{passed} passed, {failed} failed"
              + (f", {refused} refused by the driver's limits for the kernel (never chosen here)" if refused else "")
              + " "
              f"({time.perf_counter() - started:.1f}s){', interrupted' if interrupted else ''}")
    return 130 if interrupted else 1 if failed else 0
