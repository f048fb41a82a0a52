"""Qwen3.5-MoE (qwen35moe): Qwen3.5's Gated DeltaNet hybrid with a mixture of experts and a σ-gated shared expert on
every layer, from a tiny GGUF written as llama.cpp's converter writes it (gguf-py's names and keys:
ffn_gate_inp, ffn_{gate,up,down}_exps, ffn_gate_inp_shexp, ffn_{gate,up,down}_shexp,
expert_shared_feed_forward_length) and the Hugging Face directory of the same weights (Qwen3_5MoeForCausalLM's
mlp.gate, mlp.experts.{e}.*, mlp.shared_expert.*, mlp.shared_expert_gate)."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers.family_models import family_tokenizer, make_family_model, write_family_gguf, write_family_hf
from perfx import forward64, moe
from perfx.batch import Batch
from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.model import Model
from perfx.sources import open_model
from perfx.sources.synthetic import SYNTHETIC_MODELS, SyntheticSource
from perfx.op import StepOptions
from perfx.step import decode_step
from perfx.tuning.database import default_database
from perfx.tuning.spec import relative_error
from test_batch import alone_logits, run_schedule

# The device forward against the float64 one: fp16 KV cache and int8 activations of the int8 matrices, as
# tests/test_families.py holds every family to
DEVICE_TOLERANCE = 2e-3
# fp16 experts of the directory held as int8 against the GGUF's own (tests/test_moe.py's bound)
HF_TOLERANCE = 0.05
ALONE_TOLERANCE = 1e-4   # tests/test_batch.py's: a batched row against the same sequence alone
PROMPT = [5, 9, 13, 2, 17, 30, 4]


def write(root, seed: int = 5, drop=(), **overrides):
    model = make_family_model("qwen35moe", family_tokenizer(root, "qwen35moe"), np.random.default_rng(seed),
                              **overrides)
    for name in drop:
        del model.weights[name]
    return model, write_family_gguf(root / f"q{seed}-{len(drop)}-{len(overrides)}.gguf", model)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35moe")
    model, written = write(root)
    hub = write_family_hf(root / "hub", model, written.weights, dtype="F32")
    return {"gguf": written.path, "hub": hub, "root": root}


def test_the_gguf_and_the_directory_give_one_recipe(files):
    g, h = open_model(files["gguf"]).config, open_model(files["hub"]).config
    assert (g.n_experts, g.n_experts_used, g.expert_intermediate, g.expert_shared) == (6, 2, 32, 64)
    assert g.expert_gating == "softmax" and g.expert_norm and g.expert_shared_gate and g.moe_layers == [0, 1, 2, 3]
    assert [r.kind for r in g.layers] == ["delta", "delta", "delta", "attention"]
    # the head maps differ by design (the converter tiles the v heads, the checkpoint groups them)
    for field in type(g).__dataclass_fields__:
        if field not in ("architecture", "delta_head_map", "max_positions", "extra"):
            assert getattr(g, field) == getattr(h, field), field


def test_the_float64_moe_block_adds_the_gated_shared_expert(files):
    """moe.reference is the routed experts plus σ(x·g)·down(SiLU(gate·x)·up·x), computed here from the file's own
    tensors as transformers' Qwen3_5MoeSparseMoeBlock does."""
    source = open_model(files["gguf"])
    c, w = source.config, source.layer(1).moe
    x = np.random.default_rng(3).standard_normal((4, c.hidden_size))
    gate_up = x @ np.asarray(w.shared_gate_up.dequantize() if hasattr(w.shared_gate_up, "dequantize")
                             else w.shared_gate_up, np.float64).T
    down = np.asarray(w.shared_down.dequantize() if hasattr(w.shared_down, "dequantize") else w.shared_down)
    s = c.expert_shared
    shared = (gate_up[:, :s] / (1 + np.exp(-gate_up[:, :s])) * gate_up[:, s:]) @ np.asarray(down, np.float64).T
    shared *= 1 / (1 + np.exp(-(x @ w.shared_gate.astype(np.float64))))[:, None]
    routed = moe.reference(x, moe.MoEWeights(router=w.router, gate_up=w.gate_up, down=w.down), c)
    np.testing.assert_allclose(moe.reference(x, w, c), routed + shared, rtol=1e-10, atol=1e-12)
    assert np.abs(shared).max() > 0.1 * np.abs(routed).max()   # the shared expert weighs in


def test_the_directory_runs_as_the_gguf(files, device):
    want, _ = forward64.model_forward(open_model(files["gguf"]), PROMPT, ctx=64)
    hub = open_model(files["hub"])
    got, _ = forward64.model_forward(hub, PROMPT, ctx=64)
    assert relative_error(got[-1], want[-1]) <= HF_TOLERANCE
    model = Model.load(hub, device, ctx=64, progress=False, database=default_database(False))
    model.prefill(PROMPT, 0)
    assert relative_error(model.logits(), got[-1]) <= DEVICE_TOLERANCE


