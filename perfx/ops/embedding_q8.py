"""The embedding gather from an int8 table: out (M, K) = W[ids]·scale, dequantized (kernels/embedding_q8.cl).

The table is a ``Q8DeviceWeight`` (a tied embedding is the lm_head's own copy), possibly in row blocks:
one launch per block. An id outside the vocabulary gives a row of NaN, never a silent wrong row. ``scale``
multiplies each row in fp32: 1 for most models, √hidden for Gemma (llama.cpp's ggml_scale after the gather).
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.params import ParamSpace
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.runtime import Device

PARAMS = ParamSpace(
    family="embedding_q8",
    source="embedding_q8.cl",
    space={"WGS": (64, 32, 128)},   # work-items per work-group, 8 weights each
    work_group_size=lambda p, s: p["WGS"],
)


class EmbeddingQ8:
    """out (rows, K) float32 = table[ids], ids an int32 device buffer; an id outside [0, N) gives NaN."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        self.device = device
        self.params = PARAMS.resolve(params, shape or {}, device.caps)
        self.wgs = self.params["WGS"]

    def kernel(self, group: int, f32: bool, symmetric: bool):
        """The gather for a table's group size, pair precision and form."""
        defines = {**self.params, "GROUP": group, "SM_F32": int(f32), "SYM": int(symmetric)}
        return self.device.kernel(PARAMS.source, "embedding_q8", defines)

    def __call__(self, table: Q8DeviceWeight, ids, out, rows: int, scale: float = 1.0) -> list:
        """Enqueue the gather: one event per row block, in order (the last one finishes last)."""
        if rows < 1:
            raise PerfxError(f"embedding_q8: rows = {rows} must be at least 1")
        ids = device_buffer(ids, 4 * rows, "embedding_q8 ids")
        out = device_buffer(out, 4 * rows * table.k, "embedding_q8 out")
        kernel = self.kernel(table.group, table.f32, table.symmetric)
        global_size = (-(-(table.k // 8) // self.wgs) * self.wgs, rows)
        return [self.device.launch(kernel, global_size, (self.wgs, 1), np.int32(table.k), np.int32(table.n),
                                   np.int32(block.start), np.int32(block.stop), np.float32(scale), ids,
                                   block.codes, block.scales, out)
                for block in table.blocks]
