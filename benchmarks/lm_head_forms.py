"""The lm_head (and tied embedding) as int8 against fp16: bytes a token, decode and prefill tok/s, logits.

Both forms of the same model are loaded in one process on one device and measured in interleaved rounds
(the order alternating), so the difference is the head's form alone. Then the logits of one prompt from
each, against each other and against the float64 reference forward of the same source (``--reference``).

    python benchmarks/lm_head_forms.py --model default --rounds 12 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone

import numpy as np

from perfx import forward64
from perfx.commands.bench import measure_e2e
from perfx.model import load_model
from perfx.runtime import Device


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--reference", action="store_true", help="also the float64 reference's logits")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    device = Device()
    models = {head: load_model(args.model, device, progress=False, default_ctx=512, lm_head=head)
              for head in ("fp16", "q8")}
    for model, _ in models.values():   # every kernel built before timing
        measure_e2e(model, 8, 4)
    runs = {head: [] for head in models}
    for i in range(args.rounds):
        for head in (("fp16", "q8") if i % 2 == 0 else ("q8", "fp16")):
            runs[head].append(measure_e2e(models[head][0], args.prompt_tokens, args.decode_tokens, seed=i))
            print(f"round {i + 1} {head}: decode {runs[head][-1]['decode_tok_s']:.1f} tok/s", file=sys.stderr)
    out = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": device.caps.name,
           "platform": device.caps.platform, "model": args.model, "rounds": args.rounds, "forms": {}}
    for head, rows in runs.items():
        out["forms"][head] = {"weight_bytes": models[head][0].weight_bytes,
                              **{key: {"median": statistics.median(r[key] for r in rows),
                                       "min": min(r[key] for r in rows), "max": max(r[key] for r in rows)}
                                 for key in ("decode_tok_s", "prefill_tok_s")}}
    ratios = [q["decode_tok_s"] / f["decode_tok_s"] for q, f in zip(runs["q8"], runs["fp16"])]
    out["decode_q8_over_fp16"] = {"median": statistics.median(ratios), "q8_faster_rounds": sum(r > 1 for r in ratios),
                                  "rounds": len(ratios)}
    # logits of one prompt, every position
    source = models["q8"][1]
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, source.config.vocab_size, 48)]
    logits = {head: model.prefill_logits(prompt, 0, 0) for head, (model, _) in models.items()}

    def rel(a, b):
        return float(np.median(np.max(np.abs(a - b), axis=1) / np.max(np.abs(b), axis=1)))

    out["logits"] = {"q8_vs_fp16_rel_max_median": rel(logits["q8"], logits["fp16"]),
                     "top1_agreement": float(np.mean(logits["q8"].argmax(1) == logits["fp16"].argmax(1)))}
    if args.reference:
        for head, (_, src) in models.items():
            want, _ = forward64.model_forward(src, prompt)
            out["logits"][f"{head}_vs_its_reference"] = rel(logits[head], want)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for head, f in out["forms"].items():
            print(f"{head}: {f['weight_bytes'] / 1e6:.1f} MB a token, decode {f['decode_tok_s']['median']:.1f} "
                  f"({f['decode_tok_s']['min']:.1f}–{f['decode_tok_s']['max']:.1f}) tok/s")
        print(json.dumps(out["decode_q8_over_fp16"]), json.dumps(out["logits"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
