"""The step as data (``perfx.step``): the shapes `perfx tune` measures are exactly the ops of the built steps
(the decode step and each prefill bucket's), for every family's synthetic model; and a loaded model's plan
chose its kernels for those ops only, with a wrapper for every op of its decode step."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
import json

import numpy as np
import pytest

from helpers.family_models import FAMILIES, family_tokenizer, make_family_model, write_family_gguf
from helpers.tiny_models import make_tiny_model, tiny_tokenizer, write_gguf, write_hf
from perfx import moe
from perfx.model import Model, RunState
from perfx.sources import open_model
from perfx.sources.synthetic import SYNTHETIC_MODELS, open_synthetic
from perfx.mixers import MIXERS
from perfx.op import StepOptions
from perfx.step import bucket_steps, decode_step, ffn_ops, fuses, mixer_outputs, prefill_step
from perfx.tuning import SPECS
from perfx.tuning.database import M_BUCKETS, bucket_representative, default_database
from perfx.tuning.problems import DECODE_POSITIONS, model_problems

# The buffers an op may name: the run state's, and the model's KV cache, conv rings and recurrent state
# the run state's buffers, each mixer's scratch and its state
BUFFERS = ({f.name for f in dataclasses.fields(RunState)} | {name for mixer in MIXERS.values() for name in mixer.scratch}
           | {"cache", "history", "delta_state"} | set(moe.SCRATCH))


def built_steps(config, group, forms, kv, fused: bool) -> list[list]:
    """The decode step at each context `perfx tune` times attention at, unfused, and fused where loads fuse (the
    fused step's tails take the plain GEMVs' parameters where they have none of their own), and every prefill
    bucket's step."""
    decode = [decode_step(config, StepOptions(group, forms, kv, positions, fuse)) for positions in DECODE_POSITIONS
              for fuse in ((True, False) if fused else (False,))]
    return decode + [prefill_step(config, bucket_representative(b), StepOptions(group, forms, kv))
                     for b in range(len(M_BUCKETS))]


@pytest.mark.parametrize("lm_head,kv,embedding,fuse", [("q8", "f16", "head", "tails"), ("fp16", "q8", "q4", "off")])
@pytest.mark.parametrize("name", sorted(SYNTHETIC_MODELS))
def test_perfx_tune_measures_exactly_the_ops_of_the_built_steps(name, lm_head, kv, embedding, fuse, monkeypatch):
    monkeypatch.setenv("PERFX_FUSE", fuse)
    source = open_synthetic(name, lm_head=lm_head, embedding=embedding)
    c, forms = source.config, source.weight_forms()
    if kv == "q8" and c.head_dim % 32:
        kv = "f16"
    for group, given in ((source.int4_group, forms), (None, None)):   # the header's forms, and the load rule
        problems, notes = model_problems(c, SPECS, group, given, kv)
        assert not [n for n in notes if "skipped" in n], notes
        steps = built_steps(c, group, given, kv, fuse == "tails")
        ops = [op for step in steps for op in step]
        assert {op.family for op in ops} <= set(SPECS)
        measured = {(p.family, _key(p.shape)) for p in problems}
        assert measured == {key for op in ops for key in op.keys}
        assert len(measured) == len(problems), "each (family, shape) is one problem"


def _key(shape: dict) -> str:
    return json.dumps(shape, sort_keys=True)


