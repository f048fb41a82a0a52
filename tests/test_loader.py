"""Model loading: every format gives back exactly the weights written, the float64 reference forward agrees
across formats, every bad input is a PerfxError that says what is wrong, and the default model says Paris."""

import json
import shutil

import gguf
import numpy as np
import pytest

from helpers.tiny_models import (MIXED_32, Q4_K_M, Q5_K_M, from_bf16_bits, make_tiny_model, tiny_tokenizer,
                                 to_bf16_bits, write_awq, write_gguf, write_hf)
from helpers.tiny_tokenizer import write_tokenizer_only_gguf
from perfx.config import ModelConfig
from perfx.sources.default import default_model_path
from perfx.errors import PerfxError
from perfx.formats import Q4_ZEROS, Q4Matrix, Q8Matrix
from perfx.sources import open_model
from perfx.sources.base import Form, form_of, quantize_group
from perfx.sources.gguf import GGUF_FORMS
from perfx.reference import permute_qk, rope, unpermute_qk
from perfx.forward64 import model_forward
from perfx.mixers import MIXERS
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
    return w.dequantize() if isinstance(w, (Q4Matrix, Q8Matrix)) else np.asarray(w, dtype=np.float64)


def actual_forms(source) -> dict:
    """The forms the matrices really take, layer by layer: what weight_forms must predict from the header."""
    forms = {}
    for layer in source.layers():
        for label, w in layer.linears().items():
            forms.setdefault(label, set()).add(form_of(w))
    forms["embedding"] = {form_of(source.embedding())}
    head = source.lm_head()
    forms["lm_head"] = forms["embedding"] if head is None else {form_of(head)}
    return forms


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
    assert mistral.sliding_window == 4096 and {r.window for r in mistral.layers} == {4096}
    with pytest.raises(PerfxError, match=r"'gpt_neox'.*llama, mistral, qwen2, qwen3, gemma2"):
        ModelConfig.from_hf(dict(base, model_type="gpt_neox"))
    with pytest.raises(PerfxError, match="lacks 'intermediate_size'"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "intermediate_size"}
                            | {"model_type": "llama"})


# -- GGUF ------------------------------------------------------------------------------------------


def check_fused_matrices(source, written, n_layers):
    """Every fused matrix in the form its parts' types give (``fused_form``), holding what llama.cpp's
    dequantization of the file gives: exactly, up to gguf's own float32 rounding of d·q + m (Q4_1, Q5_1,
    Q5_K), or within Q4_K's fp16 rounding of s and m; any fp16 part makes the whole fp16 (rounded once)."""
    held, types = written.weights, written.types
    for i in range(n_layers):
        layer = source.layer(i)
        for field, modules in FUSED.items():
            w = layer.linears()[field]
            names = [f"model.layers.{i}.{m}.weight" for m in modules]
            want = np.concatenate([held[n] for n in names])
            parts = [GGUF_FORMS[types[n]] for n in names]
            kinds = {p.kind for p in parts}
            if "f16" in kinds:
                assert isinstance(w, np.ndarray) and w.dtype == np.float16
                np.testing.assert_array_equal(w, want.astype(np.float16))
                continue
            assert isinstance(w, Q4Matrix if kinds == {"q4"} else Q8Matrix), (field, [types[n] for n in names])
            assert w.group == min(p.group for p in parts)
            if isinstance(w, Q8Matrix):
                assert w.f32 == any(p.f32 for p in parts)
            tolerance = 2.0**-23 * np.abs(want).max()
            if any(types[n] == "Q4_K" for n in names):   # s = d·sc, m = −dmin·mn rounded to fp16
                s = np.repeat(w.scales.astype(np.float64), w.group, axis=1)
                m = np.repeat(np.abs(w.offsets.astype(np.float64)), w.group, axis=1)
                tolerance = 2.0**-11 * (15 * s + m) + tolerance
            assert np.all(np.abs(w.dequantize() - want) <= tolerance), (field, [types[n] for n in names])
            if all(types[n] in ("Q4_0", "Q8_0", "Q5_0", "Q6_K") for n in names):
                np.testing.assert_array_equal(w.dequantize(), want)
        np.testing.assert_array_equal(layer.attn_norm, written.weights[f"model.layers.{i}.input_layernorm.weight"])
        assert layer.attn_norm.dtype == np.float32 and layer.mixing.qkv_bias is None


