"""The check every kernel family's tests share: a spec's case at the defaults and at every candidate."""

from __future__ import annotations


def parameter_sets(spec, shape, caps) -> list[dict]:
    """Every parameter set the tuner may choose for ``shape`` here, the defaults first where they fit it."""
    defaults, sets = spec.defaults(), spec.candidates(shape, caps)
    return ([defaults] if defaults in sets else []) + [params for params in sets if params != defaults]


def assert_every_parameter_set(spec, device, shape, rng) -> list[tuple[dict, dict[str, float]]]:
    """Make the case for ``shape`` and check every output of every parameter set (``parameter_sets``)
    against the float64 reference within the spec's tolerance; the failure lists each set over it.

    Returns [(params, {output: relative error})], defaults first.
    """
    case = spec.make_case(device, shape, rng)
    results = [(params, case.errors(params)) for params in parameter_sets(spec, shape, device.caps)]
    failures = [f"  {params} {name}: {error:.3g}" for params, errors in results
                for name, error in errors.items() if not error <= spec.tolerance]  # NaN fails too
    assert not failures, (f"{spec.family} on {spec.describe(shape)}: {len(failures)} output(s) over the "
                          f"tolerance {spec.tolerance:.0e}:\n" + "\n".join(failures))
    return results
