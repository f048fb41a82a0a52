"""gemv_q4_split against gemv_q4 at a model's int4 decode GEMVs, on this device, interleaved.

For each int4 decode GEMV of the model (``perfx.tuning.gemv_index.model_shapes``), each family runs the set the
tuning database chooses here (a `perfx tune --kernels gemv_q4,gemv_q4_split` entry where there is one, else
the defaults); gemv_q4_split's defaults run too. Both families' cases are made with the same seed, so they read
the same weights and x. Every contender is verified against the float64 reference, then timed as the tuner
times (copies past the cache, replayed back to back) in interleaved shuffled rounds; each ratio to gemv_q4 is
the median with its 95% bootstrap interval over the rounds.

    PERFX_DEVICE=intel python benchmarks/gemv_split.py [--model smollm2-135m] [--rounds 7]
"""

from __future__ import annotations

import argparse

import numpy as np

from perfx.commands.bench import interleaved
from perfx.runtime import Device
from perfx.timing import bootstrap_ratio
from perfx.tuning import SPECS
from perfx.tuning.database import default_database
from perfx.tuning.gemv_index import model_shapes
from perfx.tuning.spec import time_case


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a synthetic preset (perfx.sources.synthetic)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device, database, rng = Device(), default_database(True), np.random.default_rng(0)
    print(f"{device.caps.platform} / {device.caps.name}, {args.model}, {args.rounds} interleaved rounds")
    print("| role | shape | gemv_q4 (its set) µs | gemv_q4_split tuned (its set) µs | split / q4 [95%] | "
          "split defaults µs | defaults / q4 [95%] |")
    print("|---|---|---|---|---|---|---|")
    for role, shape in model_shapes(args.model).items():
        contenders = []
        for family in ("gemv_q4", "gemv_q4_split"):
            spec = SPECS[family]
            case = spec.make_case(device, shape, np.random.default_rng(1))
            choice = database.choices(device, spec, shape)[0]
            sets = [(choice.params, choice.source)]
            if family == "gemv_q4_split":
                sets.append((spec.params.resolve(None, shape, device.caps), "defaults"))
            for params, source in sets:
                error = max(case.errors(params).values())
                assert error <= spec.tolerance_for(params), (family, params, error)
                contenders.append((family, case, params, source))
        rounds = interleaved(lambda c: time_case(c[1], c[2], warmup=1, repeat=3).median_s, contenders,
                             args.rounds)
        columns = [np.array(c) for c in zip(*rounds)]
        q4 = columns[0]

        def ratio(i):
            mid, low, high = bootstrap_ratio(columns[i], q4, rng)   # time_i / time_q4
            return f"{mid:.2f} [{low:.2f}, {high:.2f}]"

        def name(i):
            params, source = contenders[i][2], contenders[i][3]
            keys = {k: v for k, v in params.items() if k in ("LAYOUT", "SPLIT", "LANES", "ROWS", "WGR", "I8", "HALF")}
            return f"{source}: " + " ".join(f"{k} {v}" for k, v in keys.items())

        print(f"| {role} | {shape['n']}×{shape['k']} G{shape['group']} | {np.median(q4) * 1e6:.1f} ({name(0)}) | "
              f"{np.median(columns[1]) * 1e6:.1f} ({name(1)}) | {ratio(1)} | {np.median(columns[2]) * 1e6:.1f} | "
              f"{ratio(2)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
