"""The decode-path int4 GEMV: y = W·x (+ bias), plain, fused (QKV) or gate-up with SiLU·mul or GELU·mul.

Wraps ``kernels/gemv_q4.cl``; its parameters are ``PARAMS``. Two kernel shapes share the file, one per
weight layout (``LAYOUT``, a property of the uploaded ``Q4DeviceWeight``): lanes along K meeting in a
reduction (rows contiguous along K, the CPU/PoCL winner), and the GPU-class shape of llama.cpp's Adreno
GEMV (rows interleaved, work-items own neighbouring rows, coalesced loads, x shared across the work-group).
Each GPU-class variant (subgroup reductions, fp16 arithmetic, x through local memory or subgroup
broadcast, int8 activations, a required subgroup size, image1d_buffer views) is a parameter behind a
capability check.
The kernel guards its row and K edges itself; the wrapper's only planning is splitting launches where the
weight's rows span several image2d row blocks.
"""

from __future__ import annotations

import numpy as np
import pyopencl as cl

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.epilogue import GEMV_EPILOGUES, check_gate_up, code, is_gated, output_rows
from perfx.ops.params import (FP16_NEED, READ_BUFFER, READ_IMAGE1D, READ_IMAGE2D, READ_NAMES, READ_NEED,
                              SUBGROUP_SIZE_NEED, SUBGROUPS_NEED, Need, ParamSpace, Rule)
from perfx.ops.q4_weight import LAYOUT_INTERLEAVED, LAYOUT_NAMES, LAYOUT_ROWS, Q4DeviceWeight
from perfx.runtime import Device

WGN = 64  # rows per LAYOUT 1 work-group (kernels/gemv_q4.cl)
BROADCAST_NEED = Need("x shared by sub_group_broadcast (XS 2) needs subgroups",
                      lambda caps, value: value != 2 or caps.subgroups)


def _accumulator_rows(params, shape) -> int:
    """Rows of partial sums a work-item holds: ROWS, twice that for gate-up (gate and up rows)."""
    return params["ROWS"] * (2 if is_gated(shape.get("epilogue")) else 1)


def _gpu_class(p) -> bool:
    return p["LAYOUT"] == LAYOUT_INTERLEAVED or p["SG"] == 1


def _work_group_size(p, s) -> int:
    return WGN * p["LANES"] if p["LAYOUT"] == LAYOUT_INTERLEAVED else p["LANES"]


