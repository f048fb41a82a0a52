"""The KV cache as fp16 against int8 (q8, llama.cpp's q8_0): its bytes, decode tok/s at the end of a long
context, and (``--perplexity FILE``) perplexity by llama-perplexity's method, paired token by token.

Both forms of the same model are loaded in one process on one device (PERFX_DEVICE) and measured in
interleaved rounds (the order alternating), each decode at the end of a cache of ``--ctx`` positions
(``perfx bench --e2e --ctx``'s measurement), so the difference is the cache's form alone.

    python benchmarks/kv_forms.py --ctx 2048 --rounds 6 --perplexity benchmarks/data/public_domain.txt --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone

import numpy as np

from perfx.commands.bench import measure_e2e
from perfx.commands.perplexity import nll_rows
from perfx.model import load_model
from perfx.runtime import Device

FORMS = ("f16", "q8")


def paired_perplexity(models: dict, text: str, ctx: int) -> dict:
    """Each form's perplexity over the same chunks of ``ctx`` (perfx perplexity's method), the ratio of q8 to f16
    with the standard error of the paired per-token NLL difference, top-1 agreement and the mean KL(f16 ‖ q8)."""
    tokenizer = models["f16"][1].tokenizer
    tokens = tokenizer.encode(text, add_bos=tokenizer.add_bos_token, parse_special=False)
    bos = tokenizer.bos_id if tokenizer.add_bos_token else None
    first, nll, same, kl = ctx // 2, {form: [] for form in FORMS}, [], []
    for i in range(len(tokens) // ctx):
        ids = list(tokens[i * ctx:(i + 1) * ctx])
        if bos is not None:
            ids[0] = bos
        logp = {}
        for form, (model, _) in models.items():
            rows = model.prefill_logits(ids, 0, first)[:-1].astype(np.float64)
            nll[form].append(nll_rows(rows, tokens[i * ctx + first + 1:(i + 1) * ctx]))
            rows = rows - rows.max(axis=1, keepdims=True)
            logp[form] = rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))
        same.append(logp["f16"].argmax(1) == logp["q8"].argmax(1))
        kl.append((np.exp(logp["f16"]) * (logp["f16"] - logp["q8"])).sum(axis=1))
    f16, q8 = np.concatenate(nll["f16"]), np.concatenate(nll["q8"])
    diff = q8 - f16
    ratio = float(np.exp(diff.mean()))
    return {"ctx": ctx, "chunks": len(nll["f16"]), "scored": len(diff), "ppl_f16": float(np.exp(f16.mean())),
            "ppl_q8": float(np.exp(q8.mean())), "ratio": ratio,
            "ratio_se": float(ratio * diff.std() / np.sqrt(len(diff) - 1)),
            "top1_agreement": float(np.concatenate(same).mean()), "mean_kl": float(np.concatenate(kl).mean())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--ctx", type=int, default=2048, help="cache positions; decode runs at its end")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--perplexity", metavar="FILE", help="also perplexity of each form on this text")
    parser.add_argument("--perplexity-ctx", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    device = Device()
    models = {form: load_model(args.model, device, ctx=args.ctx, progress=False, kv=form) for form in FORMS}
    for model, _ in models.values():   # every kernel built before timing
        measure_e2e(model, 8, 4, at_end=True)
    runs = {form: [] for form in FORMS}
    for i in range(args.rounds):
        for form in (FORMS if i % 2 == 0 else FORMS[::-1]):
            runs[form].append(measure_e2e(models[form][0], args.prompt_tokens, args.decode_tokens, seed=i,
                                          at_end=True))
            print(f"round {i + 1} {form}: decode {runs[form][-1]['decode_tok_s']:.1f} tok/s", file=sys.stderr)
    out = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": device.caps.name,
           "platform": device.caps.platform, "model": args.model, "ctx": args.ctx, "rounds": args.rounds,
           "depth": runs["f16"][0]["depth"], "forms": {}}
    for form, rows in runs.items():
        out["forms"][form] = {"kv_cache_bytes": models[form][0].cache.nbytes,
                              "weight_bytes": models[form][0].weight_bytes,
                              **{key: {"median": statistics.median(r[key] for r in rows),
                                       "min": min(r[key] for r in rows), "max": max(r[key] for r in rows)}
                                 for key in ("decode_tok_s", "prefill_tok_s")}}
    ratios = [q["decode_tok_s"] / f["decode_tok_s"] for q, f in zip(runs["q8"], runs["f16"])]
    out["decode_q8_over_f16"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                 "q8_faster_rounds": sum(r > 1 for r in ratios), "rounds": len(ratios)}
    if args.perplexity:
        with open(args.perplexity, encoding="utf-8") as f:
            out["perplexity"] = paired_perplexity(models, f.read(), args.perplexity_ctx)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for form, f in out["forms"].items():
            print(f"{form}: KV cache {f['kv_cache_bytes'] / 2**20:.1f} MiB, decode at {out['depth']}.. "
                  f"{f['decode_tok_s']['median']:.1f} ({f['decode_tok_s']['min']:.1f}–{f['decode_tok_s']['max']:.1f}) "
                  "tok/s")
        print(json.dumps(out["decode_q8_over_f16"]), json.dumps(out.get("perplexity")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
