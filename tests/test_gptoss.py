"""gpt-oss from tiny GGUFs written as llama.cpp's converter writes them and Hugging Face directories as openai's
checkpoints hold them: the recipe (sinks, alternating windows, YaRN, biases, the clamped SwiGLU, softmax over the
chosen experts), the MXFP4 experts read exactly from both layouts, the float64 steps against transformers'
GptOssAttention and GptOssMLP written out, the device forward against the float64 forward, and bad files."""

import dataclasses
import json
import math

import gguf
import numpy as np
import pytest

from helpers.gptoss_models import TINY, write_gptoss_gguf, write_gptoss_hf
from perfx import moe, reference
from perfx.errors import PerfxError
from perfx.formats import MXFP4_FORM
from perfx.forward64 import ReferenceCache, model_forward
from perfx.mixers import mixer_class
from perfx.model import Model
from perfx.sources import open_model
from perfx.tokenizer import Tokenizer
from perfx.tuning.database import Database
from perfx.tuning.spec import relative_error

# The device forward against the float64 one: fp32 kernels over int8 and MXFP4 weights with the dense GEMVs' int8
# activations, as tests/test_moe.py's
DEVICE_TOLERANCE = 2e-3


@pytest.fixture
def tiny(tmp_path):
    path, held = write_gptoss_gguf(tmp_path / "m.gguf", np.random.default_rng(5))
    return path, held


def test_the_header_and_config_json_give_one_recipe(tiny, tmp_path):
    path, held = tiny
    c = open_model(path).config
    assert (c.n_experts, c.n_experts_used, c.expert_intermediate) == (6, 2, 64)
    assert (c.expert_gating, c.expert_norm, c.expert_biases, c.expert_activation) == (
        "softmax_weight", False, True, "swiglu_oai")
    assert (c.attention_sinks, c.o_bias, c.qkv_bias, c.moe_layers) == (True, True, True, [0, 1, 2, 3])
    # llama.cpp's set_swa_pattern(2): the even layers slide
    assert [r.window for r in c.layers] == [8, 0, 8, 0]
    scaling = c.layers[0].rope.scaling
    assert scaling["rope_type"] == "yarn" and scaling["factor"] == 32 and scaling["truncate"]
    assert scaling["attention_factor"] == pytest.approx(1 + 0.1 * math.log(32))
    hf = open_model(write_gptoss_hf(tmp_path / "hf", held)).config
    assert dataclasses.replace(hf, architecture="gpt-oss") == c
    assert "attention sinks" in c.describe_recipe() and "YaRN" in c.describe_recipe()


def test_the_experts_and_biases_are_read_as_both_files_hold_them(tiny, tmp_path):
    """MXFP4 experts exactly (the GGUF's blocks and openai's _blocks/_scales, gate and up de-interleaved), Q8_0 ones
    exactly from the GGUF, every bias as it is."""
    path, held = tiny
    sources = [open_model(path), open_model(write_gptoss_hf(tmp_path / "hf", held))]
    for i in range(TINY["num_hidden_layers"]):
        g = f"blk.{i}."
        mxfp4 = i % 3 == 0
        for source in sources:
            w = source.layer(i)
            m = w.moe
            np.testing.assert_array_equal(m.router_bias, held[g + "ffn_gate_inp.bias"].astype(np.float32))
            np.testing.assert_array_equal(m.gate_up_bias, np.concatenate(
                [held[g + "ffn_gate_exps.bias"], held[g + "ffn_up_exps.bias"]], axis=1).astype(np.float32))
            np.testing.assert_array_equal(m.down_bias, held[g + "ffn_down_exps.bias"].astype(np.float32))
            np.testing.assert_array_equal(w.mixing.sinks, held[g + "attn_sinks.weight"].astype(np.float32))
            np.testing.assert_array_equal(w.mixing.o_bias, held[g + "attn_output.bias"].astype(np.float32))
            for e in (0, 5):
                want = np.concatenate([held[g + "ffn_gate_exps.weight"][e], held[g + "ffn_up_exps.weight"][e]])
                exact = mxfp4 or (source is sources[0] and i % 3 == 1)
                bound = 0 if exact else np.abs(want).max() / 200
                assert np.abs(m.gate_up[e].dequantize() - want).max() <= bound, (i, e)
                assert np.abs(m.down[e].dequantize() - held[g + "ffn_down_exps.weight"][e]).max() <= (
                    0 if exact else np.abs(want).max() / 100)


