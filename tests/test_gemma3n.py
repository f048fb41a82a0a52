"""Gemma 3n: its recipe from a GGUF (as llama.cpp's converter writes it) and from config.json, and its float64
forward (perfx.forward64) against an independent re-implementation of llama.cpp's gemma3n graph
(helpers.gemma3n_models.reference_logits) on a tiny file: AltUp's four streams (predict, correct, the router),
LAuReL, the sparse gates of the first layers, per-layer embeddings and KV sharing; and the device forward
against the float64 one, from GGUF and Hugging Face files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.gemma3n_models import TINY, make_gemma3n, reference_logits, write_gemma3n_gguf, write_gemma3n_hf
from perfx import cli
from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.families.gemma3n import E2B
from perfx.forward64 import model_forward
from perfx.model import Model
from perfx.sources.gguf import GGUFSource
from perfx.sources.huggingface import HFSource
from perfx.sources.synthetic import SYNTHETIC_MODELS, SyntheticSource
from perfx.tuning import relative_error
from perfx.tuning.database import default_database

# float64 on both sides over the same held weights: only summation order differs (1e-14 seen)
TOLERANCE = 1e-9


@pytest.mark.parametrize("seed", [0, 1])
def test_forward64_follows_llamacpps_gemma3n_graph(tmp_path, seed):
    rng = np.random.default_rng(seed)
    model = write_gemma3n_gguf(tmp_path / "tiny.gguf", make_gemma3n(rng))
    source = GGUFSource(tmp_path / "tiny.gguf")
    tokens = rng.integers(0, TINY["vocab_size"], 11)
    expected = reference_logits(model, tokens)
    logits, _ = model_forward(source, tokens)
    assert np.abs(logits - expected).max() < TOLERANCE
    first, cache = model_forward(source, tokens[:6])
    rest, _ = model_forward(source, tokens[6:], 6, cache)
    assert np.abs(np.concatenate([first, rest]) - expected).max() < TOLERANCE
    # the checks can fail: without the sparse gates the logits move
    dense = GGUFSource(tmp_path / "tiny.gguf")
    dense.config.sparsity = (0.0,) * len(dense.config.sparsity)
    assert np.abs(model_forward(dense, tokens)[0] - expected).max() > 1e-3


def test_gguf_and_config_json_give_one_recipe(tmp_path):
    model = write_gemma3n_gguf(tmp_path / "tiny.gguf", make_gemma3n(np.random.default_rng(2)))
    from_gguf, from_hf = GGUFSource(tmp_path / "tiny.gguf").config, ModelConfig.from_hf(dict(model.config))
    for name in ("altup_inputs", "altup_active", "laurel_rank", "sparsity", "per_layer_input", "value_norm",
                 "intermediate_size", "final_softcap", "attention_scale", "embedding_scale", "head_dim"):
        assert getattr(from_gguf, name) == getattr(from_hf, name), name
    assert from_gguf.layers == from_hf.layers
    wrapped = ModelConfig.from_hf({"model_type": "gemma3n", "text_config": dict(model.config)})
    assert wrapped.layers == from_hf.layers


def test_the_e2b_preset():
    c = SYNTHETIC_MODELS["gemma-3n-e2b"][0]
    assert (c.n_layers, c.hidden_size, c.altup_inputs, c.laurel_rank, c.per_layer_input) == (30, 2048, 4, 64, 256)
    assert sum(1 for s in c.sparsity if s) == 10 and [r.kv_from for r in c.layers][20:] == [18, 18, 18, 18, 19] * 2
    assert E2B["num_kv_shared_layers"] == 10


# The device forward against the float64 one over the same file: the int4 and int8 GEMVs and GEMMs take
# int8-quantized activations (Q8_1 blocks, as llama.cpp's), the caches hold fp16 K and V, the AltUp projections
# run in fp16 as the file holds them: the families' tolerance (tests/test_families.py DEVICE_TOLERANCE), relative
# to the largest logit (measured 2.4e-4 to 3.6e-4 on both runtimes).
DEVICE_TOLERANCE = 2e-3


def test_the_device_forward_follows_forward64(tmp_path, device):
    rng = np.random.default_rng(10)
    write_gemma3n_gguf(tmp_path / "tiny.gguf", make_gemma3n(rng))
    source = GGUFSource(tmp_path / "tiny.gguf")
    model = Model.load(source, device, ctx=64, database=default_database(False))
    tokens = [int(t) for t in rng.integers(0, TINY["vocab_size"], 14)]
    want, _ = model_forward(source, tokens)
    # a prompt past the window of 5, decode steps, a second prompt continuing the first (the KV-sharing layers
    # read the cache their source appended in another call)
    model.prefill(tokens[:9], 0)
    assert relative_error(model.logits(), want[8]) <= DEVICE_TOLERANCE
    for pos in range(9, 11):
        model.decode_one(tokens[pos], pos)
        assert relative_error(model.logits(), want[pos]) <= DEVICE_TOLERANCE, pos
    model.prefill(tokens[11:], 11)
    assert relative_error(model.logits(), want[-1]) <= DEVICE_TOLERANCE
    # every position's logits (perplexity): the head over each row of a prompt
    model.prefill_logits(tokens[:9], 0, first=2)
    got = model.prefill_logits(tokens, 0, first=3)
    assert max(relative_error(g, w) for g, w in zip(got, want[3:])) <= DEVICE_TOLERANCE
    # the check can fail: the logits of another position; and the sparse gates matter on the device too
    assert relative_error(model.logits(), want[-2]) > DEVICE_TOLERANCE
    dense = GGUFSource(tmp_path / "tiny.gguf")
    dense.config.sparsity = (0.0,) * len(dense.config.sparsity)
    assert relative_error(model_forward(dense, tokens)[0][-1], want[-1]) > DEVICE_TOLERANCE


def test_greedy_tokens_on_the_device_are_float64s(tmp_path, device):
    """The decode loop on the device (each step's token chosen there and handed to the next) gives the tokens the
    float64 forward picks; the margins between the top two logits are far above the device's error here."""
    rng = np.random.default_rng(21)
    write_gemma3n_gguf(tmp_path / "tiny.gguf", make_gemma3n(rng))
    source = GGUFSource(tmp_path / "tiny.gguf")
    model = Model.load(source, device, ctx=64, database=default_database(False))
    prompt = [int(t) for t in rng.integers(0, TINY["vocab_size"], 7)]
    expected, tokens = [], list(prompt)
    for _ in range(6):
        logits, _ = model_forward(source, tokens)
        top = np.sort(logits[-1])[-2:]
        assert top[1] - top[0] > 0.05, "a near-tie: the float64 reference cannot say which token is right"
        expected.append(int(np.argmax(logits[-1])))
        tokens.append(expected[-1])
    model.prefill(prompt[:-1], 0)
    got = list(model.greedy_tokens(prompt[-1], len(prompt) - 1, len(prompt) + 4))
    assert got == expected


def test_a_hugging_face_checkpoint_is_the_same_model(tmp_path):
    """The GGUF's weights (fp16 where quantized types would not be exact in fp16) as the multimodal checkpoint,
    its per-layer table holding the text vocabulary's rows only, give the same float64 forward."""
    made = make_gemma3n(np.random.default_rng(6))
    made.weights["per_layer_token_embd.weight"][90:] = 0   # the vision and audio tokens' rows, padded by the converter
    fp16 = {name: "F16" for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                                     "inp_gate", "laurel_l")}
    model = write_gemma3n_gguf(tmp_path / "tiny.gguf", made, types=fp16, table_type="F16", embedding_type="F16")
    directory = write_gemma3n_hf(tmp_path / "hf", model, text_rows=90)
    gguf_source, hf_source = GGUFSource(tmp_path / "tiny.gguf", lm_head="fp16"), HFSource(directory, lm_head="fp16")
    tokens = np.random.default_rng(7).integers(0, TINY["vocab_size"], 9)
    want, _ = model_forward(gguf_source, tokens)
    got, _ = model_forward(hf_source, tokens)
    assert np.abs(got - want).max() < TOLERANCE
    assert np.abs(got - reference_logits(model, tokens)).max() < TOLERANCE


