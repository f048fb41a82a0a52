"""Shared fixtures: the OpenCL device a test runs on and a fresh random generator per test.

``device`` runs each test once per real OpenCL implementation installed here (PoCL, and Intel's CPU
runtime where ``intel-opencl-rt`` is installed), with ids such as ``[pocl]`` and ``[intel]``; a
``Device()`` made inside such a test opens the same implementation. Modules marked ``one_implementation``
(model-level and end-to-end tests) run on the default device only. ``PERFX_DEVICE`` set: that device only.
"""

import os
import zlib

import numpy as np
import pytest

from perfx.runtime import BuildError, Device, choose_device, list_devices

UNUSABLE: dict[str, str] = {}   # implementation -> why no test runs on it (reported in pytest's header)


def _compiler_knows_this_cpu(entry) -> bool:
    """False where the implementation's compiler cannot target this machine at all (PoCL 3.0's LLVM 14 on a CPU
    newer than it): every kernel would fail to build, whatever the test, so the implementation is left out
    and the header says why. Any other build failure is a test's to report."""
    try:
        Device(entry.index).build("copy.cl")
    except BuildError as e:
        if not e.compiler_lacks_cpu:
            raise
        UNUSABLE[entry.implementation] = e.summary
        return False
    return True


def _implementations() -> dict[str, str]:
    """Test id -> device selector: the first device of each real platform, the default device first."""
    chosen, _ = choose_device()
    entries = [chosen] + [e for e in list_devices() if not e.simulator and e.platform_index != chosen.platform_index
                          and e.device_index == 0]
    if os.environ.get("PERFX_DEVICE"):
        entries = [chosen]
    found = {}
    for entry in entries:
        if not _compiler_knows_this_cpu(entry):
            continue
        name = entry.implementation
        found[name if name not in found else f"{name}{entry.platform_index}"] = entry.index
    return found


IMPLEMENTATIONS = _implementations()


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
