"""Speculative decoding: draft k tokens cheaply, verify them in one forward of M = k + 1 tokens on the
prefill path (the tall-skinny GEMM reads every weight once for all of them), keep the longest accepted
prefix and one more token from the target's own distribution.

Two drafters: prompt lookup (the tokens that followed the most recent earlier occurrence of the last n-gram,
as transformers' ``prompt_lookup_num_tokens`` and llama.cpp's lookup decoding do: no second model, no memory)
and a draft model sharing the target's vocabulary (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding"; Chen et al. 2023). Acceptance is their rule: accept draft d with probability
min(1, p(d)/q(d)), else sample from the normalised max(0, p − q), so sampled text keeps the target's
distribution; a lookup draft is a point mass (q(d) = 1). At temperature 0 that is: accept while the draft
equals the target's argmax.

The draft length is chosen each step from this device's measured costs: ``StepCosts`` holds the seconds of a
step of M tokens (M = 1: a decode step), calibrated once at first use and kept current by every step
timed while generating, and ``Acceptance`` the rate at each draft depth seen so far in this reply. With
a_i the chance that draft i is accepted given draft i − 1 was, a step drafting k tokens yields on average
E(k) = 1 + Σ_{i≤k} Π_{j≤i} a_j tokens for C(k + 1) + D(k) seconds (D: drafting); the k of the most tokens
per second wins, k = 0 (one decode step) included, so a device whose verification costs as much as M decode
steps never speculates.
"""

from __future__ import annotations

import collections
import time

import numpy as np

from perfx.errors import PerfxError
from perfx.generate import Sampler, Stats, common_prefix

MODES = ("auto", "off", "lookup", "draft")
MAX_DRAFT = 8             # draft tokens per step at most (M ≤ 9)
# Timed at first use; the other M are interpolated until a step of theirs is timed. Powers of two because
# the GEMMs' tiles make them the cheap ones (an odd M can cost more than the even one above it).
CALIBRATED_M = (1, 2, 4, 8)
CALIBRATION_REPS = 2
DECODE_WINDOW = 16        # the latest decode steps whose median is the decode cost
RATIO_WINDOW = 8          # the latest verification steps of each M whose median is its cost over decode's
COST_MEMORY = 0.25        # weight of each new timing in the draft model's cost per token
MIN_GAIN = 1.1            # auto drafts only where that is expected 10% faster than decoding: room for noise


class StepCosts:
    """Seconds of one generation step of M tokens on this device and model, M = 1 .. MAX_DRAFT + 1.

    Kept as the median of the latest decode steps and, for each M ≥ 2, the median of its latest costs
    over the decode cost of their time: another app or heat slows both alike, and a step stalled by the
    scheduler moves neither median.
    """

    def __init__(self, seconds: dict[int, float] | None = None):
        self.decode: collections.deque = collections.deque(maxlen=DECODE_WINDOW)
        self.ratio: dict[int, collections.deque] = {}
        self.guessed: set[int] = set()      # the M whose ratio was interpolated, not timed yet
        if seconds:
            self._start(seconds, set(seconds))

    @property
    def calibrated(self) -> bool:
        return bool(self.decode)

    @property
    def seconds(self) -> dict[int, float]:
        decode = median(self.decode)
        return {1: decode, **{m: decode * median(r) for m, r in sorted(self.ratio.items())}}

    def _start(self, seconds: dict[int, float], timed: set[int]) -> None:
        self.decode.clear()
        self.decode.append(seconds[1])
        self.ratio = {m: collections.deque([seconds[m] / seconds[1]], maxlen=RATIO_WINDOW)
                      for m in range(2, MAX_DRAFT + 2)}
        self.guessed = set(self.ratio) - timed

    @property
    def timed(self) -> set[int]:
        return {1} | (set(self.ratio) - self.guessed)

    def calibrate(self, model, pos: int, reps: int = CALIBRATION_REPS) -> None:
        """Time a decode step and verification steps at positions pos.. (which the caller is about to
        overwrite): a warm-up (kernel builds), then ``reps`` interleaved rounds, the median of each M."""
        sizes = [m for m in CALIBRATED_M if pos + m <= model.max_positions]
        keep_state(model)   # every step below starts at pos again
        samples: dict[int, list[float]] = {m: [] for m in sizes}
        for round_ in range(reps + 1):
            for m in sizes:
                started = time.perf_counter()
                if m == 1:
                    model.decode_one(0, pos)
                    model.argmax()
                else:
                    model.prefill_logits([0] * m, pos)
                if round_:
                    samples[m].append(time.perf_counter() - started)
        measured = {m: float(np.median(s)) for m, s in samples.items()}
        sizes = list(measured)
        self._start({m: float(np.interp(m, sizes, [measured[n] for n in sizes]))
                     for m in range(1, MAX_DRAFT + 2)}, set(sizes))

    def observe(self, m: int, seconds: float) -> None:
        """A step of m tokens just took ``seconds``; the first timing of an interpolated M replaces the guess."""
        if m == 1:
            self.decode.append(seconds)
            return
        if m in self.guessed:
            self.ratio[m].clear()
            self.guessed.discard(m)
        self.ratio[m].append(seconds / median(self.decode))

    def ratios(self) -> dict[int, float]:
        """Each step's cost over a decode step's."""
        return {1: 1.0, **{m: median(r) for m, r in sorted(self.ratio.items())}}


