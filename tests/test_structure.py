"""The shape of the codebase: imports run one way down the layers (in the README's order, no cycles, none
hidden inside functions), only the device layer and the kernel wrappers call pyopencl, every kernel file's
#define defaults are its parameter space's defaults, and the README's Python examples run as written."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from perfx.resources import kernel_source
from perfx.tuning import SPECS

ROOT = Path(__file__).resolve().parent.parent
# Imports inside functions are for optional dependencies only: a package that may be absent, or heavy
# and needed by one command.
OPTIONAL = {"matplotlib", "awq", "transformers", "readline"}

# The package's layers, bottom to top, as the README's "Layout" table gives them: a module imports only from
# its own layer and those below. A name stands for that module and, for a package, every module in it.
LAYERS = (
    ("base", ("perfx.errors", "perfx.resources", "perfx.gguf_file", "perfx.config", "perfx.reference",
              "perfx.progress", "perfx.kernels")),
    ("device", ("perfx.runtime", "perfx.timing")),
    ("formats", ("perfx.formats", "perfx.tokenizer")),
    ("sources", ("perfx.sources",)),
    ("ops", ("perfx.ops",)),
    ("tuning", ("perfx.tuning",)),
    ("model", ("perfx.plan", "perfx.model", "perfx.generate", "perfx.speculative")),
    ("commands", ("perfx.commands", "perfx.serve", "perfx.cli", "perfx.plots", "perfx.__main__", "perfx")),
)

# pyopencl is called by the device layer and the kernel wrappers; everything else goes through the Device
# (Device.copy, write, read, fill for every copy).
PYOPENCL_USERS = ("perfx.runtime", "perfx.ops")


def package_modules() -> dict[str, Path]:
    """Module name -> file, for perfx and the parts installed under it (perfx.tuning, perfx.kernels)."""
    modules = {}
    for folder, package in (("perfx", "perfx"), ("tuning", "perfx.tuning"), ("kernels", "perfx.kernels")):
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package] + parts)] = path
    return modules


def imports(tree: ast.Module, module: str, modules: dict, top_level: bool):
    """(name, line) of each perfx module imported at module level (or, top_level False, inside functions)."""
    nodes = tree.body if top_level else [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                                                       ast.AsyncFunctionDef))]
    found = []
    for node in nodes if top_level else [n for f in nodes for n in ast.walk(f)]:
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = module.rsplit(".", node.level)[0] if not modules[module].name == "__init__.py" else module
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module
            submodules = [f"{name}.{alias.name}" for alias in node.names if f"{name}.{alias.name}" in modules]
            if len(submodules) < len(node.names):  # names defined in the module itself
                found.append((name, node.lineno))
            found += [(submodule, node.lineno) for submodule in submodules]
    return found


def test_no_import_cycles_among_the_package_modules():
    modules = package_modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        graph[module] = {name for name, _ in imports(tree, module, modules, True) if name in modules and name != module}
    # Tarjan's strongly connected components: any component of two or more modules is a cycle.
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"
    assert len(graph) > 40 and graph["perfx.model"], "the graph was read"


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer that holds ``module`` (the longest name that covers it)."""
    covering = [(len(name), index) for index, (_, names) in enumerate(LAYERS) for name in names
                if module == name or (module.startswith(name + ".") and name != "perfx")]
    assert covering, f"{module} has no layer: add it to LAYERS and to the README's Layout table"
    return max(covering)[1]


def test_imports_run_down_the_layers_of_the_readme():
    modules = package_modules()
    upward = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        for name, line in imports(tree, module, modules, True) + imports(tree, module, modules, False):
            if name in modules and layer_of(name) > layer_of(module):
                upward.append(f"{path.relative_to(ROOT)}:{line}: {module} ({LAYERS[layer_of(module)][0]}) imports "
                              f"{name} ({LAYERS[layer_of(name)][0]})")
    assert not upward, "imports up the layers:\n" + "\n".join(upward)
    assert {LAYERS[layer_of(m)][0] for m in modules} == {layer for layer, _ in LAYERS}, "every layer was read"


def test_only_the_device_layer_and_the_kernel_wrappers_import_pyopencl():
    modules = package_modules()
    users = set()
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name.split(".")[0] == "pyopencl" for name in names):
                users.add(module)
    allowed = {m for m in users if m.startswith(tuple(p + "." for p in PYOPENCL_USERS)) or m in PYOPENCL_USERS}
    assert not users - allowed, (f"these import pyopencl: {sorted(users - allowed)}; use the Device's methods "
                                 "(perfx.runtime) instead")
    assert "perfx.ops.kv_cache" not in users, "the KV cache wraps no kernel: its copies go through the Device"
    assert "perfx.runtime.device" in users, "the imports were read"


def test_imports_inside_functions_are_only_for_optional_dependencies():
    modules = package_modules()
    inside = []
    for module, path in modules.items():
        for name, line in imports(ast.parse(path.read_text()), module, modules, False):
            if name.split(".")[0] not in OPTIONAL:
                inside.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not inside, "imports inside functions:\n" + "\n".join(inside)


@pytest.mark.parametrize("family", sorted(SPECS))
def test_kernel_file_defaults_equal_the_parameter_space_defaults(family):
    spec = SPECS[family]
    source = kernel_source(spec.source)
    defaults = dict(re.findall(r"#ifndef (\w+)\s*\n\s*#define \1 (\S+)", source))
    for name, value in spec.defaults().items():
        assert name in defaults, f"kernels/{spec.source} has no #ifndef {name} default"
        assert defaults[name] == str(value), (f"kernels/{spec.source}: #define {name} {defaults[name]}, but "
                                              f"the parameter space's default is {value}")


def readme_python_examples() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use from Python", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.mark.parametrize("index", range(2))
def test_readme_python_examples_run_as_written(index, tmp_path):
    examples = readme_python_examples()
    assert len(examples) == 2, "the README's 'Use from Python' section has two examples"
    script = tmp_path / "example.py"
    script.write_text(examples[index])
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip(), "the example prints what it measured or generated"
