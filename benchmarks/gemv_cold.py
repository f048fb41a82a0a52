"""The default model's decode GEMVs at a few parameter sets, timed as a decode step reads their weights: from
memory, rotating through copies past the last-level cache (72 MB). Runs in the checkout it is started from, so
two checkouts (before and after a kernel change) compare by alternating runs:

    git worktree add /tmp/before <commit>
    for i in 1 2; do
      (cd /tmp/before && PYTHONPATH=. python /path/to/benchmarks/gemv_cold.py --json > /tmp/old_$i.json)
      PYTHONPATH=. python benchmarks/gemv_cold.py --json > /tmp/new_$i.json
    done

Prints, per GEMV and set, the median of 30 launches (µs) and GB/s of weights; a set the checkout does not
know (a newer variant) is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from perfx.formats import Q4Matrix, Q8Matrix
from perfx.ops.gemv_q4 import GemvQ4
from perfx.ops.gemv_q8 import GemvQ8
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.runtime import get_device
from perfx.timing import time_launches

ROWS = {"LAYOUT": 0, "READ": 0, "SG": 0, "HALF": 0, "SUBGROUP": 0}
INTERLEAVED = {"LAYOUT": 1, "SLICES": 1, "READ": 0, "HALF": 0, "SUBGROUP": 0}
I8 = {**INTERLEAVED, "ROWS": 2, "XS": 1, "I8": 1}
CASES = (
    ("qkv 960x576", "gemv_q4", {"n": 960, "k": 576, "group": 32, "epilogue": "none"},
     [I8, {**ROWS, "LANES": 1, "ROWS": 4}, {**ROWS, "LANES": 16, "ROWS": 4},
      {**INTERLEAVED, "ROWS": 4, "XS": 0, "I8": 0}, {**INTERLEAVED, "ROWS": 4, "XS": 3, "I8": 0}]),
    ("gate-up 3072x576", "gemv_q4", {"n": 3072, "k": 576, "group": 32, "epilogue": "silu_mul"},
     [I8, {**ROWS, "LANES": 1, "ROWS": 2}, {**ROWS, "LANES": 16, "ROWS": 4},
      {**INTERLEAVED, "ROWS": 2, "XS": 3, "I8": 0}]),
    ("down 576x1536", "gemv_q4", {"n": 576, "k": 1536, "group": 32, "epilogue": "none"},
     [I8, {**ROWS, "LANES": 1, "ROWS": 4}, {**ROWS, "LANES": 16, "ROWS": 4},
      {**INTERLEAVED, "ROWS": 2, "XS": 3, "I8": 0}]),
    ("lm_head 49152x576 int8", "gemv_q8", {"n": 49152, "k": 576, "group": 32, "f32": False, "sym": True,
                                                "epilogue": "none"},
     [{"LANES": 1, "ROWS": 8}, {"LANES": 1, "ROWS": 1}, {"LANES": 16, "ROWS": 4}]),
)
ROTATED_BYTES = 72 << 20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=os.environ.get("PERFX_DEVICE", "intel"))
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    device = get_device(args.device)
    rng = np.random.default_rng(0)
    out = {}
    for label, family, shape, sets in CASES:
        n, k, group, epilogue = shape["n"], shape["k"], shape["group"], shape["epilogue"]
        if family == "gemv_q8":
            matrix, nbytes = Q8Matrix.random(n, k, group, rng), n * k + 4 * n * k // group
        else:
            matrix, nbytes = Q4Matrix.random(n, k, group, rng), n * k // 2 + 4 * n * k // group
        copies = max(2, ROTATED_BYTES // nbytes)
        x = device.upload(rng.standard_normal(k).astype(np.float32))
        y = device.empty(n, np.float32)
        weights = {}
        for params in sets:
            try:
                if family == "gemv_q8":
                    layout, op = 0, GemvQ8(device, params, shape)
                    make = lambda: Q8DeviceWeight.upload(device, matrix, what="gemv_cold weight")  # noqa: E731
                else:
                    layout, op = params["LAYOUT"], GemvQ4(device, params, shape)
                    make = lambda: Q4DeviceWeight.upload(device, matrix, None, read_paths=("buffer",),  # noqa: E731
                                                         layout=layout, what="gemv_cold weight")
            except Exception as error:  # noqa: BLE001 - a set this checkout does not know is left out
                print(f"{label} {params}: {str(error).splitlines()[0][:120]}", file=sys.stderr)
                continue
            if layout not in weights:
                weights[layout] = [make() for _ in range(copies)]
            state = {"i": 0}

            def rotate():
                state["i"] = (state["i"] + 1) % copies
            ws = weights[layout]
            t = time_launches(lambda: op.events(ws[state["i"]], x, y, epilogue), warmup=3, repeat=30,
                              rotate=rotate).median_s
            key = f"{label} {' '.join(f'{k}={v}' for k, v in params.items())}"
            out[key] = {"median_s": t, "gb_per_s": nbytes / t / 1e9}
            if not args.json:
                print(f"{key:90s} {t * 1e6:8.0f} us {nbytes / t / 1e9:6.2f} GB/s")
    if args.json:
        print(json.dumps({"device": device.caps.name, "results": out}))


if __name__ == "__main__":
    main()
