"""The int8 GEMV's heads with fp32 and int8 activations (gemv_q8's I8), interleaved in one run beside the copy
bandwidth: the default model's lm_head (49152×576) and a Gemma-3-270M-class head (262144×640), G 32, half2
pairs, timed from memory (rotating through copies past the last-level cache, as benchmarks/gemv_cold.py).

    PYTHONPATH=. PERFX_DEVICE=intel python benchmarks/gemv_q8_i8.py [--rounds 3]

Prints per round and set the median of 10 launches (the I8 sets' quantize launch included) and GB/s of
weights, then the median over rounds with the spread.
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np

from perfx.formats import Q8Matrix
from perfx.ops.gemv_q8 import GemvQ8
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.runtime import get_device
from perfx.timing import copy_bandwidth, time_launches

HEADS = (("lm_head 49152x576", 49152, 576), ("gemma3 head 262144x640", 262144, 640))
# fp32: the shipped lm_head choice on both runtimes (LANES 1, ROWS 1), ROWS 8 and the defaults; I8 at the
# same and at the fewest instructions per weight on Intel's compiler (ROWS 4: 0.46).
SETS = tuple({"LANES": lanes, "ROWS": rows, "I8": i8} for i8 in (0, 1)
             for lanes, rows in ((1, 1), (1, 8), (16, 4), (1, 4)))
ROTATED_BYTES = 72 << 20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=os.environ.get("PERFX_DEVICE", "intel"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    device = get_device(args.device)
    rng = np.random.default_rng(0)
    print(device.caps.name)
    results: dict[str, list[float]] = {}
    for label, n, k in HEADS:
        shape = {"n": n, "k": k, "group": 32, "f32": False, "epilogue": "none", "bias": False}
        matrix = Q8Matrix.random(n, k, 32, rng)
        nbytes = n * k + 4 * n * k // 32
        copies = max(2, -(-ROTATED_BYTES // nbytes))
        weights = [Q8DeviceWeight.upload(device, matrix, what="benchmark weight") for _ in range(copies)]
        x = device.upload(rng.standard_normal(k).astype(np.float32))
        y = device.empty(n, np.float32)
        ops = [(params, GemvQ8(device, params, shape)) for params in SETS]
        state = {"i": 0}

        def rotate():
            state["i"] = (state["i"] + 1) % copies
        for r in range(args.rounds):
            copy_gbs = copy_bandwidth(device)[0]
            results.setdefault(f"{label} copy", []).append(copy_gbs)
            line = [f"round {r}: copy {copy_gbs:5.1f}"]
            for params, op in ops:
                t = time_launches(lambda: op.events(weights[state["i"]], x, y), warmup=2, repeat=10,
                                  rotate=rotate).median_s
                key = f"{label} {' '.join(f'{a}={b}' for a, b in params.items())}"
                results.setdefault(key, []).append(nbytes / t / 1e9)
                line.append(f"{nbytes / t / 1e9:5.2f}")
            print(label, " ".join(line), flush=True)
        del weights
    for key, values in results.items():
        print(f"{key:50s} {statistics.median(values):6.2f} GB/s  ({min(values):.2f}–{max(values):.2f})")


if __name__ == "__main__":
    main()
