"""The decode loop on the device (``Model.greedy_tokens``): each step chooses its token and hands it to the next
step on the device, the host a step ahead. The token streams equal the synchronous loop's (feed, then read the
argmax), bit for bit, on every model kind and OpenCL implementation; a consumer that stops early leaves the
cache as a forward from there needs; the hand-over kernel against its definition."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers.family_models import family_tokenizer, make_family_model, write_family_gguf
from helpers.tiny_models import make_tiny_model, tiny_tokenizer, write_gguf
from perfx.generate import SamplingConfig, generate
from perfx.model import TOKEN_RING, Model
from perfx.ops.decode_loop import NextStep
from perfx.sources import open_model
from perfx.tuning.database import default_database
from perfx.tuning.spec import relative_error

RECORDED = json.loads((Path(__file__).parent / "data" / "llamacpp_families.json").read_text())["families"]


def test_next_step_hands_the_chosen_token_to_the_next_step(device):
    rng = np.random.default_rng(3)
    for capacity in (1, 3, TOKEN_RING):
        token, pos = int(rng.integers(0, 1 << 20)), int(rng.integers(0, 1 << 16))
        chosen = device.empty(1, np.int32)
        chosen.set(np.array([token], np.int32))
        step = device.empty(2, np.int32)
        step.set(np.array([int(rng.integers(0, 1 << 20)), pos], np.int32))
        tokens = device.empty(capacity, np.int32)
        tokens.set(np.full(capacity, -7, np.int32))   # poisoned: a slot written by mistake shows
        NextStep(device)(chosen, step, tokens, capacity)
        want = np.full(capacity, -7, np.int32)
        want[(pos + 1) % capacity] = token
        assert step.get().tolist() == [token, pos + 1]
        assert tokens.get().tolist() == want.tolist()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama-shaped GGUF (attention only), and the recorded LFM2 (conv) and Qwen3.5 (Gated DeltaNet)."""
    root = tmp_path_factory.mktemp("loop")
    out = {"llama": write_gguf(root / "gqa3.gguf", make_tiny_model("gqa3", tiny_tokenizer(root),
                                                                    np.random.default_rng(11))).path}
    for family in ("lfm2", "qwen35"):
        settings = dict(RECORDED[family]["make_family_model"])
        model = make_family_model(settings.pop("family"), family_tokenizer(root, family),
                                  np.random.default_rng(settings.pop("seed")), **settings)
        out[family] = write_family_gguf(root / f"{family}.gguf", model,
                                        **RECORDED[family]["write_family_gguf"]).path
    return out


def load(path, device) -> Model:
    return Model.load(open_model(path), device, ctx=96, progress=False, database=default_database(False))


def synchronous(model: Model, token: int, pos: int, count: int) -> list[int]:
    out = []
    for q in range(pos, pos + count):
        model.decode_one(token, q)
        token = model.argmax()
        out.append(token)
    return out


@pytest.mark.parametrize("kind", ["llama", "lfm2", "qwen35"])
def test_the_device_loop_gives_the_synchronous_loop_s_tokens(models, device, kind):
    """Greedy tokens chosen on the device a step ahead are the synchronous loop's, across the attention's
    partition counts (a grid that grows with the position); a consumer that stops after a few tokens leaves
    the cache as a forward there needs: feeding another token there gives the synchronous model's logits."""
    prompt = [3, 9, 14, 5, 27, 8, 2]
    ahead, step_by_step = load(models[kind], device), load(models[kind], device)
    for model in (ahead, step_by_step):
        model.prefill(prompt, 0)
    first = ahead.argmax()
    assert first == step_by_step.argmax()
    count = 80
    want = synchronous(step_by_step, first, len(prompt), count)
    got = list(ahead.greedy_tokens(first, len(prompt), len(prompt) + count - 1))
    assert got == want

    # stopped after 3 tokens: the loop ran a fourth step past them; the next forward overwrites it
    ahead, step_by_step = load(models[kind], device), load(models[kind], device)
    for model in (ahead, step_by_step):
        model.prefill(prompt, 0)
    stream = ahead.greedy_tokens(first, len(prompt), len(prompt) + count - 1)
    got = [next(stream) for _ in range(3)]
    assert got == synchronous(step_by_step, first, len(prompt), 3)
    other = (got[-1] + 1) % ahead.config.vocab_size
    for model in (ahead, step_by_step):
        model.decode_one(other, len(prompt) + 3)
    assert np.array_equal(ahead.logits(), step_by_step.logits())


def test_generate_uses_the_device_loop_and_stops_where_the_synchronous_loop_does(models, device):
    """`generate` greedy: the device loop's reply equals the synchronous loop's to the token, ends at max tokens
    without a step past it, and a second turn continuing the cache gives the logits of a fresh run."""
    prompt = [3, 9, 14, 5, 27, 8, 2]
    model, step_by_step = load(models["llama"], device), load(models["llama"], device)
    result = generate(model, None, prompt, 12, SamplingConfig(temperature=0))
    step_by_step.prefill(prompt, 0)
    first = step_by_step.argmax()
    assert result.ids == [first] + synchronous(step_by_step, first, len(prompt), 11)
    assert result.stats.stop_reason == "max tokens" and result.end_pos == len(prompt) + 11
    assert model.written == result.end_pos, "no step ran past the last token fed"
    follow = [4, 6]
    model.prefill(follow, result.end_pos)
    fresh = load(models["llama"], device)
    fresh.prefill(prompt + result.ids[:-1] + follow, 0)
    assert relative_error(model.logits(), fresh.logits()) <= 1e-4   # fp32 sums in another order


def test_the_device_loop_refuses_positions_outside_the_context(models, device):
    model = load(models["llama"], device)
    model.prefill([3, 4], 0)
    with pytest.raises(Exception, match="outside the context"):
        next(model.greedy_tokens(5, 2, model.max_positions))
