"""The sample kernel's device time against the argmax's (the greedy choice) at a vocabulary size: both at their
defaults, the same logits, profiling events (perfx.timing.time_launches: warm-up, then the median).

    python benchmarks/sample_vs_argmax.py --v 49152 262144 [--repeat 30]   (PERFX_DEVICE picks the device)
"""

from __future__ import annotations

import argparse

import numpy as np

from perfx.ops.sample import Sample
from perfx.ops.small_ops import Argmax
from perfx.runtime import Device
from perfx.timing import time_launches


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--v", type=int, nargs="+", default=[49152, 262144])
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    device = Device()
    print(device)
    rng = np.random.default_rng(0)
    argmax, sample = Argmax(device), Sample(device)
    history = device.upload(rng.integers(0, min(args.v), 256).astype(np.int32))
    out = device.empty(1, np.int32)
    for v in args.v:
        logits = device.upload((rng.standard_normal(v) * 3).astype(np.float32))
        counter = iter(range(10**9))
        rows = {
            "argmax": lambda: argmax(logits, v, out),
            "sample t0.7 k40 p0.95 m0.05": lambda: sample(logits, v, out, temperature=0.7, top_k=40, top_p=0.95,
                                                          min_p=0.05, seed=1, counter=next(counter)),
            "sample ... penalty 1.3, 256 ids": lambda: sample(logits, v, out, temperature=0.7, top_k=40, top_p=0.95,
                                                              min_p=0.05, penalty=1.3, history=history, h=256,
                                                              seed=1, counter=next(counter)),
        }
        base = None
        for name, launch in rows.items():
            t = time_launches(launch, warmup=3, repeat=args.repeat).median_s
            base = base or t
            print(f"V={v:7d}  {name:34s} {1e6 * t:9.1f} µs  {t / base:5.2f}× argmax")


if __name__ == "__main__":
    main()
