"""The check every kernel family's tests share: a spec's case at the defaults and at every candidate.

The sweeps plan by `perfx selftest`'s rule (``perfx.tuning.spec.covering_plan``) over every OpenCL implementation
the suite runs on (``RUNTIMES``): on each implementation, at every test shape, the defaults and a covering subset
(``planned_sets``), and each other parameter set the tuner may choose once, at one (implementation, shape) where it
can run. ``PERFX_TEST_EXHAUSTIVE=1`` checks every set at every shape on every implementation instead
(docs/setup.md).
"""

from __future__ import annotations

import os
import zlib
from contextlib import contextmanager

import numpy as np

from perfx.runtime.device import build_key
from perfx.tuning.database import params_key
from perfx.tuning.spec import build_requests, covering_plan

EXHAUSTIVE = os.environ.get("PERFX_TEST_EXHAUSTIVE", "") not in ("", "0")
# The families whose sweep tests take their shapes from ``swept``: tests/test_sweep_plan.py checks that every
# family's is one of them, so that each set the plan places is checked.
SWEPT: set[str] = set()
# The implementations the kernel tests run on, test id -> their capabilities (tests/conftest.py fills it): the plan
# places each set that is neither a default nor in a covering subset on one of them. Empty (a process that opened
# no implementation through conftest): each device plans as the only one.
RUNTIMES: dict[str, object] = {}


def parameter_sets(spec, shape, caps) -> list[dict]:
    """Every parameter set the tuner may choose for ``shape`` here, the defaults first where they fit it."""
    defaults, sets = spec.params.defaults(), spec.params.candidates(shape, caps)
    return [p for p in sets if p == defaults] + [p for p in sets if p != defaults]


def covering_sets(spec, shape, caps, strength: int = 1) -> list[dict]:
    """A few of ``parameter_sets`` that together hold every value of every parameter any of them holds
    (``strength`` 1), or every pair of values (2, pairwise coverage), chosen greedily, the defaults first.

    At each of a family's test shapes, each a build of its own (a group size, an epilogue, a head size), so that
    every kind of variant and every value of every parameter meets what the shape adds; every other set runs at
    one of the shapes on one implementation (``full_plan``), random sets meet random shapes in tests/test_fuzz.py, and
    ``PERFX_TEST_EXHAUSTIVE=1`` or `perfx selftest --exhaustive` runs every set on every test shape. Pairwise where
    a shape's build makes two parameters meet (a head size of 256 against the tiles that fill local memory and
    registers).
    """
    return covering_of(parameter_sets(spec, shape, caps), strength)


def covering_of(sets: list[dict], strength: int = 1) -> list[dict]:
    """``covering_sets`` of a list of sets (the first taken first)."""
    def covered(params):
        items = sorted(params.items())
        if strength == 1:
            return set(items)
        return {(a, b) for i, a in enumerate(items) for b in items[i + 1:]}

    uncovered = set().union(*(covered(p) for p in sets)) if sets else set()
    chosen = []
    for params in sets[:1]:  # the defaults first
        chosen.append(params)
        uncovered -= covered(params)
    while uncovered:
        best = max(sets, key=lambda p: len(covered(p) & uncovered))
        chosen.append(best)
        uncovered -= covered(best)
    return chosen


def swept(spec) -> list[int]:
    """The indices of ``spec``'s test shapes, for the parametrize of its sweep test (each index checked with
    ``assert_planned_sets``): every shape, so every set the plan places runs."""
    SWEPT.add(spec.params.family)
    return list(range(len(spec.test_shapes)))


def _no_strength(shape) -> int:
    return 1


_PLANS: dict = {}


def runtimes_for(caps) -> list:
    """The capabilities of the implementations a device of ``caps`` shares the plan with: every one in
    ``RUNTIMES``, by test id, where ``caps`` is one of them; else ``caps`` alone."""
    ordered = [RUNTIMES[name] for name in sorted(RUNTIMES)]
    return ordered if caps in ordered else [caps]


def full_plan(spec, runtimes, strength=_no_strength) -> set[tuple[int, int, str]]:
    """(implementation's index in ``runtimes``, test shape's index, parameter set's key) of each check of ``spec``'s
    sweep: on every implementation at every shape its ``covering_sets`` of ``strength(shape)`` (the defaults
    first), and every other set once, at one (implementation, shape) where it can run, picked by
    ``covering_plan``'s hash of the family and the set (the sets a capability brings, fp16 or subgroups, on an
    implementation that has it). A set builds from the same source on either CPU implementation, so one checks it;
    the defaults and the covering subsets, every value of every parameter, run on both."""
    runtimes = list(runtimes)
    key = (id(spec), tuple(runtimes), tuple(strength(shape) for shape in spec.test_shapes))
    if key not in _PLANS:
        shapes = len(spec.test_shapes)
        places = [(r, i) for r in range(len(runtimes)) for i in range(shapes)]
        placed = {(place, params_key(p)) for place, (r, i) in enumerate(places)
                  for p in covering_sets(spec, spec.test_shapes[i], runtimes[r], strength(spec.test_shapes[i]))}
        per_place = [[params_key(p) for p in parameter_sets(spec, spec.test_shapes[i], runtimes[r])]
                     for r, i in places]
        _PLANS[key] = {(*places[place], k) for place, k in covering_plan(spec.params.family, per_place, placed)}
    return _PLANS[key]


