"""Every architecture is one family file (perfx/families/<arch>.py), found by itself: each carries every part
(names, both recipe readers, tensor names, chat rules, a synthetic model), no two claim one name, the set
covers what perfx ran before, and a new dense family is picked up by adding its file and nothing else."""

from __future__ import annotations

import pkgutil
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.family_models import FAMILIES as TINY_FAMILIES, MODEL_TYPE
from helpers.moe_models import MOE_MODEL_TYPES
from helpers.gemma3n_models import TINY as GEMMA3N_TINY
from helpers.gemma4_models import TINY as GEMMA4_TINY
from helpers.gptoss_models import TINY as GPTOSS_TINY
from helpers.tiny_models import SHAPES as TINY_SHAPES
from perfx import families, tokenizer
from perfx.config import LAYER_KINDS, SUPPORTED_ARCHITECTURES, SUPPORTED_GGUF_ARCHITECTURES, ModelConfig
from perfx.errors import PerfxError
from perfx.families import FAMILIES, discover_families, family_of
from perfx.families.family import ChatRules, Family, Preset, TensorNames
from perfx.sources.synthetic import SYNTHETIC_MODELS

ROOT = Path(__file__).resolve().parent.parent

# What perfx ran before the families had files of their own, in the order it listed them.
HF_BEFORE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "phi3", "smollm3", "lfm2",
             "qwen3_5_text", "qwen3_5")
GGUF_BEFORE = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "smollm3", "lfm2", "qwen35")
SYNTHETIC_BEFORE = ("llama-2-7b", "smollm2-135m", "tiny", "gemma-3-270m", "gemma-3-1b", "qwen3-1.7b", "phi-4-mini",
                    "smollm3-3b", "lfm2-350m", "lfm2-1.2b", "qwen3.5-0.8b", "qwen3.5-2b")


def test_every_module_of_the_package_is_one_family_file():
    modules = sorted(m.name for m in pkgutil.iter_modules(families.__path__))
    assert [m for m in modules if m != families.BASE_MODULE] == sorted(FAMILIES)
    for name, family in FAMILIES.items():
        assert family.name == name
        assert __import__(f"perfx.families.{name}", fromlist=["FAMILY"]).FAMILY is family


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_family_carries_every_part(name):
    family = FAMILIES[name]
    assert isinstance(family, Family)
    assert family.gguf_names and family.hf_names, f"{name}: its GGUF and Hugging Face names"
    assert callable(family.read_gguf) and callable(family.read_hf), f"{name}: both recipe readers"
    assert isinstance(family.tensors, TensorNames), f"{name}: its tensor names"
    assert isinstance(family.chat, ChatRules) and family.chat.stop_tokens, f"{name}: its chat rules"
    assert family.synthetic, f"{name}: at least one synthetic:<name> preset"
    assert set(family.layer_kinds) <= set(LAYER_KINDS) and "attention" in family.layer_kinds
    assert set(family.hf_multimodal) <= set(family.hf_names)
    # a fallback template goes with the vocabulary tokens that pick it; a right-strip rule with its names
    assert bool(family.chat.fallback_template) == bool(family.chat.template_tokens)
    assert bool(family.chat.rstrip_keep) <= bool(family.chat.rstrip_names)
    # the tokenizer knows its turn ends and its pre-tokenizers
    assert set(family.chat.stop_tokens) <= tokenizer._END_OF_GENERATION_TOKENS
    assert set(family.chat.pre_tokenizers) <= set(tokenizer._BPE_PRE_TOKENIZERS)
    # the tests can write a tiny model of it (helpers.family_models, or helpers.tiny_models for Llama and Qwen2)
    tiny_types = ({MODEL_TYPE[f] for f in TINY_FAMILIES} | {s["architecture"] for s in TINY_SHAPES.values()}
                  | set(MOE_MODEL_TYPES) | {GEMMA4_TINY["model_type"], GEMMA3N_TINY["model_type"],
                                           GPTOSS_TINY["model_type"]})
    assert tiny_types & set(family.hf_names), f"{name}: no tiny model writer in tests/helpers"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_familys_presets_are_read_by_its_own_reader(name):
    family = FAMILIES[name]
    for preset_name, preset in family.synthetic.items():
        assert isinstance(preset, Preset)
        config = SYNTHETIC_MODELS[preset_name][0]
        assert config == ModelConfig.from_hf(dict(preset.config))
        assert family_of(config.architecture) is family
        assert {r.kind for r in config.layers} <= set(family.layer_kinds), preset_name


def test_no_two_families_claim_one_name():
    claimed = [name for f in FAMILIES.values() for name in dict.fromkeys(f.gguf_names + f.hf_names)]
    assert len(claimed) == len(set(claimed))
    presets = [p for f in FAMILIES.values() for p in f.synthetic]
    assert len(presets) == len(set(presets))
    pre = [p for f in FAMILIES.values() for p in f.chat.pre_tokenizers]
    assert len(pre) == len(set(pre))
    orders = [f.order for f in FAMILIES.values()]
    assert len(orders) == len(set(orders))


