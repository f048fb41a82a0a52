"""The int4 GEMV shaped for a GPU (issue 41): y = W·x (+ bias), plain, fused (QKV) or gate-up with SiLU·mul or
GELU·mul, on the rows layout (``LAYOUT_ROWS``) of a ``Q4DeviceWeight``'s codes buffer.

``kernels/gemv_q4_split.cl``: K split into ``SPLIT`` slices across work-groups, so a small matrix still
launches several work-groups a compute unit; the work-items of a row set neighbours along K, so a warp/wave reads
contiguous runs of a row, every 32-byte sector whole; the partial sums (SPLIT·N floats, a scratch buffer this
wrapper owns per N; ⌈T/TS⌉ ≤ SPLIT of them used) reduced in slice order by a second launch that adds the bias
and applies the epilogue: deterministic, no atomics. K is a build define (one build per K).
``perfx.tuning.gemv_index`` models the launch's shape and its loads' sector use at a GPU's limits.
"""

from __future__ import annotations

import numpy as np
import pyopencl as cl

from perfx.errors import PerfxError
from perfx.formats import Q4_PAIRS, q4_form_defines
from perfx.ops import device_buffer
from perfx.ops.epilogue import GEMV_EPILOGUES, check_gate_up, code, is_gated, output_rows
from perfx.ops.params import READ_BUFFER, ParamSpace, Rule
from perfx.ops.q4_weight import LAYOUT_NAMES, LAYOUT_ROWS, Q4DeviceWeight
from perfx.runtime import Device

REDUCE_WORK_GROUP = 64   # work-items a work-group of gemv_q4_split_reduce


