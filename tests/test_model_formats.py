"""The device forward on every GGUF type and model variant perfx reads, against the float64 reference
forward over the same source: Q4_K_M and Q5_K_M mixes (int4 and int8 matrices, fused QKV at G = 16), every
32-weight type, a Llama-3-style model with rope_freqs, a Mistral-style sliding window, the lm_head in each
form, and every position's logits (perplexity's path).

Tolerance on logits: test_model.py's 2e-3 of max|logits| (fp16 KV cache, fp32 accumulation), for the same
reasons: the int8 kernels add only fp32 rounding on top of exact weights.
"""

import dataclasses

import numpy as np
import pytest

from helpers.tiny_models import MIXED_32, Q4_K_M, Q5_K_M, make_tiny_model, tiny_tokenizer, write_gguf, write_hf
from perfx import forward64
from perfx.formats import Q8Matrix
from perfx.model import Model
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.sources import open_model
from perfx.tuning.spec import relative_error
from test_loader import LLAMA3_SCALING, converter_rope_freqs

TOLERANCE = 2e-3
pytestmark = pytest.mark.one_implementation  # model-level: the default device only


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def paths(spm, tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    rng = np.random.default_rng(15)
    k256, tied, gqa3 = (make_tiny_model(kind, spm, rng) for kind in ("k256", "k256-tied", "gqa3"))
    return {
        "Q4_K_M": write_gguf(root / "q4km.gguf", k256, Q4_K_M, embedding_type="Q4_K", output_type="Q6_K").path,
        "Q5_K_M-tied": write_gguf(root / "q5km.gguf", tied, Q5_K_M, embedding_type="Q6_K").path,
        "MIXED_32": write_gguf(root / "mixed.gguf", gqa3, MIXED_32, embedding_type="Q5_0", output_type="Q4_0").path,
        "llama3": write_gguf(root / "llama3.gguf", gqa3, embedding_type="F16",
                             rope_freqs=converter_rope_freqs(64, 10000.0, LLAMA3_SCALING)).path,
        "window": write_gguf(root / "window.gguf", gqa3, sliding_window=5).path,
        "hf": write_hf(root / "hf", gqa3),
    }


def load(path, device, ctx=64, lm_head="q8"):
    source = open_model(path, lm_head=lm_head)
    return Model.load(source, device, ctx=ctx, progress=False), source


def check_prefill_and_decode(model, source, rng, prompt_len=19, steps=3):
    v = source.config.vocab_size
    prompt = [int(t) for t in rng.integers(3, v, prompt_len)]
    want, cache = forward64.model_forward(source, prompt)
    model.prefill(prompt, 0)
    assert relative_error(model.logits(), want[-1]) <= TOLERANCE
    pos = len(prompt)
    for _ in range(steps):
        token = int(rng.integers(3, v))
        want, cache = forward64.model_forward(source, [token], start_pos=pos, cache=cache)
        model.decode_one(token, pos)
        pos += 1
        assert relative_error(model.logits(), want[-1]) <= TOLERANCE
    return want


@pytest.mark.parametrize("name", ["Q4_K_M", "Q5_K_M-tied", "MIXED_32"])
def test_k_quant_and_32_weight_mixes_match_the_reference(paths, device, rng, name):
    model, source = load(paths[name], device)
    kinds = {type(linear.weight).__name__ for i, layer in enumerate(model.weights.layers)
             for linear in (layer.mixer.weights[i].qkv, layer.down)}
    assert "Q8DeviceWeight" in kinds          # some matrices run the int8 kernels
    assert isinstance(model.weights.lm_head.weight, Q8DeviceWeight) or name == "MIXED_32"   # Q6_K heads: int8, G = 16
    check_prefill_and_decode(model, source, rng)
    # the model looked every int8 kernel up by the shapes `perfx tune` lists for this file
    from perfx.tuning import SPECS
    from perfx.tuning.problems import model_problems
    problems, _ = model_problems(source.config, SPECS, source.int4_group, source.weight_forms())
    listed = {(p.family, key) for p in problems for key in [tuple(sorted((k, str(v)) for k, v in p.shape.items()))]}
    looked_up = [(label.split(" ")[0], shape) for label, shape in model.plan.tuned_shapes.items()
                 if label.split(" ")[0] in ("gemv_q8", "gemm_q8", "embedding_q8")]
    assert {family for family, _ in looked_up} >= {"gemv_q8", "gemm_q8"}
    for family, shape in looked_up:
        assert (family, tuple(sorted((k, str(v)) for k, v in shape.items()))) in listed, (family, shape)


@pytest.mark.parametrize("lanes_where", ["faster, same file", "slower, same file", "faster, another file"])
def test_the_int8_gemm_kind_is_the_one_measured_faster_in_one_run(paths, device, rng, tmp_path, lanes_where):
    """A prefill bucket's int8 matrices run gemm_q8_lanes only where it and gemm_q8 were both timed at that
    very shape in one file and lanes was the faster; a lanes time from another file (another machine's run)
    does not count. The prompt's logits match the reference whichever kernel runs."""
    import json

    from perfx.tuning import SPECS
    from perfx.tuning.database import FORMAT, Database, result_record
    from perfx.tuning.problems import model_problems
    source = open_model(paths["Q4_K_M"])
    problems, _ = model_problems(source.config, SPECS, source.int4_group, source.weight_forms())
    m = 19   # the prompt below: bucket 17..64, whose records are at M = 33
    shapes = [p.shape for p in problems if p.family == "gemm_q8" and p.shape["m"] == 33]
    assert shapes
    database = Database(tmp_path / "user", tmp_path / "shipped")
    lanes_time = 1e-5 if lanes_where.startswith("faster") else 1e-3
    other = []
    for shape in shapes:
        database.save_result(device, result_record(SPECS["gemm_q8"], shape, {"WGS": 64, "ROWS": 1, "MT": 2}, 1e-4,
                                                   None, device.fingerprint))
        lanes = result_record(SPECS["gemm_q8_lanes"], shape, {"WGS": 16, "ROWS": 1, "MB": 4}, lanes_time, None,
                              device.fingerprint)
        if lanes_where.endswith("another file"):
            other.append(lanes)
        else:
            database.save_result(device, lanes)
    (tmp_path / "shipped").mkdir()
    (tmp_path / "shipped" / "vendor.json").write_text(json.dumps(
        {"perfx_tuning": FORMAT, "match": {"vendor": device.caps.vendor_key}, "records": other}))
    model = Model.load(source, device, ctx=64, progress=False, database=database)
    prompt = [int(t) for t in rng.integers(3, source.config.vocab_size, m)]
    want, _ = forward64.model_forward(source, prompt)
    model.prefill(prompt, 0)
    assert relative_error(model.logits(), want[-1]) <= TOLERANCE
    ran = {label.split(" ")[0] for label in model.plan.tuned if "M≈33" in label and "gemm_q8" in label}
    assert ran == ({"gemm_q8_lanes"} if lanes_where == "faster, same file" else {"gemm_q8"})
    for label, choice in model.plan.tuned.items():
        if "M≈33" in label and label.startswith("gemm_q8"):
            assert choice.source == "device" and choice.exact, (label, choice)


def test_llama3_rope_freqs_on_the_device(paths, device, rng):
    """Positions past the scaling's original 64: the factors matter, and the device applies them."""
    model, source = load(paths["llama3"], device, ctx=128)
    assert "freq_factors" in source.config.rope_scaling
    prompt = [int(t) for t in rng.integers(3, source.config.vocab_size, 90)]
    want, _ = forward64.model_forward(source, prompt)
    model.prefill(prompt, 0)
    assert relative_error(model.logits(), want[-1]) <= TOLERANCE
    plain = open_model(paths["llama3"])
    plain.config.layers = tuple(dataclasses.replace(r, rope=dataclasses.replace(r.rope, scaling=None))
                                for r in plain.config.layers)
    without, _ = forward64.model_forward(plain, prompt)
    assert relative_error(without[-1], want[-1]) > 10 * TOLERANCE   # the check could fail


def test_sliding_window_on_the_device(paths, device, rng):
    model, source = load(paths["window"], device)
    assert source.config.sliding_window == 5
    want = check_prefill_and_decode(model, source, rng, prompt_len=12, steps=4)
    unwindowed = open_model(paths["window"])
    unwindowed.config.layers = tuple(dataclasses.replace(r, window=0) for r in unwindowed.config.layers)
    prompt = [int(t) for t in rng.integers(3, source.config.vocab_size, 12)]
    a, _ = forward64.model_forward(source, prompt)
    b, _ = forward64.model_forward(unwindowed, prompt)
    assert relative_error(b[-1], a[-1]) > 10 * TOLERANCE and want is not None


@pytest.mark.parametrize("name, lm_head", [("Q4_K_M", "q8"), ("MIXED_32", "q8"), ("hf", "fp16"), ("hf", "q8")])
def test_every_positions_logits(paths, device, rng, monkeypatch, name, lm_head):
    """prefill_logits over chunks of 8 (the lm_head as a GEMM over each chunk's rows: int8, int4 or fp16)
    equals the reference's logits at every position from `first` on, and leaves the last in logits()."""
    import perfx.model as model_module
    monkeypatch.setattr(model_module, "PREFILL_CHUNK", 8)
    model, source = load(paths[name], device, lm_head=lm_head)
    tokens = [int(t) for t in rng.integers(3, source.config.vocab_size, 21)]
    want, _ = forward64.model_forward(source, tokens)
    for first in (0, 5, 13, 20):
        got = model.prefill_logits(tokens, 0, first)
        assert got.shape == (21 - first, source.config.vocab_size)
        for row in range(len(got)):
            assert relative_error(got[row], want[first + row]) <= TOLERANCE, (first, row)
        assert relative_error(model.logits(), want[-1]) <= TOLERANCE
    # decode continues the same cache afterwards
    want_next, _ = forward64.model_forward(source, tokens + [7])
    model.decode_one(7, 21)
    assert relative_error(model.logits(), want_next[-1]) <= TOLERANCE


def test_lm_head_forms_and_bytes(paths, device):
    """The fp16 head of a Hugging Face checkpoint is int8 on the device by default: fewer bytes a token."""
    q8, source = load(paths["hf"], device)
    fp16, _ = load(paths["hf"], device, lm_head="fp16")
    c = source.config
    assert isinstance(q8.weights.lm_head.weight, Q8DeviceWeight)
    assert not isinstance(fp16.weights.lm_head.weight, Q8DeviceWeight)
    assert fp16.weight_bytes - q8.weight_bytes == 2 * c.vocab_size * c.hidden_size - \
        Q8Matrix.quantize(np.zeros((c.vocab_size, c.hidden_size), np.float16)).nbytes
