"""A bounded load test of `perfx serve` on loopback: N concurrent clients, R streamed chat requests each.

Starts `perfx serve` on 127.0.0.1 (a free port), sends one unmeasured request, then runs the clients through
the official `openai` client and stops the server with SIGTERM. Prints throughput, the server's queueing delay
(from its per-request log lines), the clients' TTFT and latency percentiles, and the server's resident memory
after each round of N requests, so growth would show. Stops by itself: N × R requests, each bounded by
--max-tokens and a client timeout.

With --seconds S (the chaos run) each client instead keeps sending for S seconds, a random mix of: streamed and
non-streamed greedy requests, each checked whole (a finish reason, usage that counts what came, a length stop at
exactly max_tokens) and compared with the reply the same question got alone before the load; streams the client
drops after a few chunks; and malformed or invalid requests (bad JSON, a missing or unknown field value, an
unknown model), each of which must get its 4xx with an OpenAI error body. The server's resident memory is read
every second. It fails on any reply cut short, any 5xx or dropped connection, a bad request answered otherwise,
gauges left non-zero at the end (/metrics), or a server that does not exit cleanly on SIGTERM.

    python benchmarks/serve_load.py                                  # the default model, 4 clients × 6
    python benchmarks/serve_load.py --model tiny.gguf --clients 8 --requests 10 --max-tokens 64
    python benchmarks/serve_load.py --clients 16 --seconds 60 --parallel 4    # the chaos run
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import http.client
import json
import os
import platform
import queue
import random
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

    def __init__(self, model: str, queue_limit: int, ctx: int | None, parallel: str = "auto", *options: str):
        command = [sys.executable, "-m", "perfx", "serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
                   "--queue", str(queue_limit), "--parallel", parallel, *options] + (["--ctx", str(ctx)] if ctx else [])
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.lines: queue.Queue = queue.Queue()
        self.waits: list[float] = []        # seconds each chat request waited in the queue
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 900    # the first run may fetch the default model
        while True:
            line = self.lines.get(timeout=max(1.0, deadline - time.monotonic()))
            if match := re.search(r"perfx serve: (\S+) on (http://127\.0\.0\.1:(\d+)/v1)", line):
                self.model_id, self.url, self.port = match[1], match[2], int(match[3])
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


def chat(question: str) -> list[dict]:
    """The messages of a load-test request: the shared system prompt, then the question."""
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def one_request(client: openai.OpenAI, model: str, question: str, max_tokens: int, seed: int) -> dict:
    started = time.monotonic()
    first = None
    usage = None
    stream = client.chat.completions.create(
        model=model, messages=chat(question),
        max_tokens=max_tokens, seed=seed, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic()
        if chunk.usage is not None:
            usage = chunk.usage
    ended = time.monotonic()
    return {"ttft": (first or ended) - started, "latency": ended - started, "tokens": usage.completion_tokens,
            "cached": usage.prompt_tokens_details.cached_tokens, "prompt": usage.prompt_tokens}


# Invalid requests the chaos run sends, each as raw bytes to /v1/chat/completions: (what is wrong, the body, the
# status it must get). MODEL stands for the served model's id.
HELLO = [{"role": "user", "content": "hello"}]
BAD_REQUESTS = [
    ("not JSON", b'{"model": "MODEL", "messages": [', 400),
    ("no messages", {"model": "MODEL"}, 400),
    ("an unknown model", {"model": "no-such-model", "messages": HELLO}, 404),
    ("negative max_tokens", {"model": "MODEL", "messages": HELLO, "max_tokens": -5}, 400),
    ("temperature as text", {"model": "MODEL", "messages": HELLO, "temperature": "hot"}, 400),
    ("an unknown role", {"model": "MODEL", "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("an unknown response_format", {"model": "MODEL", "messages": HELLO, "response_format": {"type": "xml"}}, 400),
    ("n of 0", {"model": "MODEL", "messages": HELLO, "n": 0}, 400),
]
# The chaos run's mix: how often a client sends each kind.
MIX = {"streamed": 5, "non-streamed": 2, "dropped": 2, "bad": 2}


def bad_request(port: int, model: str, rng: random.Random) -> str | None:
    """One of BAD_REQUESTS on a fresh connection; None if it got its status and an OpenAI error body, else what
    went wrong."""
    what, body, status = rng.choice(BAD_REQUESTS)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    data = data.replace(b"MODEL", model.encode())
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/v1/chat/completions", data, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        text = reply.read()
    finally:
        connection.close()
    try:
        error = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        error = None
    if reply.status != status or not error:
        return f"{what}: got {reply.status} {text[:200]!r}, wanted {status} with an error body"
    return None


def checked_reply(client: openai.OpenAI, model: str, question: str, max_tokens: int, stream: bool) -> str:
    """A greedy reply, streamed or not, checked whole: a finish reason, usage, and a length stop at exactly
    max_tokens. Raises AssertionError where it is not."""
    messages = chat(question)
    if stream:
        text, finish, usage = [], None, None
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        text = "".join(text)
    else:
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
        text, finish, usage = reply.choices[0].message.content or "", reply.choices[0].finish_reason, reply.usage
    assert finish in ("stop", "length"), f"finish reason {finish!r}"
    assert usage is not None and 1 <= usage.completion_tokens <= max_tokens, f"usage {usage}"
    assert finish != "length" or usage.completion_tokens == max_tokens, f"a length stop at {usage}"
    return text


def chaos_client(server: "ServeProcess", index: int, deadline: float, max_tokens: int,
                 references: dict[str, str]) -> tuple[collections.Counter, list[str], list[int]]:
    """One client's chaos run: (outcome counts, problems, where each whole reply not as alone first differs)."""
    rng = random.Random(index)
    client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=600, max_retries=0)
    counts, problems, differing = collections.Counter(), [], []
    kinds, weights = list(MIX), list(MIX.values())
    while time.monotonic() < deadline:
        kind = rng.choices(kinds, weights)[0]
        question = rng.choice(QUESTIONS)
        try:
            if kind == "bad":
                problem = bad_request(server.port, server.model_id, rng)
                counts["bad, answered 4xx" if problem is None else "bad, answered wrongly"] += 1
                if problem:
                    problems.append(problem)
            elif kind == "dropped":
                stream = client.chat.completions.create(
                    model=server.model_id, max_tokens=max_tokens, temperature=0, stream=True, messages=chat(question))
                for _, _chunk in zip(range(rng.randint(1, 3)), stream):
                    pass
                stream.close()
                counts["dropped mid-stream"] += 1
            else:
                text = checked_reply(client, server.model_id, question, max_tokens, kind == "streamed")
                same = text == references[question]
                counts[f"{kind}, whole, {'as alone' if same else 'not as alone'}"] += 1
                if not same:
                    differing.append(next((i for i, (a, b) in enumerate(zip(text, references[question])) if a != b),
                                          min(len(text), len(references[question]))))
        except openai.RateLimitError:
            counts["rejected (429)"] += 1
        except (AssertionError, openai.APIError, OSError) as error:
            counts[f"{kind}, failed"] += 1
            problems.append(f"{kind}: {type(error).__name__}: {error}")
    return counts, problems, differing


