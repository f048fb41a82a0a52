"""Decode and prefill of the synthetic Gemma 3n E2B (real shapes, random int4 weights) end to end, as
`perfx bench --e2e` measures a model (``perfx.commands.bench.run_e2e``), with its per-layer table made up: the
synthetic source leaves tables over ``PER_LAYER_TABLE_LIMIT`` values out (E2B's is 2.0 G values, about 1 GB of
int4 codes and 2 GB of host memory while it is made), so this script lifts the limit for its own run.

    python benchmarks/synthetic_gemma3n.py [--device intel] [--prompt 64] [--decode 32] [--rounds 3]
        [--baseline synthetic:qwen3-1.7b]

With ``--baseline``, a dense model of about the same bytes runs in the same rounds, interleaved: on a shared
machine the ratio of achieved GB/s says whether Gemma 3n's step reads its bytes as a plain one does.
"""

from __future__ import annotations

import argparse
import json

from perfx.commands.bench import measure_e2e
from perfx.model import load_model
from perfx.runtime import Device
from perfx.sources import synthetic
from perfx.timing import copy_bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="intel")
    parser.add_argument("--model", default="synthetic:gemma-3n-e2b")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="a model measured in the same rounds, interleaved")
    args = parser.parse_args()
    synthetic.PER_LAYER_TABLE_LIMIT = 1 << 40
    device = Device(args.device)
    models = {name: load_model(name, device, ctx=1024, progress=None, log=print)[0]
              for name in [args.model] + ([args.baseline] if args.baseline else [])}
    for model in models.values():
        measure_e2e(model, args.prompt, 2)   # the kernels built, not timed
    # each round beside the copy bandwidth of the moment: on a shared machine the fraction of it is the figure
    for round_ in range(args.rounds):
        for name, model in models.items():
            copy_gb_s, _ = copy_bandwidth(device)
            r = measure_e2e(model, args.prompt, args.decode)
            print(json.dumps({"round": round_, "model": name, "copy_gb_s": copy_gb_s,
                              "decode_of_copy": r["decode_gb_s"] / copy_gb_s,
                              **{k: r[k] for k in ("prompt_tokens", "prefill_tok_s", "decode_tok_s", "decode_gb_s",
                                                   "weight_bytes", "device_bytes", "host_peak_bytes",
                                                   "launches_per_token")}}), flush=True)

if __name__ == "__main__":
    main()
