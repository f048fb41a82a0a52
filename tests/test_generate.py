"""perfx.generate on the host, over a scripted model: sampling's filters, the stop callback, and the
Conversation that chat and serve keep to prefill only what the KV cache does not hold."""

import threading

import numpy as np
import pytest

from perfx.errors import PerfxError
from perfx.generate import (Conversation, PositionalState, SamplingConfig, apply_repetition_penalty, common_prefix,
                            generate, sampling_probs)


class Scripted(PositionalState):
    """A model whose greedy token is the next of ``script``; it records every prefill and decode step."""
    weight_bytes, host_seconds = 0, 0.0

    def __init__(self, script: list[int], max_positions: int = 64):
        self.next, self.max_positions = iter(script), max_positions
        self.prefills: list[tuple[list[int], int]] = []
        self.decoded: list[int] = []

    def prefill(self, tokens, start_pos):
        self.prefills.append((list(tokens), start_pos))

    def decode_one(self, token, pos):
        self.decoded.append(pos)

    def argmax(self):
        return next(self.next)


class Letters:
    """A tokenizer for the scripted model: id i is the letter chr(ord('a') + i); no end-of-turn id."""
    eos_ids: list[int] = []

    def stream_decoder(self):
        return self

    def add(self, token: int) -> str:
        return chr(ord("a") + token)

    def flush(self) -> str:
        return ""


GREEDY = SamplingConfig(temperature=0)


def test_sampling_filters():
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert np.count_nonzero(sampling_probs(logits, top_k=2)) == 2
    p = sampling_probs(logits, top_p=0.6)   # 0.5 alone < 0.6: the token crossing it is kept
    assert p.dtype == np.float64
    assert np.count_nonzero(p) == 2 and p[0] == pytest.approx(0.5 / 0.7)
    assert np.count_nonzero(sampling_probs(logits, min_p=0.25)) == 3  # ≥ 0.125
    cold = sampling_probs(logits, temperature=0.01)
    assert cold[0] == pytest.approx(1.0)
    logits = np.array([2.0, -2.0, 1.0], dtype=np.float32)
    penalised = apply_repetition_penalty(logits, [0, 1], 2.0)
    assert penalised.dtype == np.float64
    np.testing.assert_allclose(penalised, [1.0, -4.0, 1.0])
    np.testing.assert_array_equal(logits, [2.0, -2.0, 1.0])  # the model's logits are left as they were


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([7], [1]) == 0


def test_a_stop_callback_ends_the_reply_after_the_tokens_made():
    model = Scripted(list(range(1, 20)))
    stop = threading.Event()
    pieces = []

    def on_text(piece):
        pieces.append(piece)
        if len(pieces) == 3:
            stop.set()         # as serve's connection thread does when its client goes away

    result = generate(model, Letters(), [0, 0], 10, GREEDY, on_text=on_text, should_stop=stop.is_set)
    assert result.stats.stop_reason == "cancelled" and not result.interrupted
    assert result.ids == [1, 2, 3] and result.text == "".join(pieces) == "bcd"
    assert result.stats.generated_tokens == 3
    # Asked before each decode step: two steps ran (ids 1 and 2 fed), the third id was sampled, not fed.
    assert model.decoded == [2, 3] and result.end_pos == 4
    # Never asked when the reply ends by itself first, and no callback is the same as one that says no.
    ends = generate(Scripted([1, 2]), Letters(), [0], 2, GREEDY, should_stop=lambda: False)
    assert ends.stats.stop_reason == "max tokens" and ends.ids == [1, 2]


def test_conversation_reuses_a_shared_prefix():
    conversation = Conversation()
    assert conversation.resume([1, 2, 3]) == (0, [1, 2, 3])
    conversation.cached = [1, 2, 3, 4, 5]
    assert conversation.resume([1, 2, 3, 4, 5, 6, 7]) == (5, [6, 7])
    assert conversation.cached == [1, 2, 3, 4, 5]


def test_conversation_cuts_the_cache_where_a_prompt_diverges():
    conversation = Conversation()
    conversation.cached = [1, 2, 3, 4, 5]
    assert conversation.resume([1, 2, 9, 4, 5, 6]) == (2, [9, 4, 5, 6])
    assert conversation.cached == [1, 2], "what is about to be overwritten is forgotten first"
    assert conversation.resume([8, 2]) == (0, [8, 2]) and conversation.cached == []


def test_conversation_leaves_one_id_of_a_prompt_the_cache_already_holds():
    conversation = Conversation()
    conversation.cached = [1, 2, 3, 4, 5]
    assert conversation.resume([1, 2, 3]) == (2, [3])   # a prompt shorter than the cache: its logits again
    assert conversation.cached == [1, 2]
    conversation.cached = [1, 2, 3]
    assert conversation.resume([1, 2, 3]) == (2, [3])   # the same prompt
    # /reset in chat: only the system prompt's ids stay.
    conversation.cached = [1, 2, 3, 4, 5]
    assert conversation.keep_prefix([1, 2, 7]) == 2 and conversation.cached == [1, 2]


