"""Builds ahead of the runs that need them: each spec names the programs a parameter set builds (``Spec.programs``),
exactly those a run of it builds, so `perfx selftest` and `perfx tune` build the sets to come many at once."""

import numpy as np
import pytest

from helpers.spec_checks import covering_sets
from perfx.runtime import Device
from perfx.tuning import SPECS
from perfx.tuning.spec import build_requests

NAMED = [family for family, spec in SPECS.items() if spec.programs is not None]


@pytest.mark.sweep   # every kind of variant of the family built: a unit of work of its own (tests/conftest.py)
@pytest.mark.parametrize("family", NAMED)
def test_the_programs_a_spec_names_are_those_a_run_builds(device, family):
    spec = SPECS[family]
    fresh = Device(device.entry.index)
    for number, shape in enumerate(spec.test_shapes):
        case = spec.make_case(fresh, shape, np.random.default_rng(number))
        # every kind of variant on the first shape; on the others, each a build of its own (an epilogue, a bias,
        # a quantized output), the first two sets
        for params in covering_sets(spec, shape, fresh.caps)[:None if number == 0 else 2]:
            named = build_requests(spec, fresh, shape, [params])
            assert named, f"{family} {params}: names no program"
            fresh.forget_programs()   # what the run below builds is then in _programs, and nothing else
            case.run(params)
            assert set(named) == set(fresh._programs), (family, spec.describe(shape), params)


def test_every_family_names_its_programs():
    """A family without ``programs`` would build one kernel at a time in the selftest and the tuner."""
    assert not [family for family, spec in SPECS.items() if spec.programs is None]
