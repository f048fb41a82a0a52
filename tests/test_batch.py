"""Continuous batching (``perfx.batch``): sequences decoded together as one step of N rows give each sequence the
logits it gets decoded alone and the float64 forward's, on every family's tiny model (attention with its
windows, soft-caps, q/k norms and partial rotary; LFM2's conv rings; Qwen3.5's Gated DeltaNet state), with
sequences of different lengths joining and leaving between steps and a slot reused by a new sequence; a request
generated in a batch (``Sequence``) answers what ``generate`` answers alone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from helpers.family_models import family_tokenizer, make_family_model, write_family_gguf
from helpers.gemma3n_models import make_gemma3n, write_gemma3n_gguf
from helpers.gemma4_models import make_gemma4, write_gemma4_gguf
from helpers.gptoss_models import write_gptoss_gguf
from helpers.moe_models import write_moe_gguf
from helpers.tiny_models import make_tiny_model, tiny_tokenizer, write_gguf
from perfx import forward64
from perfx import plan as plan_module
from perfx.batch import Batch, Sequence
from perfx.errors import PerfxError
from perfx.generate import SamplingConfig, generate
from perfx.linear import Q4Linear
from perfx.mixers import Mixer
from perfx.model import Model
from perfx.serve.batching import default_parallel, sequence_state_bytes
from perfx.sources import open_model
from perfx.tuning import SPECS
from perfx.tuning.database import default_database
from perfx.tuning.spec import relative_error

RECORDED = json.loads((Path(__file__).parent / "data" / "llamacpp_families.json").read_text())["families"]
# llama (a GQA tiny Llama), then gemma3 ... lfm2, qwen35, then the mixtures of experts (their FFN over N rows), then
# Gemma 4 (layers of their own head sizes, KV heads and MLP widths, shared KV caches, per-layer inputs), gpt-oss
# (attention sinks, windows on alternate layers, the experts' biases), Gemma 3n (AltUp's streams, LAuReL and the
# sparse gates over N rows)
FAMILIES = ["llama", *RECORDED, "qwen3_moe", "lfm2_moe", "gemma4", "gpt_oss", "gemma3n"]

# Against the float64 forward: the device forward's own tolerance (fp16 KV cache, int8 activations of the int8
# matrices), as tests/test_families.py holds every family's decode to.
REFERENCE_TOLERANCE = 2e-3
# Against the same sequence decoded alone: the same kernels on the same state, but every matrix as the GEMM over
# N rows instead of the GEMV of one, which sums in another order (fp32 rounding only; a wrong row, position or
# state is off by O(1)).
ALONE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    out = {"llama": write_gguf(root / "gqa3.gguf", make_tiny_model("gqa3", tiny_tokenizer(root),
                                                                    np.random.default_rng(11))).path}
    for family in RECORDED:
        settings = dict(RECORDED[family]["make_family_model"])
        model = make_family_model(settings.pop("family"), family_tokenizer(root, family),
                                  np.random.default_rng(settings.pop("seed")), **settings)
        out[family] = write_family_gguf(root / f"{family}.gguf", model, **RECORDED[family]["write_family_gguf"]).path
    for model_type in ("qwen3_moe", "lfm2_moe"):
        out[model_type], _ = write_moe_gguf(root / f"{model_type}.gguf", model_type, np.random.default_rng(5))
    out["gpt_oss"], _ = write_gptoss_gguf(root / "gpt_oss.gguf", np.random.default_rng(5))
    out["gemma4"] = root / "gemma4.gguf"
    write_gemma4_gguf(out["gemma4"], make_gemma4(np.random.default_rng(6)))
    out["gemma3n"] = root / "gemma3n.gguf"
    write_gemma3n_gguf(out["gemma3n"], make_gemma3n(np.random.default_rng(7)))
    return out


def load(path, device, ctx: int = 96, kv: str = "f16") -> Model:
    return Model.load(open_model(path), device, ctx=ctx, progress=False, database=default_database(False), kv=kv)


def alone_logits(model: Model, prompt: list[int], fed: list[int]) -> list[np.ndarray]:
    """The prompt's last logits, then each fed token's, decoded alone from position 0."""
    model.prefill(prompt, 0)
    out = [model.logits()]
    for i, token in enumerate(fed):
        model.decode_one(token, len(prompt) + i)
        out.append(model.logits())
    return out


def run_schedule(batch: Batch, v: int, rng) -> list[tuple[list[int], list[int], list[np.ndarray]]]:
    """Three sequences of different lengths in three slots: slot 1 joins a step late, slot 0's sequence leaves
    after two steps and a new one takes its slot from position 0 (its state started afresh), the steps having 1 to
    3 rows. Returns (prompt, fed tokens, logits after the prompt and after each fed token) of each sequence."""
    def new(length):
        return [int(t) for t in rng.integers(3, v, length)], [], []

    seqs = {0: new(5), 2: new(11)}
    done = []
    for slot, (prompt, _, logits) in seqs.items():
        logits.append(batch.prefill(slot, prompt, 0))
    schedule = [[0, 2], [0, 1, 2], [1, 2], [0, 1, 2], [0, 1, 2], [0]]
    for k, slots in enumerate(schedule):
        if k == 1:
            seqs[1] = new(2)
            seqs[1][2].append(batch.prefill(1, seqs[1][0], 0))
        if k == 3:   # slot 0's first sequence has left (it fed two tokens); a new one starts there from 0
            done.append(seqs.pop(0))
            seqs[0] = new(7)
            seqs[0][2].append(batch.prefill(0, seqs[0][0], 0))
        rows = [(slot, int(rng.integers(3, v))) for slot in slots]
        for (slot, token), logits in zip(rows, batch.step(rows)):
            seqs[slot][1].append(token)
            seqs[slot][2].append(logits)
    return done + list(seqs.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_sequences_decoded_together_equal_each_alone_and_the_reference(paths, device, rng, family):
    model, alone = load(paths[family], device), load(paths[family], device)
    source = open_model(paths[family])
    batch = Batch(model, 3)
    for prompt, fed, got in run_schedule(batch, source.config.vocab_size, rng):
        want, _ = forward64.model_forward(source, prompt + fed)
        single = alone_logits(alone, prompt, fed)
        assert len(got) == len(fed) + 1
        for j, logits in enumerate(got):
            assert relative_error(logits, single[j]) <= ALONE_TOLERANCE, (prompt, fed, j)
            assert relative_error(logits, want[len(prompt) - 1 + j]) <= REFERENCE_TOLERANCE, (prompt, fed, j)


def test_an_int8_kv_cache_per_sequence(paths, device, rng):
    """--kv q8: each sequence's cache in int8 codes and scales, as the load makes the first."""
    model, alone = load(paths["llama"], device, kv="q8"), load(paths["llama"], device, kv="q8")
    batch = Batch(model, 3)
    assert all(cache.form == "q8" for cache in batch.states[2][model.mixers[0]]["caches"])
    for prompt, fed, got in run_schedule(batch, open_model(paths["llama"]).config.vocab_size, rng):
        single = alone_logits(alone, prompt, fed)
        for j, logits in enumerate(got):
            assert relative_error(logits, single[j]) <= ALONE_TOLERANCE, (prompt, fed, j)


