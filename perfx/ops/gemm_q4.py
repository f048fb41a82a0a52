"""The prefill-path int4 GEMM: Y (M, N) = X (M, K) · Wᵀ with a fused epilogue, for M tokens.

Five kernels: ``gemm_q4_skinny`` (small M, memory-bound: each weight read once, all M rows' sums in
registers), ``gemm_q4_tiled`` (large M, compute-bound: local-memory and register tiles), ``gemm_q4_lanes``
(one column a SIMD lane, for CPU compilers), ``gemm_q4_i8`` (a few rows, the batched decode step's: X
quantized to int8 per block of 32 once per call, integer products, each weight texel unpacked once for all the
rows of a pass; its products as int16 pairs, two rows of X a conversion (PAIR) or, where the device has
cl_khr_integer_dot_product, byte dot products (DOT)) and, where the device has cl_khr_fp16, ``gemm_q4_f16``
(fp16 register tiles, no local memory, no barriers; the activations converted to fp16 once per call).
``GemmQ4`` runs a fixed kind, or picks skinny or tiled by M against a crossover; ``choose(m)`` says which.

Every kernel reads the layout and read path the weight was uploaded with (``kernels/q4.h``): LAYOUT comes
from the weight, and READ is the tuned one where the weight has it, else the path it has. The space of each
kernel holds every (LAYOUT, READ) pair beside every other parameter, so the set that runs is a verified one.

Epilogues (perfx.ops.epilogue): "none"; "bias" (+ the weight's bias per output column, e.g. Qwen's QKV);
"silu_mul" and "gelu_mul" (gate-up: W has 2·I rows, gate then up, and Y (M, I) = act(X·Wgᵀ)·(X·Wuᵀ) with
act SiLU or GELU's tanh form).
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.formats import Q4_PAIRS, q4_form_defines
from perfx.ops import buffer_bytes, device_buffer
from perfx.ops.epilogue import check_gate_up, code, is_gated, output_rows
from perfx.ops.params import BYTE_DOT_NEED, FP16_NEED, READ_BUFFER, READ_IMAGE1D, READ_IMAGE2D, READ_NEED, ParamSpace, Rule
from perfx.ops.q4_weight import LAYOUT_ROWS, Q4DeviceWeight
from perfx.runtime import Device

KINDS = ("skinny", "tiled", "f16", "lanes", "i8")
FAMILIES = tuple(f"gemm_q4_{kind}" for kind in KINDS)   # each kind's tuning family
# Largest M for the tall-skinny kernel when no tuned crossover is given: at M ≈ 32 its register
# passes cost about what the tiled kernel's tile overheads do (see benchmarks/bench_gemm_q4.py,
# which prints the measured crossover for this device).
DEFAULT_CROSSOVER = 32
# Largest M the int8-activation kernel is tuned and offered at: the rows of a batched decode step (one a
# sequence, `perfx serve --parallel N`) and of short prompt pieces; its passes of MT rows re-unpack the weight,
# which the tiled kernels' local-memory tiles do not, so it is not a kernel for long prompts.
I8_MAX_M = 16

_GROUP_SHIFT = {32: 0, 64: 1, 128: 2}


def _weight_rows(shape) -> int:
    """Weight rows a column of Y needs: two (gate and up) for the gate-up epilogue."""
    return 2 if is_gated(shape.get("epilogue")) else 1


# Byte dot products sum a texel (a group, for gemm_q8_i8) of a row of X into one int: no int lanes to pair.
PAIR_RULE = Rule("rows of X are paired (PAIR 1) in the int lanes of the 16-bit products: DOT 0",
                 lambda p, s: not (p["PAIR"] and p["DOT"]))

LAYOUT_READ_RULE = Rule("the interleaved layout has no image2d row blocks: READ 0 or 2",
                        lambda p, s: p["LAYOUT"] == LAYOUT_ROWS or p["READ"] != READ_IMAGE2D)


SKINNY = ParamSpace(
    family="gemm_q4_skinny",
    source="gemm_q4_skinny.cl",
    space={
        "WGS": (64, 1),          # work-items per work-group (independent: no local memory, no barriers)
        "ROWS": (1, 2, 4),       # output columns per work-item (1 by default: 8 accumulators for gate-up too)
        "MT": (4, 2, 8),         # rows of X per register pass
        "READ": (1, 0),          # codes from image2d (1) or buffer (0): where the weight has it
        "LAYOUT": (0, 1),        # the weight's layout (rows along K, interleaved): set from the weight
    },
    # Each work-item holds ROWS·MT float8 accumulators per weight row it applies (two, gate and up, for the
    # gate-up epilogue), plus ROWS weight vectors and the x chunk: at most 8 accumulators, counted as they
    # are held. A CPU with 16 vector registers spills 16 of them, slower than 8 (benchmarks/NOTES.md).
    rules=(Rule("at most 8 float8 accumulators per work-item (ROWS·MT, times 2 for the gate-up epilogue)",
                lambda p, s: p["ROWS"] * p["MT"] * _weight_rows(s) <= 8),
           LAYOUT_READ_RULE),
    work_group_size=lambda p, s: p["WGS"],
    needs={"READ": READ_NEED},
)

TILED = ParamSpace(
    family="gemm_q4_tiled",
    source="gemm_q4_tiled.cl",
    space={
        "MWG": (32, 64),         # rows of Y per work-group tile
        "NWG": (64, 128),        # columns of Y per work-group tile
        "KWG": (32, 64),         # K per local-memory tile (a multiple of 32)
        "MDIMC": (8,),           # work-items along M
        "NDIMC": (8,),           # work-items along N
        "VWN": (8, 4),           # vector width along N: 1, 2, 4 or 8 (16 fails to build on PoCL)
        "READ": (0, 1),          # codes from buffer (0) or image2d (1): where the weight has it
        "LAYOUT": (0, 1),        # the weight's layout (rows along K, interleaved): set from the weight
    },
    rules=(
        Rule("MWG must be a multiple of MDIMC", lambda p, s: p["MWG"] % p["MDIMC"] == 0),
        Rule("NWG must be a multiple of NDIMC·VWN", lambda p, s: p["NWG"] % (p["NDIMC"] * p["VWN"]) == 0),
        # Register block of at most 64 accumulators per work-item: beyond that every device spills.
        Rule("at most 64 accumulators per work-item ((MWG/MDIMC)·(NWG/NDIMC) ≤ 64)",
             lambda p, s: (p["MWG"] // p["MDIMC"]) * (p["NWG"] // p["NDIMC"]) <= 64),
        LAYOUT_READ_RULE,
    ),
    work_group_size=lambda p, s: p["MDIMC"] * p["NDIMC"],
    local_memory=lambda p, s: 4 * p["KWG"] * (p["MWG"] + _weight_rows(s) * p["NWG"]),
    needs={"READ": READ_NEED},
)

F16 = ParamSpace(
    family="gemm_q4_f16",
    source="gemm_q4_f16.cl",
    space={
        "WGS": (64, 32),         # work-items per work-group (independent: no local memory, no barriers)
        "TN": (4, 8),            # output columns per work-item: one halfTN vector of weight rows
        "TM": (4, 2, 8),         # rows of X per work-item
        "READ": (0, 2, 1),       # codes from a buffer (0), its image1d_buffer view (2), image2d row blocks (1)
        "LAYOUT": (0, 1),        # the weight's layout: set from the weight
        "HALF": (1,),            # fp16 arithmetic: what the kernel is for, where cl_khr_fp16 is
    },
    rules=(
        # TM·TN half accumulators and as many fp32 totals per weight-row set (two for the gate-up
        # epilogue), beside TN texels and TM x vectors: 32 outputs is what a GPU keeps in registers.
        Rule("at most 32 outputs of accumulators per work-item (TM·TN, twice for gate-up, ≤ 32)",
             lambda p, s: p["TM"] * p["TN"] * _weight_rows(s) <= 32),
        LAYOUT_READ_RULE,
    ),
    work_group_size=lambda p, s: p["WGS"],
    needs={"READ": READ_NEED, "HALF": FP16_NEED},
)

LANES = ParamSpace(
    family="gemm_q4_lanes",
    source="gemm_q4_lanes.cl",
    space={
        "WGS": (64, 32, 16),     # work-items per work-group (independent: no local memory, no barriers)
        "ROWS": (1, 2),          # output columns per work-item, a global size apart
        "MB": (6, 4, 8, 12, 16), # rows of X per pass (6: the gate-up epilogue's 12 accumulators)
        "READ": (0, 1),          # codes from a buffer (0) or image2d (1): where the weight has it
        "LAYOUT": (0, 1),        # the weight's layout (rows along K, interleaved): set from the weight
    },
    # MB·ROWS scalar accumulators per weight row a work-item applies (two for the gate-up epilogue), a vector
    # register each once the lanes hold work-items, beside the weights and the broadcast x: a CPU with 32
    # vector registers holds 24 (one with 16 spills past 12, which the tuner measures).
    rules=(Rule("at most 24 accumulators per work-item (MB·ROWS, times 2 for the gate-up epilogue)",
                lambda p, s: p["MB"] * p["ROWS"] * _weight_rows(s) <= 24),
           LAYOUT_READ_RULE),
    work_group_size=lambda p, s: p["WGS"],
    needs={"READ": READ_NEED},
)

I8 = ParamSpace(
    family="gemm_q4_i8",
    source="gemm_q4_i8.cl",
    space={
        "WGS": (16, 1, 32, 64),  # work-items per work-group (independent: no local memory, no barriers)
        "ROWS": (2, 1, 4),       # output columns per work-item: each texel of X applied to ROWS weight rows
        "MT": (4, 2, 8),         # rows of X per pass
        "READ": (0, 1),          # codes from a buffer (0) or image2d (1): where the weight has it
        "LAYOUT": (0, 1),        # the weight's layout (rows along K, interleaved): set from the weight
        "DOT": (0, 1),           # products as int16 pairs (0) or byte dot products (1, cl_khr_integer_dot_product)
        "PAIR": (0, 1),          # 1: two rows of X share a 16-lane conversion and multiply-add (DOT 0)
    },
    # ROWS·MT float8 accumulators per weight row a work-item applies (two for the gate-up epilogue), beside its
    # unpacked texels (two short16 a weight row): 16 accumulators is what a CPU with 32 vector registers holds;
    # the tuner measures where fewer spill. Paired, as many float16 for half the rows of X: the same lanes.
    rules=(Rule("at most 16 float8 accumulators per work-item (ROWS·MT, times 2 for the gate-up epilogue)",
                lambda p, s: p["ROWS"] * p["MT"] * _weight_rows(s) <= 16),
           PAIR_RULE,
           LAYOUT_READ_RULE),
    work_group_size=lambda p, s: p["WGS"],
    needs={"READ": READ_NEED, "DOT": BYTE_DOT_NEED},
)

_SPACES = {"skinny": SKINNY, "tiled": TILED, "f16": F16, "lanes": LANES, "i8": I8}


class GemmQ4:
    """Y = X · Wᵀ (+ epilogue) for an int4 ``Q4DeviceWeight``, by the tall-skinny, tiled or fp16 kernel."""

    def __init__(self, device: Device, skinny_params=None, tiled_params=None, crossover: int | None = None,
                 shape: dict | None = None, f16_params=None, kind: str | None = None, lanes_params=None,
                 i8_params=None):
        """Parameters of each kernel (None: the defaults) must fit ``shape`` (its ``epilogue`` matters: the
        gate-up epilogue holds two weight tiles) on this device. ``kind`` fixes the kernel whatever M is
        (the model's per-bucket choice); without it, M ≤ crossover runs skinny and larger M tiled.
        The fp16 kernel's parameters are resolved only where the device has cl_khr_fp16 (or when given)."""
        self.device = device
        shape = shape or {}
        self.params = {"skinny": SKINNY.resolve(skinny_params, shape, device.caps),
                       "tiled": TILED.resolve(tiled_params, shape, device.caps),
                       "lanes": LANES.resolve(lanes_params, shape, device.caps),
                       "i8": I8.resolve(i8_params, shape, device.caps)}
        if f16_params is not None or device.caps.fp16:
            self.params["f16"] = F16.resolve(f16_params, shape, device.caps)
        if kind is not None and kind not in self.params:
            raise PerfxError(f"gemm_q4: kind {kind!r} is not available here; available: {', '.join(self.params)}"
                             + (" (the fp16 kernel needs cl_khr_fp16)" if kind == "f16" else ""))
        self.kind = kind
        self.crossover = DEFAULT_CROSSOVER if crossover is None else int(crossover)
        if self.crossover < 0:
            raise PerfxError(f"gemm_q4 crossover must be ≥ 0 (the largest M for the tall-skinny kernel), "
                             f"got {crossover}")
        self._kernels = {}
        self._quantize_from: tuple | None = None   # (defines, newest_c) of a built int8 program
        # Kernels take a bias pointer whatever the epilogue; this one stands in when there is none.
        self._no_bias = device.alloc(4, what="gemm_q4 placeholder bias")
        self._x_half = None   # the fp16 kernel's activations, grown to the largest X seen
        # the int8 kernel's quantized X (codes, then (step, sum) per block), grown to the largest X seen; the
        # smaller ones are kept, since a recorded step's launches still name them
        self._x_q8: list[tuple] = []

    def choose(self, m: int) -> str:
        """The fixed kind, else "skinny" for M ≤ crossover and "tiled" above."""
        if self.kind is not None:
            return self.kind
        return "skinny" if m <= self.crossover else "tiled"

    def __call__(self, weight: Q4DeviceWeight, x, y, m: int, epilogue: str = "none", quantized=None):
        """Y (m, N, or N/2 for a gate-up epilogue) = X (m, K) · Wᵀ with the epilogue; returns the last event.

        ``x`` and ``y`` are float32 cl.Buffers (or pyopencl Arrays), row-major. Where the weight's
        image path holds several row blocks, one launch per block is enqueued (in order). ``quantized``: X's
        Q8_1 blocks in texel order (codes, (step, sum) pairs; ``kernels/q8_1.h``), as the norm that wrote X
        made them, which the int8-activation kernel reads instead of quantizing X itself; other kinds read x.
        """
        return self.run(self.choose(m), weight, x, y, m, epilogue, quantized)

    def skinny(self, weight: Q4DeviceWeight, x, y, m: int, epilogue: str = "none"):
        """The tall-skinny kernel whatever M is (the tuner and the benchmark use it)."""
        return self.run("skinny", weight, x, y, m, epilogue)

    def tiled(self, weight: Q4DeviceWeight, x, y, m: int, epilogue: str = "none"):
        """The tiled kernel whatever M is."""
        return self.run("tiled", weight, x, y, m, epilogue)

    def f16(self, weight: Q4DeviceWeight, x, y, m: int, epilogue: str = "none"):
        """The fp16 register-tiled kernel whatever M is (cl_khr_fp16)."""
        return self.run("f16", weight, x, y, m, epilogue)

    def output_columns(self, weight: Q4DeviceWeight, epilogue: str) -> int:
        """Columns of Y: N, or N/2 for the gate-up epilogue."""
        return output_rows(weight.n, epilogue)

    # -- launching -------------------------------------------------------------------------------

    def kernel(self, kind: str, epilogue: str, read: int, layout: int = LAYOUT_ROWS, form: int = Q4_PAIRS):
        """The built kernel of one kind, epilogue, read path, weight layout and scales' form (built once, then
        kept)."""
        key = (kind, epilogue, read, layout, form)
        kernel = self._kernels.get(key)
        if kernel is None:
            params = self.params[kind]
            if (params["READ"], params["LAYOUT"]) != (read, layout):   # the weight's own: another set
                params = {**params, "READ": read, "LAYOUT": layout}
            params = _SPACES[kind].check(params, {"epilogue": epilogue}, self.device.caps,
                                         f"the {epilogue} epilogue")
            defines = {**params, "EPILOGUE": code("gemm_q4", epilogue), **q4_form_defines(form)}
            # cl_khr_integer_dot_product's built-ins are declared only for OpenCL C 2.0 and newer on some compilers
            kernel = self.device.kernel(_SPACES[kind].source, f"gemm_q4_{kind}", defines,
                                        newest_c=bool(params.get("DOT")))
            self._kernels[key] = kernel
            if kind == "i8" and self._quantize_from is None:
                self._quantize_from = (defines, bool(params.get("DOT")))
        return kernel

    @staticmethod
    def read_path(read: int, weight: Q4DeviceWeight) -> int:
        """READ where the weight holds that path, else the path it holds (buffer first): the same maths."""
        have = {READ_BUFFER: weight.buffer is not None, READ_IMAGE2D: bool(weight.images),
                READ_IMAGE1D: weight.image1d is not None}
        return GemmQ4.read_of(read, {code for code, held in have.items() if held})

    @staticmethod
    def read_of(read: int, held: set[int]) -> int:
        """``read_path`` for a weight holding the READ codes ``held`` (one not uploaded yet: a build ahead)."""
        if read in held:
            return read
        return READ_BUFFER if READ_BUFFER in held else READ_IMAGE2D

    def _check(self, weight: Q4DeviceWeight, x, y, m: int, epilogue: str) -> tuple[int, list]:
        """Y's column count and the buffers behind X and Y, once every argument is checked."""
        code("gemm_q4", epilogue)
        if not isinstance(m, (int, np.integer)) or m < 1:
            raise PerfxError(f"gemm_q4: M must be a positive integer, got {m!r}")
        if weight.k % 32 or weight.group not in _GROUP_SHIFT or weight.k % weight.group:
            raise PerfxError(f"gemm_q4: K = {weight.k} with group {weight.group} is not supported; K must be a "
                             "multiple of 32 and of the group size (32, 64 or 128)")
        check_gate_up("gemm_q4", epilogue, weight.n)
        if epilogue == "bias" and weight.bias is None:
            raise PerfxError("gemm_q4: epilogue 'bias' on a weight uploaded without a bias; pass bias= to "
                             "Q4DeviceWeight.upload or use epilogue 'none'")
        cols = self.output_columns(weight, epilogue)
        buffers = []
        for name, array, need in (("X", x, m * weight.k * 4), ("Y", y, m * cols * 4)):
            buffer, size = buffer_bytes(array, f"gemm_q4 {name}")
            if size < need:
                raise PerfxError(f"gemm_q4: {name} holds {size} bytes, less than the {need} that M = {m}, "
                                 f"K = {weight.k}, N = {cols} need (float32, row-major)")
            buffers.append(buffer)
        return cols, buffers

    def _segments(self, weight: Q4DeviceWeight, cols: int, gated: bool, read: int):
        """Launch pieces: (y_col0, n_cols, row_a0, row_b0, codes_a, codes_b, base_a, base_b).

        With images, the columns are cut where the gate or the up rows cross from one image to the next.
        """
        up = cols if gated else 0
        if read != READ_IMAGE2D:
            codes = weight.buffer if read == READ_BUFFER else weight.image1d
            return [(0, cols, 0, up, codes, codes, 0, 0)]
        starts = [start for start, _ in weight.image_rows]
        cuts = {0, cols}
        for start in starts:
            for edge in (start, start - up) if gated else (start,):
                if 0 < edge < cols:
                    cuts.add(edge)
        cuts = sorted(cuts)

        def image_of(row):
            i = max(j for j, start in enumerate(starts) if start <= row)
            return weight.images[i], starts[i]

        pieces = []
        for a, b in zip(cuts, cuts[1:]):
            image_a, base_a = image_of(a)
            image_b, base_b = image_of(a + up)
            pieces.append((a, b - a, a, a + up, image_a, image_b, base_a, base_b))
        return pieces

    def run(self, kind: str, weight: Q4DeviceWeight, x, y, m: int, epilogue: str = "none", quantized=None):
        """Y by the named kernel ("skinny", "tiled" or "f16"); ``__call__`` is ``run(choose(m), ...)``."""
        if kind not in KINDS:
            raise PerfxError(f"gemm_q4: unknown kernel {kind!r}; choose one of {', '.join(KINDS)}")
        if kind not in self.params:
            raise PerfxError(f"gemm_q4: the {kind} kernel is not available on {self.device.caps.name} "
                             "(the fp16 kernel needs cl_khr_fp16)")
        cols, (xb, yb) = self._check(weight, x, y, m, epilogue)
        params = self.params[kind]
        read = self.read_path(params["READ"], weight)
        kernel = self.kernel(kind, epilogue, read, weight.layout, weight.form)
        bias = weight.bias if weight.bias is not None else self._no_bias
        if kind == "f16":
            xb = self._to_half(xb, m * weight.k)
        if kind != "i8":
            x_args = (xb,)
        elif quantized is not None:
            codes, steps = quantized
            x_args = (device_buffer(codes, m * weight.k, "gemm_q4_i8 X's int8 codes"),
                      device_buffer(steps, 8 * m * (weight.k // 32), "gemm_q4_i8 X's steps and sums"))
        else:
            x_args = self._to_q8(xb, m * weight.k)
        event = None
        for y_col0, n_cols, row_a0, row_b0, codes_a, codes_b, base_a, base_b in self._segments(
                weight, cols, is_gated(epilogue), read):
            if kind in ("skinny", "lanes", "i8"):
                local = (params["WGS"],)
                glob = (-(-n_cols // (params["ROWS"] * params["WGS"])) * params["WGS"],)
            elif kind == "f16":
                local = (params["WGS"], 1)
                glob = (-(-n_cols // (params["TN"] * params["WGS"])) * params["WGS"], -(-m // params["TM"]))
            else:
                local = (params["NDIMC"], params["MDIMC"])
                glob = (-(-n_cols // params["NWG"]) * params["NDIMC"], -(-m // params["MWG"]) * params["MDIMC"])
            event = self.device.launch(
                kernel, glob, local,
                np.int32(m), np.int32(n_cols), np.int32(weight.k), np.int32(_GROUP_SHIFT[weight.group]),
                np.int32(cols), np.int32(y_col0), np.int32(row_a0), np.int32(row_b0),
                np.int32(base_a), np.int32(base_b), np.int32(weight.n),
                *x_args, yb, codes_a, codes_b, weight.scale_offset, bias)
        return event

    def convert_kernel(self):
        """The conversion of X to half that the fp16 kernel's calls launch first."""
        return self.device.kernel(F16.source, "convert_f16", {})

    def quantize_kernel(self):
        """The quantization of X to int8 blocks that the int8 kernel's calls launch first: from the program of an
        int8 product this wrapper built already, where there is one (the quantizing reads none of its parameters,
        and a program less is a compile less at a cold load), else from a program of its own; or the one the device
        made already for another wrapper or set (the same code: ``Device.kernel``'s ``reads``)."""
        defines, newest_c = self._quantize_from or ({}, False)
        return self.device.kernel(I8.source, "gemm_q4_i8_quantize_x", defines, newest_c, reads=())

    def _to_q8(self, xb, count: int) -> tuple:
        """X's int8 codes and (step, sum) per block of 32 (the int8 kernel's input), in scratch kept for the
        next call."""
        if not self._x_q8 or self._x_q8[-1][0].size < count:
            self._x_q8.append((self.device.alloc(count, what="gemm_q4_i8 activations (int8)"),
                               self.device.alloc(count // 4, what="gemm_q4_i8 activation steps")))
        codes, steps = self._x_q8[-1]
        blocks = count // 32
        self.device.launch(self.quantize_kernel(), (-(-blocks // 64) * 64,), (64,), np.int32(count), xb, codes,
                           steps)
        return codes, steps

    def _to_half(self, xb, count: int):
        """X as half, once per call (the fp16 kernel's input), in a scratch buffer kept for the next call."""
        if self._x_half is None or self._x_half.size < 2 * count:
            self._x_half = self.device.alloc(2 * count, what="gemm_q4_f16 activations (fp16)")
        kernel = self.convert_kernel()
        chunks = -(-count // 8)
        self.device.launch(kernel, (-(-chunks // 64) * 64,), (64,), np.int32(count), xb, self._x_half)
        return self._x_half
