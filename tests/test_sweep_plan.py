"""The kernel tests' plan (tests/helpers/spec_checks.py, `perfx selftest`'s rule): every parameter set the tuner may
choose is checked at one test shape of its family, the defaults and a covering subset at every shape, the same plan
on every run and machine, and every family has a sweep test over all its shapes."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import spec_checks
from helpers.spec_checks import covering_sets, parameter_sets, planned_sets
from perfx.tuning import SPECS
from perfx.tuning.database import params_key
from perfx.tuning.spec import covering_plan

TESTS = Path(__file__).parent


def keys(sets) -> list[str]:
    return [params_key(p) for p in sets]


@pytest.mark.parametrize("family", sorted(SPECS))
def test_every_set_is_checked_at_a_shape_and_the_defaults_and_a_covering_subset_at_each(device, family):
    spec = SPECS[family]
    checked, every = set(), set()
    for index, shape in enumerate(spec.test_shapes):
        sets = parameter_sets(spec, shape, device.caps)
        here = keys(planned_sets(spec, index, device.caps))
        assert here[:1] == keys(sets[:1]), "the defaults (or the first set that runs here) first"
        assert set(keys(covering_sets(spec, shape, device.caps))) <= set(here)
        every |= set(keys(sets))
        checked |= set(here)
    assert checked == every, f"{family}: sets no shape checks: {sorted(every - checked)[:3]}"


def test_each_other_set_goes_to_one_shape_where_it_runs_picked_by_a_hash():
    per_shape = [["a", "b", "c"], ["b", "c", "d"], ["c", "d", "e"]]
    plan = covering_plan("family", per_shape, {(0, "a"), (1, "b")})
    assert {(0, "a"), (1, "b")} <= plan
    others = {key: [i for i, k in plan if k == key] for key in "cde"}
    assert all(len(shapes) == 1 for shapes in others.values())
    assert others["e"] == [2] and others["d"][0] in (1, 2), "only where the set runs"
    assert plan == covering_plan("family", per_shape, {(0, "a"), (1, "b")})
    # sha256 of the family and the set's key: these picks are fixed, whatever the process or its hash seed
    assert sorted(plan) == [(0, "a"), (0, "c"), (1, "b"), (1, "d"), (2, "e")]


def test_the_plan_is_the_same_in_another_process(device):
    """Another process, with another seed for Python's string hashes, plans every family's checks the same."""
    code = ("import json, sys; sys.path.insert(0, 'tests'); from helpers.spec_checks import plan;"
            "from perfx.runtime import Device; from perfx.tuning import SPECS; caps = Device().caps;"
            "print(json.dumps({f: sorted(plan(s, caps)) for f, s in sorted(SPECS.items())}))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PERFX_DEVICE": device.entry.index,
           "PERFX_TEST_EXHAUSTIVE": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=TESTS.parent, check=True)
    there = {family: [tuple(pair) for pair in pairs] for family, pairs in json.loads(done.stdout).items()}
    here = {family: sorted(spec_checks.plan(spec, device.caps)) for family, spec in sorted(SPECS.items())}
    assert there == here


def test_every_family_has_a_sweep_over_its_shapes():
    """Each family's sweep test takes its shapes from ``swept`` (every index), so the sets the plan places at each
    shape run: a family without one would leave its planned sets unchecked."""
    for path in sorted(TESTS.glob("test_*.py")):
        try:
            importlib.import_module(path.stem)
        except pytest.skip.Exception:   # a module whose optional dependency is missing: it sweeps no family
            continue
    assert set(SPECS) <= spec_checks.SWEPT, f"families no test sweeps: {sorted(set(SPECS) - spec_checks.SWEPT)}"
