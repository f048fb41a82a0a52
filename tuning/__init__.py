"""The autotuner's data and machinery, installed as ``perfx.tuning``: one spec per kernel family (its
wrapper's parameter space with verification cases and metrics), the problems a model runs, the search,
and the tuning database.

``SPECS`` holds every family's spec by name, found in the package's modules: a module that defines a ``Spec``
at module level registers it, so adding a family is adding its spec module, with no list to edit.
"""

from __future__ import annotations

import importlib
import pkgutil

from perfx.errors import PerfxError
from perfx.tuning.spec import Case, Spec, relative_error


def discover_specs(package: str = __name__) -> dict[str, Spec]:
    """family -> Spec for every ``Spec`` defined at module level in the modules of ``package``: modules in
    name order, each module's specs in the order it defines them."""
    found: dict[str, Spec] = {}
    for info in sorted(pkgutil.iter_modules(importlib.import_module(package).__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{package}.{info.name}")
        for spec in vars(module).values():
            if not isinstance(spec, Spec):
                continue
            other = found.setdefault(spec.params.family, spec)
            if other is not spec:
                raise PerfxError(f"two specs of the kernel family {spec.params.family!r} (the second in "
                                 f"{module.__name__}): each family has one spec")
    return found


SPECS: dict[str, Spec] = discover_specs()


def select_specs(names: str | None) -> dict[str, Spec]:
    """The specs named in a comma-separated list (`--kernels`): exact family names, or a prefix naming a
    group (gemm_q4 = gemm_q4_skinny, _tiled, _f16, _lanes and _i8); a family the plan compares by kind with those
    its name begins names them too (gemm_q8 = gemm_q8, _lanes and _i8); None or empty: all."""
    if not names:
        return dict(SPECS)
    chosen = {}
    for name in (n.strip() for n in names.split(",") if n.strip()):
        # a family's exact name is that family alone (gemv_q4, not gemv_q4_split too), unless the plan compares it
        # with the kinds its name begins (gemm_q8 with gemm_q8_lanes and gemm_q8_i8: timed apart, in two runs, they
        # would be compared by the machine's state rather than by the kernels); else a prefix's group
        group = [family for family in SPECS if family.startswith(name + "_")]
        if name in SPECS:
            matched = [name] + ([family for family in group if SPECS[family].compared_kind]
                                if SPECS[name].compared_kind else [])
        else:
            matched = group
        if not matched:
            raise PerfxError(f"unknown kernel family {name!r}; known: {', '.join(SPECS)}")
        chosen.update({family: SPECS[family] for family in matched})
    return chosen


__all__ = ["Case", "SPECS", "Spec", "discover_specs", "relative_error", "select_specs"]
