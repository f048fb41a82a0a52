"""RMSNorm with the residual add fused in: one work-group per row, one pass over the inputs.

``residual``: h = x + r written back into r (the new residual stream), y = rmsnorm(h)·γ — the
normalisation before each attention and MLP block. ``plain``: y = rmsnorm(x)·γ — the final norm.
``post_residual`` (Gemma's sandwich norms): h = x + rmsnorm(p)·γ_post written back into x, and
y = rmsnorm(h)·γ_next — a block's output p normalised before the residual add, then the next block's (or the
final) norm, in one pass.
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.params import SUBGROUPS_NEED, ParamSpace, Rule
from perfx.runtime import Device

PARAMS = ParamSpace(
    family="rmsnorm",
    source="rmsnorm.cl",
    space={
        "WGS": (128, 64, 256, 32),  # work-items per row
        "VW": (4, 8, 1),            # floats per load
        "SG": (0, 1),               # the row's sum by a local-memory tree (0) or subgroup reductions (1)
    },
    rules=(Rule("the local-memory tree halves WGS: a power of two",
                lambda p, s: p["WGS"] & (p["WGS"] - 1) == 0),),
    work_group_size=lambda p, s: p["WGS"],
    local_memory=lambda p, s: 4 * p["WGS"],
    needs={"SG": SUBGROUPS_NEED},
)


class RMSNorm:
    """Fused residual + RMSNorm over ``rows`` rows of ``dim`` floats; γ float32 (dim)."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        self.device = device
        self.params = PARAMS.resolve(params, shape or {}, device.caps)
        self.wgs = self.params["WGS"]
        self.residual_kernel = device.kernel(PARAMS.source, "rmsnorm_residual", self.params)
        self.plain_kernel = device.kernel(PARAMS.source, "rmsnorm", self.params)
        self.post_residual_kernel = device.kernel(PARAMS.source, "rmsnorm_post_residual", self.params)

    def _check(self, rows: int, dim: int):
        if rows < 1 or dim < 1:
            raise PerfxError(f"rmsnorm: rows = {rows} and dim = {dim} must both be at least 1")

    def residual(self, x, r, gamma, y, rows: int, dim: int, eps: float):
        """r ← x + r, y = rmsnorm(r)·γ: (rows, dim) float32, y not aliasing x or r. Returns the event."""
        self._check(rows, dim)
        nbytes = 4 * rows * dim
        args = (device_buffer(x, nbytes, "rmsnorm x"), device_buffer(r, nbytes, "rmsnorm residual"),
                device_buffer(gamma, 4 * dim, "rmsnorm gamma"), device_buffer(y, nbytes, "rmsnorm y"))
        return self.device.launch(self.residual_kernel, (rows * self.wgs,), (self.wgs,),
                                  np.int32(dim), np.float32(eps), *args)

    def plain(self, x, gamma, y, rows: int, dim: int, eps: float):
        """y = rmsnorm(x)·γ, (rows, dim) float32; y must not alias x. Returns the event."""
        self._check(rows, dim)
        nbytes = 4 * rows * dim
        args = (device_buffer(x, nbytes, "rmsnorm x"), device_buffer(gamma, 4 * dim, "rmsnorm gamma"),
                device_buffer(y, nbytes, "rmsnorm y"))
        return self.device.launch(self.plain_kernel, (rows * self.wgs,), (self.wgs,),
                                  np.int32(dim), np.float32(eps), *args)

    def post_residual(self, p, x, post_gamma, next_gamma, y, rows: int, dim: int, eps: float):
        """x ← x + rmsnorm(p)·γ_post, y = rmsnorm(x)·γ_next: (rows, dim) float32, both γ (dim), one eps for
        both norms; y not aliasing p or x. Returns the event."""
        self._check(rows, dim)
        nbytes = 4 * rows * dim
        args = (device_buffer(p, nbytes, "rmsnorm p"), device_buffer(x, nbytes, "rmsnorm residual"),
                device_buffer(post_gamma, 4 * dim, "rmsnorm post_gamma"),
                device_buffer(next_gamma, 4 * dim, "rmsnorm next_gamma"),
                device_buffer(y, nbytes, "rmsnorm y"))
        return self.device.launch(self.post_residual_kernel, (rows * self.wgs,), (self.wgs,),
                                  np.int32(dim), np.float32(eps), *args)
