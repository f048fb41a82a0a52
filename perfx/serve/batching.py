"""`perfx serve --parallel N`: up to N requests decoded together (``perfx.batch``), one weight read a step for all.

The engine's contract is ``Engine``'s (jobs, their events, the queue and its 429s, cancelling, shutdown); only the
worker differs. Each loop it admits waiting jobs into free slots (the slot whose last conversation shares the
longest prefix with the prompt, so a conversation's next turn prefills only its new ids), stops the cancelled,
prefills new prompts in arrival order, ``PREFILL_PIECE`` ids in all while others stream (so their tokens keep
coming, and short prompts join the next step together), the oldest whole when none do, then one decode step over
every sequence that is decoding (those whose prompts just ran included); a sequence leaves the
moment it is done. A prompt starts after the longest prefix of it any slot holds (a shared system prompt),
copied from that slot on the device where it is not its own (``Batch.share``); the choices of one request
(n > 1) run its prompt once: the others take it from that slot (``Sequence.share_prompt``) and decode beside it. Speculation is off while batching: a step
already reads the weights once for N tokens.
"""

from __future__ import annotations

import sys
import time
import traceback

from perfx.batch import Batch, Sequence
from perfx.errors import PerfxError
from perfx.generate import Conversation, common_prefix
from perfx.serve.api import APIError, shutting_down
from perfx.serve.engine import Engine, Job

PARALLEL_DEFAULT = 4     # sequences decoded together by default, where their state fits (``default_parallel``)
STATE_SHARE = 4          # ... their state at most 1/STATE_SHARE of the device's memory
PREFILL_PIECE = 64       # prompt ids prefilled between two decode steps while other sequences stream


def sequence_state_bytes(model) -> int:
    """Device bytes of one more sequence's state: its KV cache, conv rings and recurrent state."""
    r = model.load_report
    return r.get("kv_cache_bytes", 0) + r.get("conv_state_bytes", 0) + r.get("recurrent_state_bytes", 0)


