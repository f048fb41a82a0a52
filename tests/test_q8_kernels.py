"""The int8 kernel families (gemv_q8, gemm_q8, gemm_q8_lanes and gemm_q8_i8, embedding_q8): every candidate at one
test shape and every shape at the defaults, row blocks under a phone's allocation limit, bad ids, and the error
paths."""

import numpy as np
import pyopencl as cl
import pytest

from helpers.spec_checks import (EXHAUSTIVE, RUNTIMES, assert_planned_sets, runtimes_for,
                                 same_inputs_for_every_form, shared_out, swept)
from perfx import reference
from perfx.errors import PerfxError
from perfx.formats import Q8Matrix
from perfx.ops.embedding_q8 import EmbeddingQ8
from perfx.ops.gemm_q8 import GemmQ8
from perfx.ops.gemv_q8 import GemvQ8
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.runtime import Device, Limits
from perfx.tuning import SPECS
from perfx.tuning.gemm_q4 import q8_rounded
from perfx.tuning.spec import relative_error

FAMILIES = ("gemv_q8", "gemm_q8", "gemm_q8_lanes", "gemm_q8_i8", "embedding_q8")
ALL_SHAPES = [(SPECS[f], i) for f in FAMILIES for i in swept(SPECS[f])]


@pytest.mark.sweep
@pytest.mark.parametrize("spec, index", ALL_SHAPES,
                         ids=[f"{s.params.family}-{s.describe(s.test_shapes[i])}" for s, i in ALL_SHAPES])
def test_every_parameter_set_matches_reference(device, rng, spec, index):
    """Each parameter set at one of a family's shapes (gemv_q8's first: K = 4160, 130 groups, rows past every
    ROWS·WGR tile), and at each, a different build (group size, fp32 pairs, epilogue, bias, row blocks), the
    defaults and a covering subset: every value of every parameter (helpers.spec_checks.plan)."""
    assert_planned_sets(spec, device, index, rng)


def test_shapes_cover_the_contract():
    gemv = SPECS["gemv_q8"].test_shapes
    assert {s["group"] for s in gemv} == {16, 32} and {s["f32"] for s in gemv} == {False, True}
    for family in FAMILIES:   # scales alone (Q8_0, Q5_0, Q6_K) and pairs, each on some shape
        assert {bool(s.get("sym")) for s in SPECS[family].test_shapes} == {False, True}, family
    assert any(s.get("sym") and s["f32"] and s["group"] == 16 for s in gemv), "Q6_K's form"
    assert any(s.get("bias") and s.get("parts") for s in gemv), "a fused QKV with bias"
    for epilogue in ("silu_mul", "gelu_mul"):
        assert any(s.get("epilogue") == epilogue and s.get("block_bytes") for s in gemv), f"{epilogue}, blocks"
    gemm = SPECS["gemm_q8"].test_shapes
    assert {s["epilogue"] for s in gemm} == {"none", "bias", "silu_mul", "gelu_mul"}


def test_detects_wrong_answers(device, rng):
    """The check can fail: a poisoned output, and one code off by one against an x of ~3."""
    spec = SPECS["gemv_q8"]
    shape = spec.test_shapes[2]
    case = spec.make_case(device, shape, rng)
    assert relative_error(np.full(shape["n"], np.nan), case.expected["y"]) == np.inf
    y = case.run(spec.params.defaults())["y"]
    wrong = y.copy()
    wrong[-1] += 0.02 / 128 * 3
    assert relative_error(wrong, case.expected["y"]) > spec.tolerance


@pytest.mark.parametrize("form", [pytest.param({}, id="pairs"), pytest.param({"PAIR": 1}, id="paired"),
                                  pytest.param({"DOT": 1}, id="bytedots")])
