"""Gemma 3n: its recipe from a GGUF (as llama.cpp's converter writes it) and from config.json, and its float64
forward (perfx.forward64) against an independent re-implementation of llama.cpp's gemma3n graph
(helpers.gemma3n_models.reference_logits) on a tiny file: AltUp's four streams (predict, correct, the router),
LAuReL, the sparse gates of the first layers, per-layer embeddings and KV sharing. The device refuses it."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.gemma3n_models import TINY, make_gemma3n, reference_logits, write_gemma3n_gguf, write_gemma3n_hf
from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.families.gemma3n import E2B
from perfx.forward64 import model_forward
from perfx.model import Model
from perfx.sources.gguf import GGUFSource
from perfx.sources.huggingface import HFSource
from perfx.sources.synthetic import SYNTHETIC_MODELS
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


def test_the_e2b_preset_and_the_devices_refusal(tmp_path, device):
    c = SYNTHETIC_MODELS["gemma-3n-e2b"][0]
    assert (c.n_layers, c.hidden_size, c.altup_inputs, c.laurel_rank, c.per_layer_input) == (30, 2048, 4, 64, 256)
    assert sum(1 for s in c.sparsity if s) == 10 and [r.kv_from for r in c.layers][20:] == [18, 18, 18, 18, 19] * 2
    assert E2B["num_kv_shared_layers"] == 10
    write_gemma3n_gguf(tmp_path / "tiny.gguf", make_gemma3n(np.random.default_rng(3)))
    with pytest.raises(PerfxError, match="float64 only"):
        Model.load(GGUFSource(tmp_path / "tiny.gguf"), device, ctx=32, database=default_database(False))


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
