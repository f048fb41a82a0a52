"""Small ops (embedding_f16, embedding_q4, argmax, swiglu, geglu, sigmoid_mul, softcap): every test shape at the
defaults, every candidate at one of them, the edge behaviours (bad ids, NaN, ties, split tables, in-place,
extreme inputs, row scales) and the error paths."""

import numpy as np
import pytest

from helpers.spec_checks import assert_first_sets, assert_planned_sets, swept
from perfx import reference
from perfx.errors import PerfxError
from perfx.formats import Q4_SYMMETRIC, Q4_ZEROS, Q4Matrix
from perfx.ops.gemv_f16 import F16DeviceWeight
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.ops.small_ops import Argmax, Embedding, GeGLU, SigmoidMul, Softcap, SwiGLU
from perfx.runtime import Device, Limits
from perfx.tuning import relative_error
from perfx.tuning.small_ops import ARGMAX, EMBEDDING_F16, EMBEDDING_Q4, GEGLU, SIGMOID_MUL, SOFTCAP, SWIGLU


ALL_SHAPES = [(spec, index) for spec in (EMBEDDING_F16, EMBEDDING_Q4, ARGMAX, SWIGLU, GEGLU, SIGMOID_MUL,
                                                           SOFTCAP)
              for index in swept(spec)]


@pytest.mark.sweep
@pytest.mark.parametrize("spec, index", ALL_SHAPES,
                         ids=[f"{s.params.family}-{s.describe(s.test_shapes[i])}" for s, i in ALL_SHAPES])
def test_every_parameter_set_matches_reference(device, rng, spec, index):
    assert_planned_sets(spec, device, index, rng)


def test_embedding_f16_split_table_and_bad_ids(device, rng):
    small = Device(limits=Limits(name="test", max_alloc=16 << 10))  # 100 halves a row: 81 rows a block
    w = rng.standard_normal((300, 100)).astype(np.float16)
    table = F16DeviceWeight.upload(small, w)
    assert len(table.blocks) == 4
    ids = np.array([299, 0, 80, 81, 162, -1, 300, 150], np.int32)
    out = small.poisoned((len(ids), 100), np.float32)
    events = Embedding(small).f16(table, small.upload(ids), out, len(ids))
    events[-1].wait()
    got = out.get()
    good = [0, 1, 2, 3, 4, 7]
    np.testing.assert_array_equal(got[good], w[ids[good]].astype(np.float32))
    assert np.isnan(got[[5, 6]]).all()  # out-of-range ids give NaN rows, not another row


def test_embedding_q4_bad_ids_and_read_path(device, rng):
    q4 = Q4Matrix.random(10, 64, 32, rng)
    ids = device.upload(np.array([3, 10, -2], np.int32))
    out = device.poisoned((3, 64), np.float32)
    embed = Embedding(device)
    embed.q4(Q4DeviceWeight.upload(device, q4, read_paths=("buffer",)), ids, out, 3).wait()
    got = out.get()
    assert relative_error(got[0], q4.dequantize()[3]) <= 1e-6
    assert np.isnan(got[1:]).all()
    if device.caps.image_support:
        images_only = Q4DeviceWeight.upload(device, q4, read_paths=("image2d",))
        with pytest.raises(PerfxError, match="read_paths including 'buffer'"):
            embed.q4(images_only, ids, out, 3)


@pytest.mark.parametrize("form", [Q4_ZEROS, Q4_SYMMETRIC])
def test_embedding_q4_zero_point_forms(device, rng, form):
    """The gather in both layouts on the zero-point forms: 41 rows × 9 groups, an odd count of zero points."""
    shape = {"n": 41, "k": 576, "group": 64, "m": 5, "form": form}
    ran = assert_first_sets(EMBEDDING_Q4, device, shape, rng, {"rows": lambda p: p["LAYOUT"] == 0,
                                                               "interleaved": lambda p: p["LAYOUT"] == 1})
    assert set(ran) == {"rows", "interleaved"}


@pytest.mark.parametrize("values, expected", [
    ([1.0, np.nan, 3.0, np.nan], 1),                   # numpy: the first NaN
    ([-np.inf] * 5, 0),                                # all −inf: the first
    ([2.0] * 1001, 0),                                 # all equal: the first
    ([0.0, -0.0, 0.0], 0),                             # −0 == 0: a tie
])
def test_argmax_edge_values(device, values, expected):
    x = np.array(values, np.float32)
    assert np.argmax(x) == expected
    out = device.poisoned(1, np.int32)
    Argmax(device)(device.upload(x), len(x), out)[-1].wait()
    assert out.get()[0] == expected


def test_argmax_ties_across_work_groups_and_no_allocation(device, rng):
    device = Device(device.entry.index)   # a count of its own: the shared one's moves as other tests' buffers go
    argmax = Argmax(device, {"GROUPS3": 16, "WGS3": 64, "VW3": 4})
    out = device.empty(1, np.int32)
    x = rng.standard_normal(50000).astype(np.float32)
    x[[49999, 40000, 1234, 1233]] = 9.0  # the same maximum in several work-groups' shares
    x_d = device.upload(x)
    argmax(x_d, len(x), out)[-1].wait()
    before = device.allocated_bytes
    for n in (50000, 1234, 1):
        argmax(x_d, n, out)[-1].wait()
        assert out.get()[0] == np.argmax(x[:n])
    assert device.allocated_bytes == before


GATED = pytest.mark.parametrize("op, answer", [(SwiGLU, reference.swiglu), (GeGLU, reference.geglu),
                                               (SigmoidMul, reference.sigmoid_mul)],
                                ids=["swiglu", "geglu", "sigmoid_mul"])


