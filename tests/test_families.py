"""The 2026 phone families end to end: Gemma 3, Gemma 2, Qwen3, Phi-3 (Phi-4-mini's shape), SmolLM3, LFM2 and
Qwen3.5.

Each family's tiny model (``helpers.family_models``) is written as llama.cpp's converter writes its GGUF and
as transformers writes its directory; ``tests/data/llamacpp_families.json`` holds what llama.cpp 0.3.36
(llama-cpp-python, benchmark-only: ``benchmarks/families_llamacpp.py`` records it) answered on that GGUF:
the prompt's ids, the last prompt position's logits and 8 greedy tokens, each with a top-1 margin of 0.5 or
more. perfx must give the same ids, its float64 reference forward the same logits within llama.cpp's own
error, its device forward the reference's logits within the kernels' tolerance and llama.cpp's greedy tokens
exactly; the Hugging Face directory must give the same recipe and the same forward; bad files of each family
get one clear error naming the tensor or key; `perfx perplexity` runs each.

Tolerances. Device against reference: 2e-3 of max|logits| (test_model.py's: fp16 KV cache and fp32 kernels).
Reference against llama.cpp on the recorded (Q4_0/Q8_0/K-quant) files: 0.5 absolute on logits that spread over
about ±12; measured at most 0.38. llama.cpp multiplies those weights by activations it rounds to 8 bits per
block of 32 and keeps K and V in fp16 (and the Gemmas take GELU from an fp16 table). On F32 files with an F32
cache, where llama.cpp and transformers agree to 1e-5, perfx's reference is 0.01 from both: perfx holds F32
tensors as fp16 (2⁻¹¹ per weight); with the file's float32 kept it agrees to 1e-5 too (Phi-3, whose
projections are stored fused, shows it). Qwen3.5 on its recorded file: 0.42 from llama.cpp at the last prompt
position (its tiny model is the most sensitive: the gated norm keeps only the direction of each head's output),
0.015 on its F32 file. The live check against llama.cpp on F32 files runs where
llama-cpp-python is installed. The greedy tokens must be equal: every margin is at least 0.5.
"""

import json
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers.family_models import (FAMILIES, family_tokenizer, make_family_model, write_family_gguf, write_family_hf,
                                   write_family_tokenizer)
from helpers.llamacpp import INSTALL, import_llama_cpp
from helpers.perplexity import reference_nll
from helpers.tiny_models import write_awq
from perfx import forward64
from perfx import cli, reference
from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.families.smollm3 import NO_ROPE_STEP as SMOLLM3_NO_ROPE_STEP
from perfx.generate import Conversation, SamplingConfig, generate
from perfx.model import Model
from perfx.ops.restore_points import KEPT
from perfx.serve.api import chat_prompt
from perfx.serve.engine import Engine
from perfx.sources import open_model
from perfx.speculative import MAX_DRAFT, Speculator, StepCosts
from perfx.step import fuses
from perfx.tuning.database import default_database
from perfx.tuning.spec import relative_error

pytestmark = pytest.mark.one_implementation

RECORDED = json.loads((Path(__file__).parent / "data" / "llamacpp_families.json").read_text())["families"]
RUNS = [(family, run["n_ctx"]) for family, entry in RECORDED.items() for run in entry["runs"]]
DEVICE_TOLERANCE = 2e-3
RESUME_TOLERANCE = 1e-4   # a resumed forward against a run from 0 on the device: fp32 sums in another order
LLAMA_CPP_ATOL = 0.5
F32_ATOL = 0.03   # perfx's fp16 copy of F32 weights: measured at most 0.0104
TEXT = ("kato rimu senla dope quiban zorel nevo pira nesu talo mirek sova lenu. " * 12).strip()
HF_FAMILIES = list(RECORDED)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Per family: the recorded GGUF, and Hugging Face directories of the same weights (both config styles)."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family, entry in RECORDED.items():
        settings = dict(entry["make_family_model"])
        model = make_family_model(settings.pop("family"), family_tokenizer(root, family),
                                  np.random.default_rng(settings.pop("seed")), **settings)
        written = write_family_gguf(root / f"{family}.gguf", model, **entry["write_family_gguf"])
        hub = write_family_hf(root / f"{family}-hub", model, written.weights, dtype="F32")
        new = write_family_hf(root / f"{family}-tf5", model, written.weights, dtype="F32", style="transformers5")
        out[family] = {"gguf": written.path, "hub": Path(hub), "transformers5": Path(new), "model": model}
    return out


