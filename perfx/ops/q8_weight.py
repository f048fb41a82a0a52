"""An int8 matrix on the device, in the layout every int8 kernel (gemv_q8, gemm_q8, embedding_q8) reads.

Codes: int8 rows contiguous along K. Per group of G ∈ {16, 32} along K, (rows, K/G): an (s, m) pair, or
the scale alone for the symmetric types (``perfx.formats.Q8Matrix.symmetric``), as half where fp16 holds
every value exactly, else float (``perfx.formats.Q8Matrix.f32``): kernels/q8.h. The matrix
is held as row blocks, each its own buffers within the device's largest allocation (a 128k × 4096
vocabulary is 525 MB of int8, beyond the 256 MiB some Adreno parts allow at once); the kernels take
a block and a row within it, and the wrappers cut launches at block boundaries (``segments``). A tied
embedding is this same weight: the gather and the lm_head read one copy. Made once at load time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from perfx.errors import PerfxError
from perfx.formats import Q8Matrix, q8_group_bytes, row_splits
from perfx.runtime import Device


@dataclass
class Q8Block:
    start: int                  # first row of the matrix in this block
    stop: int
    codes: object               # cl.Buffer of int8 (rows, K)
    scales: object              # cl.Buffer of (rows, K/G) half or float, pairs (s, m) unless symmetric
    bias: object | None = None  # cl.Buffer of float (rows), or None


@dataclass
class Q8DeviceWeight:
    n: int
    k: int
    group: int
    f32: bool                   # float scales (True) or half (False)
    symmetric: bool             # scales alone (True) or (s, m) pairs (False)
    blocks: list[Q8Block] = field(default_factory=list)
    has_bias: bool = False

    @property
    def group_bytes(self) -> int:
        return q8_group_bytes(self.f32, self.symmetric)

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads for one pass over the matrix (codes, scales and offsets, bias)."""
        return self.n * self.k + self.group_bytes * self.n * (self.k // self.group) + (4 * self.n if self.has_bias else 0)

    @property
    def block_rows(self) -> list[tuple[int, int]]:
        return [(b.start, b.stop) for b in self.blocks]

    @classmethod
    def upload(cls, device: Device, q8: Q8Matrix, bias: np.ndarray | None = None, max_block_bytes: int | None = None,
               what: str = "weight") -> Q8DeviceWeight:
        """Upload ``q8`` (and a float32 bias of N) as row blocks of at most ``max_block_bytes`` of codes
        (default and ceiling: the device's largest allocation)."""
        n, k = q8.shape
        limit = device.caps.max_alloc if max_block_bytes is None else min(device.caps.max_alloc, max_block_bytes)
        max_rows = limit // k
        if max_rows == 0:
            raise PerfxError(f"{what}: one int8 row of K = {k} bytes exceeds the largest allocation allowed "
                             f"here ({limit} bytes, limits: {device.caps.limits})")
        if bias is not None:
            bias = np.asarray(bias, dtype=np.float32)
            if bias.shape != (n,):
                raise PerfxError(f"{what}: bias of shape {bias.shape} for a matrix with {n} rows")
        weight = cls(n, k, q8.group, q8.f32, q8.symmetric, has_bias=bias is not None)
        for start, stop in row_splits(n, max_rows):
            part = q8.rows(start, stop)
            values = part.group_values()
            if weight.symmetric and not weight.f32:   # fp16 scales are read a half2 at a time: one past the end
                values = np.append(values.reshape(-1), np.float16(0))
            block = Q8Block(start, stop, device.alloc(part.codes.nbytes, part.codes, what=f"{what} codes {start}:{stop}"),
                            device.alloc(values.nbytes, values, what=f"{what} scales {start}:{stop}"))
            if bias is not None:
                block.bias = device.alloc(4 * (stop - start), bias[start:stop], what=f"{what} bias {start}:{stop}")
            weight.blocks.append(block)
        return weight

    def locate(self, row: int) -> tuple[int, int]:
        """(block index, row within that block) of a matrix row."""
        for i, b in enumerate(self.blocks):
            if b.start <= row < b.stop:
                return i, row - b.start
        raise PerfxError(f"row {row} is outside the matrix of {self.n} rows")

    def segments(self, count: int, up: int | None = None) -> list[tuple[int, int, int, int, int, int]]:
        """Launch pieces covering outputs [0, count): (first output, outputs, block a, row in a, block b,
        row in b). Output o reads row o (gate, or only) and, when ``up`` is given, row up + o; a piece
        never lets either cross from one block into the next."""
        pieces, o = [], 0
        while o < count:
            a, row_a = self.locate(o)
            length = min(count - o, self.blocks[a].stop - o)
            b, row_b = a, row_a
            if up is not None:
                b, row_b = self.locate(up + o)
                length = min(length, self.blocks[b].stop - (up + o))
            pieces.append((o, length, a, row_a, b, row_b))
            o += length
        return pieces
