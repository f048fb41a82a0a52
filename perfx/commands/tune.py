"""`perfx tune`: tune the kernels a model runs on this device, and keep the results.

Every (family, shape) of the model (GEMM shapes at one M per bucket) is swept by
``perfx.tuning.tuner``: verified candidates only, timed with profiling events, each outcome written to
the device's resume log as it comes, each problem's best to its results file. Run it again to resume
or extend an interrupted or budget-cut sweep. ``--export``/``--import`` share results between devices,
and ``--merge`` turns many devices' results into architecture and vendor defaults.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from perfx import plots
from perfx.commands.options import add_kv_option, add_lm_head_option
from perfx.errors import PerfxError
from perfx.ops.gemm_q4 import FAMILIES as GEMM_FAMILIES
from perfx.ops.gemm_q8 import FAMILIES as Q8_GEMM_FAMILIES
from perfx.plan import one_run_costs
from perfx.progress import Progress, format_table
from perfx.resources import read_json, write_atomic
from perfx.runtime import DEVICE_HELP, Device
from perfx.timing import copy_bandwidth, read_bandwidth
from perfx.tuning import select_specs
from perfx.tuning.database import Choice, Database, merge, results_json
from perfx.tuning.problems import problems_for
from perfx.tuning.tuner import Tuner

DEFAULT_BUDGET = 600.0


def add_arguments(parser):
    parser.add_argument("--model", default=None,
                        help="model whose shapes to tune: 'default', a .gguf file or model directory, or "
                             "synthetic:llama-2-7b / synthetic:smollm2-135m (default: default)")
    parser.add_argument("--kernels", help="comma-separated kernel families, a prefix names a group "
                                          "(gemm_q4 = gemm_q4_skinny, _tiled, _f16, _lanes and _i8; gemm_q8 = "
                                          "gemm_q8, _lanes and _i8; default: all)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole sweep, shared among the problems (default: 600)")
    parser.add_argument("--max-m", type=int, default=None,
                        help="tune the prefill (GEMM, attention) path only up to this prompt length")
    parser.add_argument("--refresh", action="store_true",
                        help="after a perfx upgrade changed kernel sources: instead of sweeping, check again "
                             "the entries measured on the old sources (this device's and the shipped ones "
                             "that apply to it; --kernels narrows them): each entry's parameters verified "
                             "against the float64 reference and timed against the defaults in interleaved "
                             "rounds; those at least as fast as the defaults are kept for the new source, "
                             "the rest are left for a sweep; a GEMM kind's entry timed at its bucket's middle M "
                             "alone is timed at the bucket's other Ms too. A few seconds an entry; resumes if "
                             "interrupted")
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    parser.add_argument("--plot", metavar="DIR", help="write PNG plots there (needs matplotlib: perfx[plot])")
    parser.add_argument("--export", metavar="FILE", help="write this device's tuning results to FILE")
    parser.add_argument("--import", dest="import_file", metavar="FILE",
                        help="merge a results file (from --export or --merge) into your tuning database. With "
                             "only --import and/or --export (no --model, --kernels, --budget), nothing is tuned")
    parser.add_argument("--merge", nargs="+", metavar="FILE",
                        help="architecture- and vendor-level defaults from many devices' results (files from "
                             "--export, tuning logs, or `perfx report` files): the best parameters on average, "
                             "as CLBlast's database scripts choose them; written to --out")
    parser.add_argument("--out", metavar="DIR", default=".",
                        help="with --merge: the folder for the merged files (default: here)")
    parser.add_argument("--min-devices", type=int, default=2,
                        help="with --merge: the fewest devices behind a merged architecture or vendor entry "
                             "(default 2: one machine's results do not speak for its vendor)")
    parser.add_argument("--device", help=DEVICE_HELP)
    add_lm_head_option(parser)
    add_kv_option(parser)


def _explicitly_tuning(args) -> bool:
    named = (args.model, args.kernels, args.budget, args.max_m)
    return any(value is not None for value in named) or args.refresh or not (args.import_file or args.export)


def _until_interrupted(progress, run, message: str):
    """``run()``'s result, or None after Ctrl-C (``message`` said): what was measured is saved as it came."""
    try:
        result = run()
    except KeyboardInterrupt:
        progress.close()
        print(message, file=sys.stderr)
        return None
    progress.close()
    return result