@GATED
def test_gated_activation_in_place(device, rng, op, answer):
    gate = rng.standard_normal(1001).astype(np.float32) * 4
    up = rng.standard_normal(1001).astype(np.float32)
    gate_d = device.upload(gate)
    op(device)(gate_d, device.upload(up), gate_d, 1001).wait()
    assert relative_error(gate_d.get(), answer(gate, up)) <= 1e-5


# Where exp and tanh saturate, and where GELU's x³ (and x²) overflow float32: every output must still be the
# float64 answer (the tails x and 0), never inf or NaN.
EXTREMES = np.array([-3.4e38, -1e20, -1e10, -1e4, -88.0, -30.0, -10.0, -5.0, -1e-30, 0.0, 1e-30, 5.0, 10.0,
                     30.0, 88.0, 1e4, 1e10, 1e20, 3.4e38], np.float32)


@pytest.mark.parametrize("params", [{"VW4": 4}, {"VW4": 1}], ids=["VW4=4", "VW4=1"])
@GATED
def test_gated_activation_at_extreme_inputs(device, op, answer, params):
    """Element by element, not against max|out|: the huge tails would hide an error at the others. The bound
    is a few ulp of each answer, plus |gate·up|·1e-6 where 1 + tanh(·) (GELU, gate ≪ 0) cancels in fp32."""
    gate = np.concatenate([EXTREMES, -EXTREMES[::-1]])
    up = np.where(np.arange(gate.size) % 2, 0.5, -1.0).astype(np.float32)
    out = device.poisoned(gate.size, np.float32)
    op(device, params)(device.upload(gate), device.upload(up), out, gate.size).wait()
    got, want = out.get().astype(np.float64), answer(gate, up)
    assert np.isfinite(got).all() and np.isfinite(want).all()
    bound = 1e-6 * np.abs(want) + 1e-6 * np.abs(reference.f64(gate) * up) * (gate < 0) + 1e-37
    bad = np.abs(got - want) > bound
    assert not bad.any(), list(zip(gate[bad], got[bad], want[bad]))


def test_softcap_at_extreme_inputs(device):
    x = np.concatenate([EXTREMES, [np.inf, -np.inf]]).astype(np.float32)
    x_d = device.upload(x)
    Softcap(device)(x_d, x.size, 30.0).wait()
    want = reference.softcap(x, 30.0)
    np.testing.assert_allclose(x_d.get(), want, rtol=1e-6, atol=1e-37)
    assert np.abs(x_d.get()).max() <= 30.0


def test_embedding_scale_multiplies_each_row(device, rng):
    """scale (Gemma's √hidden) on every gather: fp16 and int4 tables, the default 1 leaving the copy exact."""
    w = rng.standard_normal((30, 100)).astype(np.float16)
    q4 = Q4Matrix.random(30, 128, 32, rng)
    ids = device.upload(np.array([29, 0, 7], np.int32))
    table = F16DeviceWeight.upload(device, w)
    q4_table = Q4DeviceWeight.upload(device, q4, read_paths=("buffer",))
    embed = Embedding(device)
    for scale in (1.0, 10.0 ** 0.5):
        out = device.poisoned((3, 100), np.float32)
        embed.f16(table, ids, out, 3, scale)[-1].wait()
        np.testing.assert_allclose(out.get(), w[[29, 0, 7]].astype(np.float64) * np.float32(scale), rtol=1e-7)
        out = device.poisoned((3, 128), np.float32)
        embed.q4(q4_table, ids, out, 3, scale).wait()
        np.testing.assert_allclose(out.get(), q4.dequantize()[[29, 0, 7]] * np.float32(scale), rtol=2e-7,
                                   atol=1e-7 * scale)
    out = device.poisoned((3, 100), np.float32)
    embed.f16(table, ids, out, 3)[-1].wait()   # the default scale, 1: still an exact copy
    np.testing.assert_array_equal(out.get(), w[[29, 0, 7]].astype(np.float32))


def test_wrong_answers_are_detected(device, rng):
    spec = SWIGLU
    case = spec.make_case(device, spec.test_shapes[0], rng)
    out = case.run(spec.params.defaults())["out"]
    assert relative_error(out, case.expected["out"] * 1.001) > spec.tolerance
    out[-1] = np.nan
    assert relative_error(out, case.expected["out"]) == float("inf")


def test_errors(device):
    x, out = device.empty(100, np.float32), device.empty(1, np.int32)
    with pytest.raises(PerfxError, match="n = 0"):
        Argmax(device)(x, 0, out)
    with pytest.raises(PerfxError, match="argmax x holds 400 bytes where 404"):
        Argmax(device)(x, 101, out)
    with pytest.raises(PerfxError, match="swiglu up holds"):
        SwiGLU(device)(x, device.empty(10, np.float32), x, 100)
    table = F16DeviceWeight.upload(device, np.ones((4, 64), np.float16))
    with pytest.raises(PerfxError, match="embedding out holds"):
        Embedding(device).f16(table, device.upload(np.zeros(2, np.int32)), x, 2)
    with pytest.raises(PerfxError, match="unknown parameter"):
        Embedding(device, {"WGS9": 64})
    with pytest.raises(PerfxError, match="is not one of"):
        SwiGLU(device, {"VW4": 2})
    with pytest.raises(PerfxError, match="geglu up holds"):
        GeGLU(device)(x, device.empty(10, np.float32), x, 100)
    with pytest.raises(PerfxError, match="softcap: cap = 0.0 must be positive"):
        Softcap(device)(x, 100, 0.0)
    with pytest.raises(PerfxError, match="softcap x holds 400 bytes where 404"):
        Softcap(device)(x, 101, 30.0)
