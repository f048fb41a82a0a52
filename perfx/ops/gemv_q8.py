"""The decode-path int8 GEMV: y = W·x (+ bias), plain, fused (QKV) or gate-up with SiLU·mul or GELU·mul; also
the lm_head.

Wraps ``kernels/gemv_q8.cl``; its parameters are ``PARAMS`` (LANES, ROWS: the names and meaning of
gemv_q4's, so variants added to one family carry over; I8, int8 activations: x quantized per group by
one small launch before the product, into buffers the wrapper keeps per (K, G), read by every work-group; or,
on groups of 32, the same bytes written by the norm that made x, ``RMSNorm``'s blocks in ``Q8_NATURAL`` order,
and no launch of its own).
The kernel guards its row and K edges itself, so every parameter set fits every shape; the wrapper's only
planning is cutting launches where the weight's rows span several row blocks (a large vocabulary on a
phone's allocation limit).
"""

from __future__ import annotations

import numpy as np
import pyopencl as cl

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.epilogue import GEMV_EPILOGUES, check_gate_up, code, is_gated, output_rows
from perfx.ops.params import INTEGER_DOT_NEED, ParamSpace, Rule
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.runtime import Device


def _accumulator_rows(params, shape) -> int:
    """Rows of partial sums a work-item holds: ROWS, twice that for gate-up (gate and up rows)."""
    return params["ROWS"] * (2 if is_gated(shape.get("epilogue")) else 1)


PARAMS = ParamSpace(
    family="gemv_q8",
    source="gemv_q8.cl",
    space={
        "LANES": (16, 1, 4, 64),   # work-items along K per work-group
        "ROWS": (4, 1, 2, 8),      # outputs per work-item (pairs for the gate-up epilogues)
        "WGR": (1, 16, 64),        # work-items along the rows per work-group (ROWS neighbouring rows each)
        "I8": (0, 1, 2),           # x quantized to int8 per group once per product, integer products in int16
                                   # pairs (1) or byte dot products (2, cl_khr_integer_dot_product)
    },
    rules=(Rule("gate-up holds gate and up rows: at most 8 rows of accumulators per work-item (ROWS ≤ 4)",
                lambda p, s: _accumulator_rows(p, s) <= 8),
           # As gemv_q4's rows kernel: two float8 a row, and Intel's CPU compiler wrong at 64 × 8.
           Rule("64 lanes along K hold at most 4 rows of accumulators (ROWS ≤ 4, gate-up ≤ 2)",
                lambda p, s: p["LANES"] < 64 or _accumulator_rows(p, s) <= 4),
           Rule("a work-group holds at most 64 work-items (LANES × WGR ≤ 64), as gemv_q4's rows kernel",
                lambda p, s: p["LANES"] * p["WGR"] <= 64)),
    work_group_size=lambda p, s: p["LANES"] * p["WGR"],
    local_memory=lambda p, s: 4 * p["LANES"] * p["WGR"] * _accumulator_rows(p, s) if p["LANES"] > 1 else 0,
    needs={"I8": INTEGER_DOT_NEED},
)


def _or(buffer, placeholder):
    return placeholder if buffer is None else buffer


