"""Prefill attention: RoPE on q and k, k and v appended to the KV cache, causal GQA attention over the prompt.

Two launches of ``kernels/attention_prefill.cl`` on the in-order queue: ``kv_append`` (normalise where built
with qk_norm and rotate k, store k and v as fp16 at positions p0..p0+m−1) and ``attention_prefill`` (the
same for q, flash-attention over positions 0..p0+m−1 with K/V tiles in local memory). p0 > 0 continues a
chat: positions < p0 are read from the cache. The RoPE table, the sliding window, the scale, the soft-cap
and the norm weights are per launch, so one AttentionPrefill serves every layer. With an int8 cache (shape
``kv`` "q8": the build's KV_Q8) the append quantizes each row and the attention dequantizes its tiles.
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.kv_cache import KVCache, RopeTable, attention_features, check_kv_form, kv_shape, sink_buffer
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


# HALF first: where the defaults do not fit, the first set that does (``ParamSpace.resolve``) is an fp32 one
# when one fits. BK 8 is for head_dim 256 within 32 KiB of local memory in fp32 (float K/V tiles of 16
# positions are 32 KiB alone). Head_dim 512 (Gemma 4's global layers): DSPLIT 8 (64 dimensions of q and of the
# accumulator a work-item) with fp32 tiles of 4 or 8 positions (16 or 32 KiB; no HALF there, as for decode).
PARAMS = ParamSpace(
    family="attention_prefill",
    source="attention_prefill.cl",
    space={
        "HALF": (0, 1),        # K/V tiles as half in local memory, q·k in half (cl_khr_fp16)
        "WGS": (32, 16, 64),   # query rows (token, head of the GQA group) per work-group
        "BK": (16, 32, 64, 8, 4),  # key positions per local-memory K/V tile (4: fp32 tiles at head_dim 512)
        "VW": (8, 4),          # vector width along head_dim
        # work-items per query row, each with head_dim / DSPLIT of q and of the output (8: head_dim 512 within
        # the register budget)
        "DSPLIT": (2, 1, 4, 8),
    },
    rules=(
        Rule("each half of a head row must be whole vectors of VW",
             lambda p, s: s["head_dim"] % (2 * p["VW"]) == 0),
        Rule("each work-item's share of a head row must be whole vectors of VW",
             lambda p, s: s["head_dim"] % (p["DSPLIT"] * p["VW"]) == 0),
        # q·k in half over 512 products drifts past HALF's tolerance, as the decode attention's does
        Rule("HALF only up to head_dim 256", lambda p, s: not p["HALF"] or s["head_dim"] <= 256),
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

    ``params``: ``PARAMS`` (HALF, WGS, BK, VW, DSPLIT); None → the defaults, or the first set that fits where
    they do not (head_dim 256: DSPLIT 4). ``shape``: the spec's (``n_heads``, ``n_kv_heads``, ``head_dim``), and
    ``window``, the sliding window of launches that do not name one (0: none), ``qk_norm``: build the
    per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3); every launch then passes its ``q_norm`` and
    ``k_norm`` weights; and ``kv``, the form of the KV caches it appends to and reads ("f16", or "q8").
    """

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        shape = dict(shape or {})
        try:
            n_heads, n_kv_heads, head_dim = int(shape["n_heads"]), int(shape["n_kv_heads"]), int(shape["head_dim"])
        except KeyError as missing:
            raise PerfxError(f"attention_prefill: the shape needs {missing.args[0]!r} (n_heads, n_kv_heads, "
                             "head_dim; optionally window, qk_norm, kv)") from None
        window, qk_norm = int(shape.get("window", 0)), bool(shape.get("qk_norm", False))
        self.v_norm, self.q_only = bool(shape.get("v_norm", False)), bool(shape.get("q_only", False))
        self.sinks = bool(shape.get("sinks", False))   # gpt-oss: a sink logit per head (every launch passes them)
        if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise PerfxError(f"attention_prefill: {n_heads} query heads cannot share {n_kv_heads} kv heads "
                             "(the query heads must be a positive multiple of the kv heads)")
        if head_dim <= 0 or head_dim % 8:
            raise PerfxError(f"attention_prefill: head_dim {head_dim} is not supported; "
                             "it must be a multiple of 8")
        self.kv = check_kv_form(shape.get("kv", "f16"), head_dim, "attention_prefill")
        self.device = device
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.group = n_heads // n_kv_heads
        self.window = int(window)   # sliding window (Mistral): attend to the last `window` positions; 0 = all
        self.qk_norm = bool(qk_norm)
        # The keys the rules read, qk_norm only where set (as tuning/problems.py names it): a set the database
        # checked for this layer's shape is then taken as it is.
        spec_shape = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim,
                      **({"qk_norm": True} if self.qk_norm else {}), **({"v_norm": True} if self.v_norm else {}),
                      **({"q_only": True} if self.q_only else {}), **({"sinks": True} if self.sinks else {}),
                      **kv_shape(self.kv)}
        self.params = params = PARAMS.resolve(params, spec_shape, device.caps)
        defines = {"HEAD_DIM": head_dim, "QK_NORM": int(self.qk_norm), "KV_Q8": int(self.kv == "q8"),
                   "V_NORM": int(self.v_norm), "Q_ONLY": int(self.q_only), "SINKS": int(self.sinks), **params}
        # the append reads none of the tuned parameters: one compiled copy serves every set (``Device.kernel``)
        self.append_kernel = device.kernel(PARAMS.source, "kv_append", defines,
                                           reads=("HEAD_DIM", "QK_NORM", "KV_Q8", "V_NORM"))
        self.attention_kernel = device.kernel(PARAMS.source, "attention_prefill", defines)
        self.wgs = int(params["WGS"])
        # Bound to the table and weight arguments a launch does not read (no RoPE, no qk_norm).
        self.placeholder = device.alloc(4, what="attention_prefill placeholder")

    def _check(self, qkv, out, cache: KVCache, rope: RopeTable | None, layer: int, p0: int, m: int):
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
        if cache.form != self.kv:
            raise PerfxError(f"attention_prefill: the KV cache is {cache.form}, but this kernel was built for a "
                             f"{self.kv} cache: make it with shape kv={cache.form!r}")
        if not 0 <= layer < cache.n_layers:
            raise PerfxError(f"attention_prefill: layer {layer} is outside the KV cache's "
                             f"{cache.n_layers} layers")
        if rope is not None and (rope.head_dim != d or rope.max_positions < p0 + m):
            raise PerfxError(f"attention_prefill: RoPE table ({rope.max_positions} positions × head_dim "
                             f"{rope.head_dim}) does not cover positions < {p0 + m} at head_dim {d}")
        buffers = []
        for name, array, width in (("qkv", qkv, (h + (0 if self.q_only else 2 * hkv)) * d), ("out", out, h * d)):
            shape = getattr(array, "shape", None)
            if shape is not None and (len(shape) != 2 or shape[0] < m or shape[1] != width
                                      or array.dtype != np.float32):
                raise PerfxError(f"attention_prefill: {name} must be float32 (≥ {m}, {width}), got "
                                 f"{getattr(array, 'dtype', '?')} {tuple(shape)}")
            buffers.append(device_buffer(array, 4 * m * width, f"attention_prefill {name}"))
        return buffers

    def enqueue(self, qkv, out, cache: KVCache, rope: RopeTable | None, layer: int, p0: int, m: int, *,
                window: int | None = None, scale: float | None = None, softcap: float = 0.0, q_norm=None,
                k_norm=None, eps: float = 1e-6, sinks=None) -> list:
        """Enqueue both launches; returns [append event, attention event] (for timing). ``sinks``: H float32, each
        query head's sink logit, where built with them (shape ``sinks``)."""
        qkv_b, out_b = self._check(qkv, out, cache, rope, layer, p0, m)
        sinks_b = sink_buffer("attention_prefill", self.sinks, sinks, self.n_heads, self.placeholder)
        window, scale, (q_w, k_w) = attention_features(
            "attention_prefill", self.head_dim, self.qk_norm, self.window if window is None else window,
            scale, softcap, q_norm, k_norm, eps, self.placeholder)
        h, hkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        keys, values, offset = cache.layer(layer)
        scales = cache.scales(layer) or (self.placeholder, self.placeholder)
        offset = np.int32(offset)
        cos, sin = (self.placeholder, self.placeholder) if rope is None else (rope.cos, rope.sin)
        n_rot = np.int32(0 if rope is None else rope.rotary_dims)
        # q_only: the layer reads what another layer appended (Gemma 4's KV sharing): nothing to append
        append = None if self.q_only else self.device.launch(
            self.append_kernel, (d // 8, hkv, m), (d // 8, 1, 1),
            np.int32(p0), np.int32(h), np.int32(hkv), np.int32(cache.max_positions), offset,
            qkv_b, cos, sin, n_rot, k_w, np.float32(eps), keys, values, *scales)
        rows = m * self.group
        split = int(self.params["DSPLIT"])
        attention = self.device.launch(
            self.attention_kernel, (-(-rows // self.wgs) * self.wgs * split, hkv), (self.wgs * split, 1),
            np.int32(m), np.int32(p0), np.int32(self.group), np.int32(h), np.int32(hkv),
            np.int32(cache.max_positions), offset, np.float32(scale),
            qkv_b, cos, sin, n_rot, q_w, np.float32(eps), keys, values, *scales, out_b, np.int32(window),
            np.float32(softcap), sinks_b)
        return [attention] if append is None else [append, attention]

    def __call__(self, qkv, out, cache: KVCache, rope: RopeTable | None, layer: int, p0: int, m: int,
                 **features):
        """out (m, H·D) = causal attention of the m tokens of ``qkv`` (m, (H + 2·Hkv)·D) at p0..p0+m−1.

        Normalises q and k per head (built with qk_norm: ``q_norm``, ``k_norm`` weights of head_dim float32,
        ``eps``), rotates them (``rope``; None: no RoPE in this layer), appends k and v to ``cache`` at
        ``layer``, positions p0..p0+m−1 (positions < p0 must already be there), and returns the attention's
        cl.Event (the append runs before it on the in-order queue). Scores are q·k·``scale`` (None:
        1/√head_dim), soft-capped by ``softcap`` (0: off), over the last ``window`` positions (None: the
        constructor's; 0: all). ``qkv``, ``out`` and the weights are pyopencl Arrays or cl.Buffers.
        """
        return self.enqueue(qkv, out, cache, rope, layer, p0, m, **features)[-1]