def refresh(args, device, database, say) -> int:
    """``--refresh``: check the stale entries again (``Tuner.refresh``) and say what became of each."""
    if args.model is not None or args.max_m is not None:
        raise PerfxError("--refresh checks the entries already in the database, whatever model they came from: "
                         "drop --model and --max-m (--kernels narrows which families)")
    families = select_specs(args.kernels)
    entries = database.stale_records(device, families)
    print(f"perfx tune --refresh on {device.caps.platform} / {device.caps.name}: {len(entries)} entries "
          f"measured on an older kernel source, or lacking their times at their bucket's Ms; results in "
          f"{database.device_path(device.fingerprint)}", file=sys.stderr)
    progress = Progress(len(entries), "refresh", enabled=None if not args.json else False)
    results = _until_interrupted(progress, lambda: Tuner(device, database, progress=progress).refresh(entries),
                                 "perfx tune --refresh: interrupted; every entry checked so far is saved, run it "
                                 "again to resume")
    if results is None:
        return 130
    kept = sum(r.kept for r in results)
    if args.json:
        print(json.dumps({"device": device.fingerprint, "database": str(database.device_path(device.fingerprint)),
                          "kept": kept, "entries": [r.as_dict() for r in results]}, indent=1))
    else:
        rows = [("kernel", "shape", "parameters", "time", "defaults' time", "verdict")]
        for r in results:
            rows.append((r.family, r.description, " ".join(f"{k}={v}" for k, v in r.params.items()),
                         f"{r.time_s * 1e6:.1f} us" if r.time_s else "-",
                         f"{r.default_time_s * 1e6:.1f} us" if r.default_time_s else "-",
                         ("kept: " if r.kept else "left for a sweep: ") + r.reason))
        if results:
            print(format_table(rows))
        print(f"{kept} of {len(results)} entries kept for the current kernel sources"
              + ("; `perfx tune --model ...` sweeps the shapes of the rest again" if kept < len(results) else ""))
    if args.export:
        count = database.export(device, args.export)
        say(f"exported {count} tuning records of {device.caps.name} to {args.export}")
    return 0


def merge_files(paths: list[str], out: Path, min_devices: int, say) -> list[Path]:
    """``--merge``: read each file (a `perfx report` file contributes its tuning section), write one
    results file per architecture and per vendor with enough devices behind it."""
    inputs = []
    for path in paths:
        data = read_json(path)
        if isinstance(data, dict) and "perfx_report" in data:
            data = data.get("sections", {}).get("tuning", {}).get("results")
            if data is None:
                raise PerfxError(f"{path} is a perfx report without its tuning section: it was interrupted "
                                 "before the end; run the same `perfx report` command again to finish it")
        inputs.append(data)
    written = []
    for level in ("architecture", "vendor"):
        for data in merge(inputs, level, min_devices):
            name = next(iter(data["match"].values()))
            target = out / f"{level}-{name}.json"
            write_atomic(target, results_json(data))
            written.append(target)
            say(f"merged {len(data['records'])} records for {level} {name} into {target}")
    if not written:
        say(f"nothing merged: no architecture or vendor has results from {min_devices} or more devices "
            "(--min-devices sets that)")
    return written


def _rate_cells(result, copy_gbps: float) -> tuple[str, str]:
    gbps, gflops = result.rate()
    if gbps is None:
        return "-", "-"
    compute_bound = result.flops and result.flops / max(result.bytes_moved, 1) > 8
    if compute_bound:
        return f"{gflops:.1f} GFLOP/s", "-"
    return f"{gbps:.2f} GB/s", f"{100 * gbps / copy_gbps:.0f}%" if copy_gbps else "-"


