"""`perfx warm`: build every kernel a model runs, at once on every core, so that the first `perfx generate`
(or chat, serve, bench, perplexity) after an install or an upgrade does not wait for the compiler.

The kernels are those a model of these settings can run (``perfx.model.kernel_requests``: the decode step's,
every prefill bucket's, the int8 ones of each weight form, the lm_head over many rows that perplexity, a batched
decode step and speculation run, constrained decoding's mask), built together by ``Device.build_many`` with a
progress bar. Then the model is loaded and runs what users run once (a prompt of each bucket's size with the
logits of every row, a decode step, a masked choice): a kernel the collection missed is built there, one at a
time, and reported as ``missed``. The builds land in pyopencl's binary cache (PoCL: its own kernel cache), where
every later process finds them.
"""

from __future__ import annotations

import json
import time

import numpy as np

from perfx.commands.options import add_model_options, log
from perfx.generate import SamplingConfig
from perfx.model import PREFILL_CHUNK, Model, kernel_requests
from perfx.ops.logit_mask import mask_words
from perfx.progress import Progress
from perfx.runtime import Device, show_build_logs
from perfx.sources import open_named
from perfx.tuning.database import M_BUCKETS, bucket_representative, default_database


def add_arguments(parser):
    add_model_options(parser)
    parser.add_argument("--workers", type=int, default=None,
                        help="kernels built at once (default: PERFX_BUILD_WORKERS, else the CPU count, at most 8)")
    parser.add_argument("--json", action="store_true",
                        help="print what was built as JSON on stdout: the kernels held, how many were compiled "
                             "and how many came from the cache, the plan's builds at once, any missed, the seconds")


def prompt_sizes(ctx: int) -> list[int]:
    """One prompt length a prefill bucket, up to a prefill chunk (and the context)."""
    limit = min(ctx, PREFILL_CHUNK)
    return [m for m in (bucket_representative(b) for b in range(1, len(M_BUCKETS))) if m <= limit]


def warm(source, device: Device, ctx: int | None = None, database=None, kv: str = "f16", workers: int | None = None,
         log=None, progress: bool | None = False) -> dict:
    """Build every kernel a model of ``source`` with these settings runs (``kernel_requests``) at once on
    ``workers`` (``Device.build_many``), then load it and run each kind of step once; returns what `perfx warm
    --json` prints: ``kernels`` held, ``compiled`` and ``from_cache`` (``Device.build_counts``), ``plan`` (the
    builds at once, ``BuildReport.as_dict``), ``missed`` (kernels the run built that the plan did not name: each
    built one at a time), ``seconds``, ``serial_reason``. ``log`` receives one line per failed build."""
    note = log or (lambda text: None)
    started = time.perf_counter()
    database = database if database is not None else default_database()
    requests = kernel_requests(source, device, ctx, database, kv)
    with Progress(len(set(requests)), "kernels", enabled=progress) as bar:
        report = device.build_many(requests, workers, on_done=lambda key, error: bar.update(note=key[0]))
    for key, error in report.errors.items():
        note(f"perfx: kernels/{key[0]} {dict(key[1])} did not build ({error.summary}): the load takes the next "
             "choice")
    planned = set(requests)
    model = Model.load(source, device, ctx=ctx, progress=progress, database=database, log=note, kv=kv)
    _run_each_step(model)
    counts = device.build_counts()
    missed = sorted({key[0] for key in device.program_keys - planned})
    return {"model": source.describe().get("path"), "device": device.caps.name, "platform": device.caps.platform,
            "kernels": counts["programs"], "compiled": counts["compiled"], "from_cache": counts["from_cache"],
            "plan": report.as_dict(), "missed": missed, "seconds": round(time.perf_counter() - started, 3),
            "serial_reason": device.serial_reason}


def _run_each_step(model: Model) -> None:
    """A prompt of each bucket's size with every row's logits (the lm_head over rows: perplexity, speculation, a
    batched step), a decode step and a masked choice (constrained decoding)."""
    for m in prompt_sizes(model.max_positions):
        model.prefill_logits([0] * m, 0)
    model.decode_one(0, 0)
    vocab = model.config.vocab_size
    model.masked_token(np.full(mask_words(vocab), 0xFFFFFFFF, np.uint32), SamplingConfig(temperature=0), 0, [], 1)
    model.device.queue.finish()


def main(args) -> int:
    if args.verbose:
        show_build_logs()
    device = Device(args.device)
    source = open_named(args.model, quantize=args.quantize, lm_head=args.lm_head, embedding=args.embedding)
    note = (lambda text: None) if args.json else log
    workers = device.build_workers(args.workers)
    note(f"perfx: building the kernels of {args.model} on {device.caps.name} ({device.caps.platform}), "
         f"{workers} at once")
    result = warm(source, device, args.ctx, default_database(not args.no_tuning), args.kv, args.workers, note,
                  progress=False if args.json else None)
    result["model"] = args.model
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    counts, plan = result, result["plan"]
    cached = ("" if counts["compiled"] is None
              else f": {counts['compiled']} compiled, {counts['from_cache']} from the cache")
    log(f"perfx: {counts['kernels']} kernels ready{cached}, in {result['seconds']:.1f} s "
        f"({plan['built']} of the plan's on {plan['workers']} {'processes' if plan['processes'] else 'threads'} "
        f"in {plan['seconds']:.1f} s)"
        + (f"; {len(result['missed'])} built one at a time that the plan missed: {', '.join(result['missed'])}"
           if result["missed"] else "")
        + (f"; built one at a time: {result['serial_reason']}" if result["serial_reason"] else ""))
    return 0