@pytest.mark.parametrize("quantize", [None, "q4"])
def test_a_hugging_face_checkpoint_on_the_device(tmp_path, device, quantize):
    """The multimodal checkpoint as it is (fp16: the fp16 GEMV, row by row) and rounded to int4 on load (LAuReL's
    pair among the int4 matrices) follows its float64 forward."""
    made = make_gemma3n(np.random.default_rng(8))
    made.weights["per_layer_token_embd.weight"][90:] = 0   # the vision and audio tokens' rows
    model = write_gemma3n_gguf(tmp_path / "tiny.gguf", made)
    source = HFSource(write_gemma3n_hf(tmp_path / "hf", model, text_rows=90), quantize=quantize)
    device_model = Model.load(source, device, ctx=32, database=default_database(False))
    tokens = [int(t) for t in np.random.default_rng(9).integers(0, 90, 8)]
    want, _ = model_forward(source, tokens)
    device_model.prefill(tokens[:6], 0)
    assert relative_error(device_model.logits(), want[5]) <= DEVICE_TOLERANCE
    for pos in (6, 7):
        device_model.decode_one(tokens[pos], pos)
        assert relative_error(device_model.logits(), want[pos]) <= DEVICE_TOLERANCE


def test_a_synthetic_model_runs_the_same_maths(device):
    """A synthetic Gemma 3n (what `synthetic:gemma-3n-e2b` is at E2B's shapes: random int4 matrices, AltUp's
    tables and coefficients) on the device against its float64 forward."""
    config = ModelConfig.from_hf(dict(TINY, hidden_size=128, laurel_rank=32, hidden_size_per_layer_input=32))
    source = SyntheticSource("tiny-gemma3n", config, 32)
    model = Model.load(source, device, ctx=32, database=default_database(False))
    tokens = [int(t) for t in np.random.default_rng(11).integers(0, TINY["vocab_size"], 6)]
    want, _ = model_forward(source, tokens)
    model.prefill(tokens[:5], 0)
    assert relative_error(model.logits(), want[4]) <= DEVICE_TOLERANCE
    model.decode_one(tokens[5], 5)
    assert relative_error(model.logits(), want[5]) <= DEVICE_TOLERANCE


