"""The decode-path int4 GEMV: y = W·x (+ bias), plain, fused (QKV) or gate-up with SiLU·mul or GELU·mul.

One kernel per weight layout (``LAYOUT``, a property of the uploaded ``Q4DeviceWeight``), each in its own
file with its own parameters (``PARAMS``, a ``Variants``): ``kernels/gemv_q4_rows.cl``, lanes along K meeting
in a reduction (rows contiguous along K, the CPU/PoCL winner; ``ROWS_LAYOUT``), and
``kernels/gemv_q4_interleaved.cl``, the GPU-class shape of llama.cpp's Adreno GEMV (rows interleaved,
work-items own neighbouring rows, coalesced loads, x shared across the work-group; ``INTERLEAVED_LAYOUT``).
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
from perfx.formats import Q4_PAIRS, q4_form_defines
from perfx.ops import device_buffer
from perfx.ops.epilogue import GEMV_EPILOGUES, check_gate_up, code, is_gated, output_rows
from perfx.ops.params import (FP16_NEED, READ_BUFFER, READ_IMAGE1D, READ_IMAGE2D, READ_NAMES, READ_NEED,
                              INTEGER_DOT_NEED, SUBGROUP_SIZE_NEED, SUBGROUPS_NEED, Need, ParamSpace, Rule,
                              Variants)
from perfx.ops.q4_weight import LAYOUT_INTERLEAVED, LAYOUT_NAMES, LAYOUT_ROWS, Q4DeviceWeight
from perfx.runtime import Device

WGN = 64  # rows per work-group of the interleaved kernel (kernels/gemv_q4_interleaved.cl)
BROADCAST_NEED = Need("x shared by sub_group_broadcast (XS 2) needs subgroups",
                      lambda caps, value: value != 2 or caps.subgroups)


def _accumulator_rows(params, shape) -> int:
    """Rows of partial sums a work-item holds: ROWS, twice that for gate-up (gate and up rows)."""
    return params["ROWS"] * (2 if is_gated(shape.get("epilogue")) else 1)


def _rows_local_memory(p, s) -> int:
    """kernels/gemv_q4_rows.cl's lane partial sums, per row set."""
    return 4 * p["LANES"] * p["WGR"] * _accumulator_rows(p, s) if p["LANES"] > 1 else 0


def _staged_x_bytes(p, k: int) -> int:
    """XS 1 stages x in local memory: K floats, K halfs (HALF), or K int8 and two floats per 32 (I8); XS 3 K
    floats in the codes' byte order."""
    if p["XS"] == 3:
        return 4 * k
    if p["XS"] != 1:
        return 0
    return k + k // 4 if p["I8"] else (2 if p["HALF"] else 4) * k


def _interleaved_local_memory(p, s) -> int:
    """kernels/gemv_q4_interleaved.cl's slice partial sums and staged x."""
    return 4 * (p["SLICES"] - 1) * _accumulator_rows(p, s) * WGN + _staged_x_bytes(p, s.get("k", 0))