def run_of(family: str, n_ctx: int) -> dict:
    return next(r for r in RECORDED[family]["runs"] if r["n_ctx"] == n_ctx)


def greedy_reference(source, prompt: list[int], steps: int, ctx: int) -> tuple[np.ndarray, list[int]]:
    logits, cache = forward64.model_forward(source, prompt, ctx=ctx)
    first, tokens, pos = logits[-1], [], len(prompt)
    for _ in range(steps):
        tokens.append(int(np.argmax(logits[-1])))
        logits, cache = forward64.model_forward(source, [tokens[-1]], pos, cache, ctx=ctx)
        pos += 1
    return first, tokens


@pytest.mark.parametrize("family", RECORDED)
def test_prompt_ids_equal_llama_cpp_s(files, family):
    tokenizer = open_model(files[family]["gguf"]).tokenizer
    entry = RECORDED[family]
    assert tokenizer.encode(entry["prompt_text"], add_bos=tokenizer.add_bos_token) == entry["prompt_ids"]


def rounded(value):
    """Floats to 6 significant digits: a GGUF holds float32 what config.json holds as decimals."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def recipe_of(config) -> tuple:
    """What the forward reads, layer by layer, at a context below Phi-3's original length."""
    layers = tuple((None if r.rope is None else (r.rope.theta, r.rope.dims, json.dumps(rounded(r.rope.scaling))),
                    r.window) for r in (config.layer(i, 128) for i in range(config.n_layers)))
    scalars = (config.head_dim, config.n_heads, config.n_kv_heads, config.qk_norm, config.post_norms,
               config.ffn_activation, round(config.scale, 6), config.attn_softcap, config.final_softcap,
               round(config.embedding_scale, 5), config.rotary_dims, config.tie_embeddings)
    return scalars, layers


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_the_recipe_is_the_family_s(files, family):
    """The recipe read from the GGUF is the one read from either config.json, and says what the family does."""
    gguf_config = open_model(files[family]["gguf"]).config
    for style in ("hub", "transformers5"):
        assert recipe_of(open_model(files[family][style]).config) == recipe_of(gguf_config), style
    c, shape = gguf_config, FAMILIES[family]
    windows = [r.window for r in c.layers]
    if family == "gemma3":   # every 6th layer global, at the global base; the others slide at the local base
        assert windows == [8, 8, 8, 8, 8, 0] and c.layers[5].rope.theta == 1e6 and c.layers[0].rope.theta == 1e4
        assert c.qk_norm and c.post_norms and c.ffn_activation == "gelu_tanh"
        assert c.embedding_scale == pytest.approx(math.sqrt(64)) and c.scale == pytest.approx(32 ** -0.5)
    elif family == "gemma2":   # even layers slide; both soft-caps
        assert windows == [8, 0, 8, 0] and (c.attn_softcap, c.final_softcap) == (10.0, 30.0) and not c.qk_norm
    elif family == "qwen3":
        assert c.qk_norm and c.head_dim * c.n_heads != c.hidden_size and windows == [0] * c.n_layers
    elif family == "phi3":   # 24 of 32 dimensions rotate; LongRoPE's short factors below the original context
        assert c.rotary_dims == int(0.75 * shape["hidden_size"]) // shape["num_attention_heads"] == 24
        short, long = c.layer(0, 256).rope.scaling, c.layer(0, 512).rope.scaling
        assert short["freq_factors"] != long["freq_factors"] and len(short["freq_factors"]) == 12
        assert short["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(256)), rel=1e-6)
    elif family == "smollm3":
        assert [r.rope is None for r in c.layers] == [(i + 1) % SMOLLM3_NO_ROPE_STEP == 0 for i in range(4)]


@pytest.mark.parametrize("family, n_ctx", RUNS)
def test_the_reference_forward_is_llama_cpp_s(files, family, n_ctx):
    """perfx's float64 forward over the GGUF gives llama.cpp's logits (within llama.cpp's own rounding) and
    its greedy tokens."""
    run, entry = run_of(family, n_ctx), RECORDED[family]
    first, tokens = greedy_reference(open_model(files[family]["gguf"]), entry["prompt_ids"], len(run["greedy"]),
                                     n_ctx)
    assert np.max(np.abs(first - np.asarray(run["logits_prompt_last"]))) <= LLAMA_CPP_ATOL
    assert tokens == run["greedy"]


@pytest.mark.parametrize("family", RECORDED)
def test_on_f32_files_the_reference_is_llama_cpp_s_to_fp16_rounding(files, tmp_path, family):
    """The recipe itself, without quantization on either side: an F32 file, an F32 KV cache in llama.cpp."""
    pytest.importorskip("llama_cpp", reason=INSTALL)
    llama_cpp = import_llama_cpp()
    entry = RECORDED[family]
    f32 = [{k: "F32" for k in entry["write_family_gguf"]["types"][0]}]
    path = write_family_gguf(tmp_path / "f32.gguf", files[family]["model"], types=f32, embedding_type="F32",
                             output_type="F32").path
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, n_threads=2, logits_all=True,
                          verbose=False, type_k=0, type_v=0)   # GGML_TYPE_F32 cache
    llm.eval(entry["prompt_ids"])
    want = np.array(llm.scores[llm.n_tokens - 1])
    got, _ = forward64.model_forward(open_model(path, lm_head="fp16"), entry["prompt_ids"], ctx=256)
    assert np.max(np.abs(got[-1] - want)) <= F32_ATOL


