"""The kernel wrappers, one module per family, each with its parameter space (``PARAMS``), and what they
share: taking device buffers from their callers."""

from __future__ import annotations

import pyopencl as cl
import pyopencl.array as cla

from perfx.errors import PerfxError


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
