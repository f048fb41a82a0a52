"""Generation: sampling, stops and streaming over a model's ``prefill`` / ``decode_one``, and the
conversation a KV cache holds.

Like gpt-fast's ``generate.py``: the loop knows nothing about kernels; the REPL and `perfx generate`
only pass a callback that receives each piece of text as it is decoded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Callable, Protocol

import numpy as np

from perfx.constrain import Constraint
from perfx.errors import PerfxError
from perfx.reference import apply_repetition_penalty, sampling_probs  # noqa: F401 (the sampler's maths)
from perfx.reference import allowed_tokens
from perfx.reference import sample as sample_token


class Model(Protocol):
    """What generation, speculation, serve and chat use of a model (``perfx.model.Model``), its state contract
    included: where a forward may continue once later positions have run."""

    max_positions: int
    weight_bytes: int      # bytes one decode step reads
    host_seconds: float    # host time spent enqueueing so far
    can_roll_back: bool         # a forward may resume before the last position run without a restore point
    keeps_restore_points: bool  # some state holds the last positions only: earlier ones resume from restore points

    def prefill(self, tokens: list[int], start_pos: int) -> None: ...
    def decode_one(self, token: int, pos: int) -> None: ...
    def logits(self) -> np.ndarray: ...
    def argmax(self) -> int: ...
    def resume_point(self, pos: int) -> int: ...   # the latest position at or before pos a forward may continue at
    def checkpoint(self, verification: bool = False) -> None: ...   # keep a restore point at the last position run
    # feed token at pos, then yield the greedy token after each position up to last, feeding each at the next
    def greedy_tokens(self, token: int, pos: int, last: int) -> Iterator[int]: ...
    def samples_on_device(self, config: SamplingConfig) -> bool: ...   # sampled_tokens draws with config there
    # as greedy_tokens, each token drawn from the sampler's distribution after seen with uniform (seed, 0, position)
    def sampled_tokens(self, token: int, pos: int, last: int, config: SamplingConfig, seed: int,
                       seen: list[int]) -> Iterator[int]: ...
    # the next token among those a bitmask allows (constrained decoding), drawn as sampled_tokens draws at pos
    def masked_token(self, allowed: np.ndarray, config: SamplingConfig, seed: int, seen: list[int],
                     pos: int) -> int: ...


class PositionalState:
    """The state contract of a model whose state is positional only (a KV cache): a forward continues at any
    position it has run, and there is nothing to keep. Models with recurrent state implement it themselves."""

    can_roll_back = True
    keeps_restore_points = False

    def resume_point(self, pos: int) -> int:
        return pos

    def checkpoint(self, verification: bool = False) -> None:
        pass

    def greedy_tokens(self, token: int, pos: int, last: int) -> Iterator[int]:
        """The greedy loop step by step: feed, then choose (``perfx.model.Model`` chooses on the device and runs a
        step ahead)."""
        for q in range(pos, last + 1):
            self.decode_one(token, q)
            token = self.argmax()
            yield token

    def samples_on_device(self, config: SamplingConfig) -> bool:
        return False

    def sampled_tokens(self, token: int, pos: int, last: int, config: SamplingConfig, seed: int,
                       seen: list[int]) -> Iterator[int]:
        """The sampled loop step by step on the host: feed, then draw from the host sampler's distribution with
        the uniform of (seed, 0, position) (``perfx.model.Model`` draws the same on the device, a step ahead)."""
        seen = list(seen)
        for q in range(pos, last + 1):
            self.decode_one(token, q)
            token = sample_token(self.logits(), seen[-256:], config.temperature, config.top_k, config.top_p,
                                 config.min_p, config.repetition_penalty, seed, 0, q)
            seen.append(token)
            yield token

    def masked_token(self, allowed: np.ndarray, config: SamplingConfig, seed: int, seen: list[int],
                     pos: int) -> int:
        """The choice of ``perfx.model.Model.masked_token`` on the host: the logits with every token ``allowed``
        forbids at −∞, then the argmax or the draw at (seed, 0, pos)."""
        logits = self.logits()
        ok = np.zeros(len(logits), bool)
        n = min(len(logits), 32 * len(allowed))
        ok[:n] = allowed_tokens(allowed, n)
        masked = np.where(ok, logits, -np.inf)
        return sample_token(masked, list(seen)[-256:], config.temperature, config.top_k, config.top_p,
                            config.min_p, config.repetition_penalty, seed, 0, pos)


@dataclass
class SamplingConfig:
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise PerfxError(f"--temperature must be ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise PerfxError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise PerfxError(f"--top-k must be ≥ 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise PerfxError(f"--min-p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise PerfxError(f"--repetition-penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and self.repetition_penalty == 1.0


class Sampler:
    """Picks the next token: greedy on the device (4 bytes read back), else on host logits."""

    def __init__(self, config: SamplingConfig):
        self.config = config
        self.rng = np.random.default_rng(config.seed)

    def __call__(self, model: Model, history: list[int]) -> int:
        if self.config.greedy:
            return model.argmax()
        return self.pick(model.logits(), history)

    def pick(self, logits, history: list[int]) -> int:
        """The next token after ``history`` from host logits."""
        if self.config.temperature == 0:
            return int(np.argmax(self.penalised(logits, history)))
        return self.sample(self.distribution(logits, history))

    def penalised(self, logits, history: list[int]) -> np.ndarray:
        return apply_repetition_penalty(logits, history[-256:], self.config.repetition_penalty)

    def distribution(self, logits, history: list[int]) -> np.ndarray:
        """What a temperature above 0 samples from after ``history`` (float64)."""
        c = self.config
        return sampling_probs(self.penalised(logits, history), c.temperature, c.top_k, c.top_p, c.min_p)

    def sample(self, probs: np.ndarray) -> int:
        return int(self.rng.choice(len(probs), p=probs))


@dataclass
class Stats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0          # prompt in -> first token out
    prefill_s: float = 0.0
    decode_s: float = 0.0
    host_s_per_token: float = 0.0  # Python/host time per decode step (sampling, detokenizing, enqueueing)
    weight_bytes: int = 0
    stop_reason: str = ""
    speculation: str = ""        # the drafter that ran ("lookup", "draft"), "" for none
    drafted: int = 0             # draft tokens verified
    accepted: int = 0            # ... of which the target kept
    verify_steps: int = 0        # forwards of the target over its last token and a draft
    speculation_gain: float = 0.0  # decode tok/s over what one token a step measured in this reply
    draft_lengths: dict = field(default_factory=dict)   # draft length chosen -> steps
    step_seconds: dict = field(default_factory=dict)    # M -> measured seconds of a step of M tokens

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        steps = max(self.generated_tokens - 1, 0)  # the first token comes from the prefill
        return steps / self.decode_s if self.decode_s and steps else 0.0

    @property
    def decode_gb_s(self) -> float:
        """Achieved bandwidth: model bytes read per token × decode tok/s."""
        return self.weight_bytes * self.decode_tok_s / 1e9

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def speculation_dict(self) -> dict:
        return {"drafter": self.speculation, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance, "verify_steps": self.verify_steps,
                "mean_draft_length": self.drafted / self.verify_steps if self.verify_steps else 0.0,
                "draft_lengths": {str(k): n for k, n in sorted(self.draft_lengths.items())},
                "gain": self.speculation_gain,
                "step_ms": {str(m): 1e3 * s for m, s in sorted(self.step_seconds.items())}}

    def as_dict(self) -> dict:
        out = {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
               "ttft_s": self.ttft_s, "prefill_tok_s": self.prefill_tok_s, "decode_tok_s": self.decode_tok_s,
               "decode_gb_s": self.decode_gb_s, "host_ms_per_token": 1e3 * self.host_s_per_token,
               "stop_reason": self.stop_reason}
        if self.speculation:
            out["speculation"] = self.speculation_dict()
        return out

    def speculation_line(self) -> str:
        """Drafted, accepted and the gain, for a log line ("" without speculation)."""
        if not self.speculation:
            return ""
        mean = self.drafted / self.verify_steps if self.verify_steps else 0.0
        return (f"{self.speculation}: {self.accepted}/{self.drafted} drafted accepted "
                f"({100 * self.acceptance:.0f}%), draft length {mean:.1f}, gain {self.speculation_gain:.2f}x")

    def line(self) -> str:
        spec = self.speculation_line() if self.drafted else ""
        return (f"{self.generated_tokens} tokens, TTFT {1e3 * self.ttft_s:.0f} ms, prefill {self.prefill_tok_s:.1f} tok/s, "
                f"decode {self.decode_tok_s:.1f} tok/s ({self.decode_gb_s:.2f} GB/s)"
                + (f", {spec}" if spec else ""))


@dataclass
class Result:
    text: str
    ids: list[int]
    stats: Stats
    end_pos: int = 0             # the next free position in the KV cache
    interrupted: bool = False


class StopMatcher:
    """Holds back text that might be the start of a stop string, so a stop never reaches the stream."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        self.pending += text
        for stop in self.stops:
            at = self.pending.find(stop)
            if at >= 0:
                out, self.pending = self.pending[:at], ""
                return out, True
        hold = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def generate(model: Model, tokenizer, prompt_ids: list[int], max_tokens: int = 256,
             sampling: SamplingConfig | None = None, start_pos: int = 0, stop_strings: list[str] | None = None,
             on_text: Callable[[str], None] | None = None, history: list[int] | None = None,
             should_stop: Callable[[], bool] | None = None, speculator=None, restore_at=(),
             constraint: Constraint | None = None,
             on_logits: Callable[[int, np.ndarray], None] | None = None,
             logit_bias: dict[int, float] | None = None) -> Result:
    """Prefill ``prompt_ids`` at ``start_pos`` (the cache before it is reused), then decode until an EOS id,
    a stop string, ``max_tokens``, the end of the context or ``should_stop()``. ``on_text`` receives each
    piece of text.

    ``should_stop`` is asked before each decode step, so a flag another thread sets (a client gone) ends the
    reply within one token: it keeps the tokens made so far, with stop reason "cancelled".
    ``speculator`` (a ``perfx.speculative.Speculator``) makes the decode steps: each feeds the last token and
    returns one or more next tokens, all but the last already in the cache.
    ``restore_at``: positions inside the prompt that later prompts may resume at (the end of a system prompt):
    a model with recurrent state (``restore_points``) prefills up to each and keeps a restore point there, as
    it does at the prompt's end.
    ``constraint`` (a ``perfx.constrain.Constraint``, fresh for this reply) keeps the reply in its grammar: each
    token is chosen among those it allows (``Model.masked_token``: the mask applied to the logits on the device),
    an end-of-generation id only where the grammar accepts the reply, and the reply ends as soon as the grammar
    is complete (stop reason "grammar complete"). Each step needs the host's mask before its choice, so the
    steps run one at a time and the speculator is not used.
    ``on_logits(token, logits)`` receives every chosen token (an end-of-generation id included) with the raw
    logits of the step that chose it, before any penalty, mask or temperature (log-probabilities): each step's
    logits are then read back and the token chosen on the host, one step at a time, without the speculator.
    ``logit_bias`` (token id → a number added to its logit before each choice, OpenAI's) chooses on the host
    likewise; it cannot be combined with ``constraint``, whose mask is applied on the device.
    ``Result.end_pos`` is the number of cache positions filled: the prompt and every generated id but the
    last (which was sampled and not yet fed), as after any stop. A KeyboardInterrupt (a user's Ctrl-C) stops
    the reply and returns what was made with ``interrupted`` set; ``end_pos`` is consistent then too.
    """
    sampling = sampling or SamplingConfig()
    sampler = Sampler(sampling)
    host = on_logits is not None or bool(logit_bias)    # each step's logits read back, the token chosen here
    if logit_bias and constraint is not None:
        raise PerfxError("logit_bias cannot be combined with a constraint (its mask is applied on the device)")
    if constraint is not None or host:
        speculator = None   # each step's choice waits for the host: nothing to verify ahead of it
    if not prompt_ids:
        raise PerfxError("the prompt is empty: nothing to continue from (give some text, or use the chat template)")
    end = start_pos + len(prompt_ids)
    if end >= model.max_positions:
        raise PerfxError(f"the prompt needs {end} positions with what came before, but the context holds "
                         f"{model.max_positions}: shorten it or raise --ctx")
    stats = Stats(prompt_tokens=len(prompt_ids), weight_bytes=model.weight_bytes)
    stops = StopMatcher(stop_strings or [])
    decoder = tokenizer.stream_decoder() if tokenizer is not None else None
    eos = set(tokenizer.eos_ids) if tokenizer is not None else set()
    seen = list(history or []) + list(prompt_ids)
    ids: list[int] = []
    text_parts: list[str] = []
    pos = start_pos          # positions filled so far; the prompt's count once its prefill has finished
    interrupted = False

    def emit(piece: str):
        if piece:
            text_parts.append(piece)
            if on_text:
                on_text(piece)

    ahead: list[int] = []    # next tokens a speculative step verified: each but the last already in the cache
    greedy = None            # the model's greedy tokens, chosen and fed on by the model (``Model.greedy_tokens``)
    sampled = None           # ... or its sampled tokens, drawn on the device (``Model.sampled_tokens``)
    on_device = speculator is None and not host and not sampling.greedy and model.samples_on_device(sampling)
    if constraint is not None:
        draws = sampling.seed if sampling.seed is not None else int(sampler.rng.integers(2**63))

    def constrained(position: int) -> int:
        # the next token after the forward of ``position``, among those the grammar allows
        if on_logits is None:
            return model.masked_token(constraint.allowed(), sampling, draws, seen, position)
        logits = model.logits()     # read before the mask is applied to them on the device
        chosen = model.masked_token(constraint.allowed(), sampling, draws, seen, position)
        on_logits(chosen, logits)
        return chosen

    if logit_bias:
        bias_ids = np.fromiter(logit_bias.keys(), np.int64)
        bias_values = np.fromiter(logit_bias.values(), np.float64)

    def choose() -> int:
        # the next token after the last forward, by the host's sampler (or the device's argmax)
        if not host:
            return sampler(model, seen)
        logits = model.logits()
        biased = logits
        if logit_bias:
            biased = logits.astype(np.float64)
            biased[bias_ids] += bias_values
        chosen = sampler.pick(biased, seen)
        if on_logits is not None:
            on_logits(chosen, logits)
        return chosen
    if speculator is not None:
        speculator.begin(model, seen, start_pos)
    started = time.perf_counter()
    host_before = None
    try:
        cuts = sorted({p - start_pos for p in restore_at if start_pos < p < end}
                      if model.keeps_restore_points else ())
        for a, b in zip([0] + cuts, cuts + [len(prompt_ids)]):
            model.prefill(list(prompt_ids[a:b]), start_pos + a)
        pos = end
        token = choose() if constraint is None else constrained(end - 1)
        stats.prefill_s = stats.ttft_s = time.perf_counter() - started
        decode_started = time.perf_counter()
        host_before = model.host_seconds
        while True:
            if token in eos:
                stats.stop_reason = "eos"
                break
            ids.append(token)
            seen.append(token)
            if decoder is not None:
                piece, stopped = stops.feed(decoder.add(token))
                emit(piece)
                if stopped:
                    stats.stop_reason = "stop string"
                    break
            if constraint is not None:
                constraint.advance(token)
                if constraint.done:
                    stats.stop_reason = "grammar complete"
                    break
            if len(ids) >= max_tokens:
                stats.stop_reason = "max tokens"
                break
            if pos >= model.max_positions:
                stats.stop_reason = "context full"
                break
            if should_stop is not None and should_stop():
                stats.stop_reason = "cancelled"
                break
            if constraint is not None:
                model.decode_one(token, pos)
                ahead = [constrained(pos)]
            elif not ahead and speculator is not None:
                room = min(max_tokens - len(ids) - 1, model.max_positions - pos - 1)
                ahead = speculator.advance(model, sampler, token, pos, seen, room)
            elif not ahead and sampling.greedy and not host:
                # the model chooses each token itself and feeds it on, a step ahead of this loop; the last
                # position it may feed is the one before max tokens or the end of the context
                if greedy is None:
                    last = min(pos + max_tokens - len(ids) - 1, model.max_positions - 1)
                    greedy = model.greedy_tokens(token, pos, last)
                ahead = [next(greedy)]
            elif not ahead and on_device:
                # as greedy: the model draws each token on the device and feeds it on, a step ahead
                if sampled is None:
                    last = min(pos + max_tokens - len(ids) - 1, model.max_positions - 1)
                    seed = sampling.seed if sampling.seed is not None else int(sampler.rng.integers(2**63))
                    sampled = model.sampled_tokens(token, pos, last, sampling, seed, seen)
                ahead = [next(sampled)]
            elif not ahead:
                model.decode_one(token, pos)
                ahead = [choose()]
            pos += 1
            token = ahead.pop(0)
        stats.decode_s = time.perf_counter() - decode_started
    except KeyboardInterrupt:
        interrupted = True
        stats.stop_reason = "interrupted"
        stats.decode_s = time.perf_counter() - started - stats.prefill_s
    if decoder is not None and stats.stop_reason != "stop string":
        piece, _ = stops.feed(decoder.flush())
        emit(piece + stops.flush())
    stats.generated_tokens = len(ids)
    if speculator is not None:
        speculator.finish(stats)
    if host_before is not None:
        stats.host_s_per_token = (model.host_seconds - host_before) / max(len(ids) - 1, 1)
    return Result("".join(text_parts), ids, stats, end_pos=pos, interrupted=interrupted)