@pytest.mark.parametrize("family, n_ctx", RUNS)
def test_the_device_forward_is_the_reference_s(files, device, family, n_ctx):
    """Prefill and decode on the device (the kernels' defaults: the tuned entries were measured on Llama
    shapes) give the reference's logits at every step, and so llama.cpp's greedy tokens."""
    run, entry = run_of(family, n_ctx), RECORDED[family]
    source = open_model(files[family]["gguf"])
    model = Model.load(source, device, ctx=n_ctx, progress=False, database=default_database(False))
    prompt = entry["prompt_ids"]
    logits, cache = forward64.model_forward(source, prompt, ctx=n_ctx)
    model.prefill(prompt, 0)
    assert relative_error(model.logits(), logits[-1]) <= DEVICE_TOLERANCE
    tokens, pos = [], len(prompt)
    for _ in range(len(run["greedy"])):
        tokens.append(model.argmax())
        logits, cache = forward64.model_forward(source, [tokens[-1]], pos, cache, ctx=n_ctx)
        model.decode_one(tokens[-1], pos)
        pos += 1
        assert relative_error(model.logits(), logits[-1]) <= DEVICE_TOLERANCE
    assert tokens == run["greedy"]


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_the_hugging_face_directory_runs_as_the_gguf(files, device, family):
    """The same weights from config.json + safetensors (fp16 on load) give the GGUF's forward: the recipe
    and the tensor names are read alike (Gemma's 1 + w norms, Phi-3's fused projections)."""
    prompt = RECORDED[family]["prompt_ids"]
    # tables as fp16 on both sides (an fp16 table would otherwise be rounded to int8 on load, the GGUF's Q8_0 not)
    want, _ = forward64.model_forward(open_model(files[family]["gguf"], lm_head="fp16"), prompt, ctx=256)
    for style in ("hub", "transformers5"):
        got, _ = forward64.model_forward(open_model(files[family][style], lm_head="fp16"), prompt, ctx=256)
        # fp16 weights where the GGUF has Q8_0/Q4_0 values (written to the directory as float32): 2⁻¹¹ per weight
        assert relative_error(got[-1], want[-1]) <= 5e-3, style
    source = open_model(files[family]["hub"])
    got, _ = forward64.model_forward(source, prompt, ctx=64)
    model = Model.load(source, device, ctx=64, progress=False, database=default_database(False))
    model.prefill(prompt, 0)
    assert relative_error(model.logits(), got[-1]) <= DEVICE_TOLERANCE


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_awq_and_quantize_on_load_checkpoints_of_each_family(files, device, tmp_path, family):
    """AutoAWQ's packing of each family (Phi-3's fused qkv_proj and gate_up_proj are one Linear each, so one
    AWQ module each) reads into the int4 form, and so does --quantize q4 of the fp16 directory; the
    device forward gives the reference's logits on both."""
    model = files[family]["model"]
    directory, parts = write_awq(tmp_path / "awq", model, np.random.default_rng(5), group=32)
    write_family_tokenizer(directory, model)
    awq = open_model(directory)
    assert {form.kind for forms in awq.weight_forms().values() for form in forms} >= {"q4"}
    layer = awq.layer(0)
    # the first matrix of layer 0's mixer: LFM2's layer 0 is a conv layer, Qwen3.5's a Gated DeltaNet layer
    role, first = next(iter(layer.linears().items()))
    module = {"qkv": "self_attn.qkv_proj" if family == "phi3" else "self_attn.q_proj", "conv_in": "conv.in_proj",
              "delta_qkv": "linear_attn.in_proj_qkv"}[role]
    codes, zeros, scales = parts[f"model.layers.0.{module}"]
    want = (codes.astype(np.float64) - np.repeat(zeros, 32, axis=1)) * np.repeat(scales.astype(np.float64), 32, axis=1)
    # the int4 form holds w = s·q + m with m = −z·s rounded once to fp16: at most 2⁻¹¹·|z·s| per weight
    offset = np.repeat(zeros * scales.astype(np.float64), 32, axis=1)
    assert np.all(np.abs(first.dequantize()[:want.shape[0]] - want) <= 2.0 ** -11 * np.abs(offset) + 1e-12)
    prompt = RECORDED[family]["prompt_ids"]
    for source in (awq, open_model(files[family]["hub"], quantize="q4")):
        logits, cache = forward64.model_forward(source, prompt, ctx=64)
        loaded = Model.load(source, device, ctx=64, progress=False, database=default_database(False), fuse=True)
        loaded.prefill(prompt, 0)
        assert relative_error(loaded.logits(), logits[-1]) <= DEVICE_TOLERANCE
        # decode steps (asked to fuse) with the norms as tails of the GEMVs where every mixer's output, gate-up and down are int4
        # (perfx.step.fused_step: Gemma's post-norms, LFM2's convolution and Qwen3.5's DeltaNet outputs among them)
        assert loaded.fused == fuses(source.config, loaded.plan.options)
        pos = len(prompt)
        for token in (5, 9):
            logits, cache = forward64.model_forward(source, [token], pos, cache, ctx=64)
            loaded.decode_one(token, pos)
            pos += 1
            assert relative_error(loaded.logits(), logits[-1]) <= DEVICE_TOLERANCE


