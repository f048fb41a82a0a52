"""The suite's file order (tests/conftest.py): under `-n auto --dist loadfile` the heaviest files start first."""

from pathlib import Path

import pytest

from conftest import WEIGHTS, pytest_collection_modifyitems, pytest_configure


class Item:
    """What the ordering reads of a collected test: its file and its markers."""

    def __init__(self, file: str, name: str, marker: str | None = None):
        self.path, self.name, self.marker = Path(file), name, marker

    def get_closest_marker(self, name):
        return name if name == self.marker else None


def test_heaviest_files_first_and_tests_in_their_order():
    items = [Item("a.py", f"a{i}") for i in range(3)] + [Item("b.py", "b0", "slow"), Item("b.py", "b1")]
    items += [Item("c.py", "c0", "sweep"), Item("c.py", "c1", "sweep"), Item("d.py", "d0"), Item("e.py", "e0")]
    pytest_collection_modifyitems(None, items)
    # b: slow + 1, c: two sweeps, a: 3, then d and e (1 each) in the order they were collected
    assert WEIGHTS["slow"] + 1 > 2 * WEIGHTS["sweep"] > 3
    assert [item.name for item in items] == ["b0", "b1", "c0", "c1", "a0", "a1", "a2", "d0", "e0"]


def test_xdist_keeps_this_order(pytestconfig):
    """pytest-xdist's own reorder (files with the most tests first) is off, in this run as in any."""
    if not hasattr(pytestconfig.option, "loadscopereorder"):
        # the dev extra installs xdist (CI has it); a plain `pytest` without it has no reorder to turn off
        pytest.skip("pytest-xdist is not installed")
    assert pytestconfig.option.loadscopereorder is False

    class Options:
        loadscopereorder = True

    class Config:
        option = Options()

    config = Config()
    pytest_configure(config)
    assert config.option.loadscopereorder is False
