"""The autotuner's data: one search-space spec per kernel family, and the tuning database.

Installed as ``perfx.tuning``. ``specs()`` returns every family's spec; adding a family to the tuner,
to `perfx selftest` and to the parameterised tests is writing one module here with a ``SPEC``.
"""

from __future__ import annotations

import importlib
import pkgutil

from perfx.tuning.spec import Case, Spec, relative_error


def specs() -> dict[str, Spec]:
    """Every kernel family's spec: each module of this package that defines ``SPEC`` (or ``SPECS``)."""
    result = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for spec in getattr(module, "SPECS", ()) or ([module.SPEC] if hasattr(module, "SPEC") else []):
            result[spec.family] = spec
    return result


__all__ = ["Case", "Spec", "relative_error", "specs"]
