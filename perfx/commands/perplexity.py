"""`perfx perplexity FILE`: the perplexity of a model on a text, by llama.cpp's llama-perplexity method.

How a user compares quantizations (a Q4_K_M against its Q8_0, `--lm-head q8` against `fp16`) and how perfx
is checked against llama.cpp on the same file (benchmarks/NOTES.md). The method, as llama-perplexity's
``perplexity()`` (tools/perplexity/perplexity.cpp):

- the whole text is tokenized once, with a BOS first only where the model adds one
  (``tokenizer.add_bos_token``) and without parsing special-token text;
- the ids are cut into whole chunks of N (``--ctx``), each evaluated from an empty cache at position 0;
  where the model adds a BOS, the chunk's first token is replaced by BOS for the evaluation;
- the prediction of each token in the second half of a chunk (positions N/2 + 1 .. N − 1, from the
  logits at N/2 .. N − 2) is scored: PPL = exp(mean NLL), ± PPL·sqrt(var(NLL) / (count − 1)).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from perfx.commands.options import add_model_options, load_model_from_args, log
from perfx.errors import PerfxError
from perfx.progress import Progress

DEFAULT_CTX = 512   # llama-perplexity's classic setting (wikitext-2 figures are quoted at -c 512)


def add_arguments(parser):
    parser.add_argument("file", help="a UTF-8 text file (e.g. wikitext-2's wiki.test.raw)")
    add_model_options(parser, ctx=False)
    parser.add_argument("--ctx", type=int, default=DEFAULT_CTX,
                        help="tokens per chunk, N (default %(default)s, as llama-perplexity -c); the text must "
                             "hold at least 2·N tokens")
    parser.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def nll_rows(logits: np.ndarray, targets) -> np.ndarray:
    """−log softmax(logits)[target] per row, in float64."""
    rows = np.asarray(logits, dtype=np.float64)
    top = rows.max(axis=1)
    log_z = top + np.log(np.exp(rows - top[:, None]).sum(axis=1))
    return log_z - rows[np.arange(len(rows)), np.asarray(targets)]


def check_options(ctx: int, chunks: int | None):
    if ctx < 4 or ctx % 2:
        raise PerfxError(f"--ctx must be an even number of at least 4 tokens, got {ctx}")
    if chunks is not None and chunks < 1:
        raise PerfxError(f"--chunks must be at least 1, got {chunks}")


def chunk_plan(n_tokens: int, ctx: int, chunks: int | None) -> int:
    """How many chunks of ``ctx`` to score (llama-perplexity: all whole chunks, at most --chunks); a
    PerfxError when the text is too short (it needs 2·ctx tokens, as llama-perplexity does)."""
    check_options(ctx, chunks)
    if n_tokens < 2 * ctx:
        raise PerfxError(f"the text tokenizes to {n_tokens} tokens; perplexity with a context of {ctx} needs at "
                         f"least {2 * ctx} (as llama-perplexity): give a longer text or a smaller --ctx")
    available = n_tokens // ctx
    return available if chunks is None else min(chunks, available)


def perplexity(model, tokens: list[int], ctx: int, chunks: int, bos_id: int | None, progress=None) -> dict:
    """Score ``chunks`` chunks of ``ctx`` tokens (``bos_id``: the model adds BOS, replacing each chunk's first
    token). Returns ppl, its ± estimate, the mean NLL, counts and the evaluation speed."""
    first = ctx // 2
    nll_sum = nll2_sum = 0.0
    count = 0
    running = []
    started = time.perf_counter()
    for i in range(chunks):
        ids = list(tokens[i * ctx:(i + 1) * ctx])
        if bos_id is not None:
            ids[0] = bos_id
        logits = model.prefill_logits(ids, 0, first)[:-1]        # positions first .. ctx − 2
        nll = nll_rows(logits, tokens[i * ctx + first + 1:(i + 1) * ctx])
        nll_sum, nll2_sum, count = nll_sum + nll.sum(), nll2_sum + (nll * nll).sum(), count + len(nll)
        running.append(float(np.exp(nll_sum / count)))
        if progress is not None:
            progress.update(note=f"[{i + 1}] {running[-1]:.4f}")
    seconds = time.perf_counter() - started
    mean = nll_sum / count
    variance = nll2_sum / count - mean * mean
    ppl = float(np.exp(mean))
    error = float(ppl * np.sqrt(variance / (count - 1))) if variance > 0 and count > 1 else 0.0
    return {"ppl": ppl, "ppl_error": error, "nll": float(mean), "chunks": chunks, "ctx": ctx, "scored": count,
            "running_ppl": running, "seconds": seconds, "tokens_per_s": chunks * ctx / seconds}


def main(args) -> int:
    check_options(args.ctx, args.chunks)
    path = Path(args.file)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PerfxError(f"{path}: no such file") from None
    except UnicodeDecodeError as error:
        raise PerfxError(f"{path} is not UTF-8 text ({error}); convert it to UTF-8 first") from None
    except OSError as error:
        raise PerfxError(f"cannot read {path}: {error}") from None
    model, source = load_model_from_args(args, log=log, progress=None if not args.json else False)
    tokenizer = source.tokenizer
    if tokenizer is None:
        raise PerfxError(f"{args.model} has no tokenizer: `perfx perplexity` needs one")
    adds_bos = bool(tokenizer.add_bos_token and tokenizer.bos_id is not None)
    tokens = tokenizer.encode(text, add_bos=adds_bos, parse_special=False)
    chunks = chunk_plan(len(tokens), args.ctx, args.chunks)
    log(f"perfx: {len(tokens)} tokens ({'with' if adds_bos else 'no'} BOS, as the model says), {chunks} chunks "
        f"of {args.ctx}, scoring the second half of each")
    with Progress(chunks, "perplexity", enabled=None if not args.json else False) as bar:
        result = perplexity(model, tokens, args.ctx, chunks, tokenizer.bos_id if adds_bos else None, bar)
    result.update(model=str(source.describe().get("path", args.model)), file=str(path), tokens=len(tokens),
                  add_bos=adds_bos, lm_head=args.lm_head, kv=args.kv, device=model.device.caps.name)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"PPL = {result['ppl']:.4f} +/- {result['ppl_error']:.5f} over {result['scored']} predictions "
              f"({chunks} chunks of {args.ctx})")
        log(f"perfx: {result['tokens_per_s']:.1f} tokens/s ({result['seconds']:.1f} s) on {model.device.caps.name}")
    sys.stdout.flush()
    return 0
