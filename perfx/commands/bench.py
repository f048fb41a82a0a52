"""`perfx bench`: the device's ceilings, then each kernel at a model's shapes with its tuned parameters.

Ceilings: copy bandwidth (``perfx.timing.copy_bandwidth``), the read-only stream (``perfx.timing.read_bandwidth``:
what a kernel that reads far more than it writes, a decode GEMV, could reach) and peak fp32 arithmetic
(``kernels/peak_flops.cl``: chains of multiply-adds on float4/8/16, the best width reported). Each
kernel is checked against the reference once, then timed with the same timing module as the tuner
and the pytest-benchmark suite, and reported against the ceiling that bounds it (roofline: memory
below the ridge point flops/byte = peak / bandwidth, compute above): a memory-bound kernel as a percent of copy
(``percent_of_ceiling``, the measure perfx's goals are stated in) and of the read stream (``percent_of_read``).

``--e2e`` adds end-to-end figures (``measure_e2e``: prefill and decode tok/s, TTFT, achieved GB/s, host
time per token, memory); benchmarks/bench_e2e.py reports the same figures through the same functions.
"""

from __future__ import annotations

import json
import random
import sys

import numpy as np

from perfx.commands.options import add_kernel_options, add_no_tuning_option
from perfx.errors import PerfxError
from perfx.generate import SamplingConfig, generate
from perfx.model import load_model
from perfx.progress import Progress, format_table
from perfx.runtime import Device
from perfx.timing import bootstrap_ratio, copy_bandwidth, read_bandwidth, time_launches
from perfx.tuning import select_specs
from perfx.tuning.database import default_database
from perfx.tuning.problems import problems_for
from perfx.tuning.spec import time_case

PEAK_WIDTHS = (4, 8, 16)


