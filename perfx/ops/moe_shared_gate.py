"""The σ gate of a mixture-of-experts block's shared expert, applied in place to its act(gate)·up rows
(``kernels/moe_shared_gate.cl``; ``perfx.reference.moe_shared_gate`` is the float64 answer)."""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.params import ParamSpace, Rule
from perfx.runtime import Device

PARAMS = ParamSpace(
    family="moe_shared_gate",
    source="moe_shared_gate.cl",
    space={"WGS": (64, 32, 128, 256), "PER": (4, 1, 8)},
    rules=(Rule("the tree sum halves WGS: a power of two", lambda p, s: p["WGS"] & (p["WGS"] - 1) == 0),),
    work_group_size=lambda p, s: p["WGS"],
    local_memory=lambda p, s: 4 * p["WGS"],
)


class MoeSharedGate:
    """h (m, n) *= σ(x (m, K) · w (K)) a row, in place, all float32."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        self.device = device
        self.params = PARAMS.resolve(params, shape or {}, device.caps)
        self.kernel = device.kernel(PARAMS.source, "moe_shared_gate", self.params)

    def __call__(self, x, w, h, m: int, k: int, n: int):
        """Enqueue it. Returns the event."""
        if min(m, k, n) < 1:
            raise PerfxError(f"moe_shared_gate: {m} rows of K = {k} gating {n} values each: all must be positive")
        wgs, per = self.params["WGS"], self.params["PER"]
        groups = -(-n // (wgs * per))
        return self.device.launch(self.kernel, (groups * wgs, m), (wgs, 1), np.int32(k), np.int32(n),
                                  device_buffer(x, 4 * m * k, "moe_shared_gate x"),
                                  device_buffer(w, 4 * k, "moe_shared_gate w"),
                                  device_buffer(h, 4 * m * n, "moe_shared_gate h"))
