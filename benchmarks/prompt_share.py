"""What `n` > 1 and a shared prefix save while batching: a prompt's state copied from the slot that ran it into
another (``perfx.batch.Batch.share``: the KV cache's rows of those positions, on the device) against running
the prompt again there (``Batch.prefill``), each round both, in a shuffled order, so load on a shared machine
favours neither. Prints the median milliseconds of each and their ratio, per prompt length.

    python benchmarks/prompt_share.py                       # the default model; --model M --lengths 40 200 1000
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np

from perfx.batch import Batch
from perfx.model import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default=None)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--lengths", type=int, nargs="+", default=[40, 200, 1000])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model, _ = load_model(args.model, args.device, ctx=args.ctx, progress=False)
    batch = Batch(model, 2)
    rng = np.random.default_rng(0)
    print(f"{args.model} on {model.device.caps.name}, {args.rounds} rounds")
    for length in args.lengths:
        ids = [int(t) for t in rng.integers(3, model.config.vocab_size, length)]
        batch.prefill(0, ids, 0)
        times = {"prefill": [], "share": []}
        contenders = {"prefill": lambda: batch.prefill(1, ids, 0), "share": lambda: batch.share(0, 1, length)}
        for _ in range(args.rounds):
            for name in random.sample(list(contenders), 2):
                started = time.perf_counter()
                contenders[name]()
                model.device.queue.finish()
                times[name].append(time.perf_counter() - started)
        prefill, share = (float(np.median(times[name])) for name in ("prefill", "share"))
        spread = {name: f"{min(v) * 1e3:.2f}–{max(v) * 1e3:.2f}" for name, v in times.items()}
        print(f"{length:5d} ids: prefill {prefill * 1e3:8.2f} ms ({spread['prefill']}), share {share * 1e3:6.2f} ms "
              f"({spread['share']}): {prefill / share:.0f}× less")


if __name__ == "__main__":
    main()
