"""Gemma 3n's per-token kernels (kernels/altup.cl: AltUp's router, prediction, correction, the per-layer input into
the streams, the magnitude-matched projections, LAuReL's combination, the sparse gate): every test shape at the
defaults, every candidate at one of them, against float64, and the error paths."""

import numpy as np
import pytest

from helpers.spec_checks import assert_planned_sets, swept
from perfx import reference
from perfx.errors import PerfxError
from perfx.ops.altup import AltUp
from perfx.tuning.altup import ALTUP_SPEC


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(ALTUP_SPEC), ids=[ALTUP_SPEC.describe(s) for s in ALTUP_SPEC.test_shapes])
def test_every_parameter_set_matches_reference(device, rng, index):
    assert_planned_sets(ALTUP_SPEC, device, index, rng)


def test_bad_arguments_are_refused(device):
    x = device.empty((4, 8), np.float32)
    op = AltUp(device)
    with pytest.raises(PerfxError, match="9 AltUp streams"):
        op.predict(x, x, x, 1, 2, 9, 2)
    with pytest.raises(PerfxError, match="overlap"):
        op.correct(x, x, x, x, x, x, 2, 4, 2, 6)
    with pytest.raises(PerfxError, match="at least 1 value"):
        op.sparse_gate(x, x, 1, 0, 1.6)


def test_sparse_gate_spread_is_over_n_values_as_transformers(device):
    """The cutoff is mean + z·std with std over the n values (transformers' Gemma3nTextMLP._gaussian_topk,
    torch.std(unbiased=False)), not llama.cpp's n − 1: on a 4-wide row the two cutoffs are 1.866 and 2.0."""
    gate = np.array([[0.0, 0.0, 0.0, 4.0], [1.0, -1.0, 3.0, 0.5]], np.float32)
    up = np.array([[1.0, 1.0, 1.0, 1.5], [0.5, 2.0, 1.0, -1.0]], np.float32)
    z = 0.5
    g = gate.astype(np.float64)
    mean = g.mean(axis=1, keepdims=True)
    cutoff = mean + z * np.sqrt(((g - mean) ** 2).mean(axis=1, keepdims=True))
    want = reference.gelu_tanh(np.maximum(g - cutoff, 0.0)) * up
    out = device.empty((2, 4), np.float32)
    out.fill(np.float32(np.nan))
    AltUp(device).sparse_gate(device.upload(np.concatenate([gate, up], axis=1)), out, 2, 4, z).wait()
    got = out.get()
    # fp32 sums of four values: a few ulps of the row's scale
    assert np.abs(got - want).max() < 1e-5
    assert np.abs(reference.sparse_gate(np.concatenate([gate, up], axis=1), z) - want).max() < 1e-12
    # the check can fail: llama.cpp's n − 1 moves the first row's survivor by 0.2
    unbiased = reference.gelu_tanh(np.maximum(g - (mean + z * g.std(axis=1, ddof=1, keepdims=True)), 0.0)) * up
    assert np.abs(got - unbiased).max() > 0.1