def _verdict(result) -> str:
    c = result.confirmation
    if c is None:
        return "unconfirmed (budget)" if result.chosen else "-"
    if c.verdict.startswith("replaced"):
        return f"new: {c.ratio:.2f}x [{c.interval[0]:.2f}, {c.interval[1]:.2f}] of the old"
    return "kept: " + ("fastest" if "fastest" in c.verdict else "no significant difference")


def summary_rows(results, copy_gbps: float) -> list[tuple]:
    rows = [("kernel", "use", "shape", "parameters in force", "time", "rate", "% copy bw",
             "vs defaults [95% interval]", "confirmation", "private B", "tried", "rejected", "done")]
    for r in results:
        rate, pct = _rate_cells(r, copy_gbps)
        c = r.confirmation
        gain = "-"
        if r.speedup:
            gain = f"{r.speedup:.2f}x" + (f" [{c.gain_interval[0]:.2f}, {c.gain_interval[1]:.2f}]" if c else "")
        rows.append((
            r.family, r.label, r.description,
            " ".join(f"{k}={v}" for k, v in r.chosen.items()) if r.chosen else (r.note or "none valid"),
            f"{r.time_s * 1e6:.1f} us" if r.time_s else "-", rate, pct, gain, _verdict(r), _private(r), len(r.outcomes),
            sum(o.status not in ("ok", "slow") for o in r.outcomes), "yes" if r.complete else "partial"))
    return rows


def _private(result) -> str:
    """Private memory per work-item of the chosen parameters' kernels, as the driver reports it (spills)."""
    outcome = next((o for o in result.outcomes if o.params == result.chosen and o.private_bytes is not None), None)
    return "-" if outcome is None else str(outcome.private_bytes)


def drift_line(results, tuner) -> str:
    """How often the machine drifted (the reference kernel slowed) and timings were taken again."""
    rounds = sum(r.confirmation.suspect_rounds for r in results if r.confirmation)
    candidates = sum(r.suspect_candidates for r in results)
    kept = sum(r.suspect_kept for r in results)
    return (f"drift: the reference (copy) kernel slowed beyond {100 * tuner.drift.threshold:.0f}% "
            f"{tuner.drift.events} time(s); re-taken after a cool-down, or a screen timed in full: {candidates} search "
            f"timing(s), {rounds} confirmation round(s); {kept} search timing(s) kept, too slow to win even so")


def split_line(report: dict) -> str:
    """Candidates a minute, and where the sweep's time went (``Tuner.report``)."""
    wall = report["wall_s"] or 1.0
    parts = [f"{name} {100 * seconds / wall:.0f}%" for name, seconds in report["seconds"].items()]
    parts.append(f"other {100 * report['other_s'] / wall:.0f}%")
    rate = report["candidates_per_minute"]
    return (f"sweep: {report['candidates']} candidates in {wall:.0f}s ({rate if rate is not None else 0:.1f} a minute; "
            f"{report['pruned']} sets pruned unbuilt); time: " + ", ".join(parts)
            + (f"; {report['built_beside_runs_s']:.0f}s of builds beside the runs" if report["built_beside_runs_s"]
               else ""))


def crossover_lines(results) -> list[str]:
    """Per prefill matrix and M bucket of the sweep, the GEMM kind the model runs by these times: of the int4 kinds
    timed there, and of the int8 ones, the kind whose time is the least multiple of the fastest at the M of the
    bucket where it is worst (``perfx.plan.one_run_costs``: a batched decode step's bucket is judged at each M it
    serves, as the model chooses, not at its middle M alone)."""
    timed: dict[tuple, dict] = {}
    for r in results:
        if r.family in (*GEMM_FAMILIES, *Q8_GEMM_FAMILIES) and r.time_s:
            confirmation = getattr(r, "confirmation", None)
            timed.setdefault((r.label, r.shape["m"]), {})[r.family] = Choice(
                {}, "", "", r.time_s, exact=True, file="this sweep", served=confirmation.served if confirmation else {})
    lines = []
    for label in sorted({label for label, _ in timed}):
        cells = []
        for m in sorted(m for lab, m in timed if lab == label):
            for families, anchor, prefix in ((GEMM_FAMILIES, "gemm_q4_skinny", ""), (Q8_GEMM_FAMILIES, "gemm_q8",
                                                                                      "int8 ")):
                choices = {family: c for family, c in timed[label, m].items() if family in families}
                if anchor in choices and len(choices) > 1:   # an int8 matrix times gemm_q8's kinds (a layer's either)
                    costs = one_run_costs(choices, anchor)
                    best = min(costs, key=costs.get)
                    cells.append(f"M={m}: {prefix}{'skinny' if best == 'gemm_q8' else best.rsplit('_', 1)[1]}")
        if cells:
            lines.append(f"  {label}: " + ", ".join(cells))
    return lines


