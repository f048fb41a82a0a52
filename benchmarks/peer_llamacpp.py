"""llama.cpp's CPU backend as perfx's benchmark peer, on the same GGUF in the same run.

Per round: llama.cpp prefills a 130-token prompt and decodes 64 greedy tokens (2 threads by default); with
--with-perfx, perfx does the same on an OpenCL device (perfx.commands.bench.measure_e2e) in the same rounds, interleaved
perfx, llama.cpp, perfx, llama.cpp, ... Both read the same random prompt ids. The table gives the median
and the spread (min–max) between rounds; --json prints every round.

    python benchmarks/peer_llamacpp.py                        # the default model, llama.cpp only
    python benchmarks/peer_llamacpp.py --with-perfx --device pocl --rounds 5 --json
    python benchmarks/peer_llamacpp.py path/to/model.gguf --with-perfx --device intel
    python benchmarks/peer_llamacpp.py --with-perfx --device pocl,intel   # both, interleaved with llama.cpp

llama-cpp-python is a benchmark tool here, never a perfx dependency; it builds llama.cpp (about ten minutes
on two cores): CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python

For later comparisons the module also gives llama.cpp's tokenization (``tokenize``), its logits for a token
sequence (``logits``) and a llama-perplexity-style perplexity over any logits function (``perplexity``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.llamacpp import import_llama_cpp  # noqa: E402
from perfx.commands.bench import measure_e2e  # noqa: E402
from perfx.model import load_model  # noqa: E402
from perfx.runtime import Device  # noqa: E402
from perfx.sources.default import resolve_model  # noqa: E402

PROMPT_TOKENS = 130
DECODE_TOKENS = 64


def open_llama(path, threads: int = 2, ctx: int = 512, logits_all: bool = False):
    """llama.cpp on the CPU: ``threads`` for decode and for prompt batches; ``logits_all`` keeps every
    position's logits (``logits``, ``perplexity``), else only the last."""
    return import_llama_cpp().Llama(model_path=str(path), n_ctx=ctx, n_batch=ctx, n_threads=threads,
                                    n_threads_batch=threads, logits_all=logits_all, n_gpu_layers=0, verbose=False)


# -- helpers for comparisons ------------------------------------------------------------------------------


def adds_bos(llm) -> bool:
    """Whether the model's own GGUF asks for BOS (``tokenizer.ggml.add_bos_token``), as llama.cpp reads it."""
    import llama_cpp

    return bool(llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model)))


def tokenize(llm, text: str, add_bos: bool | None = None) -> list[int]:
    """llama.cpp's ids for ``text``, special tokens (``<|im_start|>``) parsed as such. ``add_bos=None``
    does what llama.cpp's tools do: llama_tokenize's add_special (llama-cpp-python calls it add_bos), which
    adds BOS only where the GGUF asks for it; True or False forces it."""
    if add_bos is None:
        return llm.tokenize(text.encode(), add_bos=True, special=True)
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    return [llm.token_bos()] + ids if add_bos else ids


def logits(llm, tokens: list[int]) -> np.ndarray:
    """(len(tokens), vocab) float32: row i is llama.cpp's logits after tokens[: i + 1], from a fresh cache.
    ``llm`` must be opened with ``logits_all=True``."""
    if not llm._logits_all:  # llama-cpp-python keeps no public flag for it
        raise ValueError("open the model with open_llama(..., logits_all=True) to read every position's logits")
    llm.reset()
    llm.eval(list(tokens))
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def perplexity(tokens: list[int], chunk: int, logits_of, bos: int | None = None) -> dict:
    """Perplexity as llama.cpp's llama-perplexity computes it: ``tokens`` cut into whole chunks of ``chunk``,
    each evaluated from an empty cache (its first token replaced by ``bos`` where the model adds one), and
    the negative log-likelihood of each token predicted in the second half of its chunk, averaged.
    ``logits_of(ids)`` returns (len(ids), vocab) logits: ``lambda ids: logits(llm, ids)`` for llama.cpp.

    Returns ``{"ppl", "nll", "chunks", "scored"}`` (scored: how many predictions were averaged)."""
    n_chunks = len(tokens) // chunk
    if n_chunks < 1:
        raise ValueError(f"{len(tokens)} tokens make no chunk of {chunk}")
    first = chunk // 2
    nll, scored = 0.0, 0
    for c in range(n_chunks):
        ids = list(tokens[c * chunk:(c + 1) * chunk])
        if bos is not None:
            ids[0] = bos
        rows = np.asarray(logits_of(ids), dtype=np.float64)[first:chunk - 1]
        targets = np.asarray(ids[first + 1:chunk])
        top = rows.max(axis=1)
        log_z = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
        nll += float((log_z - rows[np.arange(len(targets)), targets]).sum())
        scored += len(targets)
    return {"ppl": float(np.exp(nll / scored)), "nll": nll / scored, "chunks": n_chunks, "scored": scored}


# -- the speed run ----------------------------------------------------------------------------------------


