"""The HTTP side of `perfx serve`, on the standard library's ThreadingHTTPServer.

Each connection has a thread (``Handler``): it reads and checks the request, renders the prompt, hands a job
to the engine and writes what comes back, as JSON or as server-sent events (one HTTP chunk each). HTTP/1.1
keep-alive: every answer carries a Content-Length or is chunked, and a request's body is always read whole,
so a refused request cannot be mistaken for the connection's next one. A client that has gone is noticed
before each write and while waiting (a closed socket reads as end-of-file), and its job is cancelled.
"""

from __future__ import annotations

import hmac
import itertools
import json
import queue
import select
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from perfx.serve.api import (APIError, Answer, Tooling, chat_prompt, check_fits, common_parameters, parse_json,
                             response_schema, text_prompt)
from perfx.serve.engine import SHUTDOWN_GRACE_S, Engine, Job

MAX_BODY_BYTES = 8 << 20
CLIENT_CHECK_S = 0.25       # how often a request that waits for the model checks its client is still there
IDLE_CONNECTION_S = 60      # a keep-alive connection with no new request for this long is closed
PATHS = {"/health": "GET", "/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST"}


class ClientGone(Exception):
    """The client closed its connection: nothing more can be written to it."""


@dataclass
class ServeOptions:
    model_id: str
    default_max_tokens: int
    api_key: str | None = None
    verbose: bool = False
    log: Callable[[str], None] = print     # receives one line per request


