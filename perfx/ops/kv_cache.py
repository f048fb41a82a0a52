"""The KV cache and the RoPE table: device state shared by decode and prefill attention.

KV cache: fp16, keys and values in two buffers laid out [layer][kv_head][pos][head_dim], so one
head's positions are contiguous (the attention kernels stream them). fp16 storage halves the cache
and needs no cl_khr_fp16 (vstore_half / vload_half are core OpenCL).

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
    keys: object     # cl.Buffer of half, [layer][kv_head][pos][head_dim]
    values: object

    @classmethod
    def allocate(cls, device: Device, n_layers: int, n_kv_heads: int, max_positions: int, head_dim: int) -> KVCache:
        layer_bytes = n_kv_heads * max_positions * head_dim * 2
        total = n_layers * layer_bytes
        if total > device.caps.max_alloc:
            raise PerfxError(f"a KV cache of {max_positions} positions needs {total / 2**20:.0f} MiB per K and V, "
                             f"more than one allocation may hold here ({device.caps.max_alloc / 2**20:.0f} MiB, "
                             f"limits: {device.caps.limits}); use a smaller --ctx")
        return cls(n_layers, n_kv_heads, max_positions, head_dim,
                   device.alloc(total, what="KV cache keys"), device.alloc(total, what="KV cache values"))

    def layer_offset(self, layer: int) -> int:
        """Element offset of a layer's block in ``keys`` / ``values``."""
        return layer * self.n_kv_heads * self.max_positions * self.head_dim

    @property
    def nbytes(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.max_positions * self.head_dim * 2

    def read(self, device: Device, layer: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of one layer's keys and values for positions 0..positions−1, as (T, Hkv, D) float32."""
        shape = (self.n_kv_heads, self.max_positions, self.head_dim)
        out = []
        for buffer in (self.keys, self.values):
            host = np.empty(shape, np.float16)
            cl.enqueue_copy(device.queue, host, buffer, src_offset=2 * self.layer_offset(layer))
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