def median(values) -> float:
    """statistics.median, for the few values of a window (numpy's costs more than the step it times)."""
    ordered = sorted(values)
    half = len(ordered) // 2
    return float(ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2)


class Acceptance:
    """How often the draft at each depth was accepted, given the one before it was: counts with a prior of
    ``prior`` accepted out of ``prior_total`` at depth 1 (a Beta prior), and at each deeper depth the rate
    of the depth before it as the prior of the same weight, so a reply starts from a guess, follows what it
    sees, and a depth not yet tried is expected to do as the one above it."""

    def __init__(self, prior: float = 1.0, prior_total: float = 2.0):
        self.prior, self.prior_total = prior, prior_total
        self.accepted = np.zeros(MAX_DRAFT + 1)
        self.tried = np.zeros(MAX_DRAFT + 1)

    def record(self, depth: int, accepted: bool) -> None:
        self.tried[depth] += 1
        self.accepted[depth] += accepted

    def rates(self) -> np.ndarray:
        """a_1 .. a_MAX_DRAFT (index 0 unused), each one standard deviation below its mean: a few lucky
        drafts early in a reply do not make the next ones look sure."""
        means = np.empty(MAX_DRAFT + 1)
        means[0] = self.prior / self.prior_total
        for i in range(1, MAX_DRAFT + 1):
            means[i] = (self.accepted[i] + self.prior_total * means[i - 1]) / (self.tried[i] + self.prior_total)
        spread = np.sqrt(means * (1 - means) / (self.tried + self.prior_total + 1))
        return np.clip(means - spread, 0.0, 1.0)

    def expected_tokens(self) -> np.ndarray:
        """E(k), k = 0 .. MAX_DRAFT: the tokens one step drafting k yields (a cautious mean), the accepted
        drafts and the target's own."""
        return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.rates()[1:]))])


def best_length(costs: StepCosts, acceptance: Acceptance, draft_seconds: float, k_max: int,
                k_min: int = 0) -> tuple[int, float]:
    """(the draft length of the most expected tokens per second in k_min..k_max, its expected gain over
    decoding one token a step); a length is chosen over decoding only beyond MIN_GAIN."""
    seconds, tokens = costs.seconds, acceptance.expected_tokens()
    decode = seconds[1]
    best, best_rate = (0, 1.0 / decode) if k_min == 0 else (k_min, 0.0)
    for k in range(max(k_min, 1), k_max + 1):
        rate = tokens[k] / (seconds[k + 1] + k * draft_seconds)
        if rate > best_rate * (MIN_GAIN if best == 0 else 1.0):
            best, best_rate = k, rate
    return best, best_rate * decode


