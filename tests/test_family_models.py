"""The family test models (helpers.family_models): the GGUF holds what its writer says, and llama.cpp still
gives the answers recorded in tests/data/llamacpp_families.json (``benchmarks/families_llamacpp.py`` writes
them; llama-cpp-python is benchmark-only, so that test is skipped without it)."""

import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import quants

from helpers.family_models import (FAMILIES, GEMMAS, family_tokenizer, make_family_model, qwen35_unstored,
                                   write_family_gguf, write_family_hf)
from helpers.llamacpp import INSTALL, cpu_has_amx, import_llama_cpp
from perfx.reference import permute_qk

RECORDED = json.loads((Path(__file__).parent / "data" / "llamacpp_families.json").read_text())

# Keys llama.cpp's loader reads for each architecture, besides the common ones
ARCH_KEYS = {
    "gemma3": ["attention.key_length", "attention.value_length", "attention.sliding_window", "rope.freq_base",
               "rope.freq_base_swa"],
    "gemma2": ["attention.key_length", "attn_logit_softcapping", "final_logit_softcapping",
               "attention.sliding_window"],
    "qwen3": ["attention.key_length", "attention.value_length", "rope.freq_base"],
    "phi3": ["rope.dimension_count", "rope.scaling.attn_factor", "rope.scaling.original_context_length",
             "attention.sliding_window"],
    "smollm3": ["rope.dimension_count", "vocab_size", "rope.freq_base"],
    "lfm2": ["shortconv.l_cache", "vocab_size", "attention.head_count_kv", "rope.freq_base"],
    "qwen35": ["ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
               "attention.recurrent_layers", "full_attention_interval", "rope.dimension_count"],
    "qwen35moe": ["ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
                  "full_attention_interval", "rope.dimension_count", "expert_count", "expert_used_count",
                  "expert_feed_forward_length", "expert_shared_feed_forward_length"],
}


def gguf_name_of(names, hf_name: str) -> str:
    """The GGUF tensor a transformers weight becomes (ssm_a and the dt bias have no .weight)."""
    if hf_name.endswith(".A_log"):
        return names.get_name(hf_name)
    if hf_name.endswith(".dt_bias"):
        return names.get_name(hf_name.replace(".dt_bias", ".dt_proj")) + ".bias"
    return names.get_name(hf_name.removesuffix(".weight")) + ".weight"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gguf_holds_the_weights_its_writer_returns(tmp_path, family):
    model = make_family_model(family, family_tokenizer(tmp_path, family), np.random.default_rng(0))
    written = write_family_gguf(tmp_path / "m.gguf", model)
    reader = gguf.GGUFReader(str(written.path))
    for key in ARCH_KEYS[family]:
        assert reader.get_field(f"{family}.{key}") is not None, key
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[family.upper()], model.n_layers)
    heads = {"q_proj": model.config["num_attention_heads"], "k_proj": model.config["num_key_value_heads"]}
    for hf_name, held in written.weights.items():
        expert = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", hf_name)
        if expert:   # one expert of a stacked (E, rows, K) tensor, as llama.cpp's converter writes them
            layer, e, part = expert.groups()
            t = tensors[f"blk.{layer}.ffn_{part}_exps.weight"]
            data = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(-1, *held.shape)[int(e)]
            np.testing.assert_array_equal(data, held, err_msg=hf_name)
            continue
        t = tensors[gguf_name_of(names, hf_name)]
        data = quants.dequantize(np.asarray(t.data), t.tensor_type)
        if family in ("qwen35", "qwen35moe"):   # stored as llama.cpp reads it (v heads tiled, −exp A_log, 1 + w): back to HF
            data = qwen35_unstored(hf_name, data, model.config)
        data = data.reshape(held.shape)
        module = hf_name.split(".")[-2]
        expected = held + 1 if family in GEMMAS and hf_name.endswith("norm.weight") else held
        if family == "smollm3" and module in heads:
            expected = permute_qk(expected, heads[module])
        if family in ("qwen35", "qwen35moe"):   # log(−(−exp A_log)) in float32 may land an ulp away
            np.testing.assert_allclose(data, expected.astype(np.float32), rtol=3e-7, atol=0, err_msg=hf_name)
        else:
            np.testing.assert_array_equal(data, expected.astype(np.float32), err_msg=hf_name)
        # and the held weights are the model's, within the type's rounding (4-bit: a step of max|w| / 8)
        original = model.weights[hf_name]
        assert np.abs(held - original).max() <= np.abs(original).max() / 7, hf_name
    tied = model.config.get("tie_word_embeddings", model.config.get("tie_embedding"))
    assert ("output.weight" in tensors) == (not tied and family != "gemma2")


def test_k_quants_need_rows_of_256(tmp_path):
    model = make_family_model("qwen3", family_tokenizer(tmp_path, "qwen3"), np.random.default_rng(0))
    with pytest.raises(ValueError, match="rows of 64 are no multiple of 256"):
        write_family_gguf(tmp_path / "m.gguf", model, [dict(q="Q4_K", k="Q8_0", v="Q8_0", o="Q8_0", gate="Q8_0",
                                                             up="Q8_0", down="Q8_0")])


@pytest.mark.parametrize("style", ["hub", "transformers5"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_directory(tmp_path, family, style):
    model = make_family_model(family, family_tokenizer(tmp_path, family), np.random.default_rng(0))
    directory = write_family_hf(tmp_path / "hf", model, style=style)
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == model.config["model_type"]
    # Qwen3.5's published config.json is transformers 5's already (rope_parameters) in either style
    assert ("rope_parameters" in config) == (style == "transformers5" or family in ("qwen35", "qwen35moe"))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] == (family in GEMMAS + ("lfm2",))   # as their published tokenizers


@pytest.mark.parametrize("family", RECORDED["families"])
def test_llama_cpp_still_gives_the_recorded_answers(tmp_path, family):
    pytest.importorskip("llama_cpp", reason=INSTALL)
    llama_cpp = import_llama_cpp()
    entry = RECORDED["families"][family]
    settings = dict(entry["make_family_model"])
    model = make_family_model(settings.pop("family"), family_tokenizer(tmp_path, family),
                              np.random.default_rng(settings.pop("seed")), **settings)
    path = write_family_gguf(tmp_path / "m.gguf", model, **entry["write_family_gguf"]).path
    for run in entry["runs"]:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=run["n_ctx"], n_batch=run["n_ctx"], n_threads=2,
                              n_threads_batch=2, logits_all=True, verbose=False)
        assert llm.tokenize(entry["prompt_text"].encode(), add_bos=True, special=True) == entry["prompt_ids"]
        llm.eval(entry["prompt_ids"])
        first = np.array(llm.scores[llm.n_tokens - 1])
        tokens = []
        for _ in range(len(run["greedy"])):
            tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval([tokens[-1]])
        assert tokens == run["greedy"]
        # llama.cpp's kernels differ a little between instruction sets; the file's logits spread is about 4.
        # Without its extra weight buffers (CPUs with AMX: helpers.llamacpp) its products round otherwise: phi3's
        # file differed by up to 0.14 on a Xeon VM, its greedy continuation unchanged.
        np.testing.assert_allclose(first, run["logits_prompt_last"], atol=0.2 if cpu_has_amx() else 2e-2)