def test_the_multimodal_checkpoint_reads_its_text_model(files, tmp_path):
    """Qwen3_5MoeForConditionalGeneration's config.json: the text_config is run, its weights under
    model.language_model."""
    directory = tmp_path / "mm"
    shutil.copytree(files["hub"], directory)
    text = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text,
                                                       "tie_word_embeddings": False,
                                                       "architectures": ["Qwen3_5MoeForConditionalGeneration"]}))
    weights = load_file(str(directory / "model.safetensors"))
    save_file({(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
               for k, v in weights.items()}, str(directory / "model.safetensors"))
    want, _ = forward64.model_forward(open_model(files["hub"]), PROMPT, ctx=64)
    got, _ = forward64.model_forward(open_model(directory), PROMPT, ctx=64)
    np.testing.assert_array_equal(got, want)


def test_the_device_forward_is_the_reference_s(files, device):
    """Prefill and every decode step on the device (the shared expert's GEMVs, its σ gate, the routed GEMVs adding
    into its output) give the float64 logits; a prefill runs the grouped products."""
    source = open_model(files["gguf"])
    model = Model.load(source, device, ctx=64, progress=False, database=default_database(False))
    logits, cache = forward64.model_forward(source, PROMPT, ctx=64)
    model.prefill(PROMPT, 0)
    assert relative_error(model.logits(), logits[-1]) <= DEVICE_TOLERANCE
    pos = len(PROMPT)
    for token in (11, 40, 7, 23):
        logits, cache = forward64.model_forward(source, [token], pos, cache, ctx=64)
        model.decode_one(token, pos)
        assert relative_error(model.logits(), logits[-1]) <= DEVICE_TOLERANCE
        pos += 1


def test_greedy_tokens_on_the_device_follow_the_float64_argmax(files, device):
    source = open_model(files["gguf"])
    model = Model.load(source, device, ctx=64, progress=False, database=default_database(False))
    model.prefill(PROMPT[:-1], 0)
    got = list(model.greedy_tokens(PROMPT[-1], len(PROMPT) - 1, len(PROMPT) + 4))
    logits, cache = forward64.model_forward(source, PROMPT, ctx=64)
    want, token = [], int(np.argmax(logits[-1]))
    for pos in range(len(PROMPT), len(PROMPT) + 6):
        want.append(token)
        top = np.sort(logits[-1])[-2:]
        assert top[1] - top[0] > 1e-3 * np.abs(logits[-1]).max(), "a near-tie: the seed gives another model"
        logits, cache = forward64.model_forward(source, [token], pos, cache, ctx=64)
        token = int(np.argmax(logits[-1]))
    assert got == want[:len(got)] and len(got) >= 5


def test_sequences_decoded_together_equal_each_alone_and_the_reference(files, device, rng):
    """`perfx serve --parallel`'s batched decode: each row its own DeltaNet state, KV cache and experts."""
    def load():
        return Model.load(open_model(files["gguf"]), device, ctx=96, progress=False,
                          database=default_database(False))
    model, alone, source = load(), load(), open_model(files["gguf"])
    batch = Batch(model, 3)
    for prompt, fed, got in run_schedule(batch, source.config.vocab_size, rng):
        want, _ = forward64.model_forward(source, prompt + fed)
        single = alone_logits(alone, prompt, fed)
        for j, logits in enumerate(got):
            assert relative_error(logits, single[j]) <= ALONE_TOLERANCE, (prompt, fed, j)
            assert relative_error(logits, want[len(prompt) - 1 + j]) <= DEVICE_TOLERANCE, (prompt, fed, j)


def test_the_step_runs_the_shared_expert_and_its_gate():
    c = SYNTHETIC_MODELS["qwen3.5-35b-a3b"][0]
    ops = decode_step(c, StepOptions())
    roles = [(op.family, op.role) for op in ops]
    assert ("moe_shared_gate", "shared expert gate") in roles
    gate_up = next(op for op in ops if op.weight == "gate_up")
    assert gate_up.shape["n"] == 2 * 512 and gate_up.layers == tuple(range(40))


def test_the_synthetic_preset_is_qwen3_5_35b_a3b():
    c = SYNTHETIC_MODELS["qwen3.5-35b-a3b"][0]
    assert (c.architecture, c.n_layers, c.hidden_size, c.n_experts, c.n_experts_used) == (
        "qwen3_5_moe_text", 40, 2048, 256, 8)
    assert (c.expert_intermediate, c.expert_shared, c.expert_shared_gate) == (512, 512, True)
    assert len(c.layers_of("delta")) == 30 and (c.delta_k_heads, c.delta_v_heads) == (16, 32)


def reduced_source() -> SyntheticSource:
    """synthetic:qwen3.5-35b-a3b's shapes at 4 layers and 16 experts (its random weights the same at every call)."""
    base = SYNTHETIC_MODELS["qwen3.5-35b-a3b"][0]
    c = dataclasses.replace(base, n_layers=4, layers=base.layers[:4], n_experts=16, vocab_size=512)
    return SyntheticSource("qwen3.5-35b-a3b (4 layers)", c, group=32)


@functools.cache
def reduced_reference() -> np.ndarray:
    """The reduced model's float64 logits after each of the tokens 3, 7, 9: one forward (each widens every weight
    to float64), for the prefill of the first two and the decode of the third, on every implementation."""
    return forward64.model_forward(reduced_source(), [3, 7, 9], ctx=16)[0]


def test_a_reduced_synthetic_model_runs_on_the_device(device):
    """synthetic:qwen3.5-35b-a3b's shapes at 4 layers and 16 experts: the device's prefill and decode are its
    float64 forward."""
    model = Model.load(reduced_source(), device, ctx=16, progress=False, database=default_database(False))
    want = reduced_reference()
    model.prefill([3, 7], 0)
    assert relative_error(model.logits(), want[1]) <= DEVICE_TOLERANCE
    model.decode_one(9, 2)
    assert relative_error(model.logits(), want[2]) <= DEVICE_TOLERANCE


# -- bad files -----------------------------------------------------------------------------------------------

def test_more_experts_used_than_held_is_named(files):
    _, written = write(files["root"], seed=6, num_experts_per_tok=7)
    with pytest.raises(PerfxError, match=r"7 experts used of 6 \(expert_used_count"):
        open_model(written.path)


@pytest.mark.parametrize("tensor, gguf_name", [
    ("mlp.shared_expert_gate.weight", r"blk\.2\.ffn_gate_inp_shexp\.weight \(the shared expert's gate\) is missing"),
    ("mlp.shared_expert.down_proj.weight", r"blk\.2\.ffn_down_shexp\.weight"),
])
def test_a_missing_shared_expert_tensor_is_named(files, tensor, gguf_name):
    _, written = write(files["root"], seed=7, drop=(f"model.layers.2.{tensor}",))
    with pytest.raises(PerfxError, match=gguf_name):
        open_model(written.path)


def test_a_config_without_the_shared_expert_s_width_is_named(files, tmp_path):
    directory = tmp_path / "hub"
    shutil.copytree(files["hub"], directory)
    config = json.loads((directory / "config.json").read_text())
    del config["shared_expert_intermediate_size"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(PerfxError, match="config.json lacks 'shared_expert_intermediate_size'"):
        open_model(directory)


def test_a_checkpoint_missing_its_shared_gate_is_named(files, tmp_path):
    directory = tmp_path / "hub"
    shutil.copytree(files["hub"], directory)
    weights = load_file(str(directory / "model.safetensors"))
    del weights["model.layers.3.mlp.shared_expert_gate.weight"]
    save_file(weights, str(directory / "model.safetensors"))
    with pytest.raises(PerfxError, match=r"model\.layers\.3\.mlp\.shared_expert_gate\.weight"):
        open_model(directory)


def test_config_checks_the_shared_width():
    with pytest.raises(PerfxError, match="shared expert's width -1"):
        ModelConfig(architecture="qwen35moe", vocab_size=16, hidden_size=32, intermediate_size=32, n_layers=1,
                    n_heads=1, n_kv_heads=1, head_dim=32, n_experts=4, n_experts_used=2, expert_intermediate=32,
                    expert_shared=-1)


def test_transformers_5_s_stacked_experts_read_as_the_hub_s(files, tmp_path):
    """transformers 5 saves each layer's experts stacked: mlp.experts.gate_up_proj (E, 2·I, hidden), gate rows
    first, and mlp.experts.down_proj (E, hidden, I)."""
    directory = tmp_path / "tf5"
    shutil.copytree(files["hub"], directory)
    weights = load_file(str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    for i in range(config["num_hidden_layers"]):
        block = f"model.layers.{i}.mlp.experts."
        experts = range(config["num_experts"])
        gate_up = [np.concatenate([weights.pop(f"{block}{e}.gate_proj.weight"),
                                   weights.pop(f"{block}{e}.up_proj.weight")]) for e in experts]
        weights[block + "gate_up_proj"] = np.stack(gate_up)
        weights[block + "down_proj"] = np.stack([weights.pop(f"{block}{e}.down_proj.weight") for e in experts])
    save_file(weights, str(directory / "model.safetensors"))
    want, _ = forward64.model_forward(open_model(files["hub"]), PROMPT, ctx=64)
    got, _ = forward64.model_forward(open_model(directory), PROMPT, ctx=64)
    np.testing.assert_array_equal(got, want)