def system_prompt_end(tokenizer, messages: list[dict], ids: list[int], **template) -> int:
    """How many of ``ids`` (the chat prompt of ``messages``, through the template with ``template``'s
    variables) its leading system messages make, as far as the template renders them alone alike (0: none, or
    a template that refuses them alone). Prompts sharing the system prompt share those ids: a model with
    recurrent state keeps a restore point there (``generate``'s ``restore_at``)."""
    system = []
    for message in messages:
        if message["role"] != "system":
            break
        system.append(message)
    if not system:
        return 0
    try:
        text = tokenizer.apply_chat_template(system, add_generation_prompt=False, **template)
    except PerfxError:
        return 0
    return common_prefix(tokenizer.encode(text, add_bos=tokenizer.add_bos_token), ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists: how much of a KV cache holding ``a`` serves ``b``."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Conversation:
    """The ids whose keys and values a model's KV cache holds (positions 0..n-1), and how the next prompt
    reuses them: a prompt that repeats what the cache holds (the next turn of a chat, re-rendered whole)
    prefills only its new suffix. `perfx chat` and `perfx serve` keep one each beside their model.
    ``resume_point(position)`` (the model's) gives the latest position at or before it at which the device
    still holds the state to continue: a conv layer's ring holds only its last positions and a recurrent
    state its last one, besides the few restore points the model keeps, so a shared prefix may be resumed
    before its end (from the start at worst).
    """

    def __init__(self, resume_point=None):
        self.cached: list[int] = []
        self.resume_point = resume_point

    def resume(self, ids: list[int]) -> tuple[int, list[int]]:
        """(the position to resume from, the ids still to prefill there) for the prompt ``ids``: the cache's
        longest prefix that ``ids`` repeats, but at least one id is left to prefill, as its logits give the
        first token. What the cache holds past that position is forgotten first, since it is about to be
        overwritten: ``cached`` stays true however the generation ends, a prompt ``generate`` refuses
        (empty, or too long for the context) included.
        """
        start = self.keep_prefix(ids[:-1])
        if start and self.resume_point is not None:
            start = self.keep_prefix(ids[:self.resume_point(start)])
        return start, ids[start:]

    def keep_prefix(self, ids: list[int]) -> int:
        """Forget what the cache holds past its common prefix with ``ids``; returns how many ids stay."""
        del self.cached[common_prefix(self.cached, ids):]
        return len(self.cached)

    def record(self, ids: list[int], result: Result):
        """After ``generate`` ran the prompt ``ids`` from ``resume(ids)``: the last sampled id was never fed,
        so the cache holds the first ``end_pos`` ids of prompt and reply."""
        self.cached = (list(ids) + result.ids)[:result.end_pos]

    def forget(self):
        """Nothing in the cache is to be trusted (a failed generation wrote it as far as is unknown)."""
        self.cached = []
