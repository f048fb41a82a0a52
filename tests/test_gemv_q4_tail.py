"""gemv_q4_tail: every parameter set the tuner may choose on every test shape (both tails, the post-norm form, each
order of the Q8_1 blocks), launches back to back (the counter left at zero for the next), its code apart from
gemv_q4's (no shipped gemv_q4 record goes stale), and bad input."""

import numpy as np
import pytest

from helpers.spec_checks import assert_every_parameter_set
from perfx.errors import PerfxError
from perfx.formats import Q4Matrix
from perfx.ops.gemv_q4 import PARAMS as GEMV_Q4_PARAMS
from perfx.ops.gemv_q4_tail import GemvQ4Tail, tail_params
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.tuning import SPECS
from perfx.tuning.database import source_hash
from perfx.tuning.gemv_q4_tail import SPEC


@pytest.mark.parametrize("index", range(len(SPEC.test_shapes)), ids=[SPEC.describe(s) for s in SPEC.test_shapes])
def test_every_candidate(device, rng, index):
    """Every candidate on the first shape, and on the others (each tail's other builds: bias, blocks in either
    order, the post-norm, gate-up with each activation) a subset holding every value of every parameter, as
    gemv_q4's test does: N = 37, 96 and 160 are no multiple of the larger row sets, so the last row set of a launch
    owns rows past the end and still counts itself; every output (y, the residual h, the normed xn, the blocks'
    rounding) against the float64 reference, poisoned first."""
    shape = SPEC.test_shapes[index]
    assert len(SPEC.params.candidates(shape, device.caps)) >= 8
    assert_every_parameter_set(SPEC, device, shape, rng, cover=index > 0)


def test_launches_back_to_back_each_run_their_tail(device, rng):
    """Three products in a row without a wait: each launch's last arrival resets the counter, so the next launch's
    tail runs too (h accumulates every p)."""
    n, k = 64, 256
    q4 = Q4Matrix.random(n, k, 64, rng)
    weight = Q4DeviceWeight.upload(device, q4, None, ("buffer",))
    x = rng.standard_normal(k).astype(np.float32)
    r = rng.standard_normal(n).astype(np.float32)
    gamma = np.ones(n, np.float32)
    xd, rd, gd = (device.upload(a) for a in (x, r, gamma))
    y, xn = device.poisoned(n, np.float32), device.poisoned(n, np.float32)
    wrapper = GemvQ4Tail(device, None, {"n": n, "k": k, "tail": "norm"})
    for _ in range(3):
        wrapper.norm(weight, xd, y, rd, gd, 1e-5, xn)
    device.queue.finish()
    p = q4.dequantize().astype(np.float64) @ x
    h = r + 3 * p
    assert np.allclose(rd.get(), h, rtol=1e-4, atol=1e-4 * np.abs(h).max())
    assert np.allclose(xn.get(), h / np.sqrt(np.mean(h * h) + 1e-5), atol=1e-4)


def test_the_plain_gemv_q4_records_stay_pinned():
    """The tail is a file of its own that includes gemv_q4_rows.cl unchanged: gemv_q4's pinned hash does not read
    it, and a gemv_q4 rows set with a buffer or image1d read is a tail set as it is."""
    assert "gemv_q4_tail.cl" not in SPECS["gemv_q4"].params.sources
    assert source_hash(SPECS["gemv_q4"]) != source_hash(SPECS["gemv_q4_tail"])
    rows = GEMV_Q4_PARAMS.defaults()
    assert tail_params(rows) == rows
    assert tail_params({**rows, "READ": 1}) is None and tail_params({"LAYOUT": 1}) is None


def test_bad_blocks_are_refused(device, rng):
    q4 = Q4Matrix.random(37, 64, 32, rng)
    weight = Q4DeviceWeight.upload(device, q4, None, ("buffer",))
    wrapper = GemvQ4Tail(device)
    buf = device.poisoned(37, np.float32)
    with pytest.raises(PerfxError, match="multiple of 32"):
        wrapper.norm(weight, device.poisoned(64, np.float32), buf, buf, buf, 1e-5, buf, None, None, 1)
    with pytest.raises(PerfxError, match="order 1 or 2"):
        wrapper.quantize_output(weight, device.poisoned(64, np.float32), buf, None, 0)
