"""`perfx report`: one file a phone user runs and sends back: what the device is, whether every kernel is
right on its driver, how fast each is at a model's shapes, and its tuning results.

The report is written after every section (atomically), so an interrupted report resumes: run the same
command again and the sections already done (same device, perfx version and options) are kept. Beside
the JSON goes a short Markdown summary to read before sending. Received reports become shipped tuning
entries with ``perfx tune --merge REPORT... --out tuning/database``.
"""

from __future__ import annotations

import gc
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from perfx import __version__
from perfx.commands.bench import bench_problem, ceilings
from perfx.commands.options import add_no_tuning_option
from perfx.commands.selftest import family_seconds, run_checks
from perfx.generate import SamplingConfig, generate
from perfx.model import load_model
from perfx.progress import Progress, format_table
from perfx.resources import read_json, write_atomic, write_json_atomic
from perfx.runtime import DEVICE_HELP, Device, capabilities_dict, list_devices
from perfx.runtime.replay import REPLAYS, ReplayChoice
from perfx.tuning import SPECS
from perfx.tuning.database import default_database, results_json
from perfx.tuning.problems import problems_for
from perfx.tuning.tuner import Tuner

FORMAT = 1
SEVEN_B = "synthetic:llama-2-7b"


def add_arguments(parser):
    parser.add_argument("--out", default="perfx-report.json", metavar="FILE",
                        help="the report (default %(default)s); a Markdown summary is written beside it (.md)")
    parser.add_argument("--model", default="default", help="model whose kernel shapes to measure (default: default)")
    parser.add_argument("--7b", dest="seven_b", action="store_true",
                        help="also measure Llama-2-7B's decode shapes (synthetic weights, ~4 GB of device memory)")
    parser.add_argument("--tune", type=float, default=0, metavar="SECONDS",
                        help="first tune the model's kernels for this long (resumable; 0: report the results "
                             "you have, default)")
    parser.add_argument("--max-m", type=int, default=None,
                        help="tune and measure the prefill (GEMM, attention) path only up to this prompt length")
    parser.add_argument("--quick", action="store_true", help="selftest at the defaults only (minutes instead of more)")
    parser.add_argument("--device", help=DEVICE_HELP)
    add_no_tuning_option(parser)


def _sections(args) -> list[tuple[str, float]]:
    """(section, rough share of the time) in the order they run."""
    sections = [("device", 0.01)]
    if args.tune:
        sections.append(("tune", 0.4))
    sections += [("selftest", 0.2 if args.quick else 0.35), ("bench", 0.3), ("replay", 0.05)]
    if args.seven_b:
        sections.append(("bench_7b", 0.3))
    return sections + [("tuning", 0.01)]


def _options(args) -> dict:
    return {"model": args.model, "seven_b": args.seven_b, "tune": args.tune, "quick": args.quick,
            "max_m": args.max_m, "tuning": not args.no_tuning}


def _resumed(path: Path, device: Device, options: dict) -> dict:
    """The sections of an earlier report of this device, perfx version and options; {} if there is none."""
    if not path.exists():
        return {}
    old = read_json(path)
    same = (isinstance(old, dict) and old.get("perfx_report") == FORMAT and old.get("perfx") == __version__
            and old.get("fingerprint") == device.fingerprint and old.get("options") == options)
    return old.get("sections", {}) if same else {}


def main(args) -> int:
    out = Path(args.out)
    device = Device(args.device)
    options = _options(args)
    sections = _resumed(out, device, options)
    report = {"perfx_report": FORMAT, "perfx": __version__, "fingerprint": device.fingerprint,
              "options": options, "sections": sections}
    plan = _sections(args)
    done = [name for name, _ in plan if name in sections]
    print(f"perfx report on {device.caps.platform} / {device.caps.name} into {out}"
          + (f" (resuming: {', '.join(done)} already done)" if done else ""), file=sys.stderr)
    database = default_database(not args.no_tuning)
    total = sum(share for _, share in plan)
    started = time.perf_counter()
    with Progress(100, "report") as bar:
        for name, share in plan:
            if name not in sections:
                bar.update(0, f"{name}...")
                sections[name] = run_section(name, device, args, database)
                sections[name]["seconds"] = time.perf_counter() - started
                write_json_atomic(out, report)
            bar.update(round(100 * share / total), f"{name} done")
    summary = out.with_suffix(".md")
    write_atomic(summary, markdown(report, device))
    print(f"wrote {out} and {summary}: please send the report (see docs/phones.md)",
          file=sys.stderr)
    return 1 if sections["selftest"]["failed"] else 0