def slice_texels(k: int, split: int) -> int:
    """Texels of K a slice covers: ⌈T/SPLIT⌉ rounded up to even (slices start on a 32-byte boundary); the
    kernel's SLICE_TEXELS."""
    texels = k // 32
    return (-(-texels // split) + 1) // 2 * 2


def slices(k: int, split: int) -> int:
    """Slices a launch makes: ⌈T/TS⌉, SPLIT or fewer where rounding TS up leaves the last ones empty (the
    kernel's SLICES)."""
    return -(-(k // 32) // slice_texels(k, split))


def _slices_fit(p, s) -> bool:
    """One slice, or slices that each hold at least half a pass of the lanes."""
    texels = s.get("k", 0) // 32
    return p["SPLIT"] == 1 or texels == 0 or -(-texels // p["SPLIT"]) >= p["LANES"] // 2


PARAMS = ParamSpace(
    family="gemv_q4_split",
    source="gemv_q4_split.cl",
    space={
        "SPLIT": (1, 2, 4, 8, 16),  # slices of K across work-groups, reduced by a second launch
        "LANES": (8, 4, 16, 32),    # work-items along K per row set, neighbours reading neighbouring texels
        "ROWS": (2, 1, 4),          # rows per work-item: each x chunk applied to ROWS rows
        "WGR": (4, 1, 2, 8, 16),    # row sets per work-group
    },
    rules=(
        Rule("a work-group holds 32 to 256 work-items (LANES × WGR): at least a warp, at most what a GPU runs "
             "several of a compute unit",
             lambda p, s: 32 <= p["LANES"] * p["WGR"] <= 256),
        Rule("each slice of K holds at least half a pass of the lanes (⌈T/SPLIT⌉ ≥ LANES/2, T = K/32)",
             _slices_fit),
    ),
    work_group_size=lambda p, s: p["LANES"] * p["WGR"],
    local_memory=lambda p, s: 4 * p["LANES"] * p["WGR"] * p["ROWS"],
)


class GemvQ4Split:
    """y (M) = W (N, K)·x (K) (+ bias) on a ``Q4DeviceWeight`` in the rows layout with a codes buffer; M = N, or
    N/2 for a gate-up epilogue (``silu_mul``, ``gelu_mul``). Two launches: the slices' partial sums, then their
    reduction with the bias and the epilogue."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        """``params`` (None: the defaults) must fit ``shape`` (its ``k`` matters) on this device."""
        self.device = device
        self.params = PARAMS.resolve(params, shape or {}, device.caps)
        self.split, self.lanes = self.params["SPLIT"], self.params["LANES"]
        self.rows, self.sets = self.params["ROWS"], self.params["WGR"]
        self._no_bias = device.alloc(4, what="gemv_q4_split bias placeholder")
        self._kernels: dict[tuple, tuple[cl.Kernel, cl.Kernel]] = {}
        self._scratch: dict[int, cl.Buffer] = {}   # N -> SPLIT·N floats of partial sums

    def kernels(self, group: int, epilogue: str, k: int, form: int = Q4_PAIRS,
                bias: bool = False) -> tuple[cl.Kernel, cl.Kernel]:
        """The built (product, reduction) kernels for a group size, epilogue, K, scales' form and whether the
        weight has a bias (the reduction's), once the parameters are checked against K (built once, then
        cached by the device)."""
        key = (group, epilogue, k, form, bias)
        kernels = self._kernels.get(key)
        if kernels is None:
            PARAMS.check(self.params, {"k": k, "epilogue": epilogue}, self.device.caps, f"at K = {k}")
            epilogue_code = code("gemv_q4_split", epilogue, GEMV_EPILOGUES)
            defines = {**self.params, "KTEXELS": k // 32, "GROUP": group, "EPILOGUE": epilogue_code,
                       **q4_form_defines(form)}
            # The reduction reads only the slice count (SPLIT and K), the epilogue and the bias: its program is
            # built with those alone, so every set of one SPLIT shares it instead of building the file again.
            reduce_defines = {"SPLIT": self.split, "KTEXELS": k // 32, "EPILOGUE": epilogue_code, "BIAS": int(bias)}
            kernels = (self.device.kernel(PARAMS.source, "gemv_q4_split", defines),
                       self.device.kernel(PARAMS.source, "gemv_q4_split_reduce", reduce_defines))
            self._kernels[key] = kernels
        return kernels

    def scratch(self, n: int) -> cl.Buffer:
        """This wrapper's partial sums for a weight of N rows (SPLIT·N floats), made once per N. Launches on
        one in-order queue reuse it one after the other."""
        buffer = self._scratch.get(n)
        if buffer is None:
            # zeroed once: the product writes every row it holds before the reduction reads it (an unwritten
            # partial would read 0 and fail the checks against the reference); Oclgrind reported the
            # reduction's reads of a fresh scratch as uninitialised when a case of another N ran first
            buffer = self._scratch[n] = self.device.alloc(4 * self.split * n, np.zeros(self.split * n, np.float32),
                                                          what="gemv_q4_split partial sums")
        return buffer

    def launch_shape(self, n: int, k: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(global, local) of the product over an (N, K) weight: the index model's and the launch's."""
        local = self.lanes * self.sets
        groups = -(-(-(-n // self.rows)) // self.sets)
        return (local * groups, slices(k, self.split)), (local, 1)

    # GemvQ4's call interface, so a plan can hold either wrapper for a role: x is read as floats, never as the
    # norm's int8 blocks (``quantized`` is accepted and not read); the weight in the rows layout, read through its
    # codes buffer (the layout and read path its upload takes from the wrapper).
    reads_quantized = False
    layout, read = LAYOUT_ROWS, READ_BUFFER

    def events(self, weight: Q4DeviceWeight, x, y, epilogue: str = "none", quantized=None) -> list[cl.Event]:
        """Enqueue y = W·x: the product's launch and the reduction's; returns both events."""
        n, k = weight.n, weight.k
        check_gate_up("gemv_q4_split", epilogue, n)
        if weight.layout != LAYOUT_ROWS:
            raise PerfxError(f"gemv_q4_split reads the rows layout (layout {LAYOUT_ROWS}), not a weight uploaded "
                             f"{LAYOUT_NAMES[weight.layout]} (layout {weight.layout}); upload it with layout=0")
        if weight.buffer is None:
            raise PerfxError("gemv_q4_split: the weight was uploaded without the 'buffer' read path it reads; "
                             "upload it with read_paths including 'buffer'")
        product, reduce = self.kernels(weight.group, epilogue, k, weight.form, weight.bias is not None)
        m = output_rows(n, epilogue)
        xb = device_buffer(x, 4 * k, "gemv_q4_split x")
        yb = device_buffer(y, 4 * m, "gemv_q4_split y")
        bias = weight.bias if weight.bias is not None else self._no_bias
        partial = self.scratch(n)
        global_size, local_size = self.launch_shape(n, k)
        first = self.device.launch(product, global_size, local_size, np.int32(n), weight.buffer,
                                   weight.scale_offset, xb, partial)
        reduce_global = REDUCE_WORK_GROUP * -(-m // REDUCE_WORK_GROUP)
        second = self.device.launch(reduce, (reduce_global,), (REDUCE_WORK_GROUP,), np.int32(m),
                                    np.int32(m if is_gated(epilogue) else 0), np.int32(n), partial, bias, yb)
        return [first, second]

    def __call__(self, weight: Q4DeviceWeight, x, y, epilogue: str = "none", quantized=None) -> cl.Event:
        """Enqueue y = W·x (+ bias), or act(gate)·up for a gate-up epilogue; returns the last launch's event (the
        queue is in order: waiting on it waits for the whole product)."""
        return self.events(weight, x, y, epilogue)[-1]