def test_fused_gate_up_experts_read_as_apart(tmp_path):
    rng_a, rng_b = np.random.default_rng(9), np.random.default_rng(9)
    apart = open_model(write_gptoss_gguf(tmp_path / "a.gguf", rng_a)[0])
    fused = open_model(write_gptoss_gguf(tmp_path / "f.gguf", rng_b, fused_gate_up=True)[0])
    for i in (0, 1):
        a, f = apart.layer(i).moe, fused.layer(i).moe
        np.testing.assert_array_equal(a.gate_up_bias, f.gate_up_bias)
        np.testing.assert_array_equal(a.gate_up[3].dequantize(), f.gate_up[3].dequantize())


def _transformers_attention(x, w, c, positions, window):
    """GptOssAttention written out (eager_attention_forward with sinks): q, k, v with biases, YaRN RoPE
    (rotate-half, cos and sin times the attention factor), scores·D^−½ masked causally (and to the window), the
    sink logit concatenated per head, softmax, the sink's column dropped, o with its bias."""
    h, hkv, d = c.n_heads, c.n_kv_heads, c.head_dim
    qkv = w.qkv.dequantize() if hasattr(w.qkv, "dequantize") else np.asarray(w.qkv, np.float64)
    proj = x @ qkv.T + w.qkv_bias
    q = proj[:, :h * d].reshape(-1, h, d)
    k = proj[:, h * d:(h + hkv) * d].reshape(-1, hkv, d)
    v = proj[:, (h + hkv) * d:].reshape(-1, hkv, d)
    inv = reference.rope_inv_freq(d, c.rope_theta, c.layers[0].rope.scaling)
    angles = np.outer(positions, inv)
    cos, sin = np.cos(angles) * c.layers[0].rope.scaling["attention_factor"], np.sin(angles) * c.layers[0].rope.scaling[
        "attention_factor"]

    def rotate(t):
        t1, t2 = t[..., :d // 2], t[..., d // 2:]
        return np.concatenate([t1 * cos[:, None] - t2 * sin[:, None], t2 * cos[:, None] + t1 * sin[:, None]], -1)

    q, k = rotate(q), rotate(k)
    out = np.zeros((len(x), h, d))
    for head in range(h):
        g = head // (h // hkv)
        scores = q[:, head] @ k[:, g].T / math.sqrt(d)
        i, j = np.meshgrid(positions, positions, indexing="ij")
        mask = (j <= i) & ((i - j < window) if window else True)
        scores = np.where(mask, scores, -np.inf)
        logits = np.concatenate([scores, np.full((len(x), 1), float(w.sinks[head]))], axis=1)
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = probs / probs.sum(axis=1, keepdims=True)
        out[:, head] = probs[:, :-1] @ v[:, g]
    o = w.o.dequantize() if hasattr(w.o, "dequantize") else np.asarray(w.o, np.float64)
    return out.reshape(len(x), -1) @ o.T + w.o_bias


def _transformers_mlp(x, m, c):
    """GptOssMLP written out: the router's logits with its bias, top-k, softmax over the chosen; each expert's
    gate_up with its bias, gate = min(gate, 7), up = clamp(up, −7, 7), (up + 1)·gate·σ(1.702·gate), down with its
    bias, weighted."""
    out = np.zeros((len(x), c.hidden_size))
    inter = c.expert_intermediate
    for t, row in enumerate(x):
        logits = m.router @ row + m.router_bias
        chosen = np.argsort(-logits, kind="stable")[:c.n_experts_used]
        weights = np.exp(logits[chosen] - logits[chosen].max())
        weights /= weights.sum()
        for e, weight in zip(chosen, weights):
            gu = m.gate_up[e].dequantize() @ row + m.gate_up_bias[e]
            gate, up = np.minimum(gu[:inter], 7.0), np.clip(gu[inter:], -7.0, 7.0)
            glu = gate / (1 + np.exp(-1.702 * gate))
            out[t] += weight * (m.down[e].dequantize() @ ((up + 1) * glu) + m.down_bias[e])
    return out


def test_the_float64_steps_are_transformers(tiny, rng):
    path, _ = tiny
    source = open_model(path)
    c = source.config
    x = rng.standard_normal((12, c.hidden_size))
    positions = np.arange(12)
    for i in (0, 1):   # a sliding layer and a full one
        w = source.layer(i)
        got = mixer_class("attention").reference(x, w, c, ReferenceCache(c.n_layers), i, positions, c.layer(i, 64))
        np.testing.assert_allclose(got, _transformers_attention(x, w.mixing, c, positions, c.layers[i].window),
                                   rtol=1e-9, atol=1e-11)
        m = w.moe
        # inputs large enough that the clamps bite
        big = 3 * x
        gate_up = np.stack([m.gate_up[e].dequantize() @ big.T for e in range(c.n_experts)])
        assert (np.abs(gate_up) > 7).any()
        np.testing.assert_allclose(moe.reference(big, m, c), _transformers_mlp(big, m, c), rtol=1e-9, atol=1e-11)


def test_yarn_is_transformers_yarn():
    """_compute_yarn_parameters written out at gpt-oss-20b's settings, with and without truncate."""
    d, base, factor, original = 64, 150000.0, 32.0, 4096
    for truncate in (True, False):
        def dim(rot):
            return d * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))
        low, high = dim(32), dim(1)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        pos_freqs = base ** (np.arange(0, d, 2) / d)
        ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        want = 1 / (factor * pos_freqs) * (1 - extrapolation) + 1 / pos_freqs * extrapolation
        scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
                   "beta_fast": 32.0, "beta_slow": 1.0, "truncate": truncate}
        np.testing.assert_allclose(reference.rope_inv_freq(d, base, scaling), want, rtol=1e-12)