def shared_out(family: str, sets_per_place: list[list[dict]]) -> list[list[dict]]:
    """For each place (an implementation and a shape of a test of its own), the sets it checks there by the plan's
    rule (``full_plan``): a ``covering_of`` the sets that may run there, and every other set once, at one place
    where it can run (``covering_plan``'s hash of ``family`` and the set); every set everywhere with
    ``PERFX_TEST_EXHAUSTIVE=1``."""
    if EXHAUSTIVE:
        return sets_per_place
    placed = {(place, params_key(p)) for place, sets in enumerate(sets_per_place) for p in covering_of(sets)}
    keep = covering_plan(family, [[params_key(p) for p in sets] for sets in sets_per_place], placed)
    return [[p for p in sets if (place, params_key(p)) in keep] for place, sets in enumerate(sets_per_place)]


def plan(spec, caps, strength=_no_strength) -> set[tuple[int, str]]:
    """(test shape's index, parameter set's key) of each check of ``spec``'s sweep on a device of ``caps``: its share
    of ``full_plan`` over the implementations it shares the plan with (``runtimes_for``)."""
    runtimes = runtimes_for(caps)
    here = runtimes.index(caps)
    return {(i, k) for r, i, k in full_plan(spec, runtimes, strength) if r == here}


def planned_sets(spec, index, caps, strength=_no_strength) -> list[dict]:
    """The parameter sets checked at ``spec.test_shapes[index]`` on a device of ``caps`` (``plan``), the defaults
    first; every set the tuner may choose there with ``PERFX_TEST_EXHAUSTIVE=1``."""
    sets = parameter_sets(spec, spec.test_shapes[index], caps)
    if EXHAUSTIVE:
        return sets
    keep = plan(spec, caps, strength)
    return [p for p in sets if (index, params_key(p)) in keep]


def assert_sets(spec, device, shape, rng, sets) -> list[tuple[dict, dict[str, float]]]:
    """Make the case for ``shape`` and check every output of each of ``sets`` against the float64 reference within
    the spec's tolerance for that set, each run asking for exactly the programs the spec names for its set
    (``errors_of_the_named_programs``); the failure lists each set over the tolerance.

    Returns [(params, {output: relative error})], in the order of ``sets``.
    """
    assert sets, f"{spec.params.family}: no parameter set may run {spec.describe(shape)} on {device.caps.name}"
    case = spec.make_case(device, shape, rng)
    results = [(params, errors_of_the_named_programs(spec, device, shape, case, params)) for params in sets]
    failures = [f"  {params} {name}: {error:.3g} > {spec.tolerance_for(params):.0e}" for params, errors in results
                for name, error in errors.items() if not error <= spec.tolerance_for(params)]  # NaN fails too
    assert not failures, (f"{spec.params.family} on {spec.describe(shape)}: {len(failures)} output(s) over the "
                          "tolerance:\n" + "\n".join(failures))
    return results


@contextmanager
def programs_asked(device):
    """The ``(file, defines, newest_c)`` keys of the programs asked of ``device`` inside the block (``build`` and
    ``kernel``), whether built then or kept from before: what a run on a device that has built nothing builds."""
    asked: set[tuple] = set()
    build, kernel = device.build, device.kernel

    def asked_build(file, defines=None, newest_c=False):
        asked.add(build_key(file, defines, newest_c))
        return build(file, defines, newest_c)

    def asked_kernel(file, name, defines=None, newest_c=False, reads=None):
        asked.add(build_key(file, defines, newest_c))
        return kernel(file, name, defines, newest_c, reads=reads)
    device.build, device.kernel = asked_build, asked_kernel
    try:
        yield asked
    finally:
        del device.build, device.kernel   # the class's own again


def errors_of_the_named_programs(spec, device, shape, case, params) -> dict[str, float]:
    """``case.errors(params)``, whose run asks for exactly the programs the spec names for ``params`` at ``shape``
    (``Spec.programs``, through ``build_requests``): what `perfx selftest` and `perfx tune` build ahead, many at
    once, for the sets to come, so that none is built one at a time in a check (or one built for nothing)."""
    named = set(build_requests(spec, device, shape, [params]))
    assert named, f"{spec.params.family} {params}: names no program"
    with programs_asked(device) as asked:
        errors = case.errors(params)
    assert asked == named, (f"{spec.params.family} on {spec.describe(shape)} with {params}: the run asked for "
                            f"{sorted(asked - named)} beyond the named, and not for {sorted(named - asked)}")
    return errors


def assert_planned_sets(spec, device, index, rng, strength=_no_strength) -> list[tuple[dict, dict[str, float]]]:
    """``assert_sets`` at ``spec.test_shapes[index]`` of the ``planned_sets`` there, the defaults first."""
    return assert_sets(spec, device, spec.test_shapes[index], rng,
                       planned_sets(spec, index, device.caps, strength))


def assert_first_sets(spec, device, shape, rng, predicates: dict) -> dict[str, dict]:
    """For each named predicate, the first parameter set (the defaults first) that satisfies it, checked
    against the float64 reference within its tolerance; a predicate no set here satisfies (a GPU-class
    variant this device lacks) is left out. Returns {name: params} of those that ran."""
    case = spec.make_case(device, shape, rng)
    sets = parameter_sets(spec, shape, device.caps)
    chosen = {name: next((p for p in sets if test(p)), None) for name, test in predicates.items()}
    chosen = {name: params for name, params in chosen.items() if params is not None}
    failures = [f"  {name} {params} {output}: {error:.3g} > {spec.tolerance_for(params):.0e}"
                for name, params in chosen.items() for output, error in case.errors(params).items()
                if not error <= spec.tolerance_for(params)]
    assert not failures, f"{spec.params.family} on {spec.describe(shape)}:\n" + "\n".join(failures)
    return chosen


def same_inputs_for_every_form(request) -> np.random.Generator:
    """The generator of this test's id without its last part (the int8 GEMMs' form of the products, the last
    parametrize): every form on the same inputs, so a form is judged on the data the others passed."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.rsplit("-", 1)[0].encode()))