def test_gguf_q4_codes_scales_exact_and_the_rest_in_int8_or_fp16(gqa3, gqa3_gguf):
    source = open_model(gqa3_gguf.path)
    assert source.config == ModelConfig.from_hf(gqa3.config)
    check_fused_matrices(source, gqa3_gguf, gqa3.n_layers)
    held = gqa3_gguf.weights
    emb = source.embedding()  # Q8_0, untied: the file's own type, exactly
    assert isinstance(emb, Q8Matrix) and emb.group == 32 and not emb.f32
    np.testing.assert_array_equal(emb.dequantize(), held["model.embed_tokens.weight"])
    # the F16 lm_head is quantized to int8 on load by default (--lm-head q8), kept fp16 with "fp16"
    head = source.lm_head()
    assert isinstance(head, Q8Matrix)
    np.testing.assert_array_equal(head.codes, Q8Matrix.quantize(held["lm_head.weight"].astype(np.float16)).codes)
    np.testing.assert_array_equal(open_model(gqa3_gguf.path, lm_head="fp16").lm_head(),
                                  held["lm_head.weight"].astype(np.float16))
    np.testing.assert_array_equal(source.final_norm(), gqa3.weights["model.norm.weight"])
    info = source.describe()
    assert info["format"] == "gguf" and info["file_size"] == gqa3_gguf.path.stat().st_size
    assert "Q4_0" in info["quantization"] and "Q8_0" in info["quantization"]
    assert source.weight_forms() == actual_forms(source)


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "MIXED_32"])
def test_gguf_every_type_reads_into_its_form_as_llama_cpp_dequantizes_it(spm, mix, tmp_path):
    """The mixes llama-quantize writes (Q4_K_M, Q5_K_M: K-quants with Q6_K attn_v and ffn_down in some layers,
    so a fused QKV of Q4_K q, k and a Q6_K v becomes int8 at G = 16), and every 32-weight type and BF16."""
    kind = "gqa3" if mix == "MIXED_32" else "k256"
    model = make_tiny_model(kind, spm, np.random.default_rng(21))
    layers = {"Q4_K_M": Q4_K_M, "Q5_K_M": Q5_K_M, "MIXED_32": MIXED_32}[mix]
    embedding = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "MIXED_32": "Q5_1"}[mix]
    written = write_gguf(tmp_path / "m.gguf", model, layer_types=layers, embedding_type=embedding,
                         output_type="Q6_K" if mix != "MIXED_32" else "Q5_0")
    source = open_model(written.path)
    check_fused_matrices(source, written, model.n_layers)
    forms = source.weight_forms()
    assert forms == actual_forms(source)
    if mix != "MIXED_32":
        assert {f.kind for f in forms["qkv"]} == {"q4" if mix == "Q4_K_M" else "q8", "q8"}
        assert form_of(source.layer(0).mixing.qkv).group == 16      # Q6_K v: the fused matrix at G = 16, exact
        head = source.lm_head()
        assert isinstance(head, Q8Matrix) and head.group == 16 and head.f32    # Q6_K, its own type
        np.testing.assert_allclose(head.dequantize(), written.weights["lm_head.weight"], rtol=0,
                                   atol=2.0**-23 * np.abs(written.weights["lm_head.weight"]).max())
    # the reference forward runs on every form
    logits, _ = model_forward(source, [1, 5, 9])
    assert logits.shape == (3, source.config.vocab_size) and np.all(np.isfinite(logits))


@pytest.mark.parametrize("kind, shape_kind, tensor", [
    ("IQ4_NL", "gqa3", "blk.1.ffn_up.weight"), ("Q2_K", "k256", "blk.0.attn_q.weight"),
    ("Q3_K", "k256", "token_embd.weight"), ("IQ2_XXS", "k256", "blk.1.ffn_gate.weight")])
