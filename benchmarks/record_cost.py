"""What recording one launch costs the host (``Device.record``: a decode step's recording, each of a tuning
sweep's timing replays): the old way (a Kernel made again from the program, its pyopencl argument-setting code
read from pyopencl's on-disk cache) against perfx's (that code kept in memory per kernel signature, the Kernel a
clone), in interleaved rounds on one device.

    PYTHONPATH=. python benchmarks/record_cost.py intel pocl
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import pyopencl as cl
from pyopencl import invoker

from perfx.runtime import get_device, replay

LAUNCHES, ROUNDS = 300, 7


def main(names: list[str]) -> None:
    for name in names:
        device = get_device(name)   # prepares OpenCL: the memo is in place from here on
        memoized = invoker.generate_enqueue_and_set_args
        kernel = device.kernel("copy.cl", "copy_vectors", {"VWC": 4})
        buf = device.empty(1024, np.float32)
        own_kernel = replay._own_kernel
        rounds = {"old": [], "perfx": []}
        for _ in range(ROUNDS):
            for how in rounds:
                old = how == "old"
                invoker.generate_enqueue_and_set_args = memoized.__wrapped__ if old else memoized
                replay._own_kernel = (lambda k: cl.Kernel(k.program, k.function_name)) if old else own_kernel
                started = time.perf_counter()
                with device.record():
                    for _ in range(LAUNCHES):
                        device.launch(kernel, (256,), None, np.int32(256), buf.data, buf.data)
                rounds[how].append((time.perf_counter() - started) / LAUNCHES * 1e6)
        invoker.generate_enqueue_and_set_args, replay._own_kernel = memoized, own_kernel
        old, new = statistics.median(rounds["old"]), statistics.median(rounds["perfx"])
        print(f"{name}: µs to record a launch, median of {ROUNDS} rounds: old {old:.1f} "
              f"({min(rounds['old']):.0f}–{max(rounds['old']):.0f}), perfx {new:.1f} "
              f"({min(rounds['perfx']):.0f}–{max(rounds['perfx']):.0f}): {old / new:.1f}× less")


if __name__ == "__main__":
    main(sys.argv[1:] or ["intel", "pocl"])
