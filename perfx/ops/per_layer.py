"""Gemma 4's per-layer operations (``kernels/per_layer.cl``): the gate of a layer's per-layer input, GELU(W_gate·x)
times that layer's slice of the token's per-layer inputs (``PerLayerGate``), and the residual stream times the
layer's learned output scalar (``LayerScale``)."""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.params import ParamSpace
from perfx.runtime import Device

PER_LAYER_GATE = ParamSpace(family="per_layer_gate", source="per_layer.cl", space={"WGS": (64, 128, 256)},
                            work_group_size=lambda p, s: p["WGS"])
LAYER_SCALE = ParamSpace(family="layer_scale", source="per_layer.cl",
                         space={"VW": (4, 8, 1), "WGS": (64, 128, 256)}, work_group_size=lambda p, s: p["WGS"])


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class PerLayerGate:
    """out (m, P) = GELU(gate)·inputs[:, offset:offset + P], inputs (m, stride) float32; out may be gate."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        self.device = device
        self.params = PER_LAYER_GATE.resolve(params, shape or {}, device.caps)
        self.kernel = device.kernel(PER_LAYER_GATE.source, "per_layer_gate", self.params)

    def __call__(self, gate, inputs, out, m: int, p: int, stride: int, offset: int):
        """Enqueue it. Returns the event."""
        if m < 1 or p < 1 or offset < 0 or offset + p > stride:
            raise PerfxError(f"per_layer_gate: {m} rows of {p} from column {offset} of rows of {stride}: the rows "
                             "and the width must be positive and the slice within the row")
        count = m * p
        args = (device_buffer(gate, 4 * count, "per_layer_gate gate"),
                device_buffer(inputs, 4 * m * stride, "per_layer_gate inputs"),
                device_buffer(out, 4 * count, "per_layer_gate out"))
        wgs = self.params["WGS"]
        return self.device.launch(self.kernel, (_round_up(count, wgs),), (wgs,), np.int32(m), np.int32(p),
                                  np.int32(stride), np.int32(offset), *args)


class LayerScale:
    """x = x·scale[0] in place over ``count`` floats, scale a one-float device buffer."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        self.device = device
        self.params = LAYER_SCALE.resolve(params, shape or {}, device.caps)
        self.kernel = device.kernel(LAYER_SCALE.source, "layer_scale", self.params)

    def __call__(self, x, scale, count: int):
        """Enqueue it. Returns the event."""
        if count < 1:
            raise PerfxError(f"layer_scale: count = {count} must be at least 1")
        wgs = self.params["WGS"]
        return self.device.launch(self.kernel, (_round_up(-(-count // self.params["VW"]), wgs),), (wgs,),
                                  np.int32(count), device_buffer(scale, 4, "layer_scale scale"),
                                  device_buffer(x, 4 * count, "layer_scale x"))