def add_arguments(parser):
    add_kernel_options(parser, "measure")
    parser.add_argument("--e2e", action="store_true",
                        help="also end-to-end figures: prefill/decode tok/s, TTFT, host time per token, memory")
    parser.add_argument("--ctx", type=int,
                        help="with --e2e: the KV cache sized for CTX positions (the memory figures are the model's at "
                             "that context) and the prompt and decode run at its end, after a cache filled with "
                             "arbitrary values (attention reads as many positions as in a conversation that long); "
                             "synthetic models included, so a model and context can be sized before downloading")
    fuse = parser.add_mutually_exclusive_group()
    fuse.add_argument("--fuse", dest="fuse", action="store_true", default=None,
                      help="with --e2e: the decode step's norms as tails of the GEMVs beside them (5 launches a dense "
                           "layer, not 8; docs/kernels.md); default: as PERFX_FUSE says, else where the device's "
                           "compiler orders the tails' hand-off (OpenCL C 2.0 or later)")
    fuse.add_argument("--no-fuse", dest="fuse", action="store_false",
                      help="with --e2e: each norm of the decode step its own launch")
    parser.add_argument("--vs-defaults", action="store_true",
                        help="does tuning help here? each kernel (and, with --e2e, the model) with its tuned "
                             "parameters and with the built-in defaults, interleaved in shuffled rounds, with the "
                             "ratio and its 95%% bootstrap interval")
    parser.add_argument("--rounds", type=int, default=7,
                        help="interleaved rounds for --vs-defaults (default %(default)s; at least 4)")
    add_no_tuning_option(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def peak_flops(device, widths=PEAK_WIDTHS, iters: int = 256, min_seconds: float = 0.005) -> tuple[float, dict]:
    """The device's peak fp32 GFLOP/s (best over vector widths), and the figure of each width."""
    per_width = {}
    most = 1 << 22
    out = device.empty(most, np.float32)
    a, b = np.float32(1 - 2 ** -10), np.float32(2 ** -10)
    for vw in widths:
        kernel = device.kernel("peak_flops.cl", "peak_mad", {"VW": vw, "ITERS": iters})
        n = 1 << 12
        while True:  # grow the launch until it is long enough to time well
            timing = time_launches(lambda: [device.launch(kernel, (n,), None, out.data, a, b)], warmup=1, repeat=5,
                                   device=device)
            if timing.median_s >= min_seconds or n >= most:
                break
            n = min(most, n * max(2, int(min_seconds / max(timing.median_s, 1e-7)) // 2 * 2 or 2))
        per_width[vw] = 2 * 8 * vw * iters * n / timing.median_s / 1e9
    return max(per_width.values()), per_width


def ceilings(device) -> dict:
    copy_gbps, timing = copy_bandwidth(device)
    read_gbps, read_timing = read_bandwidth(device)
    peak, per_width = peak_flops(device)
    return {"copy_gb_per_s": copy_gbps, "copy_spread": timing.spread, "read_gb_per_s": read_gbps,
            "read_spread": read_timing.spread, "peak_gflop_per_s": peak,
            "peak_by_vector_width": {f"float{k}": v for k, v in per_width.items()}}


def interleaved(measure, contenders: list, rounds: int, seed: int = 0) -> list[list[float]]:
    """``measure(contender)`` for each contender, in a shuffled order, ``rounds`` times: per round, each
    contender's figure in contender order. Interleaving keeps drift (heat, other load) from favouring one."""
    order, shuffle, results = list(range(len(contenders))), random.Random(seed), []
    for _ in range(rounds):
        shuffle.shuffle(order)
        figures = [0.0] * len(contenders)
        for i in order:
            figures[i] = measure(contenders[i])
        results.append(figures)
    return results


def bench_problem(device, spec, problem, ceiling: dict, rng, database, vs_defaults: int = 0) -> dict:
    """One kernel at one shape with the parameters the database chooses: check, time, rate; with
    ``vs_defaults`` rounds, also the defaults interleaved with it and the gain with its interval."""
    shape = problem.shape
    row = {"family": spec.params.family, "label": problem.label, "shape": shape,
           "description": spec.describe(shape)}
    found = database.choices(device, spec, shape)
    if not found:  # a variant family this device lacks the features for (fp16 GEMM on PoCL): not a failure
        row.update(params={}, source="-", unsupported=f"no parameter set fits on {device.caps.name}")
        return row
    choice = found[0]
    row.update(params=choice.params, source=choice.source, detail=choice.detail)
    try:
        case = spec.make_case(device, shape, rng)
        defaults = dict(spec.params.resolve(None, shape, device.caps))   # what runs untuned
        contenders = [choice.params] + ([defaults] if vs_defaults and choice.params != defaults else [])
        worst, verified = 0.0, True
        for params in contenders:
            with device.watch_kernels() as kernels:
                errors = case.errors(params)
            worst = max([worst, *errors.values()])
            verified = verified and all(e <= spec.tolerance_for(params) for e in errors.values())
            if params is choice.params:
                row["private_bytes"] = max((i.private_mem for i in kernels.values()), default=None)
        row["error"], row["verified"] = worst, verified
        probe = time_case(case, choice.params, warmup=1, repeat=1, device=device)
        repeat = 3 if probe.median_s > 0.2 else 10
        timing = time_case(case, choice.params, warmup=1, repeat=repeat, device=device)
        if vs_defaults:
            rounds = interleaved(lambda p: time_case(case, p, warmup=1, repeat=3, device=device).median_s, contenders,
                                 vs_defaults)
            columns = list(zip(*rounds))
            gain, low, high = (bootstrap_ratio(columns[1], columns[0], rng) if len(columns) == 2 else (1.0, 1.0, 1.0))
            row.update(tuned_time_s=float(np.median(columns[0])), defaults_time_s=float(np.median(columns[-1])),
                       gain=gain, gain_interval=[low, high], rounds=vs_defaults)
    except PerfxError as e:
        row["failure"] = str(e).splitlines()[0]
        return row
    flops, nbytes = int(spec.flops(shape)), int(spec.bytes_moved(shape))
    gbps, gflops = nbytes / timing.median_s / 1e9, flops / timing.median_s / 1e9
    ridge = ceiling["peak_gflop_per_s"] / ceiling["copy_gb_per_s"]
    bound = "compute" if flops and flops / nbytes > ridge else "memory"
    row.update(time_s=timing.median_s, spread=timing.spread, samples_s=timing.samples, bytes_moved=nbytes,
               flops=flops, gb_per_s=gbps, gflop_per_s=gflops, bound=bound,
               percent_of_ceiling=100 * (gflops / ceiling["peak_gflop_per_s"] if bound == "compute"
                                         else gbps / ceiling["copy_gb_per_s"]),
               percent_of_read=100 * gbps / ceiling["read_gb_per_s"])
    return row


def measure_e2e(model, prompt_tokens: int = 64, decode_tokens: int = 32, seed: int = 0, at_end: bool = False) -> dict:
    """Prefill ``prompt_tokens`` random ids, then decode ``decode_tokens`` greedily (EOS ignored): prefill
    and decode tok/s, TTFT, achieved GB/s (model bytes × tok/s), host time per token, memory. ``at_end``: at the
    end of the context, after ``Model.fill_to`` (``depth`` in the result: the position the prompt starts at)."""
    c = model.config
    prompt_tokens = max(1, min(prompt_tokens, model.max_positions - decode_tokens - 1))
    prompt = [int(t) for t in np.random.default_rng(seed).integers(3, c.vocab_size, prompt_tokens)]
    depth = max(0, model.max_positions - prompt_tokens - decode_tokens - 1) if at_end else 0
    if depth:
        model.fill_to(depth)
    result = generate(model, None, prompt, decode_tokens, SamplingConfig(temperature=0), start_pos=depth)
    s = result.stats
    report = model.load_report
    # the last decode step's kernel launches and copies, as the greedy loop enqueues them
    step = model.greedy_launches(result.end_pos - 1)
    launches = sum(1 for op in step if hasattr(op, "kernel"))
    return {"prompt_tokens": s.prompt_tokens, "decode_tokens": s.generated_tokens,
            "launches_per_token": launches, "copies_per_token": len(step) - launches,
            "launches_per_layer": launches_per_layer(model.step_launches(result.end_pos - 1)),
            "ttft_s": s.ttft_s, "prefill_tok_s": s.prefill_tok_s, "decode_tok_s": s.decode_tok_s,
            "decode_gb_s": s.decode_gb_s, "host_ms_per_token": 1e3 * s.host_s_per_token,
            "weight_bytes": model.weight_bytes, "device_bytes": report["device_bytes"],
            "device_peak_bytes": model.device.peak_allocated_bytes, "host_peak_bytes": report["host_peak_bytes"],
            "load_s": report["load_s"], "ctx": report["ctx"], "depth": depth,
            "kv": report["kv"], "kv_cache_bytes": report["kv_cache_bytes"], "int4_forms": report["int4_forms"],
            "conv_state_bytes": report.get("conv_state_bytes", 0),
            "recurrent_state_bytes": report.get("recurrent_state_bytes", 0),
            "restore_points": report.get("restore_points", 0),
            "restore_point_bytes": report.get("restore_point_bytes", 0)}


def launches_per_layer(counted: dict) -> dict:
    """``Model.step_launches`` by layer kind: {kind: {"layers", "min", "max", "total"}}, and the launches outside
    the layers ("outside": the embedding gather, the final norm, the head, the draw and the hand-over)."""
    out: dict = {}
    for kind, n in zip(counted["kinds"], counted["layers"]):
        entry = out.setdefault(kind, {"layers": 0, "min": n, "max": n, "total": 0})
        entry["layers"] += 1
        entry["min"], entry["max"] = min(entry["min"], n), max(entry["max"], n)
        entry["total"] += n
    return {**out, "outside": counted["before"] + counted["after"]}


def run_e2e(device, model_name: str, prompt_tokens: int = 64, decode_tokens: int = 32, ctx: int | None = None,
            tuning: bool = True, lm_head: str = "q8", at_end: bool = False, kv: str = "f16",
            embedding: str = "head", fuse: bool | None = None) -> dict:
    """Load ``model_name`` on ``device`` with a KV cache of form ``kv`` and measure it end to end
    (``measure_e2e``; ``at_end``: at the end of a cache of ``ctx`` positions). A first, shorter run builds the
    kernels, so the figures time no compiler; its TTFT is kept as ``ttft_cold_s`` (a first prompt after
    installing, before the driver's binaries are cached: seconds on a phone)."""
    device.peak_allocated_bytes = device.allocated_bytes  # the model's peak, not earlier benchmarks'
    model, _ = load_model(model_name, device, ctx=ctx, progress=None, default_ctx=1024, tuning=tuning,
                          lm_head=lm_head, kv=kv, embedding=embedding, fuse=fuse)
    cold = measure_e2e(model, prompt_tokens, 2, at_end=at_end)
    return {"model": model_name, **measure_e2e(model, prompt_tokens, decode_tokens, at_end=at_end),
            "ttft_cold_s": cold["ttft_s"]}


def e2e_vs_defaults(device, model_name: str, rounds: int, prompt_tokens: int = 64, decode_tokens: int = 32,
                    kv: str = "f16") -> dict:
    """The model with tuning on and off, both loaded, measured end to end in interleaved shuffled rounds:
    decode and prefill tok/s of each, and tuned/defaults with its 95% bootstrap interval."""
    models = [load_model(model_name, device, progress=None, default_ctx=1024, tuning=tuning, kv=kv)[0]
              for tuning in (True, False)]
    measure_e2e(models[0], 8, 4), measure_e2e(models[1], 8, 4)  # build every kernel before timing
    runs = interleaved(lambda model: measure_e2e(model, prompt_tokens, decode_tokens), models, rounds)
    rng = np.random.default_rng(0)
    out = {"model": model_name, "rounds": rounds}
    for figure in ("decode_tok_s", "prefill_tok_s"):
        tuned, defaults = [r[0][figure] for r in runs], [r[1][figure] for r in runs]
        gain, low, high = bootstrap_ratio(tuned, defaults, rng)
        out[figure] = {"tuned": float(np.median(tuned)), "defaults": float(np.median(defaults)),
                       "tuned_range": [min(tuned), max(tuned)], "defaults_range": [min(defaults), max(defaults)],
                       "gain": gain, "gain_interval": [low, high]}
    return out


def e2e_lines(e2e: dict, copy_gb_s: float) -> list[str]:
    mib = 2**20
    return [
        f"end to end, {e2e['model']} (ctx {e2e['ctx']}" + (f", at positions {e2e['depth']}.." if e2e["depth"] else "")
        + f"): prefill {e2e['prompt_tokens']} tokens at {e2e['prefill_tok_s']:.1f} tok/s "
        f"(TTFT {1e3 * e2e['ttft_s']:.0f} ms"
        + (f"; {1e3 * e2e['ttft_cold_s']:.0f} ms the first time, building kernels" if "ttft_cold_s" in e2e else "")
        + ")",
        f"  decode {e2e['decode_tok_s']:.2f} tok/s = {e2e['decode_gb_s']:.2f} GB/s of weights "
        f"({100 * e2e['decode_gb_s'] / copy_gb_s:.0f}% of copy), host {e2e['host_ms_per_token']:.2f} ms/token, "
        f"{e2e['launches_per_token']} launches a token ("
        + ", ".join(f"{kind} layers {v['min']}" + (f"–{v['max']}" if v["max"] != v["min"] else "") + " each"
                    for kind, v in e2e["launches_per_layer"].items() if kind != "outside")
        + f", {e2e['launches_per_layer']['outside']} outside the layers)",
        f"  memory: device {e2e['device_bytes'] / mib:.0f} MiB (peak {e2e['device_peak_bytes'] / mib:.0f} MiB; "
        f"KV cache {e2e['kv']} {e2e['kv_cache_bytes'] / mib:.0f} MiB"
        + (f", conv state {e2e['conv_state_bytes'] / mib:.1f} MiB" if e2e["conv_state_bytes"] else "")
        + (f", recurrent state {e2e['recurrent_state_bytes'] / mib:.1f} MiB" if e2e["recurrent_state_bytes"] else "")
        + (f", {e2e['restore_points']} restore points {e2e['restore_point_bytes'] / mib:.1f} MiB"
           if e2e.get("restore_points") else "")
        + "), "
        f"host peak {e2e['host_peak_bytes'] / mib:.0f} MiB, weights read per token {e2e['weight_bytes'] / mib:.0f} MiB",
    ] + [f"  {form}: {count} matri{'x' if count == 1 else 'ces'}"
         for form, count in e2e.get("int4_forms", {}).items()]


def main(args) -> int:
    if args.ctx is not None and not args.e2e:
        raise PerfxError("--ctx sizes the end-to-end run's cache: add --e2e")
    if args.ctx is not None and args.vs_defaults:
        raise PerfxError("--ctx and --vs-defaults together are not supported: run --e2e --ctx alone")
    if args.vs_defaults and args.rounds < 4:
        raise PerfxError(f"--rounds must be at least 4 for --vs-defaults, got {args.rounds}")
    device = Device(args.device)
    database = default_database(not args.no_tuning)
    families = select_specs(args.kernels)
    problems, notes = problems_for(args.model, families, args.max_m, args.lm_head, args.kv, args.embedding,
                                  device.caps)
    print(f"perfx bench on {device.caps.platform} / {device.caps.name} (limits: {device.caps.limits}), "
          f"{len(problems)} kernel shapes of {args.model}" + ("" if database.enabled else ", tuning off"),
          file=sys.stderr)
    for note in notes:
        print(f"  note: {note}", file=sys.stderr)
    ceiling = ceilings(device)
    rng = np.random.default_rng(0)
    rows = []
    vs = args.rounds if args.vs_defaults else 0
    with Progress(len(problems), "bench", enabled=None if not args.json else False) as progress:
        for problem in problems:
            rows.append(bench_problem(device, families[problem.family], problem, ceiling, rng, database, vs))
            progress.update(note=f"{problem.family} {rows[-1]['description']}")
    e2e = None
    if args.e2e:
        e2e = (e2e_vs_defaults(device, args.model, args.rounds, kv=args.kv) if args.vs_defaults
               else run_e2e(device, args.model, tuning=database.enabled, lm_head=args.lm_head, ctx=args.ctx,
                            at_end=args.ctx is not None, kv=args.kv, embedding=args.embedding, fuse=args.fuse))
    failed = [r for r in rows if "unsupported" not in r and (r.get("failure") or not r.get("verified", False))]

    if args.json:
        print(json.dumps({"device": device.fingerprint, "architecture": device.caps.architecture,
                          "model": args.model, "tuning": database.enabled, "ceilings": ceiling, "kernels": rows,
                          "notes": notes, "e2e": e2e}, indent=1, default=float))
        return 1 if failed else 0
    widths = ", ".join(f"{k} {v:.1f}" for k, v in ceiling["peak_by_vector_width"].items())
    print(f"ceilings: copy {ceiling['copy_gb_per_s']:.2f} GB/s (read + write); read {ceiling['read_gb_per_s']:.2f} "
          f"GB/s (read alone); peak fp32 {ceiling['peak_gflop_per_s']:.1f} GFLOP/s ({widths})")
    print(format_table(kernel_table(rows, vs)))
    if vs:
        print(f"tuned vs defaults: {vs} interleaved rounds (their medians; 'time' is a separate run); gain = "
              "defaults' time / tuned time, median, with its 95% bootstrap interval (an interval that holds 1.0 "
              "is no significant difference)")
    if e2e is not None:
        print("\n".join(e2e_vs_lines(e2e) if vs else e2e_lines(e2e, ceiling["copy_gb_per_s"])))
    return 1 if failed else 0


def kernel_table(rows: list[dict], vs_defaults: int) -> list[tuple]:
    table = [("kernel", "use", "shape", "parameters", "from", "time", "GB/s", "GFLOP/s", "% ceiling", "% read",
              "private B", "check") + (("interleaved: tuned / defaults", "gain [95% interval]") if vs_defaults else ())]
    for r in rows:
        params = " ".join(f"{k}={v}" for k, v in r["params"].items())
        if "failure" in r or "unsupported" in r:
            check = f"FAIL: {r['failure'][:60]}" if "failure" in r else "not on this device"
            table.append((r["family"], r["label"], r["description"], params or "-", r["source"], "-", "-", "-", "-",
                          "-", "-", check) + (("-", "-") if vs_defaults else ()))
            continue
        cells = (r["family"], r["label"], r["description"], params, r["source"], f"{r['time_s'] * 1e6:.1f} us",
                 f"{r['gb_per_s']:.2f}", f"{r['gflop_per_s']:.2f}" if r["flops"] else "-",
                 f"{r['percent_of_ceiling']:.0f}% {'peak' if r['bound'] == 'compute' else 'copy'}",
                 f"{r['percent_of_read']:.0f}%",
                 "-" if r.get("private_bytes") is None else str(r["private_bytes"]),
                 "ok" if r["verified"] else f"WRONG {r['error']:.1e}")
        if vs_defaults:
            low, high = r["gain_interval"]
            cells += (f"{r['tuned_time_s'] * 1e6:.1f} / {r['defaults_time_s'] * 1e6:.1f} us",
                      f"{r['gain']:.2f}x [{low:.2f}, {high:.2f}]"
                      + ("" if low > 1 or high < 1 else " ~"))
        table.append(cells)
    return table


def e2e_vs_lines(e2e: dict) -> list[str]:
    lines = [f"end to end, {e2e['model']}, tuning on vs off, {e2e['rounds']} interleaved rounds:"]
    for figure, name in (("decode_tok_s", "decode"), ("prefill_tok_s", "prefill")):
        f = e2e[figure]
        lines.append(f"  {name}: tuned {f['tuned']:.1f} tok/s ({f['tuned_range'][0]:.1f}–{f['tuned_range'][1]:.1f}), "
                     f"defaults {f['defaults']:.1f} ({f['defaults_range'][0]:.1f}–{f['defaults_range'][1]:.1f}): "
                     f"{f['gain']:.2f}x [{f['gain_interval'][0]:.2f}, {f['gain_interval'][1]:.2f}]")
    return lines
