"""The routed-expert kernels on one device, interleaved rounds: a prompt's experts grouped by expert (gemm_moe)
against the same rows through the per-row GEMVs (gemv_moe over m rows), and a decode step's routed gate-up against
the dense int4 GEMV of the same bytes (gemv_q4 over the chosen experts' rows), at LFM2-8B-A1B's expert shape with
8 experts (4 chosen), defaults.

    python benchmarks/moe_kernels.py --device intel --rounds 3 --m 64
"""

from __future__ import annotations

import argparse

import numpy as np

from perfx.runtime import Device
from perfx.timing import time_launches
from perfx.tuning import SPECS

SHAPE = {"op": "gate_up", "n": 1792, "k": 2048, "experts": 8, "used": 4, "bits": 4, "group": 32, "sym": True,
         "f32": False, "act": "silu"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--m", type=int, default=64)
    args = parser.parse_args()
    device = Device(args.device)
    rng = np.random.default_rng(0)
    cases = {}
    for name, family, shape in (("grouped", "gemm_moe", {**SHAPE, "m": args.m}),
                                ("per-row", "gemv_moe", {**SHAPE, "m": args.m}),
                                ("routed decode", "gemv_moe", {**SHAPE, "m": 1}),
                                ("dense decode", "gemv_q4", {"n": 2 * 4 * SHAPE["n"], "k": SHAPE["k"], "group": 32,
                                                             "epilogue": "silu_mul", "bias": False})):
        spec = SPECS[family]
        cases[name] = (spec.make_case(device, shape, rng), spec.params.resolve(None, shape, device.caps))
    print(f"{device.caps.name}: median ms per launch, {args.rounds} interleaved rounds")
    times = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (case, params) in cases.items():
            times[name].append(time_launches(lambda c=case, p=params: c.launch(p)).median_s * 1e3)
    for name, samples in times.items():
        print(f"  {name:14s} {np.median(samples):9.2f} ms  ({', '.join(f'{t:.2f}' for t in samples)})")
    print(f"  per-row / grouped: {np.median(times['per-row']) / np.median(times['grouped']):.2f}x; "
          f"routed / dense decode: {np.median(times['routed decode']) / np.median(times['dense decode']):.2f}x")


if __name__ == "__main__":
    main()
