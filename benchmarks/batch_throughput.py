"""Continuous batching's gain: aggregate decode tok/s of N sequences decoded together over one sequence alone.

Two measures, each as interleaved rounds (the contenders in a shuffled order every round, so drift and other
load on a shared machine do not favour one), reported as the ratio of medians with its 95% bootstrap interval:

- ``step`` (default): N sequences through ``perfx.batch.Batch.step`` (N rows a step, the logits read back and
  each row's token chosen on the host, as `perfx serve --parallel` does) against one sequence through
  ``Model.greedy_tokens`` (today's decode loop on the device), both from a short prompt, STEPS steps each.
- ``--matrices``: where a step's time goes: layer 0's gate_up and down and the lm_head as the GEMM over N rows
  (what a batched step runs) over their GEMV of one row (what one sequence runs), device time of each launch.
- ``--ops``: where a batched step's device time goes at each N (1 included: the decode step's GEMVs): its
  recorded launches replayed on a profiling queue, each launch's device time summed by kernel and launch size
  (one line a matrix: qkv, o, gate-up, down, the lm_head; attention; norms), with the GEMM kind the plan chose
  for each matrix at that M.
- ``--peer`` (with step): llama.cpp's CPU backend on the same GGUF in the same rounds (llama-cpp-python, a
  benchmark tool, never a perfx dependency): N sequences a ``llama_decode`` (each its own sequence id, one token
  a sequence a call, every row's logits read and its argmax taken on the host, as the step's are) against one
  sequence the same way, both from the same short prompts and 2 threads; so the gain of batching on this CPU is
  measured for the peer too, and perfx's aggregate tok/s is given over llama.cpp's at N and at one.
- ``--serve``: `perfx serve --parallel N` as users run it, in its own process, and N official `openai` clients
  (threads of this process) streaming at once against one client alone, greedy, --max-tokens each: completion
  tokens over wall time; and the time to first token of a request that arrives while N − 1 others stream, over
  its time alone. ``--in-process`` runs the server in this process instead, where its threads share one
  interpreter with the clients' (what the figures before 2026-12-06 08:00 UTC in benchmarks/NOTES.md measured).

    python benchmarks/batch_throughput.py --model synthetic:smollm2-135m --parallel 2 4 8
    python benchmarks/batch_throughput.py --device intel --parallel 4 8 --peer      # llama.cpp's batching beside
    python benchmarks/batch_throughput.py --matrices --parallel 2 4 8
    python benchmarks/batch_throughput.py --ops --parallel 1 2 4 8
    python benchmarks/batch_throughput.py --serve --parallel 4 --rounds 5          # the default model
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import platform
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np

from perfx.batch import Batch
from perfx.generate import SamplingConfig
from perfx.mixers import Rows
from perfx.model import load_model
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.timing import bootstrap_ratio

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def step_rate(batch: Batch, n: int, steps: int) -> float:
    """Aggregate tok/s of n sequences decoded together for ``steps`` steps (each row's argmax fed next)."""
    for slot in range(n):
        batch.prefill(slot, PROMPT[:-1] + [PROMPT[-1] + slot], 0)
    tokens = [PROMPT[0]] * n
    started = time.perf_counter()
    for _ in range(steps):
        logits = batch.step(list(enumerate(tokens)))
        tokens = [int(np.argmax(row)) for row in logits]
    return n * steps / (time.perf_counter() - started)


def alone_rate(model, steps: int) -> float:
    """tok/s of one sequence through the model's own decode loop."""
    model.prefill(PROMPT, 0)
    started = time.perf_counter()
    for _ in model.greedy_tokens(model.argmax(), len(PROMPT), len(PROMPT) + steps - 1):
        pass
    return steps / (time.perf_counter() - started)


class LlamaBatch:
    """llama.cpp's CPU backend holding ``n`` sequences in one context (``--peer``): ``rate(steps)`` decodes them
    together, one ``llama_decode`` of n tokens a step, as ``step_rate`` does perfx's."""

    def __init__(self, path, n: int, ctx: int, threads: int = 2):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from helpers.llamacpp import import_llama_cpp

        llama_cpp = import_llama_cpp()
        llama_cpp._logger.set_verbose(False)   # errors only, as Llama(verbose=False) has it
        self.api = api = llama_cpp.llama_cpp
        params = api.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = api.llama_model_load_from_file(str(path).encode(), params)
        context = api.llama_context_default_params()
        context.n_ctx, context.n_batch, context.n_ubatch, context.n_seq_max = ctx, ctx, ctx, n
        context.n_threads = context.n_threads_batch = threads
        self.ctx = api.llama_init_from_model(self.model, context)
        self.vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.model))
        self.n = n
        self.batch = api.llama_batch_init(max(n * len(PROMPT), n), 0, n)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (sequence, position, token, wants logits) rows."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (seq, pos, token, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        if self.api.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(self.api.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,))))

    def rate(self, steps: int) -> float:
        """Aggregate tok/s of the n sequences decoded together for ``steps`` steps, from the prompts step_rate
        gives perfx's slots (each row's argmax fed next)."""
        self.api.llama_memory_clear(self.api.llama_get_memory(self.ctx), True)
        self._decode([(seq, pos, token, False) for seq in range(self.n)
                      for pos, token in enumerate(PROMPT[:-1] + [PROMPT[-1] + seq])])
        tokens = [PROMPT[0]] * self.n
        started = time.perf_counter()
        for step in range(steps):
            self._decode([(seq, len(PROMPT) + step, token, True) for seq, token in enumerate(tokens)])
            tokens = [self._argmax(i) for i in range(self.n)]
        return self.n * steps / (time.perf_counter() - started)


