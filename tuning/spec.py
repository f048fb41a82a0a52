"""What a kernel family's tuning spec is: data, in the manner of kernel_tuner and CLBlast's tuners.

A spec joins a family's parameter space (``perfx.ops.<family>.PARAMS``: the values, the rules, the
work-group size and local memory a parameter set needs) with what verifying and measuring it takes:
the bytes moved and flops of a problem (for GB/s and GFLOP/s), and how to make a ``Case``: inputs on
the device, the float64 reference answer, and a way to run any parameter set.

Tests, `perfx selftest` and the tuner all go through ``Spec.candidates`` and ``Spec.make_case``, so
"every parameter set the tuner may choose" is the same set everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from perfx import reference
from perfx.ops.epilogue import is_gated
from perfx.ops.params import Params, ParamSpace, Shape


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


def epilogue_reference(epilogue: str, full: np.ndarray) -> np.ndarray:
    """The float64 answer of an epilogue from the float64 product (with its bias) along the last axis: the
    product itself, or act(gate)·up of its gate half and up half for a gate-up epilogue."""
    if not is_gated(epilogue):
        return full
    half = full.shape[-1] // 2
    gate, up = full[..., :half], full[..., half:]
    return reference.geglu(gate, up) if epilogue == "gelu_mul" else reference.swiglu(gate, up)


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


def rotating_case(expected: np.ndarray, y, copies: int, launch_copy: Callable[[int, Params], list]) -> Case:
    """A one-output case over ``copies`` copies of its inputs: ``launch_copy(i, params)`` enqueues on copy i
    into the device array ``y``; run poisons y and uses copy 0, rotate steps to the next copy."""
    state = {"i": 0}

    def launch(params):
        return launch_copy(state["i"], params)

    def run(params):
        state["i"] = 0
        y.fill(np.float32(np.nan))
        for event in launch(params):
            event.wait()
        return {"y": y.get()}

    def rotate():
        state["i"] = (state["i"] + 1) % copies

    return Case(expected={"y": expected}, run=run, launch=launch, rotate=rotate)


@dataclass(frozen=True)
class Spec:
    """A family's parameter space (from its wrapper in ``perfx.ops``) with what verifying and measuring
    it needs: cases with float64 answers, the tolerance and why, test shapes, bytes moved and flops."""

    params: ParamSpace
    make_case: Callable[..., Case]                 # (device, shape, rng) -> Case
    tolerance: float                               # on relative_error
    tolerance_why: str
    test_shapes: tuple[Shape, ...]                 # small, off the tile grid: tests and selftest
    bytes_moved: Callable[[Shape], int]
    flops: Callable[[Shape], int] = lambda shape: 0
    describe: Callable[[Shape], str] = lambda shape: ", ".join(f"{k}={v}" for k, v in shape.items())
    # Reduced-precision variants carry their own rounding: parameter name -> (tolerance, why), applying where
    # that parameter is non-zero: "HALF" (fp16 arithmetic), "I8" (int8 activations).
    variant_tolerances: dict = field(default_factory=dict)

    @property
    def family(self) -> str:
        return self.params.family

    @property
    def source(self) -> str:
        return self.params.source

    @property
    def space(self) -> dict[str, tuple]:
        return self.params.space

    def defaults(self) -> Params:
        return self.params.defaults()

    def tolerance_for(self, params: Params) -> float:
        """The bound on ``relative_error`` for this parameter set: the loosest of ``variant_tolerances`` whose
        parameter it sets (fp16 arithmetic, int8 activations), else ``tolerance``."""
        return max([self.tolerance] + [bound for name, (bound, _) in self.variant_tolerances.items()
                                       if params.get(name)])

    def why_invalid(self, params: Params, shape: Shape, caps=None) -> str | None:
        return self.params.why_invalid(params, shape, caps)

    def candidates(self, shape: Shape, caps=None) -> list[Params]:
        """Every parameter set allowed for this shape on this device (the tuner's search space)."""
        return self.params.candidates(shape, caps)