@pytest.mark.parametrize("group, f32, sym", [(16, True, False), (32, False, True), (32, False, False)])
def test_int8_gemm_is_exact_to_its_own_rounding_of_x(device, request, group, f32, sym, form):
    """gemm_q8_i8's one approximation is X rounded to int8 per group: against the float64 product of the same
    weights and X so rounded it holds the fp32 tolerance in each form of its products (int16 pairs, two rows of X
    a conversion, and where the device lists cl_khr_integer_dot_product byte dot products), against the exact X
    it does not (it is the int8 kernel) but holds gemv_q8's I8 tolerance; its calls at M = 2, 4, 8 (the batched
    decode step's) and then 3 (a smaller X in the scratch grown for 8) each write their M rows and no more,
    across 64-row blocks."""
    n, k = 203, 640
    rng = same_inputs_for_every_form(request)
    spec = SPECS["gemm_q8_i8"]
    candidates = spec.params.candidates(spec.test_shapes[0], device.caps)
    assert any(p["DOT"] for p in candidates) == device.caps.integer_dot_product
    assert any(p["PAIR"] for p in candidates) and not any(p["DOT"] and p["PAIR"] for p in candidates)
    if form.get("DOT") and not device.caps.integer_dot_product:
        with pytest.raises(PerfxError, match="need cl_khr_integer_dot_product"):
            GemmQ8(device, form, kind="i8")
        # the refusal above is this device's check; the products themselves need the extension to run
        pytest.skip(f"{device.caps.name} has no cl_khr_integer_dot_product")
    q8 = Q8Matrix.random(n, k, group, rng, f32=f32, symmetric=sym)
    weight = Q8DeviceWeight.upload(device, q8, max_block_bytes=64 * k)
    gemm = GemmQ8(device, form, kind="i8")
    i8_tolerance = SPECS["gemv_q8"].tolerance_for({**SPECS["gemv_q8"].params.defaults(), "I8": 1})
    for m in (2, 4, 8, 3):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, rng.integers(0, 64)::64] *= 40
        y = device.poisoned((m + 1, n), np.float32)
        gemm(weight, device.upload(x), y, m).wait()
        out = y.get()
        assert np.isnan(out[m:]).all(), f"wrote past row M = {m}"
        rounded = q8_rounded(x, group)
        assert relative_error(out[:m], reference.gemm(rounded, q8.dequantize())) <= SPECS["gemm_q8_i8"].tolerance
        exact = relative_error(out[:m], reference.gemm(x, q8.dequantize()))
        assert SPECS["gemm_q8_i8"].tolerance < exact <= i8_tolerance, m


I8_SHAPES = [{"n": 203, "k": 640, "group": 16, "f32": True, "sym": False, "epilogue": "none"},
             {"n": 2 * 75, "k": 576, "group": 32, "f32": False, "sym": False, "epilogue": "silu_mul"},
             {"n": 203, "k": 640, "group": 16, "f32": True, "sym": True, "epilogue": "none"},
             {"n": 2 * 75, "k": 576, "group": 32, "f32": False, "sym": True, "epilogue": "silu_mul"}]


def i8_sets(caps) -> list[list[dict]]:
    """The I8 sets checked at each of I8_SHAPES on a device of ``caps``: the plan's rule over the implementations
    (``shared_out``): at each shape on each, a subset holding every value of every parameter, and every other I8
    set once."""
    spec, runtimes = SPECS["gemv_q8"], runtimes_for(caps)
    places = [[p for p in spec.params.candidates({**shape, "bias": False}, r) if p["I8"]]
              for r in runtimes for shape in I8_SHAPES]
    here = runtimes.index(caps) * len(I8_SHAPES)
    return shared_out("gemv_q8 I8 exact", places)[here:here + len(I8_SHAPES)]


def test_every_i8_set_is_checked_for_its_exactness():
    """``i8_sets`` over the implementations here: every I8 set the tuner may choose at each shape on each is
    checked at one of them (``PERFX_TEST_EXHAUSTIVE=1``: at every one)."""
    spec = SPECS["gemv_q8"]
    places = [[p for p in spec.params.candidates({**shape, "bias": False}, caps) if p["I8"]]
              for caps in RUNTIMES.values() for shape in I8_SHAPES]
    checked = [sets for caps in RUNTIMES.values() for sets in i8_sets(caps)]
    assert all(p in sets for sets, chosen in zip(places, checked) for p in chosen)
    assert {str(p) for sets in checked for p in sets} == {str(p) for sets in places for p in sets}
    made, every = sum(map(len, checked)), sum(map(len, places))
    assert made == every if EXHAUSTIVE else made < every


