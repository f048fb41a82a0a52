"""What one replayed launch costs the host: a step of N launches of a trivial kernel (``Device.record``) enqueued
as perfx replays a decode step (``perfx.runtime.replay.Sequence``: pyopencl's enqueue called straight on arguments
made once, on the device's queue, which records no profiling events) against the way it did before (each
``BoundLaunch.enqueue`` in turn, on a queue that records profiling events), interleaved round by round, on each
OpenCL implementation.

    python benchmarks/launch_cost.py [--launches 300] [--repeat 20] [--rounds 7] [--json]

Each round enqueues the step ``--repeat`` times each way and waits for the queue once; the host time is the
enqueueing alone (the wait is timed apart), in µs a launch; the ratio is before / after within each round. The
kernel is perfx's copy of 16 bytes: the device's work is negligible beside the host's, as in a decode step on a
phone whose driver spends more a launch than a CPU's. Also each alone: the profiling queue with the new enqueue,
and the lean queue with the old one, so the two changes' shares show.
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

    class OneByOne:   # the replay before: a method of ours a launch
        def __init__(self, steps):
            self.steps = steps

        def enqueue(self, queue):
            for step in self.steps:
                step.enqueue(queue)

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
        profiling = cl.CommandQueue(device.context, properties=cl.command_queue_properties.PROFILING_ENABLE)
        ways = {"before (one by one, profiling queue)": (OneByOne(list(steps)), profiling),
                "after (Sequence, perfx's queue)": (Sequence(list(steps)), device.queue),
                "Sequence, profiling queue": (Sequence(list(steps)), profiling),
                "one by one, perfx's queue": (OneByOne(list(steps)), device.queue)}
        per_launch = {way: [] for way in ways}
        for r in range(args.rounds):
            for way in (list(ways) if r % 2 == 0 else list(reversed(list(ways)))):
                replay, queue = ways[way]
                queue.finish()
                started = time.perf_counter()
                for _ in range(args.repeat):
                    replay.enqueue(queue)
                host = time.perf_counter() - started
                queue.finish()
                per_launch[way].append(1e6 * host / (args.repeat * args.launches))
        results[name] = {way: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v)}
                         for way, v in per_launch.items()}
        before, after = per_launch[list(ways)[0]], per_launch[list(ways)[1]]
        ratios = [a / b for a, b in zip(before, after)]
        results[name]["before_over_after"] = {"median": statistics.median(ratios), "min": min(ratios),
                                              "max": max(ratios)}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for name, r in results.items():
        print(f"{name}: µs a launch, median (min–max) of {args.rounds} rounds")
        for way in r:
            if way != "before_over_after":
                print(f"  {way:40s} {r[way]['median_us']:.2f} ({r[way]['min_us']:.2f}–{r[way]['max_us']:.2f})")
        q = r["before_over_after"]
        print(f"  before / after, round by round: {q['median']:.2f}× ({q['min']:.2f}–{q['max']:.2f})")


if __name__ == "__main__":
    main()
