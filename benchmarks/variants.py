"""Each kind of kernel variant against its fp32 / portable counterpart, on this device, in one run.

For every problem of a model (``tuning/problems.py``) in the chosen families, the candidates are grouped
into kinds (the GPU-class switches: layout, subgroup reduction, fp16 arithmetic, x sharing, ...). Every
candidate is verified and timed once (the search); then the best of each kind is timed again in
interleaved rounds beside the copy-bandwidth kernel, so each kind is compared with the others under the same
conditions. Reports median time, spread over the rounds, GB/s and % of the copy bandwidth of that run.

    PERFX_DEVICE=intel python benchmarks/variants.py gemv_q4 [--model default] [--rounds 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from perfx.runtime import Device
from perfx.timing import copy_bandwidth, time_launches
from perfx.tuning import SPECS
from perfx.tuning.problems import problems_for

# The parameters that make a kind of variant, per family (the rest are sizes the search tunes within a kind).
KIND_KEYS = {
    "gemv_q4": ("LAYOUT", "SG", "HALF", "XS", "I8"),
    "gemv_f16": ("SG", "HALF"),
    "rmsnorm": ("SG",),
    "argmax": ("SG",),
    "attention_decode": ("HALF",),
    "attention_prefill": ("HALF", "DSPLIT"),
    "gemm_q4_skinny": ("LAYOUT",),
    "gemm_q4_tiled": ("LAYOUT",),
    "gemm_q4_f16": ("LAYOUT",),
    "gemm_q4_lanes": ("LAYOUT",),
}


def kind_of(family: str, params: dict) -> str:
    keys = [k for k in KIND_KEYS.get(family, ()) if k in params]
    return " ".join(f"{k}={params[k]}" for k in keys) or "all"


def run(device, family: str, model: str, rounds: int, max_m: int, only: str | None, log) -> list[dict]:
    spec = SPECS[family]
    problems, _ = problems_for(model, {family: spec}, max_m=max_m)
    if only:
        problems = [p for p in problems if only in p.label]
    rows = []
    for problem in problems:
        shape = dict(problem.shape)
        weight_bytes = spec.bytes_moved(shape)
        started = time.perf_counter()
        case = spec.make_case(device, shape, np.random.default_rng(0))
        best: dict[str, tuple[float, dict, float]] = {}
        rejected = 0
        for params in spec.params.candidates(shape, device.caps):
            try:
                errors = case.errors(params)
                error = max(errors.values()) if errors else 0.0
                if not error <= spec.tolerance_for(params):
                    rejected += 1
                    continue
                t = time_launches(lambda: case.launch(params), warmup=1, repeat=3, rotate=case.rotate).median_s
            except Exception as e:  # noqa: BLE001 - a variant that fails here is reported, not fatal
                log(f"  {params}: {str(e).splitlines()[0][:160]}")
                rejected += 1
                continue
            kind = kind_of(family, params)
            if kind not in best or t < best[kind][0]:
                best[kind] = (t, params, error)
        search_s = time.perf_counter() - started
        # Interleaved rounds: each kind's best and the copy kernel, round after round.
        samples: dict[str, list[float]] = {kind: [] for kind in best}
        copies = []
        for _ in range(rounds):
            copies.append(copy_bandwidth(device, 32 << 20, repeat=3)[0])
            for kind, (_, params, _) in best.items():
                samples[kind].append(time_launches(lambda: case.launch(params), warmup=1, repeat=5,
                                                   rotate=case.rotate).median_s)
        copy_gbs = statistics.median(copies)
        log(f"\n{family} {problem.label} {spec.describe(problem.shape)}: {len(best)} kinds, search {search_s:.0f}s, "
            f"{rejected} rejected; copy {copy_gbs:.1f} GB/s (spread {(max(copies) - min(copies)) / copy_gbs:.0%})")
        for kind, times in sorted(samples.items(), key=lambda item: statistics.median(item[1])):
            median = statistics.median(times)
            spread = (max(times) - min(times)) / median
            gbs = weight_bytes / median / 1e9
            flops = spec.flops(problem.shape)
            row = {"family": family, "label": problem.label, "shape": problem.shape, "kind": kind,
                   "params": best[kind][1], "error": best[kind][2], "median_s": median, "spread": spread,
                   "samples_s": times, "gb_per_s": gbs, "copy_gb_per_s": copy_gbs,
                   "gflop_per_s": flops / median / 1e9 if flops else None}
            rows.append(row)
            log(f"  {kind:30s} {median * 1e6:9.1f} us ±{spread:4.0%}  {gbs:6.2f} GB/s = {100 * gbs / copy_gbs:3.0f}% "
                f"of copy" + (f"  {row['gflop_per_s']:6.1f} GFLOP/s" if flops else "")
                + f"  err {best[kind][2]:.1e}  {best[kind][1]}")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", help="comma-separated kernel families")
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--max-m", type=int, default=1)
    parser.add_argument("--only", help="only problems whose label contains this")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    device = Device()
    log = lambda text: print(text, flush=True)  # noqa: E731
    log(f"{device.caps.platform} / {device.caps.name}, {args.model}")
    rows = []
    for family in args.families.split(","):
        rows += run(device, family.strip(), args.model, args.rounds, args.max_m, args.only, log)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device.fingerprint, "model": args.model, "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
