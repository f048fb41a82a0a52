"""The prefill-path int8 GEMM: Y (M, N) = X (M, K) · Wᵀ with a fused epilogue, for M tokens.

Two kernels of one contract, each its own tuning family: ``gemm_q8`` (``kernels/gemm_q8.cl``, gemm_q4_skinny's
structure and parameter names WGS, ROWS, MT: each weight read once per pass of MT rows, every row's sums in
float8 registers, no local memory) and ``gemm_q8_lanes`` (``kernels/gemm_q8_lanes.cl``, gemm_q4_lanes's: one
output column a SIMD lane, scalar accumulators, for compilers that vectorize across work-items). The model
runs whichever was measured faster at a bucket's shape. A third, ``gemm_q8_i8`` (``kernels/gemm_q8_i8.cl``), is for
the few rows of a batched decode step (M ≤ 16): X rounded to int8 per group once a call, integer products, each
weight group widened once for all the rows of a pass, its products in gemm_q4_i8's forms (int16 pairs, PAIR,
DOT). It also runs the lm_head over many positions
(perplexity). Epilogues (perfx.ops.epilogue): "none"; "bias" (+ the weight's
bias per output column, e.g. Qwen's QKV); "silu_mul" and "gelu_mul" (gate-up: W has 2·I rows, gate then up,
Y (M, I) = act(X·Wgᵀ)·(X·Wuᵀ)).
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import buffer_bytes
from perfx.ops.epilogue import check_gate_up, code, is_gated, output_rows
from perfx.ops.params import BYTE_DOT_NEED, ParamSpace, Rule
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.runtime import Device

PARAMS = ParamSpace(
    family="gemm_q8",
    source="gemm_q8.cl",
    space={
        "WGS": (64, 1),          # work-items per work-group (independent: no local memory, no barriers)
        "ROWS": (1, 2, 4),       # output columns per work-item (1 by default: 8 accumulators for gate-up too)
        "MT": (4, 2, 8),         # rows of X per register pass
    },
    # ROWS·MT float8 accumulators per weight row applied (two, gate and up, for the gate-up epilogue) plus
    # ROWS weight vectors and the x chunk must stay in registers: gemm_q4_skinny's rule, for the same reason.
    rules=(Rule("at most 8 float8 accumulators per work-item (ROWS·MT, times 2 for the gate-up epilogue)",
                lambda p, s: p["ROWS"] * p["MT"] * (2 if is_gated(s.get("epilogue")) else 1) <= 8),),
    work_group_size=lambda p, s: p["WGS"],
)

LANES = ParamSpace(
    family="gemm_q8_lanes",
    source="gemm_q8_lanes.cl",
    space={
        "WGS": (64, 32, 16),     # work-items per work-group (independent: no local memory, no barriers)
        "ROWS": (1, 2),          # output columns per work-item, a global size apart
        "MB": (12, 6, 4, 8, 16), # rows of X per pass
    },
    # MB·ROWS scalar accumulators per weight row a sweep applies, a vector register each once the lanes hold
    # work-items, beside the weights and the broadcast x: 16 is the share of a CPU with 32 vector registers
    # (one with 16 spills past 12, which the tuner measures). A gate-up pass sweeps gate rows, then up rows, so its gate
    # accumulators wait outside the inner loop.
    rules=(Rule("at most 16 accumulators per sweep over K (MB·ROWS)", lambda p, s: p["MB"] * p["ROWS"] <= 16),),
    work_group_size=lambda p, s: p["WGS"],
)

I8 = ParamSpace(
    family="gemm_q8_i8",
    source="gemm_q8_i8.cl",
    space={
        "WGS": (16, 1, 32, 64),  # work-items per work-group (independent: no local memory, no barriers)
        "ROWS": (1, 2, 4),       # output columns per work-item: each group of X applied to ROWS weight rows
        "MT": (4, 2, 8),         # rows of X per pass
        "DOT": (0, 1),           # products as int16 pairs (0) or byte dot products (1, cl_khr_integer_dot_product)
        "PAIR": (0, 1),          # 1: two rows of X share a 16-lane conversion and multiply-add (DOT 0)
    },
    # ROWS·MT float8 accumulators per weight row applied (two for the gate-up epilogue), beside the widened codes
    # of a group of each row: gemm_q4_i8's rules, for the same reasons.
    rules=(Rule("at most 16 float8 accumulators per work-item (ROWS·MT, times 2 for the gate-up epilogue)",
                lambda p, s: p["ROWS"] * p["MT"] * (2 if is_gated(s.get("epilogue")) else 1) <= 16),
           Rule("rows of X are paired (PAIR 1) in the int lanes of the 16-bit products: DOT 0",
                lambda p, s: not (p["PAIR"] and p["DOT"]))),
    work_group_size=lambda p, s: p["WGS"],
    needs={"DOT": BYTE_DOT_NEED},
)

KINDS = {"skinny": PARAMS, "lanes": LANES, "i8": I8}
FAMILIES = tuple(space.family for space in KINDS.values())   # each kind's tuning family


class GemmQ8:
    """Y = X · Wᵀ (+ epilogue) for an int8 ``Q8DeviceWeight``, by the ``kind`` of kernel ("skinny": gemm_q8,
    "lanes": gemm_q8_lanes, or "i8": gemm_q8_i8)."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None,
                 kind: str = "skinny"):
        """``params`` of that kind's kernel (None: the defaults) must fit ``shape`` on this device."""
        if kind not in KINDS:
            raise PerfxError(f"gemm_q8: unknown kernel {kind!r}; choose one of {', '.join(KINDS)}")
        self.device = device
        self.space = KINDS[kind]
        self.params = self.space.resolve(params, shape or {}, device.caps)
        self._kernels = {}
        self._quantize_from: dict[int, tuple] = {}   # G -> (defines, newest_c) of a built int8 program of that group
        self._no_bias = device.alloc(4, what="gemm_q8 placeholder bias")
        self.kind = kind
        # the int8 kernel's quantized X (codes, then (step, sum) per group), grown to the largest X seen; the
        # smaller ones are kept, since a recorded step's launches still name them
        self._x_q8: list[tuple] = []

    def output_columns(self, weight: Q8DeviceWeight, epilogue: str) -> int:
        """Columns of Y: N, or N/2 for the gate-up epilogue."""
        return output_rows(weight.n, epilogue)

    def kernel(self, group: int, f32: bool, symmetric: bool, epilogue: str):
        key = (group, f32, symmetric, epilogue)
        kernel = self._kernels.get(key)
        if kernel is None:
            # Checked for the epilogue here (once per build) where the parameters were not checked for it.
            self.space.check(self.params, {"epilogue": epilogue}, self.device.caps, f"the {epilogue} epilogue")
            defines = {**self.params, "GROUP": group, "SM_F32": int(f32), "SYM": int(symmetric),
                       "EPILOGUE": code("gemm_q8", epilogue)}
            # cl_khr_integer_dot_product's built-ins are declared only for OpenCL C 2.0 and newer on some compilers
            kernel = self._kernels[key] = self.device.kernel(self.space.source, self.space.family, defines,
                                                             newest_c=bool(self.params.get("DOT")))
            if self.space.source == I8.source:
                self._quantize_from.setdefault(group, (defines, bool(self.params.get("DOT"))))
        return kernel

    def quantize_kernel(self, group: int):
        """The rounding of X to int8 groups that the int8 kernel's calls launch first: from the program of an int8
        product of that group this wrapper built already, where there is one (the rounding reads no other
        parameter, and a program less is a compile less at a cold load), else from a program of its own; or the one
        the device made already for another wrapper or set (the same code: ``Device.kernel``'s ``reads``)."""
        defines, newest_c = self._quantize_from.get(group, ({"GROUP": group}, False))
        return self.device.kernel(I8.source, "gemm_q8_i8_quantize_x", defines, newest_c, reads=("GROUP",))

    def _to_q8(self, xb, count: int, group: int) -> tuple:
        """X's int8 codes and (step, sum) per group (the int8 kernel's input), in scratch kept for the next call."""
        if not self._x_q8 or self._x_q8[-1][0].size < count:
            self._x_q8.append((self.device.alloc(count, what="gemm_q8_i8 activations (int8)"),
                               self.device.alloc(8 * (count // 16), what="gemm_q8_i8 activation steps")))
        codes, steps = self._x_q8[-1]
        groups = count // group
        self.device.launch(self.quantize_kernel(group), (-(-groups // 64) * 64,), (64,), np.int32(count), xb,
                           codes, steps)
        return codes, steps

    def _check(self, weight: Q8DeviceWeight, x, y, m: int, epilogue: str, ldy: int | None):
        code("gemm_q8", epilogue)
        if not isinstance(m, (int, np.integer)) or m < 1:
            raise PerfxError(f"gemm_q8: M must be a positive integer, got {m!r}")
        check_gate_up("gemm_q8", epilogue, weight.n)
        if epilogue == "bias" and not weight.has_bias:
            raise PerfxError("gemm_q8: epilogue 'bias' on a weight uploaded without a bias; pass bias= to "
                             "Q8DeviceWeight.upload or use epilogue 'none'")
        cols = self.output_columns(weight, epilogue)
        ldy = cols if ldy is None else int(ldy)
        if ldy < cols:
            raise PerfxError(f"gemm_q8: row stride ldy = {ldy} is less than the {cols} columns of Y")
        buffers = []
        for name, array, need in (("X", x, m * weight.k * 4), ("Y", y, ((m - 1) * ldy + cols) * 4)):
            buffer, size = buffer_bytes(array, f"gemm_q8 {name}")
            if size < need:
                raise PerfxError(f"gemm_q8: {name} holds {size} bytes, less than the {need} that M = {m}, "
                                 f"K = {weight.k}, N = {cols} need (float32, row-major)")
            buffers.append(buffer)
        return cols, ldy, buffers

    def __call__(self, weight: Q8DeviceWeight, x, y, m: int, epilogue: str = "none", ldy: int | None = None):
        """Y (m, N, or N/2 for a gate-up epilogue) = X (m, K) · Wᵀ with the epilogue; returns the last event.

        ``x`` and ``y`` are float32 cl.Buffers (or pyopencl Arrays), row-major; Y's rows are ``ldy`` floats
        apart (default: its column count). One launch per piece of the weight's row blocks, in order.
        """
        cols, ldy, (xb, yb) = self._check(weight, x, y, m, epilogue, ldy)
        kernel = self.kernel(weight.group, weight.f32, weight.symmetric, epilogue)
        wgs, rows = self.params["WGS"], self.params["ROWS"]
        x_args = (xb,) if self.kind != "i8" else self._to_q8(xb, m * weight.k, weight.group)
        event = None
        for first, count, a, row_a, b, row_b in weight.segments(cols, cols if is_gated(epilogue) else None):
            block_a, block_b = weight.blocks[a], weight.blocks[b]
            bias = block_a.bias if block_a.bias is not None else self._no_bias
            event = self.device.launch(
                kernel, (-(-count // (rows * wgs)) * wgs,), (wgs,),
                np.int32(m), np.int32(count), np.int32(weight.k), np.int32(ldy), np.int32(first),
                np.int32(row_a), np.int32(row_b), *x_args, yb, block_a.codes, block_b.codes,
                block_a.scales, block_b.scales, bias)
        return event
