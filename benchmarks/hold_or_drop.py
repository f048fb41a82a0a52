"""Keep the tuned entries that hold up against the defaults, drop those that do not.

A maintainer's step before shipping a results file (ours, or one a user sent from a phone): combine the
results files (a later file's record replaces an earlier one for the same kernel and shape), then judge every
record by a `perfx bench --vs-defaults --json` run on that device, where each kernel ran with its entry and
with the built-in defaults interleaved in shuffled rounds:

- kept: the entry was faster on the median of the rounds (gain ≥ 1; an interval that holds 1.0 is kept,
  as the tuner's own confirmation already demanded a significant win over the incumbent);
- dropped: slower than the defaults on the median, or slower beyond the noise (the whole interval below 1);
  but a record of a kind the plan compares with the other kinds of its product (``Spec.compared_kind``: the
  int4 and int8 GEMMs) is kept when it is slower on the median within the noise: without a record at its shape
  the plan never runs that kind there, however much faster than the others its defaults are (a lost gemm_q4_i8
  record made the batched step run gemm_q4_skinny at twice its time: benchmarks/NOTES.md), and one slower
  beyond the noise is dropped with a warning that the kind leaves the comparison at that shape; and the shapes
  of a batched step's few rows where the kept records compare fewer kinds than the file holds elsewhere are
  listed at the end;
- a record no bench run measured is judged by its own measurement against the defaults where it carries
  one on the current kernel source (the tuner's confirmation, or `perfx tune --refresh`, interleaved rounds
  as the bench's), by the same rule;
- dropped: not measured at all (another entry was in force at its shape, or it carries no gain),
  or stale (measured on an older kernel source, which the look-up ignores anyway).
  A record whose parameters are the defaults is kept without a ratio (there is nothing to compare).

A kept record carries the bench's gain, interval and rounds (the latest measurement against the defaults).

    PERFX_CACHE=/tmp/t perfx bench --vs-defaults --rounds 7 --json > bench.json
    PERFX_CACHE=/tmp/t perfx tune --export new.json
    python benchmarks/hold_or_drop.py tuning/database/old.json new.json --bench bench.json --out tuning/database/old.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from perfx.resources import write_atomic
from perfx.tuning import SPECS
from perfx.tuning.database import SERVED_UP_TO, params_key, results_json, shape_key, source_hash


def record_key(record: dict) -> tuple:
    return record["family"], shape_key(record.get("shape"))


def verdict(record: dict, row: dict | None) -> tuple[bool, str]:
    """Whether ``record`` holds, and why, given the bench row measured at its shape (None: not benched)."""
    spec = SPECS.get(record["family"])
    if spec is None:
        return False, "no such kernel family"
    if record.get("source_hash") not in (None, source_hash(spec)):
        return False, "stale: measured on an older kernel source"
    params = {**spec.params.defaults(record["params"]), **record["params"]}
    if params_key(params) == params_key(spec.params.defaults()):
        return True, "the defaults"
    if row is None or "gain" not in row:
        if record.get("gain") is None or not record.get("gain_interval"):
            return False, "not measured"
        row, own = record, " (its own measurement)"
    else:
        own = ""
        if params_key({**spec.params.defaults(row["params"]), **row["params"]}) != params_key(params):
            return False, "another entry was in force"
    gain, (low, high) = row["gain"], row["gain_interval"]
    text = f"{gain:.2f}x [{low:.2f}, {high:.2f}]{own}"
    if high < 1:
        lost = " (the plan no longer compares this kind at this shape: sweep it again)" if spec.compared_kind else ""
        return False, f"slower than the defaults beyond the noise: {text}{lost}"
    if gain < 1:
        if spec.compared_kind:
            return True, f"within the noise of the defaults, kept for the plan's comparison of kinds: {text}"
        return False, f"slower than the defaults on the median: {text}"
    return True, text


def kind_gaps(records: list[dict]) -> list[str]:
    """The shapes of a batched step's few rows (2 ≤ M ≤ SERVED_UP_TO) where the plan compares fewer GEMM kinds than
    the file holds for that product elsewhere: a kind with no record at a shape is never run there, however fast
    (how the o projection's gemm_q4_i8 went missing: benchmarks/NOTES.md). One line a shape, the kinds it lacks."""
    def product(family: str) -> str:   # gemm_q4_i8 -> q4, gemm_q8 -> q8
        return family.split("_")[1]

    compared = [r for r in records if SPECS.get(r["family"]) is not None and SPECS[r["family"]].compared_kind
                and 2 <= (r.get("shape") or {}).get("m", 0) <= SERVED_UP_TO]
    kinds: dict[str, set] = {}
    at: dict[tuple, set] = {}
    for r in compared:
        kinds.setdefault(product(r["family"]), set()).add(r["family"])
        at.setdefault((product(r["family"]), shape_key(r["shape"])), set()).add(r["family"])
    return [f"{shape}: no {', '.join(sorted(kinds[name] - present))} (the file has them elsewhere)"
            for (name, shape), present in sorted(at.items()) if kinds[name] - present]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results files; later ones replace earlier records")
    parser.add_argument("--bench", nargs="*", type=Path, default=[],
                        help="`perfx bench --vs-defaults --json` outputs from the same device (without any, each "
                             "record is judged by its own measurement against the defaults)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the kept records")
    parser.add_argument("--comment", help="replace the file's comment (how it was measured)")
    args = parser.parse_args(argv)

    data = json.loads(args.results[0].read_text())
    records = {}
    for path in args.results:
        for record in json.loads(path.read_text())["records"]:
            records[record_key(record)] = record
    rows = {}
    for path in args.bench:
        for row in json.loads(path.read_text())["kernels"]:
            rows[(row["family"], shape_key(row["shape"]))] = row

    kept = []
    for key, record in records.items():
        holds, why = verdict(record, rows.get(key))
        params = " ".join(f"{k}={v}" for k, v in record["params"].items())
        print(f"{'keep' if holds else 'drop'}  {record['family']:<18} {shape_key(record.get('shape')):<40} "
              f"{params:<40} {why}")
        if holds:
            row = rows.get(key)
            if row is not None and "gain" in row and why != "the defaults":  # the re-measurement's figures
                record = {**record, "gain": round(row["gain"], 4),
                          "gain_interval": [round(x, 4) for x in row["gain_interval"]], "rounds": row["rounds"]}
            kept.append(record)
    data["records"] = kept
    if args.comment:
        data["comment"] = args.comment
    write_atomic(args.out, results_json(data))
    print(f"{len(kept)} of {len(records)} records kept -> {args.out}", file=sys.stderr)
    for gap in kind_gaps(kept):
        print(f"note: the plan compares fewer kinds at {gap}: sweep them there if the device runs them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
