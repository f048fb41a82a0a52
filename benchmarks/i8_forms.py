"""The int8-activation GEMMs' forms of their products against each other: gemm_q4_i8 and gemm_q8_i8 at the default
model's batched-step shapes, each parameter set with PAIR 1 (two rows of X a 16-lane conversion) and, where the
device lists cl_khr_integer_dot_product, DOT 1 (byte dot products) against the same set with int16 pairs
(DOT 0, PAIR 0), device time in interleaved shuffled rounds, ratio of medians with its 95% bootstrap interval
(above 1: the form is faster).

    python benchmarks/i8_forms.py --device intel --m 2 4 8 --rounds 7
    python benchmarks/i8_forms.py --device intel --params WGS=16 ROWS=2 MT=4   # one set instead of the defaults

The set compared is the defaults (or ``--params``), with MT no larger than M, so that the form runs in the
pass that covers the rows.
"""

from __future__ import annotations

import argparse
import random

import numpy as np

from perfx.runtime import get_device
from perfx.timing import bootstrap_ratio, time_launches
from perfx.tuning import SPECS

# (label, family, shape without m): the default model's (SmolLM2-135M) matrices a batched step runs.
SHAPES = (
    ("qkv", "gemm_q4_i8", {"n": 960, "k": 576, "group": 32, "epilogue": "none"}),
    ("gate-up", "gemm_q4_i8", {"n": 3072, "k": 576, "group": 32, "epilogue": "silu_mul"}),
    ("down", "gemm_q4_i8", {"n": 576, "k": 1536, "group": 32, "epilogue": "none"}),
    ("lm_head", "gemm_q8_i8", {"n": 49152, "k": 576, "group": 32, "f32": False, "sym": True, "epilogue": "none"}),
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="PERFX_DEVICE's forms: pocl, intel, P:D")
    parser.add_argument("--m", type=int, nargs="+", default=[4], help="rows of X (sequences in the step)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (after one dropped warm-up)")
    parser.add_argument("--params", nargs="*", default=[], metavar="NAME=VALUE", help="the set to compare")
    args = parser.parse_args(argv)
    device = get_device(args.device)
    asked = {name: int(value) for name, value in (item.split("=") for item in args.params)}
    rng, shuffle = np.random.default_rng(0), random.Random(0)
    print(f"{device.caps.name} / {device.caps.driver_version}, rounds {args.rounds}")
    for m in args.m:
        for label, family, shape in SHAPES:
            spec, shape = SPECS[family], {"m": m, **shape}
            base = {**spec.params.defaults(), **asked}
            base["MT"] = min(base["MT"], 1 << (m.bit_length() - 1))
            forms = {"pairs": {**base, "DOT": 0, "PAIR": 0}, "PAIR 1": {**base, "DOT": 0, "PAIR": 1},
                     "DOT 1": {**base, "DOT": 1, "PAIR": 0}}
            forms = {name: p for name, p in forms.items() if spec.params.why_invalid(p, shape, device.caps) is None}
            case = spec.make_case(device, shape, rng)
            times = {name: [] for name in forms}
            names = list(forms)
            for round_ in range(args.rounds + 1):
                shuffle.shuffle(names)
                for name in names:
                    timing = time_launches(lambda: case.launch(forms[name]), warmup=1, repeat=5)
                    if round_:
                        times[name].append(timing.median_s)
            line = ", ".join(
                f"{name} {ratio:.2f}x ({low:.2f}-{high:.2f})"
                for name in forms if name != "pairs"
                for ratio, low, high in [bootstrap_ratio(times["pairs"], times[name], rng)])
            print(f"M = {m} {label} ({family}, {' '.join(f'{k}={v}' for k, v in base.items() if k not in ('DOT', 'PAIR'))}): "
                  f"pairs {np.median(times['pairs']) * 1e6:.1f} us; over the pairs: {line}", flush=True)


if __name__ == "__main__":
    main()
