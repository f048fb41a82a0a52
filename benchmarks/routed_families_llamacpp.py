"""llama.cpp's greedy answers on the tiny files of the mixtures of experts, Gemma 4 and 3n (``tests/helpers/
llamacpp_files.py`` writes them), the truth ``tests/test_routed_families_llamacpp.py`` checks perfx against.

For each family: the first seed from 0 whose greedy run under llama.cpp's CPU backend (2 threads, n_ctx 256) is
clear in both engines — at every step llama.cpp's top logit and the float64 forward's (fed llama.cpp's tokens)
name the same token, each at least ``MIN_MARGIN`` above its next, with at least ``MIN_DISTINCT`` different
tokens. ``MIN_MARGIN`` is some five times the largest logit difference seen between the two on these files
(llama.cpp rounds activations to 8 bits). A mixture of experts can differ
from llama.cpp by more than its rounding where a router's top-k is near a tie (a different expert chosen): the
seed search keeps such seeds out, and ``--show SEED`` prints any seed's three answers side by side.

    python benchmarks/routed_families_llamacpp.py --write tests/data/llamacpp_routed_families.json

llama-cpp-python is a benchmark tool here, never a perfx dependency:
CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36 (about ten minutes on two cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.llamacpp import import_llama_cpp  # noqa: E402
from helpers.llamacpp_files import PROMPT, WRITERS  # noqa: E402

GREEDY = 8
MIN_MARGIN = 0.2
MIN_DISTINCT = 3


def llama_greedy(path: Path, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    llm = import_llama_cpp().Llama(model_path=str(path), n_ctx=256, n_batch=256, n_threads=2, n_threads_batch=2,
                                   logits_all=True, n_gpu_layers=0, verbose=False)
    llm.eval(prompt)
    tokens, margins = [], []
    for _ in range(steps):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        top = np.sort(logits)[::-1]
        tokens.append(int(logits.argmax()))
        margins.append(float(top[0] - top[1]))
        llm.eval([tokens[-1]])
    return tokens, margins


def float64_margins(path: Path, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """The float64 forward's top-1 token and margin at each greedy step, fed llama.cpp's tokens."""
    from perfx.forward64 import model_forward
    from perfx.sources import open_model

    logits = model_forward(open_model(path), prompt + tokens[:-1])[0][len(prompt) - 1:]
    top = np.sort(logits, axis=1)[:, ::-1]
    return [int(t) for t in logits.argmax(axis=1)], [float(m) for m in top[:, 0] - top[:, 1]]


def run_family(family: str, work: Path, max_seeds: int) -> dict:
    for seed in range(max_seeds):
        path = WRITERS[family](work / f"{family}.gguf", seed)
        tokens, margins = llama_greedy(path, PROMPT, GREEDY)
        if min(margins) < MIN_MARGIN or len(set(tokens)) < MIN_DISTINCT:
            continue
        f64_tokens, f64_margins = float64_margins(path, PROMPT, tokens)
        if f64_tokens == tokens and min(f64_margins) >= MIN_MARGIN:
            break
    else:
        raise SystemExit(f"{family}: no seed below {max_seeds} gives a clear greedy run")
    print(f"{family}: seed {seed}, greedy {tokens}\n  llama.cpp margins {[round(m, 3) for m in margins]}\n"
          f"  float64 {f64_tokens}, margins {[round(m, 3) for m in f64_margins]}", file=sys.stderr)
    return {"seed": seed, "prompt_ids": PROMPT, "greedy": tokens, "margins": [round(m, 3) for m in margins],
            "float64_greedy": f64_tokens, "float64_margins": [round(m, 3) for m in f64_margins]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="write the JSON here (else print it)")
    parser.add_argument("--families", default=",".join(WRITERS))
    parser.add_argument("--max-seeds", type=int, default=200)
    parser.add_argument("--show", type=int, metavar="SEED", help="print llama.cpp's and float64's answers at SEED")
    args = parser.parse_args(argv)
    llama_cpp = import_llama_cpp()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.show is not None:
            for family in args.families.split(","):
                path = WRITERS[family](work / f"{family}.gguf", args.show)
                tokens, margins = llama_greedy(path, PROMPT, GREEDY)
                f64, f64_margins = float64_margins(path, PROMPT, tokens)
                print(f"{family} seed {args.show}: llama.cpp {tokens} {[round(m, 3) for m in margins]}\n"
                      f"  float64 {f64} {[round(m, 3) for m in f64_margins]}")
            return
        result = {"llama_cpp_python": llama_cpp.__version__, "llama_cpp": llama_cpp.llama_version().decode(),
                  "threads": 2, "greedy_steps": GREEDY, "min_margin": MIN_MARGIN, "families": {}}
        for family in args.families.split(","):
            result["families"][family] = run_family(family, work, args.max_seeds)
    text = json.dumps(result, indent=1)
    if args.write:
        args.write.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
