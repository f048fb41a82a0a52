"""Do a driver's builds run at once? Distinct programs (a family's parameter sets) built from empty caches and each
checked once, three ways, interleaved in rounds: one at a time, on 2 threads of this process, and in 2 worker
processes (``Device.build_many``'s two ways; PERFX_BUILD_PROCESSES). Also, while 2 threads build, how often 2 or
more of this process's threads are running (state R in /proc): near 0 % where the driver compiles one program at a
time under a lock, whatever the threads. Run from the checkout:

    PYTHONPATH=. python benchmarks/builds_at_once.py --device pocl --sets 12 --rounds 2
    PYTHONPATH=. python benchmarks/builds_at_once.py --device intel --sets 12 --rounds 2

Prints each round's wall seconds (builds plus each set's first check, where PoCL compiles a kernel for the
work-group size it runs at), the ratios to one at a time, and the share of samples with 2+ threads running.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from perfx.runtime import BUILD_PROCESSES_ENV, Device
from perfx.tuning import SPECS
from perfx.tuning.spec import build_requests

WAYS = ("one at a time", "2 threads", "2 processes")


def _running_threads(me: int) -> int:
    count = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                count += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except OSError:
            pass
    return count


def one_way(selector: str, family: str, sets: int, way: str, sample: bool) -> dict:
    """In a fresh process with fresh caches (pyopencl's; PoCL's, which it reads once, at start; NVIDIA's),
    ``sets`` parameter sets built and checked."""
    folder = tempfile.mkdtemp(prefix="perfx-builds-")
    env = {**os.environ, "XDG_CACHE_HOME": folder, "POCL_CACHE_DIR": os.path.join(folder, "pocl"),
           "CUDA_CACHE_PATH": os.path.join(folder, "nv"),
           BUILD_PROCESSES_ENV: "1" if way == "2 processes" else "0"}
    command = [sys.executable, __file__, "--device", selector, "--family", family, "--sets", str(sets),
               "--one", way] + (["--sample"] if sample else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    shutil.rmtree(folder, ignore_errors=True)
    return json.loads(done.stdout)


def measure(selector: str, family: str, sets: int, way: str, sample: bool) -> dict:
    spec = SPECS[family]
    device = Device(selector)
    shape = spec.test_shapes[0]
    chosen = spec.params.candidates(shape, device.caps)[:sets]
    case = spec.make_case(device, shape, np.random.default_rng(0))
    requests = build_requests(spec, device, shape, chosen)
    samples, stop = [], threading.Event()

    def sampler(me=None):
        me = threading.get_native_id()
        while not stop.is_set():
            samples.append(_running_threads(me))
            time.sleep(0.005)
    watcher = threading.Thread(target=sampler, daemon=True)
    if sample:
        watcher.start()
    started = time.perf_counter()
    report = device.build_many(requests, workers=1 if way == "one at a time" else 2)
    built = time.perf_counter() - started
    stop.set()
    errors = [case.errors(params) for params in chosen]
    wall = time.perf_counter() - started
    return {"way": way, "programs": len(requests), "build_s": round(built, 2), "wall_s": round(wall, 2),
            "failed": len(report.errors), "errors": errors,
            "two_running": round(sum(s >= 2 for s in samples) / len(samples), 3) if samples else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--family", default="gemv_q4")
    parser.add_argument("--sets", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=WAYS)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", choices=WAYS, help=argparse.SUPPRESS)     # one way, in this process
    parser.add_argument("--sample", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.device, args.family, args.sets, args.one, args.sample)))
        return
    selector = Device(args.device).entry.index
    rounds = []
    for number in range(args.rounds):
        ways = list(args.ways) if number % 2 == 0 else list(args.ways)[::-1]
        results = {way: one_way(selector, args.family, args.sets, way, way == "2 threads") for way in ways}
        first = results["one at a time"]["errors"]
        assert all(r["errors"] == first for r in results.values()), "the same checks gave other errors"
        rounds.append({w: {k: v for k, v in r.items() if k != "errors"} for w, r in results.items()})
        if not args.json:
            base = results["one at a time"]["wall_s"]
            print(f"round {number + 1} ({results['one at a time']['programs']} programs, load "
                  f"{os.getloadavg()[0]:.1f}): " + ", ".join(
                      f"{w} {results[w]['wall_s']:.1f} s ({base / results[w]['wall_s']:.2f}x)" for w in args.ways)
                  + (f"; 2+ threads running in {results['2 threads']['two_running']:.0%} of samples"
                     if "2 threads" in results else ""), flush=True)
    if args.json:
        print(json.dumps({"device": Device(selector).fingerprint, "family": args.family, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