@pytest.mark.parametrize("family", RECORDED)
def test_perplexity_of_each_family(files, capsys, tmp_path, family):
    """`perfx perplexity` on each family equals llama-perplexity's method over the reference (within the
    device's 2e-3 of max|logits|, which moves a token's NLL by at most ~0.04 for logits of ±10)."""
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    code = cli.main(["perplexity", str(text), "--model", str(files[family]["gguf"]), "--ctx", "32", "--chunks", "2",
                     "--json", "--no-tuning"])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert abs(result["nll"] - reference_nll(files[family]["gguf"], TEXT, 32, 2)[0]) <= 0.04


# -- bad files of each family ---------------------------------------------------------------------------


def rewrite_gguf(src: Path, dst: Path, drop=(), fields: dict | None = None, tensors: dict | None = None) -> Path:
    """A copy of a GGUF with tensors dropped or replaced (float32 arrays) and header fields changed."""
    reader = gguf.GGUFReader(str(src))
    fields = fields or {}
    arch = bytes(reader.get_field("general.architecture").parts[-1]).decode()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        if name in fields and kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, fields[name], kind, sub_type=field.types[-1])
            continue
        if name in fields:
            value = fields[name]
        elif kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            value = ([bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
                     if sub == gguf.GGUFValueType.STRING else [field.parts[i].tolist()[0] for i in field.data])
            writer.add_array(name, value) if sub == gguf.GGUFValueType.STRING else writer.add_key_value(
                name, value, kind, sub_type=sub)
            continue
        elif kind == gguf.GGUFValueType.STRING:
            value = bytes(field.parts[-1]).decode("utf-8", "replace")
        else:
            value = field.parts[-1].tolist()[0]
        writer.add_key_value(name, value, kind)
    for t in reader.tensors:
        if t.name in drop:
            continue
        if tensors and t.name in tensors:
            writer.add_tensor(t.name, np.asarray(tensors[t.name], np.float32))
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)   # quantized: bytes per row
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_a_rewritten_gguf_is_the_same_model(files, tmp_path):
    """The copier the bad-file tests use changes nothing by itself."""
    path = rewrite_gguf(files["qwen3"]["gguf"], tmp_path / "same.gguf")
    prompt = RECORDED["qwen3"]["prompt_ids"]
    a, _ = forward64.model_forward(open_model(files["qwen3"]["gguf"]), prompt)
    b, _ = forward64.model_forward(open_model(path), prompt)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("family, change, message", [
    ("qwen3", {"drop": ["blk.1.attn_k_norm.weight"]}, r"tensor blk\.1\.attn_k_norm\.weight is missing"),
    ("gemma3", {"drop": ["blk.2.post_ffw_norm.weight"]}, r"tensor blk\.2\.post_ffw_norm\.weight is missing"),
    ("gemma2", {"drop": ["blk.0.post_attention_norm.weight"]}, r"blk\.0\.post_attention_norm\.weight is missing"),
    ("qwen3", {"fields": {"qwen3.attention.key_length": 24, "qwen3.attention.value_length": 24}},
     r"blk\.0\.attn_q\.weight has 128 rows, but qwen3\.attention\.head_count 4 × qwen3\.attention\.key_length 24"
     r" = 96 \(key_length does not divide"),
    ("phi3", {"tensors": {"rope_factors_short.weight": np.ones(10)}},
     r"rope_factors_short\.weight has 10 values, but RoPE over 24 dimensions needs one per dimension pair, 12"),
    ("phi3", {"drop": ["rope_factors_long.weight"]}, r"needs both factor tables"),
    ("phi3", {"fields": {"phi3.attention.head_count_kv": 1}},
     r"fused tensor blk\.0\.attn_qkv\.weight has shape \(256, 128\), but its rows do not split as the header says "
     r"\(4 heads × 32 \+ 2 × 1 kv heads × 32 = 192"),
    ("gemma3", {"fields": {"gemma3.attention.value_length": 16}}, r"value_length = 16 differs from key_length"),
    # LFM2: the layer pattern (kv heads per layer), the convolution's length and the conv tensors must agree
    ("lfm2", {"fields": {"lfm2.attention.head_count_kv": [0, 0, 2]}},
     r"lfm2\.attention\.head_count_kv lists 3 layers but the model has 4"),
    ("lfm2", {"fields": {"lfm2.attention.head_count_kv": [2, 0, 2, 0]}},
     r"tensor blk\.0\.attn_q\.weight is missing"),
    ("lfm2", {"fields": {"lfm2.attention.head_count_kv": [0, 0, 0, 0]}}, r"at least one attention layer"),
    ("lfm2", {"fields": {"lfm2.shortconv.l_cache": 4}},
     r"blk\.0\.shortconv\.conv\.weight has shape \(128, 3\), but lfm2\.shortconv\.l_cache = 4"),
    ("lfm2", {"drop": ["blk.1.shortconv.out_proj.weight"]}, r"tensor blk\.1\.shortconv\.out_proj\.weight is missing"),
    # Qwen3.5: the layer pattern, the convolution's length and the DeltaNet's sizes must agree with the tensors
    ("qwen35", {"fields": {"qwen35.attention.recurrent_layers": [True, True, False, False]}},
     r"layer 2 holds linear-attention tensors \(ssm_conv1d\) but qwen35\.attention\.recurrent_layers make it a "
     r"full-attention layer"),
    ("qwen35", {"fields": {"qwen35.attention.recurrent_layers": [True, True, True]}},
     r"recurrent_layers lists 3 layers but the model has 4"),
    ("qwen35", {"fields": {"qwen35.ssm.conv_kernel": 3}},
     r"blk\.0\.ssm_conv1d\.weight has shape \(256, 4\), but qwen35\.ssm\.conv_kernel = 3"),
    ("qwen35", {"fields": {"qwen35.ssm.inner_size": 100}},
     r"qwen35\.ssm\.inner_size = 100 must be qwen35\.ssm\.time_step_rank 4 × qwen35\.ssm\.state_size 32 = 128"),
    ("qwen35", {"fields": {"qwen35.ssm.state_size": 16, "qwen35.ssm.inner_size": 64}},
     r"tensor blk\.0\.attn_qkv\.weight has shape \(256, 64\) but .* needs \(128, 64\)"),
    ("qwen35", {"drop": ["blk.1.ssm_a"]}, r"tensor blk\.1\.ssm_a is missing"),
])
def test_bad_family_ggufs_name_the_tensor_or_key(files, tmp_path, family, change, message):
    bad = rewrite_gguf(files[family]["gguf"], tmp_path / "bad.gguf", **change)
    with pytest.raises(PerfxError, match=message):
        open_model(bad)


