"""What a kernel family's tuning spec is: data, in the manner of kernel_tuner and CLBlast's tuners.

A spec joins a family's parameter space (``perfx.ops.<family>.PARAMS``: the values, the rules, the
work-group size and local memory a parameter set needs) with what verifying and measuring it takes:
the bytes moved and flops of a problem (for GB/s and GFLOP/s), and how to make a ``Case``: inputs on
the device, the float64 reference answer, and a way to run any parameter set.

Tests, `perfx selftest` and the tuner all go through ``spec.params.candidates`` and ``Spec.make_case``, so
"every parameter set the tuner may choose" is the same set everywhere. A spec also carries what the test tiers
need of its family (its float64 reference, a shape strategy for fuzzing, shapes small enough for Oclgrind), so
that tests/test_fuzz.py and tests/oclgrind_runner.py hold nothing per family.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from perfx import formats, reference
from perfx.errors import PerfxError
from perfx.formats import Q8Matrix
from perfx.ops.epilogue import is_gated
from perfx.ops.params import Params, ParamSpace, Shape
from perfx.timing import Timing, time_launches
from perfx.tuning.database import SERVED_UP_TO


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


# How many parameter sets' wrappers a case keeps (``cached_per_params``): the tuner runs a few sets at a time
# (a candidate's verification and timings, then the best few to confirm), and `perfx selftest` checks each set
# once; a wrapper holds its kernels, and so their built programs, which the device can then let go of
# (``Device.forget_programs``).
KEPT_PER_CASE = 16


def cached_per_params(factory: Callable[[Params], Any], keep: int = KEPT_PER_CASE) -> Callable[[Params], Any]:
    """``factory(params)`` made once per parameter set, on first use: a case's wrappers, and the kernels
    they build, are not remade on every run of the same parameter set. The ``keep`` sets used last are kept,
    so a case run at hundreds of sets does not hold every one's kernels (a set asked for again is remade,
    from the device's own cache of kernels where it still has them)."""
    made: dict = {}

    def get(params: Params):
        key = tuple(sorted(params.items()))
        if key in made:
            made[key] = made.pop(key)   # the most recently used last
        else:
            made[key] = factory(params)
            while len(made) > keep:
                del made[next(iter(made))]
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
    # Where set: ``steady(params, products)`` enqueues that many products (of ``steady_count`` copies; all by
    # default) back to back, replayed as a decode step replays its launches (recorded once, no Python between
    # them), and returns their events; the tuner times a candidate by it, per product. Each replay goes on round
    # the copies from where the last one stopped, so a copy is read again only after all the others, however
    # many products a replay takes.
    steady: Callable[..., list] | None = None
    steady_count: int = 1

    def errors(self, params: Params) -> dict[str, float]:
        outputs = self.run(params)
        return {name: relative_error(outputs[name], want) for name, want in self.expected.items()}


def time_case(case: Case, params: Params, timer: Callable = time_launches, share: float = 1.0,
              **kwargs) -> Timing:
    """A parameter set's time per product (``timer``'s keywords pass through): replayed back to back where the
    case can (``Case.steady``, the decode GEMVs), each run over ``share`` of its copies (at least one), else one
    launch at a time, rotating the case's copies."""
    if case.steady is None:
        return timer(lambda: case.launch(params), rotate=case.rotate, **kwargs)
    count = max(1, min(case.steady_count, round(share * case.steady_count)))
    timing = timer(lambda: case.steady(params, count), **kwargs)
    return Timing(timing.median_s / count, [t / count for t in timing.samples])


