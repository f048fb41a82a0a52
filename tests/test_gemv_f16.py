"""gemv_f16 (the lm_head): every test shape at the defaults, every candidate at one of them, the row-block split,
and the error paths."""

import numpy as np
import pytest

from helpers.spec_checks import assert_planned_sets, swept
from perfx import reference
from perfx.errors import PerfxError
from perfx.ops.gemv_f16 import F16DeviceWeight, GemvF16
from perfx.runtime import Device, Limits
from perfx.tuning import relative_error
from perfx.tuning.gemv_f16 import SPEC


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(SPEC), ids=[SPEC.describe(s) for s in SPEC.test_shapes])
def test_every_parameter_set_matches_reference(device, rng, index):
    assert_planned_sets(SPEC, device, index, rng)


def test_split_under_small_allocation_limit(rng):
    # 600 bytes a row, 64 KiB an allocation: 109 rows a block, 5 blocks for 500 rows.
    small = Device(limits=Limits(name="test", max_alloc=64 << 10))
    w = (rng.standard_normal((500, 300)) * 0.05).astype(np.float16)
    x = rng.standard_normal(300).astype(np.float32)
    weight = F16DeviceWeight.upload(small, w)
    assert weight.block_rows == [(0, 109), (109, 218), (218, 327), (327, 436), (436, 500)]
    assert all(block.size <= 64 << 10 for block in weight.blocks)
    y = small.poisoned(500, np.float32)
    events = GemvF16(small)(weight, small.upload(x), y)
    assert len(events) == 5
    events[-1].wait()
    assert relative_error(y.get(), reference.gemv(w, x)) <= SPEC.tolerance


def test_no_allocation_per_call(device, rng):
    weight = F16DeviceWeight.upload(device, rng.standard_normal((64, 96)).astype(np.float16))
    x, y = device.upload(rng.standard_normal(96).astype(np.float32)), device.empty(64, np.float32)
    gemv = GemvF16(device)
    gemv(weight, x, y)[-1].wait()
    before = device.allocated_bytes
    for _ in range(3):
        gemv(weight, x.data, y.data)[-1].wait()  # plain cl.Buffers work too
    assert device.allocated_bytes == before


def test_wrong_answers_are_detected(device, rng):
    case = SPEC.make_case(device, SPEC.test_shapes[1], rng)
    y = case.run(SPEC.params.defaults())["y"]
    wrong = case.expected["y"].copy()
    wrong[7] += 1e-3 * np.abs(wrong).max()
    assert relative_error(y, wrong) > SPEC.tolerance
    y[-1] = np.nan  # an unwritten (poisoned) element
    assert relative_error(y, case.expected["y"]) == float("inf")


def test_shape_errors(device, rng):
    weight = F16DeviceWeight.upload(device, rng.standard_normal((10, 20)).astype(np.float32))
    gemv = GemvF16(device)
    with pytest.raises(PerfxError, match="x holds 40 bytes where 80"):
        gemv(weight, device.empty(10, np.float32), device.empty(10, np.float32))
    with pytest.raises(PerfxError, match="y holds"):
        gemv(weight, device.empty(20, np.float32), device.empty(5, np.float32))
    with pytest.raises(PerfxError, match="expected a \\(N, K\\)"):
        F16DeviceWeight.upload(device, np.zeros(8, np.float16))
    with pytest.raises(PerfxError, match="expected a \\(N, K\\)"):
        F16DeviceWeight.upload(device, np.zeros((2, 2), np.int32))
    with pytest.raises(PerfxError, match="exceeds the largest allocation"):
        F16DeviceWeight.upload(device, np.ones((2, 100), np.float16), max_block_bytes=100)
    with pytest.raises(PerfxError, match="beyond fp16's range"):
        F16DeviceWeight.upload(device, np.full((2, 4), 1e6, np.float32))


def test_parameter_errors(device):
    with pytest.raises(PerfxError, match="unknown parameter"):
        GemvF16(device, {"TILE": 4})
    with pytest.raises(PerfxError, match="is not one of"):
        GemvF16(device, {"VW": 3})
    small = Device(limits=Limits(name="test", max_work_group=128))
    with pytest.raises(PerfxError, match="work-group of 256 > the device's 128"):
        GemvF16(small, {"WGS": 256})