@pytest.mark.parametrize("index", range(len(I8_SHAPES)), ids=["-".join(map(str, s.values())) for s in I8_SHAPES])
def test_int8_activations_are_exact_to_their_own_quantization(device, rng, index):
    """I8's only approximation is x rounded to int8 per group (the offset term on the rounded group's sum):
    the quantized x the launch leaves is perfx.reference.quantize_activations_q8's, and against the float64
    product of the same weights and that x every I8 parameter set is as exact as the fp32 kernels: the int16
    pairs (I8 1) and, where the driver has cl_khr_integer_dot_product (and only there), the byte dot products
    (I8 2). Each I8 set is checked so at one shape on one implementation (``i8_sets``), and at each shape on each
    a subset holding every value of every parameter."""
    spec = SPECS["gemv_q8"]
    shape = {**I8_SHAPES[index], "bias": False}
    n, k, group, f32, sym, epilogue = (shape[name] for name in ("n", "k", "group", "f32", "sym", "epilogue"))
    q8 = Q8Matrix.random(n, k, group, rng, f32=f32, symmetric=sym)
    weight = Q8DeviceWeight.upload(device, q8, max_block_bytes=64 * k)   # launches cut at 64-row blocks
    x = rng.standard_normal(k).astype(np.float32)
    x[rng.integers(0, 64)::64] *= 40   # outliers: their groups round the rest coarsely
    quantized = reference.quantize_activations_q8(x, group)
    full = reference.gemv(q8.dequantize(), quantized)
    want = full if epilogue == "none" else reference.swiglu(full[:n // 2], full[n // 2:])
    candidates = [p for p in spec.params.candidates(shape, device.caps) if p["I8"]]
    assert candidates
    assert any(p["I8"] == 2 for p in candidates) == device.caps.integer_dot_product
    checked = i8_sets(device.caps)[index]
    assert {value for p in checked for value in p.items()} == {value for p in candidates for value in p.items()}
    for params in checked:
        gemv = GemvQ8(device, params, shape)
        y = device.poisoned(len(want), np.float32)
        gemv.events(weight, device.upload(x), y, epilogue)[-1].wait()
        assert relative_error(y.get(), want) <= spec.tolerance, params
    codes, step_sum = np.empty(k, np.int8), np.empty((k // group, 2), np.float32)
    for host, buffer in zip((codes, step_sum), gemv._quantized[(k, group)]):
        cl.enqueue_copy(device.queue, host, buffer)
    np.testing.assert_allclose(np.repeat(step_sum[:, 0], group) * codes, quantized, rtol=1e-6, atol=0)
    np.testing.assert_allclose(step_sum[:, 1], quantized.reshape(-1, group).sum(axis=1), rtol=1e-5, atol=1e-6)
    exact = reference.gemv(q8.dequantize(), x)
    exact = exact if epilogue == "none" else reference.swiglu(exact[:n // 2], exact[n // 2:])
    assert relative_error(y.get(), exact) > spec.tolerance   # x really was quantized


# The skinny GEMMs go over M in full passes of MT rows (or gemm_q8_lanes's MB), then over the remainder: each
# value of the space, with the int8 kernels' paired rows too.
M_PASSES = {"skinny": [{"MT": v} for v in SPECS["gemm_q8"].params.space["MT"]],
            "lanes": [{"MB": v} for v in SPECS["gemm_q8_lanes"].params.space["MB"]],
            "i8": [{"MT": v, "PAIR": pair} for v in SPECS["gemm_q8_i8"].params.space["MT"] for pair in (0, 1)]}


@pytest.mark.parametrize("kind", list(M_PASSES))
def test_every_remainder_of_the_m_passes(device, rng, kind):
    """At each rows-a-pass value M_PASS (MT or MB), M = 1 .. 2·M_PASS + 1: fewer rows than one pass (M = 1
    among them), one full pass and each remainder 0 .. M_PASS − 1, two full passes and one row; each call's M
    rows match the float64 reference (of X rounded as gemm_q8_i8 rounds it, for that kernel) and nothing is
    written past row M."""
    n, k, group = 101, 160, 32   # columns off every ROWS·WGS; 5 groups
    shape = {"n": n, "k": k, "group": group, "f32": False, "sym": False, "epilogue": "bias"}
    q8 = Q8Matrix.random(n, k, group, rng, f32=False, symmetric=False)
    bias = (0.1 * rng.standard_normal(n)).astype(np.float32)
    weight = Q8DeviceWeight.upload(device, q8, bias)
    top = 2 * max(max(p.values()) for p in M_PASSES[kind]) + 1
    x = rng.standard_normal((top, k)).astype(np.float32)
    x[:, rng.integers(0, 64)::64] *= 40
    want = reference.gemm(q8_rounded(x, group) if kind == "i8" else x, q8.dequantize(), bias)
    spec = SPECS["gemm_q8" if kind == "skinny" else f"gemm_q8_{kind}"]
    for params in M_PASSES[kind]:
        gemm = GemmQ8(device, params, shape, kind)
        rows = params.get("MT", params.get("MB"))
        for m in range(1, 2 * rows + 2):
            y = device.poisoned((m + 1, n), np.float32)
            gemm(weight, device.upload(x[:m]), y, m, "bias").wait()
            out = y.get()
            assert np.isnan(out[m:]).all(), f"{params} wrote past row M = {m}"
            assert relative_error(out[:m], want[:m]) <= spec.tolerance, (params, m)


def test_blocks_split_under_the_allocation_limit(rng):
    """A 64 KiB allocation limit splits a 300 × 576 int8 table into 3 blocks; the lm_head GEMV, the
    multi-position GEMM and the gather all cross them."""
    small = Device(limits=Limits(name="tiny-phone", max_alloc=128 * 576))
    q8 = Q8Matrix.random(300, 576, 32, rng)
    weight = Q8DeviceWeight.upload(small, q8)
    assert weight.block_rows == [(0, 128), (128, 256), (256, 300)]
    x = rng.standard_normal((3, 576)).astype(np.float32)
    y = small.poisoned(300, np.float32)
    GemvQ8(small)(weight, small.upload(x[0]), y).wait()
    assert relative_error(y.get(), reference.gemv(q8.dequantize(), x[0])) <= 1e-5
    # the lm_head over 3 positions into a wider Y (ldy 310): what perplexity reads
    y2 = small.poisoned((3, 310), np.float32)
    GemmQ8(small)(weight, small.upload(x), y2, 3, ldy=310).wait()
    assert relative_error(y2.get()[:, :300], reference.gemm(x, q8.dequantize())) <= 1e-5
    assert np.isnan(y2.get()[:, 300:]).all()   # nothing written past the columns
    ids = np.array([299, 0, 127, 128, 255, 256, -1, 300], np.int32)
    out = small.poisoned((len(ids), 576), np.float32)
    events = EmbeddingQ8(small)(weight, small.upload(ids), out, len(ids))
    assert len(events) == 3
    events[-1].wait()
    got = out.get()
    np.testing.assert_allclose(got[:6], q8.dequantize()[ids[:6]], rtol=0, atol=1e-7)
    assert np.isnan(got[6:]).all()   # ids outside the table give NaN rows, not another row


def test_errors_name_what_is_wrong(device, rng):
    q8 = Q8Matrix.random(7, 64, 32, rng)
    weight = Q8DeviceWeight.upload(device, q8)
    x, y = device.upload(np.ones(64, np.float32)), device.empty(7, np.float32)
    for epilogue in ("silu_mul", "gelu_mul"):
        with pytest.raises(PerfxError, match=f"{epilogue} needs gate and up rows of equal count.*N = 7"):
            GemvQ8(device)(weight, x, y, epilogue)
        with pytest.raises(PerfxError, match=f"gemm_q8: {epilogue} needs gate and up rows.*N = 7"):
            GemmQ8(device)(weight, x, device.empty((1, 7), np.float32), 1, epilogue)
    with pytest.raises(PerfxError, match=r"gemv_q8: parameters .*ROWS.*cannot run on"):
        GemvQ8(device, {"LANES": 16, "ROWS": 3})
    blocks = (device.empty(64, np.int8), device.empty((2, 2), np.float32))
    with pytest.raises(PerfxError, match="gemv_q8: x's Q8_1 blocks of 32 are read with int8 activations.*I8 = 0"):
        GemvQ8(device)(weight, x, y, quantized=blocks)
    sixteen = Q8DeviceWeight.upload(device, Q8Matrix.random(7, 64, 16, rng))
    with pytest.raises(PerfxError, match="the weight groups of 16"):
        GemvQ8(device, {"I8": 1})(sixteen, x, y, quantized=blocks)
    with pytest.raises(PerfxError, match="gemv_q8 quantized x's steps and sums holds 8 bytes where 16 are needed"):
        GemvQ8(device, {"I8": 1})(weight, x, y, quantized=(blocks[0], device.empty(2, np.float32)))
    with pytest.raises(PerfxError, match="epilogue 'bias' on a weight uploaded without a bias"):
        GemmQ8(device)(weight, x, device.empty((1, 7), np.float32), 1, "bias")
    with pytest.raises(PerfxError, match="gemm_q8: Y holds 24 bytes, less than the 28"):
        GemmQ8(device)(weight, x, device.empty(6, np.float32), 1)
    with pytest.raises(PerfxError, match="gemm_q8: unknown kernel 'tiled'; choose one of skinny, lanes, i8"):
        GemmQ8(device, kind="tiled")
    with pytest.raises(PerfxError, match=r"bias of shape \(6,\) for a matrix with 7 rows"):
        Q8DeviceWeight.upload(device, q8, np.zeros(6, np.float32))
    small = Device(limits=Limits(name="tiny", max_alloc=32))
    with pytest.raises(PerfxError, match="one int8 row of K = 64 bytes exceeds the largest allocation"):
        Q8DeviceWeight.upload(small, q8)
