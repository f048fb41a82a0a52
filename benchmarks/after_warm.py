"""What a first session still builds after `perfx warm`: from an empty kernel cache (a temporary XDG_CACHE_HOME
a run, the model file linked in), `perfx warm --json` in one process, then in another a load and a greedy
generation, speculation (prompt lookup), perplexity and a batched decode step of 2 sequences, each with the
seconds its thread spent building (``Device.compile_seconds``) and, at the end, how many programs were compiled
rather than taken from the cache (``Device.build_counts``). ``--tree DIR`` runs another checkout's perfx (an
export of an older commit) in the same rounds, interleaved:

    PYTHONPATH=. python benchmarks/after_warm.py --rounds 2
    git archive COMMIT perfx tuning | tar -x -C /tmp/old
    PYTHONPATH=. python benchmarks/after_warm.py --rounds 2 --tree /tmp/old
    PYTHONPATH=. python benchmarks/after_warm.py --rounds 2 --tree /tmp/old --no-warm   # a first session, no warm
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SESSION = """
import json, time
import numpy as np
import perfx
from perfx.batch import Batch
from perfx.commands.perplexity import perplexity
from perfx.generate import SamplingConfig, generate
from perfx.model import load_model
from perfx.speculative import Speculator
started = time.perf_counter()
model, _ = load_model({model!r}, ctx={ctx}, progress=False)
device, rng = model.device, np.random.default_rng(1)
out = {{"load_s": round(time.perf_counter() - started, 2)}}

def ids(n):
    return rng.integers(3, model.config.vocab_size, n).tolist()

def batched():
    batch = Batch(model, 2)
    batch.prefill(0, ids(5), 0)
    batch.prefill(1, ids(7), 0)
    for _ in range(4):
        batch.step([(0, 5), (1, 6)])

for name, run in [("generate", lambda: generate(model, None, ids(20), 16, SamplingConfig(temperature=0))),
                  ("speculation", lambda: generate(model, None, ids(6) * 4, 16, SamplingConfig(temperature=0),
                                                   speculator=Speculator("lookup"))),
                  ("perplexity", lambda: perplexity(model, ids({ctx}), {ctx} // 2, 2, None)),
                  ("batch of 2", batched)]:
    began, compiled = time.perf_counter(), device.compile_seconds()
    run()
    device.queue.finish()
    out[name] = {{"s": round(time.perf_counter() - began, 2), "building_s": round(device.compile_seconds() - compiled, 2)}}
out["programs"] = device.build_counts()
print(json.dumps(out))
"""


def one_run(tree: str | None, model: str, ctx: int, warm: bool = True) -> dict:
    with tempfile.TemporaryDirectory(prefix="perfx-after-warm-") as cache:
        models = Path(cache) / "perfx" / "models"
        models.mkdir(parents=True)
        source = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "perfx" / "models"
        for file in source.glob("*.gguf"):   # the default model, not fetched again
            (models / file.name).symlink_to(file)
        here = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "XDG_CACHE_HOME": cache, "PYTHONPATH": tree or here}
        began = time.perf_counter()
        if warm:
            done = subprocess.run([sys.executable, "-m", "perfx", "warm", "--model", model, "--ctx", str(ctx),
                                   "--json"], env=env, cwd=cache, capture_output=True, text=True, check=True)
        warm_s = time.perf_counter() - began
        # run from the cache folder: the checkout's folder first on sys.path would shadow --tree
        session = subprocess.run([sys.executable, "-c", SESSION.format(model=model, ctx=ctx)], env=env, cwd=cache,
                                 capture_output=True, text=True, check=True)
    out = {"tree": tree or "this checkout"}
    if warm:
        w = json.loads(done.stdout)
        out.update({"warm_s": round(warm_s, 1), "warm kernels": w["kernels"], "at once": w["plan"]["requested"],
                    "missed": w.get("missed")})
    return {**out, **json.loads(session.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--tree", help="another checkout's perfx, run in the same rounds (PYTHONPATH)")
    parser.add_argument("--no-warm", action="store_true", help="the session alone, from empty caches: what a first "
                                                                   "session without `perfx warm` builds")
    args = parser.parse_args()
    for _ in range(args.rounds):
        for tree in ([args.tree] if args.tree else []) + [None]:
            print(json.dumps(one_run(tree, args.model, args.ctx, not args.no_warm)), flush=True)


if __name__ == "__main__":
    main()
