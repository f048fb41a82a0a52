"""Mixture-of-experts models (qwen3moe, lfm2moe) from tiny GGUFs written as llama.cpp's converter writes them:
the header read into the experts' recipe, the experts read exactly, the float64 MoE step against transformers'
sparse-MoE blocks written out, the device forward (prompt and decode) against the float64 forward, bad files,
and the step's ops as `perfx tune` measures them."""

import json

import gguf
import numpy as np
import pytest

from helpers.moe_models import SHAPES, write_moe_gguf, write_moe_hf
from perfx import moe
from perfx.errors import PerfxError
from perfx.formats import MXFP4_FORM, MXFP4_VALUES, mxfp4_arrays, mxfp4_scales
from perfx.forward64 import model_forward
from perfx.model import Model
from perfx.op import StepOptions
from perfx.ops.gemv_moe import expert_form
from perfx.sources import open_model
from perfx.step import decode_step
from perfx.tuning import SPECS
from perfx.tuning.database import Database
from perfx.tuning.problems import model_problems
from perfx.tuning.spec import relative_error

# The device forward against the float64 one: fp32 kernels over int4/int8 weights with the dense GEMVs' int8
# activations (their own rounding ~1e-3 of max|logit|), as tests/test_families.py's DEVICE_TOLERANCE
DEVICE_TOLERANCE = 2e-3


@pytest.fixture(params=sorted(SHAPES))
def tiny(request, tmp_path):
    path, held = write_moe_gguf(tmp_path / "m.gguf", request.param, np.random.default_rng(7))
    return request.param, path, held


def test_the_header_gives_the_experts_recipe(tiny):
    model_type, path, _ = tiny
    c, shape = open_model(path).config, SHAPES[model_type]
    assert (c.n_experts, c.n_experts_used, c.expert_intermediate) == (
        shape["num_experts"], shape["num_experts_per_tok"], shape["moe_intermediate_size"])
    assert c.expert_norm
    if model_type == "lfm2_moe":
        assert (c.expert_gating, c.expert_bias, c.dense_layers) == ("sigmoid", True, 1)
        assert c.moe_layers == [1, 2, 3] and c.intermediate_size == shape["intermediate_size"]
        assert [r.kind for r in c.layers] == ["conv", "attention", "conv", "attention"]
    else:
        assert (c.expert_gating, c.expert_bias, c.dense_layers, c.qk_norm) == ("softmax", False, 0, True)
    assert "experts" in c.describe_recipe()


def test_the_experts_are_read_as_the_file_holds_them(tiny):
    """Q4_0 and Q8_0 experts exactly; F16 and F32 ones as int8 (round to nearest, a step of max|w|/255 a group)."""
    model_type, path, held = tiny
    source = open_model(path)
    c = source.config
    for i in c.moe_layers:
        w = source.layer(i).moe
        np.testing.assert_array_equal(w.router, held[f"blk.{i}.ffn_gate_inp.weight"].astype(np.float32))
        for e in (0, c.n_experts - 1):
            gate_up = w.gate_up[e].dequantize()
            want = np.concatenate([held[f"blk.{i}.ffn_gate_exps.weight"][e], held[f"blk.{i}.ffn_up_exps.weight"][e]])
            exact = i % 4 in (0, 1)   # EXPERT_TYPES: Q4_0, Q8_0, then F16, F32
            bound = 0 if exact else np.abs(want).max() / 200
            assert np.abs(gate_up - want).max() <= bound, (i, e)
            assert np.abs(w.down[e].dequantize() - held[f"blk.{i}.ffn_down_exps.weight"][e]).max() <= (
                0 if exact else np.abs(want).max() / 100)


def _transformers_block(x, router, gate, up, down, used, gating, bias, norm):
    """Qwen3MoeSparseMoeBlock / Lfm2MoeSparseMoeBlock written out per token (softmax or σ of the router logits, the
    top-k by them plus the bias, the weights renormalised), in float64."""
    out = np.zeros((x.shape[0], down.shape[1]))
    for t, row in enumerate(x):
        logits = router @ row
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum() if gating == "softmax" else (
            1 / (1 + np.exp(-logits)))
        chosen = np.argsort(-(probs + (0 if bias is None else bias)), kind="stable")[:used]
        weights = probs[chosen] / (probs[chosen].sum() if norm else 1.0)
        for e, weight in zip(chosen, weights):
            g, u = gate[e] @ row, up[e] @ row
            out[t] += weight * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def test_the_float64_step_is_transformers_sparse_block(tiny, rng):
    model_type, path, held = tiny
    source = open_model(path)
    c = source.config
    i = c.moe_layers[-1]
    w = source.layer(i).moe
    x = rng.standard_normal((5, c.hidden_size))
    gate = np.stack([g.dequantize()[:c.expert_intermediate] for g in w.gate_up])
    up = np.stack([g.dequantize()[c.expert_intermediate:] for g in w.gate_up])
    down = np.stack([d.dequantize() for d in w.down])
    want = _transformers_block(x, w.router.astype(np.float64), gate, up, down, c.n_experts_used, c.expert_gating,
                               w.selection_bias, c.expert_norm)
    np.testing.assert_allclose(moe.reference(x, w, c), want, rtol=1e-10, atol=1e-12)


