"""RMSNorm with the residual add fused in: one work-group per row, one pass over the inputs.

``residual``: h = x + r written back into r (the new residual stream), y = rmsnorm(h)·γ — the
normalisation before each attention and MLP block. ``plain``: y = rmsnorm(x)·γ — the final norm.
``post_residual`` (Gemma's sandwich norms): h = x + rmsnorm(p)·γ_post written back into x, and
y = rmsnorm(h)·γ_next — a block's output p normalised before the residual add, then the next block's (or the
final) norm, in one pass.

Each takes ``quantized``: (codes, steps and sums) buffers where y is also written as Q8_1 blocks of 32, the int8
activations of the GEMVs that read y (``GemvQ4.events``' and ``GemvQ8.events``' ``quantized``), in ``order``
(``Q8_TEXEL`` for the int4 GEMV, ``Q8_NATURAL`` for the int8 one), so the decode step quantizes each vector once,
in the norm that makes it (K a multiple of 32).
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import Q8_NATURAL, Q8_TEXEL, device_buffer
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
        self._kernels: dict[tuple[str, int], object] = {}
        self.kernels(0)   # built now: a refusal shows at load

    def kernels(self, q8x: int) -> list:
        """The kernel of each entry point, writing y also as Q8_1 blocks in the order ``q8x`` (0: not)."""
        return [self.kernel(name, q8x) for name in ("rmsnorm_residual", "rmsnorm", "rmsnorm_post_residual")]

    def kernel(self, name: str, q8x: int):
        """The entry point ``name``'s kernel, writing y also as Q8_1 blocks in the order ``q8x`` (0: not)."""
        kernel = self._kernels.get((name, q8x))
        if kernel is None:
            kernel = self._kernels[name, q8x] = self.device.kernel(PARAMS.source, name, {**self.params, "Q8X": q8x})
        return kernel

    def _launch(self, name: str, rows: int, dim: int, eps: float, args: tuple, quantized, order: int):
        if rows < 1 or dim < 1:
            raise PerfxError(f"rmsnorm: rows = {rows} and dim = {dim} must both be at least 1")
        q8x = 0
        if quantized is not None:
            if dim % 32:
                raise PerfxError(f"rmsnorm: y quantized per block of 32 needs dim a multiple of 32, not {dim}")
            if order not in (Q8_TEXEL, Q8_NATURAL):
                raise PerfxError(f"rmsnorm: the blocks' order is Q8_TEXEL or Q8_NATURAL, not {order!r}")
            codes, steps = quantized
            args += (device_buffer(codes, rows * dim, "rmsnorm quantized y"),
                     device_buffer(steps, 8 * rows * (dim // 32), "rmsnorm quantized y's steps and sums"))
            q8x = order
        return self.device.launch(self.kernel(name, q8x), (rows * self.wgs,), (self.wgs,),
                                  np.int32(dim), np.float32(eps), *args)

    def residual(self, x, r, gamma, y, rows: int, dim: int, eps: float, quantized=None, order: int = Q8_TEXEL):
        """r ← x + r, y = rmsnorm(r)·γ: (rows, dim) float32, y not aliasing x or r. Returns the event."""
        nbytes = 4 * rows * dim
        args = (device_buffer(x, nbytes, "rmsnorm x"), device_buffer(r, nbytes, "rmsnorm residual"),
                device_buffer(gamma, 4 * dim, "rmsnorm gamma"), device_buffer(y, nbytes, "rmsnorm y"))
        return self._launch("rmsnorm_residual", rows, dim, eps, args, quantized, order)

    def plain(self, x, gamma, y, rows: int, dim: int, eps: float, quantized=None, order: int = Q8_TEXEL):
        """y = rmsnorm(x)·γ, (rows, dim) float32; y must not alias x. Returns the event."""
        nbytes = 4 * rows * dim
        args = (device_buffer(x, nbytes, "rmsnorm x"), device_buffer(gamma, 4 * dim, "rmsnorm gamma"),
                device_buffer(y, nbytes, "rmsnorm y"))
        return self._launch("rmsnorm", rows, dim, eps, args, quantized, order)

    def post_residual(self, p, x, post_gamma, next_gamma, y, rows: int, dim: int, eps: float, quantized=None,
                      order: int = Q8_TEXEL):
        """x ← x + rmsnorm(p)·γ_post, y = rmsnorm(x)·γ_next: (rows, dim) float32, both γ (dim), one eps for
        both norms; y not aliasing p or x. Returns the event."""
        nbytes = 4 * rows * dim
        args = (device_buffer(p, nbytes, "rmsnorm p"), device_buffer(x, nbytes, "rmsnorm residual"),
                device_buffer(post_gamma, 4 * dim, "rmsnorm post_gamma"),
                device_buffer(next_gamma, 4 * dim, "rmsnorm next_gamma"),
                device_buffer(y, nbytes, "rmsnorm y"))
        return self._launch("rmsnorm_post_residual", rows, dim, eps, args, quantized, order)
