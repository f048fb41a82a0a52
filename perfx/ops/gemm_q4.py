"""The prefill-path int4 GEMM: Y (M, N) = X (M, K) · Wᵀ with a fused epilogue, for M tokens.

Two kernels of one family: ``gemm_q4_skinny`` (small M, memory-bound: each weight read once, all M
rows' sums in registers) and ``gemm_q4_tiled`` (large M, compute-bound: local-memory and register
tiles). ``GemmQ4`` picks one by M against a crossover; ``choose(m)`` says which.

Epilogues: "none"; "bias" (+ the weight's bias per output column, e.g. Qwen's QKV); "silu_mul"
(gate-up: W has 2·I rows, gate then up, and Y (M, I) = SiLU(X·Wgᵀ)·(X·Wuᵀ)).
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import buffer_bytes
from perfx.ops.params import READ_NEED, ParamSpace, Rule
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.runtime import Device

EPILOGUES = {"none": 0, "bias": 1, "silu_mul": 2}
KINDS = ("skinny", "tiled")
# Largest M for the tall-skinny kernel when no tuned crossover is given: at M ≈ 32 its register
# passes cost about what the tiled kernel's tile overheads do (see benchmarks/bench_gemm_q4.py,
# which prints the measured crossover for this device).
DEFAULT_CROSSOVER = 32

_GROUP_SHIFT = {32: 0, 64: 1, 128: 2}


def _weight_rows(shape) -> int:
    """Weight rows a column of Y needs: two (gate and up) for the gate-up epilogue."""
    return 2 if shape.get("epilogue") == "silu_mul" else 1


SKINNY = ParamSpace(
    family="gemm_q4_skinny",
    source="gemm_q4_skinny.cl",
    space={
        "WGS": (64, 1),          # work-items per work-group (independent: no local memory, no barriers)
        "ROWS": (1, 2, 4),       # output columns per work-item (1 by default: 8 accumulators for gate-up too)
        "MT": (4, 2, 8),         # rows of X per register pass
        "READ": (1, 0),          # codes from image2d (1) or buffer (0)
    },
    # Each work-item holds ROWS·MT float8 accumulators per weight row it applies (two, gate and up, for the
    # gate-up epilogue), plus ROWS weight vectors and the x chunk: at most 8 accumulators, counted as they
    # are held. On PoCL/AVX2 (16 vector registers) 16 of them spill and run at 2/3 the speed of 8.
    rules=(Rule("at most 8 float8 accumulators per work-item (ROWS·MT, times 2 for the gate-up epilogue)",
                lambda p, s: p["ROWS"] * p["MT"] * _weight_rows(s) <= 8),),
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
        "READ": (0, 1),          # codes from buffer (0) or image2d (1)
    },
    rules=(
        Rule("MWG must be a multiple of MDIMC", lambda p, s: p["MWG"] % p["MDIMC"] == 0),
        Rule("NWG must be a multiple of NDIMC·VWN", lambda p, s: p["NWG"] % (p["NDIMC"] * p["VWN"]) == 0),
        # Register block of at most 64 accumulators per work-item: beyond that every device spills.
        Rule("at most 64 accumulators per work-item ((MWG/MDIMC)·(NWG/NDIMC) ≤ 64)",
             lambda p, s: (p["MWG"] // p["MDIMC"]) * (p["NWG"] // p["NDIMC"]) <= 64),
    ),
    work_group_size=lambda p, s: p["MDIMC"] * p["NDIMC"],
    local_memory=lambda p, s: 4 * p["KWG"] * (p["MWG"] + _weight_rows(s) * p["NWG"]),
    needs={"READ": READ_NEED},
)

_SPACES = {"skinny": SKINNY, "tiled": TILED}


class GemmQ4:
    """Y = X · Wᵀ (+ epilogue) for an int4 ``Q4DeviceWeight``, by the tall-skinny or the tiled kernel."""

    def __init__(self, device: Device, skinny_params=None, tiled_params=None, crossover: int | None = None,
                 shape: dict | None = None):
        """Parameters of each kernel (None: the defaults) must fit ``shape`` (its ``epilogue`` matters: the
        gate-up epilogue holds two weight tiles) on this device."""
        self.device = device
        self.params = {"skinny": SKINNY.resolve(skinny_params, shape or {}, device.caps),
                       "tiled": TILED.resolve(tiled_params, shape or {}, device.caps)}
        self.crossover = DEFAULT_CROSSOVER if crossover is None else int(crossover)
        if self.crossover < 0:
            raise PerfxError(f"gemm_q4 crossover must be ≥ 0 (the largest M for the tall-skinny kernel), "
                             f"got {crossover}")
        self._kernels = {}
        # Kernels take a bias pointer whatever the epilogue; this one stands in when there is none.
        self._no_bias = device.alloc(4, what="gemm_q4 placeholder bias")

    def choose(self, m: int) -> str:
        """"skinny" for M ≤ crossover, else "tiled"."""
        return "skinny" if m <= self.crossover else "tiled"

    def __call__(self, weight: Q4DeviceWeight, x, y, m: int, epilogue: str = "none"):
        """Y (m, N or N/2 for silu_mul) = X (m, K) · Wᵀ with the epilogue; returns the last event.

        ``x`` and ``y`` are float32 cl.Buffers (or pyopencl Arrays), row-major. Where the weight's
        image path holds several row blocks, one launch per block is enqueued (in order).
        """
        return self.run(self.choose(m), weight, x, y, m, epilogue)

    def skinny(self, weight: Q4DeviceWeight, x, y, m: int, epilogue: str = "none"):
        """The tall-skinny kernel whatever M is (the tuner and the benchmark use it)."""
        return self.run("skinny", weight, x, y, m, epilogue)

    def tiled(self, weight: Q4DeviceWeight, x, y, m: int, epilogue: str = "none"):
        """The tiled kernel whatever M is."""
        return self.run("tiled", weight, x, y, m, epilogue)

    def output_columns(self, weight: Q4DeviceWeight, epilogue: str) -> int:
        """Columns of Y: N, or N/2 for the gate-up epilogue."""
        return weight.n // 2 if epilogue == "silu_mul" else weight.n

    # -- launching -------------------------------------------------------------------------------

    def kernel(self, kind: str, epilogue: str, read: int):
        """The built kernel of one kind, epilogue and read path (built once, then kept)."""
        key = (kind, epilogue, read)
        kernel = self._kernels.get(key)
        if kernel is None:
            why = _SPACES[kind].why_invalid(self.params[kind], {"epilogue": epilogue}, self.device.caps)
            if why is not None:
                raise PerfxError(f"gemm_q4: the {kind} kernel's parameters {self.params[kind]} cannot run the "
                                 f"{epilogue} epilogue on {self.device.caps.name}: {why}")
            defines = {**self.params[kind], "READ": read, "EPILOGUE": EPILOGUES[epilogue]}
            kernel = self.device.kernel(_SPACES[kind].source, f"gemm_q4_{kind}", defines)
            self._kernels[key] = kernel
        return kernel

    def _check(self, weight: Q4DeviceWeight, x, y, m: int, epilogue: str) -> tuple[int, list]:
        """Y's column count and the buffers behind X and Y, once every argument is checked."""
        if epilogue not in EPILOGUES:
            raise PerfxError(f"gemm_q4: unknown epilogue {epilogue!r}; choose one of {', '.join(EPILOGUES)}")
        if not isinstance(m, (int, np.integer)) or m < 1:
            raise PerfxError(f"gemm_q4: M must be a positive integer, got {m!r}")
        if weight.k % 32 or weight.group not in _GROUP_SHIFT or weight.k % weight.group:
            raise PerfxError(f"gemm_q4: K = {weight.k} with group {weight.group} is not supported; K must be a "
                             "multiple of 32 and of the group size (32, 64 or 128)")
        if epilogue == "silu_mul" and weight.n % 2:
            raise PerfxError("gemm_q4: the silu_mul epilogue needs a gate-up weight of 2·I rows, "
                             f"got N = {weight.n}")
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

    def _segments(self, weight: Q4DeviceWeight, cols: int, silu: bool, read: int):
        """Launch pieces: (y_col0, n_cols, row_a0, row_b0, codes_a, codes_b, base_a, base_b).

        With images, the columns are cut where the gate or the up rows cross from one image to the next.
        """
        up = cols if silu else 0
        if read == 0:
            return [(0, cols, 0, up, weight.buffer, weight.buffer, 0, 0)]
        starts = [start for start, _ in weight.image_rows]
        cuts = {0, cols}
        for start in starts:
            for edge in (start, start - up) if silu else (start,):
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

    def run(self, kind: str, weight: Q4DeviceWeight, x, y, m: int, epilogue: str = "none"):
        """Y by the named kernel ("skinny" or "tiled"); ``__call__`` is ``run(choose(m), ...)``."""
        if kind not in KINDS:
            raise PerfxError(f"gemm_q4: unknown kernel {kind!r}; choose one of {', '.join(KINDS)}")
        cols, (xb, yb) = self._check(weight, x, y, m, epilogue)
        params = self.params[kind]
        # READ where the weight holds that layout, else the one it holds: the same maths, both verified.
        read = params["READ"]
        if read == 1 and not weight.images:
            read = 0
        if read == 0 and weight.buffer is None:
            read = 1
        kernel = self.kernel(kind, epilogue, read)
        bias = weight.bias if weight.bias is not None else self._no_bias
        event = None
        for y_col0, n_cols, row_a0, row_b0, codes_a, codes_b, base_a, base_b in self._segments(
                weight, cols, epilogue == "silu_mul", read):
            if kind == "skinny":
                local = (params["WGS"],)
                glob = (-(-n_cols // (params["ROWS"] * params["WGS"])) * params["WGS"],)
            else:
                local = (params["NDIMC"], params["MDIMC"])
                glob = (-(-n_cols // params["NWG"]) * params["NDIMC"], -(-m // params["MWG"]) * params["MDIMC"])
            event = self.device.launch(
                kernel, glob, local,
                np.int32(m), np.int32(n_cols), np.int32(weight.k), np.int32(_GROUP_SHIFT[weight.group]),
                np.int32(cols), np.int32(y_col0), np.int32(row_a0), np.int32(row_b0),
                np.int32(base_a), np.int32(base_b),
                xb, yb, codes_a, codes_b, weight.scale_offset, bias)
        return event