def start_server(model, tokenizer, n: int, max_tokens: int, command: list | None):
    """A server of ``n`` slots: `perfx serve --parallel n` as users run it, in a process of its own (``command``:
    [the model, the context, its other options]), or with ``command`` None in this process beside the clients,
    sharing their interpreter. Returns (its base URL, how to stop it)."""
    if command is None:
        from perfx.serve.batching import BatchEngine
        from perfx.serve.server import Server, ServeOptions

        engine = BatchEngine(model, tokenizer, 64, SamplingConfig(temperature=0), n)
        server = Server(("127.0.0.1", 0), engine, ServeOptions("bench", max_tokens, log=lambda line: None))
        threading.Thread(target=server.serve_forever, daemon=True).start()

        def stop():
            server.shutdown()
            server.engine.close()
        return f"http://127.0.0.1:{server.server_address[1]}", stop
    from serve_load import ServeProcess   # the load test's way of starting `perfx serve` (needs openai)

    model_path, ctx, *options = command
    server = ServeProcess(model_path, 64, ctx, str(n), *options, "--temperature", "0", "--max-tokens", str(max_tokens))
    return server.url.removesuffix("/v1"), server.stop


def serve_rates(url: str, n: int, max_tokens: int) -> dict:
    """Contenders for --serve: (aggregate tok/s of n clients, of one client; TTFT joining n − 1 streams, alone),
    the official openai client streaming from the server at ``url``."""
    import openai   # the benchmark's client; perfx itself does not need it

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", timeout=600)
    served = client.models.list().data[0].id

    def ask(i: int, tokens: int = max_tokens) -> tuple[int, float]:
        """(completion tokens, seconds to the first text) of one streamed request."""
        started, first, count = time.perf_counter(), None, 0
        for chunk in client.completions.create(model=served, prompt=f"Question {i}: why is the sky blue?",
                                               max_tokens=tokens, temperature=0, stream=True,
                                               stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].text and first is None:
                first = time.perf_counter() - started
            if chunk.usage:
                count = chunk.usage.completion_tokens
        return count, first or 0.0

    def together(clients: int) -> float:
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            done = sum(c for c, _ in pool.map(ask, range(clients)))
        return done / (time.perf_counter() - started)

    def joining() -> float:
        """TTFT of a request sent once n − 1 long ones stream."""
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            streams = [pool.submit(ask, i, 4 * max_tokens) for i in range(n - 1)]
            time.sleep(0.5)
            ttft = ask(n, 8)[1]
            for stream in streams:
                stream.result()
        return ttft

    return {"n clients tok/s": lambda: together(n), "1 client tok/s": lambda: together(1),
            "TTFT joining s": joining, "TTFT alone s": lambda: ask(0, 8)[1]}


