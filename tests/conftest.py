"""Shared fixtures: the OpenCL device a test runs on and a fresh random generator per test.

``device`` runs each test once per real OpenCL implementation installed here (PoCL, and Intel's CPU
runtime where ``intel-opencl-rt`` is installed), with ids such as ``[pocl]`` and ``[intel]``; a
``Device()`` made inside such a test opens the same implementation. Modules marked ``one_implementation``
(model-level and end-to-end tests) run on the default device only. ``PERFX_DEVICE`` set: that device only.

The order, for ``-n auto`` (pytest-xdist hands the tests out in this order as workers free up): tests go in units,
heaviest first, so that the last to start are short and both workers finish together. A file's tests make one unit
(in their order), except those marked ``sweep`` (every parameter set of a kernel family at a shape, or the fuzz's
random ones: a build a set): each sweep is a unit of its own with its runs on every implementation, so that a file
of many sweeps starts early rather than at its file's place. A unit's weight is its number of tests, a test marked
``slow`` counting ``WEIGHTS["slow"]`` and one marked ``sweep`` ``WEIGHTS["sweep"]``. Mark a new test that takes
minutes from cold kernel caches with one of them, or it will start last and hold the run's tail.
"""

import os
import zlib

import numpy as np
import pytest

from helpers import spec_checks
from perfx.runtime import BuildError, Device, choose_device, list_devices

UNUSABLE: dict[str, str] = {}   # implementation -> why no test runs on it (reported in pytest's header)


def _compiler_knows_this_cpu(entry):
    """The implementation's capabilities, or None where its compiler cannot target this machine at all (PoCL 3.0's
    LLVM 14 on a CPU newer than it): every kernel would fail to build, whatever the test, so the implementation is
    left out and the header says why. Any other build failure is a test's to report."""
    device = Device(entry.index)
    try:
        device.build("copy.cl")
    except BuildError as e:
        if not e.compiler_lacks_cpu:
            raise
        UNUSABLE[entry.implementation] = e.summary
        return None
    return device.caps


def _implementations() -> dict[str, str]:
    """Test id -> device selector: the first device of each real platform, the default device first. Their
    capabilities go to ``spec_checks.RUNTIMES``: the kernel sweeps share their parameter sets out among them."""
    chosen, _ = choose_device()
    entries = [chosen] + [e for e in list_devices() if not e.simulator and e.platform_index != chosen.platform_index
                          and e.device_index == 0]
    if os.environ.get("PERFX_DEVICE"):
        entries = [chosen]
    found = {}
    for entry in entries:
        caps = _compiler_knows_this_cpu(entry)
        if caps is None:
            continue
        name = entry.implementation
        name = name if name not in found else f"{name}{entry.platform_index}"
        found[name] = entry.index
        spec_checks.RUNTIMES[name] = caps
    return found


IMPLEMENTATIONS = _implementations()
IMPLEMENTATION_IDS = {index: name for name, index in IMPLEMENTATIONS.items()}   # device selector -> test id


# What a test counts for in its unit's weight (a test with neither counts 1): the ratio of a typical such test's
# time from cold kernel caches to an ordinary test's, roughly.
WEIGHTS = {"slow": 60, "sweep": 15}


def work_unit(item) -> str:
    """The unit a test is ordered with: its file's name, or for a sweep, its own: the file, the test and its
    parameters but the implementation, so that a sweep's runs on PoCL and on Intel's runtime are one unit, which
    starts where the first of them stands in pytest's order (pytest runs each implementation's tests together, and
    PoCL's runs alone would start after all of Intel's)."""
    if item.get_closest_marker("sweep") is None:
        return item.path.stem
    callspec = getattr(item, "callspec", None)
    parts = callspec.id.split("-") if callspec is not None else []
    if callspec is not None and "opencl_device" in callspec.params:
        parts.remove(IMPLEMENTATION_IDS[callspec.params["opencl_device"]])
    return ".".join([item.path.stem, item.originalname] + ["-".join(parts)] * bool(parts))


def pytest_collection_modifyitems(config, items):
    """The tests by unit (``work_unit``), the units by weight, heaviest first (ties in pytest's order); the tests of
    a unit keep their order."""
    units, weight = [], {}
    for item in items:
        unit = work_unit(item)
        marked = [WEIGHTS[name] for name in WEIGHTS if item.get_closest_marker(name) is not None]
        weight[unit] = weight.get(unit, 0) + max(marked, default=1)
        units.append(unit)
    rank = {unit: i for i, unit in enumerate(sorted(weight, key=lambda unit: -weight[unit]))}
    order = sorted(range(len(items)), key=lambda i: rank[units[i]])
    items[:] = [items[i] for i in order]


def pytest_report_header(config):
    return [f"perfx: {name} left out, its compiler cannot build for this CPU ({why})"
            for name, why in UNUSABLE.items()]
DEFAULT = next(iter(IMPLEMENTATIONS))


def pytest_generate_tests(metafunc):
    if "opencl_device" in metafunc.fixturenames:
        one = metafunc.definition.get_closest_marker("one_implementation") is not None
        ids = [DEFAULT] if one else list(IMPLEMENTATIONS)
        metafunc.parametrize("opencl_device", [IMPLEMENTATIONS[i] for i in ids], ids=ids, indirect=True,
                             scope="session")


@pytest.fixture(scope="session")
def opencl_device(request) -> Device:
    """One Device per implementation for the whole session (parametrized by ``pytest_generate_tests``)."""
    return Device(request.param)


@pytest.fixture
def device(opencl_device, monkeypatch) -> Device:
    monkeypatch.setenv("PERFX_DEVICE", opencl_device.entry.index)
    return opencl_device


@pytest.fixture
def rng(request) -> np.random.Generator:
    # A different seed per test, stable across runs, so failures reproduce.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
