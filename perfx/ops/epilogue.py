"""The fused epilogues of the GEMV and GEMM families by name, with the code each kernel file builds them with
(``kernels/epilogue.h``): one table, the same meaning in every family.

"none" (y = W·x; the GEMVs add the weight's bias here where it has one), "bias" (the GEMMs: + the weight's
bias per output column), "silu_mul" (SwiGLU) and "gelu_mul" (GeGLU, GELU's tanh form): W has 2·I rows, gate
rows then up rows, and y (I) = act(W_g·x)·(W_u·x).
"""

from __future__ import annotations

from perfx.errors import PerfxError

EPILOGUES = {"none": 0, "bias": 1, "silu_mul": 2, "gelu_mul": 3}   # EPI_NONE .. EPI_GELU_MUL
GATED = ("silu_mul", "gelu_mul")
# What each family takes: the GEMVs fold the weight's bias into "none" (a launch argument); the GEMMs build
# "bias" on its own.
GEMV_EPILOGUES = ("none",) + GATED
GEMM_EPILOGUES = ("none", "bias") + GATED

# The gate-up epilogue of an MLP's activation (a model config's ffn_activation, perfx.config.FFN_ACTIVATIONS)
GATE_UP_EPILOGUES = {"silu": "silu_mul", "gelu_tanh": "gelu_mul"}


def is_gated(epilogue: str | None) -> bool:
    """Whether the epilogue pairs gate and up rows (the output has half the weight's rows)."""
    return epilogue in GATED


def output_rows(n: int, epilogue: str | None) -> int:
    """Outputs of a weight of N rows under the epilogue: N, or N/2 for a gated one."""
    return n // 2 if is_gated(epilogue) else n


def code(family: str, epilogue: str, allowed: tuple[str, ...] = GEMM_EPILOGUES) -> int:
    """The EPILOGUE define of ``epilogue``; a PerfxError naming the choices where the family lacks it."""
    if epilogue not in allowed:
        raise PerfxError(f"{family}: unknown epilogue {epilogue!r}; choose one of {', '.join(allowed)}")
    return EPILOGUES[epilogue]


def check_gate_up(family: str, epilogue: str, n: int):
    """A gated epilogue needs gate and up rows of equal count: a PerfxError for an odd N."""
    if is_gated(epilogue) and n % 2:
        raise PerfxError(f"{family}: {epilogue} needs gate and up rows of equal count, a gate-up weight of "
                         f"2·I rows, got N = {n} (odd)")


def gate_up_epilogue(activation: str) -> str:
    """The gate-up epilogue of an MLP activation ("silu", "gelu_tanh"); a PerfxError for one perfx has not."""
    if activation not in GATE_UP_EPILOGUES:
        raise PerfxError(f"FFN activation {activation!r} has no fused gate-up epilogue; known: "
                         f"{', '.join(GATE_UP_EPILOGUES)}")
    return GATE_UP_EPILOGUES[activation]
