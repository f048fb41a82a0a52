"""`perfx warm` builds every kernel a model can run, all at once: after it, a model of the same settings runs
prompts of every size, greedy and sampled generation, speculation, perplexity, a batched decode step of several
sequences (``perfx.batch``) and constrained decoding without building one more program. Checked on a dense model
shaped as the default one (Q4_1, its int4 embedding tied to the lm_head), a hybrid (LFM2: convolutions, attention,
a mix of Q4_0, Q4_K, Q8_0 and Q6_K), a mixture of experts and Gemma 4 (layers of their own shapes, per-layer
inputs), at the built-in defaults and, for the first two, with GEMVs reading int8 activations (as tuned entries
may choose: more variants); and `perfx warm --json` says what it built."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers.family_models import family_tokenizer, make_family_model, write_family_gguf
from helpers.gemma4_models import make_gemma4, write_gemma4_gguf
from helpers.moe_models import write_moe_gguf
from helpers.tiny_models import make_tiny_model, tiny_tokenizer, write_gguf
from perfx import cli
from perfx.batch import Batch
from perfx.commands.perplexity import perplexity
from perfx.commands.warm import warm
from perfx.generate import SamplingConfig, generate
from perfx.model import Model, kernel_requests
from perfx.ops.gemm_q4 import GemmQ4
from perfx.ops.gemm_q8 import GemmQ8
from perfx.ops.gemv_q4 import GemvQ4
from perfx.ops.gemv_q8 import GemvQ8
from perfx.ops.logit_mask import mask_words
from perfx.runtime import Device
from perfx.sources import open_model
from perfx.speculative import Speculator
from perfx.tuning import SPECS
from perfx.tuning.database import Choice, default_database

pytestmark = pytest.mark.one_implementation

RECORDED = json.loads((Path(__file__).parent / "data" / "llamacpp_families.json").read_text())["families"]
FAMILIES = ["dense", "lfm2", "qwen3_moe", "gemma4"]
CTX = 80   # prompts of every bucket up to 80 tokens: up to the 65..256 bucket, as a longer context would run them


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("warm")
    # as the default model: every matrix Q4_1, the int4 embedding tied to the lm_head
    dense = make_tiny_model("gqa1", tiny_tokenizer(root), np.random.default_rng(3))
    q4_1 = {name: "Q4_1" for name in ("q", "k", "v", "o", "gate", "up", "down")}
    out = {"dense": write_gguf(root / "dense.gguf", dense, layer_types=[q4_1], embedding_type="Q4_1").path}
    settings = dict(RECORDED["lfm2"]["make_family_model"])
    lfm2 = make_family_model(settings.pop("family"), family_tokenizer(root, "lfm2"),
                             np.random.default_rng(settings.pop("seed")), **settings)
    out["lfm2"] = write_family_gguf(root / "lfm2.gguf", lfm2, **RECORDED["lfm2"]["write_family_gguf"]).path
    out["qwen3_moe"], _ = write_moe_gguf(root / "qwen3_moe.gguf", "qwen3_moe", np.random.default_rng(5))
    out["gemma4"] = root / "gemma4.gguf"
    write_gemma4_gguf(out["gemma4"], make_gemma4(np.random.default_rng(6)))
    return out


def run_everything(model: Model) -> None:
    """What a user can ask of a loaded model: a prompt of each length, generation greedy, sampled on the device
    and with speculation, perplexity, constrained decoding, and batched decode steps of 2 and 3 sequences."""
    rng = np.random.default_rng(9)
    vocab = model.config.vocab_size

    def ids(n):
        return rng.integers(3, vocab, n).tolist()
    for length in (1, 2, 4, 5, 16, 17, 64, 65, CTX):   # each prompt bucket's ends
        model.prefill(ids(length), 0)
    generate(model, None, ids(7), 4, SamplingConfig(temperature=0))
    generate(model, None, ids(7), 4, SamplingConfig(temperature=0.7, seed=5))
    # a repeated prompt: prompt lookup drafts, verified in steps of several tokens
    generate(model, None, ids(6) * 4, 8, SamplingConfig(temperature=0), speculator=Speculator("lookup"))
    perplexity(model, ids(2 * CTX), CTX, 2, None)
    model.prefill(ids(5), 0)
    model.masked_token(np.full(mask_words(vocab), 0xFFFFFFFF, np.uint32), SamplingConfig(temperature=0), 1, [], 5)
    for slots in (2, 3):
        batch = Batch(model, slots)
        for slot in range(slots):
            batch.prefill(slot, ids(3 + slot), 0)
        for _ in range(2):
            batch.step([(slot, int(rng.integers(3, vocab))) for slot in range(slots)])
    model.device.queue.finish()


class IntActivations:
    """The built-in defaults, but the GEMVs take x as int8 first (I8 1), as a device's tuned entries may choose:
    the norms and the decode attention then also write their outputs as int8 blocks for them to read."""

    def __init__(self, database):
        self.database = database

    def __getattr__(self, name):
        return getattr(self.database, name)

    def choices(self, device, spec, shape):
        found = self.database.choices(device, spec, shape)
        if spec in (SPECS["gemv_q4"], SPECS["gemv_q8"]):
            int8 = [p for p in spec.params.candidates(shape, device.caps) if p["I8"] == 1]
            # the defaults with int8 activations where those run, else the first such set
            wanted = {**found[0].params, "I8": 1}
            int8 = next((p for p in int8 if dict(p) == wanted), int8[0])
            found = [Choice(int8, "device", "int8 activations first"), *found]
        return found


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES + ["dense, int8 activations", "lfm2, int8 activations"])
def test_nothing_is_built_after_warm(device, paths, family):
    """Every program the device holds after warm and after everything above was among the builds warm made at
    once (``Device.build_many``): none was built one at a time, by warm's own check or later."""
    fresh = Device(device.entry.index)
    database = default_database(False)
    if family.endswith("int8 activations"):
        family, database = family.split(",")[0], IntActivations(database)
    planned = set(kernel_requests(open_model(paths[family]), fresh, CTX, database))
    result = warm(open_model(paths[family]), fresh, ctx=CTX, database=database)
    model = Model.load(open_model(paths[family]), fresh, ctx=CTX, progress=False, database=database)
    run_everything(model)
    missed = sorted(f"{key[0]} {dict(key[1])}" for key in fresh.program_keys - planned)
    assert not missed, f"{len(missed)} kernels built one at a time, after warm's builds at once: {missed}"
    assert result["missed"] == [] and result["plan"]["failed"] == 0
    assert result["kernels"] == len(planned) == result["plan"]["requested"]


