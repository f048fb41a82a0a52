"""Decode attention: RoPE on q and k, k and v appended to the KV cache, GQA attention for one new token.

Flash-decoding with ``kernels/attention_decode.cl`` in one launch: ``attention_partial`` (one work-group per kv
head, group of ``heads`` query heads and partition of PART positions: per-head RMSNorm of q and k where built
with it, RoPE, the append by the partition that holds the new position, partial softmax and weighted V), the
online-softmax merge of the partitions done by the last work-group of each (kv head, head group) to finish (a
counter per grid row, this wrapper's, zeroed once; the kernel leaves it at zero). The RoPE table, the sliding
window, the scale, the soft-cap and the norm weights are per launch, so one AttentionDecode serves every layer
of a model whose layers differ in them. The position is read on the device, from an int32 buffer (the model's
decode step buffer, or the wrapper's own): a launch recorded once serves every position with the same number of
partitions. The KV cache's form (fp16, or int8 codes with fp16 scales: ``kv`` "q8") is part of the shape, since
the model decides it: it sets the build (KV_Q8), and every launch's cache must have it.
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import DevicePosition, buffer_bytes, device_buffer
from perfx.ops.kv_cache import KVCache, RopeTable, attention_features, check_kv_form, kv_shape, sink_buffer
from perfx.ops.params import FP16_NEED, ParamSpace, Rule
from perfx.runtime import Device

# head_dim: even and whole vectors of 8 (both VW values); 64 and 128 are the tested Llama sizes, 512 Gemma 4's
# global layers'.
SUPPORTED_HEAD_DIMS = tuple(range(32, 513, 8))
# Rows of a batched decode step one launch serves (the kernel's BATCH): each row's cache is an argument of its own.
BATCH_ROWS = 8
# The local memory a work-group may take: Adreno's 32 KiB (other GPUs have 48–64). Where all GQA query heads of a
# kv head would need more (Gemma 4 E2B: 8 heads of 512 on one kv head), fewer share a work-group (``heads``).
LOCAL_BUDGET = 32 * 1024


def lanes(params, shape) -> int:
    """Work-items that share one K/V row: head_dim / VW."""
    return shape["head_dim"] // params["VW"]


def local_memory(params, shape, heads: int | None = None) -> int:
    """Mirrors the kernel's __local arrays for ``heads`` query heads a work-group (default ``heads_per_group``):
    q, the fresh k/v (fp16; q8: fp32, codes and scales), sums of squares / scores / partial V sums, reductions,
    the combine's flag, and with a norm the 1/rms of each row."""
    gqa, d = (heads or heads_per_group(params, shape)), shape["head_dim"]
    rows = params["WGS"] // lanes(params, shape)
    work = max(gqa * params["PART"], rows * gqa * d, (gqa + 2) * params["WGS"])
    q_half = 2 * gqa * d if params["HALF"] else 2
    inv_rms = gqa + 2 if shape.get("qk_norm") or shape.get("v_norm") else 0
    fresh = 2 + 4 * 2 * d + 2 * d + 2 * 2 * d // 32 if shape.get("kv") == "q8" else 2 * 2 * d + 4 + 1 + 2
    return 4 * (gqa * d + work + gqa * params["WGS"] + 2 * gqa + inv_rms + 1) + fresh + q_half


def heads_per_group(params, shape) -> int:
    """The query heads one work-group serves (the kernel's HEADS): all GQA of a kv head, or the most of them, a
    divisor of GQA, whose local memory fits ``LOCAL_BUDGET`` (1 at least)."""
    gqa = shape["n_heads"] // shape["n_kv_heads"]
    fitting = [h for h in range(gqa, 0, -1) if gqa % h == 0 and local_memory(params, shape, h) <= LOCAL_BUDGET]
    return fitting[0] if fitting else 1


PARAMS = ParamSpace(
    family="attention_decode",
    source="attention_decode.cl",
    space={
        "PART": (128, 32, 256),  # positions per partition (one work-group per kv head and partition)
        # work-items per partition work-group; not 32: half an Adreno wave (PoCL showed no gain from it)
        "WGS": (64, 128),
        "VW": (8, 4),            # halfs per K/V load along head_dim
        "HALF": (0, 1),          # q·k in half against the half key rows (cl_khr_fp16)
    },
    rules=(
        Rule("head_dim must be whole vectors of VW", lambda p, s: s["head_dim"] % p["VW"] == 0),
        Rule("WGS must hold at least one whole V row (head_dim / VW work-items)",
             lambda p, s: p["WGS"] >= lanes(p, s)),
        # q·k in half over 512 products drifts past HALF's 5e-3 (6.3e-3 measured on Intel's runtime at D = 512)
        Rule("HALF only up to head_dim 256", lambda p, s: not p["HALF"] or s["head_dim"] <= 256),
    ),
    work_group_size=lambda p, s: p["WGS"],
    local_memory=local_memory,
    needs={"HALF": FP16_NEED},
)


