"""Shape fuzzing: Hypothesis draws shapes, group sizes, GQA ratios, positions and a
parameter set within each family's spec, and the kernel must match the float64 reference within the spec's
tolerance.

The default run is short and reproducible (derandomized, PERFX_FUZZ_EXAMPLES examples per family, 10 unless
set); PERFX_FUZZ_EXAMPLES=200 is a long run. Count the cases with --hypothesis-show-statistics. A failure
shrinks to a minimal shape and parameter set: add it as an explicit regression below.
A family without a strategy here draws from its spec's test shapes, so a new family is fuzzed from day one.
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from perfx.tuning import SPECS, relative_error

EXAMPLES = int(os.environ.get("PERFX_FUZZ_EXAMPLES", "10"))

# derandomize: the same examples on every run (CI reproduces a failure without a seed); the database keeps
# no state between runs. function_scoped_fixture: only the session-wide device is used.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

GROUPS = st.sampled_from([32, 64, 128])
GATED = st.sampled_from(["silu_mul", "gelu_mul"])


@st.composite
def q4_matrix(draw, max_rows: int, max_group_multiple: int = 8):
    """(n, k, group) of an int4 weight: K a multiple of G (the format's contract), N anything."""
    group = draw(GROUPS)
    k = group * draw(st.integers(1, max_group_multiple))
    return draw(st.integers(1, max_rows)), k, group


@st.composite
def gemv_q4_shape(draw):
    n, k, group = draw(q4_matrix(120))
    if draw(st.booleans()):
        return {"n": 2 * n, "k": k, "group": group, "epilogue": draw(GATED), "bias": False}
    shape = {"n": n, "k": k, "group": group, "epilogue": "none", "bias": draw(st.booleans())}
    if n >= 3 and draw(st.booleans()):  # a fused QKV: three matrices along N
        a = draw(st.integers(1, n - 2))
        b = draw(st.integers(1, n - a - 1))
        shape["parts"] = (a, b, n - a - b)
    return shape


@st.composite
def gemm_q4_shape(draw, max_m: int):
    n, k, group = draw(q4_matrix(100))
    epilogue = draw(st.sampled_from(["none", "bias", "silu_mul", "gelu_mul"]))
    return {"m": draw(st.integers(1, max_m)), "n": 2 * n if epilogue.endswith("_mul") else n, "k": k,
            "group": group, "epilogue": epilogue}


@st.composite
def f16_matrix(draw, max_rows: int, max_k: int):
    shape = {"n": draw(st.integers(1, max_rows)), "k": draw(st.integers(1, max_k))}
    if draw(st.booleans()):  # split W over row blocks of 1..n rows
        shape["block_bytes"] = draw(st.integers(1, shape["n"])) * shape["k"] * 2
    return shape


@st.composite
def heads(draw):
    """Query heads, kv heads (the GQA ratio, up to 8) and head_dim (the kernels take multiples of 8 from 32;
    Gemma's 256 too)."""
    kv = draw(st.integers(1, 3))
    return {"n_heads": kv * draw(st.integers(1, 8)), "n_kv_heads": kv,
            "head_dim": draw(st.one_of(st.integers(4, 20).map(lambda n: 8 * n), st.just(256)))}


@st.composite
def layer_features(draw, head_dim: int):
    """Any of the per-layer features of tuning/attention_decode.py's Features: q/k norm, partial or no RoPE,
    a scale, a soft-cap, a window."""
    out = {}
    if draw(st.booleans()):
        out["qk_norm"] = True
    rotary = draw(st.sampled_from(["all", "partial", "none"]))
    if rotary == "partial":
        out["rotary_dims"] = 2 * draw(st.integers(1, head_dim // 2 - 1))
    elif rotary == "none":
        out["rotary_dims"] = 0
    if draw(st.booleans()):
        out["scale"] = draw(st.sampled_from([0.03, 0.0625, 0.1, 0.3]))
    if draw(st.booleans()):
        out["softcap"] = draw(st.sampled_from([1.0, 3.0, 50.0]))
    if draw(st.booleans()):
        out["window"] = draw(st.integers(1, 80))
    return out


@st.composite
def attention_decode_shape(draw):
    shape = {**draw(heads()), "positions": draw(st.integers(1, 300)), "qkv_offset": draw(st.integers(0, 9))}
    return {**shape, **draw(layer_features(shape["head_dim"]))}


@st.composite
def attention_prefill_shape(draw):
    shape = {**draw(heads()), "m": draw(st.integers(1, 40)), "p0": draw(st.integers(0, 60))}
    return {**shape, **draw(layer_features(shape["head_dim"]))}


# An embedding's row scale: 1 (most models) or a Gemma-like √hidden.
SCALES = st.sampled_from([1.0, 33.94, 48.0])


@st.composite
def embedding_f16_shape(draw):
    return {**draw(f16_matrix(60, 700)), "m": draw(st.integers(1, 5)), "scale": draw(SCALES)}


@st.composite
def embedding_q4_shape(draw):
    n, k, group = draw(q4_matrix(40))
    return {"n": n, "k": k, "group": group, "m": draw(st.integers(1, 5)), "scale": draw(SCALES)}


@st.composite
def q8_matrix(draw, max_rows: int, max_group_multiple: int = 12):
    """(n, k, group, f32, block_bytes or None) of an int8 weight: K a multiple of G ∈ {16, 32}, N anything,
    fp16 or float32 (s, m) pairs, maybe split into row blocks of 1..n rows."""
    group = draw(st.sampled_from([16, 32]))
    n, k = draw(st.integers(1, max_rows)), group * draw(st.integers(1, max_group_multiple))
    block = draw(st.integers(1, n)) * k if draw(st.booleans()) else None
    return n, k, group, draw(st.booleans()), block


@st.composite
def gemv_q8_shape(draw):
    n, k, group, f32, block = draw(q8_matrix(120))
    shape = {"n": n, "k": k, "group": group, "f32": f32, "epilogue": "none", "bias": draw(st.booleans())}
    if draw(st.booleans()):
        shape.update(n=2 * n, epilogue=draw(GATED), bias=False)
    if block:
        shape["block_bytes"] = block
    return shape


@st.composite
def gemm_q8_shape(draw, max_m: int):
    n, k, group, f32, block = draw(q8_matrix(100))
    epilogue = draw(st.sampled_from(["none", "bias", "silu_mul", "gelu_mul"]))
    shape = {"m": draw(st.integers(1, max_m)), "n": 2 * n if epilogue.endswith("_mul") else n, "k": k,
             "group": group, "f32": f32, "epilogue": epilogue}
    if block:
        shape["block_bytes"] = block
    return shape


@st.composite
def embedding_q8_shape(draw):
    n, k, group, f32, block = draw(q8_matrix(40))
    shape = {"n": n, "k": k, "group": group, "f32": f32, "m": draw(st.integers(1, 5)), "scale": draw(SCALES)}
    if block:
        shape["block_bytes"] = block
    return shape


@st.composite
def rmsnorm_shape(draw):
    shape = {"m": draw(st.integers(1, 4)), "k": draw(st.integers(1, 1500)), "residual": draw(st.booleans())}
    if shape["residual"] and draw(st.booleans()):
        shape["post"] = True   # the post-norm form, Gemma's sandwich norm
    return shape


@st.composite
def gated_delta_net_shape(draw):
    """q/k heads, v heads (a GQA ratio up to 4), head sizes off every lane and row multiple, up to 80 tokens
    (several chunks of every size, or less than one), either head map, either gate form, an offset."""
    hk = draw(st.integers(1, 3))
    return {"n_k_heads": hk, "n_v_heads": hk * draw(st.integers(1, 4)), "d_k": draw(st.integers(1, 160)),
            "d_v": draw(st.integers(1, 160)), "tokens": draw(st.integers(1, 80)),
            "head_map": draw(st.sampled_from(["tile", "interleave"])), "raw_gates": draw(st.booleans()),
            "qkv_offset": draw(st.integers(0, 9))}


SHAPES = {
    "gemv_q4": gemv_q4_shape(),
    "gemv_q8": gemv_q8_shape(),
    "gemm_q8": gemm_q8_shape(40),
    "embedding_q8": embedding_q8_shape(),
    "gemv_f16": f16_matrix(200, 1200),
    "rmsnorm": rmsnorm_shape(),
    "attention_decode": attention_decode_shape(),
    "attention_prefill": attention_prefill_shape(),
    "gemm_q4_skinny": gemm_q4_shape(40),
    "gemm_q4_tiled": gemm_q4_shape(80),
    "gemm_q4_f16": gemm_q4_shape(40),
    "embedding_f16": embedding_f16_shape(),
    "embedding_q4": embedding_q4_shape(),
    "argmax": st.fixed_dictionaries({"n": st.integers(1, 40000)}),
    "swiglu": st.fixed_dictionaries({"count": st.integers(1, 12000)}),
    "geglu": st.fixed_dictionaries({"count": st.integers(1, 12000)}),
    "softcap": st.fixed_dictionaries({"count": st.integers(1, 300000), "cap": st.sampled_from([30.0, 1.5])}),
    "gated_delta_net_recurrent": gated_delta_net_shape(),
    "gated_delta_net_chunked": gated_delta_net_shape(),
}


def shapes_of(spec):
    return SHAPES[spec.family] if spec.family in SHAPES else st.sampled_from(spec.test_shapes)


def check(device, spec, shape, params, seed: int = 0):
    case = spec.make_case(device, shape, np.random.default_rng(seed))
    outputs = case.run(params)
    for name, want in case.expected.items():
        error = relative_error(outputs[name], want)
        tolerance = spec.tolerance_for(params)
        assert error <= tolerance, (f"{spec.family} {spec.describe(shape)} with {params}: {name} "
                                    f"relative error {error:.3g} > tolerance {tolerance:.3g}")


@pytest.mark.parametrize("family", sorted(SPECS))
@FUZZ
@given(data=st.data())
def test_fuzz(device, family, data):
    spec = SPECS[family]
    shape = data.draw(shapes_of(spec), label="shape")
    candidates = spec.candidates(shape, device.caps)
    if not candidates and not spec.candidates(spec.test_shapes[0], device.caps):
        pytest.skip(f"{family} needs a capability {device.caps.name} lacks (e.g. cl_khr_fp16)")
    assert candidates, f"{family}: no parameter set may run {spec.describe(shape)} on {device.caps.name}"
    params = data.draw(st.sampled_from(candidates), label="params")
    event("defaults" if params == spec.defaults() else "tuned parameters")
    check(device, spec, shape, params, seed=data.draw(st.integers(0, 2**32 - 1), label="seed"))


def test_strategies_cover_every_family():
    # A family without a strategy is fuzzed only over its spec's test shapes: say so when one appears.
    missing = sorted(set(SPECS) - set(SHAPES))
    assert not missing, f"add shape strategies for {missing} in tests/test_fuzz.py"


def test_a_wrong_answer_is_caught(device):
    # The comparison can fail: the same check against a reference that is off by one element must.
    spec = SPECS["swiglu"]
    case = spec.make_case(device, {"count": 37}, np.random.default_rng(1))
    outputs = case.run(spec.defaults())
    wrong = case.expected["out"].copy()
    wrong[17] += 1e-3 * np.max(np.abs(wrong))
    assert relative_error(outputs["out"], wrong) > spec.tolerance