def run_section(name: str, device: Device, args, database) -> dict:
    if name == "device":
        return {"capabilities": capabilities_dict(device.caps), "limits": device.caps.limits,
                "devices": [e.label for e in list_devices()], "python": sys.version.split()[0],
                "platform": platform.platform()}
    if name == "tune":
        problems, notes = problems_for(args.model, SPECS, args.max_m, caps=device.caps)
        tuner = Tuner(device, database, budget_s=args.tune)
        results = tuner.tune([(SPECS[p.family], p.shape, p.label) for p in problems])
        return {"model": args.model, "budget_s": args.tune, "problems": len(results),
                "confirmed": sum(r.confirmation is not None for r in results), "notes": notes,
                "sweep": tuner.report(results)}   # where a phone's tuning minute goes
    if name == "selftest":
        checks = run_checks(device, SPECS, "quick" if args.quick else "covering", show_progress=False)
        failed = [asdict(c) for c in checks if c.failed]
        families = {}
        for c in checks:
            entry = families.setdefault(c.kernel, {"checks": 0, "failed": 0, "refused": 0, "worst_passing_error": 0.0})
            entry["checks"] += 1
            entry["failed"] += c.failed
            entry["refused"] += bool(c.refused)
            if c.passed:
                entry["worst_passing_error"] = max(entry["worst_passing_error"], c.error)
        for family, spent in family_seconds(checks).items():   # which families a slow device splits off
            families[family]["seconds"] = spent["seconds"]
        return {"quick": args.quick, "passed": sum(c.passed for c in checks), "failed": len(failed),
                "refused": sum(bool(c.refused) for c in checks), "families": families, "failures": failed}
    if name in ("bench", "bench_7b"):
        model = args.model if name == "bench" else SEVEN_B
        problems, notes = problems_for(model, SPECS, max_m=args.max_m if name == "bench" else 1, caps=device.caps)
        ceiling = ceilings(device)
        rng = np.random.default_rng(0)
        rows = [bench_problem(device, SPECS[p.family], p, ceiling, rng, database) for p in problems]
        for row in rows:
            row.pop("samples_s", None)
        return {"model": model, "ceilings": ceiling, "kernels": rows, "notes": notes}
    if name == "replay":
        return compare_replays(args.device, args.model, not args.no_tuning)
    if name == "tuning":
        exported = default_database().device_file(device).data
        return {"results": json.loads(results_json(exported))}
    raise ValueError(name)


def compare_replays(selector: str | None, model_name: str, tuning: bool, decode_tokens: int = 48,
                    rounds: int = 3) -> dict:
    """The model's greedy decode with each replay of the decode step this driver has (``PERFX_REPLAY``: launches
    one by one, a command buffer, an Adreno recording): whether each gives the tokens of launches one by one,
    and each one's decode tok/s (the median of ``rounds`` runs). Each replay's model is loaded in turn, so one
    is in memory at a time. A replay the driver lacks is listed with why; one it refuses while recording says
    so in its ``mode``. Nothing is measured where launches one by one are the only replay."""
    out, devices = {}, {}
    for kind in REPLAYS:
        device = Device(selector)
        device.replay_choice = ReplayChoice(device.cl_device, device.queue.properties, kind)
        if device.replay_choice.kind == kind:
            devices[kind] = device
        else:
            out[kind] = {"available": False, "mode": device.replay_mode}
    result = {"model": model_name, "decode_tokens": decode_tokens, "rounds": rounds, "replays": out}
    if len(devices) == 1:
        out["sequence"] = {"available": True, "mode": devices["sequence"].replay_mode}
        return result
    prompt = reference = None
    for kind, device in devices.items():   # launches one by one first: the reference
        model = load_model(model_name, device, progress=None, default_ctx=1024, tuning=tuning)[0]
        if prompt is None:
            prompt = [int(t) for t in np.random.default_rng(0).integers(3, model.config.vocab_size, 16)]
        ids = generate(model, None, prompt, decode_tokens, SamplingConfig(temperature=0)).ids   # builds, records
        speeds = [generate(model, None, prompt, decode_tokens, SamplingConfig(temperature=0)).stats.decode_tok_s
                  for _ in range(rounds)]
        reference = ids if reference is None else reference
        same = ids == reference
        first = next((j for j, (a, b) in enumerate(zip(ids, reference)) if a != b),
                     None if same else min(len(ids), len(reference)))
        out[kind] = {"available": True, "mode": device.replay_mode, "same_tokens": same, "first_difference": first,
                     "decode_tok_s": float(np.median(speeds))}
        del model
        gc.collect()
    return result


