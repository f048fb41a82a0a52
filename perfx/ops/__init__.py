"""The kernel wrappers, one module per family, each with its parameter space (``PARAMS``), and what they
share: taking device buffers from their callers, and a position read on the device."""

from __future__ import annotations

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

from perfx.errors import PerfxError


# The orders a producer of Q8_1 blocks (an rmsnorm, the decode attention) writes their codes in
# (kernels/q8_1.h): the int4 GEMV's rows layout reads a texel's order (even codes, then odd), the int8 GEMV x's own.
Q8_TEXEL, Q8_NATURAL = 1, 2


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


class DevicePosition:
    """Where a kernel that reads its position on the device (decode attention, the short convolution) finds
    it: the caller's (int32 buffer, index) — the decode plan's step buffer, so one recorded launch serves every
    position — or else this wrapper's own buffer, written in queue order when the position changes."""

    def __init__(self, device, what: str):
        self.device = device
        self.buffer = device.alloc(4, what=f"{what} position")
        self._value, self._write = None, None

    def __call__(self, pos: int, position=None) -> tuple:
        """(the cl.Buffer, the index) the kernel reads ``pos`` from."""
        if position is not None:
            buffer, index = position
            return getattr(buffer, "data", buffer), index
        if self._value != pos:
            # A fresh host array each time, held by the copy's event until it has run; keeping the event keeps
            # the write non-blocking (pyopencl waits when such an event is dropped).
            self._write = self.device.write(self.buffer, np.array([pos], np.int32), wait=False)
            self._value = pos
        return self.buffer, 0