def test_rows_at_different_attention_partitions(paths, device, rng):
    """A sequence crossing the decode attention's first partition (128 positions at its defaults) beside a short
    one: each row's grid is its own, and the step recorded for one partition count is not replayed for another."""
    model = load(paths["llama"], device, ctx=200)
    source = open_model(paths["llama"])
    v = source.config.vocab_size
    batch = Batch(model, 2)
    prompts = [[int(t) for t in rng.integers(3, v, n)] for n in (127, 3)]
    for slot, prompt in enumerate(prompts):
        batch.prefill(slot, prompt, 0)
    fed, got = [[], []], [[], []]
    for _ in range(3):   # slot 0 at positions 127, 128, 129: one partition, then two
        rows = [(slot, int(rng.integers(3, v))) for slot in (1, 0)]
        for (slot, token), logits in zip(rows, batch.step(rows)):
            fed[slot].append(token)
            got[slot].append(logits)
    for slot, prompt in enumerate(prompts):
        want, _ = forward64.model_forward(source, prompt + fed[slot])
        for j, logits in enumerate(got[slot]):
            assert relative_error(logits, want[len(prompt) + j]) <= REFERENCE_TOLERANCE, (slot, j)


@pytest.mark.parametrize("family", ["llama", "lfm2", "qwen35"])
def test_a_slot_resumes_its_last_sequence_s_prefix(paths, device, rng, family):
    """A new prompt that repeats what a slot holds prefills only its new ids there (``resume_point``): a KV cache
    anywhere it has run, a recurrent state at its last position only (else from 0)."""
    model = load(paths[family], device)
    source = open_model(paths[family])
    v = source.config.vocab_size
    batch = Batch(model, 2)
    first = [int(t) for t in rng.integers(3, v, 6)]
    batch.prefill(1, first, 0)
    token = int(rng.integers(3, v))
    batch.step([(1, token)])
    more = [int(t) for t in rng.integers(3, v, 3)]
    start = batch.resume_point(1, len(first) + 1)
    assert start == len(first) + 1
    ids = first + [token] + more
    got = batch.prefill(1, ids[start:], start)
    want, _ = forward64.model_forward(source, ids)
    assert relative_error(got, want[-1]) <= REFERENCE_TOLERANCE
    expected_earlier = 3 if model.can_roll_back else 0
    assert batch.resume_point(1, 3) == expected_earlier