def markdown(report: dict, device: Device) -> str:
    s = report["sections"]
    caps = s["device"]["capabilities"]
    lines = [f"# perfx report: {caps['name']} ({caps['platform']})", "",
             f"perfx {report['perfx']}, {caps['opencl_c_version']}, driver {caps['driver_version']}, "
             f"architecture {caps['architecture']}, limits {s['device']['limits']}", ""]
    test = s["selftest"]
    lines += [f"**selftest**: {test['passed']} passed, {test['failed']} failed"
              + (f", {test['refused']} refused by the driver's limits" if test.get("refused") else "")
              + (" (defaults only)" if test["quick"] else " (every parameter set the tuner may choose)"), ""]
    for failure in test["failures"][:20]:
        why = failure["failure"] or f"relative error {failure['error']:.2e} > {failure['tolerance']:.0e}"
        lines.append(f"- FAIL {failure['kernel']} {failure['shape']} {failure['params']}: {why}")
    for name in ("bench", "bench_7b"):
        if name not in s:
            continue
        bench = s[name]
        copy, read = bench["ceilings"]["copy_gb_per_s"], bench["ceilings"].get("read_gb_per_s")
        lines += ["", f"**{bench['model']}**: copy bandwidth {copy:.1f} GB/s"
                      + (f", read-only stream {read:.1f} GB/s" if read else "")
                      + f", peak {bench['ceilings']['peak_gflop_per_s']:.0f} GFLOP/s", ""]
        rows = [("kernel", "use", "shape", "time", "GB/s", "% copy", "% read", "from")]
        for r in bench["kernels"]:
            if "time_s" in r:
                rows.append((r["family"], r["label"], r["description"], f"{r['time_s'] * 1e6:.1f} us",
                             f"{r['gb_per_s']:.2f}", f"{100 * r['gb_per_s'] / copy:.0f}%",
                             f"{100 * r['gb_per_s'] / read:.0f}%" if read else "-", r["source"]))
        lines += ["```", format_table(rows), "```"]
    if "replay" in s:
        replays = s["replay"]["replays"]
        lines += ["", f"**decode step replays** ({s['replay']['model']}, {s['replay']['decode_tokens']} greedy tokens):",
                  ""]
        for kind, r in replays.items():
            if not r["available"]:
                lines.append(f"- {kind}: not here ({r['mode']})")
                continue
            if "decode_tok_s" not in r:
                lines.append(f"- {kind}: the only replay here, not measured ({r['mode']})")
                continue
            same = ("the same tokens as one by one" if r["same_tokens"]
                    else f"DIFFERENT tokens from one by one, from token {r['first_difference']}")
            lines.append(f"- {kind}: {r['decode_tok_s']:.2f} tok/s, {same} ({r['mode']})")
    tuned = s["tuning"]["results"]["records"]
    lines += ["", f"**tuning results**: {len(tuned)} records of this device"
                  + ("" if tuned else " (run `perfx report --tune 900` to include a sweep)"), ""]
    return "\n".join(lines) + "\n"
