"""Builds ahead of the runs that need them: each spec names the programs a parameter set builds (``Spec.programs``),
exactly those a run of it builds, so `perfx selftest` and `perfx tune` build the sets to come many at once.

Every kernel sweep checks it for each set it runs (``helpers.spec_checks.errors_of_the_named_programs``: the programs
the run asks the device for, built then or kept from an earlier set, against those named): every set the tuner may
choose, at the shapes where the plan checks it, the defaults and a covering subset at every shape on each
implementation. Here: that every family names its programs, and that the check fails a spec naming others."""

import dataclasses

import pytest

from helpers.spec_checks import assert_sets
from perfx.tuning import SPECS


def test_every_family_names_its_programs():
    """A family without ``programs`` would build one kernel at a time in the selftest and the tuner."""
    assert not [family for family, spec in SPECS.items() if spec.programs is None]


def test_a_spec_naming_other_programs_than_a_run_builds_fails_the_sweeps_check(device, rng):
    spec = SPECS["gemv_q4_split"]   # two programs a set: the split product and its reduction
    shape = spec.test_shapes[0]
    params = spec.params.defaults()
    assert_sets(spec, device, shape, rng, [params])   # as named, it passes

    def one_more(device, shape, params):   # and a program the run never asks for
        spec.programs(device, shape, params)
        device.build("copy.cl")

    def part(device, shape, params):   # the product's program alone, not the reduction's
        with device.collecting() as requests:
            spec.programs(device, shape, params)
        device.build(*requests[0])

    for wrong, message in ((one_more, r"and not for \[\('copy.cl'"), (part, r"asked for \[\('gemv_q4_split.cl'")):
        with pytest.raises(AssertionError, match=message):
            assert_sets(dataclasses.replace(spec, programs=wrong), device, shape, rng, [params])
