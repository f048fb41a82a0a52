"""The device every benchmark runs on (PERFX_DEVICE chooses; the first GPU, else the first CPU)."""

import pytest

from perfx.runtime import Device


@pytest.fixture(scope="session")
def device() -> Device:
    return Device()