def test_perfx_generate_runs_a_gemma3n_file(tmp_path, capsys):
    """`perfx generate --model tiny.gguf` as a user runs it (speculation on its own choice): its greedy tokens are
    float64's."""
    write_gemma3n_gguf(tmp_path / "tiny.gguf", make_gemma3n(np.random.default_rng(14)))   # no near-tie in 5 tokens
    code = cli.main(["generate", "--model", str(tmp_path / "tiny.gguf"), "--raw", "--temperature", "0",
                     "--max-tokens", "5", "--json", "hello"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["ids"]) == 5
    tokens = list(out["prompt_ids"])
    source = GGUFSource(tmp_path / "tiny.gguf")
    for got in out["ids"]:
        logits = model_forward(source, tokens)[0][-1]
        top = np.sort(logits)[-2:]
        assert top[1] - top[0] > 0.05, "a near-tie: the float64 reference cannot say which token is right"
        assert got == int(np.argmax(logits))
        tokens.append(got)


def test_a_recipe_the_device_does_not_run_is_one_clear_error(tmp_path, device):
    write_gemma3n_gguf(tmp_path / "tiny.gguf", make_gemma3n(np.random.default_rng(3)))
    source = GGUFSource(tmp_path / "tiny.gguf")
    source.config.altup_active = 1
    with pytest.raises(PerfxError, match="active stream is 1"):
        Model.load(source, device, ctx=32, database=default_database(False))


# With an int8 cache, its rounding too (half a code of 127 per value), as tests/test_kv_q8.py's VS_F16_TOLERANCE
# (measured 1.2e-2 here on Intel's runtime)
Q8_CACHE_TOLERANCE = 3e-2


def test_an_int8_kv_cache(tmp_path, device):
    rng = np.random.default_rng(10)
    write_gemma3n_gguf(tmp_path / "tiny.gguf", make_gemma3n(rng))
    source = GGUFSource(tmp_path / "tiny.gguf")
    model = Model.load(source, device, ctx=64, database=default_database(False), kv="q8")
    tokens = [int(t) for t in rng.integers(0, TINY["vocab_size"], 12)]
    want, _ = model_forward(source, tokens)
    model.prefill(tokens[:9], 0)
    assert relative_error(model.logits(), want[8]) <= Q8_CACHE_TOLERANCE
    for pos in range(9, 12):
        model.decode_one(tokens[pos], pos)
        assert relative_error(model.logits(), want[pos]) <= Q8_CACHE_TOLERANCE, pos


def test_per_layer_inputs_wider_than_the_mlp_on_the_device(tmp_path, device):
    """The fp16 per-layer model projection (as the converter stores it) makes n_layers·P values a token, more than
    the MLP's width here (6·48 = 288 against 2·96): the fp16 GEMV's scratch rows hold it, and the device's logits
    are the float64 forward's."""
    made = make_gemma3n(np.random.default_rng(23), hidden_size_per_layer_input=48)
    write_gemma3n_gguf(tmp_path / "tiny.gguf", made)
    source = GGUFSource(tmp_path / "tiny.gguf")
    model = Model.load(source, device, ctx=64, database=default_database(False))
    tokens = [int(t) for t in np.random.default_rng(24).integers(0, TINY["vocab_size"], 8)]
    want, _ = model_forward(source, tokens)
    model.prefill(tokens[:7], 0)
    assert relative_error(model.logits(), want[6]) <= DEVICE_TOLERANCE
    model.decode_one(tokens[7], 7)
    assert relative_error(model.logits(), want[7]) <= DEVICE_TOLERANCE
