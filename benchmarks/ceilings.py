"""The device's two memory ceilings interleaved in one run: copy (``perfx.timing.copy_bandwidth``, bytes read and
written) and the read-only stream (``perfx.timing.read_bandwidth``), as `perfx bench` measures them, alternating in a
shuffled order for several rounds.

    python benchmarks/ceilings.py --device intel [--rounds 9] [--json]

Prints each ceiling's median GB/s over the rounds with its range, and the ratio read / copy (median of the rounds'
ratios, with its 95% bootstrap interval).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from perfx.commands.bench import interleaved
from perfx.runtime import get_device
from perfx.timing import bootstrap_ratio, copy_bandwidth, read_bandwidth

CEILINGS = {"copy": copy_bandwidth, "read": read_bandwidth}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=os.environ.get("PERFX_DEVICE"))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    device = get_device(args.device)
    names = list(CEILINGS)
    rounds = interleaved(lambda name: CEILINGS[name](device)[0], names, args.rounds)
    copy, read = ([r[i] for r in rounds] for i in range(2))
    # GB/s are rates: read / copy is the ratio of copy's time per byte to read's
    ratio, low, high = bootstrap_ratio(read, copy, np.random.default_rng(0))
    result = {"device": device.caps.name, "platform": device.caps.platform, "rounds": args.rounds,
              "copy_gb_per_s": copy, "read_gb_per_s": read, "read_over_copy": ratio, "interval": [low, high]}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{device.caps.platform} / {device.caps.name}, {args.rounds} interleaved rounds")
    for name, values in (("copy", copy), ("read", read)):
        print(f"{name}: {np.median(values):.2f} GB/s ({min(values):.2f}–{max(values):.2f})")
    print(f"read / copy: {ratio:.2f} [{low:.2f}, {high:.2f}]")


if __name__ == "__main__":
    main()