@pytest.mark.parametrize("family", ["llama", "lfm2", "qwen35", "gemma4", "llama-q8"])
def test_a_prompt_run_once_is_shared_into_other_slots(paths, device, rng, family):
    """``Batch.share``: a prompt run in one slot is copied on the device into two others (one of them holding
    another sequence first, whose state is replaced), at the prompt's end: the KV cache's rows (fp16, or q8's
    codes and scales; Gemma 4's caches of each shape), LFM2's conv rings, Qwen3.5's rings and recurrent S. Each
    slot then decodes its own tokens as if it had run the prompt itself: its logits are those of the sequence
    decoded alone, and the float64 forward's (fp16 caches: an int8 cache's rounding is its own, held to the
    sequence alone as ``test_an_int8_kv_cache_per_sequence`` holds it)."""
    family, kv = (family[:-3], "q8") if family.endswith("-q8") else (family, "f16")
    model, alone = load(paths[family], device, kv=kv), load(paths[family], device, kv=kv)
    source = open_model(paths[family])
    v = source.config.vocab_size
    batch = Batch(model, 3)
    assert batch.state_bytes == 2 * sequence_state_bytes(model) > 0
    batch.prefill(0, [int(t) for t in rng.integers(3, v, 13)], 0)      # slot 0 holds something else first
    prompt = [int(t) for t in rng.integers(3, v, 9)]
    first = batch.prefill(1, prompt, 0)
    for slot in (0, 2):
        assert batch.can_share(1, len(prompt))
        batch.share(1, slot, len(prompt))
    fed = {slot: [int(t) for t in rng.integers(3, v, 3)] for slot in range(3)}
    got = {slot: [first] for slot in range(3)}
    for k in range(3):
        rows = [(slot, fed[slot][k]) for slot in (2, 0, 1)]
        for (slot, _), logits in zip(rows, batch.step(rows)):
            got[slot].append(logits)
    for slot in range(3):
        want, _ = forward64.model_forward(source, prompt + fed[slot])
        single = alone_logits(alone, prompt, fed[slot])
        for j, logits in enumerate(got[slot]):
            assert relative_error(logits, single[j]) <= ALONE_TOLERANCE, (slot, j)
            assert kv == "q8" or relative_error(logits, want[len(prompt) - 1 + j]) <= REFERENCE_TOLERANCE, (slot, j)
    # Past the prompt's end: a KV cache still holds the prompt's positions, a conv ring its last 64; a recurrent
    # state has moved on, and sharing there is refused (the other slot runs the prompt itself)
    if model.can_roll_back:
        batch.share(1, 2, len(prompt))
        logits = batch.step([(2, fed[1][0])])[0]
        assert relative_error(logits, got[1][1]) <= ALONE_TOLERANCE
    else:
        assert not batch.can_share(1, len(prompt))
        with pytest.raises(PerfxError, match="does not hold its state at position 9"):
            batch.share(1, 2, len(prompt))
    with pytest.raises(PerfxError, match="cannot share its state with itself"):
        batch.share(1, 1, 3)