@pytest.mark.parametrize("family, edit, message", [
    ("gemma3", lambda c: c.update(layer_types=["full_attention"] * 2), r"layer_types lists 2 layers but the model has 6"),
    ("phi3", lambda c: c["rope_scaling"].update(short_factor=[1.0] * 5),
     r"rope_scaling\.short_factor has 5 values, but RoPE over 24 dimensions needs 12"),
    ("smollm3", lambda c: c.update(no_rope_layers=[1, 1]), r"no_rope_layers lists 2 layers but the model has 4"),
    ("lfm2", lambda c: c.update(layer_types=["conv", "full_attention"]), r"layer_types .* must name 4 layers"),
    ("lfm2", lambda c: c.update(conv_L_cache=4), r"conv\.conv\.weight has shape \(128, 1, 3\)"),
])
def test_bad_family_configs_name_the_key(files, tmp_path, family, edit, message):
    directory = files[family]["hub"]
    config = json.loads((directory / "config.json").read_text())
    edit(config)
    bad = tmp_path / "bad"
    bad.mkdir()
    for item in directory.iterdir():
        (bad / item.name).symlink_to(item)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(PerfxError, match=message):
        open_model(bad)


def test_a_fused_hugging_face_projection_must_split_as_the_config_says(files, tmp_path):
    directory = files["phi3"]["hub"]
    config = json.loads((directory / "config.json").read_text())
    config["num_key_value_heads"] = 1
    bad = tmp_path / "bad"
    bad.mkdir()
    for item in directory.iterdir():
        if item.name != "config.json":
            (bad / item.name).symlink_to(item)
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(PerfxError, match=r"fused tensor model\.layers\.0\.self_attn\.qkv_proj\.weight has shape "
                                         r"\(256, 128\), but its rows do not split as config\.json says"):
        open_model(bad)


