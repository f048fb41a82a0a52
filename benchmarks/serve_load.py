"""A bounded load test of `perfx serve` on loopback: N concurrent clients, R streamed chat requests each.

Starts `perfx serve` on 127.0.0.1 (a free port), sends one unmeasured request, then runs the clients through
the official `openai` client and stops the server with SIGTERM. Prints throughput, the server's queueing delay
(from its per-request log lines), the clients' TTFT and latency percentiles, and the server's resident memory
after each round of N requests, so growth would show. Stops by itself: N × R requests, each bounded by
--max-tokens and a client timeout.

    python benchmarks/serve_load.py                                  # the default model, 4 clients × 6
    python benchmarks/serve_load.py --model tiny.gguf --clients 8 --requests 10 --max-tokens 64
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import openai

SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?", "Why is the sky blue?",
             "Name a prime number larger than ten.", "What do bees make?", "What is water made of?",
             "Who wrote Hamlet?", "What is the boiling point of water?"]


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux and Android: /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class ServeProcess:
    """`perfx serve` on a free loopback port, its stderr read as it comes (queue waits parsed from it)."""

    def __init__(self, model: str, queue_limit: int, ctx: int | None, parallel: str = "auto"):
        command = [sys.executable, "-m", "perfx", "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
                   "--queue", str(queue_limit), "--parallel", parallel] + (["--ctx", str(ctx)] if ctx else [])
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.lines: queue.Queue = queue.Queue()
        self.waits: list[float] = []        # seconds each chat request waited in the queue
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 900    # the first run may fetch the default model
        while True:
            line = self.lines.get(timeout=max(1.0, deadline - time.monotonic()))
            if match := re.search(r"perfx serve: (\S+) on (http://127\.0\.0\.1:\d+/v1)", line):
                self.model_id, self.url = match[1], match[2]
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"perfx serve exited:\n{''.join(self.log)}")

    def _read(self):
        for line in self.proc.stderr:
            self.log.append(line)
            if match := re.search(r"POST /v1/chat/completions 200, .* wait ([\d.]+) s", line):
                self.waits.append(float(match[1]))
            self.lines.put(line)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


def one_request(client: openai.OpenAI, model: str, question: str, max_tokens: int, seed: int) -> dict:
    started = time.monotonic()
    first = None
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=max_tokens, seed=seed, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic()
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.monotonic()
    return {"ttft": (first or ended) - started, "latency": ended - started, "tokens": usage.completion_tokens,
            "cached": usage.prompt_tokens_details.cached_tokens, "prompt": usage.prompt_tokens}


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def percentiles(values: list[float]) -> str:
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return f"p50 {p50:.2f} s, p90 {p90:.2f} s, p99 {p99:.2f} s, max {max(values):.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (default %(default)s)")
    parser.add_argument("--requests", type=int, default=6, help="requests per client (default %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=32, help="per request (default %(default)s)")
    parser.add_argument("--queue", type=int, default=16, help="the server's --queue (default %(default)s)")
    parser.add_argument("--ctx", type=int, help="the server's --ctx")
    parser.add_argument("--parallel", default="auto", help="the server's --parallel (default %(default)s)")
    args = parser.parse_args()

    server = ServeProcess(args.model, args.queue, args.ctx, args.parallel)
    pid = server.proc.pid
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=600, max_retries=0)
        rss_loaded = rss_bytes(pid)
        one_request(client, server.model_id, QUESTIONS[0], args.max_tokens, seed=0)  # unmeasured
        rss_rounds = [rss_bytes(pid)]
        done = 0
        done_lock = threading.Lock()
        rejected = 0

        def run_client(index: int) -> list[dict]:
            nonlocal done, rejected
            mine = openai.OpenAI(base_url=server.url, api_key="unused", timeout=600, max_retries=0)
            results = []
            for r in range(args.requests):
                try:
                    results.append(one_request(mine, server.model_id, QUESTIONS[(index + r) % len(QUESTIONS)],
                                               args.max_tokens, seed=index * 1000 + r))
                except openai.RateLimitError:
                    with done_lock:
                        rejected += 1
                with done_lock:
                    done += 1
                    if done % args.clients == 0:     # a round: as many requests as clients
                        rss_rounds.append(rss_bytes(pid))
            return results

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            results = [r for rs in pool.map(run_client, range(args.clients)) for r in rs]
        elapsed = time.monotonic() - started
        rss_end = rss_bytes(pid)
    finally:
        status = server.stop() if server.proc.poll() is None else server.proc.returncode

    waits = server.waits[1:]  # the first line is the unmeasured request
    tokens = sum(r["tokens"] for r in results)
    mib = 2 ** 20
    print(f"# perfx serve under load: {time.strftime('%Y-%m-%d')}, {platform.node()} "
          f"({os.cpu_count()} CPUs, {platform.machine()}), model {server.model_id}")
    print(f"command: python benchmarks/serve_load.py {' '.join(sys.argv[1:])}")
    print(f"{plural(args.clients, 'client')} × {plural(args.requests, 'request')}, max_tokens {args.max_tokens}, streamed, queue "
          f"{args.queue}: {len(results)} completed, {rejected} rejected (429) in {elapsed:.1f} s")
    print(f"throughput: {len(results) / elapsed:.2f} requests/s, {tokens / elapsed:.1f} completion tokens/s "
          f"({tokens} tokens; mean prompt {np.mean([r['prompt'] for r in results]):.0f} tokens, "
          f"{np.mean([r['cached'] for r in results]):.0f} of them cached)")
    print(f"queueing delay (server): {percentiles(waits)}")
    print(f"TTFT (client, queueing included): {percentiles([r['ttft'] for r in results])}")
    print(f"latency (client): {percentiles([r['latency'] for r in results])}")
    rounds = rss_rounds[1:]
    shown = sorted(set(np.linspace(0, len(rounds) - 1, min(len(rounds), 12)).round().astype(int)))
    print(f"server RSS: {rss_loaded / mib:.1f} MiB loaded, {rss_rounds[0] / mib:.1f} MiB after the first request, "
          f"{rss_end / mib:.1f} MiB at the end (max {max(rss_rounds + [rss_end]) / mib:.1f}); after round k of "
          f"{len(rounds)} ({plural(args.clients, 'request')} each): "
          + ", ".join(f"{k + 1}: {rounds[k] / mib:.1f}" for k in shown) + " MiB")
    print(f"server exit status after SIGTERM: {status}")
    return 0 if status == 0 and not rejected and len(waits) == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