@pytest.mark.parametrize("name", sorted(SYNTHETIC_MODELS))
def test_the_decode_step_runs_in_order_over_the_run_state(name):
    source = open_synthetic(name)
    c = source.config
    options = StepOptions(source.int4_group, source.weight_forms(), "f16", 256, fuse=False)
    step = decode_step(c, options)
    assert step[0].role == "embedding" and [op.family for op in step[-2:]] == ["argmax", "sample"]
    for op in step:
        assert set(op.reads) | set(op.writes) <= BUFFERS, op
        assert set(op.layers) <= set(range(c.n_layers)), op
        assert op.shares is None or any(o.role == op.shares and o.shares is None for o in step), op
    # each layer kind's mixer ops run on that kind's layers, in the builders' order, between the two norms
    kinds = {r.kind for r in c.layers}
    for kind, mixer in MIXERS.items():
        if kind not in kinds:
            assert not any(set(op.layers) & set(c.layers_of(kind)) for op in step)
            continue
        ops = mixer.ops(c, 1, options)
        # each launch of the kind runs on all its layers, or (layers of their own shapes: Gemma 4) one op a shape
        for role in {op.role for op in ops}:
            layers = sorted(layer for op in ops if op.role == role for layer in op.layers)
            assert layers == c.layers_of(kind), (kind, role)
        assert [op for op in step if op in ops] == ops
    if c.dense_ffn_layers:
        assert [op.weight for op in ffn_ops(c, 1, options) if op.weight][-1] == "down"
    # a MoE model's experts: the shared expert's σ gate where it has one, then the router, gate-up, then down into
    # proj, on its MoE layers, after the gated MLP (a shared expert's too)
    experts = moe.ops(c, 1, options)
    assert bool(experts) == bool(c.n_experts)
    assert [op for op in step if op in experts] == experts and all(op.layers == tuple(c.moe_layers) for op in experts)
    if experts:
        gated = int(bool(c.expert_shared_gate))
        assert [op.family for op in experts][:gated] == ["moe_shared_gate"] * gated
        assert [op.family for op in experts][gated:gated + 2] == ["moe_router", "gemv_moe"]
        assert experts[-1].writes == ("proj",)
    # a matrix role reads what the norm wrote (xb) or its mixer's output, and the step ends in the logits
    head = [op for op in step if op.weight == "lm_head"]
    assert head and all(op.reads == ("xb",) and op.writes == ("logits",) for op in head)


@pytest.mark.parametrize("name", sorted(SYNTHETIC_MODELS))
def test_a_fused_step_runs_the_norms_as_tails_of_the_gemvs_beside_them(name):
    """Where the recipe allows (dense attention layers, int4 o, gate-up and down), the fused decode step has no
    norm in the layer block and none before the head: o and down carry the residual add and the next norm (with
    the post-norm where the recipe has one), gate-up its output's Q8_1 blocks; one norm of the embedding's output
    runs before the layers; every other op is the unfused step's, in its order."""
    source = open_synthetic(name)
    c = source.config
    options = StepOptions(source.int4_group, source.weight_forms(), "f16", 256, fuse=True)
    fused, plain = decode_step(c, options), decode_step(c, replace(options, fuse=False))
    if not fuses(c, options):
        assert fused == plain
        return
    # a mixer's own norms (Qwen3.5's delta norm) stay; the residual norms of the layer block go
    assert not [op for op in fused if op.family == "rmsnorm" and op.layers and op.role in ("norm", "post-norm")]
    norms = [i for i, op in enumerate(fused) if op.family == "rmsnorm" and not op.layers]
    first_layer_op = next(i for i, op in enumerate(fused) if op.layers)
    assert norms == [first_layer_op - 1] and fused[norms[0]].shape == {"m": 1, "k": c.hidden_size, "residual": True}
    tails = {op.weight: op for op in fused if op.family == "gemv_q4_tail"}
    post = {"post": True} if c.post_norms else {}
    outputs = mixer_outputs(c, options)   # attention's o, the convolution's and the DeltaNet's out-projections
    assert "o" in outputs or not c.layers_of("attention")
    for role in (*outputs, "down"):
        assert tails[role].shape["tail"] == "norm" and tails[role].shape.get("post", False) == bool(post)
    assert ("gate_up" in tails) == (c.intermediate_size % 32 == 0)
    assert sorted(layer for role in outputs for layer in tails[role].layers) == list(range(c.n_layers))
    assert all(op.alternatives == () for op in tails.values())
    untailed = [replace(op, family="gemv_q4", shape={k: v for k, v in op.shape.items() if k not in ("tail", "post")},
                        alternatives=plain[[p.role for p in plain].index(op.role)].alternatives)
                if op.family == "gemv_q4_tail" else op for op in fused if op.family != "rmsnorm"]
    assert untailed == [op for op in plain if op.family != "rmsnorm"]


