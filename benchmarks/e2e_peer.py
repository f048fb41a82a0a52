"""perfx (one or more devices or tuning databases) and llama.cpp's CPU backend on the same GGUF, interleaved.

Per round each engine prefills a 130-token random prompt and decodes 64 greedy tokens (llama.cpp: 2
threads), engines in turn; median and min–max over the rounds (the method of peer_llamacpp.py). An engine is
a device selector, optionally with ``@DIR``: the PERFX_CACHE (tuning database) its model is loaded with, so
two databases on one device compare in the same run, and ``#fp16`` or ``#q8``: the lm_head's form.

    python benchmarks/e2e_peer.py intel,pocl 5
    python benchmarks/e2e_peer.py intel@/tmp/cache_a,intel@/tmp/cache_b#fp16 7 [--json=out.json]

llama-cpp-python is a benchmark tool here, never a perfx dependency.
"""
import json
import os
import statistics
import sys
import time

import numpy as np

from perfx.commands.bench import measure_e2e
from perfx.model import load_model
from perfx.runtime import Device
from perfx.sources.default import resolve_model

PROMPT, DECODE = 130, 64


def measure_llama(llm, prompt):
    llm.reset()
    t = time.perf_counter()
    llm.eval(prompt)
    prefill = time.perf_counter() - t
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t = time.perf_counter()
    for _ in range(DECODE):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    decode = time.perf_counter() - t
    return {"prefill_tok_s": len(prompt) / prefill, "decode_tok_s": DECODE / decode}


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--json")]
    out = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--json=")), None)
    devices = args[0].split(",")
    rounds = int(args[1]) if len(args) > 1 else 5
    path = str(resolve_model("default"))
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=512, n_batch=512, n_threads=2, n_threads_batch=2, n_gpu_layers=0,
                verbose=False)
    engines = {}
    for sel in devices:
        sel, _, head = sel.partition("#")
        sel, _, cache = sel.partition("@")
        if cache:
            os.environ["PERFX_CACHE"] = cache
        d = Device(sel)
        model, _ = load_model("default", d, progress=False, default_ctx=512, lm_head=head or "q8")
        engines[f"perfx {d.caps.platform} {cache} lm_head {head or 'q8'}"] = (
            lambda model=model: measure_e2e(model, PROMPT, DECODE))
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, llm.n_vocab(), PROMPT)]
    engines["llama.cpp"] = lambda: measure_llama(llm, prompt)
    results = {name: [] for name in engines}
    for r in range(rounds):
        for name, run in engines.items():
            results[name].append(run())
            print(name, {k: round(v, 1) for k, v in results[name][-1].items() if k.endswith("tok_s")}, flush=True)
    print("\nmedian (min-max) over", rounds, "rounds")
    for name, rows in results.items():
        line = []
        for key in ("prefill_tok_s", "decode_tok_s"):
            vals = [row[key] for row in rows]
            line.append(f"{key} {statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f})")
        print(f"  {name:30s} " + "  ".join(line))
    if out:
        with open(out, "w") as f:
            json.dump(results, f, default=float, indent=1)


if __name__ == "__main__":
    main()