class AttentionDecode:
    """RoPE + KV-cache append + attention of one token at position ``pos`` for one layer.

    ``params``: ``PARAMS`` (PART, WGS, VW, HALF); None → the defaults, or the first set that fits where they
    do not. ``shape``: the spec's (``n_heads``, ``n_kv_heads``, ``head_dim``, ``positions``: partial buffers for
    contexts of up to that many are allocated here, once), and ``window``, the sliding window of launches that
    do not name one (0: none), ``qk_norm``: build the per-head RMSNorm of q and k before RoPE (Qwen3,
    Gemma 3); every launch then passes its ``q_norm`` and ``k_norm`` weights; and ``kv``, the form of the KV
    caches it reads and appends to ("f16", the default, or "q8"). The build made here (where a refusal of the
    driver's limits shows) is the one the shape says its launches take: with ``rows`` the batched one (``rows``),
    with ``q8_out`` the one writing out as Q8_1 blocks too (``enqueue``'s ``quantized``), else the plain one; any
    other is built at its first launch.
    """

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        shape = dict(shape or {})
        try:
            n_heads, n_kv_heads = int(shape["n_heads"]), int(shape["n_kv_heads"])
            head_dim, max_positions = int(shape["head_dim"]), int(shape["positions"])
        except KeyError as missing:
            raise PerfxError(f"attention_decode: the shape needs {missing.args[0]!r} (n_heads, n_kv_heads, head_dim, "
                             "positions; optionally window, qk_norm, kv)") from None
        window, qk_norm = int(shape.get("window", 0)), bool(shape.get("qk_norm", False))
        v_norm, q_only = bool(shape.get("v_norm", False)), bool(shape.get("q_only", False))
        self.sinks = bool(shape.get("sinks", False))   # gpt-oss: a sink logit per head (every launch passes them)
        if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise PerfxError(f"attention_decode: {n_heads} query heads cannot share {n_kv_heads} kv heads "
                             "(the query heads must be a positive multiple of the kv heads)")
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise PerfxError(f"attention_decode: head_dim {head_dim} is not supported; supported: multiples "
                             f"of 8 from {SUPPORTED_HEAD_DIMS[0]} to {SUPPORTED_HEAD_DIMS[-1]} "
                             f"({', '.join(map(str, SUPPORTED_HEAD_DIMS))})")
        if max_positions <= 0:
            raise PerfxError(f"attention_decode: max_positions must be positive, got {max_positions}")
        self.kv = check_kv_form(shape.get("kv", "f16"), head_dim, "attention_decode")
        self.device = device
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.max_positions = max_positions
        self.window = int(window)   # sliding window (Mistral): attend to the last `window` positions; 0 = all
        self.qk_norm = bool(qk_norm)
        self.v_norm, self.q_only = v_norm, q_only   # Gemma 4: v normed; q alone, reading another layer's cache
        spec_shape = {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim, "positions": max_positions,
                      **({"qk_norm": True} if self.qk_norm else {}), **({"v_norm": True} if v_norm else {}),
                      **({"q_only": True} if q_only else {}), **({"sinks": True} if self.sinks else {}),
                      **kv_shape(self.kv)}
        self.params = params = PARAMS.resolve(params, spec_shape, device.caps)
        self.heads = heads_per_group(params, spec_shape)
        self.defines = {"HEAD_DIM": head_dim, "GQA": n_heads // n_kv_heads, "QK_NORM": int(self.qk_norm),
                        "KV_Q8": int(self.kv == "q8"), "HEADS": self.heads, "V_NORM": int(v_norm),
                        "Q_ONLY": int(q_only), "SINKS": int(self.sinks), **params}
        self._kernels: dict[bool, object] = {}
        # Built now, so that a refusal shows at load: the build the shape says its launches take (``rows``: the
        # batched one; ``q8_out``: the one writing Q8_1 blocks too), else the plain one. Only that: a check or
        # a tuning candidate builds no program it never launches.
        if shape.get("rows"):
            self.rows_kernel()
        else:
            self.kernels(bool(shape.get("q8_out")))
        self.part = int(params["PART"])
        self.wgs = int(params["WGS"])
        self.max_parts = -(-max_positions // self.part)
        stats = n_heads * self.max_parts
        # Zeroed once: the combine reads them with atomics, whose stores Oclgrind's uninitialised-value check does
        # not follow; a partial a launch failed to write reads 0 and fails the reference, so this hides nothing.
        zeros = np.zeros(stats * head_dim, np.float32)
        self.part_max = device.alloc(4 * stats, zeros[:stats], what="attention_decode partial maxima")
        self.part_sum = device.alloc(4 * stats, zeros[:stats], what="attention_decode partial sums")
        self.part_out = device.alloc(4 * stats * head_dim, zeros, what="attention_decode partial outputs")
        # the arrivals at each head group's combine (a kv head's GQA/HEADS groups of query heads, one row of the
        # grid each); zero between launches (the last arrival resets its own)
        self.groups = n_kv_heads * (n_heads // n_kv_heads // self.heads)
        self.counters = device.alloc(4 * self.groups, np.zeros(self.groups, np.int32),
                                     what="attention_decode combine counters")
        self.qkv_size = (n_heads + (0 if q_only else 2 * n_kv_heads)) * head_dim
        # Bound to the table and weight arguments a launch does not read (no RoPE, no qk_norm).
        self.placeholder = device.alloc(4, what="attention_decode placeholder")
        self.position = DevicePosition(device, "attention_decode")
        self.last_events: list = []
        self._rows = None   # the batched kernel, its partials and counters (``_rows_state``)

    def kernels(self, quantizes: bool):
        """attention_partial, built to also write out as Q8_1 blocks where ``quantizes``."""
        kernel = self._kernels.get(quantizes)
        if kernel is None:
            defines = {**self.defines, "Q8_OUT": int(quantizes)}
            kernel = self._kernels[quantizes] = self.device.kernel(PARAMS.source, "attention_partial", defines)
        return kernel

    def rows(self, qkv, out, caches: list[KVCache], rope: RopeTable | None, layer: int, positions: list[int],
             qkv_stride: int, first: int = 0, *, position, window: int | None = None, scale: float | None = None,
             softcap: float = 0.0, q_norm=None, k_norm=None, eps: float = 1e-6, sinks=None) -> list:
        """Rows first .. first + n − 1 of a batched decode step in one launch (n = len(caches), 1 to BATCH_ROWS):
        row i (from first) is qkv's [q | k | v] at element i·``qkv_stride``, its token at ``positions``[i − first]
        over ``caches``[i − first] (each sequence's own KV cache, all of one shape and form), its out at element
        i·H·D. ``position``: (int32 buffer, index) where row 0's position is read on the device, row i's at
        index + i. The features are ``enqueue``'s, one layer's for every row. Returns the events ([the launch])."""
        n = len(caches)
        if not 1 <= n <= BATCH_ROWS or len(positions) != n:
            raise PerfxError(f"attention_decode: one launch serves 1 to {BATCH_ROWS} rows, each with its cache and "
                             f"position; got {n} caches and {len(positions)} positions")
        for i, (cache, pos) in enumerate(zip(caches, positions)):
            qkv_b, _ = self._check(qkv, out, cache, rope, layer, pos, (first + i) * qkv_stride)
            if (cache.max_positions, cache.n_layers) != (caches[0].max_positions, caches[0].n_layers):
                raise PerfxError("attention_decode: a batched launch's caches must all have one shape")
        out_b, out_bytes = buffer_bytes(out, "attention_decode out")
        if out_bytes // 4 < (first + n) * self.n_heads * self.head_dim:
            raise PerfxError(f"attention_decode: out must hold {first + n} rows of {self.n_heads * self.head_dim} "
                             f"float32 elements, it holds {out_bytes // 4}")
        sinks_b = sink_buffer("attention_decode", self.sinks, sinks, self.n_heads, self.placeholder)
        window, scale, norms = attention_features(
            "attention_decode", self.head_dim, self.qk_norm, self.window if window is None else window,
            scale, softcap, q_norm, k_norm, eps, self.placeholder)
        kernel, part_max, part_sum, part_out, counters = self._rows_state()
        buffers = []
        for cache in list(caches) + [caches[0]] * (BATCH_ROWS - n):   # rows past n: never read
            keys, values, _ = cache.layer(layer)
            buffers.append((keys, values, *(cache.scales(layer) or (self.placeholder, self.placeholder))))
        offset = caches[0].layer(layer)[2]
        grid_parts = max(self.partitions(pos) for pos in positions)
        cos, sin = (self.placeholder, self.placeholder) if rope is None else (rope.cos, rope.sin)
        buffer, index = position
        launch = self.device.launch(
            kernel, (self.wgs, self.groups, n * grid_parts), (self.wgs, 1, 1),
            qkv_b, np.int32(0), cos, sin, np.int32(0 if rope is None else rope.rotary_dims),
            *norms, np.float32(eps), *buffers[0], np.int32(offset), np.int32(caches[0].max_positions),
            device_buffer(buffer, 4 * (index + first + n), "attention_decode positions"), np.int32(index),
            np.int32(self.max_parts), part_max, part_sum, part_out, out_b, np.int32(window), np.float32(scale),
            np.float32(softcap), sinks_b, counters, np.int32(n), np.int32(first), np.int32(qkv_stride),
            *(b for row in buffers[1:] for b in row))
        self.last_events = [launch]
        return self.last_events

    def rows_kernel(self):
        """The batched build (``rows``), made now (while the device collects builds, only asked for: its buffers
        are made by ``rows`` at its first launch)."""
        return self.device.kernel(PARAMS.source, "attention_partial", {**self.defines, "Q8_OUT": 0, "BATCH": BATCH_ROWS})

    def rows_counters(self) -> np.ndarray:
        """The batched launch's combine counters, read back (each is zero between launches)."""
        counters = self._rows_state()[4]
        return self.device.read(np.empty(BATCH_ROWS * self.groups, np.int32), counters)

    def _rows_state(self) -> tuple:
        """The batched kernel (BATCH rows a launch) and its partials and counters, one block a row: made on first
        use, as a model that never batches needs neither."""
        if self._rows is None:
            kernel = self.rows_kernel()
            stats = BATCH_ROWS * self.n_heads * self.max_parts
            zeros = np.zeros(stats * self.head_dim, np.float32)
            self._rows = (kernel,
                          self.device.alloc(4 * stats, zeros[:stats], what="attention_decode rows' partial maxima"),
                          self.device.alloc(4 * stats, zeros[:stats], what="attention_decode rows' partial sums"),
                          self.device.alloc(4 * stats * self.head_dim, zeros,
                                            what="attention_decode rows' partial outputs"),
                          self.device.alloc(4 * BATCH_ROWS * self.groups,
                                            np.zeros(BATCH_ROWS * self.groups, np.int32),
                                            what="attention_decode rows' combine counters"))
        return self._rows

    def partitions(self, pos: int) -> int:
        """Work-groups per kv head for the token at ``pos`` (1: no partials to combine)."""
        return pos // self.part + 1

    def _check(self, qkv, out, cache: KVCache, rope: RopeTable | None, layer: int, pos: int, qkv_offset: int):
        """The buffers behind qkv and out, once every argument is checked."""
        d = self.head_dim
        if pos < 0:
            raise PerfxError(f"attention_decode: position {pos} is negative")
        if pos >= cache.max_positions:
            raise PerfxError(f"attention_decode: context full: position {pos} does not fit the KV cache of "
                             f"{cache.max_positions} positions; start a new chat or use a larger --ctx")
        if pos >= self.max_positions:
            raise PerfxError(f"attention_decode: context full: position {pos} is beyond the "
                             f"{self.max_positions} positions this AttentionDecode was made for; "
                             "make it with max_positions ≥ the cache's")
        if (cache.n_kv_heads, cache.head_dim) != (self.n_kv_heads, d):
            raise PerfxError(f"attention_decode: KV cache of {cache.n_kv_heads} kv heads × {cache.head_dim} "
                             f"does not match this layer's {self.n_kv_heads} × {d}")
        if cache.form != self.kv:
            raise PerfxError(f"attention_decode: the KV cache is {cache.form}, but this kernel was built for a "
                             f"{self.kv} cache: make it with shape kv={cache.form!r}")
        if not 0 <= layer < cache.n_layers:
            raise PerfxError(f"attention_decode: layer {layer} is outside the KV cache's "
                             f"{cache.n_layers} layers")
        if rope is not None and (rope.head_dim != d or pos >= rope.max_positions):
            raise PerfxError(f"attention_decode: RoPE table ({rope.max_positions} positions × head_dim "
                             f"{rope.head_dim}) does not cover position {pos} at head_dim {d}")
        qkv_b, qkv_bytes = buffer_bytes(qkv, "attention_decode qkv")
        if qkv_offset < 0 or qkv_bytes // 4 < qkv_offset + self.qkv_size:
            raise PerfxError(f"attention_decode: qkv must hold float32 [q | k | v] (q alone, q_only) of "
                             f"{self.qkv_size} "
                             f"elements from offset {qkv_offset}; it holds {qkv_bytes // 4}")
        out_b, out_bytes = buffer_bytes(out, "attention_decode out")
        if out_bytes // 4 < self.n_heads * d:
            raise PerfxError(f"attention_decode: out must hold {self.n_heads * d} float32 elements, "
                             f"it holds {out_bytes // 4}")
        return qkv_b, out_b

    def enqueue(self, qkv, out, cache: KVCache, rope: RopeTable | None, layer: int, pos: int,
                qkv_offset: int = 0, *, position=None, window: int | None = None, scale: float | None = None,
                softcap: float = 0.0, q_norm=None, k_norm=None, eps: float = 1e-6, quantized=None,
                sinks=None) -> list:
        """Enqueue the launch; returns its events ([the launch]), for timing.

        ``position``: (int32 buffer, index) that holds ``pos`` when the launches run (the decode plan's step
        buffer: recorded once, the launches serve every position of the same partition count); None: this
        wrapper writes ``pos`` into its own buffer, in queue order. ``quantized``: (codes, steps and sums)
        buffers where out is also written as Q8_1 blocks of 32 (H·D int8, H·D/32 float pairs), the o
        projection's int8 activations (``GemvQ4.events``' ``quantized``); head_dim must be a multiple of 32.
        ``sinks``: H float32, each query head's sink logit, where built with them (shape ``sinks``).
        """
        qkv_b, out_b = self._check(qkv, out, cache, rope, layer, pos, qkv_offset)
        sinks_b = sink_buffer("attention_decode", self.sinks, sinks, self.n_heads, self.placeholder)
        extra = ()
        if quantized is not None:
            if self.head_dim % 32:
                raise PerfxError(f"attention_decode: out quantized per block of 32 needs head_dim a multiple of "
                                 f"32, not {self.head_dim}")
            size = self.n_heads * self.head_dim
            extra = (device_buffer(quantized[0], size, "attention_decode quantized out"),
                     device_buffer(quantized[1], 8 * (size // 32), "attention_decode quantized out's steps and sums"))
        kernel = self.kernels(quantized is not None)
        positions, pos_index = self.position(pos, position)
        window, scale, norms = attention_features(
            "attention_decode", self.head_dim, self.qk_norm, self.window if window is None else window,
            scale, softcap, q_norm, k_norm, eps, self.placeholder)
        keys, values, offset = cache.layer(layer)
        scales = cache.scales(layer) or (self.placeholder, self.placeholder)
        n_parts = self.partitions(pos)
        cos, sin = (self.placeholder, self.placeholder) if rope is None else (rope.cos, rope.sin)
        launch = self.device.launch(
            kernel, (self.wgs, self.groups, n_parts), (self.wgs, 1, 1),
            qkv_b, np.int32(qkv_offset), cos, sin, np.int32(0 if rope is None else rope.rotary_dims),
            *norms, np.float32(eps), keys, values, *scales,
            np.int32(offset), np.int32(cache.max_positions), positions,
            np.int32(pos_index), np.int32(self.max_parts), self.part_max, self.part_sum, self.part_out, out_b, np.int32(window),
            np.float32(scale), np.float32(softcap), sinks_b, self.counters, *extra)
        self.last_events = [launch]
        return self.last_events

    def __call__(self, qkv, out, cache: KVCache, rope: RopeTable | None, layer: int, pos: int,
                 qkv_offset: int = 0, **features):
        """out (H·D) = attention of the token at ``pos`` over positions 0..pos of ``layer``.

        ``qkv`` holds float32 [q (H·D) | k (Hkv·D) | v (Hkv·D)] from element ``qkv_offset``. Normalises q and k
        per head (built with qk_norm: ``q_norm``, ``k_norm`` weights of head_dim float32, ``eps``), rotates
        them (``rope``; None: no RoPE in this layer), appends k and v to ``cache`` at (layer, pos)
        (positions < pos must be there already) and returns the last launch's cl.Event (``last_events``
        holds them all). Scores are q·k·``scale`` (None: 1/√head_dim), soft-capped by ``softcap`` (0: off),
        over the last ``window`` positions (None: the constructor's; 0: all). ``qkv``, ``out`` and the
        weights are pyopencl Arrays or cl.Buffers.
        """
        return self.enqueue(qkv, out, cache, rope, layer, pos, qkv_offset, **features)[-1]
