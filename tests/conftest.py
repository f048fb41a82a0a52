"""Shared fixtures: the OpenCL device every test runs on (PoCL on the CPU unless PERFX_DEVICE says
otherwise) and a fresh random generator per test."""

import zlib

import numpy as np
import pytest

from perfx.runtime import Device


@pytest.fixture(scope="session")
def device() -> Device:
    return Device()


@pytest.fixture
def rng(request) -> np.random.Generator:
    # A different seed per test, stable across runs, so failures reproduce.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
