"""Continuous batching: several sequences decoded together, one step of N rows that reads each weight once.

Decode is bound by reading the weights: a step over N rows (one a sequence) runs every matrix as the prompt
GEMM over M = N rows, so N sequences cost about one weight read a step instead of N. What mixes positions runs
row by row on each row's own sequence: its token at its own position, read on the device, over its own KV cache,
conv rings and recurrent state (``perfx.mixers.Mixer.forward_rows``).

``Batch(model, slots)`` gives each of ``slots`` sequences its own state (the model's own is slot 0's; the others
are made as the load made it: ``Mixer.new_state``). ``prefill(slot, ids, start)`` runs a prompt into a slot, in
as many pieces as its caller likes (so other sequences keep decoding between them); ``step([(slot, token),
...])`` feeds each listed sequence's token at its next position and returns each row's logits. ``Sequence`` is
one request's generation over a batch, as ``perfx.generate.generate`` is over a model alone: the same sampler,
the same stops, the same result, so a request answers the same batched or alone (greedy: up to near-ties, since
the GEMM over N rows sums in another order than the GEMV of one).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from perfx.errors import PerfxError
from perfx.generate import Result, Sampler, SamplingConfig, Stats, StopMatcher
from perfx.mixers import Rows
from perfx.reference import logit_mask
from perfx.reference import sample as sample_token

MAX_RECORDINGS = 256   # recorded steps kept (one per set of slots and partition counts met); past it, made again


class Batch:
    """``slots`` sequences of one model, each with its own state, decoded together by ``step``."""

    def __init__(self, model, slots: int):
        if not 1 <= slots <= model.state.chunk:
            raise PerfxError(f"--parallel must be between 1 and {model.state.chunk} (the rows of a prefill chunk), "
                             f"got {slots}")
        unbatched = [mixer.kind for mixer in model.mixers if not mixer.decodes_rows()]
        if unbatched:
            raise PerfxError(f"this model's {', '.join(unbatched)} layers cannot decode several sequences together "
                             "yet: use --parallel 1")
        self.model, self.slots = model, slots
        mixers = model.mixers
        self.states = ([{mixer: mixer.own_state() for mixer in mixers}]
                       + [{mixer: mixer.new_state() for mixer in mixers} for _ in range(slots - 1)])
        self.written = [0] * slots     # per slot: positions 0..written−1 are in its state
        self.ids = model.device.empty(2 * slots, np.int32)   # a step's token ids, then their positions
        self._upload = None
        self._replays: dict[tuple, object] = {}   # (slots, partitions of each row) -> the step's recorded launches
        self.logits = model.device.empty((slots, model.config.vocab_size), np.float32)   # a step's rows' logits
        # slot 0 is the model's own state from now on: what the model held is not kept
        model.written = 0
        if model.restore_points is not None:
            model.restore_points.clear()

    @property
    def state_bytes(self) -> int:
        """Device bytes of the state of the sequences past the first (the first's is the model's own)."""
        return sum(_nbytes(obj) for state in self.states[1:] for fields in state.values() for obj in fields.values())

    @contextmanager
    def bound(self, slot: int):
        """The model's forward runs on ``slot``'s state inside the block (its mixers hold it, ``written`` is the
        slot's); restore points are not kept for a slot (a slot resumes at its live state only)."""
        self._check_slot(slot)
        model = self.model
        saved = model.written, model.restore_points
        model.written, model.restore_points = self.written[slot], None
        for mixer in model.mixers:
            mixer.bind(self.states[slot][mixer])
        try:
            yield
        finally:
            self.written[slot] = model.written
            for mixer in model.mixers:
                mixer.bind(self.states[0][mixer])
            model.written, model.restore_points = saved

    def resume_point(self, slot: int, pos: int) -> int:
        """The latest position at or before ``pos`` where ``slot``'s state serves a forward as it is (0 at worst):
        the prefix of its last sequence a new prompt reuses."""
        with self.bound(slot):
            return pos if self.model.can_resume(pos) else 0

    def can_share(self, slot: int, positions: int) -> bool:
        """Whether ``slot``'s state at ``positions`` may be copied into another slot (``share``): a KV cache holds
        every position it has run; a conv ring its last ones; a recurrent state only the last position run."""
        with self.bound(slot):
            return positions >= 1 and self.model.can_resume(positions)

    def share(self, src: int, dst: int, positions: int) -> None:
        """Give slot ``dst`` slot ``src``'s positions 0..positions−1 without running them: each layer's state there
        copied on the device (``Mixer.copy_state``), so a sequence that starts with the same ids (another choice
        of one prompt) continues at ``positions`` in ``dst``. What ``dst`` held is replaced."""
        self._check_slot(src)
        self._check_slot(dst)
        if src == dst:
            raise PerfxError(f"slot {src} cannot share its state with itself")
        if not self.can_share(src, positions):
            raise PerfxError(f"slot {src} does not hold its state at position {positions} (positions "
                             f"0..{self.written[src] - 1} were run): run the prompt in slot {dst} instead")
        for mixer in self.model.mixers:
            mixer.copy_state(self.states[src][mixer], self.states[dst][mixer], positions)
        self.written[dst] = positions

    def prefill(self, slot: int, tokens: list[int], start: int, logits: bool = True) -> np.ndarray | None:
        """Run ``tokens`` at positions start.. of ``slot`` (its state before ``start`` is reused, from 0 it starts
        afresh); the last position's logits (V) where ``logits``, else None (a piece of a longer prompt)."""
        model = self.model
        with self.bound(slot):
            if not model.can_resume(start):
                raise PerfxError(f"slot {slot}: position {start} cannot be resumed (positions 0..{model.written - 1} "
                                 "were run); prefill from its last position or from 0")
            if start == 0:
                for mixer in model.mixers:
                    mixer.reset()
            if not logits:
                model.replay(tokens, start)
                return None
            model.prefill(tokens, start)
            return model.logits()

    def step(self, rows: list[tuple[int, int]]) -> np.ndarray:
        """Feed each (slot, token) of ``rows`` at its slot's next position, all in one step of len(rows) rows;
        returns their logits, (len(rows), V) float32 in the order of ``rows``.

        The step's launches are recorded once per set of slots and partition counts of their positions (the
        decode attention's grid grows every PART positions) and replayed after one upload of the ids and
        positions, as ``Model.decode_one`` replays its step: the host sets no kernel argument per step."""
        model = self.model
        n = len(rows)
        order = sorted(range(n), key=lambda i: rows[i][0])   # rows run in slot order: one recording a set of slots
        slots = [rows[i][0] for i in order]
        tokens = [rows[i][1] for i in order]
        if not 1 <= n <= self.slots or len(set(slots)) != n:
            raise PerfxError(f"a batched step takes 1 to {self.slots} rows of distinct slots, got slots "
                             f"{[slot for slot, _ in rows]}")
        for slot in slots:
            self._check_slot(slot)
        model._check_ids(tokens)
        positions = [self.written[slot] for slot in slots]
        full = [slot for slot, pos in zip(slots, positions) if pos >= model.max_positions]
        if full:
            raise PerfxError(f"context full in slot(s) {full}: {model.max_positions} positions; raise --ctx")
        started = time.perf_counter()
        key = (tuple(slots), tuple(tuple(mixer.partitions(pos) for mixer in model.mixers) for pos in positions))
        replay = self._replays.get(key)
        if replay is None:
            if len(self._replays) >= MAX_RECORDINGS:
                self._replays.clear()
            with model.device.record() as launches:
                self._launches(Rows(positions, self.ids, n, [self.states[slot] for slot in slots]))
            replay = self._replays[key] = model.device.replay(list(launches))
        # a fresh host array, held by the copy's event until it has run
        self._upload = model.device.write(self.ids, np.array(tokens + positions, np.int32), wait=False)
        replay.enqueue(model.device.queue)
        model.host_seconds += time.perf_counter() - started
        logits = model.device.read(np.empty((n, model.config.vocab_size), np.float32),
                                   model.state.logits if n == 1 else self.logits)
        for slot in slots:
            self.written[slot] += 1
        out = np.empty_like(logits)
        out[order] = logits
        return out

    def _launches(self, rows: Rows) -> None:
        """The step's launches: the ids gathered, every layer over the rows, the final norm and the lm_head over
        them (into ``logits``; one row: the decode step's head, into ``state.logits``)."""
        model, n = self.model, len(rows)
        c = model.config
        model._embed(n, self.ids)
        model._layers(n, 0, decode=n == 1, rows=rows)
        if n == 1:
            model._head(0)
            return
        model._final_norm(n)
        model.weights.lm_head.rows(model.state.xb, self.logits, n)
        if c.final_softcap:
            model.plan.softcap(self.logits, n * c.vocab_size, c.final_softcap)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise PerfxError(f"slot {slot} is outside the batch's {self.slots} slots")


def _nbytes(obj) -> int:
    if isinstance(obj, list):   # attention's caches, one per shape of its layers
        return sum(_nbytes(item) for item in obj)
    return int(getattr(obj, "nbytes", 0))


class Sequence:
    """One request's generation in a slot of a ``Batch``: ``perfx.generate.generate``'s loop, driven from outside
    one step at a time, so that the caller can run many at once.

    The caller runs ``prefill_piece`` until ``decoding``, then gives it each step's logits (``take``) after
    feeding ``token`` at ``pos``, until ``done``; ``result()`` is then what ``generate`` would have returned.
    Tokens are chosen as ``generate`` chooses them: the first from the prompt's logits by the host ``Sampler``,
    the next ones greedily, or drawn with the device sampler's uniforms (``perfx.reference.sample``) where the
    model draws on the device, else by the host ``Sampler`` again.
    """

    def __init__(self, batch: Batch, slot: int, tokenizer, prompt_ids: list[int], start: int, max_tokens: int,
                 sampling: SamplingConfig, stop: list[str] | None = None, on_text=None, history=(),
                 constraint=None, on_logits=None, logit_bias=None):
        model = batch.model
        if not prompt_ids:
            raise PerfxError("the prompt is empty: nothing to continue from (give some text, or use the chat "
                             "template)")
        end = start + len(prompt_ids)
        if end >= model.max_positions:
            raise PerfxError(f"the prompt needs {end} positions with what came before, but the context holds "
                             f"{model.max_positions}: shorten it or raise --ctx")
        self.batch, self.slot, self.model = batch, slot, model
        self.todo, self.pos, self.max_tokens = list(prompt_ids), start, max_tokens
        self.prompt_end = end
        self.prompt_logits: np.ndarray | None = None   # the prompt's last logits, once run: for ``share_prompt``
        self.sampling, self.sampler = sampling, Sampler(sampling)
        self.device_draw = not sampling.greedy and model.samples_on_device(sampling)
        self.seed = None
        self.stats = Stats(prompt_tokens=len(prompt_ids), weight_bytes=model.weight_bytes)
        self.stops = StopMatcher(stop or [])
        self.decoder = tokenizer.stream_decoder() if tokenizer is not None else None
        self.eos = set(tokenizer.eos_ids) if tokenizer is not None else set()
        self.seen = list(history) + list(prompt_ids)
        self.ids: list[int] = []
        self.parts: list[str] = []
        self.on_text = on_text
        # a perfx.constrain.Constraint, fresh for this reply: each token chosen among those it allows, on the
        # host, where a batched step's logits are anyway
        self.constraint = constraint
        self.on_logits = on_logits   # generate's: each chosen token with its step's raw logits
        self.logit_bias = dict(logit_bias or {})    # generate's: token id -> added to its logit before a choice
        self.token: int | None = None    # the token to feed next, at pos
        self.done = False
        self.started = time.perf_counter()
        self.decode_started = None

    @property
    def decoding(self) -> bool:
        """Whether its prompt has run and it waits for a step (``token`` at ``pos``)."""
        return not self.done and not self.todo

    def prefill_piece(self, most: int | None = None) -> None:
        """Run the next ``most`` ids of the prompt (None: all that is left); after the last, its first token."""
        piece = self.todo[:len(self.todo) if most is None else most]
        del self.todo[:len(piece)]
        logits = self.batch.prefill(self.slot, piece, self.pos, logits=not self.todo)
        self.pos += len(piece)
        if logits is not None:
            self.prompt_logits = logits
            self._first(logits)

    def share_prompt(self, source: Sequence) -> None:
        """Take the prompt from ``source``, a sequence of the same ids in another slot whose prompt has run
        (another choice of one request): that slot's state at the prompt's end is copied into this one's on the
        device (``Batch.share``), nothing is prefilled, and the first token is chosen from the prompt's logits
        by this sequence's own sampler, as ``prefill_piece`` would have chosen it."""
        end = self.prompt_end
        if source.prompt_logits is None or source.prompt_end != end or source.seen[:end] != self.seen[:end]:
            raise PerfxError("share_prompt: the other sequence has not run this prompt")
        self.batch.share(source.slot, self.slot, end)
        self.todo, self.pos = [], end
        self.prompt_logits = source.prompt_logits
        self._first(source.prompt_logits)

    def _first(self, logits: np.ndarray) -> None:
        """The first token, from the prompt's last logits."""
        self.stats.prefill_s = self.stats.ttft_s = time.perf_counter() - self.started
        self.decode_started = time.perf_counter()
        self._chosen(int(self.sampler.pick(self._allowed(logits), self.seen)), logits)

    def take(self, logits: np.ndarray) -> None:
        """The logits after ``token`` was fed at ``pos`` (one row of a ``Batch.step``): the next token."""
        fed = self.pos
        self.pos += 1
        s, raw = self.sampling, logits
        logits = self._allowed(logits)
        if s.greedy:
            token = int(np.argmax(logits))
        elif self.device_draw:
            if self.seed is None:
                self.seed = s.seed if s.seed is not None else int(self.sampler.rng.integers(2**63))
            token = sample_token(logits, self.seen[-256:], s.temperature, s.top_k, s.top_p, s.min_p,
                                 s.repetition_penalty, self.seed, 0, fed)
        else:
            token = self.sampler.pick(logits, self.seen)
        self._chosen(int(token), raw)

    def _chosen(self, token: int, logits: np.ndarray) -> None:
        if self.on_logits is not None:
            self.on_logits(token, logits)
        self._next(token)

    def _allowed(self, logits: np.ndarray) -> np.ndarray:
        """The logits with ``logit_bias`` added and the tokens the constraint forbids at −∞ (as is, without
        either)."""
        if self.logit_bias:
            logits = logits.copy()
            for token, bias in self.logit_bias.items():
                logits[token] += bias
        return logits if self.constraint is None else logit_mask(logits, self.constraint.allowed())

    def cancel(self) -> None:
        """Stop before the next step (a client gone, shutdown): what was made is kept."""
        self._stop("cancelled")

    def _next(self, token: int) -> None:
        """``generate``'s checks on a chosen token: the end of generation, a stop string, max tokens, the end of
        the context; else it is fed at the next step."""
        if token in self.eos:
            return self._stop("eos")
        self.ids.append(token)
        self.seen.append(token)
        if self.decoder is not None:
            piece, stopped = self.stops.feed(self.decoder.add(token))
            self._emit(piece)
            if stopped:
                return self._stop("stop string")
        if self.constraint is not None:
            self.constraint.advance(token)
            if self.constraint.done:
                return self._stop("grammar complete")
        if len(self.ids) >= self.max_tokens:
            return self._stop("max tokens")
        if self.pos >= self.model.max_positions:
            return self._stop("context full")
        self.token = token

    def _stop(self, reason: str) -> None:
        if self.done:
            return
        self.done, self.token = True, None
        self.stats.stop_reason = reason
        if self.decoder is not None and reason != "stop string":
            piece, _ = self.stops.feed(self.decoder.flush())
            self._emit(piece + self.stops.flush())

    def _emit(self, piece: str) -> None:
        if piece:
            self.parts.append(piece)
            if self.on_text is not None:
                self.on_text(piece)

    def result(self) -> Result:
        """What ``generate`` returns for the same request; ``end_pos``: the positions its slot holds."""
        self.stats.generated_tokens = len(self.ids)
        if self.decode_started is not None:
            self.stats.decode_s = time.perf_counter() - self.decode_started
        return Result("".join(self.parts), list(self.ids), self.stats, end_pos=self.pos)
