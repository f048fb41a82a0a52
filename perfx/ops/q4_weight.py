"""A 4-bit matrix on the device, in the layout every int4 kernel (gemv_q4, gemm_q4) reads.

Codes: rows contiguous along K, 32 codes per RGBA/UINT32 texel (``perfx.formats.pack_texels``),
held as a plain buffer of uint4 (N, K/32) and/or as image2d_t row blocks of at most the device's
image height (rows split over several images). Scale/offset pairs: one half2 per group, (N, K/G).
The layout is made once at load time; nothing is repacked per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from perfx.errors import PerfxError
from perfx.formats import Q4Matrix, pack_scale_offset, pack_texels, row_splits
from perfx.runtime import Device

READ_PATHS = ("image2d", "buffer")


@dataclass
class Q4DeviceWeight:
    n: int
    k: int
    group: int
    scale_offset: object                 # cl.Buffer of half2 (N, K/G)
    bias: object | None = None           # cl.Buffer of float (N), or None
    buffer: object | None = None         # cl.Buffer of uint4 (N, K/32), when the buffer path is loaded
    images: list = field(default_factory=list)             # image2d per row block
    image_rows: list[tuple[int, int]] = field(default_factory=list)  # [start, stop) of each image

    @property
    def texels_per_row(self) -> int:
        return self.k // 32

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads for one pass over the matrix (codes, scales and offsets, bias)."""
        return self.n * self.k // 2 + 4 * self.n * (self.k // self.group) + (4 * self.n if self.bias is not None else 0)

    @classmethod
    def upload(cls, device: Device, q4: Q4Matrix, bias: np.ndarray | None = None,
               read_paths: tuple[str, ...] = READ_PATHS, what: str = "weight") -> Q4DeviceWeight:
        """Upload ``q4`` for the given read paths ("image2d", "buffer")."""
        n, k = q4.shape
        unknown = set(read_paths) - set(READ_PATHS)
        if unknown:
            raise PerfxError(f"unknown read path(s) {sorted(unknown)}; perfx knows {READ_PATHS}")
        texels = pack_texels(q4.codes)  # (N, K/32, 4) uint32
        weight = cls(n, k, q4.group, device.alloc(n * (k // q4.group) * 4, pack_scale_offset(q4.scales, q4.offsets),
                                                  what=f"{what} scales"))
        if bias is not None:
            bias = np.asarray(bias, dtype=np.float32)
            if bias.shape != (n,):
                raise PerfxError(f"{what}: bias of shape {bias.shape} for a matrix with {n} rows")
            weight.bias = device.alloc(bias.nbytes, bias, what=f"{what} bias")
        if "buffer" in read_paths:
            weight.buffer = device.alloc(texels.nbytes, texels, what=f"{what} codes")
        if "image2d" in read_paths:
            caps = device.caps
            if not caps.image_support:
                raise PerfxError(f"{caps.name} has no image support: load {what} with read path 'buffer'")
            if k // 32 > caps.image2d_max_width:
                raise PerfxError(f"{what}: K = {k} needs {k // 32} texels per row, more than the image width "
                                 f"limit {caps.image2d_max_width}; use read path 'buffer'")
            # Rows per image: the height limit, and the allocation limit for very long rows.
            max_rows = max(1, min(caps.image2d_max_height, caps.max_alloc // (16 * (k // 32))))
            for start, stop in row_splits(n, max_rows):
                weight.images.append(device.image_rgba_u32(texels[start:stop], what=f"{what} rows {start}:{stop}"))
                weight.image_rows.append((start, stop))
        return weight