def test_choices_of_one_prompt_share_its_run(paths, device):
    """``Sequence.share_prompt``: choices of one prompt, greedy and sampled each with its own seed, in three slots,
    the prompt run in one of them only: each answers what ``generate`` answers for it alone."""
    model, alone = load(paths["llama"], device), load(paths["llama"], device)
    tokenizer = open_model(paths["llama"]).tokenizer
    ids = tokenizer.encode("Once upon a time", add_bos=tokenizer.add_bos_token)
    settings = [SamplingConfig(temperature=0), SamplingConfig(temperature=0.9, seed=4),
                SamplingConfig(temperature=0.9, seed=5)]
    expected = [generate(alone, tokenizer, ids, 10, sampling) for sampling in settings]
    batch = Batch(model, 3)
    prefilled = []
    real = batch.prefill
    batch.prefill = lambda slot, tokens, start, logits=True: prefilled.append(len(tokens)) or real(
        slot, tokens, start, logits)
    seqs = [Sequence(batch, slot, tokenizer, ids, 0, 10, sampling) for slot, sampling in enumerate(settings)]
    seqs[1].prefill_piece()
    seqs[0].share_prompt(seqs[1])
    seqs[2].share_prompt(seqs[1])
    assert prefilled == [len(ids)]
    while not all(seq.done for seq in seqs):
        live = [seq for seq in seqs if seq.decoding]
        for seq, logits in zip(live, batch.step([(seq.slot, seq.token) for seq in live])):
            seq.take(logits)
    for seq, want in zip(seqs, expected):
        got = seq.result()
        assert (got.ids, got.text, got.stats.stop_reason, got.end_pos) == (
            want.ids, want.text, want.stats.stop_reason, want.end_pos)
    assert expected[1].ids != expected[2].ids
    with pytest.raises(PerfxError, match="has not run this prompt"):
        Sequence(batch, 0, tokenizer, ids[:-1], 0, 3, settings[0]).share_prompt(seqs[1])


def test_requests_generated_together_answer_what_each_answers_alone(paths, device):
    """``Sequence`` in a batch, greedy and sampled with a seed, with stop rules and max tokens of their own and one
    joining late, gives ``generate``'s text, ids, stop reason and end position."""
    model, alone = load(paths["llama"], device), load(paths["llama"], device)
    source = open_model(paths["llama"])
    tokenizer = source.tokenizer
    requests = [
        ("Once upon a time", 12, SamplingConfig(temperature=0), []),
        ("The cat", 9, SamplingConfig(temperature=0.8, seed=5), []),
        ("A B C", 15, SamplingConfig(temperature=0, repetition_penalty=1.3), []),
        ("Hello there", 10, SamplingConfig(temperature=1.0, top_k=0, seed=9), []),
    ]
    batch = Batch(model, 3)
    expected = []
    for text, most, sampling, stop in requests:
        ids = tokenizer.encode(text, add_bos=tokenizer.add_bos_token)
        expected.append(generate(alone, tokenizer, ids, most, sampling, stop_strings=stop))
    waiting = list(enumerate(requests))
    running: dict[int, tuple[int, Sequence]] = {}
    results = {}
    steps = 0
    while waiting or running:
        for slot in range(batch.slots):   # a free slot takes the next request; the first three start at once
            if slot not in running and waiting and (steps > 1 or len(running) < 3):
                index, (text, most, sampling, stop) = waiting.pop(0)
                ids = tokenizer.encode(text, add_bos=tokenizer.add_bos_token)
                seq = Sequence(batch, slot, tokenizer, ids, 0, most, sampling, stop)
                seq.prefill_piece(2)   # in pieces, as serve does between steps
                while not seq.decoding and not seq.done:
                    seq.prefill_piece(2)
                running[slot] = (index, seq)
        live = [(slot, seq) for slot, (_, seq) in running.items() if seq.decoding]
        if live:
            for (slot, seq), logits in zip(live, batch.step([(slot, seq.token) for slot, seq in live])):
                seq.take(logits)
        for slot in [slot for slot, (_, seq) in running.items() if seq.done]:
            index, seq = running.pop(slot)
            results[index] = seq.result()
        steps += 1
    for index, want in enumerate(expected):
        got = results[index]
        assert (got.ids, got.text, got.stats.stop_reason, got.end_pos) == (
            want.ids, want.text, want.stats.stop_reason, want.end_pos), requests[index]