def test_an_lfm2_chat_turn_resumes_from_its_conv_rings(files, device):
    """A second turn that shares its prefix with the first resumes there (the conv rings hold the state),
    and gives the logits of a run of the whole prompt from 0; past what the rings hold it resumes at the
    restore point kept at the first prompt's end, and elsewhere is refused with a clear error, which
    can_resume says beforehand."""
    source = open_model(files["lfm2"]["gguf"])
    model = Model.load(source, device, ctx=256, progress=False, database=default_database(False))
    prompt = RECORDED["lfm2"]["prompt_ids"]
    first, second = prompt[:9], prompt
    model.prefill(first, 0)
    for pos, token in enumerate([5, 6, 7], start=len(first)):   # a reply, then a rollback of its end
        model.decode_one(token, pos)
    assert model.can_resume(len(first))
    model.prefill(second[len(first):], len(first))
    resumed = model.logits()
    want, _ = forward64.model_forward(source, second)
    assert relative_error(resumed, want[-1]) <= DEVICE_TOLERANCE
    for pos in range(len(second), len(second) + 80):
        model.decode_one(3, pos)
    assert model.can_resume(len(first)) and not model.can_resume(len(first) + 1)
    assert model.resume_point(len(first) + 3) == len(first)
    model.prefill(second[len(first):], len(first))
    assert relative_error(model.logits(), want[-1]) <= DEVICE_TOLERANCE
    for pos in range(len(second), len(second) + 80):
        model.decode_one(3, pos)
    with pytest.raises(PerfxError, match="conv layers hold their state for positions"):
        model.prefill(second[len(first) + 1:], len(first) + 1)


