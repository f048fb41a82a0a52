"""gemv_f16: y = W·x with W fp16 on the device (the lm_head, also when tied to the token embeddings).

The weight is held as row blocks, each one buffer within the device's largest allocation (a 152k × 4096
vocabulary is 1.2 GB of fp16, beyond the 1 GiB or 256 MiB an Adreno allows at once); the wrapper
launches once per block, writing y at the block's row offset. The embedding gather reads the same
blocks, so tied embeddings exist once on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from perfx.errors import PerfxError
from perfx.formats import row_splits
from perfx.ops import device_buffer
from perfx.ops.params import SUBGROUP_SIZE_NEED, SUBGROUPS_NEED, ParamSpace, Rule
from perfx.runtime import Device

PARAMS = ParamSpace(
    family="gemv_f16",
    source="gemv_f16.cl",
    space={
        "WGS": (64, 128, 256),   # work-items per work-group
        "LANES": (16, 1, 4, 32, 64),  # work-items along K per row (they meet in a reduction)
        "VW": (8, 4),             # halfs per load
        "SG": (0, 1),             # a row's lanes reduced by a local-memory tree (0) or subgroups (1)
        "SUBGROUP": (0, 8, 16, 64),  # required subgroup size (0: the driver's; 64 = Adreno's half wave)
    },
    rules=(
        Rule("WGS must be a multiple of LANES", lambda p, s: p["WGS"] % p["LANES"] == 0),
        Rule("a subgroup reduction (SG 1) needs a required subgroup size that divides LANES (each row's lanes "
             "whole subgroups); without one, SUBGROUP is 0",
             lambda p, s: (p["SUBGROUP"] > 0 and p["LANES"] % p["SUBGROUP"] == 0) if p["SG"] else
             p["SUBGROUP"] == 0),
    ),
    work_group_size=lambda p, s: p["WGS"],
    local_memory=lambda p, s: 4 * p["WGS"] if p["LANES"] > 1 else 0,
    needs={"SG": SUBGROUPS_NEED, "SUBGROUP": SUBGROUP_SIZE_NEED},
)


@dataclass
class F16DeviceWeight:
    n: int
    k: int
    blocks: list = field(default_factory=list)                      # cl.Buffer of half (rows, K) per block
    block_rows: list[tuple[int, int]] = field(default_factory=list)  # [start, stop) of each block

    @property
    def nbytes(self) -> int:
        return 2 * self.n * self.k

    @classmethod
    def upload(cls, device: Device, w: np.ndarray, max_block_bytes: int | None = None,
               what: str = "weight") -> F16DeviceWeight:
        """Upload W (N, K) float16/float32 as fp16 row blocks of at most ``max_block_bytes`` (default and
        ceiling: the device's largest allocation)."""
        w = np.asarray(w)
        if w.ndim != 2 or w.dtype not in (np.float16, np.float32):
            raise PerfxError(f"{what}: expected a (N, K) float16 or float32 matrix, got {w.dtype} {w.shape}")
        n, k = w.shape
        if n == 0 or k == 0:
            raise PerfxError(f"{what}: empty matrix {w.shape}")
        limit = device.caps.max_alloc
        if max_block_bytes is not None:
            limit = min(limit, max_block_bytes)
        max_rows = limit // (2 * k)
        if max_rows == 0:
            raise PerfxError(f"{what}: one row of K = {k} halves ({2 * k} bytes) exceeds the largest "
                             f"allocation allowed here ({limit} bytes, limits: {device.caps.limits})")
        weight = cls(n, k)
        for start, stop in row_splits(n, max_rows):
            # Converted block by block so a 1.2 GB table never needs a second host copy.
            with np.errstate(over="ignore"):  # checked just below, with the rows named
                block = np.ascontiguousarray(w[start:stop], dtype=np.float16)
            if w.dtype == np.float32 and not np.all(np.isfinite(block)):
                raise PerfxError(f"{what}: rows {start}:{stop} hold values beyond fp16's range (±65504)")
            weight.blocks.append(device.alloc(block.nbytes, block, what=f"{what} rows {start}:{stop}"))
            weight.block_rows.append((start, stop))
        return weight


class GemvF16:
    """y (N) = W (N, K) · x (K), W an ``F16DeviceWeight``; x and y float32 device buffers."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        self.device = device
        self.params = PARAMS.resolve(params, shape or {}, device.caps)
        self.kernel = device.kernel(PARAMS.source, "gemv_f16", self.params)
        self.wgs = self.params["WGS"]
        self.rows_per_group = self.params["WGS"] // self.params["LANES"]

    def __call__(self, weight: F16DeviceWeight, x, y) -> list:
        """Enqueue y = W·x; returns one event per row block, in order (the last one finishes last)."""
        x = device_buffer(x, 4 * weight.k, "gemv_f16 x")
        y = device_buffer(y, 4 * weight.n, "gemv_f16 y")
        events = []
        for block, (start, stop) in zip(weight.blocks, weight.block_rows):
            groups = -(-(stop - start) // self.rows_per_group)
            events.append(self.device.launch(self.kernel, (groups * self.wgs,), (self.wgs,),
                                             np.int32(stop - start), np.int32(weight.k), block, x, y,
                                             np.int32(start)))
        return events
