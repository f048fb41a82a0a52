"""The first `perfx generate` after install (every cache empty) and a warm one after it, for two checkouts of
perfx (before and after a change), interleaved in one run: issue 44's "first generate" goal as
``issue44_goals.py --only generate`` measures it, each round from fresh cache folders, the order alternating by
round.

Each checkout is installed apart first (``ab_trees.install_apart``) and its processes run from a neutral folder,
so each imports its own copy (kernels and tuning files included), not the working tree's. Prints per checkout the
median and range of the rounds: wall seconds of the first and the warm run, the load's seconds of each
("loaded in"), and B over A.

    git worktree add /tmp/before <commit>
    PYTHONPATH=. python benchmarks/first_generate_ab.py /tmp/before . --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ab_trees import alternating, install_apart, summarise   # noqa: E402 - the benchmarks folder is no package
from issue44_goals import generate   # noqa: E402

from perfx.resources import cache_dir   # noqa: E402

FIGURES = ("first_wall_s", "first_load_s", "warm_wall_s", "warm_load_s")


def loaded_seconds(stderr: str) -> float | None:
    found = re.search(r"loaded in ([0-9.]+)s", stderr)
    return float(found.group(1)) if found else None


def one_round(site: Path, device: str | None, models: Path, timeout: float) -> dict:
    os.environ["PYTHONPATH"] = str(site)
    (_, first), (_, warm) = generate(device, models, timeout)
    for result in (first, warm):
        if result["exit"] != 0:
            raise SystemExit(f"{site}: {result['command']} failed:\n{result['stderr_tail']}")
    return {"first_wall_s": first["wall_s"], "first_load_s": loaded_seconds(first["stderr_tail"]),
            "warm_wall_s": warm["wall_s"], "warm_load_s": loaded_seconds(warm["stderr_tail"]),
            "reply": first["reply"], "first_stderr": first["stderr_tail"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="checkout A (before)")
    parser.add_argument("b", type=Path, help="checkout B (after)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", help="PERFX_DEVICE's forms (default: perfx's choice)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds each command may take")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    models = cache_dir() / "models"
    installed = Path(tempfile.mkdtemp(prefix="perfx-first-generate-"))
    sites = {label: install_apart(tree, installed / label) for label, tree in (("A", args.a), ("B", args.b))}
    os.chdir(tempfile.gettempdir())   # `python -m perfx` puts the working folder first on the path
    runs = {"A": [], "B": []}
    for i, label in alternating(args.rounds):
        result = one_round(sites[label], args.device, models, args.timeout)
        runs[label].append(result)
        print(f"round {i + 1} {label}: first {result['first_wall_s']:.1f} s (loaded in "
              f"{result['first_load_s']} s), warm {result['warm_wall_s']:.1f} s (loaded in "
              f"{result['warm_load_s']} s), load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    summary = summarise(runs, FIGURES)
    if args.json:
        print(json.dumps({"rounds": args.rounds, "figures": summary, "runs": runs}, indent=1))
        return 0
    print(f"{args.rounds} rounds interleaved; A = {args.a}, B = {args.b}; replies: A {runs['A'][0]['reply']!r}, "
          f"B {runs['B'][0]['reply']!r}")
    for name, s in summary.items():
        print(f"  {name:13} A {s['A']:6.2f} ({s['A_range'][0]:.2f}–{s['A_range'][1]:.2f})   "
              f"B {s['B']:6.2f} ({s['B_range'][0]:.2f}–{s['B_range'][1]:.2f})   B/A {s['B_over_A']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