ROWS_LAYOUT = ParamSpace(
    family="gemv_q4",
    source="gemv_q4_rows.cl",
    space={
        "LANES": (16, 1, 4, 64),   # work-items along K per work-group
        "ROWS": (4, 1, 2, 8),      # outputs per work-item (pairs for the gate-up epilogues)
        "WGR": (1, 16, 64),        # work-items along the rows per work-group (ROWS neighbouring rows each)
        "READ": (0, 1, 2),         # codes from a uint4 buffer (0), image2d row blocks (1), image1d_buffer view (2)
        "SG": (0, 1),              # lanes reduced by a local-memory tree (0) or sub_group_reduce_add (1)
        "HALF": (0, 1),            # fp16 dequantize-and-multiply within a group, fp32 across groups
        "I8": (0, 1, 2),           # x quantized to int8 per 32 once per product, integer products in int16
                                   # pairs (1) or byte dot products (2, cl_khr_integer_dot_product)
        "SUBGROUP": (0, 8, 16, 64),  # required subgroup size (0: the driver's; 64 = Adreno's half wave)
    },
    rules=(
        Rule("a work-group holds at most 64 work-items (LANES × WGR ≤ 64): a wave on Adreno, and on a CPU "
             "more rows a work-group than 64 leaves too few work-groups for the cores at decode shapes",
             lambda p, s: p["LANES"] * p["WGR"] <= 64),
        Rule("several row sets a work-group (WGR > 1) reduce their lanes in local memory (SG 0): a subgroup "
             "reduction would mix the rows of neighbouring sets", lambda p, s: p["WGR"] == 1 or p["SG"] == 0),
        Rule("int8 activations (I8 1 or 2) are integer products: not fp16 (HALF 0), lanes met in local memory "
             "(SG 0)",
             lambda p, s: p["I8"] == 0 or (p["HALF"] == 0 and p["SG"] == 0)),
        Rule("gate-up holds gate and up rows: at most 8 rows of accumulators per work-item (ROWS ≤ 4)",
             lambda p, s: _accumulator_rows(p, s) <= 8),
        Rule("a subgroup reduction (SG 1) reduces whole subgroups of lanes along K: LANES ≥ 16",
             lambda p, s: p["SG"] == 0 or p["LANES"] >= 16),
        # Each row holds two float8 (the group's products and the running sums): 64 lanes × 8 rows is more state
        # than registers hold anywhere, and Intel's CPU compiler has computed a wrong y there (right on PoCL and
        # under Oclgrind).
        Rule("64 lanes along K hold at most 4 rows of accumulators (ROWS ≤ 4, gate-up ≤ 2)",
             lambda p, s: p["LANES"] < 64 or _accumulator_rows(p, s) <= 4),
        # The same compiler on a CPU with 512-bit vectors, with a gate-up's 8 rows and lanes met in local
        # memory: a wrong y at 16 lanes (right under Oclgrind, with 256-bit vectors and with the subgroup
        # reduction), and a crash of the compiler itself building 4 lanes × 16 row sets.
        Rule("lanes met in local memory (LANES > 1, SG 0) hold at most 4 rows of gate-up accumulators (ROWS ≤ 2)",
             lambda p, s: not (p["LANES"] > 1 and p["SG"] == 0 and is_gated(s.get("epilogue"))
                               and _accumulator_rows(p, s) > 4)),
        Rule("fp16 arithmetic is a GPU-class variant: with a subgroup reduction (SG 1)",
             lambda p, s: p["HALF"] == 0 or p["SG"] == 1),
        Rule("with a subgroup reduction 2 or 4 rows a work-item: 8 rows of texels, accumulators and fp16 sums "
             "exceed a GPU's registers at full occupancy, and one row leaves x loaded for a single row",
             lambda p, s: p["SG"] == 0 or p["ROWS"] in (2, 4)),
        Rule("the subgroup kernel reads the buffer or its image1d_buffer view (READ 0 or 2), the portable one the "
             "buffer or image2d row blocks (READ 0 or 1, a copy where the device cannot view a buffer)",
             lambda p, s: p["READ"] != (READ_IMAGE2D if p["SG"] else READ_IMAGE1D)),
        Rule("a required subgroup size goes with the subgroup reduction it shapes: SUBGROUP = LANES for a "
             "one-subgroup reduction, 0 (the driver's) for one of several subgroups or without SG",
             lambda p, s: p["SUBGROUP"] in ((0, p["LANES"]) if p["SG"] else (0,))),
    ),
    work_group_size=lambda p, s: p["LANES"] * p["WGR"],
    local_memory=_rows_local_memory,
    needs={"READ": READ_NEED, "HALF": FP16_NEED, "SG": SUBGROUPS_NEED, "SUBGROUP": SUBGROUP_SIZE_NEED,
           "I8": INTEGER_DOT_NEED},
)

INTERLEAVED_LAYOUT = ParamSpace(
    family="gemv_q4",
    source="gemv_q4_interleaved.cl",
    space={
        "SLICES": (1, 4),          # slices of K per 64-row work-group, meeting in local memory
        "ROWS": (4, 2),            # outputs per work-item, 64 rows apart: x serves at least two rows
        "READ": (0, 2),            # codes from a uint4 buffer (0) or its image1d_buffer view (2)
        "XS": (0, 1, 2, 3),        # x from global memory (0), local memory (1), subgroup broadcast (2), local
                                   # memory in the codes' byte order (3)
        "HALF": (0, 1),            # fp16 dequantize-and-multiply within a group, fp32 across groups
        "I8": (0, 1),              # XS 1: x quantized to int8 per 32 in local memory, int16 products
        "SUBGROUP": (0, 8, 16, 64),  # required subgroup size (0: the driver's; 64 = Adreno's half wave)
    },
    rules=(
        Rule("int8 activations (I8 1) are quantized once per work-group into local memory: XS 1, not fp16 "
             "(HALF 0)", lambda p, s: p["I8"] == 0 or (p["XS"] == 1 and p["HALF"] == 0)),
        Rule("x in the codes' byte order (XS 3) is fp32: HALF 0", lambda p, s: p["XS"] != 3 or p["HALF"] == 0),
        Rule("a required subgroup size shapes the broadcast of x by lanes 0..7 (XS 2, ≥ 8 required there); "
             "without it, 0",
             lambda p, s: p["SUBGROUP"] >= 8 if p["XS"] == 2 else p["SUBGROUP"] == 0),
    ),
    work_group_size=lambda p, s: WGN * p["SLICES"],
    local_memory=_interleaved_local_memory,
    needs={"READ": READ_NEED, "HALF": FP16_NEED, "XS": BROADCAST_NEED, "SUBGROUP": SUBGROUP_SIZE_NEED},
)

