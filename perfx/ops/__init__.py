"""The kernel wrappers, one module per family, and what they share: resolving tuning parameters and
taking device buffers from their callers."""

from __future__ import annotations

import pyopencl as cl
import pyopencl.array as cla

from perfx.errors import PerfxError
from perfx.tuning.spec import Spec


def resolve_params(spec: Spec, params: dict | None, caps) -> dict:
    """The spec's defaults overridden by ``params``; a PerfxError when the set may not run on this device."""
    resolved = {**spec.defaults(), **(params or {})}
    outside = {name: value for name, value in resolved.items() if value not in spec.space.get(name, (value,))}
    reason = f"values outside the tuning space {outside}" if outside else spec.why_invalid(resolved, {}, caps)
    if reason is not None:
        raise PerfxError(f"{spec.family}: parameters {resolved} cannot run on {caps.name}: {reason}")
    return resolved


def buffer_bytes(array, what: str) -> tuple[cl.Buffer, int]:
    """(the cl.Buffer behind ``array``, the bytes ``array`` holds), for a cl.Buffer or a whole pyopencl Array.

    ``what`` names the argument in the error ("gemv_q4 x"). Kernels read from the buffer's start, so an
    Array view at an offset is refused rather than silently read from its base.
    """
    if isinstance(array, cla.Array):
        if array.offset:
            raise PerfxError(f"{what}: an Array view at an offset is not supported; pass a whole buffer")
        return array.base_data, array.nbytes
    if isinstance(array, cl.Buffer):
        return array, array.size
    raise PerfxError(f"{what} must be a cl.Buffer or a pyopencl Array, not {type(array).__name__}")


def device_buffer(array, nbytes: int, what: str) -> cl.Buffer:
    """The cl.Buffer behind ``array`` (see ``buffer_bytes``), checked to hold at least ``nbytes``."""
    buffer, size = buffer_bytes(array, what)
    if size < nbytes:
        raise PerfxError(f"{what} holds {size} bytes where {nbytes} are needed")
    return buffer
