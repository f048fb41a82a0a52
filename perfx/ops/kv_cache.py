"""The KV cache and the RoPE table: device state shared by decode and prefill attention, and the check of
what both take per launch (window, scale, soft-cap, the q/k norm weights).

KV cache: fp16, keys and values laid out [layer][kv_head][pos][head_dim], so one head's positions are
contiguous (the attention kernels stream them), in pieces of whole layers that each fit the device's
largest allocation. fp16 storage halves the cache and needs no cl_khr_fp16 (vstore_half / vload_half
are core OpenCL).

RoPE table: cos and sin (max_positions, n_rot/2) float32, computed once on the host in float64
from θ and the model's rope_scaling (``perfx.reference.rope_tables``) and uploaded once — never
recomputed per step. n_rot (``rotary_dims``) is the number of leading dimensions of a head that rotate:
head_dim, or fewer for partial rotary (Phi-3, Phi-4-mini). A model whose layers use different θ (Gemma 3's
local and global layers) keeps one table each and passes the layer's to each attention launch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from perfx import reference
from perfx.errors import PerfxError
from perfx.ops import device_buffer
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
                device.fill(buffer, np.uint16(0))

    def write(self, device: Device, keys: np.ndarray, values: np.ndarray) -> None:
        """Fill the whole cache from host arrays (layers, kv_heads, max_positions, head_dim), converted to fp16."""
        shape = (self.n_layers, self.n_kv_heads, self.max_positions, self.head_dim)
        for host, which in ((keys, 0), (values, 1)):
            host = np.ascontiguousarray(host, dtype=np.float16).reshape(shape)
            for i, piece in enumerate(self.pieces):
                block = np.ascontiguousarray(host[i * self.layers_per_piece:(i + 1) * self.layers_per_piece])
                device.write(piece[which], block)

    def read_all(self, device: Device) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the whole cache, (layers, kv_heads, max_positions, head_dim) fp16 each."""
        out = []
        for which in (0, 1):
            blocks = []
            for i, piece in enumerate(self.pieces):
                count = min(self.layers_per_piece, self.n_layers - i * self.layers_per_piece)
                block = np.empty((count, self.n_kv_heads, self.max_positions, self.head_dim), np.float16)
                device.read(block, piece[which])
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
            device.read(host, buffer, src_offset=2 * offset)
            out.append(host[:, :positions].transpose(1, 0, 2).astype(np.float32))
        return out[0], out[1]


@dataclass
class RopeTable:
    head_dim: int
    max_positions: int
    cos: object   # cl.Buffer float (max_positions, rotary_dims/2)
    sin: object
    rotary_dims: int   # n_rot: dimensions 0..n_rot−1 of a head rotate (pairs (i, i + n_rot/2)), the rest pass

    @classmethod
    def upload(cls, device: Device, head_dim: int, max_positions: int, theta: float,
               scaling: dict | None = None, rotary_dims: int | None = None) -> RopeTable:
        """The table for heads of ``head_dim`` rotating their first ``rotary_dims`` dimensions (None: all)."""
        n_rot = head_dim if rotary_dims is None else int(rotary_dims)
        if n_rot <= 0 or n_rot % 2 or n_rot > head_dim:
            raise PerfxError(f"RoPE table: rotary_dims {rotary_dims} must be even and within 2..{head_dim} "
                             f"(head_dim); for a layer without RoPE pass rope=None to the attention instead")
        cos, sin = reference.rope_tables(np.arange(max_positions), n_rot, theta, scaling)
        return cls(head_dim, max_positions,
                   device.alloc(cos.size * 4, cos.astype(np.float32), what="RoPE cos table"),
                   device.alloc(sin.size * 4, sin.astype(np.float32), what="RoPE sin table"), n_rot)


def attention_features(family: str, head_dim: int, qk_norm: bool, window, scale, softcap, q_norm, k_norm, eps,
                       placeholder) -> tuple[int, float, list]:
    """(window, scale, [q_norm, k_norm] buffers to bind) of one attention launch, once each is checked;
    ``placeholder`` is bound for the weights of a kernel built without qk_norm (never read)."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise PerfxError(f"{family}: window must be a whole number ≥ 0 (0: no sliding window), got {window!r}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise PerfxError(f"{family}: scale must be positive and finite (None: 1/√head_dim), got {scale}")
    if not (math.isfinite(float(softcap)) and softcap >= 0):
        raise PerfxError(f"{family}: softcap must be ≥ 0 and finite (0: no soft-cap), got {softcap}")
    if not qk_norm:
        if q_norm is not None or k_norm is not None:
            raise PerfxError(f"{family}: q_norm / k_norm given, but this kernel was built without the q/k "
                             "RMSNorm: make it with qk_norm=True")
        return int(window), scale, [placeholder, placeholder]
    if q_norm is None or k_norm is None:
        raise PerfxError(f"{family}: built with qk_norm=True: pass q_norm and k_norm, the per-head RMSNorm "
                         f"weights ({head_dim} float32 each)")
    if not (math.isfinite(float(eps)) and eps > 0):
        raise PerfxError(f"{family}: eps must be positive and finite, got {eps}")
    buffers = []
    for name, weight in (("q_norm", q_norm), ("k_norm", k_norm)):
        if getattr(weight, "dtype", np.float32) != np.float32:
            raise PerfxError(f"{family}: {name} must be float32 ({head_dim} values), got {weight.dtype}")
        buffers.append(device_buffer(weight, 4 * head_dim, f"{family} {name} ({head_dim} float32)"))
    return int(window), scale, buffers