def metrics_gauges(port: int) -> dict[str, float]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def chaos(args, server: "ServeProcess") -> int:
    """The --seconds run: see the module's docstring."""
    pid = server.proc.pid
    mib = 2 ** 20
    client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=600, max_retries=0)
    references = {q: checked_reply(client, server.model_id, q, args.max_tokens, True) for q in QUESTIONS}
    rss: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            rss.append((time.monotonic(), rss_bytes(pid)))
            stop.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    started = time.monotonic()
    sampler.start()
    deadline = started + args.seconds
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        outcomes = list(pool.map(lambda i: chaos_client(server, i, deadline, args.max_tokens, references),
                                 range(args.clients)))
    elapsed = time.monotonic() - started
    stop.set()
    sampler.join()
    gauges = metrics_gauges(server.port)
    settle = time.monotonic() + 10   # the last dropped streams' cancellations land within a step or two
    busy = ("perfx_sequences_running", "perfx_sequences_waiting")
    while any(gauges.get(name) for name in busy) and time.monotonic() < settle:
        time.sleep(0.1)
        gauges = metrics_gauges(server.port)
    counts = sum((c for c, _, _ in outcomes), collections.Counter())
    problems = [p for _, ps, _ in outcomes for p in ps]
    differing = sorted(at for _, _, ats in outcomes for at in ats)
    status = server.stop()

    half = [b for t, b in rss if t >= started + elapsed / 2]
    print(f"# perfx serve, chaos run: {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()} "
          f"({os.cpu_count()} CPUs, {platform.machine()}), model {server.model_id}")
    print(f"command: python benchmarks/serve_load.py {' '.join(sys.argv[1:])}")
    print(f"{plural(args.clients, 'client')} for {elapsed:.1f} s, max_tokens {args.max_tokens}, mix {MIX}:")
    for outcome, count in sorted(counts.items()):
        if count:
            print(f"  {count:6d}  {outcome}")
    if differing:
        print(f"  whole replies not as alone (a batched step and a step of one row may round a near-tie apart: "
              f"benchmarks/NOTES.md), the first character that differs: {differing}")
    print(f"server RSS: {rss[0][1] / mib:.1f} MiB at the start, {rss[-1][1] / mib:.1f} at the end, max "
          f"{max(b for _, b in rss) / mib:.1f}; over the second half {min(half) / mib:.1f}-{max(half) / mib:.1f} MiB "
          f"({len(rss)} samples a second apart)")
    running = gauges.get("perfx_sequences_running", -1)
    waiting = gauges.get("perfx_sequences_waiting", -1)
    print(f"/metrics after: {running:.0f} running, {waiting:.0f} waiting; "
          + ", ".join(f"{k.split('outcome=')[1].strip('}').strip(chr(34))} {v:.0f}"
                      for k, v in gauges.items() if k.startswith("perfx_requests_total")))
    print(f"server exit status after SIGTERM: {status}")
    for problem in problems[:20]:
        print(f"problem: {problem}")
    whole = sum(c for k, c in counts.items() if ", whole," in k)
    ok = status == 0 and not problems and whole > 0 and running == 0 and waiting == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


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
    parser.add_argument("--seconds", type=float,
                        help="the chaos run: each client sends a random mix of whole, dropped and bad requests for "
                             "this long (--requests is then unused)")
    args = parser.parse_args()

    server = ServeProcess(args.model, args.queue, args.ctx, args.parallel)
    if args.seconds:
        try:
            return chaos(args, server)
        finally:
            if server.proc.poll() is None:
                server.stop()
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
