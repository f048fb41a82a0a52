"""Shape fuzzing: Hypothesis draws a shape from each family's spec (``Spec.fuzz_shapes``: sizes, group sizes,
GQA ratios, positions, layer features) and a parameter set the tuner may choose for it, and the kernel must
match the float64 reference within the spec's tolerance. Nothing here is per family: a new family is fuzzed
by having a spec.

The default run is short and reproducible: PERFX_FUZZ_EXAMPLES examples per family on each OpenCL implementation
(5 unless set; 50 with PERFX_TEST_EXHAUSTIVE=1), drawn from a seed of the test's id, so that each implementation
draws other shapes than the other (together 10 a family) and every run the same ones; PERFX_FUZZ_EXAMPLES=200 is a
long run. A failure shrinks to a minimal shape and parameter set, and is printed: add the shape to the family's
test_shapes, which its own tests sweep over every parameter set.
"""

import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings, strategies as st

from helpers.spec_checks import EXHAUSTIVE
from perfx.tuning import SPECS, relative_error

EXAMPLES = int(os.environ.get("PERFX_FUZZ_EXAMPLES", "50" if EXHAUSTIVE else "5"))

# A seed per test id (``seed`` below): the same examples on every run (CI reproduces a failure without a seed), other
# ones on each implementation; the database keeps no state between runs.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def check(device, spec, shape, params, seed: int = 0):
    case = spec.make_case(device, shape, np.random.default_rng(seed))
    outputs = case.run(params)
    for name, want in case.expected.items():
        error = relative_error(outputs[name], want)
        tolerance = spec.tolerance_for(params)
        assert error <= tolerance, (f"{spec.params.family} {spec.describe(shape)} with {params}: {name} "
                                    f"relative error {error:.3g} > tolerance {tolerance:.3g}")


@pytest.mark.sweep
@pytest.mark.parametrize("family", sorted(SPECS))
def test_fuzz(device, family, request):
    spec = SPECS[family]

    @FUZZ
    @seed(zlib.crc32(request.node.nodeid.encode()))
    @given(data=st.data())
    def fuzz(data):
        shape = data.draw(spec.fuzz_shapes(st), label="shape")
        candidates = spec.params.candidates(shape, device.caps)
        if not candidates and not spec.params.candidates(spec.test_shapes[0], device.caps):
            pytest.skip(f"{family} needs a capability {device.caps.name} lacks (e.g. cl_khr_fp16)")
        assert candidates, f"{family}: no parameter set may run {spec.describe(shape)} on {device.caps.name}"
        params = data.draw(st.sampled_from(candidates), label="params")
        check(device, spec, shape, params, seed=data.draw(st.integers(0, 2**32 - 1), label="seed"))

    fuzz()


@pytest.mark.parametrize("family", sorted(SPECS))
def test_a_wrong_answer_is_caught(device, family):
    # The comparison can fail: the same check against an answer that is off in one element must.
    spec = SPECS[family]
    shape = spec.oclgrind_shapes[0]
    candidates = spec.params.candidates(shape, device.caps)
    if not candidates:
        pytest.skip(f"{family} needs a capability {device.caps.name} lacks (e.g. cl_khr_fp16)")
    params = spec.params.defaults() if spec.params.defaults() in candidates else candidates[0]
    case = spec.make_case(device, shape, np.random.default_rng(1))
    outputs = case.run(params)
    name, want = next(iter(case.expected.items()))
    tolerance = spec.tolerance_for(params)
    assert relative_error(outputs[name], want) <= tolerance
    wrong = np.array(want, np.float64)
    wrong.flat[wrong.size // 2] += 10 * max(tolerance, 1e-4) * max(float(np.max(np.abs(wrong))), 1.0)
    assert relative_error(outputs[name], wrong) > tolerance, f"{family}: an answer off in one element passed"
