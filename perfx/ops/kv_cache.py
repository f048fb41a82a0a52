"""The KV cache and the RoPE table: device state shared by decode and prefill attention, and the check of
what both take per launch (window, scale, soft-cap, the q/k norm weights).

KV cache: keys and values laid out [layer][kv_head][pos][head_dim], so one head's positions are
contiguous (the attention kernels stream them), in pieces of whole layers that each fit the device's
largest allocation. Two forms, chosen by the model (``form``), read by one code path of each attention
kernel (its KV_Q8 define):
  f16: fp16 values; halves a float cache and needs no cl_khr_fp16 (vstore_half / vload_half are core OpenCL).
  q8:  llama.cpp's q8_0 cache (``perfx.reference.quantize_kv_q8``): int8 codes [layer][kv_head][pos][head_dim]
       and, in a buffer of their own, one fp16 scale per 32 codes, [layer][kv_head][pos][head_dim/32], so a
       work-item's run of codes and the scales of a row are each read in whole contiguous loads. 1.0625 bytes
       a value against 2: at long contexts the cache is what a decode step reads most. Quantized where the
       attention kernels append a row, dequantized where they read one.

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


KV_FORMS = ("f16", "q8")


def check_kv_form(form: str, head_dim: int, what: str) -> str:
    """``form`` once it is a KV cache form this head size may take (q8: whole blocks of 32 per row)."""
    if form not in KV_FORMS:
        raise PerfxError(f"{what}: KV cache form {form!r} is not one of {', '.join(KV_FORMS)}")
    if form == "q8" and head_dim % reference.KV_BLOCK:
        raise PerfxError(f"{what}: an int8 KV cache quantizes rows in blocks of {reference.KV_BLOCK}, and head_dim "
                         f"{head_dim} is not a multiple of it; use --kv f16 for this model")
    return form


def kv_shape(form: str) -> dict:
    """The attention kernels' shape key for the KV cache's form, which changes their build: set for q8 only,
    so an fp16 shape is the one it has always been (as tuned)."""
    return {} if form == "f16" else {"kv": form}


@dataclass
class KVCache:
    n_layers: int
    n_kv_heads: int
    max_positions: int
    head_dim: int
    pieces: list                 # (keys, values) cl.Buffers, each [layer][kv_head][pos][head_dim] (half or int8)
    layers_per_piece: int        # for this many consecutive layers (the last piece may hold fewer)
    form: str = "f16"            # "f16" or "q8"
    scale_pieces: list | None = None  # q8: (key scales, value scales) per piece, [layer][kv_head][pos][D/32] half

    @classmethod
    def allocate(cls, device: Device, n_layers: int, n_kv_heads: int, max_positions: int, head_dim: int,
                 form: str = "f16") -> KVCache:
        """Keys and values in pieces of whole layers, each within the device's largest allocation (a 7B model
        at 4096 positions needs 1 GiB per K and V in fp16; some phones allow 256 MiB at once) and within the
        kernels' int element offsets. ``form``: "f16" or "q8" (int8 codes and fp16 scales per 32)."""
        form = check_kv_form(form, head_dim, "KVCache")
        layer_elements = n_kv_heads * max_positions * head_dim
        value_bytes = 2 if form == "f16" else 1
        layer_bytes = value_bytes * layer_elements     # the largest buffer's share of one layer: K (or V) codes
        if layer_bytes > device.caps.max_alloc or layer_elements >= 2**31:
            raise PerfxError(f"a KV cache of {max_positions} positions needs {layer_bytes / 2**20:.0f} MiB per layer "
                             f"for K and as much for V, more than one allocation may hold here "
                             f"({device.caps.max_alloc / 2**20:.0f} MiB, limits: {device.caps.limits}); "
                             "use a smaller --ctx" + (" or --kv q8" if form == "f16" else ""))
        per_piece = max(1, min(n_layers, device.caps.max_alloc // layer_bytes, (2**31 - 1) // layer_elements))
        pieces, scale_pieces = [], [] if form == "q8" else None
        for first in range(0, n_layers, per_piece):
            count = min(per_piece, n_layers - first)
            what = f"KV cache layers {first}-{first + count - 1}"
            pieces.append((device.alloc(count * layer_bytes, what=f"{what} keys"),
                           device.alloc(count * layer_bytes, what=f"{what} values")))
            if form == "q8":
                scale_bytes = count * layer_elements // reference.KV_BLOCK * 2
                scale_pieces.append((device.alloc(scale_bytes, what=f"{what} key scales"),
                                     device.alloc(scale_bytes, what=f"{what} value scales")))
        return cls(n_layers, n_kv_heads, max_positions, head_dim, pieces, per_piece, form, scale_pieces)

    def _layer_elements(self) -> int:
        return self.n_kv_heads * self.max_positions * self.head_dim

    def _piece_layers(self, i: int) -> int:
        return min(self.layers_per_piece, self.n_layers - i * self.layers_per_piece)

    def layer(self, layer: int) -> tuple[object, object, int]:
        """(keys buffer, values buffer, element offset of the layer's block in them) of one layer; with q8 the
        scales' offset is the element offset / 32 (``scales``)."""
        keys, values = self.pieces[layer // self.layers_per_piece]
        return keys, values, (layer % self.layers_per_piece) * self._layer_elements()

    def scales(self, layer: int) -> tuple[object, object] | None:
        """(key scales, value scales) buffers of one layer's piece (q8), None for fp16."""
        return None if self.form == "f16" else self.scale_pieces[layer // self.layers_per_piece]

    @property
    def nbytes(self) -> int:
        """K and V together: fp16 values, or int8 codes and one fp16 scale per 32."""
        values = 2 * self.n_layers * self._layer_elements()
        return values * 2 if self.form == "f16" else values + values // reference.KV_BLOCK * 2

    def _buffers(self):
        """(buffer, kind) of every allocation: kind "values" (fp16 values or int8 codes) or "scales"."""
        for piece in self.pieces:
            yield from ((buffer, "values") for buffer in piece)
        for piece in self.scale_pieces or ():
            yield from ((buffer, "scales") for buffer in piece)

    def fill(self, device: Device, value: float) -> None:
        """Every position of every layer holding ``value`` (q8: code 1 times the fp16 scale ``value``; 0: all
        codes and scales 0)."""
        half = np.float16(value).view(np.uint16)
        for buffer, kind in self._buffers():
            device.fill(buffer, np.int8(value != 0) if self.form == "q8" and kind == "values" else half)

    def clear(self, device: Device) -> None:
        """Zero every position (the model never reads a position it has not written; tests may)."""
        self.fill(device, 0.0)

    def copy_prefix(self, device: Device, dst: KVCache, positions: int) -> None:
        """Positions 0..positions−1 of every layer and head copied into ``dst`` (a cache of the same shape and
        form) on the device: one copy per (layer, kv head) run of keys and of values (and of q8 scales), each
        run contiguous in the [layer][kv_head][pos][...] layout. What ``dst`` holds past them is left as is."""
        if (dst.n_layers, dst.n_kv_heads, dst.max_positions, dst.head_dim, dst.form) != (
                self.n_layers, self.n_kv_heads, self.max_positions, self.head_dim, self.form):
            raise PerfxError("KVCache.copy_prefix: the two caches differ in shape or form")
        if not 0 <= positions <= self.max_positions:
            raise PerfxError(f"KVCache.copy_prefix: {positions} positions, the cache holds {self.max_positions}")
        runs = [(self.pieces, dst.pieces, (2 if self.form == "f16" else 1) * self.head_dim)]
        if self.form == "q8":
            runs.append((self.scale_pieces, dst.scale_pieces, 2 * self.head_dim // reference.KV_BLOCK))
        for sources, targets, row_bytes in runs:
            for i, (source, target) in enumerate(zip(sources, targets)):
                for block in range(self._piece_layers(i) * self.n_kv_heads):
                    offset = block * self.max_positions * row_bytes
                    for which in (0, 1):
                        device.copy(target[which], source[which], positions * row_bytes, offset, offset)

    def write(self, device: Device, keys: np.ndarray, values: np.ndarray) -> None:
        """Fill the whole cache from host arrays (layers, kv_heads, max_positions, head_dim): converted to fp16,
        or quantized by ``reference.quantize_kv_q8`` (NaN blocks get NaN scales)."""
        shape = (self.n_layers, self.n_kv_heads, self.max_positions, self.head_dim)
        for host, which in ((keys, 0), (values, 1)):
            host = np.asarray(host).reshape(shape)
            parts = ([host.astype(np.float16)] if self.form == "f16" else list(reference.quantize_kv_q8(host)))
            for pieces, part in zip((self.pieces, self.scale_pieces), parts):
                for i, piece in enumerate(pieces):
                    block = part[i * self.layers_per_piece:(i + 1) * self.layers_per_piece]
                    device.write(piece[which], np.ascontiguousarray(block))

    def read_stored(self, device: Device) -> tuple[np.ndarray, ...]:
        """Host copies of the whole cache as stored, (layers, kv_heads, max_positions, ...) each: f16 (keys,
        values) fp16; q8 (key codes, value codes) int8 and (key scales, value scales) fp16 (.., head_dim/32)."""
        d = self.head_dim
        parts = ([(self.pieces, np.float16, d)] if self.form == "f16" else
                 [(self.pieces, np.int8, d), (self.scale_pieces, np.float16, d // reference.KV_BLOCK)])
        out = []
        for pieces, dtype, width in parts:
            for which in (0, 1):
                blocks = []
                for i, piece in enumerate(pieces):
                    block = np.empty((self._piece_layers(i), self.n_kv_heads, self.max_positions, width), dtype)
                    device.read(block, piece[which])
                    blocks.append(block)
                out.append(np.concatenate(blocks))
        return tuple(out)

    def read_all(self, device: Device) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of the whole cache's keys and values, (layers, kv_heads, max_positions, head_dim): fp16,
        or float32 codes times their scales (exact) for q8."""
        stored = self.read_stored(device)
        if self.form == "f16":
            return stored
        return tuple(reference.dequantize_kv_q8(codes, scales).astype(np.float32)
                     for codes, scales in zip(stored[:2], stored[2:]))

    def read(self, device: Device, layer: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of one layer's keys and values for positions 0..positions−1, as (T, Hkv, D) float32
        (q8: dequantized)."""
        keys, values, offset = self.layer(layer)
        shape = (self.n_kv_heads, self.max_positions, self.head_dim)
        if self.form == "q8":
            out = []
            for codes_buffer, scales_buffer in zip((keys, values), self.scales(layer)):
                codes = np.empty(shape, np.int8)
                scales = np.empty(shape[:2] + (self.head_dim // reference.KV_BLOCK,), np.float16)
                device.read(codes, codes_buffer, src_offset=offset)
                device.read(scales, scales_buffer, src_offset=2 * offset // reference.KV_BLOCK)
                host = reference.dequantize_kv_q8(codes[:, :positions], scales[:, :positions])
                out.append(host.transpose(1, 0, 2).astype(np.float32))
            return out[0], out[1]
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


def sink_buffer(family: str, built: bool, sinks, n_heads: int, placeholder):
    """The buffer of the sink logits (H float32) a launch binds: ``sinks`` where the kernel was built with them,
    the placeholder (never read) where not; a clear error where the two disagree."""
    if built != (sinks is not None):
        raise PerfxError(f"{family}: " + ("built with attention sinks: pass sinks, one float32 logit per query head"
                                          if built else "sinks given, but this kernel was built without them: make "
                                          "it with shape sinks=True"))
    return device_buffer(sinks, 4 * n_heads, f"{family} sinks") if built else placeholder


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
