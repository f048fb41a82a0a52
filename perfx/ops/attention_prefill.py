"""Prefill attention: RoPE on q and k, k and v appended to the KV cache, causal GQA attention over the prompt.

Two launches of ``kernels/attention_prefill.cl`` on the in-order queue: ``kv_append`` (rotate k, store k and
v as fp16 at positions p0..p0+m−1) and ``attention_prefill`` (rotate q, flash-attention over positions
0..p0+m−1 with K/V tiles in local memory). p0 > 0 continues a chat: positions < p0 are read from the cache.
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.kv_cache import KVCache, RopeTable
from perfx.ops.params import FP16_NEED, ParamSpace, Rule
from perfx.runtime import Device

# Registers a work-item may spend on its slice of q, its output accumulator and the tile's scores (32-bit
# values): a GPU keeps ~128–256 per work-item before occupancy collapses or the compiler spills, and the
# K/V vectors, addresses and softmax state need the rest. Today's kernel at D = 128 (q[128], acc[128]) is
# 256 alone.
REGISTER_BUDGET = 160


def registers(params, shape) -> int:
    """32-bit registers for q (half: two per register), the accumulator and the scores of one work-item."""
    dp = shape["head_dim"] // params["DSPLIT"]
    return (dp // 2 if params["HALF"] else dp) + dp + params["BK"]


def local_memory(params, shape) -> int:
    """K and V tiles (float, or half with HALF) and, where parts share a row, their partial scores."""
    tiles = 2 * params["BK"] * shape["head_dim"] * (2 if params["HALF"] else 4)
    partial = 4 * params["WGS"] * params["BK"] * params["DSPLIT"] if params["DSPLIT"] > 1 else 0
    return tiles + partial


PARAMS = ParamSpace(
    family="attention_prefill",
    source="attention_prefill.cl",
    space={
        "WGS": (32, 16, 64),   # query rows (token, head of the GQA group) per work-group
        "BK": (16, 32, 64),    # key positions per local-memory K/V tile
        "VW": (8, 4),          # vector width along head_dim
        "DSPLIT": (2, 1, 4),   # work-items per query row, each with head_dim / DSPLIT of q and of the output
        "HALF": (0, 1),        # K/V tiles as half in local memory, q·k in half (cl_khr_fp16)
    },
    rules=(
        Rule("each half of a head row must be whole vectors of VW",
             lambda p, s: s["head_dim"] % (2 * p["VW"]) == 0),
        Rule("each work-item's share of a head row must be whole vectors of VW",
             lambda p, s: s["head_dim"] % (p["DSPLIT"] * p["VW"]) == 0),
        Rule(f"at most {REGISTER_BUDGET} registers of q, accumulator and scores per work-item "
             "(head_dim/DSPLIT twice, halved for an fp16 q, plus BK)",
             lambda p, s: registers(p, s) <= REGISTER_BUDGET),
    ),
    work_group_size=lambda p, s: p["WGS"] * p["DSPLIT"],
    local_memory=local_memory,
    needs={"HALF": FP16_NEED},
)


class AttentionPrefill:
    """Causal RoPE + KV append + attention for ``m`` prompt tokens of one layer.

    ``params``: ``PARAMS`` (WGS, BK, VW, DSPLIT, HALF); None → the defaults, or the first set that fits where
    they do not.
    """

    def __init__(self, device: Device, n_heads: int, n_kv_heads: int, head_dim: int,
                 params: dict | None = None, window: int = 0):
        if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise PerfxError(f"attention_prefill: {n_heads} query heads cannot share {n_kv_heads} kv heads "
                             "(the query heads must be a positive multiple of the kv heads)")
        if head_dim <= 0 or head_dim % 8:
            raise PerfxError(f"attention_prefill: head_dim {head_dim} is not supported; "
                             "it must be a multiple of 8")
        self.device = device
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.group = n_heads // n_kv_heads
        self.window = int(window)   # sliding window (Mistral): attend to the last `window` positions; 0 = all
        shape = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim, "m": 1, "p0": 0}
        self.params = params = PARAMS.resolve(params, shape, device.caps)
        defines = {"HEAD_DIM": head_dim, **params}
        self.append_kernel = device.kernel(PARAMS.source, "kv_append", defines)
        self.attention_kernel = device.kernel(PARAMS.source, "attention_prefill", defines)
        self.wgs = int(params["WGS"])
        self.scale = np.float32(1.0 / np.sqrt(head_dim))

    def _check(self, qkv, out, cache: KVCache, rope: RopeTable, layer: int, p0: int, m: int):
        """The buffers behind qkv and out, once every argument is checked."""
        h, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        if m <= 0 or p0 < 0:
            raise PerfxError(f"attention_prefill: needs m ≥ 1 tokens at p0 ≥ 0, got m={m}, p0={p0}")
        if p0 + m > cache.max_positions:
            raise PerfxError(f"attention_prefill: the prompt is longer than the context: positions "
                             f"{p0}..{p0 + m - 1} need {p0 + m} cache positions, the KV cache holds "
                             f"{cache.max_positions} ({p0 + m - cache.max_positions} too many); "
                             "use a larger --ctx or a shorter prompt")
        if (cache.n_kv_heads, cache.head_dim) != (hkv, d):
            raise PerfxError(f"attention_prefill: KV cache of {cache.n_kv_heads} kv heads × {cache.head_dim} "
                             f"does not match this layer's {hkv} × {d}")
        if not 0 <= layer < cache.n_layers:
            raise PerfxError(f"attention_prefill: layer {layer} is outside the KV cache's "
                             f"{cache.n_layers} layers")
        if rope.head_dim != d or rope.max_positions < p0 + m:
            raise PerfxError(f"attention_prefill: RoPE table ({rope.max_positions} positions × head_dim "
                             f"{rope.head_dim}) does not cover positions < {p0 + m} at head_dim {d}")
        buffers = []
        for name, array, width in (("qkv", qkv, (h + 2 * hkv) * d), ("out", out, h * d)):
            shape = getattr(array, "shape", None)
            if shape is not None and (len(shape) != 2 or shape[0] < m or shape[1] != width
                                      or array.dtype != np.float32):
                raise PerfxError(f"attention_prefill: {name} must be float32 (≥ {m}, {width}), got "
                                 f"{getattr(array, 'dtype', '?')} {tuple(shape)}")
            buffers.append(device_buffer(array, 4 * m * width, f"attention_prefill {name}"))
        return buffers

    def enqueue(self, qkv, out, cache: KVCache, rope: RopeTable, layer: int, p0: int, m: int) -> list:
        """Enqueue both launches; returns [append event, attention event] (for timing)."""
        qkv_b, out_b = self._check(qkv, out, cache, rope, layer, p0, m)
        h, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        keys, values, offset = cache.layer(layer)
        offset = np.int32(offset)
        append = self.device.launch(
            self.append_kernel, (d // 8, hkv, m), None,
            np.int32(p0), np.int32(h), np.int32(hkv), np.int32(cache.max_positions), offset,
            qkv_b, rope.cos, rope.sin, keys, values)
        rows = m * self.group
        split = int(self.params["DSPLIT"])
        attention = self.device.launch(
            self.attention_kernel, (-(-rows // self.wgs) * self.wgs * split, hkv), (self.wgs * split, 1),
            np.int32(m), np.int32(p0), np.int32(self.group), np.int32(h), np.int32(hkv),
            np.int32(cache.max_positions), offset, self.scale,
            qkv_b, rope.cos, rope.sin, keys, values, out_b, np.int32(self.window))
        return [append, attention]

    def __call__(self, qkv, out, cache: KVCache, rope: RopeTable, layer: int, p0: int, m: int):
        """out (m, H·D) = causal attention of the m tokens of ``qkv`` (m, (H + 2·Hkv)·D) at p0..p0+m−1.

        Rotates q and k, appends k and v to ``cache`` at ``layer``, positions p0..p0+m−1 (positions < p0
        must already be there), and returns the attention's cl.Event (the append runs before it on the
        in-order queue). ``qkv`` and ``out`` are pyopencl Arrays or cl.Buffers.
        """
        return self.enqueue(qkv, out, cache, rope, layer, p0, m)[-1]
