"""What one replayed launch costs the host: a step of N launches of a trivial kernel (``Device.record``, replayed
by ``perfx.runtime.replay.Sequence``) enqueued on perfx's queue, which records profiling events, and on a queue
without profiling, interleaved round by round, on each OpenCL implementation.

    python benchmarks/launch_cost.py [--launches 300] [--rounds 7] [--json]

Each round enqueues the step ``--repeat`` times and waits for the queue once; the host time is the enqueueing
alone (the wait is timed apart), in µs a launch. The kernel is perfx's copy of 16 bytes: the device's work is
negligible beside the host's, as in a decode step on a phone whose driver spends more a launch than a CPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import pyopencl as cl

    from perfx.runtime import Device
    from perfx.runtime.replay import Sequence

    results = {}
    for name in ("pocl", "intel"):
        try:
            device = Device(name)
        except Exception as e:   # an implementation this machine lacks
            print(f"{name}: {e}")
            continue
        src, dst = device.empty(4, np.float32), device.empty(4, np.float32)
        kernel = device.kernel("copy.cl", "copy_vectors", {"VWC": 4})
        with device.record() as steps:
            for _ in range(args.launches):
                device.launch(kernel, (1,), (1,), np.int32(1), src.data, dst.data)
        replay = Sequence(list(steps))
        ways = {"profiling": device.queue, "lean": cl.CommandQueue(device.context)}
        per_launch = {way: [] for way in ways}
        for r in range(args.rounds):
            for way in (ways if r % 2 == 0 else reversed(list(ways))):
                queue = ways[way]
                queue.finish()
                started = time.perf_counter()
                for _ in range(args.repeat):
                    replay.enqueue(queue)
                host = time.perf_counter() - started
                queue.finish()
                per_launch[way].append(1e6 * host / (args.repeat * args.launches))
        results[name] = {way: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v)}
                         for way, v in per_launch.items()}
        ratios = [a / b for a, b in zip(per_launch["profiling"], per_launch["lean"])]
        results[name]["profiling_over_lean"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                 "max": max(ratios)}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for name, r in results.items():
        line = ", ".join(f"{way} {r[way]['median_us']:.2f} µs ({r[way]['min_us']:.2f}–{r[way]['max_us']:.2f})"
                         for way in ("profiling", "lean"))
        q = r["profiling_over_lean"]
        print(f"{name}: a launch costs the host {line}; profiling/lean {q['median']:.2f}× "
              f"({q['min']:.2f}–{q['max']:.2f})")


if __name__ == "__main__":
    main()
