"""Sampling on the device inside the decode loop (``Model.sampled_tokens``): each step draws its token with the
sample kernel, appends it to the penalty's window on the device and hands it on, the host a step ahead. The
tokens equal the host loop's (``PositionalState.sampled_tokens``: feed, read the logits, draw from the host
sampler's distribution with the same Philox uniform), and `generate` with a seed uses the device loop."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers.family_models import family_tokenizer, make_family_model, write_family_gguf
from helpers.tiny_models import make_tiny_model, tiny_tokenizer, write_gguf
from perfx.errors import PerfxError
from perfx.generate import PositionalState, SamplingConfig, generate
from perfx.model import Model
from perfx.sources import open_model
from perfx.tuning.database import default_database

RECORDED = json.loads((Path(__file__).parent / "data" / "llamacpp_families.json").read_text())["families"]
PROMPT = [3, 9, 14, 5, 27, 8, 2]
CONFIG = SamplingConfig(temperature=0.9, top_k=20, top_p=0.95, min_p=0.02, repetition_penalty=1.3, seed=77)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Llama-shaped GGUF (its state rolls back: the loop runs a step ahead) and the recorded Qwen3.5
    (recurrent state: step by step)."""
    root = tmp_path_factory.mktemp("sampled")
    out = {"llama": write_gguf(root / "gqa3.gguf", make_tiny_model("gqa3", tiny_tokenizer(root),
                                                                    np.random.default_rng(11))).path}
    settings = dict(RECORDED["qwen35"]["make_family_model"])
    model = make_family_model(settings.pop("family"), family_tokenizer(root, "qwen35"),
                              np.random.default_rng(settings.pop("seed")), **settings)
    out["qwen35"] = write_family_gguf(root / "qwen35.gguf", model, **RECORDED["qwen35"]["write_family_gguf"]).path
    return out


def load(path, device) -> Model:
    return Model.load(open_model(path), device, ctx=96, progress=False, database=default_database(False))


@pytest.mark.parametrize("kind", ["llama", "qwen35"])
def test_the_device_draws_the_host_loop_s_tokens(models, device, kind):
    on_device, on_host = load(models[kind], device), load(models[kind], device)
    for model in (on_device, on_host):
        model.prefill(PROMPT, 0)
    first, count, seed = 4, 40, 1234567
    seen = PROMPT + [first]
    last = len(PROMPT) + count - 1
    want = list(PositionalState.sampled_tokens(on_host, first, len(PROMPT), last, CONFIG, seed, seen))
    got = list(on_device.sampled_tokens(first, len(PROMPT), last, CONFIG, seed, seen))
    assert got == want
    assert len(set(got)) > 5, "the draws vary"
    assert on_device.samples_on_device(CONFIG) == on_device.can_roll_back


def test_generate_with_a_seed_draws_on_the_device(models, device):
    """`generate` with a seed: the first token from the host sampler (the prefill's logits), every later one
    drawn on the device, equal to the host loop's from there; a second run gives the same reply."""
    model, on_host = load(models["llama"], device), load(models["llama"], device)
    assert model.samples_on_device(CONFIG)
    result = generate(model, None, PROMPT, 24, CONFIG)
    assert result.stats.stop_reason == "max tokens" and len(result.ids) == 24
    on_host.prefill(PROMPT, 0)
    first = result.ids[0]
    rest = list(PositionalState.sampled_tokens(on_host, first, len(PROMPT), len(PROMPT) + 22, CONFIG, CONFIG.seed,
                                               PROMPT + [first]))
    assert result.ids == [first] + rest
    assert model.written == result.end_pos, "no step ran past the last token fed"
    again = generate(load(models["llama"], device), None, PROMPT, 24, CONFIG)
    assert again.ids == result.ids


def test_settings_the_device_does_not_serve_stay_on_the_host(models, device):
    model = load(models["llama"], device)
    wide = SamplingConfig(temperature=0.9, top_k=0, seed=3)    # no top-k over a vocabulary above TOPK
    if model.config.vocab_size > 64:
        assert not model.samples_on_device(wide)
        model.prefill([3, 4], 0)
        with pytest.raises(PerfxError, match="is not drawn on the device"):
            model.sampled_tokens(5, 2, 4, wide, 3, [3, 4, 5])
    with pytest.raises(PerfxError, match="outside the context"):
        model.sampled_tokens(5, 2, model.max_positions, CONFIG, 3, [3, 4, 5])
    assert not model.samples_on_device(SamplingConfig(temperature=0))   # greedy: the argmax loop's
