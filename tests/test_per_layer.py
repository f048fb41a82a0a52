"""Gemma 4's per-layer operations (per_layer_gate, layer_scale): every test shape at the defaults, every
candidate at one of them, against float64, and the error paths."""

import numpy as np
import pytest

from helpers.spec_checks import assert_planned_sets, swept
from perfx.errors import PerfxError
from perfx.ops.per_layer import LayerScale, PerLayerGate
from perfx.tuning.per_layer import LAYER_SCALE_SPEC, PER_LAYER_GATE_SPEC

ALL_SHAPES = [(spec, index) for spec in (PER_LAYER_GATE_SPEC, LAYER_SCALE_SPEC) for index in swept(spec)]


@pytest.mark.sweep
@pytest.mark.parametrize("spec, index", ALL_SHAPES,
                         ids=[f"{s.params.family}-{s.describe(s.test_shapes[i])}" for s, i in ALL_SHAPES])
def test_every_parameter_set_matches_reference(device, rng, spec, index):
    assert_planned_sets(spec, device, index, rng)


def test_bad_arguments_are_refused(device):
    x = device.empty((2, 8), np.float32)
    with pytest.raises(PerfxError, match="slice within the row"):
        PerLayerGate(device)(x, x, x, 2, 4, 8, 6)
    with pytest.raises(PerfxError, match="count = 0"):
        LayerScale(device)(x, x, 0)