def test_unsupported_gguf_types_name_the_type_and_what_to_do(spm, kind, shape_kind, tensor, tmp_path):
    model = make_tiny_model(shape_kind, spm, np.random.default_rng(1))
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    reader_shape = {"blk.1.ffn_up.weight": (384, 192), "blk.0.attn_q.weight": (256, 256),
                    "token_embd.weight": (model.config["vocab_size"], 256), "blk.1.ffn_gate.weight": (512, 256)}
    n, k = reader_shape[tensor]
    raw = np.zeros((n, k // block * size), np.uint8)
    written = write_gguf(tmp_path / "bad.gguf", model, tokenizer=False, raw_override={tensor: (raw, qtype)})
    with pytest.raises(PerfxError, match=rf"tensor {tensor} has type {kind}, which perfx does not read; .*Q4_K.*"
                                         r"Q6_K.*requantize the model with llama.cpp's llama-quantize to Q4_K_M, "
                                         r"Q5_K_M, Q8_0 or Q4_0"):
        open_model(written.path)


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
    # (lm_head fp16: the GGUF's Q8_0 tables are held as written; int8 on load would quantize them again)
    hf = open_model(write_hf(tmp_path / "hf", gqa3, gqa3_gguf.weights, shards=2), lm_head="fp16")
    gg = open_model(gqa3_gguf.path)
    assert hf.config == gg.config
    prompt = "kato rimu senla"
    ids = gg.tokenizer.encode(prompt, add_bos=True)
    assert ids == hf.tokenizer.encode(prompt, add_bos=True) and len(ids) >= 4
    assert "<|im_start|>assistant" in gg.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    logits_gg, _ = model_forward(gg, ids)
    logits_hf, _ = model_forward(hf, ids)
    assert rel(logits_hf, logits_gg) <= 5e-3
    assert rel(logits_hf + 1.0, logits_gg) > 5e-3  # the comparison can fail
    np.testing.assert_array_equal(logits_hf.argmax(-1), logits_gg.argmax(-1))
    # decoding one token at a time through the cache gives the prompt's logits again
    logits, cache = model_forward(gg, ids[:2])
    for pos in range(2, len(ids)):
        step, cache = model_forward(gg, ids[pos:pos + 1], pos, cache)
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
        np.testing.assert_array_equal(gg.layer(0).mixing.qkv_bias, bias)  # Qwen2: not permuted by llama.cpp
        np.testing.assert_array_equal(hf.layer(0).mixing.qkv_bias, bias.astype(np.float16))
    ids = [1, 17, 42, 300, 5]
    logits_gg, _ = model_forward(gg, ids)
    logits_hf, _ = model_forward(hf, ids)
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
            w = layer.linears()[field]
            assert w.dtype == np.float16
            np.testing.assert_array_equal(w, fused(stored, i, field).astype(np.float16))
    np.testing.assert_array_equal(source.final_norm(), stored["model.norm.weight"].astype(np.float32))
    assert source.describe()["quantization"] == dtype.lower() + ", lm_head and embedding int8 on load"
    assert source.generation_config["eos_token_id"] == 2
    # the fp16 lm_head and the untied embedding: int8 on load by default (device memory on a phone)
    for table, name in ((source.lm_head(), "lm_head.weight"), (source.embedding(), "model.embed_tokens.weight")):
        w16 = stored[name].astype(np.float16)
        np.testing.assert_array_equal(table.codes, Q8Matrix.quantize(w16).codes)
        # half a step, s/2 = (group range)/510 ≤ 2·max|w|/510: under 4e-3 of max|w|
        assert rel(table.dequantize(), w16.astype(np.float64)) < 4e-3
    kept = open_model(tmp_path / "hf", lm_head="fp16")
    np.testing.assert_array_equal(kept.lm_head(), stored["lm_head.weight"].astype(np.float16))
    np.testing.assert_array_equal(kept.embedding(), stored["model.embed_tokens.weight"].astype(np.float16))
    assert kept.describe()["quantization"] == dtype.lower()
    assert source.weight_forms() == actual_forms(source)
    with pytest.raises(PerfxError, match=r"lm_head='q4' is not supported; choose one of \('q8', 'fp16'\)"):
        open_model(tmp_path / "hf", lm_head="q4")


def test_quantize_on_load_falls_back_to_a_dividing_group(gqa3, tmp_path):
    source = open_model(write_hf(tmp_path / "hf", gqa3), quantize="q4")
    # K = 192 (hidden, and H·D for o) is no multiple of 128: group 64 there, and the notes say so
    notes = source.describe()["notes"]
    assert any("group 128 does not divide K = 192" in note and "group 64" in note for note in notes)
    layer = source.layer(1)
    assert (layer.mixing.qkv.group, layer.mixing.o.group, layer.gate_up.group, layer.down.group) == (64, 64, 64, 128)
    for field in FUSED:
        w16 = fused(gqa3.weights, 1, field).astype(np.float16)
        expected = Q4Matrix.quantize(w16, layer.linears()[field].group)
        np.testing.assert_array_equal(layer.linears()[field].codes, expected.codes)
        assert rel(layer.linears()[field].dequantize(), w16.astype(np.float64)) < 0.1  # 4-bit RTN error
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
            w = layer.linears()[field]
            modules = [f"model.layers.{i}.{m}" for m in FUSED[field]]
            codes, zeros, scales = (np.concatenate(a) for a in zip(*(parts[m] for m in modules)))
            assert isinstance(w, Q4Matrix) and w.group == 64
            np.testing.assert_array_equal(w.codes, codes)
            np.testing.assert_array_equal(w.scales, scales)
            # the zero points kept: 2.5 bytes a group, w = s·(q − z) exactly
            assert w.form == Q4_ZEROS
            np.testing.assert_array_equal(w.zeros, zeros)
        # modules_to_not_convert stay fp16
        assert layer.down.dtype == np.float16
        np.testing.assert_array_equal(layer.down, gqa3.weights[f"model.layers.{i}.mlp.down_proj.weight"]
                                      .astype(np.float16))
    assert isinstance(source.lm_head(), Q8Matrix)   # AutoAWQ leaves the lm_head fp16: int8 on load
    assert open_model(directory, lm_head="fp16").lm_head().dtype == np.float16
    assert source.describe()["quantization"] == (f"awq-{version} int4 g64, 2.5 bytes a group (fp16 scale + 4-bit "
                                                 "zero), lm_head and embedding int8 on load")
    untied = open_model(directory, embedding="q4")
    embedding = untied.embedding()
    group = quantize_group(source.config.hidden_size)
    assert embedding.form == Q4_ZEROS and embedding.group == group
    assert untied.weight_forms()["embedding"] == {Form("q4", group)}
    assert untied.describe()["quantization"].endswith(f", lm_head int8 on load, embedding int4 g{group}, 2.5 bytes a "
                                                      "group (fp16 scale + 4-bit zero) on load")
    assert source.weight_forms() == actual_forms(source)
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


def test_unsupported_gguf_architecture(spm, tmp_path):
    path = write_tokenizer_only_gguf(tmp_path / "rwkv7.gguf", spm, arch="rwkv7")
    with pytest.raises(PerfxError, match=r"GGUF architecture 'rwkv7' is not supported.*llama, qwen2, qwen3, gemma2"):
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
    assert layer.mixing.qkv.shape == (960, 576) and layer.mixing.qkv.group == 32
    assert layer.gate_up.shape == (3072, 576) and layer.down.shape == (576, 1536)
    tiny = open_model("synthetic:tiny")
    assert tiny.tokenizer is None and tiny.describe()["format"] == "synthetic"
    logits, _ = model_forward(tiny, [1, 2, 3])
    assert logits.shape == (3, tiny.config.vocab_size) and np.all(np.isfinite(logits))


@pytest.mark.parametrize("kind", sorted(MIXERS))
def test_each_layer_kind_declares_what_its_layers_hold(kind):
    """A layer's host weights are its kind's (``Mixer.Weights``), every matrix of the shape the mixer declares for
    its role, each role fused from projections the mixer gives shapes to: the smallest synthetic model of the
    kind, every form of its layers the same."""
    mixer = MIXERS[kind]
    name = min((name for name, (c, _, _) in SYNTHETIC_MODELS.items() if kind in {r.kind for r in c.layers}),
               key=lambda name: SYNTHETIC_MODELS[name][0].hidden_size)
    source = open_model(f"synthetic:{name}")
    c = source.config
    layer = source.layer(c.layers_of(kind)[0])
    assert type(layer.mixing) is mixer.Weights
    roles, shapes = mixer.host_linears(c), mixer.host_shapes(c)
    assert set(roles) <= set(mixer.Weights.matrices)
    assert {role: w.shape for role, w in layer.linears().items() if role in roles} == {r: shapes[r] for r in roles}
    assert all(part in shapes for parts in roles.values() for part in parts)
    assert source.layer_linears(c.layers_of(kind)[0]) == {**roles, "gate_up": ("gate", "up"), "down": ("down",)}
    if mixer.taps(c):
        assert layer.mixing.conv_weight.shape == (mixer.taps(c), c.conv_length)


# -- the default model -------------------------------------------------------------------------------


def test_default_model_says_paris():
    source = open_model(default_model_path())
    c = source.config
    assert (c.hidden_size, c.n_layers, c.n_heads, c.n_kv_heads, c.vocab_size) == (576, 30, 9, 3, 49152)
    assert c.tie_embeddings and source.lm_head() is None
    tokenizer = source.tokenizer
    ids = tokenizer.encode("The capital of France is", add_bos=tokenizer.add_bos_token)
    logits, _ = model_forward(source, ids)
    assert tokenizer.decode([int(np.argmax(logits[-1]))]) == " Paris"


# -- Llama 3.x rope_freqs and Mistral's sliding window ---------------------------------------------------


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def converter_rope_freqs(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf.py computes it for a "llama3" rope_scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def test_gguf_rope_freqs_are_llama3_scaling_as_llama_cpp_applies_it(gqa3, tmp_path):
    """A Llama 3.x GGUF's rope_freqs divides each pair's frequency (ggml_rope_ext's freq_factors): the same
    inverse frequencies as transformers' "llama3" rope_scaling, up to the float32 rounding of the factors."""
    freqs = converter_rope_freqs(64, 10000.0, LLAMA3_SCALING)
    assert 1.0 in freqs and 8.0 in freqs and np.any((freqs > 1) & (freqs < 8))  # all three regimes
    written = write_gguf(tmp_path / "llama3.gguf", gqa3, rope_freqs=freqs)
    c = open_model(written.path).config
    assert c.rope_scaling == {"rope_type": "default", "freq_factors": [float(f) for f in freqs]}
    from perfx.reference import rope_inv_freq
    np.testing.assert_allclose(rope_inv_freq(64, 10000.0, c.rope_scaling),
                               rope_inv_freq(64, 10000.0, LLAMA3_SCALING), rtol=2e-7)
    assert not np.allclose(rope_inv_freq(64, 10000.0, c.rope_scaling), rope_inv_freq(64, 10000.0))


@pytest.mark.parametrize("values, message", [
    (np.ones(31, np.float32), r"rope_freqs.weight has 31 values, but RoPE over 64 dimensions needs one per "
                              r"dimension pair, 32"),
    (np.r_[np.ones(31), -1.0].astype(np.float32), "not a positive finite number"),
    (np.r_[np.ones(31), np.nan].astype(np.float32), "not a positive finite number"),
])
def test_bad_rope_freqs_are_named(gqa3, tmp_path, values, message):
    written = write_gguf(tmp_path / "bad.gguf", gqa3, rope_freqs=values, tokenizer=False)
    with pytest.raises(PerfxError, match=message):
        open_model(written.path)


def test_sliding_window_from_gguf_and_hf(gqa3, tmp_path):
    assert open_model(write_gguf(tmp_path / "w.gguf", gqa3, sliding_window=6).path).config.sliding_window == 6
    assert open_model(write_gguf(tmp_path / "n.gguf", gqa3).path).config.sliding_window == 0
    mistral = open_model(write_hf(tmp_path / "hf", gqa3, config_overrides={"model_type": "mistral",
                                                                           "sliding_window": 6}))
    assert mistral.config.sliding_window == 6 and mistral.config.architecture == "mistral"
    qwen = ModelConfig.from_hf(dict(gqa3.config, model_type="qwen2", sliding_window=6, use_sliding_window=False))
    assert qwen.sliding_window == 0   # Qwen2 declares one but does not use it
