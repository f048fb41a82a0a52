"""The Oclgrind tier: every kernel family under a simulator that checks each access.

Each family of ``perfx.tuning.SPECS`` runs at its spec's tiny ``oclgrind_shapes`` (tests/oclgrind_runner.py),
at its defaults and at SAMPLES parameter sets (fewer where the family has fewer) drawn with a fixed seed from
what the tuner may choose on the simulator, with Oclgrind's out-of-bounds, data-race, uninitialised-value and
API checks on. Any report fails the test, and the outputs must still match the float64 references within the
spec's tolerance. A new family joins by having a spec. Each check is one subprocess, so each report belongs
to one family and parameter set.

Without Oclgrind the tier is skipped (apt-get install oclgrind); PERFX_REQUIRE_OCLGRIND=1 (CI) makes that
a failure instead.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import oclgrind_runner as runner
from perfx.tuning import SPECS

RUNNER = Path(runner.__file__).resolve()
ROOT = RUNNER.parent.parent
ICD = runner.find_icd()
TIMEOUT_S = 240  # one check; the slowest takes ~10 s on two cores

if ICD is None and os.environ.get("PERFX_REQUIRE_OCLGRIND") == "1":
    raise RuntimeError(f"PERFX_REQUIRE_OCLGRIND=1 but {runner.INSTALL_HELP}")
pytestmark = pytest.mark.skipif(ICD is None, reason=runner.INSTALL_HELP)


def oclgrind(*args: str) -> tuple[dict, str]:
    """Run the runner under Oclgrind; (its JSON result, its stderr). Fails the test if it did not finish."""
    done = subprocess.run([sys.executable, str(RUNNER), *args], env=runner.oclgrind_env(ICD, family=args[0]), cwd=ROOT,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        pytest.fail(f"oclgrind_runner {' '.join(args)} exited with {done.returncode}; "
                    f"stderr (end):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def assert_no_reports(stderr: str, what: str, image_reads: bool = False):
    before, after = runner.split_at_ready(stderr)
    found = runner.reports(before) + runner.reports(after, image_reads)
    assert not found, f"Oclgrind reported {len(found)} problem(s) in {what}:\n\n" + "\n\n".join(found[:6])


def sample_counts() -> dict[str, int]:
    """Per family, the samples that exist on the simulator (asked once, at collection), so that only
    those are parametrized; without Oclgrind every test here is skipped, so SAMPLES stands in."""
    if ICD is None:
        return {family: runner.SAMPLES for family in SPECS}
    counts, _ = oclgrind("--samples")
    return counts


SAMPLE_COUNTS = sample_counts()
CHECKS = [(family, which) for family in SPECS
          for which in ["default"] + [str(i + 1) for i in range(SAMPLE_COUNTS[family])]]


@pytest.mark.parametrize("family, which", CHECKS, ids=[f"{f}-{w if w == 'default' else 'sample' + w}"
                                                       for f, w in CHECKS])
def test_family_under_oclgrind(family, which):
    result, stderr = oclgrind(family, which)
    assert_no_reports(stderr, f"{family} with {result['params']}", result["image_reads"])
    ran = [r for r in result["results"] if "errors" in r]
    if not ran and all("lacks" in r.get("skipped", "") for r in result["results"]):
        pytest.skip(f"{family} needs a capability Oclgrind lacks: {result['results'][0]['skipped']}")
    assert ran, f"{family} {result['params']}: no tiny shape fits: {result['results']}"
    for r in ran:
        for name, error in r["errors"].items():
            assert error <= result["tolerance"], (
                f"{family} {r['describe']} with {result['params']}: {name} relative error {error:.3g} "
                f"> tolerance {result['tolerance']:.3g} under Oclgrind")


def test_opening_the_device_reports_nothing():
    result, stderr = oclgrind("--device")
    assert result == {"device": "ready"}
    assert_no_reports(stderr, "opening the device (perfx.runtime.Device)")


@pytest.mark.parametrize("kind, first_line", [
    ("oob", "Invalid write of size 4 at global memory"),
    ("race", "data race at local memory"),
    ("uninit", "uninitialized value"),
    ("api", "OpenCL runtime error detected"),
])
def test_a_wrong_kernel_is_reported(kind, first_line):
    # The tier could pass by seeing nothing: each check must catch a kernel written to trip it.
    _, stderr = oclgrind("--bad", kind)
    _, after = runner.split_at_ready(stderr)
    found = runner.reports(after)
    assert any(first_line.lower() in report.lower() for report in found), stderr[-3000:]


def test_what_the_report_filter_lets_through():
    probe = ("Oclgrind - OpenCL runtime error detected\n\tFunction: clGetDeviceInfo\n"
             "\tError:    CL_INVALID_VALUE\n\tFor argument 'param_name'\n")
    other = probe.replace("clGetDeviceInfo", "clSetKernelArg").replace("'param_name'", "'arg_size'")
    uninit = "Uninitialized value written to global memory address 0x6000000000000\n\tKernel: gemv_q4\n"
    oob = "Invalid read of size 16 at global memory address 0x1000000000010\n\tKernel: gemv_q4\n"
    assert runner.reports("\n" + probe + "\n") == []
    assert len(runner.reports("\n" + probe + "\n\n" + other + "\n")) == 1
    assert len(runner.reports(f"\n{uninit}\n{oob}")) == 2
    assert runner.reports(f"\n{uninit}\n{oob}", image_reads=True) == [oob.strip()]
    assert runner.reads_images({"READ": 1}) and runner.reads_images({"READ": 2}) and runner.reads_images({"I8": 1})
    assert not runner.reads_images({"READ": 0}) and not runner.reads_images({"WGS": 64})


@pytest.mark.parametrize("params", [{"LANES": 1, "ROWS": 1, "WGR": 16, "ARRIVAL": 1},
                                    {"LANES": 1, "ROWS": 2, "WGR": 16, "ARRIVAL": 1},
                                    {"LANES": 1, "ROWS": 1, "WGR": 64, "ARRIVAL": 0}],
                         ids=["group-arrives", "group-owns-its-blocks", "each-work-item-arrives"])
def test_gemv_q4_tail_shared_by_the_last_work_group_under_oclgrind(params):
    """gemv_q4_tail with one lane a row set (the CPU runtimes' tuned shape), on each of the spec's Oclgrind shapes:
    gate-up's output quantized (96 outputs), the norm with its post-norm (45 outputs) and with its blocks (64).
    Each work-group counting itself once after a barrier (ARRIVAL 1), the last group's work-items sharing gate-up's
    blocks after a flag in local memory (16 outputs a group) or, with 32 a group, each group quantizing its own
    block (no hand-off); and every work-item counting itself, no barrier (ARRIVAL 0). The samples above draw
    LANES > 1, where each row set's first lane counts. Oclgrind takes OpenCL C 1.2 (its 3.0 lists no atomics
    features, and it cannot run C11 atomics): the hand-off is the atomics; the ordered loads run on both CPU
    runtimes (tests/test_gemv_q4_tail.py)."""
    result, stderr = oclgrind("gemv_q4_tail", json.dumps({"LAYOUT": 0, **params}))
    assert_no_reports(stderr, f"gemv_q4_tail with {result['params']}")
    assert len(result["results"]) == 3 and all("errors" in r for r in result["results"]), result["results"]
    for r in result["results"]:
        for name, error in r["errors"].items():
            assert error <= result["tolerance"], f"{r['describe']}: {name} relative error {error:.3g}"