class PromptLookup:
    """n-gram drafts from the text so far (prompt and reply): the tokens that followed the most recent
    earlier occurrence of its last n tokens, longest n first (``max_ngram`` .. 1), as transformers'
    prompt lookup does. An index of each n-gram's latest continuation keeps a draft O(1)."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram
        self.ids: list[int] = []
        self.index: dict[tuple, int] = {}

    def reset(self, ids: list[int]) -> None:
        self.ids, self.index = [], {}
        self.extend(ids)

    def extend(self, ids) -> None:
        for token in ids:
            at = len(self.ids)
            for n in range(1, min(self.max_ngram, at) + 1):
                self.index[tuple(self.ids[at - n:at])] = at   # this n-gram is continued at `at`
            self.ids.append(int(token))

    def sync(self, seen: list[int]) -> None:
        """Follow ``seen``, the text so far (it only grows within a reply)."""
        if len(seen) < len(self.ids) or seen[:1] != self.ids[:1]:
            self.reset(seen)
        else:
            self.extend(seen[len(self.ids):])

    def draft(self, k: int) -> tuple[list[int], int]:
        """(up to k draft tokens, the length of the n-gram matched: a longer match drafts better)."""
        ids = self.ids
        for n in range(min(self.max_ngram, len(ids) - 1), 0, -1):
            at = self.index.get(tuple(ids[len(ids) - n:]))
            if at is not None:
                return ids[at:at + k], n
        return [], 0


def check_same_vocabulary(target_tokenizer, draft_tokenizer, target_name: str, draft_name: str) -> None:
    """A draft model proposes token ids: they mean the same text only under the same vocabulary."""
    if target_tokenizer is None or draft_tokenizer is None:
        raise PerfxError(f"--draft {draft_name}: both models need a tokenizer to compare their vocabularies")
    n, m = target_tokenizer.vocab_size, draft_tokenizer.vocab_size
    if n != m:
        raise PerfxError(f"--draft {draft_name} has a vocabulary of {m} tokens, {target_name} one of {n}: a draft "
                         "model must share the target's vocabulary (the same tokenizer), e.g. a smaller model "
                         "of the same family")
    for i in range(n):
        if target_tokenizer.token_text(i) != draft_tokenizer.token_text(i):
            raise PerfxError(f"--draft {draft_name}: token {i} is {draft_tokenizer.token_text(i)!r} there but "
                             f"{target_tokenizer.token_text(i)!r} in {target_name}: a draft model must share the "
                             "target's vocabulary (the same tokenizer)")


class DraftModel:
    """A smaller model that drafts for the target: its own KV cache follows the text the target holds."""

    def __init__(self, model, name: str = "draft"):
        self.model, self.name = model, name
        self.cached: list[int] = []     # the ids whose keys and values its cache holds, positions 0..n−1
        self.token_seconds = 0.0        # one draft token (a decode step of the draft), measured

    def calibrate(self) -> None:
        """Time the draft's decode step at the first position its cache does not hold."""
        pos = min(len(self.cached), self.model.max_positions - 1)
        del self.cached[pos:]
        samples = []
        for _ in range(CALIBRATION_REPS + 1):
            started = time.perf_counter()
            self.model.decode_one(0, pos)
            self.model.argmax()
            samples.append(time.perf_counter() - started)
        self.token_seconds = float(np.median(samples[1:]))

    def room(self, seen: list[int]) -> int:
        """Draft tokens its context still holds after ``seen``."""
        return self.model.max_positions - len(seen)

    def propose(self, seen: list[int], k: int, sampler: Sampler) -> tuple[list[int], list | None]:
        """k draft tokens after ``seen`` and, when sampling, the distribution each was drawn from."""
        model, started = self.model, time.perf_counter()
        start = common_prefix(self.cached, seen[:-1])
        start = model.resume_point(start)   # a draft with recurrent state continues where it kept some
        del self.cached[start:]     # about to be overwritten: true however this ends
        model.prefill(seen[start:], start)
        greedy = sampler.config.temperature == 0
        drafts, dists = [], None if greedy else []
        for i in range(k):
            if i:
                model.decode_one(drafts[-1], len(seen) + i - 1)
            if sampler.config.greedy:
                drafts.append(model.argmax())
            elif greedy:
                drafts.append(sampler.pick(model.logits(), seen + drafts))
            else:
                q = sampler.distribution(model.logits(), seen + drafts)
                drafts.append(sampler.sample(q))
                dists.append(q)
        self.cached = list(seen) + drafts[:-1]
        spent = (time.perf_counter() - started) / k
        old = self.token_seconds
        self.token_seconds = spent if not old else (1 - COST_MEMORY) * old + COST_MEMORY * spent
        return drafts, dists


