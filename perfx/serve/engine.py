"""The model's side of `perfx serve`: loading it, and the one thread that generates with it.

The only module of `perfx serve` that uses perfx's own model APIs (load_model, generate, SamplingConfig, and
the Conversation that `perfx chat` keeps too), so that they are re-pointed in one place when they move.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from perfx.constrain import Constraint
from perfx.errors import PerfxError
from perfx.generate import Conversation, Result, SamplingConfig, generate, system_prompt_end
from perfx.model import load_model
from perfx.serve.api import FINISH_REASONS, APIError, shutting_down

SHUTDOWN_GRACE_S = 10       # how long stopping waits for the worker, and for answers in flight to be written


def load(name: str | None, device: str | None, ctx: int | None, quantize: str | None, log, tuning: bool = True,
         lm_head: str = "q8", kv: str = "f16", embedding: str = "head"):
    """Load a model for serving (``warm_up`` is next); returns (model, tokenizer, the id clients name it by).

    Raises PerfxError when it cannot be loaded or has no tokenizer.
    """
    model, source = load_model(name, device, ctx, quantize, log=log, tuning=tuning, lm_head=lm_head, kv=kv,
                               embedding=embedding)
    if source.tokenizer is None:
        raise PerfxError(f"{name} has no tokenizer: `perfx serve` needs one (synthetic models are for "
                         "`perfx bench`)")
    return model, source.tokenizer, served_model_id(source)


def warm_up(model, tokenizer, speculator=None):
    """A short chat turn (prefill and one decode step), so the first client's TTFT does not include building
    the kernels (seconds on a phone), and the speculator's step costs measured. What it leaves in the KV
    cache is not counted as cached. Where llguidance is installed, a JSON-mode step too: its tokenizer (built
    once per vocabulary) and the mask kernel are made now, not in the first structured request's time."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True)
    ids = tokenizer.encode(text, add_bos=tokenizer.add_bos_token)
    if speculator is not None:
        speculator.calibrate(model, 0)
    model.prefill(ids, 0)
    model.decode_one(model.argmax(), len(ids))
    try:
        allowed = Constraint.json_object(tokenizer).allowed()
    except PerfxError:
        # no llguidance, or a vocabulary that cannot spell JSON: a request with a JSON response_format gets the
        # error that says so; the server runs on for the others
        model.argmax()
        return
    model.masked_token(allowed, SamplingConfig(temperature=0), 0, ids, len(ids))


def served_model_id(source) -> str:
    """The id clients name the model by: its file or folder name, without .gguf."""
    name = Path(str(source.describe().get("path", "model"))).name
    return name[:-len(".gguf")] if name.endswith(".gguf") else name


@dataclass(eq=False)
class Job:
    """One request's generation: what to run, and the queue its events come back on.

    Events: ("started", None) when it leaves the queue, ("text", piece) as text is made, then
    ("done", Result) or ("error", APIError).
    """
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stop: list[str]
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    started: float | None = None
    first_text: float | None = None
    cached_tokens: int = 0       # prompt ids already in the KV cache (not prefilled again)
    restore_at: tuple = ()       # prompt positions later requests may resume at (the system prompt's end)
    constraint: Constraint | None = None   # the grammar the reply keeps to (response_format, a tool call's)
    logprobs: int | None = None  # None: none; else each reply token's log-probability and this many alternatives
    logit_bias: dict = field(default_factory=dict)   # token id -> added to its logit before each choice
    group: list | None = None    # n > 1: the jobs of the request's choices, this one among them (``submit``)
    result: Result | None = None

    @property
    def finish_reason(self) -> str:
        return FINISH_REASONS.get(self.result.stats.stop_reason, "stop")

    @property
    def cancelled_run(self) -> bool:
        """Whether its generation was stopped by ``cancelled`` (the client went away, or shutdown)."""
        return self.result.stats.stop_reason == "cancelled"

    def usage(self) -> dict:
        """OpenAI's usage counts: the whole prompt (cached ids included, as OpenAI counts them) and the reply."""
        prompt, completion = len(self.prompt_ids), self.result.stats.generated_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def token_logprobs(logits: np.ndarray, token: int, top: int, vocabulary: list[bytes]) -> dict:
    """One reply token's entry: {"token", "logprob", "bytes", "top_logprobs": the ``top`` most likely tokens'}.
    Log-probabilities are the log-softmax of the step's raw logits (temperature 1, no penalty or mask), as
    OpenAI reports them whatever the sampling, computed in float64."""
    row = logits.astype(np.float64)
    peak = row.max()
    logprobs = row - (peak + np.log(np.exp(row - peak).sum()))

    def entry(i: int) -> dict:
        raw = vocabulary[i] if i < len(vocabulary) else b""
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": float(logprobs[i]), "bytes": list(raw)}

    best = np.argpartition(-logprobs, top)[:top] if 0 < top < len(row) else np.arange(len(row) if top else 0)
    best = best[np.argsort(-logprobs[best], kind="stable")]
    return {**entry(token), "top_logprobs": [entry(int(i)) for i in best]}