class Server(ThreadingHTTPServer):
    """The listening socket and what every connection thread shares."""

    daemon_threads = True   # an idle keep-alive connection must not keep a stopping server alive

    def __init__(self, address: tuple[str, int], engine: Engine, options: ServeOptions):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, Handler)
        self.engine, self.options = engine, options
        self.created = int(time.time())
        self.numbers = itertools.count(1)
        self.in_flight = 0                       # requests between parsing and their last byte
        self.stopping = False
        self.idle = threading.Condition()

    def handle_error(self, request, client_address):
        """An exception that escaped a connection's thread: one line, never a traceback on the console (a
        connection that breaks while the server stops, or a client gone mid-request, is no news at all)."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)) or (isinstance(error, OSError) and self.stopping):
            return
        self.options.log(f"perfx serve: a connection from {client_address[0]} failed: "
                         f"{type(error).__name__}: {error}")
        if self.options.verbose:
            self.options.log(traceback.format_exc().rstrip())

    def stop(self):
        """Stop accepting, answer or stop every request, and wait (bounded) until their answers are written.

        serve_forever must be running in another thread.
        """
        self.stopping = True
        self.shutdown()
        self.engine.close()
        with self.idle:
            self.idle.wait_for(lambda: self.in_flight == 0, SHUTDOWN_GRACE_S)
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive; every answer carries Content-Length or is chunked
    server_version, sys_version = "perfx-serve", ""
    timeout = IDLE_CONNECTION_S
    server: Server

    def do_GET(self):
        self.serve_request()

    def do_POST(self):
        self.serve_request()

    def serve_request(self):
        self.reset_request_state()
        started = time.monotonic()
        with self.server.idle:
            self.server.in_flight += 1
        try:
            self.route()
        except APIError as error:
            self.note = error.code or ""
            self.send_json(error.status, error.body())
        except ClientGone:
            self.close_connection = True
            self.note = "client gone"
        except Exception:  # noqa: BLE001  (a bug in one request must not take the server down)
            self.log_text(f"perfx serve: internal error:\n{traceback.format_exc()}")
            self.close_connection = True
            self.send_json(500, APIError(500, "internal error in perfx serve (see its log)", code="internal_error",
                                         kind="server_error").body())
        finally:
            try:
                self.log_line(time.monotonic() - started)
            finally:
                with self.server.idle:
                    self.server.in_flight -= 1
                    self.server.idle.notify_all()

    def reset_request_state(self):
        # One handler serves every request of a keep-alive connection: nothing may leak into the next one.
        self.status, self.note, self.job, self.headers_sent = 0, "", None, False
        self.prompt_text = self.reply_text = ""
        self.tool_calls = 0

    def route(self):
        # Read first, whatever the answer: a body left unread would be taken for the connection's next request.
        body = self.read_body()
        path = self.path.split("?", 1)[0]
        expected = "GET" if path.startswith("/v1/models/") else PATHS.get(path)
        if expected is None:
            raise APIError(404, f"Invalid URL ({self.command} {path}): perfx serve answers "
                                f"{', '.join(PATHS)} and /v1/models/ID", code="not_found")
        if self.command != expected:
            raise APIError(405, f"{path} takes {expected}, not {self.command}", code="method_not_allowed")
        if path == "/health":
            return self.health()
        self.check_key()
        model_id = self.server.options.model_id
        if path == "/v1/models":
            return self.send_json(200, {"object": "list", "data": [self.model_card()]})
        if path.startswith("/v1/models/"):
            if path[len("/v1/models/"):] != model_id:
                raise APIError(404, f"The model '{path[len('/v1/models/'):]}' does not exist here: this server "
                                    f"runs '{model_id}'", code="model_not_found")
            return self.send_json(200, self.model_card())
        self.complete(parse_json(body), chat=path == "/v1/chat/completions")

    # -- endpoints ------------------------------------------------------------------------------------

    def health(self):
        engine = self.server.engine
        stats = engine.stats()
        if engine.closing:
            return self.send_json(503, {"status": "shutting down", **stats})
        self.send_json(200, {"status": "ok", "model": self.server.options.model_id, **stats})

    def model_card(self) -> dict:
        return {"id": self.server.options.model_id, "object": "model", "created": self.server.created,
                "owned_by": "perfx", "context_length": self.server.engine.model.max_positions}

    def complete(self, body: dict, chat: bool):
        options, engine = self.server.options, self.server.engine
        request = common_parameters(body, options.model_id)
        messages = variables = tooling = None
        if chat:
            ids, messages, variables, tooling = chat_prompt(body, engine.tokenizer, engine.architecture)
            self.prompt_text = json.dumps(messages, ensure_ascii=False)
        else:
            ids = text_prompt(body, engine.tokenizer)
            self.prompt_text = json.dumps(body.get("prompt"), ensure_ascii=False)
        check_fits(ids, engine.model.max_positions, "messages" if chat else "prompt")
        self.job = job = engine.job(ids, request.max_tokens or options.default_max_tokens, request.sampling,
                                    request.stop, messages, variables, schema=response_schema(body),
                                    grammar=tooling.grammar if tooling else None)
        engine.submit(job)
        answer = Answer(chat, options.model_id, created=int(time.time()))
        try:
            if request.stream:
                self.stream(job, answer, request.include_usage, tooling)
            else:
                pieces = []
                for kind, value in self.events(job):
                    if kind == "text":
                        pieces.append(value)
                    elif kind == "error":
                        raise value
                self.reply_text = "".join(pieces)
                content, calls = tooling.read(self.reply_text) if tooling else (self.reply_text, [])
                self.tool_calls = len(calls)
                finish = "tool_calls" if calls else job.finish_reason
                self.send_json(200, answer.whole(content, finish, job.usage(), calls))
        finally:
            if not job.finished.is_set():
                engine.cancel(job)
                # A running job stops at its next piece of text: wait for it (briefly), so the log line
                # has its counts and the next request starts on a settled cache.
                job.finished.wait(SHUTDOWN_GRACE_S)

    def stream(self, job: Job, answer: Answer, include_usage: bool, tooling: Tooling | None = None):
        pieces = []
        parser = tooling.parser() if tooling else None
        calls = 0

        def send_parsed(events):
            # content as it comes; each call whole, as one delta (OpenAI's clients join its pieces either way)
            nonlocal calls
            for kind, value in events:
                if kind == "content":
                    self.send_event(answer.chunk({"content": value}, include_usage))
                elif tooling.parallel or not calls:
                    self.send_event(answer.chunk({"tool_calls": [{"index": calls, **value.as_openai()}]},
                                                 include_usage))
                    calls += 1
                    self.tool_calls = calls

        for kind, value in self.events(job):
            if kind == "started":
                # Headers go out when the job leaves the queue: until then an error (503 at shutdown) can
                # still be an ordinary HTTP status.
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream; charset=utf-8")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.headers_sent = True
                if answer.chat:
                    self.send_event(answer.chunk({"role": "assistant", "content": ""}, include_usage))
            elif kind == "text":
                pieces.append(value)
                if parser is not None:
                    send_parsed(parser.feed(value))
                else:
                    self.send_event(answer.chunk({"content": value} if answer.chat else value, include_usage))
            elif kind == "error":
                if not self.headers_sent:
                    raise value
                self.note = value.code or ""
                self.send_event(value.body())  # OpenAI's clients raise this as an APIError
                self.end_chunks()
            elif kind == "done":
                self.reply_text = "".join(pieces)
                if parser is not None:
                    send_parsed(parser.finish())
                finish = "tool_calls" if calls else job.finish_reason
                self.send_event(answer.chunk({} if answer.chat else "", include_usage, finish))
                if include_usage:
                    self.send_event(answer.usage_chunk(job.usage()))
                self.send_event("[DONE]")
                self.end_chunks()

    # -- the connection -----------------------------------------------------------------------------

    def events(self, job: Job):
        """The job's events as they come, until done or error; raises ClientGone once the client has gone
        (checked every CLIENT_CHECK_S, whether events come or not: a non-streamed answer writes nothing
        until the end)."""
        next_check = time.monotonic() + CLIENT_CHECK_S
        while True:
            try:
                kind, value = job.events.get(timeout=CLIENT_CHECK_S)
            except queue.Empty:
                kind = None
            if time.monotonic() >= next_check:
                if self.client_gone():
                    raise ClientGone
                next_check = time.monotonic() + CLIENT_CHECK_S
            if kind is None:
                continue
            yield kind, value
            if kind in ("done", "error"):
                return

    def client_gone(self) -> bool:
        """True when the client has closed its end: the socket reads as end-of-file (peeked, nothing consumed).

        A client that only half-closes (shuts down writing, still reads) looks gone too; HTTP clients do not.
        """
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def check_key(self):
        key = self.server.options.api_key
        if key is None:
            return
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY' with the key "
                                "perfx serve was started with (--api-key)", code="invalid_api_key")

    def read_body(self) -> bytes | None:
        """The request's body, read whole (None when it has none)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise APIError(411, "send the body with a Content-Length (chunked request bodies are not read)",
                           code="length_required")
        length = self.headers.get("Content-Length")
        if length is None:
            return None
        if not length.strip().isdigit():
            self.close_connection = True
            raise APIError(400, f"Content-Length {length!r} is not a number of bytes", code="invalid_body")
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True  # the body stays unread: the connection cannot carry another request
            raise APIError(413, f"the body is {int(length)} bytes; perfx serve reads at most {MAX_BODY_BYTES}",
                           code="body_too_large")
        raw = self.rfile.read(int(length))
        if len(raw) < int(length):
            raise ClientGone
        return raw

    def send_json(self, status: int, document: dict):
        if self.headers_sent:
            return  # a stream already under way: its own error event was sent, or the client is gone
        data = json.dumps(document, ensure_ascii=False).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status in (429, 503):
                self.send_header("Retry-After", "1")
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.headers_sent = True
            self.wfile.write(data)
        except OSError:
            self.close_connection = True
            self.note = "client gone"

    def send_event(self, data):
        """One server-sent event (``data: ...``), as one HTTP chunk."""
        text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        self.write_chunk(f"data: {text}\n\n".encode())

    def write_chunk(self, payload: bytes):
        # Checked first: a write to a socket whose peer has closed usually succeeds once more.
        if self.client_gone():
            raise ClientGone
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
        except OSError:
            raise ClientGone from None

    def end_chunks(self):
        try:
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            raise ClientGone from None

    def send_response(self, code, message=None):
        self.status = code
        super().send_response(code, message)

    def send_error(self, code, message=None, explain=None):
        # http.server's own refusals (a malformed request line, an unknown method, headers too long), in JSON.
        self.reset_request_state()
        self.close_connection = True
        # http.server takes an unreadable request line for HTTP/0.9, which has no status line or headers.
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"
        self.send_json(code, APIError(code, message or HTTPStatus(code).phrase, code="bad_request").body())
        self.log_line(0.0)

    # -- logging ------------------------------------------------------------------------------------

    def log_message(self, format, *args):
        pass  # one line per request comes from log_line; http.server's own would repeat it

    def log_text(self, text: str):
        self.server.options.log(text)

    def log_line(self, seconds: float):
        """One line per request: number, method, path, status, token counts and timings; text only with -v."""
        number = next(self.server.numbers)
        path = (getattr(self, "path", None) or "-").split("?", 1)[0]
        parts = [f"perfx serve: #{number} {self.command or '-'} {path} {self.status or '-'}"]
        job = self.job
        if job is not None:
            parts.append(f"prompt {len(job.prompt_ids)} ({job.cached_tokens} cached)")
            if job.result is not None:
                reason = "cancelled" if job.cancelled_run else job.finish_reason
                parts.append(f"completion {job.result.stats.generated_tokens} ({reason})")
                if self.tool_calls:
                    parts.append(f"{self.tool_calls} tool call{'s' if self.tool_calls > 1 else ''}")
                if job.result.stats.speculation:
                    parts.append(job.result.stats.speculation_line())
            if job.started is not None:
                parts.append(f"wait {job.started - job.submitted:.2f} s")
            if job.first_text is not None:
                parts.append(f"TTFT {job.first_text - job.submitted:.2f} s")
        parts.append(f"total {seconds:.2f} s")
        if self.note:
            parts.append(self.note)
        self.log_text(", ".join(parts))
        if self.server.options.verbose and job is not None:
            self.log_text(f"  prompt: {self.prompt_text}")
            self.log_text(f"  reply: {json.dumps(self.reply_text, ensure_ascii=False)}")