class Speculator:
    """Makes the decode steps of ``generate`` for one model: drafts, verifies, and picks the draft length.

    ``mode``: "off" (one token a step), "lookup" or "draft" (always that drafter, the length from the costs),
    "auto" (the draft model where one is given, else prompt lookup, and no draft where that is expected to
    be slower). One Speculator lives beside its model (chat and serve keep theirs): the step costs it
    measured stay with it.
    """

    def __init__(self, mode: str = "auto", draft: DraftModel | None = None, max_draft: int = MAX_DRAFT,
                 costs: StepCosts | None = None, log=None):
        if mode not in MODES:
            raise PerfxError(f"--speculate must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "draft" and draft is None:
            raise PerfxError("--speculate draft needs a draft model: --draft MODEL (a smaller model with the "
                             "target's vocabulary)")
        if mode == "lookup":
            draft = None
        if not 1 <= max_draft <= MAX_DRAFT:
            raise PerfxError(f"--draft-max must be between 1 and {MAX_DRAFT}, got {max_draft}")
        self.mode, self.draft, self.max_draft = mode, draft, max_draft
        self.drafter = "" if mode == "off" else "draft" if draft is not None else "lookup"
        self.costs = costs or StepCosts()
        self.log = log or (lambda text: None)
        self.lookup = PromptLookup()
        self.acceptance: dict[int, Acceptance] = {}   # by the lookup's n-gram length; 0: the draft model
        self.stats = Stats()
        self.shadows: list[tuple[list[int], int, int]] = []   # lookup drafts not verified: (rest, source, depth)

    def begin(self, model, seen: list[int], start_pos: int) -> None:
        """Before the prompt's prefill at ``start_pos`` (positions from there on are about to be written):
        calibrate the step costs at first use, and start this reply's counts."""
        if not self.costs.calibrated:
            self.calibrate(model, start_pos)
        # A draft model agrees with its target more often than not. Lookup starts from 1 in 4 (most text does
        # not repeat what came before; a reply has few tokens to learn from) and learns from free shadow
        # drafts, for each n-gram length apart.
        self.acceptance = ({0: Acceptance(3.0, 4.0)} if self.draft is not None else
                           {n: Acceptance(1.0, 4.0) for n in range(1, self.lookup.max_ngram + 1)})
        self.stats = Stats(speculation=self.drafter)
        self.shadows = []
        if self.drafter == "lookup":
            self.lookup.reset(seen)

    def calibrate(self, model, pos: int) -> None:
        """Measure the step costs (and the draft model's) at positions pos.., which the caller overwrites next."""
        if self.drafter:
            started = time.perf_counter()
            self.costs.calibrate(model, pos)
            if self.draft is not None:
                self.draft.calibrate()
            draft = (f"; the draft model's token {self.draft.token_seconds / self.costs.seconds[1]:.2f}"
                     if self.draft is not None else "")
            ratios = ", ".join(f"{m}: {r:.2f}" for m, r in self.costs.ratios().items() if m in self.costs.timed)
            self.log(f"perfx: speculation ({self.mode}): step costs measured in "
                     f"{time.perf_counter() - started:.1f} s, M tokens over one: {ratios}{draft}")

    def finish(self, stats: Stats) -> None:
        """This reply's counts into ``stats``, and the gain: decode tok/s over one token a step's."""
        for name in ("speculation", "drafted", "accepted", "verify_steps", "draft_lengths"):
            setattr(stats, name, getattr(self.stats, name))
        if self.drafter and self.costs.calibrated:
            stats.step_seconds = seconds = self.costs.seconds
            stats.speculation_gain = stats.decode_tok_s * seconds[1]

    def advance(self, model, sampler: Sampler, token: int, pos: int, seen: list[int], room: int) -> list[int]:
        """Feed ``token`` (the last of ``seen``) at ``pos``; the next tokens: every one but the last is in the
        cache after it. ``room``: drafts that may be verified (tokens still wanted, positions still free)."""
        k_max = min(self.max_draft, room)
        if self.draft is not None:
            k_max = min(k_max, self.draft.room(seen) - 1)
        drafts: list[int] = []
        k = source = 0
        if self.drafter == "lookup" and k_max > 0:
            self.lookup.sync(seen)
            drafts, source = self.lookup.draft(k_max)
            k = self._length(len(drafts), 0.0, source) if drafts else 0
        elif self.drafter == "draft" and k_max > 0:
            k = self._length(k_max, self.draft.token_seconds, source)
        if k == 0:
            return [self._decode(model, sampler, token, pos, seen, drafts, source)]
        self.shadows = []
        dists = None
        if self.drafter == "draft":
            drafts, dists = self.draft.propose(seen, k, sampler)
        else:
            drafts = drafts[:k]
        started = time.perf_counter()
        keep_state(model)
        logits = model.prefill_logits([token] + drafts, pos)
        accepted, nxt = accept(logits, drafts, dists, sampler, seen)
        if len(accepted) < k and not model.can_roll_back:
            # The recurrent state stands after the rejected drafts: back to the restore point before the step,
            # and the kept tokens run again (counted in the step's cost, so auto weighs it).
            model.replay([token] + accepted, pos)
        self.costs.observe(k + 1, time.perf_counter() - started)
        for depth in range(1, min(len(accepted) + 1, k) + 1):
            self.acceptance[source].record(depth, depth <= len(accepted))
        s = self.stats
        s.drafted += k
        s.accepted += len(accepted)
        s.verify_steps += 1
        s.draft_lengths[k] = s.draft_lengths.get(k, 0) + 1
        return accepted + [nxt]

    def _length(self, k_max: int, draft_seconds: float, source: int) -> int:
        k, _ = best_length(self.costs, self.acceptance[source], draft_seconds, k_max,
                           k_min=int(self.mode != "auto"))
        return k

    def _decode(self, model, sampler: Sampler, token: int, pos: int, seen: list[int], drafts: list[int],
                source: int) -> int:
        """One token a step, timed. The lookup draft of each such step is checked against the tokens that
        follow, for free (a shadow draft: at any temperature it matches with the probability that verifying
        would have accepted it), so the acceptance rates learn at every step whether drafts ran or not."""
        if drafts:
            self.shadows.append((list(drafts), source, 0))
        started = time.perf_counter()
        model.decode_one(token, pos)
        nxt = sampler(model, seen)
        self.costs.observe(1, time.perf_counter() - started)
        alive = []
        for rest, where, depth in self.shadows:
            hit = rest[0] == nxt
            self.acceptance[where].record(depth + 1, hit)
            if hit and len(rest) > 1:
                alive.append((rest[1:], where, depth + 1))
        self.shadows = alive
        return nxt


def keep_state(model) -> None:
    """Before a forward that may be rolled back: a model whose state cannot roll back by itself (Qwen3.5's
    Gated DeltaNet holds the last position only) keeps a restore point of it (``Model.checkpoint``)."""
    if not model.can_roll_back:
        model.checkpoint(verification=True)


def accept(logits: np.ndarray, drafts: list[int], dists: list | None, sampler: Sampler,
           seen: list[int]) -> tuple[list[int], int]:
    """(the accepted drafts, the next token) from the target's ``logits`` over [last token] + drafts.

    Greedy: drafts are kept while each equals the target's argmax, and the next token is that argmax.
    Sampling (Leviathan et al., algorithm 1): draft d_i, drawn from q_i (``dists[i]``; None: a point mass on
    d_i, as prompt lookup drafts), is kept with probability min(1, p_i(d_i) / q_i(d_i)); the first one
    rejected is replaced by a sample of the normalised max(0, p_i − q_i), and when all are kept one more
    comes from p_k. p and q both pass the same temperature, penalty and top-k / top-p / min-p filters.
    """
    history = list(seen)
    greedy = sampler.config.temperature == 0
    for i, d in enumerate(drafts):
        if greedy:
            best = sampler.pick(logits[i], history)
            if best != d:
                return drafts[:i], best
        else:
            p = sampler.distribution(logits[i], history)
            q = None if dists is None else _fit(dists[i], len(p))
            q_d = 1.0 if q is None else q[d]
            if not sampler.rng.random() * q_d < p[d]:
                if q is None:
                    residual = p.copy()
                    residual[d] = 0.0
                else:
                    residual = np.maximum(p - q, 0.0)
                total = residual.sum()
                return drafts[:i], sampler.sample(residual / total if total > 0 else p)
        history.append(d)
    return list(drafts), sampler.pick(logits[len(drafts)], history)


def _fit(q: np.ndarray, n: int) -> np.ndarray:
    """A draft distribution over a vocabulary padded to another size (the same tokens, rows for padding)."""
    if len(q) == n:
        return q
    return np.pad(q, (0, n - len(q))) if len(q) < n else q[:n]
