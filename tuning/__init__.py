"""The autotuner's data and machinery, installed as ``perfx.tuning``: one spec per kernel family (its
wrapper's parameter space with verification cases and metrics), the problems a model runs, the search,
and the tuning database.

``SPECS`` holds every family's spec by name; adding a family is writing its spec module and naming it here.
"""

from __future__ import annotations

from perfx.errors import PerfxError
from perfx.tuning import (attention_decode, attention_prefill, embedding_q8, gated_delta_net, gemm_q4, gemm_q8,
                          gemv_f16, gemv_q4, gemv_q8, rmsnorm, small_ops)
from perfx.tuning.spec import Case, Spec, relative_error

SPECS: dict[str, Spec] = {spec.family: spec for spec in (
    gemv_q4.SPEC, gemv_f16.SPEC, gemm_q4.SKINNY, gemm_q4.TILED, gemm_q4.F16, rmsnorm.SPEC,
    attention_decode.SPEC,
    attention_prefill.SPEC, small_ops.EMBEDDING_F16, small_ops.EMBEDDING_Q4, small_ops.ARGMAX, small_ops.SWIGLU,
    small_ops.GEGLU, small_ops.SOFTCAP, gemv_q8.SPEC, gemm_q8.SPEC, embedding_q8.SPEC,
    gated_delta_net.RECURRENT, gated_delta_net.CHUNKED)}


def select_specs(names: str | None) -> dict[str, Spec]:
    """The specs named in a comma-separated list (`--kernels`): exact family names, or a prefix naming a
    group (gemm_q4 = gemm_q4_skinny, gemm_q4_tiled and gemm_q4_f16); None or empty: all."""
    if not names:
        return dict(SPECS)
    chosen = {}
    for name in (n.strip() for n in names.split(",") if n.strip()):
        matched = [family for family in SPECS if family == name or family.startswith(name + "_")]
        if not matched:
            raise PerfxError(f"unknown kernel family {name!r}; known: {', '.join(SPECS)}")
        chosen.update({family: SPECS[family] for family in matched})
    return chosen


__all__ = ["Case", "SPECS", "Spec", "relative_error", "select_specs"]