class Engine:
    """Owns the model: one worker thread runs jobs one at a time, in arrival order, from a bounded queue.

    ``conversation`` holds the ids whose keys and values are in the KV cache; only the worker touches it.
    Everything else is guarded by ``changed``, which is notified on every change.
    """

    def __init__(self, model, tokenizer, queue_limit: int, default_sampling: SamplingConfig, speculator=None):
        self.model, self.tokenizer, self.queue_limit = model, tokenizer, queue_limit
        self.architecture = model.config.architecture   # the family whose tool format its template may use
        self.speculator = speculator    # perfx.speculative.Speculator, or None: one token a step
        self.default_sampling = default_sampling
        self.changed = threading.Condition()
        self.waiting: collections.deque[Job] = collections.deque()
        self.running: Job | None = None
        self.closing = False
        self.counts = collections.Counter({"completed": 0, "cancelled": 0, "failed": 0, "rejected": 0})
        # what finished requests made, for /metrics: prompt and reply ids, and their decode steps' time
        self.totals = collections.Counter({"prompt_tokens": 0, "completion_tokens": 0, "decode_steps": 0,
                                           "decode_seconds": 0.0})
        self.conversation = Conversation(model.resume_point)
        self.vocabulary = tokenizer.token_bytes()
        self.worker = threading.Thread(target=self._work, name="perfx-serve-model", daemon=True)
        self.worker.start()

    def job(self, prompt_ids: list[int], max_tokens: int, sampling: dict, stop: list[str],
            messages: list[dict] | None = None, template: dict | None = None, schema=None,
            grammar: str | None = None, logprobs: int | None = None, logit_bias: dict | None = None,
            choices: int = 1) -> Job:
        """A job for these ids; ``sampling`` holds the SamplingConfig fields a request sets over the defaults.
        ``messages`` (a chat request's, as rendered with the template variables ``template``) give the system
        prompt's end, where a model with recurrent state keeps a restore point for the next requests.
        ``schema``: the JSON schema the reply must follow (``api.response_schema``); ``grammar``: the Lark grammar
        of a reply with tools (``api.plan``). Either is compiled here, in the request's thread, into the reply's
        own constraint: one llguidance does not support is a 400 naming what it lacks. ``logprobs``: the
        reply's tokens come with ("logprobs", entry) events (``token_logprobs``), each before its text.
        ``choices``: how many jobs of these ids the request makes (n); run one after another, each after the
        first resumes one id before the prompt's end (a model with recurrent state keeps a restore point there)."""
        job = Job(prompt_ids, max_tokens, dataclasses.replace(self.default_sampling, **sampling), stop,
                  logprobs=logprobs, logit_bias=dict(logit_bias or {}))
        vocab = self.model.config.vocab_size
        for token in job.logit_bias:
            if token >= vocab:
                raise APIError(400, f"'logit_bias' names token {token}, but the vocabulary's ids end at {vocab - 1}",
                               param="logit_bias", code="invalid_value")
        if job.logit_bias and (schema is not None or grammar is not None):
            raise APIError(400, "'logit_bias' cannot be combined with 'response_format' (JSON) or 'tools': their "
                                "grammar's mask is applied on the device, the biases on the host",
                           param="logit_bias", code="invalid_value")
        if schema is not None:
            try:
                job.constraint = Constraint.from_json_schema(schema, self.tokenizer)
            except PerfxError as error:
                raise APIError(400, f"'response_format': {error}", param="response_format",
                               code="unsupported_schema") from None
        if grammar is not None:
            try:
                job.constraint = Constraint.from_lark(grammar, self.tokenizer)
            except PerfxError as error:
                raise APIError(400, f"'tools': {error}", param="tools", code="unsupported_schema") from None
        if messages and self.model.keeps_restore_points:
            job.restore_at = (system_prompt_end(self.tokenizer, messages, prompt_ids, **(template or {})),)
        if choices > 1 and self.model.keeps_restore_points:
            job.restore_at += (len(prompt_ids) - 1,)
        return job

    @property
    def parallel(self) -> int:
        """Jobs run at once."""
        return 1

    def submit(self, *jobs: Job):
        """Queue jobs (one request's choices, in order, together), or raise APIError: 429 when the queue has no
        room for all of them, 503 while shutting down; 400 when they could never fit."""
        if len(jobs) > 1:
            group = list(jobs)
            for job in jobs:
                job.group = group
        room = self.queue_limit + self.parallel
        if len(jobs) > room:
            raise APIError(400, f"'n' asks for {len(jobs)} choices, but this server runs {self.parallel} and queues "
                                f"{self.queue_limit} at most (--parallel, --queue): ask for at most {room}",
                           param="n", code="invalid_value")
        with self.changed:
            if self.closing:
                raise shutting_down()
            if len(self.waiting) + self.running_count() + len(jobs) > room:
                self.counts["rejected"] += 1
                raise APIError(429, self.busy(), code="queue_full", kind="rate_limit_error")
            self.waiting.extend(jobs)
            self.changed.notify_all()

    def running_count(self) -> int:
        # Called with `changed` held.
        return int(self.running is not None)

    def busy(self) -> str:
        # Called with `changed` held.
        return (f"perfx serve is busy: one request is running and {len(self.waiting)} wait (the queue holds "
                f"{self.queue_limit}); retry later")

    def cancel(self, job: Job):
        """Withdraw a job: a waiting one leaves the queue now, a running one stops before its next token."""
        with self.changed:
            job.cancelled.set()
            if job in self.waiting:
                self.waiting.remove(job)
                self._finish(job, "cancelled")

    def close(self):
        """Refuse new jobs, answer the waiting ones 503, stop the running one, and wait (bounded) for the worker."""
        with self.changed:
            self.closing = True
            while self.waiting:
                job = self.waiting.popleft()
                job.events.put(("error", shutting_down()))
                self._finish(job, "cancelled")
            if self.running is not None:
                self.running.cancelled.set()
            self.changed.notify_all()
        self.worker.join(SHUTDOWN_GRACE_S)

    def stats(self) -> dict:
        """Requests running and waiting, the queue's size, and how many were completed, cancelled, failed and
        rejected (429) so far."""
        with self.changed:
            return self._stats()

    def wait_for(self, predicate, timeout: float) -> bool:
        """Block until ``predicate(self.stats())`` holds; False if it did not within ``timeout`` seconds."""
        with self.changed:
            return self.changed.wait_for(lambda: predicate(self._stats()), timeout)

    def logits_hook(self, job: Job):
        """The ``on_logits`` of ``generate`` that sends a job its tokens' log-probabilities; None without."""
        if job.logprobs is None:
            return None
        eos, vocab = set(self.tokenizer.eos_ids), self.model.config.vocab_size

        def on_logits(token: int, logits: np.ndarray):
            if token not in eos:   # an end-of-generation id is no part of the reply's text
                job.events.put(("logprobs", token_logprobs(logits[:vocab], token, job.logprobs, self.vocabulary)))
        return on_logits

    def _stats(self) -> dict:
        # Called with `changed` held.
        return {"running": int(self.running is not None), "waiting": len(self.waiting),
                "queue_limit": self.queue_limit, **self.counts}

    def metrics(self) -> dict:
        """``stats()`` and the totals of every finished request: prompt and completion tokens, and the decode
        rate of their steps together (decode steps / their seconds; 0 before any)."""
        with self.changed:
            totals = dict(self.totals)
            rate = totals["decode_steps"] / totals["decode_seconds"] if totals["decode_seconds"] else 0.0
            return {**self._stats(), **totals, "decode_tok_s": rate}

    def _finish(self, job: Job, outcome: str):
        # Called with `changed` held. outcome: completed, cancelled or failed.
        self.counts[outcome] += 1
        if job.result is not None:
            stats = job.result.stats
            self.totals["prompt_tokens"] += len(job.prompt_ids)
            self.totals["completion_tokens"] += stats.generated_tokens
            if stats.decode_s and stats.generated_tokens > 1:   # the first token comes from the prefill
                self.totals["decode_steps"] += stats.generated_tokens - 1
                self.totals["decode_seconds"] += stats.decode_s
        job.finished.set()
        self.changed.notify_all()

    def _work(self):
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.waiting or self.closing)
                if not self.waiting:
                    return
                job = self.running = self.waiting.popleft()
                job.started = time.monotonic()
                self.changed.notify_all()
            job.events.put(("started", None))
            outcome = self._run(job)
            with self.changed:
                self.running = None
                self._finish(job, outcome)

    def _run(self, job: Job) -> str:
        ids = job.prompt_ids
        start, todo = self.conversation.resume(ids)
        job.cached_tokens = start

        def on_text(piece: str):
            if job.first_text is None:
                job.first_text = time.monotonic()
            job.events.put(("text", piece))

        try:
            result = generate(self.model, self.tokenizer, todo, job.max_tokens, job.sampling, start_pos=start,
                              stop_strings=job.stop, on_text=on_text, history=ids[:start],
                              should_stop=job.cancelled.is_set, speculator=self.speculator,
                              restore_at=job.restore_at, constraint=job.constraint,
                              on_logits=self.logits_hook(job), logit_bias=job.logit_bias)
        except Exception as error:  # noqa: BLE001  (a failed request must not take the server down)
            self.conversation.forget()  # how far the cache was written is unknown
            message = str(error) if isinstance(error, PerfxError) else f"{type(error).__name__}: {error}"
            if not isinstance(error, PerfxError):
                print(f"perfx serve: generation failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            job.events.put(("error", APIError(500, f"generation failed: {message}", code="generation_failed",
                                              kind="server_error")))
            return "failed"
        self.conversation.record(ids, result)
        job.result = result
        if job.cancelled_run:
            # Cancelled by a client that went away (it reads nothing more) or by shutdown (it learns why).
            job.events.put(("error", shutting_down()))
            return "cancelled"
        job.events.put(("done", result))
        return "completed"