def prompt_ids(vocab_size: int, n: int = PROMPT_TOKENS, seed: int = 0) -> list[int]:
    """The random prompt perfx.commands.bench.measure_e2e uses (same seed, same ids)."""
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab_size, n)]


def _greedy(llm) -> int:
    """The argmax of the last evaluated position's logits (without logits_all, eval() stores none)."""
    import llama_cpp

    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))))


def measure_llama(llm, prompt: list[int], decode_tokens: int = DECODE_TOKENS) -> dict:
    """Prefill ``prompt`` on an empty cache and take its greedy token (TTFT), then ``decode_tokens``
    greedy steps of one token each."""
    llm.reset()
    started = time.perf_counter()
    llm.eval(prompt)
    token = _greedy(llm)
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(decode_tokens):
        llm.eval([token])
        token = _greedy(llm)
    decode_s = time.perf_counter() - started
    return {"prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": decode_tokens / decode_s,
            "ttft_s": prefill_s}


def measure_perfx(model, prompt_tokens: int = PROMPT_TOKENS, decode_tokens: int = DECODE_TOKENS) -> dict:
    # measure_e2e() counts the first generated token as the prefill's, so one more gives decode_tokens steps.
    r = measure_e2e(model, prompt_tokens, decode_tokens + 1)
    return {"prefill_tok_s": r["prefill_tok_s"], "decode_tok_s": r["decode_tok_s"], "ttft_s": r["ttft_s"]}


def summary(rounds: list[dict]) -> dict:
    out = {}
    for key in ("prefill_tok_s", "decode_tok_s"):
        values = [r[key] for r in rounds]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", nargs="?", default="default", help="a .gguf file (default: perfx's default model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", default="2", help="llama.cpp threads (default 2), or several counts separated "
                        "by commas, each measured in the same rounds (on a busy machine 1 thread shows what 2 lose)")
    parser.add_argument("--with-perfx", action="store_true", help="measure perfx too, rounds interleaved")
    parser.add_argument("--device", default=None, help="perfx's engines, separated by commas: DEVICE[@CACHE][#HEAD], "
                        "a device as PERFX_DEVICE takes it (pocl, intel, P:D), the PERFX_CACHE whose tuning database "
                        "to load with, the lm_head form (q8 or fp16); default: perfx's default device")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between measurements, so one engine's "
                        "idle worker threads do not run into the other's")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    path = resolve_model(args.gguf)
    llamas = {int(n): open_llama(path, int(n)) for n in args.threads.split(",")}
    llm = next(iter(llamas.values()))
    prompt = prompt_ids(llm.n_vocab())
    engines = {}
    if args.with_perfx:
        for engine in (args.device.split(",") if args.device else [""]):
            # DEVICE[@CACHE][#HEAD]: the device, the PERFX_CACHE whose tuning database the model is loaded
            # with (two databases on one device compare in one run), and the lm_head's form.
            selector, _, head = engine.partition("#")
            selector, _, cache = selector.partition("@")
            if cache:
                os.environ["PERFX_CACHE"] = cache
            device = Device(selector or None)
            model, _ = load_model(str(path), device, progress=False, default_ctx=512, lm_head=head or "q8")
            if model.config.vocab_size != llm.n_vocab():
                raise SystemExit(f"perfx and llama.cpp disagree on the vocabulary ({model.config.vocab_size} vs "
                                 f"{llm.n_vocab()})")
            label = f"perfx on {device.caps.platform}" + (f" @{cache}" if cache else "") + (f" #{head}" if head else "")
            engines[label] = lambda model=model: measure_perfx(model)
    for threads, one in llamas.items():
        engines[f"llama.cpp CPU, {threads} thread{'s' if threads > 1 else ''}"] = lambda one=one: measure_llama(one, prompt)
    load_before = os.getloadavg()[0]

    for run in engines.values():  # warm-up: kernel builds, first-touch of the weights
        run()
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, run in engines.items():
            time.sleep(args.pause)
            rounds[name].append(run())

    import llama_cpp

    report = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{_cpu_name()} ({platform.machine()}), {len(os.sched_getaffinity(0))} CPUs",
        "command": " ".join(["python", *sys.argv]),
        "model": str(path), "prompt_tokens": len(prompt), "decode_tokens": DECODE_TOKENS,
        "llama_cpp_python": llama_cpp.__version__,
        # other jobs on a shared machine show here: 1-minute load average before and after the rounds
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "engines": {name: {**summary(r), "rounds": r} for name, r in rounds.items()},
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"{report['date']}  {report['machine']}, load average {report['load_average']}\n{report['model']}: "
          f"prefill {len(prompt)} tokens, decode {DECODE_TOKENS} greedy tokens, {args.rounds} rounds interleaved "
          "(median, min–max)\n")
    print("| engine | prefill tok/s | decode tok/s |\n|---|---|---|")
    for name, e in report["engines"].items():
        cells = [f"{e[k]['median']:.1f} ({e[k]['min']:.1f}–{e[k]['max']:.1f})" for k in ("prefill_tok_s", "decode_tok_s")]
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
