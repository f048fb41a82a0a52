"""Speculative decoding (perfx.speculative): the drafters, the draft-length choice, the acceptance rule's
distribution on a host model whose exact distribution is known, and, on a tiny GGUF model on the device,
greedy replies equal to one-token-a-step replies with rollbacks past a prefill chunk and up to a full
context, in generate, chat and serve."""

import http.client
import json
import re
import threading

import numpy as np
import pytest

from helpers.tiny_models import make_tiny_model, tiny_tokenizer, write_gguf
from helpers.tiny_tokenizer import train_tiny_spm
from perfx import cli
from perfx.commands.chat import Chat
from perfx.errors import PerfxError
from perfx.generate import Conversation, PositionalState, SamplingConfig, generate, sampling_probs
from perfx.model import load_model
from perfx.serve.engine import Engine
from perfx.serve.server import Server, ServeOptions
from perfx.speculative import (MAX_DRAFT, Acceptance, DraftModel, PromptLookup, Speculator, StepCosts, best_length,
                               check_same_vocabulary)
from perfx.tokenizer import Tokenizer

GREEDY = SamplingConfig(temperature=0)
# Verification as cheap as decoding: any acceptance makes drafting pay, so every step drafts.
FLAT = {m: 1.0 for m in range(1, MAX_DRAFT + 2)}


# -- on the host -------------------------------------------------------------------------------------


def test_prompt_lookup_drafts_what_followed_the_latest_longest_match():
    lookup = PromptLookup(max_ngram=3)
    lookup.reset([1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3])
    assert lookup.draft(3) == ([4, 6, 7], 2), "the latest of the two occurrences of (2, 3)"
    lookup.extend([4])
    assert lookup.draft(2) == ([6, 7], 3), "(2, 3, 4) last continued by 6"
    lookup.reset([5, 6, 7])
    assert lookup.draft(4) == ([], 0), "no earlier occurrence of 7"
    lookup.sync([5, 6, 7, 5])
    assert lookup.draft(4) == ([6, 7, 5], 1) and lookup.ids == [5, 6, 7, 5]
    lookup.sync([8, 6])   # another text: the index starts over
    assert lookup.ids == [8, 6] and lookup.draft(2) == ([], 0)


def test_the_draft_length_follows_the_measured_costs_and_acceptance():
    sure = Acceptance()
    for depth in range(1, MAX_DRAFT + 1):
        for _ in range(50):
            sure.record(depth, True)
    # Verifying M tokens costs M decode steps (a compute-bound CPU): no acceptance rate makes a draft pay.
    compute_bound = StepCosts({m: float(m) for m in range(1, MAX_DRAFT + 2)})
    assert best_length(compute_bound, sure, 0.0, MAX_DRAFT) == (0, 1.0)
    # A step of 9 costs 1.5 decode steps (memory-bound, a phone GPU): draft all 8 when they are all accepted.
    memory_bound = StepCosts({m: 1.0 + (m - 1) / 16 for m in range(1, MAX_DRAFT + 2)})
    k, gain = best_length(memory_bound, sure, 0.0, MAX_DRAFT)
    assert k == MAX_DRAFT and gain > 5
    # ... but not when drafts are rejected, nor when drafting itself costs as much as decoding.
    never = Acceptance()
    for _ in range(50):
        never.record(1, False)
    assert best_length(memory_bound, never, 0.0, MAX_DRAFT)[0] == 0
    assert best_length(memory_bound, sure, 1.0, MAX_DRAFT)[0] == 0
    # An explicit drafter (--speculate lookup) drafts at least one token.
    assert best_length(compute_bound, never, 0.0, MAX_DRAFT, k_min=1)[0] == 1


