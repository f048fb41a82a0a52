"""Gemma 4: its recipe from a GGUF (as llama.cpp's converter writes it) and from config.json, and its float64
forward (perfx.forward64) against an independent re-implementation of llama.cpp's gemma4 graph
(helpers.gemma4_models.reference_logits) on tiny files: sliding layers of head 32 and global ones of head 64
with proportional RoPE, per-layer embeddings from a Q8_0 table, KV-sharing layers with a doubled MLP, V normed,
K as V, layer output scalars, the final soft-cap."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from helpers.gemma4_models import (TINY, layer_shapes, make_gemma4, reference_logits, write_gemma4_gguf,
                                   write_gemma4_hf)
from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.families.gemma4 import E2B
from perfx.formats import Q4Matrix
from perfx.forward64 import model_forward
from perfx.linear import int4_as_int8
from perfx.model import Model
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.runtime import Device, Limits
from perfx.sources.gguf import GGUFSource
from perfx.sources.huggingface import HFSource
from perfx.sources.synthetic import SYNTHETIC_MODELS
from perfx.tokenizer import Tokenizer
from perfx.tuning import relative_error
from perfx.tuning.database import default_database

# Both sides are float64 over the same held weights and differ only in summation order: 1e-9 of logits of O(1)
# to O(30) is far above that rounding (1e-13 seen) and far below any mistake of the maths.
TOLERANCE = 1e-9

VARIANTS = {
    "E2B-like": ({}, {}),
    "K as V, shared layers without k": ({"k_eq_v": True}, {"skip_shared_kv": True}),
    "per-layer KV heads": ({"num_attention_heads": 4, "num_global_key_value_heads": 2}, {}),
    "Q4_0 table, Q4_0 embedding": ({}, {"table_type": "Q4_0", "embedding_type": "Q4_0"}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_forward64_follows_llamacpps_gemma4_graph(tmp_path, variant):
    made, written = VARIANTS[variant]
    rng = np.random.default_rng(sorted(VARIANTS).index(variant))
    model = write_gemma4_gguf(tmp_path / "tiny.gguf", make_gemma4(rng, **made), **written)
    source = GGUFSource(tmp_path / "tiny.gguf")
    tokens = rng.integers(0, TINY["vocab_size"], 11)   # longer than the window of 5: sliding layers differ
    expected = reference_logits(model, tokens)
    logits, _ = model_forward(source, tokens)
    assert np.abs(logits - expected).max() < TOLERANCE
    # the same positions in two calls through the cache (the shared layers read their source's cache)
    first, cache = model_forward(source, tokens[:6])
    rest, _ = model_forward(source, tokens[6:], 6, cache)
    assert np.abs(np.concatenate([first, rest]) - expected).max() < TOLERANCE


def test_gguf_and_config_json_give_one_recipe(tmp_path):
    model = write_gemma4_gguf(tmp_path / "tiny.gguf", make_gemma4(np.random.default_rng(5)))
    from_gguf, from_hf = GGUFSource(tmp_path / "tiny.gguf").config, ModelConfig.from_hf(dict(model.config))
    for name in ("head_dim", "n_kv_heads", "intermediate_size", "per_layer_input", "value_norm", "layer_scale",
                 "final_softcap", "attention_scale", "embedding_scale", "qk_norm", "post_norms", "ffn_activation"):
        assert getattr(from_gguf, name) == getattr(from_hf, name), name
    assert from_gguf.layers == from_hf.layers
    assert [r.rope.key() for r in from_gguf.layers] == [r.rope.key() for r in from_hf.layers]
    # the multimodal checkpoint's text_config is the same model
    wrapped = ModelConfig.from_hf({"model_type": "gemma4", "text_config": dict(model.config)})
    assert wrapped.layers == from_hf.layers


def test_the_e2b_preset_has_the_published_shapes():
    c = SYNTHETIC_MODELS["gemma-4-e2b"][0]
    shapes = layer_shapes(E2B)   # the tests' reading of the published config, not the family's
    assert c.n_layers == 35 and c.hidden_size == 1536 and c.per_layer_input == 256
    assert [(r.head_dim, r.kv_heads, r.ffn, r.kv_from, r.window) for r in c.layers] == [
        (s["head"], s["kv"], s["ffn"], s["source"], 512 if s["sliding"] else 0) for s in shapes]
    assert sum(r.kv_from < 0 for r in c.layers) == 15
    assert {r.kv_from for r in c.layers if r.kv_from >= 0} == {13, 14}
    global_rope = c.layers[4].rope
    assert (global_rope.theta, global_rope.dims) == (1e6, 512)
    factors = global_rope.scaling["freq_factors"]
    assert factors[:64] == [1.0] * 64 and min(factors[64:]) > 1e29
    assert (c.layers[0].rope.theta, c.layers[0].rope.dims) == (10000.0, 256)
    assert c.attention_scale == 1.0 and c.final_softcap == 30.0


def _rewrite(tmp_path, drop: str | None = None, keys: dict | None = None):
    """The tiny file written again with one tensor left out or some keys changed."""
    model = make_gemma4(np.random.default_rng(7))
    if drop:
        del model.weights[drop]
    path = tmp_path / "bad.gguf"
    original = gguf.GGUFWriter.add_shared_kv_layers
    if keys and "shared" in keys:
        gguf.GGUFWriter.add_shared_kv_layers = lambda self, value: original(self, keys["shared"])
    try:
        write_gemma4_gguf(path, model)
    finally:
        gguf.GGUFWriter.add_shared_kv_layers = original
    return path


def test_bad_files_name_what_is_wrong(tmp_path):
    with pytest.raises(PerfxError, match="per_layer_token_embd.weight is missing"):
        GGUFSource(_rewrite(tmp_path, drop="per_layer_token_embd.weight"))
    with pytest.raises(PerfxError, match="shared_kv_layers = 6"):
        GGUFSource(_rewrite(tmp_path, keys={"shared": 6}))
    with pytest.raises(PerfxError, match="blk.1.inp_gate.weight is missing"):
        GGUFSource(_rewrite(tmp_path, drop="blk.1.inp_gate.weight"))


# The device forward against the float64 one over the same file: the int4 and int8 GEMVs take int8-quantized
# activations (Q8_1 blocks, as llama.cpp's), the caches hold fp16 (or int8) K and V: the families' tolerance
# (tests/test_families.py DEVICE_TOLERANCE), relative to the largest logit (measured up to 1.3e-3 on both
# runtimes); with an int8 cache, its rounding too (half a code of 127 per value), as tests/test_kv_q8.py's
# VS_F16_TOLERANCE (measured 1.0e-2).
DEVICE_TOLERANCE = 2e-3
Q8_CACHE_TOLERANCE = 3e-2
DEVICE_VARIANTS = {
    "E2B-like": ({}, {}, "f16"),
    "K as V, shared layers without k, int8 cache": ({"k_eq_v": True}, {"skip_shared_kv": True}, "q8"),
    "per-layer KV heads": ({"num_attention_heads": 4, "num_global_key_value_heads": 2}, {}, "f16"),
}


@pytest.mark.parametrize("variant", sorted(DEVICE_VARIANTS))
def test_the_device_forward_follows_forward64(tmp_path, device, variant):
    made, written, kv = DEVICE_VARIANTS[variant]
    rng = np.random.default_rng(10 + sorted(DEVICE_VARIANTS).index(variant))
    write_gemma4_gguf(tmp_path / "tiny.gguf", make_gemma4(rng, **made), **written)
    source = GGUFSource(tmp_path / "tiny.gguf")
    model = Model.load(source, device, ctx=64, database=default_database(False), kv=kv)
    tolerance = Q8_CACHE_TOLERANCE if kv == "q8" else DEVICE_TOLERANCE
    tokens = [int(t) for t in rng.integers(0, TINY["vocab_size"], 14)]
    want, _ = model_forward(source, tokens)
    # a prompt past the window of 5 (sliding layers differ from global ones), then decode steps; a second prompt
    # continuing the first (the shared layers read the cache their source appended in another call)
    model.prefill(tokens[:9], 0)
    assert relative_error(model.logits(), want[8]) <= tolerance
    for pos in range(9, 11):
        model.decode_one(tokens[pos], pos)
        assert relative_error(model.logits(), want[pos]) <= tolerance, pos
    model.prefill(tokens[11:], 11)
    assert relative_error(model.logits(), want[-1]) <= tolerance
    # one cache a shape of the layers that hold one: sliding and global; none for the sharing layers
    caches = model.mixers[0].caches
    assert sorted((cache.head_dim, cache.n_layers) for cache in caches) == [(32, 3), (64, 1)]
    # the check can fail: the logits of another position
    assert relative_error(model.logits(), want[-2]) > tolerance


def test_a_file_without_a_template_talks_in_gemma4s_turns(tmp_path):
    write_gemma4_gguf(tmp_path / "tiny.gguf", make_gemma4(np.random.default_rng(3)))
    tokenizer = GGUFSource(tmp_path / "tiny.gguf").tokenizer
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi "}])
    assert text == "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    # <turn|> ends a reply, as <eos> does
    assert [tokenizer.token_text(i) for i in sorted(tokenizer.eos_ids)] == ["<eos>", "<turn|>"]


def test_greedy_tokens_on_the_device_are_float64s(tmp_path, device):
    """The decode loop on the device (each step's token chosen there and handed to the next) gives the tokens the
    float64 forward picks; the margins between the top two logits are far above the device's error here."""
    rng = np.random.default_rng(21)
    write_gemma4_gguf(tmp_path / "tiny.gguf", make_gemma4(rng))
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


@pytest.mark.parametrize("multimodal", [True, False], ids=["conditional-generation", "causal-lm"])
def test_a_hugging_face_directory_is_the_same_model(tmp_path, multimodal):
    """The same weights as a GGUF (fp16 everywhere, so both hold them exactly) and as a Hugging Face directory
    give the same float64 forward; K as V and the sharing layers' k and v present as the checkpoint has them."""
    fp16 = {name: "F16" for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                                     "inp_gate", "proj")}
    model = write_gemma4_gguf(tmp_path / "tiny.gguf", make_gemma4(np.random.default_rng(4), k_eq_v=True),
                              types=fp16, table_type="F16", embedding_type="F16")
    directory = write_gemma4_hf(tmp_path / "hf", model, multimodal)
    gguf_source, hf_source = GGUFSource(tmp_path / "tiny.gguf", lm_head="fp16"), HFSource(directory, lm_head="fp16")
    assert hf_source.config.layers == gguf_source.config.layers
    tokens = np.random.default_rng(5).integers(0, TINY["vocab_size"], 9)
    want, _ = model_forward(gguf_source, tokens)
    got, _ = model_forward(hf_source, tokens)
    assert np.abs(got - want).max() < TOLERANCE
    assert np.abs(got - reference_logits(model, tokens)).max() < TOLERANCE


