"""Constrained decoding's mask on the device (``kernels/logit_mask.cl``): the logits of forbidden tokens set
to −∞ in place, from a bitmask of one bit a token (llguidance's layout: token i at bit i mod 32 of word i / 32)
that the host uploads, so that the argmax or the draw after it (``kernels/small_ops.cl``, ``kernels/sample.cl``)
chooses an allowed token and the logits are never read back."""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.params import ParamSpace
from perfx.runtime import Device

PARAMS = ParamSpace(
    family="logit_mask",
    source="logit_mask.cl",
    space={"WGS": (128, 64, 256), "VW": (1, 4, 8)},
    work_group_size=lambda p, s: p["WGS"],
)


def mask_words(v: int) -> int:
    """The uint32 words of a mask of v tokens."""
    return (v + 31) // 32


class LogitMask:
    """logits[r][i] = −∞ where bit i of row r's mask is clear, for rows of v logits (one row a sequence)."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        self.device = device
        self.params = PARAMS.resolve(params, shape or {}, device.caps)
        self.wgs, self.vw = self.params["WGS"], self.params["VW"]
        self.kernel = device.kernel(PARAMS.source, "logit_mask", self.params)

    def __call__(self, logits, v: int, mask, rows: int = 1):
        """Enqueue the mask over ``logits`` (rows × v floats, in place) from ``mask`` (rows × ceil(v / 32) uint32
        words); returns the event."""
        if not 1 <= v < 2**31 - 8:
            raise PerfxError(f"logit_mask: V = {v} must be between 1 and 2³¹ − 9")
        if rows < 1:
            raise PerfxError(f"logit_mask: rows = {rows} must be at least 1")
        logits = device_buffer(logits, 4 * v * rows, "logit_mask logits")
        mask = device_buffer(mask, 4 * mask_words(v) * rows, "logit_mask mask")
        items = -(-v // self.vw)
        return self.device.launch(self.kernel, (-(-items // self.wgs) * self.wgs, rows), (self.wgs, 1),
                                  np.int32(v), logits, mask)