def main(args) -> int:
    say = (lambda text: print(text, file=sys.stderr)) if args.json else print
    if args.merge:
        merge_files(args.merge, Path(args.out), args.min_devices, say)
        return 0
    device = Device(args.device)
    database = Database()
    if args.import_file:
        target, count = database.import_file(args.import_file)
        say(f"imported {count} tuning records from {args.import_file} into {target}")
    if not _explicitly_tuning(args):
        if args.export:
            count = database.export(device, args.export)
            say(f"exported {count} tuning records of {device.caps.name} to {args.export}")
        return 0

    if args.refresh:
        return refresh(args, device, database, say)
    args.model = args.model or "default"
    args.budget = DEFAULT_BUDGET if args.budget is None else args.budget
    families = select_specs(args.kernels)
    problems, notes = problems_for(args.model, families, args.max_m, args.lm_head, args.kv, args.embedding,
                                  device.caps)
    if not problems:
        raise PerfxError("nothing to tune: " + ("; ".join(notes) or "the model has no shapes for these families"))
    print(f"perfx tune on {device.caps.platform} / {device.caps.name}: {len(problems)} problems of "
          f"{args.model}, budget {args.budget:.0f}s, results in {database.device_path(device.fingerprint)}",
          file=sys.stderr)
    for note in notes:
        print(f"  note: {note}", file=sys.stderr)
    copy_gbps, _ = copy_bandwidth(device)
    read_gbps, _ = read_bandwidth(device)
    progress = Progress(len(problems), "tune", enabled=None if not args.json else False)
    tuner = Tuner(device, database, budget_s=args.budget, progress=progress)
    results = _until_interrupted(progress, lambda: tuner.tune([(families[p.family], p.shape, p.label)
                                                               for p in problems]),
                                 "perfx tune: interrupted; every finished candidate is saved, run the same "
                                 "command to resume")
    if results is None:
        return 130

    if args.json:
        print(json.dumps({"device": device.fingerprint, "architecture": device.caps.architecture,
                          "model": args.model, "budget_s": args.budget, "copy_gb_per_s": copy_gbps,
                          "read_gb_per_s": read_gbps,
                          "database": str(database.device_path(device.fingerprint)), "notes": notes,
                          "drift_events": tuner.drift.events, "sweep": tuner.report(results),
                          "problems": [r.as_dict() for r in results]},
                         indent=1))
    else:
        print(format_table(summary_rows(results, copy_gbps)))
        print(drift_line(results, tuner))
        print(split_line(tuner.report(results)))
        print(f"copy bandwidth {copy_gbps:.1f} GB/s, read-only stream {read_gbps:.1f} GB/s; rate is GB/s for "
              "memory-bound kernels (% of copy), GFLOP/s where a kernel does more than 8 flops per byte")
        lines = crossover_lines(results)
        if lines:
            print("prefill GEMM, the kind the model runs per matrix and M bucket:\n" + "\n".join(lines))
    if args.plot:
        written = plots.write_tuning_plots(results, args.plot, copy_gbps, read_gbps=read_gbps)
        say(f"wrote {len(written)} plots to {args.plot}")
    if args.export:
        count = database.export(device, args.export)
        say(f"exported {count} tuning records of {device.caps.name} to {args.export}")
    return 0
