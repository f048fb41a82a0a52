"""The kernel tests' plan (tests/helpers/spec_checks.py, by `perfx selftest`'s rule): on every OpenCL implementation
the suite runs on, at every test shape of a family, the defaults and a covering subset; every other parameter set the
tuner may choose once, on one implementation at one shape where it runs; the same plan on every run and machine, and
every family has a sweep test over all its shapes."""

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
def test_every_set_is_checked_once_and_the_defaults_and_a_covering_subset_everywhere(family):
    """Over the implementations here (``[pocl]``, ``[intel]``), each of which runs its own share: at every shape on
    each, the defaults first and a covering subset; every set the tuner may choose on any of them checked on one that
    can run it, and only once unless it is a default or in a covering subset there."""
    spec = SPECS[family]
    runtimes = [spec_checks.RUNTIMES[name] for name in sorted(spec_checks.RUNTIMES)]
    assert runtimes, "tests/conftest.py registers the implementations the tests run on"
    checked, every, covering = [], set(), set()
    for caps in runtimes:
        for index, shape in enumerate(spec.test_shapes):
            sets = parameter_sets(spec, shape, caps)
            here = keys(planned_sets(spec, index, caps))
            assert here[:1] == keys(sets[:1]), "the defaults (or the first set that runs here) first"
            assert set(keys(sets)) >= set(here), "only sets that run here"
            covered = set(keys(covering_sets(spec, shape, caps)))
            assert covered <= set(here)
            every |= set(keys(sets))
            covering |= covered
            checked += here
    assert set(checked) == every, f"{family}: sets nowhere checked: {sorted(every - set(checked))[:3]}"
    twice = [key for key in set(checked) - covering if checked.count(key) > 1]
    assert spec_checks.EXHAUSTIVE or not twice, f"{family}: sets checked more than once: {twice[:3]}"


def test_each_implementation_runs_a_share_of_the_other_sets():
    """With two implementations that run the same sets, each checks some of the sets no covering subset holds, not
    all of them: the sweeps' time is shared out, not doubled. A set needing a capability one lacks (fp16) goes to the
    other."""
    if len(spec_checks.RUNTIMES) < 2:
        pytest.skip("one OpenCL implementation here: it checks every set")
    spec = SPECS["gemm_q4_i8"]
    runtimes = [spec_checks.RUNTIMES[name] for name in sorted(spec_checks.RUNTIMES)]
    per_runtime = [len(spec_checks.plan(spec, caps)) for caps in runtimes]
    alone = [len(spec_checks.full_plan(spec, [caps])) for caps in runtimes]
    assert all(0 < mine < whole for mine, whole in zip(per_runtime, alone)), (per_runtime, alone)
    f16 = SPECS["gemm_q4_f16"]
    for caps in runtimes:
        if not caps.fp16:
            assert not spec_checks.plan(f16, caps)
    if any(caps.fp16 for caps in runtimes):
        assert any(spec_checks.plan(f16, caps) for caps in runtimes if caps.fp16)


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


def test_the_plan_is_the_same_in_another_process():
    """Another process, with another seed for Python's string hashes and the implementations found again by
    tests/conftest.py, plans every family's checks on each implementation the same."""
    code = ("import json, sys; sys.path.insert(0, 'tests'); import conftest;"
            "from helpers.spec_checks import RUNTIMES, plan; from perfx.tuning import SPECS;"
            "print(json.dumps({n: {f: sorted(plan(s, c)) for f, s in sorted(SPECS.items())}"
            " for n, c in RUNTIMES.items()}))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PERFX_TEST_EXHAUSTIVE": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=TESTS.parent, check=True)
    there = {name: {family: [tuple(pair) for pair in pairs] for family, pairs in plans.items()}
             for name, plans in json.loads(done.stdout).items()}
    here = {name: {family: sorted(spec_checks.plan(spec, caps)) for family, spec in sorted(SPECS.items())}
            for name, caps in spec_checks.RUNTIMES.items()}
    assert there == here and len(here) == len(spec_checks.RUNTIMES) > 0


def test_every_family_has_a_sweep_over_its_shapes():
    """Each family's sweep test takes its shapes from ``swept`` (every index), so the sets the plan places at each
    shape run: a family without one would leave its planned sets unchecked."""
    for path in sorted(TESTS.glob("test_*.py")):
        try:
            importlib.import_module(path.stem)
        except pytest.skip.Exception:   # a module whose optional dependency is missing: it sweeps no family
            continue
    assert set(SPECS) <= spec_checks.SWEPT, f"families no test sweeps: {sorted(set(SPECS) - spec_checks.SWEPT)}"