@pytest.mark.parametrize("fault, message", [
    (dict(drop=("blk.2.attn_sinks.weight",)), "blk.2.attn_sinks.weight is missing"),
    (dict(drop=("blk.1.ffn_gate_inp.bias",)), "blk.1.ffn_gate_inp.bias is missing"),
    (dict(drop=("blk.3.attn_output.bias",)), "blk.3.attn_output.bias is missing"),
    (dict(change={"blk.0.ffn_down_exps.bias": np.zeros((6, 63), np.float32)}), "blk.0.ffn_down_exps.bias has shape"),
    (dict(change={"blk.0.attn_sinks.weight": np.zeros(5, np.float32)}), "blk.0.attn_sinks.weight has shape"),
    (dict(keys={"gpt-oss.expert_used_count": 7}), "7 experts used of 6"),
    (dict(keys={"gpt-oss.rope.scaling.type": None}), "rope.scaling.type = None"),
    (dict(keys={"gpt-oss.rope.scaling.original_context_length": None}),
     "lacks gpt-oss.rope.scaling.original_context_length"),
    (dict(keys={"gpt-oss.attention.sliding_window": None}), "lacks gpt-oss.attention.sliding_window"),
], ids=["sinks", "router-bias", "o-bias", "down-bias-shape", "sinks-shape", "used-count", "no-yarn",
        "no-original-context", "no-window"])
def test_bad_files_name_the_key_or_tensor(tmp_path, fault, message):
    bad, _ = write_gptoss_gguf(tmp_path / "bad.gguf", np.random.default_rng(5), **fault)
    with pytest.raises(PerfxError, match=message.replace("(", r"\(").replace(".", r"\.")):
        open_model(bad)


def test_bad_checkpoints_name_the_key_or_tensor(tiny, tmp_path):
    _, held = tiny
    directory = write_gptoss_hf(tmp_path / "hf", held)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "swiglu_limit": 10.0}))
    with pytest.raises(PerfxError, match="swiglu_limit = 10.0"):
        open_model(directory)
    (directory / "config.json").write_text(json.dumps({**config, "num_local_experts": 5}))
    with pytest.raises(PerfxError, match="mlp.router.weight has shape"):
        open_model(directory)
    (directory / "config.json").write_text(json.dumps({**config, "rope_scaling": None}))
    with pytest.raises(PerfxError, match="YaRN"):
        open_model(directory)


