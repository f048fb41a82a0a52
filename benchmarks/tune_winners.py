"""Do two sweeps choose parameters as fast? Their chosen sets timed against each other, interleaved, on this device.

Takes two `perfx tune --json` outputs (say, a sweep of the tree before a tuner change and one after, each from
cold caches) and, for every problem both tuned, times A's chosen set, B's and the defaults as the tuner times
them (copies past the cache, replayed back to back), in shuffled order over interleaved rounds. Each is verified
against the float64 reference first. Prints B / A (time ratio, median with its 95% bootstrap interval: below 1,
B's choice is faster) and each against the defaults.

    perfx tune --kernels gemv_q4 --budget 100000 --json > a.json    # each sweep from an empty PERFX_CACHE
    python benchmarks/tune_winners.py a.json b.json [--rounds 9] [--device intel]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from perfx.commands.bench import interleaved
from perfx.runtime import get_device
from perfx.timing import bootstrap_ratio
from perfx.tuning import SPECS
from perfx.tuning.database import params_key
from perfx.tuning.spec import time_case


def chosen(path: str) -> dict:
    """(family, shape key) -> (shape, chosen parameters, description) of a `perfx tune --json` output."""
    with open(path, encoding="utf-8") as file:
        data = json.load(file)
    return {(p["family"], params_key(p["shape"])): (p["shape"], p["chosen"], p["description"])
            for p in data["problems"] if p.get("chosen")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="the first sweep's `perfx tune --json` output")
    parser.add_argument("b", help="the second's")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    device, rng = get_device(args.device), np.random.default_rng(0)
    a, b = chosen(args.a), chosen(args.b)
    print(f"{device.caps.platform} / {device.caps.name}, {args.rounds} interleaved rounds, µs a product (median)")
    print("| kernel | shape | A's set | B's set | A µs | B µs | defaults µs | B / A [95%] | defaults / B [95%] |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in [key for key in a if key in b]:
        family, _ = key
        spec = SPECS[family]
        shape, params_a, description = a[key]
        params_b = b[key][1]
        case = spec.make_case(device, shape, np.random.default_rng(0))
        defaults = dict(spec.params.resolve(None, shape, device.caps))
        contenders = [params_a, params_b, defaults]
        for params in contenders:
            errors = case.errors(params)
            if not all(e <= spec.tolerance_for(params) for e in errors.values()):
                raise SystemExit(f"{family} {description}: {params} is wrong here ({max(errors.values()):.2e})")
        rounds = interleaved(lambda p: time_case(case, p, warmup=1, repeat=3, device=device).median_s, contenders,
                             args.rounds)
        ta, tb, td = (list(column) for column in zip(*rounds))
        ratio, low, high = bootstrap_ratio(tb, ta, rng)
        gain, glow, ghigh = bootstrap_ratio(td, tb, rng)
        same = "(same)" if params_key(params_a) == params_key(params_b) else ""
        print(f"| {family} | {description} | {_short(params_a)} | {_short(params_b)} {same} | "
              f"{np.median(ta) * 1e6:.1f} | {np.median(tb) * 1e6:.1f} | {np.median(td) * 1e6:.1f} | "
              f"{ratio:.3f} [{low:.3f}, {high:.3f}] | {gain:.2f} [{glow:.2f}, {ghigh:.2f}] |")
    return 0


def _short(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


if __name__ == "__main__":
    raise SystemExit(main())