class Markov(PositionalState):
    """A host model whose logits depend on the last token fed only: the exact distribution of any
    continuation is a product of rows. It implements what generate and the speculator call."""
    weight_bytes, host_seconds = 0, 0.0

    def __init__(self, table: np.ndarray, max_positions: int = 64):
        self.table, self.max_positions = table, max_positions
        self.last = None

    def prefill(self, tokens, start_pos):
        self.last = tokens[-1]

    def prefill_logits(self, tokens, start_pos, first=0):
        self.last = tokens[-1]
        return self.table[np.asarray(tokens[first:])].astype(np.float32)

    def decode_one(self, token, pos):
        self.last = token

    def logits(self):
        return self.table[self.last].astype(np.float32)

    def argmax(self):
        return int(np.argmax(self.table[self.last]))


def continuation_counts(model, sampling, speculator_factory, prompt, runs: int, length: int) -> np.ndarray:
    v = model.table.shape[0]
    counts = np.zeros(v ** length)
    for seed in range(runs):
        speculator = speculator_factory()
        result = generate(model, None, prompt, length, SamplingConfig(**{**vars(sampling), "seed": seed}),
                          speculator=speculator)
        assert len(result.ids) == length
        counts[np.ravel_multi_index(result.ids, (v,) * length)] += 1
    return counts


@pytest.mark.parametrize("drafter", ["lookup", "draft"])
def test_sampling_with_speculation_keeps_the_distribution(drafter):
    """Continuations of 3 tokens, 3000 seeds: a chi-square test against the exact distribution (5 tokens,
    temperature 0.8 with top-k, top-p and min-p each removing tokens). The draft model is another chain, so
    drafts are accepted and rejected by min(1, p/q) and the residual max(0, p − q) is sampled."""
    rng = np.random.default_rng(3)
    v, length, runs = 5, 3, 3000
    target = Markov(rng.standard_normal((v, v)) * 0.6)
    sampling = SamplingConfig(temperature=0.8, top_k=4, top_p=0.9, min_p=0.1)
    rows = np.array([sampling_probs(target.table[t], 0.8, 4, 0.9, 0.1) for t in range(v)])
    prompt = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0]   # lookup always finds a draft here

    def speculator():
        if drafter == "lookup":
            return Speculator("lookup", costs=StepCosts(FLAT))
        draft = DraftModel(Markov(0.6 * rng.standard_normal((v, v))))   # unrelated: rejections are common
        draft.token_seconds = 0.01
        return Speculator("draft", draft, costs=StepCosts(FLAT))

    made = []

    def recording():
        made.append(speculator())
        return made[-1]

    counts = continuation_counts(target, sampling, recording, prompt, runs, length)
    expected = np.zeros(v ** length)
    for index in range(v ** length):
        a, b, c = np.unravel_index(index, (v,) * length)
        expected[index] = rows[prompt[-1], a] * rows[a, b] * rows[b, c] * runs
    # Cells expected under 5 draws are pooled into one, as the chi-square approximation needs.
    assert counts[expected == 0].sum() == 0, "a token the filters remove was sampled"
    small = (expected < 5) & (expected > 0)
    observed = np.append(counts[expected >= 5], counts[small].sum())
    wanted = np.append(expected[expected >= 5], expected[small].sum())
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    dof = len(observed) - 1
    # The 99.9% point of chi-square is below dof + 3.1·sqrt(2·dof) + 10 for these degrees of freedom.
    assert chi2 < dof + 3.1 * np.sqrt(2 * dof) + 10, f"chi2 {chi2:.1f} on {dof} degrees of freedom"
    drafted, accepted = (sum(getattr(m.stats, name) for m in made) for name in ("drafted", "accepted"))
    assert 0 < accepted < drafted, "drafts were accepted and rejected"


def test_modes_and_draft_options_are_checked():
    with pytest.raises(PerfxError, match="--speculate must be one of auto, off, lookup, draft"):
        Speculator("fast")
    with pytest.raises(PerfxError, match="--speculate draft needs a draft model: --draft MODEL"):
        Speculator("draft")
    with pytest.raises(PerfxError, match="--draft-max must be between 1 and 8"):
        Speculator("lookup", max_draft=9)


