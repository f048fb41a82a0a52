"""The shape of the codebase: imports run one way down the layers (in docs/layout.md's order, no cycles, none
hidden inside functions), only the device layer and the kernel wrappers call pyopencl, every kernel file's
#define defaults are its parameter space's defaults, every family registered by its spec alone with what the
test tiers need of it, and the Python examples of docs/python.md run as written."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from perfx import reference
from perfx.errors import PerfxError
from perfx.resources import kernel_source
from perfx.tuning import SPECS, discover_specs

ROOT = Path(__file__).resolve().parent.parent
# Imports inside functions are for optional dependencies only: a package that may be absent, or heavy
# and needed by one command.
OPTIONAL = {"matplotlib", "awq", "transformers", "readline", "llguidance"}

# The package's layers, bottom to top, as docs/layout.md's table gives them: a module imports only from
# its own layer and those below. A name stands for that module and, for a package, every module in it.
LAYERS = (
    ("base", ("perfx.errors", "perfx.resources", "perfx.gguf_file", "perfx.recipe", "perfx.families",
              "perfx.config", "perfx.reference", "perfx.progress", "perfx.kernels")),
    ("device", ("perfx.runtime", "perfx.timing")),
    ("formats", ("perfx.formats", "perfx.tokenizer", "perfx.tools", "perfx.constrain")),
    ("ops", ("perfx.ops",)),
    ("mixers", ("perfx.op", "perfx.linear", "perfx.mixers", "perfx.moe", "perfx.forward64")),
    ("sources", ("perfx.sources",)),
    ("tuning", ("perfx.tuning", "perfx.step")),
    ("model", ("perfx.plan", "perfx.model", "perfx.generate", "perfx.speculative", "perfx.batch")),
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
    assert covering, f"{module} has no layer: add it to LAYERS and to docs/layout.md's layers table"
    return max(covering)[1]


def test_imports_run_down_the_layers_of_docs_layout():
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
    params = SPECS[family].params
    # a family in variants (gemv_q4: one kernel file per weight layout) has a parameter space per file
    spaces = params.variants.values() if hasattr(params, "variants") else (params,)
    for space in spaces:
        source = kernel_source(space.source)
        defaults = dict(re.findall(r"#ifndef (\w+)\s*\n\s*#define \1 (\S+)", source))
        for name, value in space.defaults().items():
            assert name in defaults, f"kernels/{space.source} has no #ifndef {name} default"
            assert defaults[name] == str(value), (f"kernels/{space.source}: #define {name} {defaults[name]}, "
                                                  f"but the parameter space's default is {value}")


def fits_some_parameter_set(spec, shape) -> bool:
    """Whether the defaults, or else any parameter set of the space, may run ``shape`` (on some device)."""
    space = spec.params
    return space.why_invalid(space.defaults(), shape) is None or bool(space.candidates(shape))


@pytest.mark.parametrize("family", sorted(SPECS))
def test_every_family_carries_its_reference_and_oclgrind_shapes(family):
    spec = SPECS[family]
    name = getattr(spec.reference, "__name__", "")
    assert getattr(reference, name, None) is spec.reference, (
        f"{family}: Spec.reference must be a function of perfx.reference, not {spec.reference!r}")
    module_source = inspect.getsource(sys.modules[spec.make_case.__module__])
    assert f"reference.{name}" in module_source, f"{family}: its spec module never uses reference.{name}"
    assert spec.oclgrind_shapes, f"{family}: no Oclgrind shapes"
    largest = max(spec.bytes_moved(shape) for shape in spec.test_shapes)
    for shape in spec.oclgrind_shapes:
        assert fits_some_parameter_set(spec, shape), f"{family}: no parameter set runs Oclgrind shape {shape}"
        assert spec.bytes_moved(shape) <= largest, f"{family}: Oclgrind shape {shape} is larger than its tests'"


@pytest.mark.parametrize("family", sorted(SPECS))
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_family_fuzzes_shapes_its_parameters_can_run(family, data):
    spec = SPECS[family]
    shape = data.draw(spec.fuzz_shapes(st), label="shape")
    assert fits_some_parameter_set(spec, shape), f"{family}: the fuzz strategy drew {shape}, which nothing runs"
    spec.bytes_moved(shape)


def test_the_tuning_package_never_imports_hypothesis():
    # hypothesis is a dev dependency: the specs' fuzz strategies take its module as an argument.
    code = "import sys, perfx.tuning; print('hypothesis' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


SPEC_MODULE = """
from perfx import reference
from perfx.ops.params import ParamSpace
from perfx.tuning.spec import Spec

SPEC = Spec(params=ParamSpace(family="{family}", source="copy.cl", space={{"WGS": (64,)}}), make_case=None,
            tolerance=0.0, tolerance_why="", test_shapes=({{"n": 8}},), bytes_moved=lambda s: 8 * s["n"],
            reference=reference.swiglu, fuzz_shapes=lambda st: st.just({{"n": 8}}), oclgrind_shapes=({{"n": 8}},))