def test_the_device_forward_matches_the_float64_forward(tiny, device):
    """A prompt (its rows grouped by expert: more rows than a tile, experts with many, one or no rows), then decode
    steps (the recorded replay, the routed GEMVs), against perfx.forward64 on the same file."""
    _, path, _ = tiny
    source = open_model(path)
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, source.config.vocab_size, 33)]
    want, _ = model_forward(source, tokens)
    model = Model.load(source, device, ctx=64, progress=False, database=Database(None))
    model.prefill(tokens[:30], 0)
    assert relative_error(model.logits(), want[29]) <= DEVICE_TOLERANCE
    for pos in range(30, len(tokens)):
        model.decode_one(tokens[pos], pos)
        assert relative_error(model.logits(), want[pos]) <= DEVICE_TOLERANCE, pos
    # the decode step reads the router and the chosen experts only, not every expert
    c = source.config
    every = sum(source.layer(i).moe.expert_nbytes * c.n_experts for i in c.moe_layers)
    assert model.weight_bytes < every


def test_tune_measures_the_step_s_moe_ops(tiny):
    _, path, _ = tiny
    source = open_model(path)
    ops = decode_step(source.config, StepOptions(32, source.weight_forms()))
    families = {op.family for op in ops}
    assert {"moe_router", "gemv_moe"} <= families
    measured = {op.key for op in ops if op.measured and op.family in ("moe_router", "gemv_moe")}
    problems, notes = model_problems(source.config, SPECS, 32, source.weight_forms())
    listed = {(p.family, json.dumps(p.shape, sort_keys=True)) for p in problems}
    assert measured and measured <= listed, notes


def test_bad_files_name_the_key_or_tensor(tmp_path, rng):
    path, _ = write_moe_gguf(tmp_path / "used.gguf", "qwen3_moe", rng, num_experts_per_tok=11)
    with pytest.raises(PerfxError, match="11 experts used of 10"):
        open_model(path)
    # the header says 6 experts where the tensors hold 10
    path, _ = write_moe_gguf(tmp_path / "count.gguf", "qwen3_moe", rng)
    reader = gguf.GGUFReader(str(path), "r+")
    reader.get_field("qwen3moe.expert_count").parts[-1][0] = 6
    del reader
    with pytest.raises(PerfxError, match=r"ffn_gate_inp.weight has shape \(10, 64\), but qwen3moe.expert_count"):
        open_model(path)


def test_a_hugging_face_directory_reads_as_the_gguf(tiny, tmp_path, device):
    """The same model as a checkpoint: config.json gives the GGUF's recipe; its fp16 experts, held as int8, give
    the GGUF's logits within int8's rounding; its device forward matches its own float64 forward."""
    model_type, path, held = tiny
    gguf_source = open_model(path)
    hf = open_model(write_moe_hf(tmp_path / "hf", model_type, held))
    ignore = ("architecture", "max_positions", "extra")
    for field in type(hf.config).__dataclass_fields__:
        if field not in ignore:
            assert getattr(hf.config, field) == getattr(gguf_source.config, field), field
    tokens = [3, 17, 42, 5, 60]
    want, _ = model_forward(hf, tokens)
    assert relative_error(want[-1], model_forward(gguf_source, tokens)[0][-1]) <= 0.05
    model = Model.load(hf, device, ctx=32, progress=False, database=Database(None))
    model.prefill(tokens, 0)
    assert relative_error(model.logits(), want[-1]) <= DEVICE_TOLERANCE


def test_greedy_tokens_on_the_device_follow_the_float64_argmax(tiny, device):
    """The decode loop on the device (each step's experts and token chosen there, a step ahead of the host) gives
    the float64 forward's greedy tokens, where the top two logits stand clear of the kernels' rounding."""
    _, path, _ = tiny
    source = open_model(path)
    prompt = [5, 9, 14, 3, 27, 40]
    model = Model.load(source, device, ctx=64, progress=False, database=Database(None))
    model.prefill(prompt[:-1], 0)
    got = list(model.greedy_tokens(prompt[-1], len(prompt) - 1, len(prompt) + 4))
    logits, cache = model_forward(source, prompt)
    want, token = [], int(np.argmax(logits[-1]))
    for pos in range(len(prompt), len(prompt) + 6):
        want.append(token)
        top = np.sort(logits[-1])[-2:]
        assert top[1] - top[0] > 1e-3 * np.abs(logits[-1]).max(), "a near-tie: the seed gives another model"
        logits, cache = model_forward(source, [token], pos, cache)
        token = int(np.argmax(logits[-1]))
    assert got == want


