"""A real GGUF as users download it, perfx against llama.cpp (benchmark-only peer) and the float64 reference:
prompt ids, the prompt's last logits, greedy tokens, perplexity of a text, and decode/prefill speed.

    python benchmarks/real_gguf_llamacpp.py MODEL.gguf [--text benchmarks/data/public_domain.txt] [--json]

The reference forward (float64 over the same file's weights) says which engine is right where they differ;
`--no-reference` skips it (it takes a minute for a 262k-token head). llama.cpp runs on the same two CPU threads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from peer_llamacpp import logits as llama_logits, measure_llama, open_llama, perplexity, tokenize
from perfx import forward64
from perfx.commands.bench import measure_e2e
from perfx.model import load_model
from perfx.tuning.spec import relative_error

PROMPT = "The capital of France is"


def greedy_perfx(model, prompt, steps):
    model.prefill(prompt, 0)
    tokens, pos = [], len(prompt)
    for _ in range(steps):
        tokens.append(model.argmax())
        model.decode_one(tokens[-1], pos)
        pos += 1
    return tokens


def greedy_llama(llm, prompt, steps):
    llm.reset()
    llm.eval(prompt)
    tokens = []
    for _ in range(steps):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    return tokens


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--text", type=Path, default=Path(__file__).parent / "data" / "public_domain.txt")
    parser.add_argument("--ctx", type=int, default=256, help="perplexity chunk (and context)")
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--greedy", type=int, default=24)
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    out = {"model": str(args.model)}
    llm = open_llama(args.model, ctx=max(512, args.ctx), logits_all=True)
    model, source = load_model(str(args.model), ctx=max(512, args.ctx), log=lambda line: print(line, file=sys.stderr))
    tok = source.tokenizer
    out["recipe"] = f"{source.config.architecture}: {source.config.describe_recipe()}"
    prompt = tok.encode(PROMPT, add_bos=tok.add_bos_token)
    out["prompt_ids_equal"] = prompt == tokenize(llm, PROMPT)
    want = llama_logits(llm, prompt)[-1]
    model.prefill(prompt, 0)
    mine = model.logits()
    out["logits_perfx_vs_llama"] = relative_error(mine, want)
    if not args.no_reference:
        ref, _ = forward64.model_forward(source, prompt, ctx=max(512, args.ctx))
        out["logits_perfx_vs_reference"] = relative_error(mine, ref[-1])
        out["logits_llama_vs_reference"] = relative_error(want, ref[-1])
    a, b = greedy_perfx(model, prompt, args.greedy), greedy_llama(llm, prompt, args.greedy)
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    out.update(greedy_equal_tokens=same, greedy_steps=args.greedy, perfx_text=tok.decode(a), llama_text=tok.decode(b))
    ids = tok.encode(args.text.read_text(encoding="utf-8"), add_bos=tok.add_bos_token, parse_special=False)
    ids = ids[: args.ctx * args.chunks]
    bos = tok.bos_id if tok.add_bos_token else None
    out["ppl_llama"] = perplexity(ids, args.ctx, lambda chunk: llama_logits(llm, chunk), bos)["ppl"]
    out["ppl_perfx"] = perplexity(ids, args.ctx, lambda chunk: model.prefill_logits(chunk, 0), bos)["ppl"]
    speed_prompt = [int(t) for t in np.random.default_rng(0).integers(3, source.config.vocab_size, 64)]
    out["llama"] = measure_llama(llm, speed_prompt, 32)
    started = time.perf_counter()
    out["perfx"] = {k: v for k, v in measure_e2e(model, 64, 33).items()
                    if k in ("prefill_tok_s", "decode_tok_s", "weight_bytes", "decode_gb_s")}
    out["perfx"]["wall_s"] = time.perf_counter() - started
    print(json.dumps(out, indent=1) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