def matrix_contenders(model, n: int) -> dict:
    """Seconds of one launch of each matrix: its GEMV (one row) and its GEMM over n rows."""
    s, q = model.state, model.device.queue
    layer, head = model.weights.layers[0], model.weights.lm_head
    rows_logits = model.device.empty((n, model.config.vocab_size), np.float32)
    runs = {"gate_up": (layer.gate_up, s.xb, s.hb, s.hb), "down": (layer.down, s.hb, s.proj, s.proj),
            "lm_head": (head, s.xb, s.logits, rows_logits)}

    def timed(run, reps: int = 10) -> float:
        run()
        q.finish()
        started = time.perf_counter()
        for _ in range(reps):
            run()
        q.finish()
        return (time.perf_counter() - started) / reps

    out = {}
    for name, (linear, x, y_one, y_rows) in runs.items():
        out[f"{name} gemv"] = lambda linear=linear, x=x, y=y_one: timed(lambda: linear(x, y, 1, True))
        if name == "lm_head":
            out[f"{name} gemm"] = lambda linear=linear, x=x, y=y_rows: timed(lambda: linear.rows(x, y, n))
        else:
            out[f"{name} gemm"] = lambda linear=linear, x=x, y=y_rows: timed(lambda: linear(x, y, n, False))
    return out


def step_ops(batch: Batch, n: int, rounds: int) -> tuple[dict, float]:
    """(kernel, launch size) -> device seconds a step (the median over ``rounds`` replays after one dropped), and
    the step's whole device time: the batched step of n rows (n = 1: the decode step's launches, as
    ``Batch.step`` records them), each launch timed by its own profiling event."""
    device = batch.model.device
    for slot in range(n):
        batch.prefill(slot, PROMPT[:-1] + [PROMPT[-1] + slot], 0)
    # the step reads its tokens and positions on the device (``Batch.step`` uploads them the same way)
    device.write(batch.ids, np.array([PROMPT[0]] * n + [len(PROMPT)] * n + [0] * 2 * (batch.slots - n), np.int32))
    with device.record() as launches:
        batch._launches(Rows([len(PROMPT)] * n, batch.ids, n, [batch.states[slot] for slot in range(n)]))
    launches = [launch for launch in launches if hasattr(launch, "kernel")]
    samples = collections.defaultdict(list)
    with device.profiling() as queue:
        for round_ in range(rounds + 1):
            events = [(launch.kernel.function_name, launch.global_size, launch.enqueue(queue)) for launch in launches]
            queue.finish()
            if round_ == 0:
                continue
            totals = collections.defaultdict(float)
            for name, size, event in events:
                totals[name, size] += device.event_seconds(event)
            for key, seconds in totals.items():
                samples[key].append(seconds)
    per_key = {key: float(np.median(values)) for key, values in samples.items()}
    return per_key, sum(per_key.values())


def gemm_kinds(model, n: int) -> str:
    """Which GEMM kind the plan runs for each matrix at M = n (the decode GEMVs at 1)."""
    if n == 1:
        return "decode GEMVs"
    gemms, _ = model.plan.prefill(n)
    kinds = [f"{role} {gemm.kind}" for role, gemm in gemms.items()]
    head = model.weights.lm_head.weight
    if isinstance(head, Q8DeviceWeight):
        kinds.append(f"lm_head int8 {model.plan.q8('gemm', 'lm_head', head, n).kind}")
    return ", ".join(kinds)


def interleaved(contenders: dict, rounds: int) -> dict[str, list[float]]:
    names, shuffle = list(contenders), random.Random(0)
    figures: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds + 1):   # the first round warms up and is dropped
        shuffle.shuffle(names)
        for name in names:
            figures[name].append(contenders[name]())
    return {name: values[1:] for name, values in figures.items()}