# LAYOUT is the uploaded weight's (perfx.ops.q4_weight): each layout has its kernel and its parameters.
PARAMS = Variants(family="gemv_q4", key="LAYOUT",
                  variants={LAYOUT_ROWS: ROWS_LAYOUT, LAYOUT_INTERLEAVED: INTERLEAVED_LAYOUT})


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
    (``silu_mul``, ``gelu_mul``: perfx.ops.epilogue). The parameters' LAYOUT picks the kernel, and must be
    the weight's."""

    PARAMS = PARAMS   # the family's parameters (a subclass that builds another file has its own)

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        """``params`` (None: the defaults) must fit ``shape`` (its ``epilogue`` key matters) on this device."""
        self.device = device
        self.params = self.PARAMS.resolve(params, shape or {}, device.caps)
        self.layout, self.rows, self.read = self.params["LAYOUT"], self.params["ROWS"], self.params["READ"]
        self.space = self.PARAMS.variant(self.params)
        self._defines = {k: v for k, v in self.params.items() if k != "LAYOUT"}
        self._no_bias = device.alloc(4, what="gemv_q4 bias placeholder")
        self._kernels: dict[tuple[int, str, int, int], cl.Kernel] = {}
        self._quantized: dict[int, tuple] = {}   # K -> (codes, (step, sum) pairs) of the quantized x
        self._quantize_from: tuple | None = None   # (defines, newest_c) of a built program holding the quantizing

    def kernel(self, group: int, epilogue: str, k: int = 0, form: int = Q4_PAIRS, extra: tuple = ()) -> cl.Kernel:
        """The built kernel for a group size, epilogue and the weight's scales' form (built once, then cached
        by the device), once the parameters are checked against that epilogue and K (the staged x's local
        memory); ``extra``: (define, value) pairs of a subclass's file."""
        kernel = self._kernels.get((group, epilogue, k, form, extra))
        if kernel is None:
            # free where the parameters were checked for this epilogue and K already (the plan's shape)
            self.PARAMS.check(self.params, {"epilogue": epilogue, "k": k}, self.device.caps,
                              f"the {epilogue} epilogue at K = {k}")
            defines = {**self._defines, "GROUP": group, "EPILOGUE": code("gemv_q4", epilogue, GEMV_EPILOGUES),
                       **q4_form_defines(form), **dict(extra)}
            kernel = self.device.kernel(self.space.source, "gemv_q4", defines, newest_c=self.newest_c(defines))
            self._kernels[group, epilogue, k, form, extra] = kernel
            if self.params["I8"] and not extra and self._quantize_from is None:
                self._quantize_from = (defines, self.newest_c(defines))
        return kernel

    def newest_c(self, defines: dict) -> bool:
        """Whether the build of ``defines`` takes the newest OpenCL C the compiler has (``Device.build``)."""
        return defines["I8"] == 2   # the byte dot products' built-ins are declared from OpenCL C 2.0 on

    def quantize(self, x, k: int, into: tuple | None = None) -> tuple[list[cl.Event], tuple]:
        """With the rows layout's I8: enqueue x (K floats) quantized per block of 32 into this wrapper's buffers
        for K, or into the caller's (``into``: K int8 codes, K/32 float pairs); returns the launch's events and the
        buffers (int8 codes in a texel's order, float2 step and sum per block)."""
        if into is not None:
            buffers = (device_buffer(into[0], k, "gemv_q4 quantized x"),
                       device_buffer(into[1], 8 * (k // 32), "gemv_q4 quantized x's steps and sums"))
        else:
            buffers = self._quantized.get(k)
        if buffers is None:
            buffers = self._quantized[k] = (
                self.device.alloc(k, what="gemv_q4 quantized x"),
                self.device.alloc(8 * (k // 32), what="gemv_q4 quantized x's steps and sums"))
        event = self.device.launch(self.quantize_kernel(), (k // 32,), None, np.int32(k),
                                   device_buffer(x, 4 * k, "gemv_q4 x"), *buffers)
        return [event], buffers

    def quantize_kernel(self) -> cl.Kernel:
        """The launch ``quantize`` enqueues (the rows layout's I8): from the program of a product this wrapper built
        already, where there is one (the quantizing reads none of its parameters, and a program less is a
        compile less at a cold load), else from a program of its own; or the one the device made already for
        another wrapper or set (the same code: ``Device.kernel``'s ``reads``)."""
        if self._quantize_from is not None:
            defines, newest_c = self._quantize_from
            return self.device.kernel(self.space.source, "gemv_q4_quantize_x", defines, newest_c, reads=("I8",))
        return self.device.kernel(self.space.source, "gemv_q4_quantize_x", {"I8": 1}, reads=("I8",))

    @property
    def reads_quantized(self) -> bool:
        """Whether the product reads x as Q8_1 blocks (the rows layout's I8): a caller holding x quantized already
        (``RMSNorm``'s ``quantized``) passes them, and the product's own quantizing launch is skipped."""
        return self.layout == LAYOUT_ROWS and bool(self.params["I8"])

    def events(self, weight: Q4DeviceWeight, x, y, epilogue: str = "none", quantized=None,
               tail: tuple = ((), ())) -> list[cl.Event]:
        """Enqueue y = W·x and return every launch's event (more than one where rows span several images, and
        the quantization of x first with the rows layout's I8). ``quantized``: x's Q8_1 blocks (codes, steps and
        sums, as ``quantize`` writes them) made by the caller; the rows layout's I8 reads them instead of
        quantizing x itself, every other variant reads x. ``tail``: a subclass's (defines, arguments after y)."""
        n, k = weight.n, weight.k
        check_gate_up("gemv_q4", epilogue, n)
        if weight.layout != self.layout:
            raise PerfxError(f"gemv_q4: parameters for the {LAYOUT_NAMES[self.layout]} layout (LAYOUT="
                             f"{self.layout}) on a weight uploaded {LAYOUT_NAMES[weight.layout]} (layout "
                             f"{weight.layout}); upload it with layout={self.layout}")
        kernel = self.kernel(weight.group, epilogue, k, weight.form, tail[0])
        m = output_rows(n, epilogue)
        xb = device_buffer(x, 4 * k, "gemv_q4 x")
        yb = device_buffer(y, 4 * m, "gemv_q4 y")
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
        events = []
        if self.layout == LAYOUT_INTERLEAVED:
            slices = self.params["SLICES"]
            local_size = (WGN, slices)
            extra = (cl.LocalMemory(max(_staged_x_bytes(self.params, k), 4)),)   # the __local x argument
        else:
            lanes, set_count = self.params["LANES"], self.params["WGR"]
            local_size = (lanes * set_count,)
            extra = ()
            if self.reads_quantized and quantized is not None:
                extra = (device_buffer(quantized[0], k, "gemv_q4 quantized x"),
                         device_buffer(quantized[1], 8 * (k // 32), "gemv_q4 quantized x's steps and sums"))
            elif self.reads_quantized:
                events, extra = self.quantize(xb, k)
        for out_base, count, wa, row_a, wb, row_b in plan:
            if self.layout == LAYOUT_INTERLEAVED:
                global_size = (WGN * -(-count // (WGN * self.rows)), slices)
            else:
                global_size = (local_size[0] * -(-count // (self.rows * set_count)),)
            events.append(self.device.launch(
                kernel, global_size, local_size,
                np.int32(count), np.int32(k), np.int32(out_base), half, np.int32(row_a), np.int32(row_b),
                np.int32(n), wa, wb, weight.scale_offset, bias, has_bias, xb, yb, *tail[1], *extra))
        return events

    def __call__(self, weight: Q4DeviceWeight, x, y, epilogue: str = "none", quantized=None) -> cl.Event:
        """Enqueue y = W·x (+ bias), or act(gate)·up for a gate-up epilogue; returns the last launch's event.

        The queue is in order, so waiting on the returned event waits for the whole product.
        """
        return self.events(weight, x, y, epilogue, quantized)[-1]

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
