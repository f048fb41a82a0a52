"""`perfx serve`: an OpenAI-compatible HTTP server for one model on one device (``perfx.serve``)."""

from __future__ import annotations

import signal
import threading

from perfx.commands.options import (add_model_options, add_sampling_options, add_speculation_options, log,
                                    sampling_config, speculator_from_args)
from perfx.errors import PerfxError
from perfx.runtime import show_build_logs
from perfx.serve.batching import PARALLEL_DEFAULT, STATE_SHARE, BatchEngine, default_parallel
from perfx.serve.engine import Engine, load, warm_up
from perfx.serve.server import Server, ServeOptions

DESCRIPTION = """\
Serve a model over HTTP with OpenAI's API, so any OpenAI client library or app can use it:
GET /v1/models, POST /v1/chat/completions and POST /v1/completions (streamed or not), GET /health.
Up to --parallel requests are decoded together, each step reading the weights once for all of
them; a request joins at the next step and leaves when it is done. Up to --queue more wait, in
arrival order, and beyond that they get 429. Continuing a conversation prefills only its new
tokens (each sequence's KV cache keeps its last prompt and reply). The sampling options and --max-tokens are the defaults for requests that do not set
their own; requests may also set perfx's top_k, min_p and repetition_penalty.

examples:
  perfx serve                                   # the default model on http://127.0.0.1:8080/v1
  perfx serve --model m.gguf --ctx 2048 --port 9000 --api-key s3cret
  perfx serve --parallel 8                      # 8 requests decoded together (1: one at a time)
  curl http://127.0.0.1:8080/v1/models          # the model id to send
  curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hi"}]}'
  (add "stream": true for server-sent events, and curl -N to see them as they come)
  (add "response_format": {"type": "json_object"}, or a json_schema, for replies that are always valid JSON)

Ctrl-C or SIGTERM stops the server: new requests get 503, the running ones are stopped."""


def add_arguments(parser):
    """The options of `perfx serve`: model, sampling defaults, address, key, queue."""
    add_model_options(parser)
    add_sampling_options(parser)
    add_speculation_options(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default %(default)s: this device only; 0.0.0.0 opens it to "
                             "the network, so set --api-key too)")
    parser.add_argument("--port", type=int, default=8080, help="TCP port (default %(default)s; 0 picks a free one)")
    parser.add_argument("--api-key", metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1 requests (/health stays open)")
    parser.add_argument("--queue", type=int, default=16, metavar="N",
                        help="requests that may wait while --parallel run; more get 429 (default %(default)s)")
    parser.add_argument("--parallel", default="auto", metavar="N",
                        help=f"requests decoded together, one step reading the weights once for all (each has "
                             f"a KV cache of its own); 1 runs them one at a time, with speculation. Default auto: "
                             f"{PARALLEL_DEFAULT}, or fewer where {PARALLEL_DEFAULT} KV caches would take more than "
                             f"1/{STATE_SHARE} of the device's memory; 1 where --speculate or --draft asks for "
                             f"speculation, which is off with N > 1, or where a layer kind of the model cannot be "
                             f"batched yet. On a CPU a step of 4 rows costs about half of 4 steps (bound by "
                             f"arithmetic, not memory): 4 clients get about 2x one's rate, one client alone a little "
                             f"less than with --parallel 1")


def main(args) -> int:
    """Load the model, serve until SIGINT or SIGTERM, then stop cleanly (exit status 0).

    Raises PerfxError for bad option values, a model that cannot be loaded or an address in use.
    """
    sampling = sampling_config(args)
    if args.queue < 0:
        raise PerfxError(f"--queue must be ≥ 0, got {args.queue}")
    if not 0 <= args.port <= 65535:
        raise PerfxError(f"--port must be between 0 and 65535, got {args.port}")
    if args.verbose:
        show_build_logs()
    parallel = parse_parallel(args.parallel)
    speculating = args.draft or args.speculate not in ("auto", "off")
    if speculating and parallel not in (None, 1):
        raise PerfxError(f"speculation (--speculate {args.speculate}{', --draft' if args.draft else ''}) runs with "
                         f"--parallel 1 only: a batched step already reads the weights once for every sequence")
    if speculating:
        parallel = 1   # auto: the speculation asked for
    model, tokenizer, model_id = load(args.model, args.device, args.ctx, args.quantize, log, not args.no_tuning,
                                      args.lm_head, args.kv, args.embedding)
    parallel = default_parallel(model) if parallel is None else parallel
    speculator = speculator_from_args(args, model, tokenizer, log=log) if parallel == 1 else None
    log("perfx serve: warming up (the kernels are built once, before the first request)")
    warm_up(model, tokenizer, speculator)
    if parallel == 1:
        engine = Engine(model, tokenizer, args.queue, sampling, speculator)
    else:
        engine = BatchEngine(model, tokenizer, args.queue, sampling, parallel)
        log(f"perfx serve: {parallel} sequences decoded together: their state takes "
            f"{engine.batch.state_bytes / 2**20:.0f} MiB more of the device's memory (--parallel 1: none)")
    options = ServeOptions(model_id, args.max_tokens, args.api_key, args.verbose, log)
    try:
        server = Server((args.host, args.port), engine, options)
    except OSError as error:
        engine.close()
        raise PerfxError(f"cannot listen on {args.host}:{args.port}: {error.strerror or error}") from None

    stop = threading.Event()

    def request_stop(signum, frame):
        stop.set()
        # A second Ctrl-C or SIGTERM while stopping ends the process at once.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    # serve_forever runs in a thread: shutdown() called from a signal handler in the thread that runs it
    # would wait for itself.
    accepting = threading.Thread(target=server.serve_forever, name="perfx-serve-accept", daemon=True)
    accepting.start()
    host, port = server.server_address[:2]
    host = f"[{host}]" if ":" in host else host
    log(f"perfx serve: {model_id} on http://{host}:{port}/v1 (context {model.max_positions} positions, "
        f"{parallel} decoded together, queue {args.queue}); Ctrl-C stops")
    if not args.api_key and not is_loopback(args.host):
        log(f"perfx serve: warning: listening on {args.host} without --api-key: anyone who can reach this "
            "device can use the model")
    stop.wait()
    log("perfx serve: stopping: new requests get 503, the running ones are stopped")
    server.stop()
    accepting.join()   # serve_forever has returned: no thread of the server is left holding the model
    counts = engine.stats()
    log("perfx serve: stopped (" + ", ".join(f"{counts[name]} {name}" for name in engine.counts) + ")")
    return 0


def parse_parallel(value: str) -> int | None:
    """--parallel's value: a count of at least 1, or None for auto."""
    if value == "auto":
        return None
    try:
        parallel = int(value)
    except ValueError:
        parallel = 0
    if parallel < 1:
        raise PerfxError(f"--parallel must be a whole number ≥ 1 or auto, got {value!r}")
    return parallel


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
