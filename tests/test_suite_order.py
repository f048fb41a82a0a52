"""The suite's order (tests/conftest.py): a file's tests together, each sweep's runs on every implementation together,
the heaviest units first, so that under `-n auto` both workers finish together."""

import ast
from pathlib import Path

import pytest

from conftest import IMPLEMENTATION_IDS, IMPLEMENTATIONS, WEIGHTS, pytest_collection_modifyitems, work_unit


class Item:
    """What the ordering reads of a collected test: its file, name, markers and parameters."""

    def __init__(self, file: str, name: str, marker: str | None = None, **params):
        self.path, self.name, self.originalname, self.marker = Path(file), name, name.rstrip("0123456789"), marker
        if params:   # as pytest names a parametrized test: each value's id, joined by '-'
            ids = [IMPLEMENTATION_IDS[value] if key == "opencl_device" else str(value) for key, value in params.items()]
            self.callspec = type("CallSpec", (), {"params": params, "id": "-".join(ids)})()

    def get_closest_marker(self, name):
        return name if name == self.marker else None


def test_heaviest_units_first_and_tests_in_their_order():
    items = [Item("a.py", f"a{i}") for i in range(3)] + [Item("b.py", "b0", "slow"), Item("b.py", "b1")]
    items += [Item("c.py", "c0", "sweep", index=0), Item("c.py", "c1"), Item("c.py", "c2", "sweep", index=1),
              Item("d.py", "d0"), Item("e.py", "e0")]
    pytest_collection_modifyitems(None, items)
    # b: slow + 1, then c's two sweeps (a unit each), a: 3, then c's other test, d and e (1 each) in pytest's order
    assert WEIGHTS["slow"] + 1 > WEIGHTS["sweep"] > 3
    assert [item.name for item in items] == ["b0", "b1", "c0", "c2", "a0", "a1", "a2", "c1", "d0", "e0"]


def test_a_file_is_one_unit_and_each_sweep_one_of_its_own_on_every_implementation():
    first, *others = IMPLEMENTATIONS.values()
    second = others[0] if others else first
    items = [Item("t/x.py", "x0", opencl_device=first), Item("t/x.py", "sweep", "sweep", opencl_device=first, k="a@1"),
             Item("t/x.py", "sweep", "sweep", k="a@1", opencl_device=second), Item("t/x.py", "x2", "slow"),
             Item("t/x.py", "sweep", "sweep", opencl_device=first, k="b]-2"), Item("t/x.py", "fuzz", "sweep")]
    units = [work_unit(item) for item in items]
    assert units == ["x", "x.sweep.a@1", "x.sweep.a@1", "x", "x.sweep.b]-2", "x.fuzz"]


def test_every_kernel_sweep_is_marked_sweep():
    """A test that checks a family's planned parameter sets (``assert_planned_sets``: a build a set) is marked
    ``sweep``, so that it is a work unit of its own and starts early; unmarked, it would hold its file's worker."""
    unmarked = []
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
                continue
            called = {call.func.id for call in ast.walk(node) if isinstance(call, ast.Call)
                      and isinstance(call.func, ast.Name)}
            marked = any(ast.unparse(decorator) == "pytest.mark.sweep" for decorator in node.decorator_list)
            if "assert_planned_sets" in called and not marked:
                unmarked.append(f"{path.name}::{node.name}")
    assert not unmarked, f"sweeps not marked @pytest.mark.sweep: {unmarked}"
