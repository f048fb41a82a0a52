"""gemv_q4_tail: every parameter set the tuner may choose on every test shape (both tails, the post-norm form, each
order of the Q8_1 blocks) with the hand-off of the outputs between work-groups that both CPU runtimes' OpenCL C 3.0
takes (relaxed atomics ordered by the counter), and with OpenCL 1.2's locked atomics every value of every parameter
at every shape, 4-bit zeros at a tiny Gemma 3's shapes with each hand-off, launches back to back (the counter left
at zero for the next), its code apart from gemv_q4's (no shipped gemv_q4 record goes stale), and bad input."""

from dataclasses import replace

import numpy as np
import pytest

from helpers.spec_checks import (EXHAUSTIVE, assert_planned_sets, assert_sets, covering_sets, parameter_sets,
                                 swept)
from perfx.errors import PerfxError
from perfx.formats import Q4_ZEROS, Q4Matrix
from perfx.ops.gemv_q4 import PARAMS as GEMV_Q4_PARAMS
from perfx.ops.gemv_q4_tail import HANDOFFS, GemvQ4Tail, handoff_for, tail_params
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.tuning import SPECS
from perfx.tuning.database import source_hash
from perfx.tuning.gemv_q4_tail import SPEC


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(SPEC), ids=[SPEC.describe(s) for s in SPEC.test_shapes])
def test_every_candidate(device, rng, index):
    """Each candidate at one of the shapes, and at each (each tail's builds: bias, blocks in either order, the
    post-norm, gate-up with each activation) the defaults and a subset holding every value of every parameter, as
    gemv_q4's test does (helpers.spec_checks.plan): N = 37, 96 and 160 are no multiple of the larger row sets, so
    the last row set of a launch owns rows past the end and still counts itself; every output (y, the residual h,
    the normed xn, the blocks' rounding) against the float64 reference, poisoned first."""
    shape = SPEC.test_shapes[index]
    assert len(SPEC.params.candidates(shape, device.caps)) >= 8
    assert_planned_sets(SPEC, device, index, rng)


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(SPEC), ids=[SPEC.describe(s) for s in SPEC.test_shapes])
def test_every_candidate_with_atomics_as_on_opencl_1_2(device, rng, monkeypatch, index):
    """The same with the hand-off a device whose compiler takes OpenCL C 1.2 only gets: every output's atomic store
    and load (HANDOFF 0), where the test above runs the ordered relaxed loads (HANDOFF 1) on these runtimes. At each
    shape (each tail's build) on each implementation, the defaults and a subset holding every value of every
    parameter (``covering_sets``: the part of the plan above that every shape gets on every implementation), so the
    hand-off meets every row set size, lane count, work-group size and way of arriving; the products of the other
    sets are the same code as above, which checks each of them once. Every set at every shape with
    ``PERFX_TEST_EXHAUSTIVE=1``."""
    assert handoff_for(device.caps) == HANDOFFS["ordered"], "both CPU runtimes take OpenCL C 2.0 or later"
    assert handoff_for(replace(device.caps, opencl_c=(1, 2))) == HANDOFFS["atomics"]
    assert handoff_for(replace(device.caps, c_features=())) == HANDOFFS["atomics"]   # Oclgrind's 3.0: no features
    assert handoff_for(replace(device.caps, opencl_c=(2, 0), c_features=())) == HANDOFFS["ordered"]
    # the wrappers the spec's case makes take the hand-off an OpenCL 1.2 compiler gets (the caps themselves stay:
    # I8 2's built-ins need this compiler's newest OpenCL C)
    monkeypatch.setattr("perfx.ops.gemv_q4_tail.handoff_for", lambda caps: HANDOFFS["atomics"])
    assert GemvQ4Tail(device).handoff == HANDOFFS["atomics"]
    shape = SPEC.test_shapes[index]
    sets = parameter_sets(SPEC, shape, device.caps) if EXHAUSTIVE else covering_sets(SPEC, shape, device.caps)
    assert_sets(SPEC, device, shape, rng, sets)


