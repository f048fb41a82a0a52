"""Routed-expert products of a prompt, its rows grouped by expert on the device: each expert's weights are read
once a tile of TM of its rows, where the per-row GEMVs (``perfx.ops.gemv_moe``) read them once a row.

Wraps ``kernels/gemm_moe.cl``: ``moe_group`` (the pairs of (row, chosen expert) grouped by expert from the router's
ids: a histogram, a prefix sum, a scatter), the grouped gate-up (act(gate)·up of each pair) and down (each pair's
weighted down product), and the combine (each row's sum over its experts, in a fixed order). Weights are
``perfx.ops.gemv_moe.ExpertWeights``.
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.gemv_moe import ACTS, OPS, check_weight, form_defines, shape_form
from perfx.ops.params import ParamSpace, Rule
from perfx.runtime import Device

PARAMS = ParamSpace(
    family="gemm_moe",
    source="gemm_moe.cl",
    space={"TN": (64, 32, 128),   # work-items (output columns) per work-group
           "TM": (8, 4, 16)},     # rows of one expert per work-group: each weight group read once for them
    rules=(Rule("a work-group loads its rows' ids with its first TM work-items: TM <= TN",
                lambda p, s: p["TM"] <= p["TN"]),),
    work_group_size=lambda p, s: p["TN"],
    local_memory=lambda p, s: 4 * (p["TM"] * (int(s.get("group", 32)) + 3)),
)
GROUP_WGS = 64   # moe_group's work-items (experts counted at once)


class GroupedExperts:
    """The scratch of a prompt's grouping: per expert its count and offset, the pairs in expert order, and each
    pair's down product; for up to ``rows`` rows of ``used`` experts of ``experts``, outputs of ``n``."""

    def __init__(self, device: Device, experts: int, rows: int, used: int, n: int):
        self.experts, self.rows, self.used, self.n = experts, rows, used, n
        self.counts = device.empty(experts, np.int32)
        self.offsets = device.empty(experts, np.int32)
        self.order = device.empty(rows * used, np.int32)
        self.out = device.empty((rows * used, n), np.float32)


class GemmMoE:
    """The grouped routed-expert products of one role (the shape's ``op``) for weights of one form; shape keys as
    ``gemv_moe``'s, ``m`` the rows."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        shape = dict(shape or {})
        self.op = shape.get("op", "gate_up")
        act = shape.get("act", "silu")
        if self.op not in OPS or act not in ACTS:
            raise PerfxError(f"gemm_moe: op {self.op!r} ({OPS}) or activation {act!r} ({tuple(ACTS)}) unknown")
        self.form, self.bias = shape_form(shape), bool(shape.get("bias"))
        self.device = device
        self.params = PARAMS.resolve(params, shape, device.caps)
        self.tn, self.tm = self.params["TN"], self.params["TM"]
        defines = {**self.params, **form_defines(shape), "ACT": ACTS[act], "BIAS": int(self.bias)}
        self.no_bias = device.alloc(4, what="gemm_moe no bias") if not self.bias else None
        self.group_kernel = device.kernel(PARAMS.source, "moe_group", defines)
        self.kernel = device.kernel(PARAMS.source, f"moe_{self.op}_grouped", defines)
        self.combine_kernel = device.kernel(PARAMS.source, "moe_combine", defines) if self.op == "down" else None

    def _check(self, weight, rows: int, scratch: GroupedExperts, m: int, used: int):
        check_weight("gemm_moe", self.op, weight, self.form, rows, self.bias)
        if m > scratch.rows or used != scratch.used or weight.experts != scratch.experts:
            raise PerfxError(f"gemm_moe: scratch for {scratch.rows} rows of {scratch.used}/{scratch.experts} experts "
                             f"cannot group {m} rows of {used}/{weight.experts}")

    def _bias(self, weight):
        return weight.bias if weight.bias is not None else self.no_bias

    def group(self, ids, m: int, used: int, scratch: GroupedExperts):
        """Group the m·used (row, expert) pairs of ``ids`` (m, used) by expert into ``scratch``."""
        s = scratch
        return self.device.launch(self.group_kernel, (GROUP_WGS,), (GROUP_WGS,), np.int32(m * used),
                                  np.int32(s.experts), device_buffer(ids, 4 * m * used, "gemm_moe ids"),
                                  s.counts.base_data, s.offsets.base_data, s.order.base_data)

    def gate_up(self, weight, x, ids, h, m: int, used: int, scratch: GroupedExperts):
        """Group the pairs (``group``), then h (m, used, I) = act(gate)·up of each row's chosen experts."""
        inter, k = weight.n // 2, weight.k
        self._check(weight, 2 * inter, scratch, m, used)
        first = self.group(ids, m, used, scratch)
        s = scratch
        grid = (-(-inter // self.tn) * self.tn, weight.experts, -(-m // self.tm))
        return first, self.device.launch(
            self.kernel, grid, (self.tn, 1, 1), np.int32(inter), np.int32(k), np.int32(used), s.counts.base_data,
            s.offsets.base_data, s.order.base_data, device_buffer(x, 4 * m * k, "gemm_moe x"), weight.codes,
            weight.scales, self._bias(weight), device_buffer(h, 4 * m * used * inter, "gemm_moe h"))

    def down(self, weight, h, weights, y, m: int, used: int, scratch: GroupedExperts, accumulate: bool = False):
        """y (m, N) (+)= Σ_j weights[r, j]·down_e(h[r, j]), the pairs grouped as the last ``gate_up`` (or ``group``)
        left them in ``scratch``."""
        n, k = weight.n, weight.k
        self._check(weight, n, scratch, m, used)
        s = scratch
        if s.n < n:
            raise PerfxError(f"gemm_moe: scratch outputs of {s.n} where the experts give {n}")
        grid = (-(-n // self.tn) * self.tn, weight.experts, -(-m // self.tm))
        first = self.device.launch(
            self.kernel, grid, (self.tn, 1, 1), np.int32(n), np.int32(k), s.counts.base_data, s.offsets.base_data,
            s.order.base_data, device_buffer(weights, 4 * m * used, "gemm_moe weights"),
            device_buffer(h, 4 * m * used * k, "gemm_moe h"), weight.codes, weight.scales, self._bias(weight),
            s.out.base_data)
        return first, self.device.launch(self.combine_kernel, (-(-n // 64) * 64, m), (64, 1), np.int32(n),
                                         np.int32(used), s.out.base_data, device_buffer(y, 4 * m * n, "gemm_moe y"),
                                         np.int32(int(accumulate)))