class GemvQ8:
    """y (M) = W (N, K)·x (K) (+ bias) on a ``Q8DeviceWeight``; M = N, or N/2 for a gate-up epilogue
    (``silu_mul``, ``gelu_mul``: perfx.ops.epilogue)."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        """``params`` (None: the defaults) must fit ``shape`` (its ``epilogue`` key matters) on this device."""
        self.device = device
        self.params = PARAMS.resolve(params, shape or {}, device.caps)
        self.lanes, self.rows, self.sets = self.params["LANES"], self.params["ROWS"], self.params["WGR"]
        self._no_bias = device.alloc(4, what="gemv_q8 bias placeholder")
        self._kernels: dict[tuple, cl.Kernel] = {}
        self._quantized: dict[tuple, tuple] = {}   # (K, G) -> (codes, (step, sum) pairs) of the quantized x
        self._quantize_from: dict[int, tuple] = {}   # G -> (defines, newest_c) of a built program of that group

    def kernel(self, group: int, f32: bool, symmetric: bool, epilogue: str) -> cl.Kernel:
        """The built kernel for a group size, pair precision and epilogue (built once, then cached); the
        parameters are checked for the epilogue here where they were not checked for it already."""
        key = (group, f32, symmetric, epilogue)
        kernel = self._kernels.get(key)
        if kernel is None:
            PARAMS.check(self.params, {"epilogue": epilogue}, self.device.caps, f"the {epilogue} epilogue")
            defines = {**self.params, "GROUP": group, "SM_F32": int(f32), "SYM": int(symmetric),
                       "EPILOGUE": code("gemv_q8", epilogue, GEMV_EPILOGUES)}
            kernel = self._kernels[key] = self.device.kernel(PARAMS.source, "gemv_q8", defines,
                                                             newest_c=self.params["I8"] == 2)
            self._quantize_from.setdefault(group, (defines, self.params["I8"] == 2))
        return kernel

    def quantize(self, x, k: int, group: int) -> tuple[list[cl.Event], tuple]:
        """With I8: enqueue x (K floats) quantized per group of ``group`` into this wrapper's buffers for
        (K, G); returns the launch's events and the buffers (int8 codes, float2 step and sum per group)."""
        buffers = self._quantized.get((k, group))
        if buffers is None:
            buffers = self._quantized[(k, group)] = (
                self.device.alloc(k, what="gemv_q8 quantized x"),
                self.device.alloc(8 * (k // group), what="gemv_q8 quantized x's steps and sums"))
        event = self.device.launch(self.quantize_kernel(group), (k // group,), None, np.int32(k), x, *buffers)
        return [event], buffers

    def quantize_kernel(self, group: int) -> cl.Kernel:
        """The launch ``quantize`` enqueues for groups of ``group``: from the program of a product of that group this
        wrapper built already, where there is one (the quantizing reads no other parameter, and a program less is
        a compile less at a cold load), else from a program of its own; or the one the device made already for
        another wrapper or set (the same code: ``Device.kernel``'s ``reads``)."""
        defines, newest_c = self._quantize_from.get(group, ({"GROUP": group}, False))
        return self.device.kernel(PARAMS.source, "gemv_q8_quantize_x", defines, newest_c, reads=("GROUP",))

    def reads_blocks(self, weight: Q8DeviceWeight) -> bool:
        """Whether the product of ``weight`` can read x as Q8_1 blocks of 32 in x's own order (``Q8_NATURAL``)
        that a caller holds already (``RMSNorm``'s ``quantized``): with int8 activations, on groups of 32."""
        return bool(self.params["I8"]) and weight.group == 32

    def events(self, weight: Q8DeviceWeight, x, y, epilogue: str = "none", quantized=None) -> list[cl.Event]:
        """Enqueue y = W·x and return every launch's event (more than one where rows span several blocks).
        ``quantized``: x's Q8_1 blocks (codes in x's order, steps and sums) where ``reads_blocks``; the product's
        own quantizing launch is then skipped."""
        code("gemv_q8", epilogue, GEMV_EPILOGUES)
        n, k = weight.n, weight.k
        check_gate_up("gemv_q8", epilogue, n)
        m = output_rows(n, epilogue)
        xb = device_buffer(x, 4 * k, "gemv_q8 x")
        yb = device_buffer(y, 4 * m, "gemv_q8 y")
        kernel = self.kernel(weight.group, weight.f32, weight.symmetric, epilogue)
        has_bias = np.int32(weight.has_bias)
        events = []
        if quantized is not None:
            if not self.reads_blocks(weight):
                raise PerfxError(f"gemv_q8: x's Q8_1 blocks of 32 are read with int8 activations (I8) on groups of "
                                 f"32; these parameters have I8 = {self.params['I8']}, the weight groups of "
                                 f"{weight.group}")
            quantized = (device_buffer(quantized[0], k, "gemv_q8 quantized x"),
                         device_buffer(quantized[1], 8 * (k // 32), "gemv_q8 quantized x's steps and sums"))
        elif self.params["I8"]:
            events, quantized = self.quantize(xb, k, weight.group)
        else:
            quantized = ()
        for first, count, a, row_a, b, row_b in weight.segments(m, m if is_gated(epilogue) else None):
            block_a, block_b = weight.blocks[a], weight.blocks[b]
            events.append(self.device.launch(
                kernel, (self.lanes * self.sets * -(-count // (self.rows * self.sets)),), (self.lanes * self.sets,),
                np.int32(count), np.int32(k), np.int32(first), np.int32(row_a), np.int32(row_b),
                block_a.codes, block_b.codes, block_a.scales, block_b.scales,
                _or(block_a.bias, self._no_bias), _or(block_b.bias, self._no_bias), has_bias, xb, yb,
                *quantized))
        return events

    def __call__(self, weight: Q8DeviceWeight, x, y, epilogue: str = "none", quantized=None) -> cl.Event:
        """Enqueue y = W·x (+ bias), or act(gate)·up for a gate-up epilogue; returns the last launch's event.

        The queue is in order, so waiting on the returned event waits for the whole product.
        """
        return self.events(weight, x, y, epilogue, quantized)[-1]