def copies_past_cache(device, nbytes: int) -> int:
    """How many copies of an input of ``nbytes`` a timing rotates through so that each has left the cache
    before it comes round again: together at least twice the device's largest cache (a decode step streams
    every weight from memory once, so one copy timed in a loop, served from cache, measures another
    kernel), at most 256 copies and an eighth of the device's memory."""
    caps = device.caps
    wanted = -(-2 * caps.cache_bytes // max(1, nbytes))
    return int(max(1, min(wanted, 256, caps.global_mem // 8 // max(1, nbytes))))


def gemm_copies(device, m: int, nbytes: int) -> int:
    """Copies of a GEMM's weight of ``nbytes`` that a timing at M rows rotates through: at a batched decode step's
    few rows (``SERVED_UP_TO``), past the device's cache (``copies_past_cache``), since the step reads every weight
    from memory (a kernel timed on one copy, served from the cache, ranked the kinds otherwise than the step runs
    them: benchmarks/NOTES.md); a prompt's many rows are bound by their arithmetic, and one copy serves them."""
    return copies_past_cache(device, nbytes) if m <= SERVED_UP_TO else 1


def lazy_copies(upload: Callable[[], Any]) -> Callable[[int], Any]:
    """``get(i)``: copy i of a device input, each made by ``upload()`` when first asked for, so a case that is
    only verified (copy 0) uploads one, and one that is timed the copies its rotation reaches."""
    made: list = []

    def get(i: int):
        while len(made) <= i:
            made.append(upload())
        return made[i]
    return get




def rotating_case(expected: np.ndarray, y, copies: int, launch_copy: Callable[[int, Params], list],
                  device=None, prepare: Callable[[Params, bool], None] | None = None) -> Case:
    """A one-output case over ``copies`` copies of its inputs: ``launch_copy(i, params)`` enqueues on copy i
    into the device array ``y``; run poisons y and uses copy 0, rotate steps to the next copy. With ``device``
    the case also times steadily (``Case.steady``): a decode step's kernels run back to back, and one product
    timed alone after the host's wait carries the runtime's wake-up and, on a CPU, its second thread's late
    start (the default model's decode GEMVs ranked differently alone than in the step: ``benchmarks/NOTES.md``).

    ``prepare(params, fresh)``: makes (and waits for) an input of the parameter set that the decode step's earlier
    launches have written before its product runs (x's Q8_1 blocks), so that no timing includes the launch making
    it: before every run with ``fresh`` True (the check covers what it writes), else only where the set has none
    yet, and always outside a recording."""
    state = {"i": 0}
    ready = prepare or (lambda params, fresh: None)

    def launch(params):
        ready(params, False)
        return launch_copy(state["i"], params)

    def run(params):
        state["i"] = 0
        y.fill(np.float32(np.nan))
        ready(params, True)
        for event in launch_copy(state["i"], params):
            event.wait()
        return {"y": y.get()}

    def rotate():
        state["i"] = (state["i"] + 1) % copies

    if device is None:
        return Case(expected={"y": expected}, run=run, launch=launch, rotate=rotate)
    # Every copy read before any is read again: a replay of fewer copies than fill the cache twice comes round to
    # weights still in it (8 copies of Gemma 3's 1 MB qkv fit a CPU's L3, and the tuner then chose four rows a
    # work-item, slower from memory in the decode step than the one row it measured slower from cache).
    count = copies

    def record(params):
        ready(params, False)
        with device.record() as launches:
            for i in range(count):
                launch_copy((state["i"] + i) % copies, params)
        return list(launches)
    recorded = cached_per_params(record)

    position = {"next": 0}   # the copy after the last one a replay read

    def steady(params, products: int = count):
        steps = recorded(params)
        per = len(steps) // count   # launches a product (x's quantization first, where the product makes it)
        start = position["next"]
        position["next"] = (start + products) % count
        order = steps[start * per:] + steps[:start * per]
        return [step.enqueue(device.queue) for step in order[:products * per]]

    return Case(expected={"y": expected}, run=run, launch=launch, rotate=rotate, steady=steady,
                steady_count=count)


@dataclass(frozen=True)
class Spec:
    """A family's parameter space (from its wrapper in ``perfx.ops``) with what verifying and measuring
    it needs: cases with float64 answers, the tolerance and why, test shapes, bytes moved and flops, and
    what the fuzzing and Oclgrind tiers draw from.

    A module of ``perfx.tuning`` that defines a Spec at module level registers it (``perfx.tuning.SPECS``).
    """

    params: ParamSpace
    make_case: Callable[..., Case]                 # (device, shape, rng) -> Case
    tolerance: float                               # on relative_error
    tolerance_why: str
    test_shapes: tuple[Shape, ...]                 # small, off the tile grid: tests and selftest
    bytes_moved: Callable[[Shape], int]
    reference: Callable[..., Any]                  # the function of perfx.reference make_case's answers use
    # hypothesis.strategies -> a strategy of shapes (taking the module keeps hypothesis a dev dependency)
    fuzz_shapes: Callable[[Any], Any]
    # Oclgrind interprets every work-item (orders of magnitude slower than PoCL): shapes of a few tiles, off every
    # tile and vector multiple so the edge guards run; the defaults run on each, sampled sets on the first.
    oclgrind_shapes: tuple[Shape, ...]
    flops: Callable[[Shape], int] = lambda shape: 0
    describe: Callable[[Shape], str] = lambda shape: ", ".join(f"{k}={v}" for k, v in shape.items())
    # Reduced-precision variants carry their own rounding: parameter name -> (tolerance, why), applying where
    # that parameter is non-zero: "HALF" (fp16 arithmetic), "I8" (int8 activations).
    variant_tolerances: dict = field(default_factory=dict)
    # Where given: ``programs(device, shape, params)`` asks for every kernel a run of ``params`` on ``shape``
    # builds, by making the family's wrapper and its kernels as a case's run does, without launching. Run inside
    # ``Device.collecting()`` (``build_requests``), it names the programs, so the selftest and the tuner build the
    # sets to come many at once (``Device.build_many``) instead of one at a time as each runs.
    programs: Callable[[Any, Shape, Params], None] | None = None
    # One kind of a product the plan runs whichever kind was timed fastest over the Ms a bucket serves (the int4 and
    # int8 GEMMs, ``perfx.plan``): its records carry their times at each of ``served_ms`` (the tuner's confirmation
    # and refresh take them), not at the bucket's representative alone.
    compared_kind: bool = False

    def tolerance_for(self, params: Params) -> float:
        """The bound on ``relative_error`` for this parameter set: the loosest of ``variant_tolerances`` whose
        parameter it sets (fp16 arithmetic, int8 activations), else ``tolerance``."""
        return max([self.tolerance] + [bound for name, (bound, _) in self.variant_tolerances.items()
                                       if params.get(name)])


def build_requests(spec: Spec, device, shape: Shape, params_list) -> list[tuple]:
    """The programs runs of ``spec`` at each of ``params_list`` on ``shape`` build, as ``Device.build_many`` takes
    them, found without building any (``Spec.programs`` inside ``Device.collecting``); none where the spec does
    not say. A set the wrapper refuses here names none: its run reports why."""
    if spec.programs is None:
        return []
    with device.collecting() as requests:
        for params in params_list:
            try:
                spec.programs(device, shape, params)
            except PerfxError:
                continue
    return list(dict.fromkeys(requests))


def covering_plan(family: str, per_shape: list[list[str]], placed: set[tuple[int, str]]) -> set[tuple[int, str]]:
    """Where each parameter set of a family is checked, as (test shape's index, set's key) pairs, given the keys
    of the sets the tuner may choose at each test shape (``per_shape``): those ``placed`` by the caller (at every
    shape the defaults, and whatever else it checks there), and every other set at one shape where it can run,
    picked by a hash of the family and the set, so the plan is the same on every run and machine. `perfx selftest`
    and the kernel tests plan by it: a set builds with the same code paths at any test shape, all off the tiles,
    so one shape checks it, and the shapes share the sets about evenly."""
    keep = set(placed)
    checked = {key for _, key in placed}
    where: dict[str, list[int]] = {}
    for index, keys in enumerate(per_shape):
        for key in keys:
            where.setdefault(key, []).append(index)
    for key, indices in where.items():
        if key not in checked:
            pick = hashlib.sha256(f"{family}|{key}".encode()).digest()
            keep.add((indices[int.from_bytes(pick[:4], "little") % len(indices)], key))
    return keep


# Building blocks of the specs' fuzz_shapes, shared by families of one weight form. Each takes
# hypothesis.strategies as ``st``.

Q4_GROUPS = (32, 64, 128)
GATED = ("silu_mul", "gelu_mul")
# An embedding's row scale: 1 (most models) or a Gemma-like √hidden.
EMBEDDING_SCALES = (1.0, 33.94, 48.0)


def q4_matrix(st, max_rows: int, max_group_multiple: int = 8):
    """(n, k, group) of an int4 weight: K a multiple of G (the format's contract), N anything."""
    @st.composite
    def draw_matrix(draw):
        group = draw(st.sampled_from(Q4_GROUPS))
        k = group * draw(st.integers(1, max_group_multiple))
        return draw(st.integers(1, max_rows)), k, group
    return draw_matrix()


def q8_matrix(st, max_rows: int, max_group_multiple: int = 12):
    """(n, k, group, form keys, block_bytes or None) of an int8 weight: K a multiple of G ∈ {16, 32}, N
    anything, fp16 or float32, (s, m) pairs or scales alone (``q8_form``), maybe split into row blocks of
    1..n rows."""
    @st.composite
    def draw_matrix(draw):
        group = draw(st.sampled_from([16, 32]))
        n, k = draw(st.integers(1, max_rows)), group * draw(st.integers(1, max_group_multiple))
        block = draw(st.integers(1, n)) * k if draw(st.booleans()) else None
        form = {"f32": draw(st.booleans()), **({"sym": True} if draw(st.booleans()) else {})}
        return n, k, group, form, block
    return draw_matrix()


def q8_group_bytes(shape) -> int:
    """Bytes an int8 shape's weight holds per group: its scale, and its offset unless ``sym``."""
    return formats.q8_group_bytes(bool(shape.get("f32")), bool(shape.get("sym")))


def q8_random(shape, rng, n: int) -> Q8Matrix:
    """A random int8 matrix of n rows in the shape's group and form (``f32``, ``sym``)."""
    return Q8Matrix.random(n, shape["k"], shape["group"], rng, f32=bool(shape.get("f32")),
                           symmetric=bool(shape.get("sym")))


def f16_matrix(st, max_rows: int, max_k: int):
    """{"n", "k", maybe "block_bytes"} of an fp16 matrix, maybe split over row blocks of 1..n rows."""
    @st.composite
    def draw_matrix(draw):
        shape = {"n": draw(st.integers(1, max_rows)), "k": draw(st.integers(1, max_k))}
        if draw(st.booleans()):
            shape["block_bytes"] = draw(st.integers(1, shape["n"])) * shape["k"] * 2
        return shape
    return draw_matrix()
