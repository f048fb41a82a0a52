"""Host time per decode step, and end-to-end prefill and decode, of one source tree against another.

    python benchmarks/decode_host.py [--model default] [--device intel] [--tokens 64] [--tree DIR ...]

Host time: each decode step is followed by a wait for the queue, so the time ``decode_one`` spends (summed in
Model.host_seconds) holds only the enqueueing, never a wait behind the device. End to end: ``perfx bench
--e2e``'s measurement (a 64-token prompt, 32 greedy tokens). With ``--tree`` the same measurement runs in each
source tree given (a checkout of an earlier commit against this one), interleaved round by round in fresh
processes, so the trees share the machine's state; each tree uses its own shipped tuning entries. With
``--replay both`` each tree runs twice a round: its step as one command buffer (PERFX_COMMAND_BUFFER=on,
where the driver has cl_khr_command_buffer) and one enqueue a launch (perfx's default); ``--replay qcom`` as
one Adreno recording (PERFX_REPLAY=qcom, where the driver has cl_qcom_recordable_queues); ``--replay all``
each of the three.

    python benchmarks/decode_host.py --tree . --replay both --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(model_name: str, device_name: str, tokens: int) -> dict:
    import numpy as np

    from perfx.commands.bench import measure_e2e
    from perfx.model import load_model

    model, _ = load_model(model_name, device_name, ctx=512, progress=False)
    queue = model.device.queue
    ids = np.random.default_rng(0).integers(3, model.config.vocab_size, tokens)
    model.prefill([int(ids[0])], 0)
    queue.finish()
    host, wall = [], []
    for pos, token in enumerate(ids[1:], start=1):
        before = model.host_seconds
        started = time.perf_counter()
        model.decode_one(int(token), pos)
        queue.finish()
        wall.append(time.perf_counter() - started)
        host.append(model.host_seconds - before)
    skip = len(host) // 4   # the first steps build and warm caches
    measure_e2e(model, 8, 4)   # builds the prompt path's kernels, so the measurement below times no compiler
    e2e = measure_e2e(model)
    return {"host_ms": 1e3 * statistics.median(host[skip:]), "step_ms": 1e3 * statistics.median(wall[skip:]),
            "prefill_tok_s": e2e["prefill_tok_s"], "decode_tok_s": e2e["decode_tok_s"],
            "launches": len(getattr(model, "_decode_plans", {}).get(1, ()) or getattr(model, "_decode_plan", ())),
            "replay": getattr(model.device, "replay_mode", "one enqueue a launch")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default=os.environ.get("PERFX_DEVICE", "intel"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[], help="a source tree to measure (repeatable)")
    parser.add_argument("--replay", choices=("on", "off", "both", "qcom", "all"), default="off",
                        help="the decode step as one command buffer where the driver has them (on), one enqueue "
                             "a launch (off, perfx's default), on and off in turn (both), one Adreno recording "
                             "where the driver has them (qcom), or all three in turn (all)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # a child process: one run
    args = parser.parse_args()
    if args.one or not args.tree:
        print(json.dumps(measure(args.model, args.device, args.tokens)))
        return
    modes = {"both": ("on", "off"), "all": ("on", "qcom", "off")}.get(args.replay, (args.replay,))
    results = {(tree, mode): [] for tree in args.tree for mode in modes}
    for _ in range(args.rounds):
        for tree, mode in results:
            env = {**os.environ, "PYTHONPATH": tree, "PERFX_COMMAND_BUFFER": "on" if mode == "on" else "off",
                   "PERFX_REPLAY": "qcom" if mode == "qcom" else ""}
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", "--model", args.model,
                                  "--device", args.device, "--tokens", str(args.tokens)], cwd=tree,
                                 env=env, capture_output=True, text=True, check=True)
            results[tree, mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(tree, mode, results[tree, mode][-1], flush=True)
    for (tree, mode), runs in results.items():
        summary = {"tree": tree, "device": args.device, "replay": runs[-1].get("replay"),
                   "launches": runs[-1]["launches"]}
        for key in ("host_ms", "step_ms", "prefill_tok_s", "decode_tok_s"):
            values = [r[key] for r in runs]
            summary[key] = [round(statistics.median(values), 3), round(min(values), 3), round(max(values), 3)]
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
