"""Gemma 3n's per-token kernels (kernels/altup.cl: AltUp's router, prediction, correction, the per-layer input into
the streams, the magnitude-matched projections, LAuReL's combination, the sparse gate): every test shape at the
defaults and every candidate, against float64, and the error paths."""

import numpy as np
import pytest

from helpers.spec_checks import assert_every_parameter_set
from perfx.errors import PerfxError
from perfx.ops.altup import AltUp
from perfx.tuning.altup import ALTUP_SPEC


@pytest.mark.parametrize("shape", ALTUP_SPEC.test_shapes, ids=ALTUP_SPEC.describe)
def test_every_parameter_set_matches_reference(device, rng, shape):
    assert_every_parameter_set(ALTUP_SPEC, device, shape, rng)


def test_bad_arguments_are_refused(device):
    x = device.empty((4, 8), np.float32)
    op = AltUp(device)
    with pytest.raises(PerfxError, match="9 AltUp streams"):
        op.predict(x, x, x, 1, 2, 9, 2)
    with pytest.raises(PerfxError, match="overlap"):
        op.correct(x, x, x, x, x, x, 2, 4, 2, 6)
    with pytest.raises(PerfxError, match="at least 2 values"):
        op.sparse_gate(x, x, 1, 1, 1.6)