# Weights with 4-bit zeros (AWQ's form) as a fused tiny model runs them: 3 groups of 64, and a tiny Gemma 3's o and
# down projections with their post-norms (tests/helpers/family_models.py: hidden 64, 4 heads of 32, FFN 256; AWQ's
# groups of 32), where Intel's CPU compiler computed a wrong y with the ordered hand-off's plain loads and, with
# volatile ones, wrote through a corrupted address (a segmentation fault of the whole test run: the defaults at
# Gemma's o, and LANES 64, ROWS 1). Each set's plain product is right on both runtimes.
FOUR_BIT_ZEROS = {
    "3 groups of 64": {"n": 64, "k": 192, "group": 64},
    "gemma3 o": {"n": 64, "k": 128, "group": 32, "post": True},
    "gemma3 down": {"n": 64, "k": 256, "group": 32, "post": True},
}
FOUR_BIT_ZEROS_SETS = {"defaults": {}, "64 lanes": {"LANES": 64, "ROWS": 1},
                       "one lane, a group's arrival": {"LANES": 1, "ROWS": 2, "WGR": 16, "ARRIVAL": 1}}


@pytest.mark.parametrize("handoff", HANDOFFS.values(), ids=list(HANDOFFS))
@pytest.mark.parametrize("where", FOUR_BIT_ZEROS)
def test_four_bit_zeros(device, rng, monkeypatch, handoff, where):
    """The norm tail over a weight with 4-bit zeros at the defaults and at two other sets, with each hand-off; each
    output against the float64 reference, poisoned first."""
    monkeypatch.setattr("perfx.ops.gemv_q4_tail.handoff_for", lambda caps: handoff)
    shape = {"epilogue": "none", "bias": False, "tail": "norm", "form": Q4_ZEROS, **FOUR_BIT_ZEROS[where]}
    case = SPEC.make_case(device, shape, rng)
    for name, chosen in FOUR_BIT_ZEROS_SETS.items():
        errors = case.errors({**SPEC.params.defaults(), **chosen})
        assert all(error <= SPEC.tolerance for error in errors.values()), (name, errors)


def test_launches_back_to_back_each_run_their_tail(device, rng):
    """Three products in a row without a wait: each launch's last arrival resets the counter, so the next launch's
    tail runs too (h accumulates every p); with each hand-off and each way of arriving."""
    n, k = 64, 256
    q4 = Q4Matrix.random(n, k, 64, rng)
    weight = Q4DeviceWeight.upload(device, q4, None, ("buffer",))
    x = rng.standard_normal(k).astype(np.float32)
    r = rng.standard_normal(n).astype(np.float32)
    gamma = np.ones(n, np.float32)
    xd, rd, gd = (device.upload(a) for a in (x, r, gamma))
    y, xn = device.poisoned(n, np.float32), device.poisoned(n, np.float32)
    p = q4.dequantize().astype(np.float64) @ x
    h = r + 3 * p
    one_lane = {**GEMV_Q4_PARAMS.defaults(), "LANES": 1, "ROWS": 2, "WGR": 16}
    for handoff in HANDOFFS.values():
        # each row set arriving (LANES 16, and LANES 1 without a barrier), each work-group once
        for params in (None, {**one_lane, "ARRIVAL": 0}, {**one_lane, "ARRIVAL": 1}):
            rd.set(r)
            xn.fill(np.float32(np.nan))
            wrapper = GemvQ4Tail(device, params, {"n": n, "k": k, "tail": "norm"}, handoff)
            for _ in range(3):
                wrapper.norm(weight, xd, y, rd, gd, 1e-5, xn)
            device.queue.finish()
            assert np.allclose(rd.get(), h, rtol=1e-4, atol=1e-4 * np.abs(h).max()), (handoff, params)
            assert np.allclose(xn.get(), h / np.sqrt(np.mean(h * h) + 1e-5), atol=1e-4), (handoff, params)


def test_the_plain_gemv_q4_records_stay_pinned():
    """The tail is a file of its own that includes gemv_q4_rows.cl unchanged: gemv_q4's pinned hash does not read
    it, and a gemv_q4 rows set with a buffer or image1d read is a tail set as it is."""
    assert "gemv_q4_tail.cl" not in SPECS["gemv_q4"].params.sources
    assert source_hash(SPECS["gemv_q4"]) != source_hash(SPECS["gemv_q4_tail"])
    rows = GEMV_Q4_PARAMS.defaults()
    assert tail_params(rows) == {**rows, "ARRIVAL": 0}   # several lanes a row set: each row set arrives
    one_lane = {**rows, "LANES": 1, "WGR": 16}
    assert tail_params(one_lane) == {**one_lane, "ARRIVAL": 1}   # one lane: the work-group arrives once
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
    with pytest.raises(PerfxError, match="handoff 2 is none of"):
        GemvQ4Tail(device, None, None, 2)
