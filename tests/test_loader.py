"""Model loading: every format gives back exactly the weights written, the float64 reference forward agrees
across formats, every bad input is a PerfxError that says what is wrong, and the default model says Paris."""

import json
import shutil

import gguf
import numpy as np
import pytest

from helpers.tiny_models import (from_bf16_bits, make_tiny_model, tiny_tokenizer, to_bf16_bits, write_awq,
                                 write_gguf, write_hf)
from helpers.tiny_tokenizer import write_tokenizer_only_gguf
from perfx.config import ModelConfig
from perfx.sources.default import default_model_path
from perfx.errors import PerfxError
from perfx.formats import Q4Matrix
from perfx.sources import open_model
from perfx.reference import llama_forward, permute_qk, rope, unpermute_qk
from perfx.sources.synthetic import SYNTHETIC_MODELS

FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def gqa3(spm):
    return make_tiny_model("gqa3", spm, np.random.default_rng(3))


@pytest.fixture(scope="module")
def gqa3_gguf(gqa3, tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", gqa3)


def fused(weights: dict, layer: int, field: str) -> np.ndarray:
    return np.concatenate([weights[f"model.layers.{layer}.{m}.weight"] for m in FUSED[field]])


def as_f64(w) -> np.ndarray:
    return w.dequantize() if isinstance(w, Q4Matrix) else np.asarray(w, dtype=np.float64)


def rel(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


# -- configs ---------------------------------------------------------------------------------------


def test_config_from_hf_architectures():
    base = {"vocab_size": 100, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 2}
    llama = ModelConfig.from_hf(dict(base, model_type="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, tie_word_embeddings=True))
    assert (llama.n_kv_heads, llama.head_dim, llama.qkv_bias, llama.tie_embeddings) == (2, 64, False, True)
    assert llama.rope_scaling["rope_type"] == "llama3"
    qwen2 = ModelConfig.from_hf(dict(base, model_type="qwen2", num_key_value_heads=1))
    assert qwen2.qkv_bias and qwen2.n_kv_heads == 1 and qwen2.qkv_dim == 128 + 2 * 64
    mistral = ModelConfig.from_hf(dict(base, model_type="mistral", sliding_window=4096))
    assert mistral.extra["sliding_window"] == 4096
    with pytest.raises(PerfxError, match=r"'gpt_neox'.*llama, mistral, qwen2"):
        ModelConfig.from_hf(dict(base, model_type="gpt_neox"))
    with pytest.raises(PerfxError, match="lacks 'intermediate_size'"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "intermediate_size"}
                            | {"model_type": "llama"})


# -- GGUF ------------------------------------------------------------------------------------------


def test_gguf_q4_codes_scales_exact_and_rest_to_fp16(gqa3, gqa3_gguf):
    source = open_model(gqa3_gguf.path)
    assert source.config == ModelConfig.from_hf(gqa3.config)
    held, types = gqa3_gguf.weights, gqa3_gguf.types
    for i in range(gqa3.n_layers):
        layer = source.layer(i)
        for field, modules in FUSED.items():
            w = getattr(layer, field)
            names = [f"model.layers.{i}.{m}.weight" for m in modules]
            if all(types[n] in ("Q4_0", "Q4_1") for n in names):
                # Q4_0 and Q4_1 stay 4-bit, in HF row order, holding what llama.cpp's dequantization gives:
                # exactly for Q4_0 (d·(q − 8)); Q4_1's d·q + m is rounded to float32 by gguf, not by us.
                assert isinstance(w, Q4Matrix) and w.group == 32
                want = np.concatenate([held[n] for n in names])
                np.testing.assert_allclose(w.dequantize(), want, rtol=0, atol=2**-23 * np.abs(want).max())
                if all(types[n] == "Q4_0" for n in names):
                    np.testing.assert_array_equal(w.dequantize(), want)
            else:
                # any Q8_0/F16/F32 part makes the fused matrix fp16: the held values rounded once
                assert w.dtype == np.float16
                np.testing.assert_array_equal(w, np.concatenate([held[n] for n in names]).astype(np.float16))
        np.testing.assert_array_equal(layer.attn_norm, gqa3.weights[f"model.layers.{i}.input_layernorm.weight"])
        assert layer.attn_norm.dtype == np.float32 and layer.qkv_bias is None
    emb = source.embedding()  # Q8_0 -> fp16
    assert emb.dtype == np.float16
    np.testing.assert_array_equal(emb, held["model.embed_tokens.weight"].astype(np.float16))
    np.testing.assert_array_equal(source.lm_head(), held["lm_head.weight"].astype(np.float16))
    np.testing.assert_array_equal(source.final_norm(), gqa3.weights["model.norm.weight"])
    info = source.describe()
    assert info["format"] == "gguf" and info["file_size"] == gqa3_gguf.path.stat().st_size
    assert "Q4_0" in info["quantization"] and "Q8_0" in info["quantization"]


def test_gguf_unpermute_round_trip_and_rope_equivalence(rng):
    heads, d = 3, 64
    w = rng.standard_normal((heads * d, 32))
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, heads), heads), w)
    assert not np.array_equal(permute_qk(w, heads), w)
    # why the permutation exists: llama.cpp's interleaved RoPE (pairs 2i, 2i+1) on the permuted rows
    # equals rotate-half RoPE on Hugging Face's rows, so unpermuting is what makes perfx's RoPE right
    x, pos = rng.standard_normal(32), np.array([5])
    q_hf = (w @ x).reshape(1, heads, d)
    q_gguf = (permute_qk(w, heads) @ x).reshape(heads, d // 2, 2)
    angle = pos[0] * 10000.0 ** (-np.arange(0, d, 2) / d)
    a, b = q_gguf[..., 0], q_gguf[..., 1]
    interleaved = np.stack([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], -1)
    expected = rope(q_hf, pos, 10000.0).reshape(heads * d)
    np.testing.assert_allclose(unpermute_qk(interleaved.reshape(heads * d), heads), expected, atol=1e-12)


def test_gguf_and_hf_fp16_forward_agree(gqa3, gqa3_gguf, tmp_path):
    # the same weights written both ways: only the fp16 rounding of dequantized Q4 weights differs
    hf = open_model(write_hf(tmp_path / "hf", gqa3, gqa3_gguf.weights, shards=2))
    gg = open_model(gqa3_gguf.path)
    assert hf.config == gg.config
    prompt = "kato rimu senla"
    ids = gg.tokenizer.encode(prompt, add_bos=True)
    assert ids == hf.tokenizer.encode(prompt, add_bos=True) and len(ids) >= 4
    assert "<|im_start|>assistant" in gg.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    logits_gg, _ = llama_forward(gg, ids)
    logits_hf, _ = llama_forward(hf, ids)
    assert rel(logits_hf, logits_gg) <= 5e-3
    assert rel(logits_hf + 1.0, logits_gg) > 5e-3  # the comparison can fail
    np.testing.assert_array_equal(logits_hf.argmax(-1), logits_gg.argmax(-1))
    # decoding one token at a time through the cache gives the prompt's logits again
    logits, cache = llama_forward(gg, ids[:2])
    for pos in range(2, len(ids)):
        step, cache = llama_forward(gg, ids[pos:pos + 1], pos, cache)
        np.testing.assert_allclose(step[0], logits_gg[pos], rtol=0, atol=1e-9 * np.abs(logits_gg).max())


@pytest.mark.parametrize("kind", ["gqa1", "qwen2"])
def test_gguf_tied_and_qwen2_agree_with_hf(kind, spm, tmp_path):
    model = make_tiny_model(kind, spm, np.random.default_rng(11))
    written = write_gguf(tmp_path / "m.gguf", model, embedding_type="F16")
    gg = open_model(written.path)
    hf = open_model(write_hf(tmp_path / "hf", model, written.weights))
    assert gg.config == hf.config
    if kind == "gqa1":
        assert gg.config.tie_embeddings and gg.lm_head() is None and hf.lm_head() is None
    else:
        bias = np.concatenate([model.weights[f"model.layers.0.self_attn.{m}_proj.bias"] for m in "qkv"])
        np.testing.assert_array_equal(gg.layer(0).qkv_bias, bias)  # Qwen2: not permuted by llama.cpp
        np.testing.assert_array_equal(hf.layer(0).qkv_bias, bias.astype(np.float16))
    ids = [1, 17, 42, 300, 5]
    logits_gg, _ = llama_forward(gg, ids)
    logits_hf, _ = llama_forward(hf, ids)
    assert rel(logits_hf, logits_gg) <= 5e-3


# -- Hugging Face safetensors ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_hf_checkpoint_loads_as_fp16(gqa3, dtype, tmp_path):
    source = open_model(write_hf(tmp_path / "hf", gqa3, dtype=dtype))
    stored = {n: (from_bf16_bits(to_bf16_bits(w)) if dtype == "BF16" else w.astype(np.float16))
              for n, w in gqa3.weights.items()}
    for i in range(gqa3.n_layers):
        layer = source.layer(i)
        for field in FUSED:
            w = getattr(layer, field)
            assert w.dtype == np.float16
            np.testing.assert_array_equal(w, fused(stored, i, field).astype(np.float16))
    np.testing.assert_array_equal(source.embedding(), stored["model.embed_tokens.weight"].astype(np.float16))
    np.testing.assert_array_equal(source.final_norm(), stored["model.norm.weight"].astype(np.float32))
    assert source.describe()["quantization"] == dtype.lower()
    assert source.generation_config["eos_token_id"] == 2


def test_quantize_on_load_falls_back_to_a_dividing_group(gqa3, tmp_path):
    source = open_model(write_hf(tmp_path / "hf", gqa3), quantize="q4")
    # K = 192 (hidden, and H·D for o) is no multiple of 128: group 64 there, and the notes say so
    notes = source.describe()["notes"]
    assert any("group 128 does not divide K = 192" in note and "group 64" in note for note in notes)
    layer = source.layer(1)
    assert (layer.qkv.group, layer.o.group, layer.gate_up.group, layer.down.group) == (64, 64, 64, 128)
    for field in FUSED:
        w16 = fused(gqa3.weights, 1, field).astype(np.float16)
        expected = Q4Matrix.quantize(w16, getattr(layer, field).group)
        np.testing.assert_array_equal(getattr(layer, field).codes, expected.codes)
        assert rel(getattr(layer, field).dequantize(), w16.astype(np.float64)) < 0.1  # 4-bit RTN error
    with pytest.raises(PerfxError, match=r"quantize='q8'.*\(None, 'q4'\)"):
        open_model(tmp_path / "hf", quantize="q8")


@pytest.mark.parametrize("version", ["gemm", "gemv"])
def test_awq_codes_and_scales_exact(gqa3, version, tmp_path):
    directory, parts = write_awq(tmp_path / "awq", gqa3, np.random.default_rng(5), group=64, version=version,
                                 not_convert=("down_proj",))
    source = open_model(directory)
    for i in range(gqa3.n_layers):
        layer = source.layer(i)
        for field in ("qkv", "o", "gate_up"):
            w = getattr(layer, field)
            modules = [f"model.layers.{i}.{m}" for m in FUSED[field]]
            codes, zeros, scales = (np.concatenate(a) for a in zip(*(parts[m] for m in modules)))
            assert isinstance(w, Q4Matrix) and w.group == 64
            np.testing.assert_array_equal(w.codes, codes)
            np.testing.assert_array_equal(w.scales, scales)
            # m = −z·s, rounded once to fp16
            np.testing.assert_array_equal(w.offsets, (-zeros.astype(np.float32) * scales).astype(np.float16))
        # modules_to_not_convert stay fp16
        assert layer.down.dtype == np.float16
        np.testing.assert_array_equal(layer.down, gqa3.weights[f"model.layers.{i}.mlp.down_proj.weight"]
                                      .astype(np.float16))
    assert source.lm_head().dtype == np.float16
    assert source.describe()["quantization"] == f"awq-{version} int4, group 64"
    assert source.tokenizer is not None


@pytest.mark.parametrize("change, message", [
    ({"w_bit": 8}, r"8-bit.*w_bit = 4"),
    ({"q_group_size": 256}, r"group size 256.*\(32, 64, 128\)"),
    ({"version": "exllama"}, r"version 'exllama'.*gemm and gemv"),
    ({"zero_point": False}, r"zero_point"),
    ({"quant_method": "gptq"}, r"'gptq' is not supported.*AWQ"),
])
def test_unsupported_quantization_configs(gqa1_awq_dir, change, message, tmp_path):
    directory = tmp_path / "awq"
    shutil.copytree(gqa1_awq_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"].update(change)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(PerfxError, match=message):
        open_model(directory)


@pytest.fixture(scope="module")
def gqa1_awq_dir(spm, tmp_path_factory):
    model = make_tiny_model("gqa1", spm, np.random.default_rng(7), n_layers=1)
    directory, _ = write_awq(tmp_path_factory.mktemp("awq1"), model, np.random.default_rng(8), group=128)
    return directory


# -- errors ----------------------------------------------------------------------------------------


def test_path_errors(tmp_path):
    with pytest.raises(PerfxError, match="Model not found: .*nowhere"):
        open_model(tmp_path / "nowhere")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(PerfxError, match="neither a model directory nor a GGUF file"):
        open_model(tmp_path / "notes.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PerfxError, match="no config.json"):
        open_model(tmp_path / "empty")
    with pytest.raises(PerfxError, match=r"unknown synthetic model 'synthetic:llama-9b'; known: .*:tiny"):
        open_model("synthetic:llama-9b")


def test_truncated_files_name_the_file(gqa3, gqa3_gguf, tmp_path):
    directory = write_hf(tmp_path / "hf", gqa3)
    tensors = directory / "model.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-1000])
    with pytest.raises(PerfxError, match=r"model.safetensors is not a readable safetensors file.*truncated"):
        open_model(directory)
    cut = tmp_path / "cut.gguf"
    for size in (200, gqa3_gguf.path.stat().st_size - 5000):
        cut.write_bytes(gqa3_gguf.path.read_bytes()[:size])
        with pytest.raises(PerfxError, match=r"cut.gguf is not a readable GGUF file.*truncated or corrupt"):
            open_model(cut)


def test_missing_tensor_is_named(gqa3, tmp_path):
    missing = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(PerfxError, match=f"tensor {missing} is missing"):
        open_model(write_hf(tmp_path / "hf", gqa3, drop=(missing,)))


def test_shape_contradicting_config(gqa3, tmp_path):
    directory = write_hf(tmp_path / "hf", gqa3, config_overrides={"intermediate_size": 512})
    with pytest.raises(PerfxError, match=r"mlp.gate_proj.weight has shape \(384, 192\).*needs \(512, 192\)"):
        open_model(directory)


def test_unsupported_gguf_tensor_type(gqa3, tmp_path):
    # a Q5_0 tensor (22-byte blocks): the loader names the tensor and its type
    raw = np.zeros((384, 192 // 32 * 22), np.uint8)
    written = write_gguf(tmp_path / "q5.gguf", gqa3, tokenizer=False,
                         raw_override={"blk.1.ffn_up.weight": (raw, gguf.GGMLQuantizationType.Q5_0)})
    with pytest.raises(PerfxError, match=r"tensor blk.1.ffn_up.weight has type Q5_0.*Q4_0, Q4_1, Q8_0, F16"):
        open_model(written.path)


def test_unsupported_gguf_architecture(spm, tmp_path):
    path = write_tokenizer_only_gguf(tmp_path / "phi3.gguf", spm, arch="phi3")
    with pytest.raises(PerfxError, match=r"GGUF architecture 'phi3' is not supported.*llama, qwen2"):
        open_model(path)


def test_layer_index_out_of_range():
    with pytest.raises(PerfxError, match="layer 2 does not exist: the model has 2 layers"):
        open_model("synthetic:tiny").layer(2)


# -- synthetic models ------------------------------------------------------------------------------


def test_synthetic_models_have_the_real_shapes():
    seven = SYNTHETIC_MODELS["llama-2-7b"][0]
    assert (seven.hidden_size, seven.intermediate_size, seven.n_layers) == (4096, 11008, 32)
    assert (seven.n_heads, seven.n_kv_heads, seven.head_dim, seven.vocab_size) == (32, 32, 128, 32000)
    small = open_model("synthetic:smollm2-135m")
    c = small.config
    assert (c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.tie_embeddings) == (576, 9, 3, 64, True)
    layer = small.layer(29)
    assert layer.qkv.shape == (960, 576) and layer.qkv.group == 32
    assert layer.gate_up.shape == (3072, 576) and layer.down.shape == (576, 1536)
    tiny = open_model("synthetic:tiny")
    assert tiny.tokenizer is None and tiny.describe()["format"] == "synthetic"
    logits, _ = llama_forward(tiny, [1, 2, 3])
    assert logits.shape == (3, tiny.config.vocab_size) and np.all(np.isfinite(logits))


# -- the default model -------------------------------------------------------------------------------


def test_default_model_says_paris():
    source = open_model(default_model_path())
    c = source.config
    assert (c.hidden_size, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size) == (576, 30, 9, 3, 49152)
    assert c.tie_embeddings and source.lm_head() is None
    tokenizer = source.tokenizer
    ids = tokenizer.encode("The capital of France is", add_bos=tokenizer.add_bos_token)
    logits, _ = llama_forward(source, ids)
    assert tokenizer.decode([int(np.argmax(logits[-1]))]) == " Paris"