def report(label: str, numerator: list[float], denominator: list[float], rng) -> None:
    ratio, low, high = bootstrap_ratio(numerator, denominator, rng)
    print(f"  {label}: {ratio:.2f}x (95% interval {low:.2f}-{high:.2f}; medians {np.median(numerator):.3g} over "
          f"{np.median(denominator):.3g}; rounds {[f'{a / b:.2f}' for a, b in zip(numerator, denominator)]})",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model perfx loads (default: the default model)")
    parser.add_argument("--device", default=None, help="PERFX_DEVICE's forms: pocl, intel, P:D")
    parser.add_argument("--parallel", type=int, nargs="+", default=[4], help="sequences decoded together (N)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps a measure (step mode)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (after one dropped warm-up)")
    parser.add_argument("--serve", action="store_true", help="through `perfx serve` and the openai client")
    parser.add_argument("--matrices", action="store_true", help="each matrix's GEMM over N rows over its GEMV")
    parser.add_argument("--ops", action="store_true", help="device time of a batched step by kernel, at each N")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens a request (--serve)")
    parser.add_argument("--in-process", action="store_true",
                        help="--serve: the server in this process, beside its clients (sharing their interpreter), "
                             "not `perfx serve` in its own")
    parser.add_argument("--peer", action="store_true",
                        help="llama.cpp's batched decode beside perfx's, same GGUF (step mode; llama-cpp-python)")
    parser.add_argument("--ctx", type=int, default=1024)
    args = parser.parse_args()
    model, source = load_model(args.model, args.device, ctx=args.ctx, progress=False)
    rng = np.random.default_rng(0)
    print(f"{source.describe().get('path', args.model)} on {model.device.caps.name}, {platform.node()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, rounds {args.rounds}", flush=True)
    if args.ops:
        batch = Batch(model, max(args.parallel))
        one = None
        for n in args.parallel:
            per_key, total = step_ops(batch, n, args.rounds)
            one = one if one is not None or n != 1 else total
            gain = f", {n} tokens at {n * one / total:.2f}x one's tok/s (device time)" if one else ""
            print(f"N = {n}: {total * 1e3:.2f} ms a step{gain}; {gemm_kinds(model, n)}")
            for (name, size), seconds in sorted(per_key.items(), key=lambda kv: -kv[1])[:12]:
                print(f"  {seconds * 1e3:8.3f} ms  {name} {size}")
        return
    for n in args.parallel:
        if args.matrices:
            figures = interleaved(matrix_contenders(model, n), args.rounds)
            print(f"N = {n}, matrices, GEMM over {n} rows over the GEMV of one (time):")
            for name in ("gate_up", "down", "lm_head"):
                report(name, figures[f"{name} gemm"], figures[f"{name} gemv"], rng)
        elif args.serve:
            command = None if args.in_process else (
                [str(source.describe().get("path", args.model or "default")), args.ctx]
                + (["--device", args.device] if args.device else []))
            url, stop = start_server(model, source.tokenizer, n, args.max_tokens, command)
            try:
                figures = interleaved(serve_rates(url, n, args.max_tokens), args.rounds)
            finally:
                stop()
            where = "in this process" if args.in_process else "its own process"
            print(f"N = {n}, serve ({where}), {args.max_tokens} tokens a request:")
            report(f"aggregate tok/s, {n} clients over 1", figures["n clients tok/s"], figures["1 client tok/s"], rng)
            report(f"TTFT joining {n - 1} streams over alone", figures["TTFT joining s"], figures["TTFT alone s"],
                   rng)
        else:
            alone, _ = load_model(args.model, model.device, ctx=args.ctx, progress=False)
            batch = Batch(model, n)
            contenders = {"n": lambda: step_rate(batch, n, args.steps), "1": lambda: alone_rate(alone, args.steps)}
            if args.peer:
                path = source.describe()["path"]
                peers = {count: LlamaBatch(path, count, args.ctx) for count in (n, 1)}
                contenders["llama n"] = lambda: peers[n].rate(args.steps)
                contenders["llama 1"] = lambda: peers[1].rate(args.steps)
            figures = interleaved(contenders, args.rounds)
            print(f"N = {n}, step, {args.steps} steps:")
            report(f"aggregate decode tok/s, {n} sequences over 1", figures["n"], figures["1"], rng)
            if args.peer:
                report(f"llama.cpp: aggregate decode tok/s, {n} sequences over 1", figures["llama n"],
                       figures["llama 1"], rng)
                report(f"perfx over llama.cpp, {n} sequences", figures["n"], figures["llama n"], rng)
                report("perfx over llama.cpp, 1 sequence", figures["1"], figures["llama 1"], rng)


if __name__ == "__main__":
    main()
