"""What a kernel family's tuning spec is: data, in the manner of kernel_tuner and CLBlast's tuners.

A spec names the family's parameter space (dict of value lists, the first value of each list being
the default), restrictions on combinations, the work-group size and local memory a parameter set
needs, the bytes moved and flops of a problem (for GB/s and GFLOP/s), and how to make a ``Case``:
inputs on the device, the float64 reference answer, and a way to run any parameter set.

Tests, `perfx selftest` and the tuner all go through ``Spec.candidates`` and ``Spec.make_case``, so
"every parameter set the tuner may choose" is the same set everywhere.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

Params = dict[str, Any]
Shape = dict[str, Any]


def relative_error(actual, expected) -> float:
    """max |actual − expected| / max |expected|: one number per output, robust to elements near zero.

    NaN anywhere in ``actual`` (an unwritten, poisoned element) gives inf.
    """
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise ValueError(f"shape {actual.shape} != expected {expected.shape}")
    if not np.all(np.isfinite(actual)):
        return float("inf")
    scale = max(float(np.max(np.abs(expected))), 1e-30) if expected.size else 1.0
    return float(np.max(np.abs(actual - expected))) / scale if expected.size else 0.0


def cached_per_params(factory: Callable[[Params], Any]) -> Callable[[Params], Any]:
    """``factory(params)`` made once per parameter set, on first use: a case's wrappers, and the kernels
    they build, are not remade on every run of the same parameter set."""
    made = {}

    def get(params: Params):
        key = tuple(sorted(params.items()))
        if key not in made:
            made[key] = factory(params)
        return made[key]
    return get


@dataclass
class Case:
    """One problem on one device, ready to run any parameter set of its family.

    ``run(params)`` poisons the outputs, launches, waits and returns the outputs as host arrays
    (a dict name -> array, compared one by one with ``expected``). ``launch(params)`` only enqueues
    the kernel(s) and returns the events, for timing. ``rotate()`` switches to another copy of the
    inputs where the case keeps several, so caches do not flatter the timing.
    """

    expected: dict[str, np.ndarray]
    run: Callable[[Params], dict[str, np.ndarray]]
    launch: Callable[[Params], list]
    rotate: Callable[[], None] = lambda: None

    def errors(self, params: Params) -> dict[str, float]:
        outputs = self.run(params)
        return {name: relative_error(outputs[name], want) for name, want in self.expected.items()}


@dataclass(frozen=True)
class Spec:
    family: str
    source: str                                    # kernel file in kernels/
    space: dict[str, tuple]                        # tunable -> allowed values; first = default
    make_case: Callable[..., Case]                 # (device, shape, rng) -> Case
    tolerance: float                               # on relative_error
    tolerance_why: str
    test_shapes: tuple[Shape, ...]                 # small, off the tile grid: tests and selftest
    bytes_moved: Callable[[Shape], int]
    flops: Callable[[Shape], int] = lambda shape: 0
    restrictions: tuple[Callable[[Params, Shape], bool], ...] = ()
    work_group_size: Callable[[Params], int] = lambda params: 1
    local_memory: Callable[[Params, Shape], int] = lambda params, shape: 0
    # Parameters the device must support: name -> predicate(caps, value) (e.g. READ=image needs images).
    device_checks: dict[str, Callable[[Any, Any], bool]] = field(default_factory=dict)
    describe: Callable[[Shape], str] = lambda shape: ", ".join(f"{k}={v}" for k, v in shape.items())

    def defaults(self) -> Params:
        return {name: values[0] for name, values in self.space.items()}

    def why_invalid(self, params: Params, shape: Shape, caps=None) -> str | None:
        """None when the parameter set may run on this shape and device, else the reason."""
        for name, value in params.items():
            if name not in self.space:
                return f"unknown parameter {name}"
        for check in self.restrictions:
            if not check(params, shape):
                return "restriction"
        if caps is not None:
            wgs = self.work_group_size(params)
            if wgs > caps.max_work_group:
                return f"work-group {wgs} > device max {caps.max_work_group}"
            local = self.local_memory(params, shape)
            if local > caps.local_mem:
                return f"local memory {local} > device {caps.local_mem}"
            for name, supported in self.device_checks.items():
                if name in params and not supported(caps, params[name]):
                    return f"{name}={params[name]} not supported by the device"
        return None

    def candidates(self, shape: Shape, caps=None) -> list[Params]:
        """Every parameter set allowed for this shape on this device (the tuner's search space)."""
        names = list(self.space)
        result = []
        for values in itertools.product(*(self.space[n] for n in names)):
            params = dict(zip(names, values))
            if self.why_invalid(params, shape, caps) is None:
                result.append(params)
        return result