def test_experts_with_gate_and_up_in_one_tensor(tmp_path, device):
    """ffn_gate_up_exps (gate rows, then up rows, of each expert) reads as the two tensors do."""
    path, held = write_moe_gguf(tmp_path / "fused.gguf", "qwen3_moe", np.random.default_rng(7), fused_gate_up=True)
    source = open_model(path)
    i = source.config.moe_layers[0]
    w = source.layer(i).moe
    want = np.concatenate([held[f"blk.{i}.ffn_gate_exps.weight"][2], held[f"blk.{i}.ffn_up_exps.weight"][2]])
    np.testing.assert_array_equal(w.gate_up[2].dequantize(), want)
    tokens = [3, 17, 42, 5, 60]
    model = Model.load(source, device, ctx=32, progress=False, database=Database(None))
    model.prefill(tokens, 0)
    assert relative_error(model.logits(), model_forward(source, tokens)[0][-1]) <= DEVICE_TOLERANCE


def test_quantize_q4_holds_float_experts_in_int4(tmp_path, device):
    """--quantize q4: a file's F16 and F32 experts become int4 (its Q4_0 and Q8_0 ones stay as they are), the
    header's forms say so before the weights are read, and the device forward follows the float64 one."""
    path, _ = write_moe_gguf(tmp_path / "m.gguf", "qwen3_moe", np.random.default_rng(7))
    source = open_model(path, quantize="q4")
    forms = source.weight_forms()
    held = {i: source.layer(i).moe for i in source.config.moe_layers}
    for role, of in (("experts_gate_up", "gate_up"), ("experts_down", "down")):
        assert forms[role] == {expert_form(getattr(w, of)[0]) for w in held.values()}, role
    assert [type(held[i].gate_up[0]).__name__ for i in sorted(held)] == ["Q4Matrix", "Q8Matrix", "Q4Matrix",
                                                                           "Q4Matrix"]
    tokens = [3, 17, 42, 5, 60]
    model = Model.load(source, device, ctx=32, progress=False, database=Database(None))
    model.prefill(tokens, 0)
    assert relative_error(model.logits(), model_forward(source, tokens)[0][-1]) <= DEVICE_TOLERANCE


def test_a_checkpoint_whose_experts_disagree_with_its_config_names_the_tensor(tmp_path, rng):
    path, held = write_moe_gguf(tmp_path / "m.gguf", "lfm2_moe", rng)
    directory = write_moe_hf(tmp_path / "hf", "lfm2_moe", held)
    config = json.loads((directory / "config.json").read_text())
    config["num_experts"] = 6   # the checkpoint holds 8
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(PerfxError, match=r"feed_forward.gate.weight has shape \(8, 64\)"):
        open_model(directory)
    config["num_experts"], config["num_experts_per_tok"] = 8, 9
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(PerfxError, match="9 experts used of 8"):
        open_model(directory)


@pytest.mark.parametrize("arch", ["qwen3_moe", "lfm2_moe"])
def test_mxfp4_experts_are_read_exactly(tmp_path, device, arch):
    """MXFP4 experts (llama-quantize's MXFP4_MOE, gpt-oss's files): as gguf.quants dequantizes them, bit for bit,
    held on the device in the file's bits (e2m1 nibbles, an E8M0 byte a group: 4.25 bits a weight); the header's
    forms say so; the prefill (grouped products) and decode steps (routed GEMVs) follow the float64 forward."""
    path, held = write_moe_gguf(tmp_path / "m.gguf", arch, np.random.default_rng(5), expert_types=("MXFP4",))
    source = open_model(path)
    forms = source.weight_forms()
    assert forms["experts_gate_up"] == forms["experts_down"] == {MXFP4_FORM}
    for i in source.config.moe_layers:
        w = source.layer(i).moe
        want = held[f"blk.{i}.ffn_down_exps.weight"][3]
        np.testing.assert_array_equal(w.down[3].dequantize(), want)
        # the device's bytes: nibbles (even k low) and exponents give the file's weights again
        nibbles, exponents = mxfp4_arrays(w.down[3])
        codes = np.stack([nibbles & 15, nibbles >> 4], axis=-1).reshape(want.shape)
        scales = np.repeat(mxfp4_scales(exponents).astype(np.float64), 32, axis=1)
        np.testing.assert_array_equal(MXFP4_VALUES[codes] * scales, want)
    tokens = [3, 17, 42, 5, 60, 8, 1, 33, 70, 2]
    want, _ = model_forward(source, tokens + [11, 4])
    model = Model.load(source, device, ctx=32, progress=False, database=Database(None))
    for i in source.config.moe_layers:
        experts = model.moe.weights[i]
        assert experts.gate_up.form == experts.down.form == MXFP4_FORM
        n, k = experts.down.n, experts.down.k
        assert (experts.down.codes_per_expert, experts.down.scales_per_expert) == (n * k // 2, n * k // 32)
    model.prefill(tokens, 0)
    assert relative_error(model.logits(), want[len(tokens) - 1]) <= DEVICE_TOLERANCE
    for pos in (len(tokens), len(tokens) + 1):
        model.decode_one((tokens + [11, 4])[pos], pos)
        assert relative_error(model.logits(), want[pos]) <= DEVICE_TOLERANCE, pos
