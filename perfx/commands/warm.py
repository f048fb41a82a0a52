"""`perfx warm`: build every kernel a model runs, at once on every core, so that the first `perfx generate`
(or chat, serve, bench) after an install or an upgrade does not wait for the compiler.

The kernels are those of the model's plan (``perfx.model.kernel_requests``: the decode step's and every
prefill bucket's, each choice's first parameters), built together by ``Device.build_many`` with a progress
bar; then the model is loaded and runs a prompt of each bucket's size once, which builds the few kernels a
plan does not name (the decode step's int8 ones, the variants chosen at run time). The builds land in
pyopencl's binary cache (PoCL: its own kernel cache), where every later process finds them.
"""

from __future__ import annotations

import json
import time

from perfx.commands.options import add_model_options, log
from perfx.model import PREFILL_CHUNK, Model, kernel_requests
from perfx.progress import Progress
from perfx.runtime import Device, show_build_logs
from perfx.sources import open_named
from perfx.tuning.database import M_BUCKETS, bucket_representative, default_database


def add_arguments(parser):
    add_model_options(parser)
    parser.add_argument("--workers", type=int, default=None,
                        help="kernels built at once (default: PERFX_BUILD_WORKERS, else the CPU count, at most 8)")
    parser.add_argument("--json", action="store_true", help="print what was built as JSON on stdout")


def prompt_sizes(ctx: int) -> list[int]:
    """One prompt length a prefill bucket, up to a prefill chunk (and the context)."""
    limit = min(ctx, PREFILL_CHUNK)
    return [m for m in (bucket_representative(b) for b in range(1, len(M_BUCKETS))) if m <= limit]


def main(args) -> int:
    if args.verbose:
        show_build_logs()
    started = time.perf_counter()
    device = Device(args.device)
    source = open_named(args.model, quantize=args.quantize, lm_head=args.lm_head, embedding=args.embedding)
    database = default_database(not args.no_tuning)
    note = (lambda text: None) if args.json else log
    requests = kernel_requests(source, device, args.ctx, database, args.kv)
    workers = device.build_workers(args.workers)
    note(f"perfx: building the {len(set(requests))} kernels of {args.model}'s plan on {device.caps.name} "
         f"({device.caps.platform}), {workers} at once")
    with Progress(len(set(requests)), "kernels", enabled=None if not args.json else False) as bar:
        report = device.build_many(requests, workers, on_done=lambda key, error: bar.update(note=key[0]))
    for key, error in report.errors.items():
        note(f"perfx: kernels/{key[0]} {dict(key[1])} did not build ({error.summary}): the load takes the next "
             "choice")
    # the load, and one prompt a bucket: builds (one at a time) the kernels no plan names
    model = Model.load(source, device, ctx=args.ctx, progress=False if args.json else None, database=database,
                       log=note, kv=args.kv)
    for m in prompt_sizes(model.max_positions):
        model.prefill([0] * m, 0)
    model.decode_one(0, 0)
    device.queue.finish()
    counts = device.build_counts()
    result = {"model": args.model, "device": device.caps.name, "platform": device.caps.platform,
              "kernels": counts["programs"], "compiled": counts["compiled"], "from_cache": counts["from_cache"],
              "plan": report.as_dict(), "seconds": round(time.perf_counter() - started, 3),
              "serial_reason": device.serial_reason}
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        cached = ("" if counts["compiled"] is None
                  else f": {counts['compiled']} compiled, {counts['from_cache']} from the cache")
        log(f"perfx: {counts['programs']} kernels ready{cached}, in {result['seconds']:.1f} s "
            f"({len(report.built)} of the plan's on {report.workers} threads in {report.seconds:.1f} s)"
            + (f"; built one at a time: {device.serial_reason}" if device.serial_reason else ""))
    return 0