def test_a_qwen35_config_json_gives_the_gguf_s_recipe(files):
    """config.json (transformers' Qwen3_5TextConfig, and the multimodal checkpoint's text_config) and the GGUF
    header give one recipe: the layer pattern, the DeltaNet's sizes, the convolution, partial rotary, gates."""
    want = open_model(files["qwen35"]["gguf"]).config
    text = json.loads((files["qwen35"]["hub"] / "config.json").read_text())
    for config in (text, {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": text}):
        got = ModelConfig.from_hf(config)
        assert recipe_of(got) == recipe_of(want)
        assert [r.kind for r in got.layers] == [r.kind for r in want.layers] == ["delta"] * 3 + ["attention"]
        assert (got.delta_k_heads, got.delta_v_heads, got.delta_k_dim, got.delta_v_dim, got.conv_length) == \
            (want.delta_k_heads, want.delta_v_heads, want.delta_k_dim, want.delta_v_dim, want.conv_length) == \
            (2, 4, 32, 32, 4)
        assert got.attention_gate and want.attention_gate and want.rotary_dims == 16
        # transformers groups the v heads by q/k head, the converter tiles them
        assert (got.delta_head_map, want.delta_head_map) == ("interleave", "tile")


def test_a_multimodal_qwen35_checkpoint_reads_its_language_model(files, tmp_path):
    """Published Qwen3.5 checkpoints are Qwen3_5ForConditionalGeneration: config.json's text_config and the
    decoder's tensors under model.language_model. (vision tensors beside them are not read); the same weights
    give the same forward as the text model's directory."""
    hub = files["qwen35"]["hub"]
    directory = tmp_path / "multimodal"
    shutil.copytree(hub, directory)
    tensors = load_file(str(hub / "model.safetensors"))
    renamed = {name.replace("model.", "model.language_model.", 1): w for name, w in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    save_file(renamed, str(directory / "model.safetensors"))
    text = json.loads((hub / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(
        {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
         "tie_word_embeddings": text["tie_word_embeddings"], "text_config": text, "vision_config": {"depth": 1}}))
    prompt = RECORDED["qwen35"]["prompt_ids"]
    want, _ = forward64.model_forward(open_model(hub, lm_head="fp16"), prompt, ctx=64)
    got, _ = forward64.model_forward(open_model(directory, lm_head="fp16"), prompt, ctx=64)
    assert np.array_equal(got, want)


def test_a_qwen35_prefill_is_its_token_by_token_decode(files, device):
    """The chunked Gated DeltaNet (prefill, several chunks and a tail) and the recurrent one (decode) leave the
    same state and give the same logits: a prompt prefilled at once, then token by token from 0."""
    source = open_model(files["qwen35"]["gguf"])
    model = Model.load(source, device, ctx=64, progress=False, database=default_database(False))
    prompt = (RECORDED["qwen35"]["prompt_ids"] * 3)[:40]
    model.prefill(prompt, 0)
    at_once = model.logits()
    model.decode_one(prompt[0], 0)
    for pos, token in enumerate(prompt[1:], start=1):
        model.decode_one(token, pos)
    assert relative_error(model.logits(), at_once) <= DEVICE_TOLERANCE
    want, _ = forward64.model_forward(source, prompt)
    assert relative_error(at_once, want[-1]) <= DEVICE_TOLERANCE


def test_a_qwen35_chat_turn_resumes_at_its_last_position_or_a_restore_point(files, device):
    """A turn that continues where the last one stopped resumes from the recurrent state; one that edits an
    earlier turn resumes at the restore point kept at the end of the prompt before it (the Conversation
    finds it) and gives the logits of a run from 0; anywhere else is refused, and can_resume says so. The
    load report counts the restore points, the kept ones are the latest few."""
    source = open_model(files["qwen35"]["gguf"])
    model = Model.load(source, device, ctx=128, progress=False, database=default_database(False))
    c = source.config
    s_bytes = 4 * len(c.layers_of("delta")) * c.delta_v_heads * c.delta_v_dim * c.delta_k_dim
    rows = 4 * (c.conv_length - 1) * len(c.layers_of("delta")) * c.delta_conv_dim
    assert model.load_report["restore_points"] == KEPT + 1   # and one for speculative verification
    assert model.load_report["restore_point_bytes"] == (KEPT + 1) * (s_bytes + rows)
    prompt = RECORDED["qwen35"]["prompt_ids"]
    first, reply = prompt[:9], [5, 6, 7]
    model.prefill(first, 0)
    for pos, token in enumerate(reply, start=len(first)):
        model.decode_one(token, pos)
    whole = first + reply + prompt[9:]
    assert model.can_resume(len(first) + len(reply)) and model.can_resume(len(first)) and model.can_resume(0)
    assert not model.can_resume(len(first) + 1)
    model.prefill(whole[len(first) + len(reply):], len(first) + len(reply))
    want, _ = forward64.model_forward(source, whole)
    assert relative_error(model.logits(), want[-1]) <= DEVICE_TOLERANCE
    for pos, token in enumerate([8, 9], start=len(whole)):
        model.decode_one(token, pos)
    with pytest.raises(PerfxError, match="Gated DeltaNet layers hold their state after position"):
        model.prefill(prompt[9:], len(first) + 1)
    # The second turn edited after two tokens of the first reply: back to the first prompt's end.
    edited = first + reply[:2] + [11, 12, 13, 14]
    conversation = Conversation(model.resume_point)
    conversation.cached = whole + [8]
    start, todo = conversation.resume(edited)
    assert (start, todo) == (len(first), edited[len(first):]) and conversation.cached == first
    model.prefill(todo, start)
    resumed = model.logits()
    assert sorted(model.restore_points.positions) == [len(first), len(edited)], "the later ones were rewritten"
    model.prefill(edited, 0)
    # the same kernels over the same positions, the prefill chunks cut elsewhere: fp32 sums in another order
    assert relative_error(resumed, model.logits()) <= RESUME_TOLERANCE
    want, _ = forward64.model_forward(source, edited)
    assert relative_error(resumed, want[-1]) <= DEVICE_TOLERANCE
    model.prefill(prompt[:4], 0)
    for end in range(5, 5 + KEPT):   # more prompt ends than are kept: the oldest goes
        model.prefill(prompt[end - 1:end], end - 1)
    assert list(model.restore_points.positions) == list(range(5, 5 + KEPT)) and not model.can_resume(4)
    assert not model.can_roll_back


class Oracle:
    """A draft model that knows the one-token-a-step text: it drafts it with every third token wrong, so
    verification steps accept some drafts and reject the rest."""
    token_seconds = 0.0

    def __init__(self, text: list[int], vocab: int):
        self.text, self.vocab = text, vocab

    def calibrate(self):
        pass

    def room(self, seen):
        return 1 << 20

    def propose(self, seen, k, sampler):
        truth = (self.text[len(seen):] + [0] * k)[:k]
        return [t if (len(seen) + i) % 3 else (t + 1) % self.vocab for i, t in enumerate(truth)], None


def test_qwen35_speculation_gives_the_one_token_a_step_reply(files, device):
    """--speculate lookup on Qwen3.5, and a draft model whose drafts are partly rejected: each verification
    keeps the state before it, a rejected draft restores it and runs the accepted tokens again, so the greedy
    reply is the one-token-a-step one, and so is the next turn's, which resumes after the reply. Auto
    speculates too."""
    source = open_model(files["qwen35"]["gguf"])
    model = Model.load(source, device, ctx=128, progress=False, database=default_database(False))
    prompt = RECORDED["qwen35"]["prompt_ids"] * 3
    greedy, flat = SamplingConfig(temperature=0), {m: 1.0 for m in range(1, MAX_DRAFT + 2)}
    results = {}
    for mode in ("off", "lookup", "draft"):
        text = prompt + results["off"][0].ids + prompt[:5] + results["off"][1].ids if mode == "draft" else []
        speculator = Speculator(mode, Oracle(text, source.config.vocab_size) if text else None,
                                costs=StepCosts(flat))
        conversation = Conversation(model.resume_point)
        start, todo = conversation.resume(prompt)
        first = generate(model, source.tokenizer, todo, 24, greedy, start_pos=start, speculator=speculator)
        conversation.record(prompt, first)
        second_prompt = prompt + first.ids + prompt[:5]
        start, todo = conversation.resume(second_prompt)
        assert start == first.end_pos
        second = generate(model, source.tokenizer, todo, 8, greedy, start_pos=start,
                          history=second_prompt[:start], speculator=speculator)
        results[mode] = (first, second)
    plain = results["off"]
    for mode in ("lookup", "draft"):
        first, second = results[mode]
        assert first.ids == plain[0].ids and second.ids == plain[1].ids, mode
        assert first.stats.verify_steps > 0 and first.stats.drafted > first.stats.accepted
    assert results["draft"][0].stats.accepted > 0
    auto = Speculator("auto")
    auto.begin(model, prompt, 0)
    assert auto.drafter == "lookup"


def test_serve_requests_sharing_a_system_prompt_resume_at_its_end(files, device):
    """Two chat requests with one system prompt: the first keeps a restore point at the system prompt's end,
    the second resumes there and replies as a run from 0 does."""
    source = open_model(files["qwen35"]["gguf"])
    model = Model.load(source, device, ctx=128, progress=False, database=default_database(False))
    tokenizer = source.tokenizer
    greedy = SamplingConfig(temperature=0)
    engine = Engine(model, tokenizer, 2, greedy)
    system = {"role": "system", "content": "kato rimu senla dope quiban zorel nevo pira nesu talo"}
    jobs = []
    try:
        for user in ("mirek sova lenu", "nevo pira"):
            ids, messages, _, _ = chat_prompt({"messages": [system, {"role": "user", "content": user}]}, tokenizer)
            jobs.append(engine.job(ids, 6, {}, [], messages))
            engine.submit(jobs[-1])
            assert jobs[-1].finished.wait(120)
    finally:
        engine.close()
    end = jobs[0].restore_at[0]
    assert end > 10 and jobs[1].restore_at == (end,)
    assert jobs[0].cached_tokens == 0 and jobs[1].cached_tokens == end
    fresh = generate(model, tokenizer, jobs[1].prompt_ids, 6, greedy)
    assert jobs[1].result.ids == fresh.ids
