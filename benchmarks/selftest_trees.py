"""`perfx selftest --json` of two checkouts interleaved (A B, then B A, ...), every cache empty for each run
(issue44_goals.selftest): wall and CPU seconds of the whole process tree, each family's CPU seconds in the check
processes, the checks, the peak memory, and the load average before and after each run; then B/A per figure.

Each checkout's processes import it from PYTHONPATH, run from a folder of their own (``python -m`` puts the
current folder first on the path, so a run started in a checkout would import that one whatever PYTHONPATH says).
A checkout must serve its own kernels and tuning database: an editable install of perfx serves ``perfx.kernels``
and ``perfx.tuning`` from the tree it was made from, so link them into a worktree made for the comparison:

    git worktree add /tmp/before bcda3f7
    ln -s ../kernels /tmp/before/perfx/kernels && ln -s ../tuning /tmp/before/perfx/tuning
    python benchmarks/selftest_trees.py /tmp/before . --device pocl --rounds 2 [--kernels gemm_q4_i8,...]
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

sys.path.insert(0, str(Path(__file__).parent))
import issue44_goals  # noqa: E402


def serves_itself(tree: Path) -> None:
    """Fails unless ``perfx``, its kernels and its tuning database import from ``tree``."""
    code = "import perfx, perfx.kernels, perfx.tuning; print(perfx.kernels.__file__, perfx.tuning.__file__)"
    with tempfile.TemporaryDirectory() as folder:
        out = subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(tree)}).stdout
    if any(not Path(path).resolve().is_relative_to(tree.resolve()) for path in out.split()):
        sys.exit(f"{tree}: perfx.kernels or perfx.tuning import from elsewhere ({out.strip()}): link them into "
                 "its perfx folder (see the module's docstring)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--device", default="pocl")
    parser.add_argument("--kernels", help="--kernels of the selftest (default: every family)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    for tree in trees.values():
        serves_itself(tree)
    extra = ["--kernels", args.kernels] if args.kernels else []
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        for r in range(args.rounds):
            for side in ("A", "B") if r % 2 == 0 else ("B", "A"):
                os.environ["PYTHONPATH"] = str(trees[side])
                before, started = open("/proc/loadavg").read().split()[0], time.strftime("%H:%M", time.gmtime())
                result = issue44_goals.selftest(args.device, extra, None, 7200)
                families = {f: round(v["cpu_seconds"], 1) for f, v in result.get("families", {}).items()}
                run = {"round": r, "side": side, "started": started,
                       "load": [before, open("/proc/loadavg").read().split()[0]], "exit": result["exit"],
                       "wall_s": result["wall_s"], "cpu_s": result["cpu_s"],
                       "checks_cpu_s": round(sum(families.values()), 1), "passed": result.get("passed"),
                       "planned": result.get("planned"), "peak_rss_bytes": result["peak_rss_bytes"],
                       "families": families}
                runs.append(run)
                print(json.dumps(run), flush=True)
    for key in ("wall_s", "cpu_s", "checks_cpu_s"):
        ratios = [b[key] / a[key] for a, b in zip((x for x in runs if x["side"] == "A"),
                                                 (x for x in runs if x["side"] == "B"))]
        print(f"B/A {key}: " + ", ".join(f"{ratio:.3f}" for ratio in ratios))


if __name__ == "__main__":
    main()