def test_gemma4s_own_tokenizer_model(tmp_path):
    """tokenizer.ggml.model "gemma4" (Gemma4Model.set_vocab): BPE over raw UTF-8 with spaces as ▁ and no prefix
    space, bytes without a piece as <0xXX>, the turn tokens split out first."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"]
    pieces = ["h", "e", "l", "o", "w", "r", "d", "▁", "he", "ll", "hell", "hello", "▁w", "▁wo", "▁wor", "▁worl",
              "▁world"]
    tokens = specials + [f"<0x{i:02X}>" for i in range(256)] + pieces
    writer = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "gemma4")
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_merges(["h e", "l l", "he ll", "hell o", "▁ w", "▁w o", "▁wo r", "▁wor l", "▁worl d"])
    writer.add_token_types([gguf.TokenType.CONTROL] * 6 + [gguf.TokenType.BYTE] * 256
                           + [gguf.TokenType.NORMAL] * len(pieces))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer = Tokenizer.from_gguf(tmp_path / "tok.gguf")
    for text, pieces_wanted in (("hello world", ["hello", "▁world"]),
                                ("hello  world<turn|>é", ["hello", "▁", "▁world", "<turn|>", "<0xC3>", "<0xA9>"]),
                                ("<|turn>user\nhello", ["<|turn>", "<0x75>", "<0x73>", "e", "r", "<0x0A>", "hello"])):
        ids = tokenizer.encode(text)
        assert [tokenizer.token_text(i) for i in ids] == pieces_wanted
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("hello", add_bos=True)[0] == 2


def test_every_positions_logits_for_perplexity(tmp_path, device):
    """prefill_logits (perplexity): the final norm and the head over every row of a prompt, Gemma 4's residual
    closed by each layer's scalar first."""
    rng = np.random.default_rng(31)
    write_gemma4_gguf(tmp_path / "tiny.gguf", make_gemma4(rng))
    source = GGUFSource(tmp_path / "tiny.gguf")
    model = Model.load(source, device, ctx=64, database=default_database(False))
    tokens = [int(t) for t in rng.integers(0, TINY["vocab_size"], 20)]
    want, _ = model_forward(source, tokens)
    got = model.prefill_logits(tokens, 0, first=3)
    assert got.shape == want[3:].shape
    assert max(relative_error(g, w) for g, w in zip(got, want[3:])) <= DEVICE_TOLERANCE


