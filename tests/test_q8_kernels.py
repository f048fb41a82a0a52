"""The int8 kernel families (gemv_q8, gemm_q8, embedding_q8): every test shape at the defaults and at every
candidate, row blocks under a phone's allocation limit, bad ids, and the error paths."""

import numpy as np
import pytest

from helpers.spec_checks import assert_every_parameter_set
from perfx import reference
from perfx.errors import PerfxError
from perfx.formats import Q8Matrix
from perfx.ops.embedding_q8 import EmbeddingQ8
from perfx.ops.gemm_q8 import GemmQ8
from perfx.ops.gemv_q8 import GemvQ8
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.runtime import Device, Limits
from perfx.tuning import SPECS
from perfx.tuning.spec import relative_error

FAMILIES = ("gemv_q8", "gemm_q8", "embedding_q8")
ALL_SHAPES = [(SPECS[f], shape) for f in FAMILIES for shape in SPECS[f].test_shapes]


@pytest.mark.parametrize("spec, shape", ALL_SHAPES,
                         ids=[f"{s.params.family}-{s.describe(sh)}" for s, sh in ALL_SHAPES])
def test_every_parameter_set_matches_reference(device, rng, spec, shape):
    results = assert_every_parameter_set(spec, device, shape, rng)
    assert len(results) == len(spec.params.candidates(shape, device.caps))


def test_shapes_cover_the_contract():
    gemv = SPECS["gemv_q8"].test_shapes
    assert {s["group"] for s in gemv} == {16, 32} and {s["f32"] for s in gemv} == {False, True}
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
    with pytest.raises(PerfxError, match="epilogue 'bias' on a weight uploaded without a bias"):
        GemmQ8(device)(weight, x, device.empty((1, 7), np.float32), 1, "bias")
    with pytest.raises(PerfxError, match="gemm_q8: Y holds 24 bytes, less than the 28"):
        GemmQ8(device)(weight, x, device.empty(6, np.float32), 1)
    with pytest.raises(PerfxError, match=r"bias of shape \(6,\) for a matrix with 7 rows"):
        Q8DeviceWeight.upload(device, q8, np.zeros(6, np.float32))
    small = Device(limits=Limits(name="tiny", max_alloc=32))
    with pytest.raises(PerfxError, match="one int8 row of K = 64 bytes exceeds the largest allocation"):
        Q8DeviceWeight.upload(small, q8)