def test_the_device_forward_matches_the_float64_forward(tiny, device):
    """A prompt past the sliding window (rows grouped by expert: the grouped products with biases and the clamped
    SwiGLU; the prefill attention with sinks), then decode steps past it (the recorded replay: the router with its
    bias, the routed GEMVs, the decode attention with sinks), against perfx.forward64; greedy tokens equal."""
    path, _ = tiny
    source = open_model(path)
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, source.config.vocab_size, 27)]
    want, _ = model_forward(source, tokens)
    model = Model.load(source, device, ctx=64, progress=False, database=Database(None))
    model.prefill(tokens[:20], 0)
    assert relative_error(model.logits(), want[19]) <= DEVICE_TOLERANCE
    for pos in range(20, len(tokens)):
        model.decode_one(tokens[pos], pos)
        logits = model.logits()
        assert relative_error(logits, want[pos]) <= DEVICE_TOLERANCE, pos
        top = np.sort(want[pos])[::-1]
        if top[0] - top[1] > 1e-2 * np.abs(want[pos]).max():   # not a near-tie: the greedy token is the same
            assert int(np.argmax(logits)) == int(np.argmax(want[pos])), pos
    # the decode step reads the router and the chosen experts only
    c = source.config
    every = sum(source.layer(i).moe.expert_nbytes * c.n_experts for i in c.moe_layers)
    assert model.weight_bytes < every
    # the MXFP4 layers' experts on the device in the file's bits, the others as the file's int8 or fp16 as int8
    forms = [source.layer(i).moe.gate_up[0] for i in c.moe_layers]
    assert [model.moe.weights[i].gate_up.form == MXFP4_FORM for i in c.moe_layers] == [f.mxfp4 for f in forms]
    assert any(f.mxfp4 for f in forms)


def test_the_hugging_face_directory_runs_on_the_device(tiny, tmp_path, device):
    """openai's layout (MXFP4 _blocks and _scales, interleaved gate_up) through the device forward; its float
    attention with biases runs quantized (--quantize q4), as Qwen2's does."""
    _, held = tiny
    source = open_model(write_gptoss_hf(tmp_path / "hf", held), quantize="q4")
    tokens = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14]
    want, _ = model_forward(source, tokens)
    model = Model.load(source, device, ctx=32, progress=False, database=Database(None))
    model.prefill(tokens[:8], 0)
    assert relative_error(model.logits(), want[7]) <= DEVICE_TOLERANCE
    for pos in range(8, len(tokens)):
        model.decode_one(tokens[pos], pos)
        assert relative_error(model.logits(), want[pos]) <= DEVICE_TOLERANCE, pos


def test_the_synthetic_gpt_oss_20b_has_its_shapes_and_mxfp4_experts():
    """synthetic:gpt-oss-20b (for perfx bench): openai's config.json, its experts in MXFP4's held form."""
    source = open_model("synthetic:gpt-oss-20b")
    c = source.config
    assert (c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim) == (24, 2880, 64, 8, 64)
    assert (c.n_experts, c.n_experts_used, c.expert_intermediate, c.vocab_size) == (32, 4, 2880, 201088)
    assert [r.window for r in c.layers[:4]] == [128, 0, 128, 0] and c.attention_sinks and c.expert_biases
    forms = source.weight_forms()
    assert forms["experts_gate_up"] == forms["experts_down"] == {MXFP4_FORM}
    assert "MXFP4" in source.describe()["quantization"]


def test_the_o200k_tokenizer_and_harmony_s_turn_ends(tmp_path):
    """A GGUF vocabulary as the converter writes gpt-oss's (gpt2 BPE, tokenizer.ggml.pre "gpt-4o", eos <|return|>):
    a reply ends at <|return|>, <|call|> or <|endoftext|>, not at <|end|>, which closes the analysis message before
    the final one; the gpt-4o pre-tokenizer splits as o200k does (a letter run and its leading space, digits by
    threes)."""
    byte_chars = [chr(c) for c in range(33, 127)]
    specials = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"]
    tokens = byte_chars + ["Ġ", "Ġa", "12", "123"] + specials
    path = tmp_path / "tok.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-4o")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(specials)) + [3] * len(specials))
    writer.add_token_merges(["Ġ a", "1 2", "12 3"])
    writer.add_eos_token_id(tokens.index("<|return|>"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tok = Tokenizer.from_gguf(path)
    assert {tokens[i] for i in tok.eos_ids} == {"<|return|>", "<|call|>", "<|endoftext|>"}
    ids = tok.encode("a a1234<|end|>", add_bos=False)
    assert [tokens[i] for i in ids] == ["a", "Ġa", "123", "4", "<|end|>"]
