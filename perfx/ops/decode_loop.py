"""The decode loop's hand-over on the device (``kernels/decode_loop.cl``): the chosen token and the next
position written where the next decode step reads them, and the token kept for the host to read a step behind.
No parameters to tune: one work-item a step."""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.runtime import Device


class NextStep:
    """step = [chosen token, step's position + 1]; tokens[(position + 1) mod capacity] = the chosen token."""

    def __init__(self, device: Device):
        self.device = device
        self.kernel = device.kernel("decode_loop.cl", "next_step")

    def __call__(self, chosen, step, tokens, capacity: int):
        if capacity < 1:
            raise PerfxError(f"next_step: capacity {capacity} must be at least 1")
        return self.device.launch(self.kernel, (1,), (1,), device_buffer(chosen, 4, "next_step chosen"),
                                  device_buffer(step, 8, "next_step step"),
                                  device_buffer(tokens, 4 * capacity, "next_step tokens"), np.int32(capacity))
