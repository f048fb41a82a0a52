"""The decode-path int4 GEMV: y = W·x (+ bias), plain, fused (QKV) or gate-up with SiLU·mul.

Wraps ``kernels/gemv_q4.cl``; its parameters are ``PARAMS`` (LANES, ROWS, READ). The kernel guards its
row and K edges itself, so every parameter set fits every shape; the wrapper's only planning is
splitting launches where the weight's rows span several images.
"""

from __future__ import annotations

import numpy as np
import pyopencl as cl

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.params import READ_BUFFER, READ_NEED, ParamSpace, Rule
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.runtime import Device

EPILOGUES = {"none": 0, "silu_mul": 1}


def _accumulator_rows(params, shape) -> int:
    """Rows of partial sums a work-item holds: ROWS, twice that for gate-up (gate and up rows)."""
    return params["ROWS"] * (2 if shape.get("epilogue") == "silu_mul" else 1)


PARAMS = ParamSpace(
    family="gemv_q4",
    source="gemv_q4.cl",
    space={
        "LANES": (16, 1, 4, 64),   # work-items along K per work-group
        "ROWS": (4, 1, 2, 8),      # outputs per work-item (pairs for silu_mul)
        "READ": (0, 1),            # codes from a uint4 buffer (0) or image2d row blocks (1)
    },
    rules=(Rule("silu_mul holds gate and up rows: at most 8 rows of accumulators per work-item (ROWS ≤ 4)",
                lambda p, s: _accumulator_rows(p, s) <= 8),),
    work_group_size=lambda p, s: p["LANES"],
    local_memory=lambda p, s: 4 * p["LANES"] * _accumulator_rows(p, s) if p["LANES"] > 1 else 0,
    needs={"READ": READ_NEED},
)


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

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        """``params`` (None: the defaults) must fit ``shape`` (its ``epilogue`` key matters) on this device."""
        self.device = device
        self.params = PARAMS.resolve(params, shape or {}, device.caps)
        self.lanes, self.rows, self.read = self.params["LANES"], self.params["ROWS"], self.params["READ"]
        self._no_bias = device.alloc(4, what="gemv_q4 bias placeholder")
        self._kernels: dict[tuple[int, str], cl.Kernel] = {}

    def kernel(self, group: int, epilogue: str) -> cl.Kernel:
        """The built kernel for a group size and epilogue (built once, then cached by the device)."""
        kernel = self._kernels.get((group, epilogue))
        if kernel is None:
            defines = {**self.params, "GROUP": group, "EPILOGUE": EPILOGUES[epilogue]}
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
        why = PARAMS.why_invalid(self.params, {"epilogue": epilogue})
        if why is not None:
            raise PerfxError(f"gemv_q4: parameters {self.params} cannot run the {epilogue} epilogue: {why}")
        xb = device_buffer(x, 4 * k, "gemv_q4 x")
        yb = device_buffer(y, 4 * m, "gemv_q4 y")
        kernel = self.kernel(weight.group, epilogue)
        bias = weight.bias if weight.bias is not None else self._no_bias
        has_bias = np.int32(weight.bias is not None)
        half = np.int32(m if epilogue == "silu_mul" else 0)
        if self.read == READ_BUFFER:
            if weight.buffer is None:
                raise PerfxError("gemv_q4: the weight was uploaded without the 'buffer' read path that "
                                 "READ=0 needs; upload it with read_paths including 'buffer'")
            plan = [(0, m, weight.buffer, 0, weight.buffer, int(half))]
        else:
            if not weight.images:
                raise PerfxError("gemv_q4: the weight was uploaded without the 'image2d' read path that "
                                 "READ=1 needs; upload it with read_paths including 'image2d'")
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
