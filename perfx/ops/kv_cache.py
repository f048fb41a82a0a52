"""The KV cache and the RoPE table: device state shared by decode and prefill attention.

KV cache: fp16, keys and values laid out [layer][kv_head][pos][head_dim], so one head's positions are
contiguous (the attention kernels stream them), in pieces of whole layers that each fit the device's
largest allocation. fp16 storage halves the cache and needs no cl_khr_fp16 (vstore_half / vload_half
are core OpenCL).

RoPE table: cos and sin (max_positions, head_dim/2) float32, computed once on the host in float64
from θ and the model's rope_scaling (``perfx.reference.rope_tables``) and uploaded once — never
recomputed per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyopencl as cl

from perfx import reference
from perfx.errors import PerfxError
from perfx.runtime import Device


@dataclass
class KVCache:
    n_layers: int
    n_kv_heads: int
    max_positions: int
    head_dim: int
    pieces: list                 # (keys, values) cl.Buffers of half, each [layer][kv_head][pos][head_dim] for
    layers_per_piece: int        # this many consecutive layers (the last piece may hold fewer)

    @classmethod
    def allocate(cls, device: Device, n_layers: int, n_kv_heads: int, max_positions: int, head_dim: int) -> KVCache:
        """Keys and values in pieces of whole layers, each within the device's largest allocation (a 7B model
        at 4096 positions needs 1 GiB per K and V; some phones allow 256 MiB at once) and within the
        kernels' int element offsets."""
        layer_elements = n_kv_heads * max_positions * head_dim
        layer_bytes = 2 * layer_elements
        if layer_bytes > device.caps.max_alloc or layer_elements >= 2**31:
            raise PerfxError(f"a KV cache of {max_positions} positions needs {layer_bytes / 2**20:.0f} MiB per layer "
                             f"for K and as much for V, more than one allocation may hold here "
                             f"({device.caps.max_alloc / 2**20:.0f} MiB, limits: {device.caps.limits}); "
                             "use a smaller --ctx")
        per_piece = max(1, min(n_layers, device.caps.max_alloc // layer_bytes, (2**31 - 1) // layer_elements))
        pieces = []
        for first in range(0, n_layers, per_piece):
            count = min(per_piece, n_layers - first)
            what = f"KV cache layers {first}-{first + count - 1}"
            pieces.append((device.alloc(count * layer_bytes, what=f"{what} keys"),
                           device.alloc(count * layer_bytes, what=f"{what} values")))
        return cls(n_layers, n_kv_heads, max_positions, head_dim, pieces, per_piece)

    def layer(self, layer: int) -> tuple[object, object, int]:
        """(keys buffer, values buffer, element offset of the layer's block in them) of one layer."""
        keys, values = self.pieces[layer // self.layers_per_piece]
        return keys, values, (layer % self.layers_per_piece) * self.n_kv_heads * self.max_positions * self.head_dim

    @property
    def nbytes(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.max_positions * self.head_dim * 2

    def clear(self, device: Device) -> None:
        """Zero every position (the model never reads a position it has not written; tests may)."""
        for piece in self.pieces:
            for buffer in piece:
                cl.enqueue_fill_buffer(device.queue, buffer, np.uint16(0), 0, buffer.size)

    def write(self, device: Device, keys: np.ndarray, values: np.ndarray) -> None:
        """Fill the whole cache from host arrays (layers, kv_heads, max_positions, head_dim), converted to fp16."""
        shape = (self.n_layers, self.n_kv_heads, self.max_positions, self.head_dim)
        for host, which in ((keys, 0), (values, 1)):
            host = np.ascontiguousarray(host, dtype=np.float16).reshape(shape)
            for i, piece in enumerate(self.pieces):
                block = np.ascontiguousarray(host[i * self.layers_per_piece:(i + 1) * self.layers_per_piece])
                cl.enqueue_copy(device.queue, piece[which], block)

    def read_all(self, device: Device) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the whole cache, (layers, kv_heads, max_positions, head_dim) fp16 each."""
        out = []
        for which in (0, 1):
            blocks = []
            for i, piece in enumerate(self.pieces):
                count = min(self.layers_per_piece, self.n_layers - i * self.layers_per_piece)
                block = np.empty((count, self.n_kv_heads, self.max_positions, self.head_dim), np.float16)
                cl.enqueue_copy(device.queue, block, piece[which])
                blocks.append(block)
            out.append(np.concatenate(blocks))
        return out[0], out[1]

    def read(self, device: Device, layer: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of one layer's keys and values for positions 0..positions−1, as (T, Hkv, D) float32."""
        keys, values, offset = self.layer(layer)
        shape = (self.n_kv_heads, self.max_positions, self.head_dim)
        out = []
        for buffer in (keys, values):
            host = np.empty(shape, np.float16)
            cl.enqueue_copy(device.queue, host, buffer, src_offset=2 * offset)
            out.append(host[:, :positions].transpose(1, 0, 2).astype(np.float32))
        return out[0], out[1]


@dataclass
class RopeTable:
    head_dim: int
    max_positions: int
    cos: object   # cl.Buffer float (max_positions, head_dim/2)
    sin: object

    @classmethod
    def upload(cls, device: Device, head_dim: int, max_positions: int, theta: float,
               scaling: dict | None = None) -> RopeTable:
        cos, sin = reference.rope_tables(np.arange(max_positions), head_dim, theta, scaling)
        return cls(head_dim, max_positions,
                   device.alloc(cos.size * 4, cos.astype(np.float32), what="RoPE cos table"),
                   device.alloc(sin.size * 4, sin.astype(np.float32), what="RoPE sin table"))
