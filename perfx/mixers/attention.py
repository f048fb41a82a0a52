"""Attention layers: the fused QKV projection, (q/k norm +) RoPE + KV append + attention, the output projection;
Qwen3.5's output gate (σ of a projection of the same input) where the recipe has it.

State: one KV cache for the attention layers (fp16 or int8, ``perfx.ops.kv_cache``), one cos/sin table per
distinct RoPE of the recipe. A KV cache keeps every position, so attention resumes anywhere it has run.
Gemma 4's layers differ in their shapes (``shape_groups``): one cache per shape of the layers that hold one, each
layer's kernels built for its shape, and a layer that shares an earlier layer's cache projects q alone and
attends over that layer's slot.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from perfx.formats import fuse_rows, permute_linear_rows
from perfx.mixers import Mixer
from perfx.ops import Q8_TEXEL
from perfx.op import Op, StepOptions, matrix_ops, qk_norm, shared
from perfx.ops.attention_decode import BATCH_ROWS
from perfx.ops.kv_cache import KVCache, RopeTable, kv_shape
from perfx.reference import attention, rmsnorm, rope, sigmoid_mul
from perfx.reference import linear as linear64


@dataclass
class AttentionWeights:
    """An attention layer's weights: host matrices (``perfx.formats.HostMatrix``, from a source) or Linears (on the
    device)."""

    matrices: ClassVar[tuple[str, ...]] = ("qkv", "attn_gate", "o")
    qkv: object                # (q_dim + 2·kv_dim, hidden): q, k, v rows, Hugging Face rotate-half order
    o: object                  # (hidden, q_dim)
    attn_gate: object = None   # (q_dim, hidden): the output's gate, the gate rows of q_proj (Qwen3.5)
    q_norm: object = None      # float32 (D): per-head q norm (Qwen3, Gemma 3)
    k_norm: object = None      # float32 (D)
    qkv_bias: object = None    # float32 (q_dim + 2·kv_dim), host side (Qwen2); on the device it is inside qkv
    o_bias: object = None      # float32 (hidden), host side (gpt-oss); on the device it is inside o
    sinks: object = None       # float32 (H): each query head's sink logit (gpt-oss)


def split_gated_q(w, n_heads: int, head_dim: int) -> tuple:
    """Qwen3.5's q projection (H·2D rows: q then the gate, head by head) as its q rows and its gate rows, each
    head-major (H·D): exact for every form."""
    rows = np.arange(2 * n_heads * head_dim).reshape(n_heads, 2, head_dim)
    return permute_linear_rows(w, rows[:, 0].reshape(-1)), permute_linear_rows(w, rows[:, 1].reshape(-1))


class AttentionMixer(Mixer):
    kind = "attention"

    scratch = ("qkv", "att", "gates")
    state_fields = ("caches", "place")

    # -- host side ------------------------------------------------------------------------------------

    Weights = AttentionWeights
    # Qwen3.5's attention layers: the q projection holds q and the output gate of each head; the gate rows are a
    # matrix of their own (attn_gate), q's join k and v in the fused QKV
    fuses = {"qkv": ("q", "k", "v"), "attn_gate": ("q",)}
    file_fused = ("qkv", "gate_up")   # Phi-3's qkv_proj and gate_up_proj
    misplaced = {("delta", "taps"): "holds linear-attention tensors (ssm_conv1d) but {keys} make it a "
                                    "full-attention layer"}

    @staticmethod
    def stand_ins(c) -> dict[str, str]:
        # Gemma 4's global layers of the larger models have no v projection: V is K's projection (normed without
        # a scale, unrotated), so K's rows are read again in V's place
        return {"v": "k"} if c.value_norm else {}

    @classmethod
    def host_linears(cls, c) -> dict[str, tuple[str, ...]]:
        # a layer that reads another layer's KV cache (Gemma 4) projects q alone
        linears = super().host_linears(c)
        return {**linears, "qkv": ("q",)} if c.kv_shared else linears

    @staticmethod
    def part_shapes(c) -> dict[str, tuple[int, int]]:
        # Qwen3.5's q projection: q and the gate of each head, 2·D rows a head
        return {"q": ((2 if c.attention_gate else 1) * c.q_dim, c.hidden_size), "k": (c.kv_dim, c.hidden_size),
                "v": (c.kv_dim, c.hidden_size)}

    @staticmethod
    def host_vectors(c) -> dict[str, int]:
        return {**({"q_bias": c.q_dim, "k_bias": c.kv_dim, "v_bias": c.kv_dim} if c.qkv_bias else {}),
                **({"o_bias": c.hidden_size} if c.o_bias else {}),
                **({"sinks": c.n_heads} if c.attention_sinks else {}),
                **({"q_norm": c.head_dim} if c.qk_norm else {}),
                **({"k_norm": c.head_dim} if c.qk_norm and not c.kv_shared else {})}

    @classmethod
    def read(cls, source, layer: int) -> AttentionWeights:
        """QKV fused (the file's own where it holds one), Qwen3.5's q split into q and the gate first; the q, k, v
        biases as one; the q/k norms; o's bias and the sinks (gpt-oss)."""
        c = source.config.at(layer)
        qkv, gate = source.whole("qkv", layer), None
        if qkv is None and c.attention_gate:
            q, gate = split_gated_q(source.read_part("q", layer), c.n_heads, c.head_dim)
            qkv = fuse_rows([q, source.read_part("k", layer), source.read_part("v", layer)])
            gate = source.quantized(gate)
        elif qkv is None:
            qkv = fuse_rows([source.read_part(name, layer) for name in cls.host_linears(c)["qkv"]])
        bias = None
        if c.qkv_bias:
            bias = np.concatenate([source.read_vector(f"{name}_bias", layer) for name in ("q", "k", "v")])
        norms = {}
        if c.qk_norm:
            norms.update({name: source.read_vector(name, layer) for name in ("q_norm", "k_norm")
                          if name in cls.host_vectors(c)})
        extra = {name: source.read_vector(name, layer) for name in ("o_bias", "sinks")
                 if name in cls.host_vectors(c)}
        return AttentionWeights(qkv=source.quantized(qkv), qkv_bias=bias,
                                o=source.quantized(source.read_part("o", layer)), attn_gate=gate, **norms, **extra)

    @classmethod
    def synthetic(cls, c, random_matrix, rng) -> AttentionWeights:
        h = c.hidden_size
        norms = {}
        if c.qk_norm:
            norms.update(q_norm=np.ones(c.head_dim, np.float32), k_norm=np.ones(c.head_dim, np.float32))
        gate = {"attn_gate": random_matrix(rng, c.q_dim, h)} if c.attention_gate else {}
        rows = c.q_dim if c.kv_shared else c.qkv_dim   # a layer reading another's cache projects q alone
        if c.qkv_bias:
            norms["qkv_bias"] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
        if c.o_bias:
            norms["o_bias"] = (0.1 * rng.standard_normal(h)).astype(np.float32)
        if c.attention_sinks:
            norms["sinks"] = rng.standard_normal(c.n_heads).astype(np.float32)
        return AttentionWeights(qkv=random_matrix(rng, rows, h), o=random_matrix(rng, h, c.q_dim), **norms,
                                **gate)

    @staticmethod
    def linears(c) -> list[tuple[str, int, int, bool]]:
        rows = [("qkv", c.q_dim + (0 if c.kv_shared else 2 * c.kv_dim), c.hidden_size, bool(c.qkv_bias)),
                ("o", c.hidden_size, c.q_dim, bool(c.o_bias))]
        if c.attention_gate:
            rows.insert(1, ("attn_gate", c.q_dim, c.hidden_size, False))
        return rows

    @classmethod
    def shape_groups(cls, c) -> list[tuple[tuple[int, ...], object]]:
        """The attention layers by their shapes, [(layers, their view of the config (``ModelConfig.at``))]: one
        group of every layer where all are alike; Gemma 4's by head size, KV heads and KV sharing."""
        groups: dict = {}
        for i in c.layers_of(cls.kind):
            v = c.at(i)
            groups.setdefault((v.head_dim, v.n_kv_heads, v.kv_shared), (v, []))[1].append(i)
        return [(tuple(layers), v) for v, layers in groups.values()]

    @classmethod
    def matrix_ops(cls, config, role: str, m: int, options: StepOptions, prefill: bool, reads: tuple[str, ...],
                   writes: tuple[str, ...]) -> list[Op]:
        """The ops of one of its matrices, per group of layers of one shape (``shape_groups``)."""
        out = []
        for layers, v in cls.shape_groups(config):
            n, k, bias = next((n, k, bias) for r, n, k, bias in cls.linears(v) if r == role)
            out += matrix_ops(v, role, m, options, prefill, layers, reads, writes, dims=(n, k, bias))
        return _merged(out)

    @classmethod
    def ops(cls, c, m: int, options: StepOptions, prefill: bool = False) -> list[Op]:
        """qkv, [the output's gate], attention (decode over the KV cache, or prefill over m rows), [σ(gate)·], o."""
        layers = tuple(c.layers_of(cls.kind))
        out = cls.matrix_ops(c, "qkv", m, options, prefill, ("xb",), ("qkv",))
        if c.attention_gate:
            out += cls.matrix_ops(c, "attn_gate", m, options, prefill, ("xb",), ("gates",))
        out += cls.kernel_ops(c, m, options)
        if c.attention_gate:
            out.append(shared(Op("sigmoid_mul", {"count": c.q_dim}, "attention gate", layers, reads=("gates", "att"),
                                 writes=("att",), m=m), prefill))
        return out + cls.matrix_ops(c, "o", m, options, prefill, ("att",), ("proj",))

    @classmethod
    def kernel_ops(cls, c, m: int, options: StepOptions) -> list[Op]:
        """The attention itself: over m rows from position 0 (prefill), or for one row over the KV cache at
        ``options.positions`` (capped by the model's); none for one row without positions (a prefill of one row
        runs the decode step's attention)."""
        if m == 1 and options.positions is None:
            return []
        out = []
        for layers, v in cls.shape_groups(c):
            # Gemma 4: v normed where the layer appends, q alone where it reads another layer's cache
            features = {"q_only": True} if v.kv_shared else ({"v_norm": True} if v.value_norm else {})
            if v.attention_sinks:   # gpt-oss
                features["sinks"] = True
            heads = {"n_heads": v.n_heads, "n_kv_heads": v.n_kv_heads, "head_dim": v.head_dim}
            if m > 1:
                shape = {**heads, "m": m, "p0": 0, **qk_norm(v), **features, **kv_shape(options.kv)}
                out.append(Op("attention_prefill", shape, "attention", layers, reads=("qkv", "cache"),
                              writes=("att", "cache"), m=m))
                continue
            positions = min(options.positions, c.max_positions) if c.max_positions else options.positions
            shape = {**heads, "positions": positions, **qk_norm(v), **features, **kv_shape(options.kv)}
            out.append(Op("attention_decode", shape, "attention", layers, reads=("qkv", "cache"),
                          writes=("att", "cache")))
        return out

    def allocate(self) -> None:
        model = self.model
        c, d, s = model.config, model.device, model.state
        f32 = np.float32
        self.qkv = d.empty((s.chunk, c.qkv_dim), f32)
        self.att = d.empty((s.chunk, c.q_dim), f32)    # the attention output, before o
        # each layer's rows packed at its own width (Gemma 4's layers differ): views of the same buffers
        self.rows: dict[int, tuple] = {}
        for i in self.layers:
            v = c.at(i)
            qkv_width = v.q_dim + (0 if v.kv_shared else 2 * v.kv_dim)
            self.rows[i] = (self.qkv if qkv_width == c.qkv_dim else self.qkv.reshape(-1)[:s.chunk * qkv_width].reshape(
                s.chunk, qkv_width), self.att if v.q_dim == c.q_dim else self.att.reshape(-1)[
                :s.chunk * v.q_dim].reshape(s.chunk, v.q_dim))
        self.gates = d.empty((s.chunk, c.q_dim), f32) if c.attention_gate else None
        # one row of att as Q8_1 blocks, for the o projections
        self.att_q8 = (d.empty(c.q_dim, np.int8), d.empty((c.q_dim // 32, 2), np.float32)) if self.writes_blocks() else None
        self.bind(self.new_state())
        # One cos/sin table per distinct RoPE and head size of the recipe (Gemma 3: local and global bases), made
        # once; a GGUF's rope_freqs (Llama 3.x, Gemma 4's proportional RoPE) and LongRoPE's factors ride in the
        # scaling and are applied in the table.
        tables: dict[tuple, RopeTable] = {}
        self.rope: dict[int, RopeTable | None] = {}
        self.window: dict[int, int] = {}
        for i in self.layers:
            recipe = c.layer(i, model.max_positions)
            r, head_dim = recipe.rope, c.at(i).head_dim
            if r is not None and (r.key(), head_dim) not in tables:
                tables[r.key(), head_dim] = RopeTable.upload(d, head_dim, model.max_positions, r.theta, r.scaling,
                                                             rotary_dims=r.dims)
            self.rope[i] = None if r is None else tables[r.key(), head_dim]
            self.window[i] = recipe.window

    def new_state(self) -> dict:
        """One cache per shape of the layers that hold one (every layer's, in one, where all are alike), and each
        layer's place in them: a layer that shares another's (Gemma 4) attends over that layer's cache and slot."""
        model = self.model
        c = model.config
        caches: list[KVCache] = []
        place: dict[int, tuple[KVCache, int]] = {}
        for layers, v in self.shape_groups(c):
            if v.kv_shared:
                continue
            cache = KVCache.allocate(model.device, len(layers), v.n_kv_heads, model.max_positions, v.head_dim,
                                     model.kv)
            caches.append(cache)
            place.update({layer: (cache, slot) for slot, layer in enumerate(layers)})
        for i in self.layers:
            if c.layers[i].kv_from >= 0:
                place[i] = place[c.layers[i].kv_from]
        return {"caches": caches, "place": place}

    def copy_state(self, src: dict, dst: dict, positions: int) -> None:
        for source, target in zip(src["caches"], dst["caches"]):
            source.copy_prefix(self.model.device, target, positions)

    @property
    def cache(self) -> KVCache:
        """The first of its caches (the only one where every layer has the model's shapes)."""
        return self.caches[0]

    def upload(self, w, layer: int) -> int:
        m, h = self.model, w.mixing
        weights = AttentionWeights(qkv=m.upload(h.qkv, f"layer {layer} qkv", "qkv", bias=h.qkv_bias),
                                   o=m.upload(h.o, f"layer {layer} o", "o", bias=h.o_bias))
        nbytes = h.qkv.nbytes + h.o.nbytes
        if h.sinks is not None:
            weights.sinks = m.vector(h.sinks)
            nbytes += h.sinks.nbytes
        if h.attn_gate is not None:
            weights.attn_gate = m.upload(h.attn_gate, f"layer {layer} attn_gate", "attn_gate")
            nbytes += h.attn_gate.nbytes
        if h.q_norm is not None:
            # a layer reading another's cache has no k norm: its q norm is bound in its place, never read
            weights.q_norm = m.vector(h.q_norm)
            weights.k_norm = weights.q_norm if h.k_norm is None else m.vector(h.k_norm)
            nbytes += h.q_norm.nbytes + (0 if h.k_norm is None else h.k_norm.nbytes)
        self.weights[layer] = weights
        return nbytes

    def xb_readers(self, layer: int) -> list:
        w = self.weights[layer]
        return [w.qkv] + ([w.attn_gate] if w.attn_gate is not None else [])

    def linears_of(self, layer: int) -> list:
        w = self.weights[layer]
        return [w.qkv, w.o] + ([w.attn_gate] if w.attn_gate is not None else [])

    def writes_blocks(self) -> bool:
        """Whether the decode attention also writes its output as Q8_1 blocks: where the o projections read them
        (int4 o taking int8 activations in the rows layout), the heads are whole blocks of 32, and no gate
        multiplies the output after the attention (Qwen3.5's would leave the blocks stale)."""
        c = self.model.config
        if c.head_dim % 32 or c.attention_gate:
            return False
        return any(self.weights[i].o.blocks_order() == Q8_TEXEL for i in self.layers)

    # -- the step ----------------------------------------------------------------------------------

    def _features(self, layer: int) -> dict:
        """The attention launch's keyword arguments: its window, the scale, soft-cap and q/k norms where the
        recipe has them."""
        c, w = self.model.config, self.weights[layer]
        features = {}
        if self.window[layer]:
            features["window"] = self.window[layer]
        if c.attention_scale:
            features["scale"] = c.attention_scale
        if c.attn_softcap:
            features["softcap"] = c.attn_softcap
        if c.qk_norm:
            features.update(q_norm=w.q_norm, k_norm=w.k_norm, eps=c.rms_eps)
        if w.sinks is not None:
            features["sinks"] = w.sinks
        return features

    def _attend_decode(self, layer: int, pos: int, position=None) -> None:
        cache, slot = self.place[layer]
        qkv, att = self.rows[layer]
        self.model.plan.attention_at(layer)(qkv, att, cache, self.rope[layer], slot, pos,
                                            position=position, quantized=self.att_q8, **self._features(layer))

    def forward(self, layer: int, m: int, pos: int, decode: bool, position=None, split=None) -> None:
        model, w = self.model, self.weights[layer]
        plan, s = model.plan, model.state
        # qkv for these positions (and the output's gate), then (q/k norm +) RoPE + KV append + attention
        qkv, att = self.rows[layer]
        w.qkv(s.xb, qkv, m, decode, model.xb_blocks(m))
        if w.attn_gate is not None:
            w.attn_gate(s.xb, self.gates, m, decode, model.xb_blocks(m))
        if split is not None:
            split(self, layer)
        elif decode:
            self._attend_decode(layer, pos)
        else:
            cache, slot = self.place[layer]
            plan.attention_at(layer, m)(qkv, att, cache, self.rope[layer], slot, pos, m,
                                        **self._features(layer))
        if w.attn_gate is not None:   # Qwen3.5: the attention output times σ(gate)
            plan.attn_gate(self.gates, self.att, self.att, m * model.config.q_dim)
        w.o(att, s.proj, m, decode, (self.att_q8, Q8_TEXEL) if m == 1 and self.att_q8 is not None else None)

    def forward_rows(self, layer: int, m: int, rows) -> None:
        model, w = self.model, self.weights[layer]
        c, plan, s = model.config, model.plan, model.state
        decode = m == 1
        # the rows packed at the layer's own widths (Gemma 4's layers differ)
        qkv, att = self.rows[layer]
        qkv_width = qkv.shape[1]
        w.qkv(s.xb, qkv, m, decode, model.xb_blocks(m))
        if w.attn_gate is not None:
            w.attn_gate(s.xb, self.gates, m, decode, model.xb_blocks(m))
        # each row attends its own sequence's cache up to its own position, read on the device: up to
        # BATCH_ROWS rows a launch, each over its own cache, into its own row of att
        places = [rows.state(self, i)["place"][layer] for i in range(m)]
        for first in range(0, m, BATCH_ROWS):
            chunk = places[first:first + BATCH_ROWS]
            plan.attention_at(layer).rows(qkv, att, [cache for cache, _ in chunk], self.rope[layer], chunk[0][1],
                                          rows.positions[first:first + len(chunk)], qkv_width, first,
                                          position=rows.position(0), **self._features(layer))
        if w.attn_gate is not None:
            plan.attn_gate(self.gates, self.att, self.att, m * c.q_dim)
        w.o(att, s.proj, m, decode)

    def partitions(self, pos: int) -> int:
        # the decode attention's grid grows by one partition every PART positions (each shape's kernel its own)
        found = {self.model.plan.attention_at(layer).partitions(pos) for layer in self.layers}
        return found.pop() if len(found) == 1 else tuple(sorted(found))

    def record_varying(self, layer: int, pos: int, position) -> None:
        self._attend_decode(layer, pos, position=position)

    @staticmethod
    def reference(xb, w, c, cache, layer: int, positions, recipe) -> np.ndarray:
        c = c.at(layer)   # the layer's own shapes (Gemma 4)
        m, h, hkv, d, w = xb.shape[0], c.n_heads, c.n_kv_heads, c.head_dim, w.mixing
        q_dim, kv_dim = h * d, hkv * d
        # q, k, v for these positions from the fused projection (q alone where the layer reads another's cache)
        qkv = linear64(xb, w.qkv, w.qkv_bias)
        q = qkv[:, :q_dim].reshape(m, h, d)
        # per-head q and k norms (Qwen3, Gemma 3), v's without a scale (Gemma 4), then RoPE where the layer has it
        # (rotate-half)
        r = recipe.rope
        if c.qk_norm:
            q = rmsnorm(q, w.q_norm, c.rms_eps)
        if r is not None:
            q = rope(q, positions, r.theta, r.scaling, rotary_dims=r.dims)
        if c.kv_shared:   # Gemma 4: the cache an earlier layer of its kind wrote, these positions included
            keys, values = cache.keys[recipe.kv_from], cache.values[recipe.kv_from]
        else:
            k = qkv[:, q_dim:q_dim + kv_dim].reshape(m, hkv, d)
            v = qkv[:, q_dim + kv_dim:].reshape(m, hkv, d)
            if c.qk_norm:
                k = rmsnorm(k, w.k_norm, c.rms_eps)
            if c.value_norm:
                v = rmsnorm(v, 1.0, c.rms_eps)
            if r is not None:
                k = rope(k, positions, r.theta, r.scaling, rotary_dims=r.dims)
            # append k, v to the cache
            keys, values = cache.append(layer, k, v)
        # causal GQA attention over everything cached
        att = attention(q, keys, values, positions, window=recipe.window, scale=c.scale,
                        softcap=c.attn_softcap, sinks=w.sinks).reshape(m, q_dim)
        if c.attention_gate:   # Qwen3.5: the output times σ(gate), the gate projected from the same input
            att = sigmoid_mul(linear64(xb, w.attn_gate), att)
        return linear64(att, w.o, w.o_bias)

    # -- state rules: a KV cache keeps every position ---------------------------------------------------

    def state_report(self) -> dict:
        return {"kv_cache_bytes": sum(cache.nbytes for cache in self.caches)}

    def fill(self, value: float) -> None:
        for cache in self.caches:
            cache.fill(self.model.device, value)



def _merged(ops: list[Op]) -> list[Op]:
    """Ops of one kernel, shape, weight and form on several groups of layers as one op on all of them."""
    out: dict = {}
    for op in ops:
        key = (op.key, op.weight, op.form, op.epilogue)
        out[key] = replace(op, layers=tuple(sorted(out[key].layers + op.layers))) if key in out else op
    return list(out.values())


MIXER = AttentionMixer
