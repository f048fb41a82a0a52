"""moe_router, gemv_moe and gemm_moe: every parameter set at one test shape and the defaults at each, against the
float64 reference, the routed GEMVs reading only the chosen experts, and bad input."""

import numpy as np
import pytest

from helpers.spec_checks import assert_planned_sets, swept
from perfx import reference
from perfx.errors import PerfxError
from perfx.formats import Q4Matrix
from perfx.ops.gemm_moe import GemmMoE, GroupedExperts
from perfx.ops.gemv_moe import ExpertWeights, GemvMoE
from perfx.ops.moe_router import MoeRouter
from perfx.ops.moe_shared_gate import MoeSharedGate
from perfx.tuning.gemm_moe import SPEC as GEMM_SPEC
from perfx.tuning.gemv_moe import SPEC as GEMV_SPEC
from perfx.tuning.moe_router import SPEC as ROUTER_SPEC
from perfx.tuning.moe_shared_gate import SPEC as SHARED_GATE_SPEC


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(ROUTER_SPEC),
                         ids=[ROUTER_SPEC.describe(s) for s in ROUTER_SPEC.test_shapes])
def test_router_every_parameter_set(device, rng, index):
    assert_planned_sets(ROUTER_SPEC, device, index, rng)


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(GEMV_SPEC),
                         ids=[GEMV_SPEC.describe(s) for s in GEMV_SPEC.test_shapes])
def test_gemv_moe_every_parameter_set(device, rng, index):
    assert_planned_sets(GEMV_SPEC, device, index, rng)


def test_route_reference_rules():
    """The float64 router: the bias chooses but does not weigh; softmax over the chosen; norm and scale."""
    logits = np.array([[2.0, 1.0, 0.5, -1.0]])
    ids, w = reference.moe_route(logits, 2, "sigmoid", bias=np.array([0.0, 0.0, 5.0, 0.0]), norm=False)
    assert ids.tolist() == [[2, 0]]
    np.testing.assert_allclose(w, reference.sigmoid(np.array([[0.5, 2.0]])))
    ids, w = reference.moe_route(logits, 2, "softmax_weight", scale=2.0)
    np.testing.assert_allclose(w[0], 2 * reference.softmax(np.array([2.0, 1.0])))
    ids, w = reference.moe_route(logits, 3, "softmax", norm=True)
    assert ids.tolist() == [[0, 1, 2]] and abs(w.sum() - 1) < 1e-12


def test_unchosen_experts_are_never_read(device, rng):
    """Experts the ids do not name hold NaN scales: the output stays finite and right, so their bytes are not read."""
    k, n, e = 64, 20, 6
    experts = [Q4Matrix.random(2 * n, k, 32, rng) for _ in range(e)]
    for i in (0, 2, 3, 5):
        experts[i].scales[:] = np.float16(np.nan)
    weight = ExpertWeights(device, experts)
    ids = np.array([[4, 1]], np.int32)
    x = rng.standard_normal((1, k)).astype(np.float32)
    h = device.empty((1, 2, n), np.float32)
    GemvMoE(device, shape={"op": "gate_up", "bits": 4, "group": 32}).gate_up(weight, device.upload(x),
                                                                             device.upload(ids), h, 1, 2).wait()
    want = [reference.swiglu(*np.split(reference.linear(x, experts[i])[0], 2)) for i in (4, 1)]
    assert np.all(np.isfinite(h.get()))
    np.testing.assert_allclose(h.get()[0], np.stack(want), rtol=1e-4, atol=1e-5)


def test_errors(device, rng):
    with pytest.raises(PerfxError, match="used <= experts"):
        MoeRouter(device, shape={"e": 4, "used": 5})
    with pytest.raises(PerfxError, match="gating"):
        MoeRouter(device, shape={"e": 4, "used": 2, "gating": "relu"})
    with pytest.raises(PerfxError, match="differ in form"):
        ExpertWeights(device, [Q4Matrix.random(4, 64, 32, rng), Q4Matrix.random(4, 64, 64, rng)])
    weight = ExpertWeights(device, [Q4Matrix.random(4, 64, 32, rng)])
    with pytest.raises(PerfxError, match="built for"):
        GemvMoE(device, shape={"op": "down", "bits": 8, "group": 32}).down(
            weight, device.empty(64, np.float32), device.empty(1, np.int32), device.empty(1, np.float32),
            device.empty(4, np.float32), 1, 1)


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(GEMM_SPEC),
                         ids=[GEMM_SPEC.describe(s) for s in GEMM_SPEC.test_shapes])
def test_gemm_moe_every_parameter_set(device, rng, index):
    # each set at one of the shapes (the first has the most edges: rows past TM, empty and crowded experts), and
    # at each the defaults and every value of every parameter (helpers.spec_checks.plan)
    assert_planned_sets(GEMM_SPEC, device, index, rng)


def test_grouping_orders_pairs_by_expert_then_row(device):
    """moe_group's histogram, prefix sum and scatter: pairs of each expert in row order."""
    ids = np.array([[2, 0], [2, 1], [0, 2]], np.int32)
    scratch = GroupedExperts(device, 4, 3, 2, 8)
    GemmMoE(device, shape={"op": "gate_up"}).group(device.upload(ids), 3, 2, scratch).wait()
    assert scratch.counts.get().tolist() == [2, 1, 3, 0]
    assert scratch.offsets.get().tolist() == [0, 2, 3, 6]
    assert scratch.order.get().tolist() == [1, 4, 3, 0, 2, 5]


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(SHARED_GATE_SPEC),
                         ids=[SHARED_GATE_SPEC.describe(s) for s in SHARED_GATE_SPEC.test_shapes])
def test_shared_gate_every_parameter_set(device, rng, index):
    assert_planned_sets(SHARED_GATE_SPEC, device, index, rng)


def test_shared_gate_refuses_empty_shapes(device):
    gate = MoeSharedGate(device)
    x = device.upload(np.ones((1, 8), np.float32))
    with pytest.raises(PerfxError, match="moe_shared_gate: 1 rows of K = 8 gating 0 values"):
        gate(x, x, x, 1, 8, 0)
