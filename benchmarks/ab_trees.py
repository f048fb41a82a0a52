"""End-to-end figures of two checkouts of perfx (before and after a change), interleaved in one run.

Each round loads the model in a fresh process from checkout A, then from B (the order alternates by round),
and measures prefill and decode with ``perfx bench``'s end-to-end measurement, with the tuned parameters
each checkout finds (its own shipped database; the user database is left out unless --user-db). The
table gives the median and the spread (min–max) of the rounds, and B/A per figure.

Each checkout is first installed apart (``pip install --no-deps --target``), and its processes import that
copy: with the checkout only on PYTHONPATH, an editable install of perfx would still serve ``perfx.kernels``
and ``perfx.tuning`` from the working tree it was made from, so A would run B's kernels and database.

    git worktree add /tmp/before <commit>
    python benchmarks/ab_trees.py /tmp/before . --model default --rounds 5

One checkout under two settings (``--env-a`` / ``--env-b NAME=VALUE``, each repeatable, set in that side's
processes only), e.g. the decode step with its norms as GEMV tails against each norm its own launch:

    python benchmarks/ab_trees.py . . --env-a PERFX_FUSE=off --env-b PERFX_FUSE=tails --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Run inside each checkout: the measurement as that checkout does it.
PROBE = r"""
import json, sys
from perfx.model import load_model
from perfx.runtime import Device
try:
    from perfx.commands.bench import measure_e2e
except ImportError:  # checkouts from before 2026-11-30
    from perfx.bench_e2e import measure as measure_e2e
model, _ = load_model(sys.argv[1], Device(), progress=False, default_ctx=512)
print("RESULT " + json.dumps(measure_e2e(model, int(sys.argv[2]), int(sys.argv[3]))))
"""
FIGURES = ("prefill_tok_s", "decode_tok_s", "decode_gb_s", "host_ms_per_token")


def install_apart(tree: Path, into: Path) -> Path:
    """``tree`` installed into ``into`` (its kernels and tuning files inside the package, as a wheel holds
    them): the folder to put on PYTHONPATH."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--disable-pip-version-check", "--target", str(into), str(tree.resolve())], check=True)
    return into


def run_once(site: Path, model: str, prompt: int, steps: int, cache: str | None, settings: dict | None = None
             ) -> dict:
    env = dict(os.environ, **(settings or {}), PYTHONPATH=str(site))
    if cache is not None:
        env["PERFX_CACHE"] = cache
    out = subprocess.run([sys.executable, "-c", PROBE, model, str(prompt), str(steps)], env=env,
                         capture_output=True, text=True, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        raise SystemExit(f"{site}: the measurement failed:\n{out.stderr[-3000:]}")
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def alternating(rounds: int):
    """(round, side) in the order the sides run: A then B, then B then A, so neither always goes first."""
    for i in range(rounds):
        for label in ("AB" if i % 2 == 0 else "BA"):
            yield i, label


def summarise(runs: dict, figures) -> dict:
    """Each figure's median and range on each side, and B's median over A's."""
    summary = {}
    for name in figures:
        a = [r[name] for r in runs["A"]]
        b = [r[name] for r in runs["B"]]
        summary[name] = {"A": statistics.median(a), "A_range": [min(a), max(a)], "B": statistics.median(b),
                         "B_range": [min(b), max(b)], "B_over_A": statistics.median(b) / statistics.median(a)}
    return summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="checkout A (before)")
    parser.add_argument("b", type=Path, help="checkout B (after)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--user-db", action="store_true",
                        help="let both checkouts read the user's tuning database too (default: shipped only)")
    parser.add_argument("--env-a", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable set for A's processes only (repeatable)")
    parser.add_argument("--env-b", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable set for B's processes only (repeatable)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    settings = {label: _settings(parser, given) for label, given in (("A", args.env_a), ("B", args.env_b))}

    cache = None
    if not args.user_db:  # an empty cache that still holds the default model: shipped tuning entries only
        cache = tempfile.mkdtemp(prefix="perfx-ab-")
        models = Path(os.environ.get("PERFX_CACHE", Path.home() / ".cache" / "perfx")) / "models"
        if models.is_dir():
            (Path(cache) / "models").symlink_to(models)
    installed = Path(tempfile.mkdtemp(prefix="perfx-ab-trees-"))
    sites = {label: install_apart(tree, installed / label) for label, tree in (("A", args.a), ("B", args.b))}
    runs = {"A": [], "B": []}
    for i, label in alternating(args.rounds):
        runs[label].append(run_once(sites[label], args.model, args.prompt_tokens, args.decode_tokens, cache,
                                    settings[label]))
        print(f"round {i + 1} {label}: decode {runs[label][-1]['decode_tok_s']:.1f} tok/s, prefill "
              f"{runs[label][-1]['prefill_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    summary = summarise(runs, FIGURES)
    if args.json:
        print(json.dumps({"model": args.model, "rounds": args.rounds, "figures": summary, "runs": runs}, indent=1))
        return 0
    sides = {label: f"{tree}" + "".join(f" {name}={value}" for name, value in settings[label].items())
             for label, tree in (("A", args.a), ("B", args.b))}
    print(f"{args.model}, {args.rounds} rounds interleaved; A = {sides['A']}, B = {sides['B']}")
    for name, s in summary.items():
        print(f"  {name:18} A {s['A']:8.2f} ({s['A_range'][0]:.2f}–{s['A_range'][1]:.2f})   "
              f"B {s['B']:8.2f} ({s['B_range'][0]:.2f}–{s['B_range'][1]:.2f})   B/A {s['B_over_A']:.3f}")
    return 0


def _settings(parser, given: list[str]) -> dict:
    """NAME=VALUE strings as a dict; a string without "=" is an error naming it."""
    bad = [item for item in given if "=" not in item or not item.split("=", 1)[0]]
    if bad:
        parser.error(f"--env-a/--env-b take NAME=VALUE, got {bad}")
    return dict(item.split("=", 1) for item in given)


if __name__ == "__main__":
    sys.exit(main())