def test_the_quantizing_of_x_is_taken_from_the_products_own_program(device):
    """A product that reads int8 activations takes the launch that quantizes its x from its own program (the
    quantizing reads none of the product's parameters): the int4 and int8 GEMVs and GEMMs build no program for it
    once their product is built."""
    fresh = Device(device.entry.index)
    caps = fresh.caps

    def int8(family, **fixed):
        shape = SPECS[family].test_shapes[0]
        params = next(p for p in SPECS[family].params.candidates(shape, caps)
                      if all(p[k] == v for k, v in fixed.items()))
        return shape, params
    shape, params = int8("gemv_q4", I8=1, LAYOUT=0)
    gemv_q4 = GemvQ4(fresh, params, shape)
    gemv_q4.kernel(shape["group"], shape["epilogue"], shape["k"])
    shape, params = int8("gemv_q8", I8=1)
    gemv_q8 = GemvQ8(fresh, params, shape)
    gemv_q8.kernel(shape["group"], shape["f32"], True, shape["epilogue"])
    shape, params = int8("gemm_q4_i8", DOT=0)
    gemm_q4 = GemmQ4(fresh, i8_params=params, shape=shape, kind="i8")
    gemm_q4.kernel("i8", shape["epilogue"], params["READ"], params["LAYOUT"])
    shape, params = int8("gemm_q8_i8", DOT=0)
    gemm_q8 = GemmQ8(fresh, params, shape, "i8")
    gemm_q8.kernel(shape["group"], shape["f32"], True, shape["epilogue"])
    products = fresh.program_keys
    assert len(products) == 4
    for kernel in (gemv_q4.quantize_kernel(), gemv_q8.quantize_kernel(SPECS["gemv_q8"].test_shapes[0]["group"]),
                   gemm_q4.quantize_kernel(), gemm_q8.quantize_kernel(SPECS["gemm_q8_i8"].test_shapes[0]["group"])):
        assert kernel.function_name.endswith("_quantize_x")
    assert fresh.program_keys == products
    # a group no product was built for: a program of its own
    gemv_q8.quantize_kernel(128)
    assert len(fresh.program_keys) == 5


def test_perfx_warm_json_says_what_it_built(device, capsys):
    """--json: the programs held, how many were compiled and how many came from the cache (None where the driver
    keeps its own cache, PoCL), the plan's builds at once, none missed, and the seconds."""
    def run():
        assert cli.main(["warm", "--model", "synthetic:tiny", "--ctx", "64", "--json"]) == 0
        return json.loads(capsys.readouterr().out)
    first, second = run(), run()
    for result in (first, second):
        assert result["kernels"] == result["plan"]["requested"] > 0 and result["missed"] == []
        assert result["seconds"] >= result["plan"]["seconds"] > 0
    if second["compiled"] is not None:
        assert second["compiled"] == 0 and second["from_cache"] == second["kernels"]