"""


def test_specs_are_discovered_from_the_modules_of_the_package(tmp_path, monkeypatch):
    package = tmp_path / "specs_here"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("VALUE = 1\n")   # a module without a spec registers nothing
    (package / "zeta.py").write_text(textwrap.dedent(SPEC_MODULE.format(family="zeta_op")))
    (package / "alpha.py").write_text(textwrap.dedent(SPEC_MODULE.format(family="alpha_op")))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert list(discover_specs("specs_here")) == ["alpha_op", "zeta_op"], "modules in name order"
    (package / "again.py").write_text(textwrap.dedent(SPEC_MODULE.format(family="zeta_op")))
    with pytest.raises(PerfxError, match="two specs of the kernel family 'zeta_op'"):
        discover_specs("specs_here")
    # perfx.tuning's own: every spec module's specs, none listed by hand.
    assert SPECS == discover_specs("perfx.tuning") and len(SPECS) >= 17


def python_doc_examples() -> list[str]:
    text = (ROOT / "docs" / "python.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.parametrize("index", range(2))
def test_python_doc_examples_run_as_written(index, tmp_path):
    examples = python_doc_examples()
    assert len(examples) == 2, "docs/python.md has two examples"
    script = tmp_path / "example.py"
    script.write_text(examples[index])
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip(), "the example prints what it measured or generated"


# The forward asks its Linears and mixers, never what form a weight is in, which layer kind it runs or which
# architecture it is; generation, speculation, serve and chat use the model's declared state contract.
FORWARD = ("perfx.model", "perfx.forward64", "perfx.step")
WEIGHT_FORMS = {"Q4Matrix", "Q8Matrix", "Q4DeviceWeight", "Q8DeviceWeight", "F16DeviceWeight", "ndarray"}
LAYER_KINDS = {"attention", "conv", "delta"}
STATE_USERS = ("perfx.generate", "perfx.speculative", "perfx.serve.engine", "perfx.commands.chat")


def forward_branches(source: str) -> list[str]:
    """Where ``source`` asks a weight's form (isinstance on a weight class) or branches on a layer kind or the
    architecture. The model's choice of the int4 kernels built first, from the file's first QKV at load
    (``_int4_plan``), is not the forward."""
    tree = ast.parse(source)
    planning = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "_int4_plan"
                for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and id(node) not in planning:
            names = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", "") for n in ast.walk(node.args[1])}
            if names & WEIGHT_FORMS:
                found.append(f"line {node.lineno}: isinstance on a weight form")
        if isinstance(node, ast.Compare):
            values = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
            attrs = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            if values & LAYER_KINDS or "architecture" in attrs:
                found.append(f"line {node.lineno}: a layer-kind or architecture branch")
    return found


@pytest.mark.parametrize("module", FORWARD)
def test_the_forward_branches_on_no_weight_form_layer_kind_or_architecture(module):
    found = forward_branches(package_modules()[module].read_text())
    assert not found, f"{module}: " + "; ".join(found)


def test_the_branch_check_finds_what_it_looks_for():
    planted = ("def f(w, c):\n    if c.layers[0].kind == 'conv':\n        return isinstance(w, Q4Matrix)\n"
               "    if c.architecture in ('gemma3',):\n        return 1\n")
    assert sorted(forward_branches(planted)) == ["line 2: a layer-kind or architecture branch",
                                                 "line 3: isinstance on a weight form",
                                                 "line 4: a layer-kind or architecture branch"]
    assert forward_branches("def _int4_plan(w):\n    return isinstance(w, Q4Matrix)\n") == []


# The sources read, fuse, check and quantize a layer as its kind's mixer declares (``perfx.mixers.Mixer``: its
# matrices and their projections, shapes, vectors, taps, how it is read): they ask the layer's mixer, never its
# kind (nor the architecture: that is the family files'). Weight forms are theirs to ask.
SOURCES = ("perfx.sources.base", "perfx.sources.gguf", "perfx.sources.huggingface", "perfx.sources.synthetic")


@pytest.mark.parametrize("module", SOURCES)
def test_the_sources_branch_on_no_layer_kind_or_architecture(module):
    found = [f for f in forward_branches(package_modules()[module].read_text()) if "isinstance" not in f]
    assert not found, f"{module}: " + "; ".join(found)


@pytest.mark.parametrize("module", STATE_USERS)
def test_no_module_probes_the_model_for_state_it_does_not_declare(module):
    tree = ast.parse(package_modules()[module].read_text())
    probes = [f"line {n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Call)
              and getattr(n.func, "id", None) in ("getattr", "hasattr")
              and "model" in ast.unparse(n.args[0])]
    assert not probes, f"{module} probes the model's state with getattr/hasattr at " + ", ".join(probes)