def test_the_norms_quantize_once_for_a_batched_step_s_int8_activation_gemms(paths, device, monkeypatch):
    """Where a batched step's int4 GEMMs take int8 activations (gemm_q4_i8, as the shipped tuning runs them on
    Intel's CPU runtime), the norms before qkv and gate-up write xb's Q8_1 blocks for every row and those GEMMs
    launch no quantizing of their own: a step of a dense model quantizes only o's and down's inputs. The blocks
    are the bytes the GEMM's own launch writes (one macro, kernels/q8_1.h), so the logits equal those of the
    step with every GEMM quantizing, to the bit, and the float64 forward's and each sequence decoded alone within
    int8 activations' tolerance."""
    # the int8-activation kind timed fastest at every bucket, as a tuned device's entries would have it
    monkeypatch.setattr(plan_module, "one_run_costs", lambda choices, anchor: {"skinny": 2.0, "i8": 1.0}
                        if anchor == "skinny" and "i8" in choices else {})
    source = open_model(paths["llama"])
    prompts = [[3, 9, 4, 12], [5, 7], [8, 6, 11]]
    rows = [[(0, 13), (1, 14), (2, 15)], [(0, 16), (2, 17)]]

    def steps(model):
        batch = Batch(model, 3)
        for slot, prompt in enumerate(prompts):
            batch.prefill(slot, prompt, 0)
        out = [batch.step(step) for step in rows]
        names = [launch.kernel.function_name for replay in batch._replays.values() for launch in replay.steps
                 if getattr(launch, "kernel", None) is not None]
        return out, names

    model, alone = load(paths["llama"], device), load(paths["llama"], device)
    gemms = model.plan.prefill(3)[0]
    assert {gemms[role].kind for role in ("qkv", "o", "gate_up", "down")} == {"i8"}
    got, names = steps(model)
    mixing = [model.mixers[0].weights[i] for i in model.mixers[0].layers]

    def int4(*linears):   # the tiny model holds some matrices in other forms, run by other kernels
        return len(rows) * sum(isinstance(linear, Q4Linear) for linear in linears)
    outputs = int4(*[w.o for w in mixing], *[w.down for w in model.weights.layers])
    inputs = int4(*[w.qkv for w in mixing], *[w.gate_up for w in model.weights.layers])
    assert inputs and names.count("gemm_q4_i8_quantize_x") == outputs, "only o's and down's inputs"
    # against the exact float64 forward, the int8 activations' rounding: the int4 GEMV's I8 bound (its spec says
    # why), which holds a whole model's logits as it holds one product's
    tolerance = SPECS["gemv_q4"].tolerance_for({"I8": 1})
    for step, logits in zip(rows, got):
        for (slot, token), row in zip(step, logits):
            fed = [t for earlier in rows[:rows.index(step)] for s, t in earlier if s == slot] + [token]
            want, _ = forward64.model_forward(source, prompts[slot] + fed)
            assert relative_error(row, want[-1]) <= tolerance, (slot, fed)
            # decoded alone (the GEMVs of one row, their activations as this device's tuning has them), the same
            # bound: the batched step's int8 rounding of X is the whole difference
            assert relative_error(row, alone_logits(alone, prompts[slot], fed)[-1]) <= tolerance, (slot, fed)

    monkeypatch.setattr(Model, "_rows_order", lambda self, readers, m: 0)
    apart = load(paths["llama"], device)
    want, apart_names = steps(apart)
    assert apart_names.count("gemm_q4_i8_quantize_x") == outputs + inputs
    for a, b in zip(got, want):
        assert np.array_equal(a, b)


def test_bad_batches_are_clear_errors(paths, device, monkeypatch):
    model = load(paths["llama"], device, ctx=8)
    with monkeypatch.context() as patch:   # a layer kind with no forward_rows of its own
        patch.setattr(type(model.mixers[0]), "forward_rows", Mixer.forward_rows)
        with pytest.raises(PerfxError, match="attention layers cannot decode several sequences together yet: use "
                                             "--parallel 1"):
            Batch(model, 2)
        assert default_parallel(model) == 1
    assert default_parallel(model) == 4   # a CPU device batches too
    with monkeypatch.context() as patch:   # where 4 sequences' state would take over a quarter of the memory: fewer
        per = sequence_state_bytes(model)
        patch.setattr(model.device, "caps", dataclasses.replace(model.device.caps, global_mem=4 * (2 * per + 1)))
        assert default_parallel(model) == 2
        patch.setattr(model.device, "caps", dataclasses.replace(model.device.caps, global_mem=per))
        assert default_parallel(model) == 1
    with pytest.raises(PerfxError, match="--parallel must be between 1 and 8"):
        Batch(model, 9)
    batch = Batch(model, 2)
    batch.prefill(0, [3, 4, 5, 6, 7, 8, 9], 0)
    batch.prefill(1, [3], 0)
    with pytest.raises(PerfxError, match="distinct slots"):
        batch.step([(1, 3), (1, 4)])
    with pytest.raises(PerfxError, match="slot 2 is outside"):
        batch.step([(2, 3)])
    with pytest.raises(PerfxError, match="outside the vocabulary"):
        batch.step([(1, 10**6)])
    batch.step([(0, 3)])
    with pytest.raises(PerfxError, match=r"context full in slot\(s\) \[0\]"):
        batch.step([(0, 3), (1, 4)])
    with pytest.raises(PerfxError, match="position 5 cannot be resumed"):
        batch.prefill(1, [3], 5)