def _local_memory(p, s) -> int:
    """Mirrors the kernel's __local arrays: lane partial sums, and x staged once (XS 1: K floats or halfs)."""
    rows = _accumulator_rows(p, s)
    if p["LAYOUT"] == LAYOUT_INTERLEAVED:
        k = s.get("k", 0)
        # XS 1 stages x: K floats, K halfs (HALF), or K int8 and two floats per 32 (I8)
        x = (k + k // 4 if p["I8"] else (2 if p["HALF"] else 4) * k) if p["XS"] == 1 else 0
        return 4 * (p["LANES"] - 1) * rows * WGN + x
    return 4 * p["LANES"] * rows if p["LANES"] > 1 else 0


PARAMS = ParamSpace(
    family="gemv_q4",
    source="gemv_q4.cl",
    space={
        "LAYOUT": (0, 1),          # codes rows along K (0) or interleaved across rows (1): set at upload
        "LANES": (16, 1, 4, 64),   # layout 0: work-items along K per work-group; layout 1: slices of K
        "ROWS": (4, 1, 2, 8),      # outputs per work-item (pairs for the gate-up epilogues)
        "READ": (0, 1, 2),         # codes from a uint4 buffer (0), image2d row blocks (1), image1d_buffer view (2)
        "XS": (0, 1, 2),           # layout 1: x from global memory (0), local memory (1), subgroup broadcast (2)
        "SG": (0, 1),              # layout 0: lanes reduced by a local-memory tree (0) or sub_group_reduce_add (1)
        "HALF": (0, 1),            # fp16 dequantize-and-multiply within a group, fp32 across groups
        "I8": (0, 1),              # layout 1, XS 1: x quantized to int8 per 32 in local memory, int16 products
        "SUBGROUP": (0, 8, 16, 64),  # required subgroup size (0: the driver's; 64 = Adreno's half wave)
    },
    rules=(
        Rule("gate-up holds gate and up rows: at most 8 rows of accumulators per work-item (ROWS ≤ 4)",
             lambda p, s: _accumulator_rows(p, s) <= 8),
        Rule("the interleaved layout has no image2d row blocks: READ 0 or 2",
             lambda p, s: p["LAYOUT"] == LAYOUT_ROWS or p["READ"] != READ_IMAGE2D),
        Rule("with rows along K each lane reads its own x chunk (XS 0); only the interleaved layout shares x",
             lambda p, s: p["LAYOUT"] == LAYOUT_INTERLEAVED or p["XS"] == 0),
        Rule("the interleaved layout splits K into at most 4 slices of a 64-row work-group (≤ 256 "
             "work-items), which meet in local memory, not a subgroup (SG 0)",
             lambda p, s: p["LAYOUT"] == LAYOUT_ROWS or (p["LANES"] in (1, 4) and p["SG"] == 0)),
        Rule("a subgroup reduction (SG 1) reduces whole subgroups of lanes along K: LANES ≥ 16",
             lambda p, s: p["SG"] == 0 or p["LANES"] >= 16),
        Rule("int8 activations (I8 1) are quantized once per work-group into local memory: the interleaved "
             "layout with XS 1, not fp16 (HALF 0)",
             lambda p, s: p["I8"] == 0 or (p["LAYOUT"] == LAYOUT_INTERLEAVED and p["XS"] == 1 and p["HALF"] == 0)),
        Rule("fp16 arithmetic is a GPU-class variant: with a subgroup reduction or the interleaved layout",
             lambda p, s: p["HALF"] == 0 or _gpu_class(p)),
        Rule("GPU-class variants hold 2 or 4 rows a work-item: x, loaded or shared, serves at least two rows, "
             "and 8 rows of texels, accumulators and fp16 sums exceed a GPU's registers at full occupancy",
             lambda p, s: not _gpu_class(p) or p["ROWS"] in (2, 4)),
        Rule("the buffer and its views: GPU-class variants read the buffer or its image1d_buffer view (READ 0 "
             "or 2), the portable kernel the buffer or image2d row blocks (READ 0 or 1, a copy where the device "
             "cannot view a buffer)",
             lambda p, s: p["READ"] != (READ_IMAGE2D if _gpu_class(p) else READ_IMAGE1D)),
        Rule("a required subgroup size goes with the subgroup operations it shapes: SUBGROUP = LANES for a "
             "one-subgroup reduction (SG 1), ≥ 8 for x broadcast by lanes 0..7 (XS 2, required there), "
             "else 0",
             lambda p, s: (p["SUBGROUP"] in (0, p["LANES"]) if p["SG"] == 1 else
                           p["SUBGROUP"] >= 8 if p["XS"] == 2 else p["SUBGROUP"] == 0)),
    ),
    work_group_size=_work_group_size,
    local_memory=_local_memory,
    needs={"READ": READ_NEED, "HALF": FP16_NEED, "SG": SUBGROUPS_NEED, "XS": BROADCAST_NEED,
           "SUBGROUP": SUBGROUP_SIZE_NEED},
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
    """y (M) = W (N, K)·x (K) (+ bias) on a ``Q4DeviceWeight``; M = N, or N/2 for a gate-up epilogue
    (``silu_mul``, ``gelu_mul``: perfx.ops.epilogue)."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        """``params`` (None: the defaults) must fit ``shape`` (its ``epilogue`` key matters) on this device."""
        self.device = device
        self.params = PARAMS.resolve(params, shape or {}, device.caps)
        self.lanes, self.rows, self.read = self.params["LANES"], self.params["ROWS"], self.params["READ"]
        self.layout = self.params["LAYOUT"]
        self._no_bias = device.alloc(4, what="gemv_q4 bias placeholder")
        self._kernels: dict[tuple[int, str], cl.Kernel] = {}

    def kernel(self, group: int, epilogue: str) -> cl.Kernel:
        """The built kernel for a group size and epilogue (built once, then cached by the device)."""
        kernel = self._kernels.get((group, epilogue))
        if kernel is None:
            defines = {**self.params, "GROUP": group, "EPILOGUE": code("gemv_q4", epilogue, GEMV_EPILOGUES)}
            kernel = self._kernels[group, epilogue] = self.device.kernel("gemv_q4.cl", "gemv_q4", defines)
        return kernel

    def _local_x(self, k: int):
        """The kernel's __local x argument: K floats (halfs with HALF) for XS 1, else a placeholder."""
        if self.layout == LAYOUT_INTERLEAVED and self.params["XS"] == 1:
            return cl.LocalMemory(_local_memory(self.params, {"k": k}) - _local_memory(self.params, {}))
        return cl.LocalMemory(4)

    def events(self, weight: Q4DeviceWeight, x, y, epilogue: str = "none") -> list[cl.Event]:
        """Enqueue y = W·x and return every launch's event (more than one where rows span several images)."""
        code("gemv_q4", epilogue, GEMV_EPILOGUES)
        n, k = weight.n, weight.k
        check_gate_up("gemv_q4", epilogue, n)
        if weight.layout != self.layout:
            raise PerfxError(f"gemv_q4: parameters for the {LAYOUT_NAMES[self.layout]} layout (LAYOUT="
                             f"{self.layout}) on a weight uploaded {LAYOUT_NAMES[weight.layout]} (layout "
                             f"{weight.layout}); upload it with layout={self.layout}")
        m = output_rows(n, epilogue)
        shape = {"epilogue": epilogue, "k": k}
        why = PARAMS.why_invalid(self.params, shape, self.device.caps)
        if why is not None:
            raise PerfxError(f"gemv_q4: parameters {self.params} cannot run the {epilogue} epilogue here: {why}")
        xb = device_buffer(x, 4 * k, "gemv_q4 x")
        yb = device_buffer(y, 4 * m, "gemv_q4 y")
        kernel = self.kernel(weight.group, epilogue)
        bias = weight.bias if weight.bias is not None else self._no_bias
        has_bias = np.int32(weight.bias is not None)
        half = np.int32(m if is_gated(epilogue) else 0)
        codes = {READ_BUFFER: weight.buffer, READ_IMAGE1D: weight.image1d}.get(self.read)
        if self.read == READ_IMAGE2D:
            if not weight.images:
                raise PerfxError("gemv_q4: the weight was uploaded without the 'image2d' read path that "
                                 "READ=1 needs; upload it with read_paths including 'image2d'")
            plan = self._image_plan(weight, m, epilogue)
        elif codes is None:
            path = READ_NAMES[self.read]
            raise PerfxError(f"gemv_q4: the weight was uploaded without the '{path}' read path that "
                             f"READ={self.read} needs; upload it with read_paths including '{path}'")
        else:
            plan = [(0, m, codes, 0, codes, int(half))]
        local_x = self._local_x(k)
        events = []
        for out_base, count, wa, row_a, wb, row_b in plan:
            if self.layout == LAYOUT_INTERLEAVED:
                blocks = -(-count // (WGN * self.rows))
                global_size, local_size = (WGN * blocks, self.lanes), (WGN, self.lanes)
            else:
                blocks = -(-count // self.rows)
                global_size, local_size = (self.lanes, blocks), (self.lanes, 1)
            events.append(self.device.launch(
                kernel, global_size, local_size,
                np.int32(count), np.int32(k), np.int32(out_base), half, np.int32(row_a), np.int32(row_b),
                np.int32(n), wa, wb, weight.scale_offset, bias, has_bias, xb, yb, local_x))
        return events

    def __call__(self, weight: Q4DeviceWeight, x, y, epilogue: str = "none") -> cl.Event:
        """Enqueue y = W·x (+ bias), or act(gate)·up for a gate-up epilogue; returns the last launch's event.

        The queue is in order, so waiting on the returned event waits for the whole product.
        """
        return self.events(weight, x, y, epilogue)[-1]

    @staticmethod
    def _image_plan(weight: Q4DeviceWeight, m: int, epilogue: str):
        """Launches so that no work-item's gate rows, nor its up rows, straddle two images."""
        images, rows = weight.images, weight.image_rows
        plan = []
        for offset, count, i, row_a in _segments(rows, 0, m):
            if not is_gated(epilogue):
                plan.append((offset, count, images[i], row_a, images[i], 0))
                continue
            for sub, sub_count, j, row_b in _segments(rows, m + offset, count):
                plan.append((offset + sub, sub_count, images[i], row_a + sub, images[j], row_b))
        return plan
