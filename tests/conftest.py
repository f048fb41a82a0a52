"""Shared fixtures: the OpenCL device a test runs on and a fresh random generator per test.

``device`` runs each test once per real OpenCL implementation installed here (PoCL, and Intel's CPU
runtime where ``intel-opencl-rt`` is installed), with ids such as ``[pocl]`` and ``[intel]``; a
``Device()`` made inside such a test opens the same implementation. Modules marked ``one_implementation``
(model-level and end-to-end tests) run on the default device only. ``PERFX_DEVICE`` set: that device only.

The work units, for ``-n auto --dist loadgroup`` (each unit on one worker, handed out in order as workers free up):
a file's tests make one unit (its module fixtures made once, its tests in their order), except those marked
``sweep`` (every parameter set of a kernel family at a shape, or the fuzz's random ones: a build a set), a unit for
each sweep (its runs on each implementation), so that a file of many sweeps does not hold one worker while the
other idles. The units go out heaviest first, so that the last to start are short and both workers finish
together. A unit's weight is its number of tests, a test marked ``slow`` counting ``WEIGHTS["slow"]`` and one
marked ``sweep`` ``WEIGHTS["sweep"]``. Mark a new test that takes minutes from cold kernel caches with one of them,
or it will start last and hold the run's tail.
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


def pytest_configure(config):
    # pytest-xdist hands out the units with the most tests first; ours go by weight (pytest_collection_modifyitems)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def work_unit(item) -> str:
    """The ``xdist_group`` of a test: its file's name, or for a sweep, its own: the file, the test and its parameters
    but the implementation, so that a sweep's runs on PoCL and on Intel's runtime are one unit, which starts where
    the first of them stands in pytest's order (pytest runs each implementation's tests together, and a unit of
    PoCL's tests alone would start after all of Intel's). Neither '@' nor ']' in it: pytest-xdist's loadgroup
    reads the group's name after the last '@'."""
    if item.get_closest_marker("sweep") is None:
        return item.path.stem
    callspec = getattr(item, "callspec", None)
    parts = callspec.id.split("-") if callspec is not None else []
    if callspec is not None and "opencl_device" in callspec.params:
        parts.remove(IMPLEMENTATION_IDS[callspec.params["opencl_device"]])
    name = ".".join([item.path.stem, item.originalname] + ["-".join(parts)] * bool(parts))
    return name.replace("@", "_").replace("]", "_")


@pytest.hookimpl(tryfirst=True)   # before pytest-xdist's worker reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Each test's work unit (``work_unit``, an ``xdist_group`` mark where pytest-xdist runs), and the units by
    weight, heaviest first (ties in pytest's order); the tests of a unit keep their order."""
    grouping = config is not None and config.pluginmanager.hasplugin("xdist")
    units, weight = [], {}
    for item in items:
        unit = work_unit(item)
        if grouping:
            item.add_marker(pytest.mark.xdist_group(unit))
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
    return np.random.default_rng(zlib.crc32(spec_checks.stable_id(request.node).encode()))
