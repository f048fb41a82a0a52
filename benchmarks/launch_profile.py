"""A decode step or a prefill, launch by launch: device time per kernel, launches, the gaps between them.

    python benchmarks/launch_profile.py [--model default] [--device intel] [--prefill 64] [--repeat 15]

The model's own launches are recorded (``Device.record``) and replayed back to back with profiling events, as a
decode step runs them; the fastest of ``--repeat`` replays is reported (the others carry the machine's noise).
Decode: the step at position 40 (the cache filled to there). ``--prefill M``: an M-token prompt's prefill.
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np


def profile(model, launches, repeat: int) -> dict:
    queue = model.device.queue
    best = None
    for _ in range(repeat):
        events = [(getattr(step, "kernel", None), step.enqueue(queue)) for step in launches]
        queue.finish()
        rows = [(kernel.function_name if kernel is not None else "copy", event.profile.start, event.profile.end)
                for kernel, event in events]
        span = (rows[-1][2] - rows[0][1]) * 1e-9
        if best is None or span < best[0]:
            best = (span, rows)
    span, rows = best
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for name, start, end in rows:
        kernels[name][0] += 1
        kernels[name][1] += (end - start) * 1e-9
    gaps = sum(max(0, rows[i + 1][1] - rows[i][2]) for i in range(len(rows) - 1)) * 1e-9
    return {"launches": len(rows), "span_ms": span * 1e3, "gaps_ms": gaps * 1e3,
            "kernels": {name: {"launches": n, "ms": t * 1e3, "us_each": t / n * 1e6}
                        for name, (n, t) in sorted(kernels.items(), key=lambda item: -item[1][1])}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default=None, help="as PERFX_DEVICE takes it (default: perfx's choice)")
    parser.add_argument("--prefill", type=int, default=0, help="profile an M-token prefill instead of a decode step")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from perfx.model import load_model

    model, _ = load_model(args.model, args.device, ctx=512, progress=False)
    queue = model.device.queue
    if args.prefill:
        ids = [int(t) for t in np.random.default_rng(0).integers(3, model.config.vocab_size, args.prefill)]
        model.prefill(ids, 0)   # builds the bucket's kernels
        queue.finish()
        with model.device.record() as launches:
            model.prefill(ids, 0)
        launches = list(launches)
        what = f"prefill of {args.prefill} tokens"
    else:
        model.prefill([5], 0)
        for pos in range(1, 40):
            model.decode_one(7, pos)
        queue.finish()
        launches = model.decode_launches(40)
        model.device.write(model.state.step, np.array([7, 40], np.int32))
        what = "decode step at position 40"
    with model.device.profiling():   # the events' times: on the device's profiling queue
        result = {"model": args.model, "device": model.device.caps.name, "what": what,
                  **profile(model, launches, args.repeat)}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{what} on {model.device}: {result['launches']} launches, {result['span_ms']:.2f} ms "
          f"(gaps {result['gaps_ms']:.2f} ms), the fastest of {args.repeat}")
    for name, k in result["kernels"].items():
        print(f"  {name:32s} {k['launches']:4d}  {k['ms']:8.3f} ms  {k['us_each']:8.1f} µs each")


if __name__ == "__main__":
    main()