# -- on the device, a tiny model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    """Two tiny models sharing one tokenizer (a target and a different-weights draft), 4096 positions, their
    end-of-turn rows zeroed so greedy replies run to max_tokens, and one with another vocabulary."""
    directory = tmp_path_factory.mktemp("speculative")
    paths = {}
    for name, seed in (("target", 6), ("draft", 7)):
        model = make_tiny_model("gqa3", tiny_tokenizer(directory), np.random.default_rng(seed))
        model.config["max_position_embeddings"] = 4096
        path = directory / f"{name}.gguf"
        write_gguf(path, model)
        for eos in Tokenizer.from_gguf(path).eos_ids:
            model.weights["lm_head.weight"][eos] = 0
        write_gguf(path, model)
        paths[name] = str(path)
    other = tmp_path_factory.mktemp("other-vocabulary")
    model = make_tiny_model("gqa3", train_tiny_spm(other, vocab_size=450), np.random.default_rng(8))
    paths["other"] = str(other / "other.gguf")
    write_gguf(paths["other"], model)
    return paths


class Tiny:
    """The target, its tokenizer, a draft with other weights and a second copy of the target (a draft that
    agrees with it), each with its own KV cache of 320 positions (two prefill chunks of 256)."""

    def __init__(self, paths, device):
        self.paths = paths
        self.target, source = load_model(paths["target"], device, ctx=CTX, progress=False)
        self.tokenizer = source.tokenizer
        self.draft = load_model(paths["draft"], device, ctx=CTX, progress=False)[0]
        self.same = load_model(paths["target"], device, ctx=CTX, progress=False)[0]

    def speculator(self, mode: str) -> Speculator:
        """``mode``: lookup, draft (other weights), same (the target's copy) or auto (costs measured here)."""
        draft = {"draft": self.draft, "same": self.same}.get(mode)
        return Speculator("auto" if mode == "auto" else "draft" if draft else mode,
                          DraftModel(draft) if draft else None, costs=None if mode == "auto" else StepCosts(FLAT))


CTX = 320


@pytest.fixture(scope="module")
def tiny(tiny_paths, opencl_device) -> Tiny:
    return Tiny(tiny_paths, opencl_device)


def assert_greedy_equal(model, plain: list[int], speculative: list[int], prompt: list[int]):
    """Equal token for token, or parted only at a near-tie: where the two best logits of the decode path
    are closer than twice what the decode path (GEMV) and the verification path (GEMM) differ by there
    (float32 sums in other orders; a tuned GEMV may quantize activations to int8: on the default model
    Intel's tuned entries put the paths up to 0.81 apart, PoCL's 0.0067), plus 1e-3."""
    if plain == speculative:
        return
    at = next((i for i, (a, b) in enumerate(zip(plain, speculative)) if a != b), min(len(plain), len(speculative)))
    assert at > 0, "the first token comes from the prompt's prefill in both"
    context = prompt + plain[:at]
    model.prefill(context[:-1], 0)
    model.decode_one(context[-1], len(context) - 1)
    decoded = model.logits()
    verified = model.prefill_logits(context[-2:], len(context) - 2)[-1]
    paths = float(np.abs(decoded - verified).max())
    top = np.sort(decoded)[-2:]
    gap = float(top[1] - top[0])
    assert gap < 2 * paths + 1e-3, f"parted at token {at}, where the two best logits are {gap:.3g} apart (paths {paths:.3g})"


def repetitive_prompt(tokenizer, repeats: int = 6) -> list[int]:
    return tokenizer.encode("kato rimu sen la dope. " * repeats + "kato rimu", add_bos=tokenizer.add_bos_token)


@pytest.mark.one_implementation
@pytest.mark.parametrize("mode", ["lookup", "draft", "same", "auto"])
def test_greedy_speculation_gives_the_one_token_a_step_reply(tiny, mode):
    prompt = repetitive_prompt(tiny.tokenizer)
    plain = generate(tiny.target, tiny.tokenizer, prompt, 40, GREEDY)
    spec = generate(tiny.target, tiny.tokenizer, prompt, 40, GREEDY, speculator=tiny.speculator(mode))
    assert_greedy_equal(tiny.target, plain.ids, spec.ids, prompt)
    assert spec.stats.stop_reason == plain.stats.stop_reason == "max tokens"
    assert spec.end_pos == plain.end_pos == len(prompt) + 39
    if mode != "auto":
        assert spec.stats.verify_steps > 0 and spec.stats.drafted >= spec.stats.accepted
        assert f"{spec.stats.accepted}/{spec.stats.drafted} drafted accepted" in spec.stats.line()
    if mode in ("lookup", "same"):
        assert spec.stats.accepted > 0   # (random other weights agree with the target on nothing)
    if mode == "same":
        assert spec.stats.accepted == spec.stats.drafted, "a copy of the target drafts what it picks"


@pytest.mark.one_implementation
@pytest.mark.parametrize("mode", ["lookup", "draft", "same"])
def test_rollbacks_past_a_prefill_chunk_up_to_a_full_context_then_the_next_turn(tiny, mode):
    """A prompt of two prefill chunks, a reply that runs into the end of the context with drafts rejected
    and rolled back on the way (every one with the other weights' draft), then a next turn that reuses the
    cache: all as one token a step."""
    prompt = repetitive_prompt(tiny.tokenizer, 40)[:CTX - 30]
    assert len(prompt) > 256, "the prompt's prefill takes two chunks"
    results = {}
    for name, speculator in (("plain", None), ("spec", tiny.speculator(mode))):
        conversation = Conversation()
        start, todo = conversation.resume(prompt)
        first = generate(tiny.target, tiny.tokenizer, todo, 64, GREEDY, start_pos=start, speculator=speculator)
        conversation.record(prompt, first)
        # The next turn drops the reply's end (a chat that re-renders), so the cache is cut back into it.
        second_prompt = prompt + first.ids[:10] + prompt[5:9]
        start, todo = conversation.resume(second_prompt)
        second = generate(tiny.target, tiny.tokenizer, todo, 8, GREEDY, start_pos=start,
                          history=second_prompt[:start], speculator=speculator)
        results[name] = (first, start, second)
    (p1, p_start, p2), (s1, s_start, s2) = results["plain"], results["spec"]
    assert s1.stats.stop_reason == p1.stats.stop_reason == "context full"
    assert s1.end_pos == p1.end_pos == CTX and s_start == p_start
    assert_greedy_equal(tiny.target, p1.ids, s1.ids, prompt)
    assert s1.stats.verify_steps > 0
    if mode == "draft":
        assert s1.stats.drafted > s1.stats.accepted, "drafts were rejected and their positions rewritten"
    if p1.ids == s1.ids:
        assert_greedy_equal(tiny.target, p2.ids, s2.ids, prompt + p1.ids[:10] + prompt[5:9])


@pytest.mark.one_implementation
def test_a_draft_model_with_another_vocabulary_is_refused(tiny, tiny_paths):
    other = Tokenizer.from_gguf(tiny_paths["other"])
    with pytest.raises(PerfxError, match=r"--draft other.gguf has a vocabulary of 450 tokens, target.gguf one "
                                         r"of \d+: a draft model must share the target's vocabulary"):
        check_same_vocabulary(tiny.tokenizer, other, "target.gguf", "other.gguf")
    check_same_vocabulary(tiny.tokenizer, Tokenizer.from_gguf(tiny_paths["draft"]), "target.gguf", "draft.gguf")


# -- the commands -------------------------------------------------------------------------------------


@pytest.mark.one_implementation
def test_generate_json_reports_speculation_and_refuses_a_draft_of_another_vocabulary(tiny_paths, capsys):
    prompt = "kato rimu sen la dope. " * 6 + "kato rimu"
    base = ["generate", "--model", tiny_paths["target"], "--raw", "--temperature", "0", "--max-tokens", "24", "-q"]
    assert cli.main(base + ["--speculate", "lookup", "--json", prompt]) == 0
    out = json.loads(capsys.readouterr().out)
    spec = out["stats"]["speculation"]
    assert spec["drafter"] == "lookup" and spec["drafted"] >= spec["accepted"] > 0 and spec["verify_steps"] > 0
    assert sum(spec["draft_lengths"].values()) == spec["verify_steps"] and spec["gain"] > 0
    assert set(spec["step_ms"]) == {str(m) for m in range(1, MAX_DRAFT + 2)}
    assert cli.main(base + ["--draft", tiny_paths["other"], prompt]) == 2
    err = capsys.readouterr().err
    assert "has a vocabulary of 450 tokens" in err and "a draft model must share the target's vocabulary" in err
    assert cli.main(base + ["--draft", tiny_paths["draft"], "--speculate", "off", prompt]) == 2
    assert "is unused with --speculate off" in capsys.readouterr().err


@pytest.mark.one_implementation
def test_chat_stats_and_the_serve_log_line_report_acceptance(tiny, tiny_paths, capsys):
    model, source = load_model(tiny_paths["target"], tiny.target.device, ctx=CTX, progress=False)
    chat = Chat(model, source, GREEDY, 16, None, interactive=False, speculator=Speculator("lookup"))
    chat.turn("kato rimu sen la dope. " * 4 + "kato rimu")
    chat.turn("sen la dope. kato rimu sen la")
    stats = chat.stats_text()
    assert re.search(r"speculate +lookup \(lookup\): last lookup: \d+/\d+ drafted accepted \(\d+%\), draft length "
                     r"[\d.]+, gain [\d.]+x; all replies \d+/\d+ drafted accepted", stats), stats
    assert re.search(r"step cost +M tokens / one: 1: 1.00, 2: [\d.]+", stats), stats
    logs: list[str] = []
    engine = Engine(model, source.tokenizer, 2, GREEDY, Speculator("lookup"))
    server = Server(("127.0.0.1", 0), engine, ServeOptions("tiny", default_max_tokens=12, log=logs.append))
    accepting = threading.Thread(target=server.serve_forever, daemon=True)
    accepting.start()
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
        body = json.dumps({"model": "tiny", "prompt": "kato rimu sen la dope. " * 4 + "kato rimu"})
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        assert connection.getresponse().status == 200
    finally:
        server.stop()
        accepting.join(30)
    assert re.search(r"completion 12 \(length\), lookup: \d+/\d+ drafted accepted \(\d+%\), draft length [\d.]+, "
                     r"gain [\d.]+x, wait", logs[0]), logs


@pytest.mark.one_implementation
def test_sampling_with_a_draft_model_keeps_the_tiny_models_distribution(tiny):
    """The first two tokens of 3-token replies on the device, 400 seeds, drafted by the other weights (so
    drafts are mostly rejected and the residual sampled): a chi-square test against the exact distribution
    from the target's own logits (temperature 1, top-k 3: 9 outcomes)."""
    sampling = SamplingConfig(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    prompt = repetitive_prompt(tiny.tokenizer, 2)
    first = sampling_probs(tiny.target.prefill_logits(prompt, 0, len(prompt) - 1)[-1], 1.0, 3)
    exact = {}
    for a in np.flatnonzero(first):
        second = sampling_probs(tiny.target.prefill_logits(prompt + [int(a)], 0, len(prompt))[-1], 1.0, 3)
        for b in np.flatnonzero(second):
            exact[(int(a), int(b))] = first[a] * second[b]
    runs, counts, drafted = 400, {}, 0
    speculator = Speculator("draft", DraftModel(tiny.draft), costs=StepCosts(FLAT))
    for seed in range(runs):
        result = generate(tiny.target, tiny.tokenizer, prompt, 3, SamplingConfig(**{**vars(sampling), "seed": seed}),
                          speculator=speculator)
        key = tuple(result.ids[:2])
        assert key in exact, f"{key} is outside the top-3 filter"
        counts[key] = counts.get(key, 0) + 1
        drafted += result.stats.drafted
    assert drafted == runs, "every reply verified one draft"
    wanted = np.array([runs * p for p in exact.values()])
    observed = np.array([counts.get(key, 0) for key in exact])
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    dof = len(exact) - 1
    assert chi2 < dof + 3.1 * np.sqrt(2 * dof) + 10, f"chi2 {chi2:.1f} on {dof} degrees of freedom"
