"""The router of a mixture-of-experts FFN: each row's expert logits, and the experts it chooses with their weights,
written to device buffers the routed-expert GEMVs read (``perfx.ops.gemv_moe``), so a decode step chooses its
experts with no host round trip.

Wraps ``kernels/moe_router.cl``: ``router_logits`` (one work-group per expert and row) and ``router_topk`` (one
work-group per row: the gating, the selection bias, the top-k, the renormalisation and the scale;
``perfx.reference.moe_route`` is the float64 answer).
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.params import ParamSpace, Rule
from perfx.reference import MOE_GATINGS
from perfx.runtime import Device

MAX_USED = 32   # kernels/moe_router.cl's MAX_USED

PARAMS = ParamSpace(
    family="moe_router",
    source="moe_router.cl",
    space={"WGS": (64, 32, 128, 256)},   # work-items per work-group, in both kernels
    rules=(Rule("the tree sums halve WGS: a power of two", lambda p, s: p["WGS"] & (p["WGS"] - 1) == 0),),
    work_group_size=lambda p, s: p["WGS"],
    local_memory=lambda p, s: 4 * (2 * int(s.get("e", 1)) + 2 * p["WGS"] + MAX_USED),
)


class MoeRouter:
    """ids, weights (m, used) of the experts each of m rows of x (m, K) chooses, from the router W (E, K) float32.

    The shape (``tuning/moe_router.py``): ``e`` experts, ``k`` the hidden size, ``used`` chosen a row, ``gating``
    ("softmax", "sigmoid", "softmax_weight"), ``bias`` (a selection bias), ``norm`` (renormalised weights),
    ``logit_bias`` (a bias on the logits: gpt-oss's router)."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        shape = dict(shape or {})
        self.e, self.used = int(shape.get("e", 8)), int(shape.get("used", 2))
        self.gating, self.bias, self.norm = shape.get("gating", "softmax"), bool(shape.get("bias")), bool(
            shape.get("norm"))
        self.logit_bias = bool(shape.get("logit_bias"))
        if self.gating not in MOE_GATINGS:
            raise PerfxError(f"moe_router: gating {self.gating!r} is not one of {MOE_GATINGS}")
        if not 1 <= self.used <= min(self.e, MAX_USED):
            raise PerfxError(f"moe_router: {self.used} experts chosen of {self.e}: 1 <= used <= experts, used <= "
                             f"{MAX_USED}")
        self.device = device
        self.params = PARAMS.resolve(params, shape, device.caps)
        self.wgs = self.params["WGS"]
        defines = {**self.params, "MAX_E": self.e, "MAX_USED": MAX_USED, "GATING": MOE_GATINGS.index(self.gating),
                   "BIAS": int(self.bias), "NORM": int(self.norm), "LOGIT_BIAS": int(self.logit_bias)}
        self.logits_kernel = device.kernel(PARAMS.source, "router_logits", defines)
        self.topk_kernel = device.kernel(PARAMS.source, "router_topk", defines)
        self._no_bias = device.alloc(4, what="moe_router no bias") if not self.bias else None

    def __call__(self, x, router, bias, logits, ids, weights, m: int, k: int, scale: float = 1.0, logit_bias=None):
        """Enqueue both launches: x (m, k), router (E, k) float32, bias (E) float32 (None without one), logits
        (m, E) scratch, ids (m, used) int32 and weights (m, used) float32 out; ``logit_bias`` (E) float32 where the
        router was built with one. Returns both launches' events."""
        e, used = self.e, self.used
        if m < 1 or k < 1:
            raise PerfxError(f"moe_router: m = {m} rows of k = {k}: both must be positive")
        if (bias is None) == self.bias:
            raise PerfxError("moe_router: a selection bias " + ("is needed: this router was built with one"
                                                                 if self.bias else "was passed to a router built "
                                                                                   "without one"))
        if (logit_bias is None) == self.logit_bias:
            raise PerfxError("moe_router: a logit bias " + ("is needed: this router was built with one"
                                                             if self.logit_bias else "was passed to a router built "
                                                                                     "without one"))
        x_b = device_buffer(x, 4 * m * k, "moe_router x")
        w_b = device_buffer(router, 4 * e * k, "moe_router router")
        z_b = device_buffer(logits, 4 * m * e, "moe_router logits")
        i_b = device_buffer(ids, 4 * m * used, "moe_router ids")
        o_b = device_buffer(weights, 4 * m * used, "moe_router weights")
        b_b = device_buffer(bias, 4 * e, "moe_router bias") if self.bias else self._no_bias
        d, wgs = self.device, self.wgs
        l_b = device_buffer(logit_bias, 4 * e, "moe_router logit bias") if self.logit_bias else b_b
        first = d.launch(self.logits_kernel, (e * wgs, m), (wgs, 1), np.int32(e), np.int32(k), x_b, w_b, l_b, z_b)
        return first, d.launch(self.topk_kernel, (wgs, m), (wgs, 1), np.int32(e), np.int32(used), z_b, b_b, i_b, o_b,
                        np.float32(scale))