def test_the_families_cover_what_perfx_ran_before():
    # in the order they came; families added since follow
    assert SUPPORTED_ARCHITECTURES[:len(HF_BEFORE)] == HF_BEFORE
    assert SUPPORTED_GGUF_ARCHITECTURES[:len(GGUF_BEFORE)] == GGUF_BEFORE
    assert {"qwen3_moe", "lfm2_moe"} <= set(SUPPORTED_ARCHITECTURES)
    assert {"qwen3moe", "lfm2moe"} <= set(SUPPORTED_GGUF_ARCHITECTURES)
    assert set(SYNTHETIC_BEFORE) <= set(SYNTHETIC_MODELS)
    for name in HF_BEFORE + GGUF_BEFORE:
        assert family_of(name).name in FAMILIES


def test_an_unknown_architecture_lists_what_perfx_runs():
    with pytest.raises(PerfxError, match=r"model_type 'rwkv' .* is not supported; perfx runs llama, mistral, qwen2"):
        ModelConfig.from_hf({"model_type": "rwkv", "architectures": ["RwkvForCausalLM"]})
    with pytest.raises(PerfxError, match="model architecture 'rwkv' is not supported; perfx runs llama, mistral"):
        family_of("rwkv")


def test_two_families_claiming_one_name_are_refused(tmp_path, monkeypatch):
    package = tmp_path / "clash"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module in ("one", "two"):
        (package / f"{module}.py").write_text(textwrap.dedent(f"""
            from perfx.families.family import ChatRules, Family, TensorNames
            FAMILY = Family(name="{module}", order=0, gguf_names=("{module}",), hf_names=("shared",),
                            read_gguf=dict, read_hf=dict, tensors=TensorNames(),
                            chat=ChatRules(stop_tokens=("</s>",)), synthetic={{}})
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PerfxError, match="families 'one' and 'two' both claim the architecture 'shared'"):
        discover_families("clash")


# A made-up dense architecture: Llama's recipe with q/k norms, its own names, one preset.
NEW_FAMILY = '''
"""Toy: a made-up dense architecture, Llama's recipe with q/k norms."""

from perfx.families.family import ChatRules, Family, Preset, TensorNames


def read_gguf(h):
    return {"qk_norm": True}


def read_hf(h):
    return {"qk_norm": True}


FAMILY = Family(
    name="toy", order=99, gguf_names=("toy",), hf_names=("toy_text",),
    read_gguf=read_gguf, read_hf=read_hf, tensors=TensorNames(),
    chat=ChatRules(stop_tokens=("<|toy_end|>",)),
    synthetic={"toy-1m": Preset(dict(model_type="toy_text", vocab_size=256, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))},
)
'''

NEW_FAMILY_CHECK = '''
import sys
import gguf
import numpy as np
from perfx.config import SUPPORTED_ARCHITECTURES, SUPPORTED_GGUF_ARCHITECTURES, ModelConfig
from perfx.families import FAMILIES
from perfx.gguf_file import GGUFFile
from perfx.sources.synthetic import SYNTHETIC_MODELS
from perfx.tokenizer import _END_OF_GENERATION_TOKENS

import perfx
assert perfx.__file__.startswith(sys.argv[2]), perfx.__file__   # the copy, with the new file
assert list(FAMILIES)[-1] == "toy"
assert "toy_text" in SUPPORTED_ARCHITECTURES and "toy" in SUPPORTED_GGUF_ARCHITECTURES
assert "<|toy_end|>" in _END_OF_GENERATION_TOKENS
c = SYNTHETIC_MODELS["toy-1m"][0]
assert (c.architecture, c.qk_norm, c.head_dim, c.n_kv_heads) == ("toy_text", True, 32, 1), c

path = sys.argv[1]
writer = gguf.GGUFWriter(path, "toy")
for key, value in (("context_length", 64), ("embedding_length", 64), ("feed_forward_length", 128),
                   ("block_count", 2), ("attention.head_count", 2), ("attention.head_count_kv", 1)):
    writer.add_uint32(f"toy.{key}", value)
writer.add_float32("toy.attention.layer_norm_rms_epsilon", 1e-6)
writer.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
g = ModelConfig.from_gguf(GGUFFile(path))
assert (g.architecture, g.qk_norm, g.vocab_size, g.tie_embeddings) == ("toy", True, 256, True), g
print("toy family read")
'''


def test_a_new_dense_family_is_its_file_alone(tmp_path):
    """A copy of the package with one more file in perfx/families: the GGUF and config.json readers, the lists
    of what perfx runs, the synthetic models and the tokenizer's stop tokens all have it."""
    copy = tmp_path / "perfx"
    shutil.copytree(ROOT / "perfx", copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "families" / "toy.py").write_text(NEW_FAMILY)
    (tmp_path / "check.py").write_text(NEW_FAMILY_CHECK)
    result = subprocess.run([sys.executable, str(tmp_path / "check.py"), str(tmp_path / "toy.gguf"), str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "toy family read" in result.stdout
    assert "toy" not in FAMILIES   # this process's package is untouched