def test_a_prompt_too_long_for_the_context_is_refused_and_the_conversation_stays_true():
    model = Scripted([7, 8], max_positions=4)
    conversation = Conversation()
    conversation.cached = [1, 2, 3]
    for prompt, refusal, kept in [([1, 2, 9, 4], "the prompt needs 4 positions", [1, 2]),
                                   ([], "the prompt is empty", [])]:
        start, todo = conversation.resume(prompt)
        with pytest.raises(PerfxError, match=refusal):
            generate(model, None, todo, 2, GREEDY, start_pos=start, history=prompt[:start])
        assert conversation.cached == kept, "what the cache holds that the prompt repeats, and no more"
    assert model.prefills == [], "nothing was written to the cache"


def test_conversation_turns_prefill_only_the_new_ids_and_survive_a_full_context():
    model = Scripted([7, 8, 9, 10, 11, 12, 13, 14], max_positions=9)
    conversation = Conversation()
    first = [1, 2, 3]
    start, todo = conversation.resume(first)
    result = generate(model, None, todo, 3, GREEDY, start_pos=start, history=first[:start])
    conversation.record(first, result)
    assert result.ids == [7, 8, 9] and conversation.cached == [1, 2, 3, 7, 8]   # 9 was sampled, never fed
    second = first + [7, 8, 9, 4]
    start, todo = conversation.resume(second)
    result = generate(model, None, todo, 5, GREEDY, start_pos=start, history=second[:start])
    conversation.record(second, result)
    assert model.prefills == [([1, 2, 3], 0), ([9, 4], 5)]
    # The reply ran to the end of the context: the cache holds every position, and the next prompt, which
    # drops a turn (as chat does when the context is full), starts over from where it diverges.
    assert result.stats.stop_reason == "context full" and conversation.cached == second + [10, 11]
    assert conversation.resume([1, 2, 5]) == (2, [5]) and conversation.cached == [1, 2]
    conversation.forget()
    assert conversation.cached == []


def test_conversation_starts_over_where_the_model_cannot_resume():
    """A model whose state before a position is gone (a conv layer's ring holds only its last positions)
    says where it can resume instead; the conversation then prefills the whole prompt from 0 (or from
    that position: a restore point)."""
    conversation = Conversation(resume_point=lambda pos: pos if pos >= 4 else 0)
    conversation.cached = [1, 2, 3, 4, 5]
    assert conversation.resume([1, 2, 3, 4, 5, 6]) == (5, [6])
    conversation.cached = [1, 2, 3, 4, 5]
    assert conversation.resume([1, 2, 9, 9]) == (0, [1, 2, 9, 9]) and conversation.cached == []
    conversation = Conversation(resume_point=lambda pos: pos if pos >= 4 else min(pos, 1))
    conversation.cached = [1, 2, 3, 4, 5]
    assert conversation.resume([1, 2, 9, 9]) == (1, [2, 9, 9]) and conversation.cached == [1]


class LogitsModel(Scripted):
    """The scripted model with logits: its script's next token scores 5, every other a fixed random value below."""

    def __init__(self, script, vocab: int = 8):
        super().__init__(script)
        self.vocab, self.rows = vocab, []
        self.noise = np.random.default_rng(2).uniform(-3, 3, vocab).astype(np.float32)

    def logits(self):
        row = self.noise.copy()
        row[next(self.next)] = 5.0
        self.rows.append(row)
        return row


def test_on_logits_sees_each_chosen_token_with_its_raw_logits_and_logit_bias_steers_the_choice():
    model = LogitsModel([1, 2, 3, 4])
    seen = []
    result = generate(model, Letters(), [0], 4, GREEDY, on_logits=lambda token, row: seen.append((token, row)))
    assert result.ids == [1, 2, 3, 4] and [t for t, _ in seen] == [1, 2, 3, 4]
    assert all(row is kept for (_, row), kept in zip(seen, model.rows))     # the raw logits, not a copy changed
    banned = LogitsModel([1, 2, 3, 4])
    result = generate(banned, Letters(), [0], 4, GREEDY, logit_bias={2: -100.0, 6: 50.0})
    assert result.ids == [6, 6, 6, 6]   # +50 outweighs the script's 5; -100 is never chosen
    assert banned.rows[0][6] == banned.noise[6] and banned.rows[0][2] == banned.noise[2]   # the model's own untouched
    with pytest.raises(PerfxError, match="logit_bias cannot be combined"):
        generate(LogitsModel([1]), Letters(), [0], 1, GREEDY, logit_bias={2: 1.0}, constraint=object())
