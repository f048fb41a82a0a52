"""Logits with the int8 KV cache against the fp16 cache on one model: the same random prompt and the same fed
tokens through both forms (loaded one after the other in one process, on PERFX_DEVICE), max|Δ| / max|logits| at
the last prompt positions and at each decode step, and whether the top-1 token agrees. For models without a
text to measure perplexity on (synthetic shapes such as Llama-2-7B's).

    PERFX_DEVICE=intel python benchmarks/kv_logits.py --model synthetic:llama-2-7b --ctx 512
"""

from __future__ import annotations

import argparse
import gc
import json

import numpy as np

from perfx.model import load_model
from perfx.runtime import Device


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="synthetic:llama-2-7b")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=200, help="random prompt tokens")
    parser.add_argument("--last", type=int, default=32, help="prompt positions compared, from the end")
    parser.add_argument("--steps", type=int, default=16, help="decode steps, the same tokens fed to both forms")
    args = parser.parse_args(argv)
    device = Device()
    rng = np.random.default_rng(0)
    logits = {}
    prompt = fed = None
    for kv in ("f16", "q8"):
        model, _ = load_model(args.model, device, ctx=args.ctx, progress=False, kv=kv)
        vocab = model.config.vocab_size
        if prompt is None:
            prompt = [int(t) for t in rng.integers(3, vocab, args.prompt)]
            fed = [int(t) for t in rng.integers(3, vocab, args.steps)]
        rows = model.prefill_logits(prompt, 0, first=len(prompt) - args.last)
        steps = []
        for i, token in enumerate(fed):
            model.decode_one(token, len(prompt) + i)
            steps.append(model.logits())
        logits[kv] = (np.asarray(rows, np.float64), np.asarray(steps, np.float64))
        del model
        gc.collect()

    def relative(a, b):
        return np.abs(a - b).max(axis=-1) / np.abs(a).max(axis=-1)

    at_prompt = relative(logits["f16"][0], logits["q8"][0])
    at_steps = relative(logits["f16"][1], logits["q8"][1])
    same = np.mean(np.argmax(logits["f16"][1], -1) == np.argmax(logits["q8"][1], -1))
    print(json.dumps({"model": args.model, "device": device.caps.platform, "ctx": args.ctx,
                      "prompt_positions": len(at_prompt), "prompt_relative_median": float(np.median(at_prompt)),
                      "prompt_relative_max": float(at_prompt.max()), "decode_steps": len(at_steps),
                      "decode_relative_median": float(np.median(at_steps)),
                      "decode_relative_max": float(at_steps.max()), "decode_top1_same": float(same)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