def test_every_prefill_bucket_has_its_step_at_its_representative_m():
    source = open_synthetic("qwen3.5-0.8b")
    options = StepOptions(source.int4_group, source.weight_forms())
    steps = bucket_steps(source.config, options)
    assert sorted(steps) == list(range(len(M_BUCKETS)))
    for bucket, step in steps.items():
        m = bucket_representative(bucket)
        gemms = [op for op in step if op.family.startswith("gemm_")]
        assert gemms and all(op.m == m and op.shape["m"] == m for op in gemms)
        families = {op.family for op in step}
        assert ("gated_delta_net_chunked" in families) == (m > 1)
        assert ("attention_prefill" in families) == (m > 1)
        assert any(op.role == "lm_head (every row)" for op in step) == (m > 1)


# -- on the device: the plan of a loaded model ------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model_paths(tmp_path_factory):
    """A GGUF of every family (int4 and int8 layers mixed, K-quants on down), and two tiny Llama-shaped models
    (a GGUF, an fp16 checkpoint)."""
    root = tmp_path_factory.mktemp("step-models")
    paths = {}
    for family in FAMILIES:
        model = make_family_model(family, family_tokenizer(root / family, family), np.random.default_rng(0))
        paths[family] = write_family_gguf(root / f"{family}.gguf", model).path
    spm = tiny_tokenizer(root / "spm")
    gqa3 = make_tiny_model("gqa3", spm, np.random.default_rng(1))
    paths["gguf-gqa3"] = write_gguf(root / "gqa3.gguf", gqa3).path
    paths["hf-fp16-gqa3"] = write_hf(root / "hf-fp16", gqa3)
    return paths


@pytest.mark.one_implementation
@pytest.mark.parametrize("name", list(FAMILIES) + ["gguf-gqa3", "hf-fp16-gqa3"])
def test_the_plan_chooses_kernels_for_the_ops_of_the_built_step(tiny_model_paths, device, name):
    source = open_model(str(tiny_model_paths[name]))
    model = Model.load(source, device, ctx=256, progress=False, database=default_database(False))
    plan, v = model.plan, source.config.vocab_size
    for m in (3, 9, 33, 128):   # a length in each bucket a prefill chunk (256) reaches past one row
        tokens = [3 + (i * 7) % (v - 4) for i in range(m)]
        model.prefill(tokens, 0)
    model.prefill_logits([3 + i % (v - 4) for i in range(33)], 0)   # the lm_head's GEMM over the rows
    model.decode_one(5, model.written)
    model.argmax()
    # a fused step's tails take the plain GEMVs' parameters, chosen at the unfused step's shapes
    ops = (plan.step + decode_step(source.config, replace(plan.options, fuse=False))
           + [op for step in plan.buckets.values() for op in step])
    keys = {op.key for op in ops}
    for label, shape in plan.tuned_shapes.items():
        assert (label.split(" ")[0], _key(shape)) in keys, f"{label}: {shape} is no op of the built step"
    missing = [op for op in plan.step if plan.wrapper(op) is None]
    assert not missing, f"ops of the decode step without a wrapper: {missing}"
    # the prefill buckets reached chose theirs too (the int4 GEMMs, the attention, the chunked recurrence)
    for m in (3, 9, 33, 128):
        chosen = [op for op in plan.ops(m) if plan.wrapper(op) is not None]
        assert any(op.family in ("attention_prefill", "gated_delta_net_chunked") for op in chosen)
        assert all(plan.wrapper(op) is not None for op in plan.ops(m) if op.family == "attention_prefill")