def default_parallel(model) -> int:
    """``PARALLEL_DEFAULT``, or fewer where the state of that many sequences would take more than
    1/``STATE_SHARE`` of the device's memory (at least 1); 1 where a layer kind of the model cannot be batched
    (``Mixer.decodes_rows``). A CPU device batches too: its decode is bound by arithmetic rather than by reading
    the weights, so a step of 4 rows costs about half of 4 steps of one there, not one step, yet 4 clients still
    get about twice one client's rate, where one at a time they would wait for each other's whole replies; one
    client alone loses the speculation of ``--parallel 1`` (about 8% on the default model: benchmarks/NOTES.md)."""
    if not all(mixer.decodes_rows() for mixer in model.mixers):
        return 1
    per = max(sequence_state_bytes(model), 1)
    room = model.device.caps.global_mem // STATE_SHARE
    return max(1, min(PARALLEL_DEFAULT, room // per))


def warm_up_batch(batch: Batch) -> None:
    """One step of every row count the batch runs, so a request's first batched step does not build kernels: each
    slot holds a token at position 0 first. What it leaves in the slots is not counted as cached."""
    for slot in range(batch.slots):
        batch.prefill(slot, [0], 0)
    for n in range(2, batch.slots + 1):
        batch.step([(slot, 0) for slot in range(n)])
        for slot in range(n):
            batch.prefill(slot, [0], 0)


class BatchEngine(Engine):
    """``Engine`` with up to ``parallel`` jobs running at once, decoded together."""

    def __init__(self, model, tokenizer, queue_limit: int, default_sampling, parallel: int):
        self.batch = Batch(model, parallel)
        warm_up_batch(self.batch)
        self.conversations = [Conversation(lambda pos, slot=slot: self.batch.resume_point(slot, pos))
                              for slot in range(parallel)]
        self.active: dict[int, Job] = {}           # slot -> its job; changed under ``changed``
        self.sequences: dict[int, Sequence] = {}   # slot -> its generation; the worker's only
        self.sharing: dict[int, int] = {}          # slot -> the slot of another choice whose prompt run it waits for
        super().__init__(model, tokenizer, queue_limit, default_sampling)

    @property
    def parallel(self) -> int:
        return self.batch.slots

    def running_count(self) -> int:
        # Called with `changed` held.
        return len(self.active)

    def busy(self) -> str:
        # Called with `changed` held.
        return (f"perfx serve is busy: {len(self.active)} requests are running (--parallel {self.parallel}) and "
                f"{len(self.waiting)} wait (the queue holds {self.queue_limit}); retry later")

    def close(self):
        """As ``Engine.close``, every running job stopped."""
        with self.changed:
            for job in self.active.values():
                job.cancelled.set()
        super().close()

    def _stats(self) -> dict:
        # Called with `changed` held.
        return {"running": len(self.active), "waiting": len(self.waiting), "queue_limit": self.queue_limit,
                "parallel": self.parallel, **self.counts}

    # -- the worker ---------------------------------------------------------------------------------------

    def _work(self):
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.waiting or self.closing or self.active)
                if self.closing:
                    for job in self.active.values():
                        job.cancelled.set()
                if not self.waiting and not self.active:
                    return
                admitted = self._admit()
            for slot, job in admitted:
                job.events.put(("started", None))
                self._begin(slot, job)
            self._advance()
            self._retire()

    def _admit(self) -> list[tuple[int, Job]]:
        """Waiting jobs into free slots, in arrival order, each into the free slot whose cache shares the longest
        prefix with its prompt. Called with ``changed`` held."""
        admitted = []
        while self.waiting and len(self.active) < self.parallel:
            job = self.waiting.popleft()
            free = [slot for slot in range(self.parallel) if slot not in self.active]
            slot = max(free, key=lambda s: common_prefix(self.conversations[s].cached, job.prompt_ids))
            job.started = time.monotonic()
            self.active[slot] = job
            admitted.append((slot, job))
        if admitted:
            self.changed.notify_all()
        return admitted

    def _begin(self, slot: int, job: Job) -> None:
        ids = job.prompt_ids
        start, todo = self.conversations[slot].resume(ids)
        sibling = self._sibling(slot, job)

        def on_text(piece: str):
            if job.first_text is None:
                job.first_text = time.monotonic()
            job.events.put(("text", piece))

        try:
            if sibling is None:
                start = self._borrow(slot, ids, start)
                todo = ids[start:]
            job.cached_tokens = start
            seq = self.sequences[slot] = Sequence(self.batch, slot, self.tokenizer, todo, start, job.max_tokens,
                                                  job.sampling, job.stop, on_text, history=ids[:start],
                                                  constraint=job.constraint, on_logits=self.logits_hook(job),
                                                  logit_bias=job.logit_bias)
        except Exception as error:  # noqa: BLE001  (a failed request must not take the server down)
            self._fail([slot], error)
            return
        if sibling is not None:
            other, ready = sibling
            if not ready:
                self.sharing[slot] = other
                return
            job.cached_tokens = seq.prompt_end
            self._try(slot, lambda: seq.share_prompt(self.sequences[other]))

    def _sibling(self, slot: int, job: Job) -> tuple[int, bool] | None:
        """Another choice of the same request (n > 1) to take the prompt from, copied on the device: (its slot,
        True) where it has run the prompt and its slot still holds the state there; (the slot whose run to wait
        for, False) while one is still running it; None: this one runs the prompt itself."""
        if job.group is None:
            return None
        siblings = [(other, self.sequences[other]) for other, running in self.active.items()
                    if other != slot and running.group is job.group and other in self.sequences]
        end = len(job.prompt_ids)
        for other, sibling in siblings:
            if sibling.prompt_logits is not None and self.batch.can_share(other, end):
                return other, True
        for other, sibling in siblings:
            if not sibling.done and not sibling.decoding:
                return self.sharing.get(other, other), False
        return None

    def _borrow(self, slot: int, ids: list[int], start: int) -> int:
        """Where the prompt ``ids`` starts in ``slot``: after what its own cache holds of it (``start``), or after
        a longer prefix that another slot holds (a shared system prompt; a conversation another slot ran), copied
        from there on the device (``Batch.share``) instead of prefilled. One id is always left to run, for the
        first token's logits."""
        donor, length = None, start
        for other in range(self.parallel):
            if other == slot:
                continue
            # a running sequence's own ids before the next position it runs (its slot holds older ones past
            # them until it gets there), else what the slot's last conversation left
            seq = self.sequences.get(other)
            held = seq.seen[:seq.pos] if seq is not None else self.conversations[other].cached
            shared = common_prefix(held, ids[:-1])
            if shared > length and self.batch.can_share(other, shared):
                donor, length = other, shared
        if donor is None:
            return start
        self.batch.share(donor, slot, length)
        self.conversations[slot].cached = list(ids[:length])
        return length

    def _release(self, gone: set[int]) -> None:
        """The choices waiting for a prompt that will not run in the ``gone`` slots (failed, cancelled before it
        ran): the first runs it itself, the others wait for that one."""
        orphans = [slot for slot, source in self.sharing.items() if source in gone and slot not in gone]
        for slot in gone | set(orphans):
            self.sharing.pop(slot, None)
        for slot in orphans[1:]:
            self.sharing[slot] = orphans[0]

    def _try(self, slot: int, action) -> bool:
        try:
            action()
            return True
        except Exception as error:  # noqa: BLE001  (a failed request must not take the server down)
            self._fail([slot], error)
            return False

    def _advance(self) -> None:
        """Stop the cancelled, run pieces of the prompts still to prefill (each then given to the choices waiting
        for it), then one decode step over every sequence decoding, those whose prompts just ran included."""
        for slot, seq in self.sequences.items():
            if self.active[slot].cancelled.is_set():
                seq.cancel()
        self._release({source for source in self.sharing.values()
                       if source not in self.sequences or self.sequences[source].done})
        decoding = [(slot, seq) for slot, seq in self.sequences.items() if seq.decoding]
        prefilling = [slot for slot, seq in self.sequences.items()
                      if not seq.done and not seq.decoding and slot not in self.sharing]
        # PREFILL_PIECE prompt ids between two steps, shared by the new prompts in arrival order (several short ones
        # join the next step together, rather than one a step); with no stream running, the oldest prompt whole.
        budget = PREFILL_PIECE if decoding else None
        for slot in prefilling:
            if budget is not None and budget <= 0:
                break
            seq = self.sequences[slot]
            ran = len(seq.todo) if budget is None else min(budget, len(seq.todo))
            if self._try(slot, lambda: seq.prefill_piece(budget)) and seq.prompt_logits is not None:
                for waiting in [other for other, source in self.sharing.items() if source == slot]:
                    del self.sharing[waiting]
                    if self.sequences[waiting].done:   # cancelled while it waited
                        continue
                    self.active[waiting].cached_tokens = seq.prompt_end
                    self._try(waiting, lambda waiting=waiting: self.sequences[waiting].share_prompt(seq))
            budget = (PREFILL_PIECE if budget is None else budget) - ran
        decoding = [(slot, seq) for slot, seq in self.sequences.items() if seq.decoding]
        if not decoding:
            return
        try:
            logits = self.batch.step([(slot, seq.token) for slot, seq in decoding])
        except Exception as error:  # noqa: BLE001
            self._fail([slot for slot, _ in decoding], error)
            return
        for (slot, seq), row in zip(decoding, logits):
            seq.take(row)

    def _retire(self) -> None:
        """Every finished sequence leaves its slot now; its job gets its result."""
        for slot, seq in list(self.sequences.items()):
            if not seq.done:
                continue
            job = self.active[slot]
            del self.sequences[slot]
            self.sharing.pop(slot, None)
            result = seq.result()
            self.conversations[slot].record(job.prompt_ids, result)
            job.result = result
            if job.cancelled_run:
                job.events.put(("error", shutting_down()))
                outcome = "cancelled"
            else:
                job.events.put(("done", result))
                outcome = "completed"
            with self.changed:
                del self.active[slot]
                self._finish(job, outcome)

    def _fail(self, slots: list[int], error: Exception) -> None:
        """The jobs in ``slots`` failed (500); what their slots hold is forgotten, as how far it was written is
        unknown."""
        message = str(error) if isinstance(error, PerfxError) else f"{type(error).__name__}: {error}"
        if not isinstance(error, PerfxError):
            print(f"perfx serve: generation failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        self._release(set(slots))
        for slot in slots:
            self.sequences.pop(slot, None)
            self.conversations[slot].forget()
            job = self.active[slot]
            job.events.put(("error", APIError(500, f"generation failed: {message}", code="generation_failed",
                                              kind="server_error")))
            with self.changed:
                del self.active[slot]
                self._finish(job, "failed")
