"""Decode and prefill of the 2026 phone families' shapes (synthetic: real shapes and recipes, random int4
weights in groups of 32 as their Q4_0 GGUFs, the int8 head), on each CPU OpenCL implementation.

    python benchmarks/families.py [--devices intel,pocl] [--models gemma-3-1b,...] [--json out.json]

Each model is loaded with a 512-position cache and measured as `perfx bench --e2e` measures (a 64-token
prompt, then 32 greedy tokens), with the copy bandwidth of the same device beside it, so a decode figure
reads as GB/s of weights against what the memory gives. Tuned entries apply where this device has them
(they were measured on the default model's and Llama-2-7B's shapes; a family's other shapes run defaults).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from perfx.commands.bench import run_e2e
from perfx.runtime import Device
from perfx.timing import copy_bandwidth

MODELS = ("gemma-3-270m", "gemma-3-1b", "qwen3-1.7b", "phi-4-mini", "smollm3-3b", "lfm2-350m", "lfm2-1.2b")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="intel,pocl")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    for selector in args.devices.split(","):
        device = Device(selector)
        copy_gb_s, _ = copy_bandwidth(device)
        for name in args.models.split(","):
            started = time.perf_counter()
            r = run_e2e(device, f"synthetic:{name}", args.prompt, args.decode, ctx=512)
            row = {"device": selector, "model": name, "copy_gb_s": copy_gb_s, **r,
                   "wall_s": time.perf_counter() - started}
            rows.append(row)
            print(f"{selector:6s} {name:13s} prefill {r['prefill_tok_s']:7.1f} tok/s  decode {r['decode_tok_s']:6.2f} "
                  f"tok/s  {r['weight_bytes'] / 1e6:7.1f} MB/token = {r['decode_gb_s']:5.2f} GB/s "
                  f"({100 * r['decode_gb_s'] / copy_gb_s:3.0f}% of copy {copy_gb_s:.1f})  host "
                  f"{r['host_ms_per_token']:.2f} ms/token  device {r['device_bytes'] / 2**20:.0f} MiB", flush=True)
            del r
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
