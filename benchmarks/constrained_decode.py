"""What constrained decoding costs a decode step: the default model's decode tok/s with a JSON schema (the mask
computed by llguidance on the host, uploaded, applied on the device; the steps one at a time) against the same
model unconstrained (the decode loop on the device, a step ahead), interleaved rounds, greedy; and the host's
share: llguidance's mask and advance per token.

    python benchmarks/constrained_decode.py [--rounds 5] [--tokens 96]   (PERFX_DEVICE picks the device)
"""

from __future__ import annotations

import argparse
import statistics
import time

from perfx.constrain import Constraint
from perfx.generate import SamplingConfig, generate
from perfx.model import load_model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["title", "story"],
          "properties": {"title": {"type": "string", "maxLength": 40}, "story": {"type": "string", "minLength": 1000}}}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    model, source = load_model("default", progress=False)
    tokenizer = source.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Write a long story about a spider as JSON."}])
    prompt = tokenizer.encode(text, add_bos=tokenizer.add_bos_token)
    greedy = SamplingConfig(temperature=0)
    rates = {"free": [], "schema": []}
    for _ in range(args.rounds):
        free = generate(model, tokenizer, prompt, args.tokens, greedy, stop_strings=["\x00"])
        rates["free"].append(free.stats.decode_tok_s)
        held = generate(model, tokenizer, prompt, args.tokens, greedy,
                        constraint=Constraint.from_json_schema(SCHEMA, tokenizer))
        rates["schema"].append(held.stats.decode_tok_s)
        print(f"free {free.stats.decode_tok_s:.1f} tok/s ({len(free.ids)} tokens), schema "
              f"{held.stats.decode_tok_s:.1f} tok/s ({len(held.ids)} tokens, {held.stats.stop_reason})")
    ratios = [s / f for s, f in zip(rates["schema"], rates["free"])]
    print(f"schema / free: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}")
    constraint, ids = Constraint.from_json_schema(SCHEMA, tokenizer), held.ids
    started = time.perf_counter()
    for token in ids:
        constraint.allowed()
        constraint.advance(token)
    per_token = (time.perf_counter() - started) / len(ids)
    print(f"llguidance: {1e3 * per_token:.3f} ms a token (mask and advance, V = {tokenizer.vocab_size}); "
          f"the mask uploaded is {4 * ((tokenizer.vocab_size + 31) // 32)} bytes a token")


if __name__ == "__main__":
    main()
