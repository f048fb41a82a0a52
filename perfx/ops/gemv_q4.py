"""The decode-path int4 GEMV: y = W·x (+ bias), plain, fused (QKV) or gate-up with SiLU·mul.

Wraps ``kernels/gemv_q4.cl``; the parameters (LANES, ROWS, READ) come from ``tuning/gemv_q4.py``.
The kernel guards its row and K edges itself, so every tuned parameter set fits every shape; the
wrapper's only planning is splitting launches where the weight's rows span several images.
"""

from __future__ import annotations

import numpy as np
import pyopencl as cl

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.runtime import Device

EPILOGUES = {"none": 0, "silu_mul": 1}
READ_CODES = {"buffer": 0, "image2d": 1}


def _segments(rows: list[tuple[int, int]], first: int, count: int):
    """Split rows [first, first + count) at image boundaries: (offset, length, image index, row in image)."""
    out, offset = [], 0
    while offset < count:
        row = first + offset
        i = next(i for i, (start, stop) in enumerate(rows) if start <= row < stop)
        length = min(count - offset, rows[i][1] - row)
        out.append((offset, length, i, row - rows[i][0]))
        offset += length
    return out


class GemvQ4:
    """y (M) = W (N, K)·x (K) (+ bias) on a ``Q4DeviceWeight``; M = N, or N/2 for ``silu_mul``."""

    def __init__(self, device: Device, params: dict | None = None):
        from perfx.tuning.gemv_q4 import SPEC
        self.device = device
        self.params = {**SPEC.defaults(), **(params or {})}
        unknown = set(self.params) - set(SPEC.space)
        if unknown:
            raise PerfxError(f"gemv_q4: unknown parameter(s) {sorted(unknown)}; known: {sorted(SPEC.space)}")
        read = self.params["READ"]
        if read not in READ_CODES:
            raise PerfxError(f"gemv_q4: READ={read!r}; expected one of {sorted(READ_CODES)}")
        if read == "image2d" and not device.caps.image_support:
            raise PerfxError(f"gemv_q4: READ='image2d' but {device.caps.name} has no image support; "
                             "use READ='buffer'")
        outside = {k: v for k, v in self.params.items() if k != "READ" and v not in SPEC.space[k]}
        if outside:  # e.g. LANES=3 builds, and gives a wrong answer: the kernel assumes the values of the space
            raise PerfxError(f"gemv_q4: values outside the tuning space {outside}; allowed: "
                             f"{ {k: list(SPEC.space[k]) for k in outside} }")
        self.lanes, self.rows, self.read = int(self.params["LANES"]), int(self.params["ROWS"]), read
        self._no_bias = device.alloc(4, what="gemv_q4 bias placeholder")
        self._kernels: dict[tuple[int, str], cl.Kernel] = {}

    def kernel(self, group: int, epilogue: str) -> cl.Kernel:
        """The built kernel for a group size and epilogue (built once, then cached by the device)."""
        kernel = self._kernels.get((group, epilogue))
        if kernel is None:
            defines = {"LANES": self.lanes, "ROWS": self.rows, "READ": READ_CODES[self.read],
                       "GROUP": group, "EPILOGUE": EPILOGUES[epilogue]}
            kernel = self._kernels[group, epilogue] = self.device.kernel("gemv_q4.cl", "gemv_q4", defines)
        return kernel

    def events(self, weight: Q4DeviceWeight, x, y, epilogue: str = "none") -> list[cl.Event]:
        """Enqueue y = W·x and return every launch's event (more than one where rows span several images)."""
        if epilogue not in EPILOGUES:
            raise PerfxError(f"gemv_q4: epilogue {epilogue!r}; expected one of {sorted(EPILOGUES)}")
        n, k = weight.n, weight.k
        if epilogue == "silu_mul" and n % 2:
            raise PerfxError(f"gemv_q4: silu_mul needs gate and up rows of equal count, but the weight has "
                             f"N = {n} rows (odd)")
        m = n // 2 if epilogue == "silu_mul" else n
        xb = device_buffer(x, 4 * k, "gemv_q4 x")
        yb = device_buffer(y, 4 * m, "gemv_q4 y")
        kernel = self.kernel(weight.group, epilogue)
        bias = weight.bias if weight.bias is not None else self._no_bias
        has_bias = np.int32(weight.bias is not None)
        half = np.int32(m if epilogue == "silu_mul" else 0)
        if self.read == "buffer":
            if weight.buffer is None:
                raise PerfxError("gemv_q4: the weight was uploaded without the 'buffer' read path that "
                                 "READ='buffer' needs; upload it with read_paths including 'buffer'")
            plan = [(0, m, weight.buffer, 0, weight.buffer, int(half))]
        else:
            if not weight.images:
                raise PerfxError("gemv_q4: the weight was uploaded without the 'image2d' read path that "
                                 "READ='image2d' needs; upload it with read_paths including 'image2d'")
            plan = self._image_plan(weight, m, epilogue)
        events = []
        for out_base, count, wa, row_a, wb, row_b in plan:
            blocks = -(-count // self.rows)
            events.append(self.device.launch(
                kernel, (self.lanes, blocks), (self.lanes, 1),
                np.int32(count), np.int32(k), np.int32(out_base), half, np.int32(row_a), np.int32(row_b),
                wa, wb, weight.scale_offset, bias, has_bias, xb, yb))
        return events

    def __call__(self, weight: Q4DeviceWeight, x, y, epilogue: str = "none") -> cl.Event:
        """Enqueue y = W·x (+ bias) (``silu_mul``: y = SiLU(gate)·up); returns the last launch's event.

        The queue is in order, so waiting on the returned event waits for the whole product.
        """
        return self.events(weight, x, y, epilogue)[-1]

    @staticmethod
    def _image_plan(weight: Q4DeviceWeight, m: int, epilogue: str):
        """Launches so that no work-item's gate rows, nor its up rows, straddle two images."""
        images, rows = weight.images, weight.image_rows
        plan = []
        for offset, count, i, row_a in _segments(rows, 0, m):
            if epilogue != "silu_mul":
                plan.append((offset, count, images[i], row_a, images[i], 0))
                continue
            for sub, sub_count, j, row_b in _segments(rows, m + offset, count):
                plan.append((offset + sub, sub_count, images[i], row_a + sub, images[j], row_b))
        return plan
