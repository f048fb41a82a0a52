"""The check every kernel family's tests share: a spec's case at the defaults and at every candidate."""

from __future__ import annotations

import zlib

import numpy as np


def parameter_sets(spec, shape, caps) -> list[dict]:
    """Every parameter set the tuner may choose for ``shape`` here, the defaults first where they fit it."""
    defaults, sets = spec.params.defaults(), spec.params.candidates(shape, caps)
    return [p for p in sets if p == defaults] + [p for p in sets if p != defaults]


def covering_sets(spec, shape, caps, strength: int = 1) -> list[dict]:
    """A few of ``parameter_sets`` that together hold every value of every parameter any of them holds
    (``strength`` 1), or every pair of values (2, pairwise coverage), chosen greedily, the defaults first.

    For a family's other test shapes, each a build of its own (a group size, an epilogue, a head size): there
    every kind of variant and every value of every parameter meets what the shape adds. Every pair of values,
    indeed every set, runs on the shape with the most edges (each family's tests name it); random sets meet
    random shapes in tests/test_fuzz.py; `perfx selftest --exhaustive` runs every set on every test shape.
    Pairwise where a shape's build makes two parameters meet (a head size of 256 against the tiles that fill local
    memory and registers).
    """
    sets = parameter_sets(spec, shape, caps)

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


def assert_every_parameter_set(spec, device, shape, rng, cover: bool = False,
                               strength: int = 1) -> list[tuple[dict, dict[str, float]]]:
    """Make the case for ``shape`` and check every output of every parameter set (``parameter_sets``; with
    ``cover``, the ``covering_sets`` of that ``strength``) against the float64 reference within the spec's
    tolerance for that set; the failure lists each set over it.

    Returns [(params, {output: relative error})], defaults first.
    """
    case = spec.make_case(device, shape, rng)
    sets = covering_sets(spec, shape, device.caps, strength) if cover else parameter_sets(spec, shape, device.caps)
    assert sets, f"{spec.params.family}: no parameter set may run {spec.describe(shape)} on {device.caps.name}"
    results = [(params, case.errors(params)) for params in sets]
    failures = [f"  {params} {name}: {error:.3g} > {spec.tolerance_for(params):.0e}" for params, errors in results
                for name, error in errors.items() if not error <= spec.tolerance_for(params)]  # NaN fails too
    assert not failures, (f"{spec.params.family} on {spec.describe(shape)}: {len(failures)} output(s) over the "
                          "tolerance:\n" + "\n".join(failures))
    return results


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