@pytest.mark.parametrize("form", ["pairs", "zeros", "symmetric"])
def test_int4_as_int8_keeps_every_value(form):
    """The int8 form a table past the largest allocation takes holds the int4 values exactly, in each int4 form:
    codes q (pairs) or q − z (zero points, Q4_0's z = 8) beside the fp16 scales, no float32 anywhere."""
    rng = np.random.default_rng(43)
    n, k, group = 24, 96, 32
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, (n, k // group)).astype(np.float16)
    offsets = (-8 * scales * rng.uniform(0.9, 1.1, scales.shape)).astype(np.float16)
    w = {"pairs": lambda: Q4Matrix(codes, scales, offsets, group),
         "zeros": lambda: Q4Matrix.with_zeros(codes, scales, rng.integers(0, 16, scales.shape), group),
         "symmetric": lambda: Q4Matrix.symmetric(codes, scales, group)}[form]()
    held = int4_as_int8(w)
    assert not held.f32 and held.symmetric == (form != "pairs")
    np.testing.assert_array_equal(held.dequantize(), w.dequantize())


@pytest.mark.parametrize("table_type, symmetric", [("Q4_0", True), ("Q4_1", False)])
def test_an_int4_table_past_the_largest_allocation_is_held_as_int8(tmp_path, opencl_device, table_type, symmetric):
    """A phone's largest allocation (PERFX_LIMITS: an Adreno's 1 GiB; here 128 KiB) below an int4 per-layer
    table's codes: the table is held as int8 of the same values, in row blocks, and the forward is unchanged. The
    int8 form is the smallest that holds them: Q4_0's w = d·(q − 8) as codes q − 8 with the fp16 scale alone (2
    bytes a group), Q4_1's (d, min) as its fp16 pair (4 bytes), never float32 pairs (8)."""
    rng = np.random.default_rng(41)
    write_gemma4_gguf(tmp_path / "tiny.gguf", make_gemma4(rng, vocab_size=4096), table_type=table_type)
    source = GGUFSource(tmp_path / "tiny.gguf")
    device = Device(opencl_device.entry.index, limits=Limits(name="test", max_alloc=128 << 10))
    model = Model.load(source, device, ctx=32, database=default_database(False))
    table = model.weights.ple_table.weight
    assert isinstance(table, Q8DeviceWeight) and len(table.blocks) > 1
    assert (table.f32, table.symmetric, table.group_bytes) == (False, symmetric, 2 if symmetric else 4)
    tokens = [int(t) for t in rng.integers(0, 4096, 8)]
    want, _ = model_forward(source, tokens)
    model.prefill(tokens, 0)
    assert relative_error(model.logits(), want[-1]) <= DEVICE_TOLERANCE
