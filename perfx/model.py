"""The decoder forward on the device: thin Python over perfx's kernels, read top to bottom like llama2.c.

The forward follows the model's recipe (``perfx.config``: norms before and optionally after attention and the
FFN, per-head Q/K norms, SiLU or GELU gates, each layer's RoPE and window, scales and soft-caps), never the
architecture's name, so Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3 and SmolLM3 run the same code.

``Model.load(source, device, ctx)`` uploads the weights once, layer by layer (the host holds one layer
at a time), in the layouts the kernels read; QKV and gate-up were fused by the loader. Each matrix runs the
kernels of its form: int4 (gemv_q4, gemm_q4), int8 (gemv_q8, gemm_q8: GGUF Q5_x/Q6_K/Q8_0 tensors and the
lm_head) or fp16. ``prefill`` runs the GEMM path over a prompt (logits for the last position only);
``prefill_logits`` also returns every position's logits from a given one on (perplexity); ``decode_one``
runs the GEMV path for one token: a recorded plan of launches, every argument bound, replayed per token after
one 8-byte upload of the token id and its position (the attention reads the position on the device).
"""

from __future__ import annotations

import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.formats import Q4_PAIRS, Q4Matrix, Q8Matrix
from perfx.ops import Q8_NATURAL, Q8_TEXEL
from perfx.ops.gated_delta_net import DeltaState
from perfx.ops.gemm_q4 import GemmQ4
from perfx.ops.gemv_f16 import F16DeviceWeight
from perfx.ops.kv_cache import KVCache, RopeTable, check_kv_form
from perfx.ops.params import READ_NAMES
from perfx.ops.q4_weight import LAYOUT_ROWS, Q4DeviceWeight
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.ops.restore_points import RestorePoints
from perfx.ops.short_conv import ConvHistory
from perfx.plan import KernelPlan
from perfx.progress import Progress
from perfx.runtime import Device
from perfx.sources import open_named
from perfx.tuning.database import Database, default_database
from perfx.tuning.problems import delta_shape

DEFAULT_CTX = 4096
PREFILL_CHUNK = 256  # prompt tokens per prefill pass: bounds the activation buffers
# The matrices that read xb, the normed residual stream (the rest read attention, gate-up or recurrence outputs):
# a layer's attention (or conv, or DeltaNet) side reads the norm before it, gate_up the norm before the FFN
ATTENTION_SIDE = ("qkv", "attn_gate", "conv_in", "delta_qkv", "delta_z", "delta_ab")


@dataclass
class DeviceLayer:
    attn_norm: object          # float32 (hidden): before the attention or the conv
    ffn_norm: object           # float32 (hidden)
    gate_up: object            # (2·intermediate, hidden): gate rows, then up rows
    down: object               # (hidden, intermediate)
    qkv: object = None         # Q4DeviceWeight | F16DeviceWeight, (q_dim + 2·kv_dim, hidden), bias inside (Q4)
    o: object = None           # (hidden, q_dim)
    q_norm: object = None      # float32 (D): per-head q norm (Qwen3, Gemma 3)
    k_norm: object = None      # float32 (D)
    post_attn_norm: object = None   # float32 (hidden): the attention output's own norm (Gemma)
    post_ffn_norm: object = None    # float32 (hidden): the FFN output's own norm (Gemma)
    conv_in: object = None     # (3·hidden, hidden): B, C, x rows (a conv layer, LFM2)
    conv_weight: object = None  # float32 (channels, L): the short convolution's taps (conv or delta layer)
    conv_out: object = None    # (hidden, hidden)
    attn_gate: object = None   # (q_dim, hidden): the attention output's gate (Qwen3.5)
    delta_qkv: object = None   # (2·Hk·d_k + Hv·d_v, hidden): a delta layer's q|k|v, the convolution's input
    delta_z: object = None     # (Hv·d_v, hidden): the output norm's gate z
    delta_ab: object = None    # (2·Hv, hidden): a, then b (the gates before softplus and sigmoid)
    delta_out: object = None   # (hidden, Hv·d_v)
    dt_bias: object = None     # float32 (Hv)
    ssm_a: object = None       # float32 (Hv): −exp(A_log)
    delta_norm: object = None  # float32 (d_v): the gated RMSNorm's γ


@dataclass
class DeviceWeights:
    """A model's weights on the device, each in the form and layout the kernels that read it want."""

    embedding: object = None   # Q4 / Q8 / fp16 device weight (the lm_head too where tied)
    layers: list[DeviceLayer] = field(default_factory=list)
    final_norm: object = None  # float32 (hidden)
    lm_head: object = None
    nbytes: int = 0            # bytes one decode step reads: every weight once

    def int4_forms(self) -> dict[str, int]:
        """{"int4 g128, 2.5 bytes a group (fp16 scale + 4-bit zero)": matrices in that form, ...}: the load line's
        count of the int4 weights by the form of their scales."""
        found = [self.embedding, self.lm_head] if self.lm_head is not self.embedding else [self.embedding]
        found += [w for layer in self.layers for w in vars(layer).values()]
        return dict(Counter(w.describe_form() for w in found if isinstance(w, Q4DeviceWeight)))


@dataclass
class RunState:
    """The activations of a forward, preallocated once (llama2.c's RunState): ``chunk`` rows for a prefill
    chunk, row 0 for a decode step."""

    chunk: int
    x: object          # (chunk, hidden) the residual stream
    xb: object         # (chunk, hidden) normed activations
    qkv: object        # (chunk, q_dim + 2·kv_dim)
    att: object        # (chunk, q_dim) attention output, before o
    proj: object       # (chunk, hidden) o or down output, added into the residual
    hb: object         # (chunk, 2·intermediate) act(gate)·up (and gate|up on the fp16 path)
    logits: object     # (V) the last position's logits
    ids: object        # (chunk) int32 prompt ids
    step: object       # (2) int32 the decode step's token id and position
    best: object       # (1) int32 the argmax
    row_in: object     # fp16 slow path scratch rows
    row_out: object
    row_up: object
    row_act: object
    bcx: object = None          # (chunk, 3·hidden) a conv layer's in-projection [B | C | x] (LFM2 only)
    mixed: object = None        # (chunk, hidden) the gated convolution's output, before its out-projection
    gates: object = None        # (chunk, q_dim) the attention output's gate (Qwen3.5)
    dqkv: object = None         # (chunk, conv channels) a delta layer's q|k|v, then convolved (dconv)
    dconv: object = None
    dz: object = None           # (chunk, Hv·d_v) z
    dab: object = None          # (chunk, 2·Hv) a | b
    dout: object = None         # (chunk, Hv·d_v) the recurrence's output, then normed and gated
    all_logits: object = None   # (chunk, V) and (chunk, hidden): made by the first prefill_logits only
    head_in: object = None
    # One row of xb as Q8_1 blocks (hidden int8 codes, hidden/32 (step, sum) pairs), written by a norm that
    # writes xb where a GEMV reading that xb takes int8 activations (Model._xb_blocks), in the order xb_order
    # (perfx.ops.Q8_TEXEL or Q8_NATURAL; 0: the last norm wrote none); one row of att the same way in the texel
    # order, written by the decode attention where the o projection takes them (Model._attention_quantizes)
    xb_q8: tuple | None = None
    xb_order: int = 0
    att_q8: tuple | None = None

    @classmethod
    def allocate(cls, device: Device, c: ModelConfig, chunk: int) -> RunState:
        f32 = np.float32
        widest = max(c.hidden_size, c.q_dim, c.qkv_dim, 2 * c.intermediate_size)
        conv = {}
        if c.layers_of("conv"):
            conv = dict(bcx=device.empty((chunk, 3 * c.hidden_size), f32), mixed=device.empty((chunk, c.hidden_size), f32))
        if c.attention_gate:
            conv["gates"] = device.empty((chunk, c.q_dim), f32)
        if c.layers_of("delta"):
            channels, value = c.delta_conv_dim, c.delta_value_dim
            conv.update(dqkv=device.empty((chunk, channels), f32), dconv=device.empty((chunk, channels), f32),
                        dz=device.empty((chunk, value), f32), dab=device.empty((chunk, 2 * c.delta_v_heads), f32),
                        dout=device.empty((chunk, value), f32))
        return cls(**conv,
            chunk=chunk, x=device.empty((chunk, c.hidden_size), f32), xb=device.empty((chunk, c.hidden_size), f32),
            qkv=device.empty((chunk, c.qkv_dim), f32), att=device.empty((chunk, c.q_dim), f32),
            proj=device.empty((chunk, c.hidden_size), f32), hb=device.empty((chunk, 2 * c.intermediate_size), f32),
            logits=device.empty(c.vocab_size, f32), ids=device.empty(chunk, np.int32),
            step=device.empty(2, np.int32), best=device.empty(1, np.int32),
            row_in=device.empty(widest, f32), row_out=device.empty(widest, f32),
            row_up=device.empty(c.intermediate_size, f32), row_act=device.empty(c.intermediate_size, f32))


class Model:
    """A decoder resident on one device: its weights, KV cache and run state, the kernel plan, the forward."""

    def __init__(self, config: ModelConfig, device: Device, max_positions: int, database: Database | None = None,
                 log=None, kv: str = "f16"):
        self.config, self.device, self.max_positions = config, device, max_positions
        self.kv = check_kv_form(kv, config.head_dim, "--kv")   # the KV cache's form: "f16" or "q8"
        self.database = database if database is not None else default_database()
        self.log = log or (lambda text: None)
        self.weights = DeviceWeights()
        self.host_seconds = 0.0         # time spent enqueueing (host work), summed over calls
        self.load_report: dict = {}

    @property
    def weight_bytes(self) -> int:
        """Bytes one decode step reads: every weight once."""
        return self.weights.nbytes

    # -- loading ----------------------------------------------------------------------------------

    @classmethod
    def load(cls, source, device: Device, ctx: int | None = None, progress: bool | None = None,
             default_ctx: int = DEFAULT_CTX, database: Database | None = None, log=None, kv: str = "f16") -> Model:
        """Upload ``source`` (a ``perfx.sources.ModelSource``) to ``device`` with a KV cache of ``ctx`` positions
        (default: the model's context length, at most ``default_ctx``) in the form ``kv`` ("f16", or "q8": int8
        codes and an fp16 scale per 32, ``perfx.ops.kv_cache``). Kernel parameters come from
        ``database`` (default: the user's and shipped tuning results; ``default_database(False)``: none);
        ``log`` receives one line for each tuned choice this driver refuses (the next one runs instead)."""
        c = source.config
        limit = c.max_positions or default_ctx
        ctx = min(limit, default_ctx) if ctx is None else int(ctx)
        if ctx < 2:
            raise PerfxError(f"--ctx must be at least 2, got {ctx}")
        if ctx > limit:
            raise PerfxError(f"--ctx {ctx} exceeds the model's context length {limit}")
        model = cls(c, device, ctx, database, log, kv)
        started = time.perf_counter()
        bar = Progress(c.n_layers + 3, "loading", enabled=progress)
        first = source.layer(0)
        group = source.int4_group or (first.qkv.group if isinstance(first.qkv, Q4Matrix) else None)
        form = first.qkv.form if isinstance(first.qkv, Q4Matrix) else Q4_PAIRS
        model.plan = KernelPlan(c, device, ctx, model.database, model.log, group, source.weight_forms(), model.kv,
                                form)
        bar.update(note="kernels")
        embedding = source.embedding()
        model.weights.embedding = model._upload(embedding, "token embedding", role="embedding")
        bar.update(note="embedding")
        for i in range(c.n_layers):
            w = first if i == 0 else source.layer(i)
            if w.qkv_bias is not None and isinstance(w.qkv, np.ndarray):
                raise PerfxError("an fp16 QKV projection with a bias (Qwen2) runs only quantized: pass --quantize q4")
            vectors = ("q_norm", "k_norm", "post_attn_norm", "post_ffn_norm", "conv_weight", "dt_bias", "ssm_a",
                       "delta_norm")
            norms = {name: model._vector(getattr(w, name)) for name in vectors if getattr(w, name) is not None}
            if w.delta_qkv is not None:   # a delta layer: its projections (the taps and gates' vectors in norms)
                names = ("delta_qkv", "delta_z", "delta_ab", "delta_out")
                mixing = {name: model._upload(getattr(w, name), f"layer {i} {name}", name) for name in names}
                matrices = tuple(getattr(w, name) for name in names) + (w.gate_up, w.down)
            elif w.conv_in is not None:   # a conv layer: in-projection, convolution, out-projection
                mixing = dict(conv_in=model._upload(w.conv_in, f"layer {i} conv in_proj", "conv_in"),
                              conv_out=model._upload(w.conv_out, f"layer {i} conv out_proj", "conv_out"))
                matrices = (w.conv_in, w.conv_out, w.gate_up, w.down)
            else:
                mixing = dict(qkv=model._upload(w.qkv, f"layer {i} qkv", "qkv", bias=w.qkv_bias),
                              o=model._upload(w.o, f"layer {i} o", "o"))
                matrices = (w.qkv, w.o, w.gate_up, w.down)
                if w.attn_gate is not None:
                    mixing["attn_gate"] = model._upload(w.attn_gate, f"layer {i} attn_gate", "attn_gate")
                    matrices += (w.attn_gate,)
            model.weights.layers.append(DeviceLayer(
                attn_norm=model._vector(w.attn_norm), ffn_norm=model._vector(w.ffn_norm),
                gate_up=model._upload(w.gate_up, f"layer {i} gate_up", "gate_up"),
                down=model._upload(w.down, f"layer {i} down", "down"), **mixing, **norms))
            model.weights.nbytes += (sum(x.nbytes for x in matrices) + 4 * 2 * c.hidden_size
                                     + sum(getattr(w, name).nbytes for name in norms))
            del w
            bar.update(note=f"layer {i}")
        first = None
        model.weights.final_norm = model._vector(source.final_norm())
        head = source.lm_head()
        weights = model.weights
        weights.lm_head = weights.embedding if head is None else model._upload(head, "lm_head", "lm_head")
        model.weights.nbytes += (embedding if head is None else head).nbytes + 4 * c.hidden_size
        del embedding, head
        model._allocate_state()
        bar.update(note="run state")
        bar.close()
        device.queue.finish()
        model.load_report = {
            "load_s": time.perf_counter() - started, "device_bytes": device.allocated_bytes,
            "weight_bytes": model.weights.nbytes, "kv_cache_bytes": model.cache.nbytes, "kv": model.kv,
            "conv_state_bytes": model.history.nbytes if model.history is not None else 0,
            "recurrent_state_bytes": model.delta_state.nbytes if model.delta_state is not None else 0,
            "restore_points": len(points.buffers) if (points := model.restore_points) is not None else 0,
            "restore_point_bytes": points.nbytes if points is not None else 0,
            "host_peak_bytes": host_peak_bytes(), "ctx": ctx, "int4_forms": model.weights.int4_forms(),
        }
        return model

    def _vector(self, v: np.ndarray):
        v = np.ascontiguousarray(v, dtype=np.float32)
        return self.device.alloc(v.nbytes, v, what="norm weight")

    def _upload(self, w, what: str, role: str, bias=None):
        """One weight, once: int4 in the layout and read path of the GEMV that reads it in decode (``role``:
        qkv, o, gate_up, down, lm_head, or embedding, whose gather reads the codes buffer)."""
        if isinstance(w, Q8Matrix):
            return Q8DeviceWeight.upload(self.device, w, bias, what=what)
        if isinstance(w, Q4Matrix):
            gemv = self.plan.gemv.get("lm_head" if role == "embedding" else role)
            if role == "embedding" and not self.config.tie_embeddings:
                layout, paths = LAYOUT_ROWS, {"buffer"}
            else:
                layout, paths = gemv.layout, {READ_NAMES[gemv.read]}
                if role == "embedding":
                    paths.add("buffer")
            return Q4DeviceWeight.upload(self.device, w, bias, read_paths=tuple(sorted(paths)), what=what,
                                         layout=layout)
        return F16DeviceWeight.upload(self.device, w, what=what)

    def _allocate_state(self):
        """The run state, preallocated once (llama2.c's RunState), for decode and for a prefill chunk."""
        c, d = self.config, self.device
        self.state = RunState.allocate(d, c, min(PREFILL_CHUNK, self.max_positions))
        if self._norms_quantize():
            self.state.xb_q8 = (d.empty(c.hidden_size, np.int8), d.empty((c.hidden_size // 32, 2), np.float32))
        if self._attention_quantizes():
            self.state.att_q8 = (d.empty(c.q_dim, np.int8), d.empty((c.q_dim // 32, 2), np.float32))
        self._lm_head_gemm = None
        # The KV cache holds the attention layers only, the conv rings the conv layers or the delta layers'
        # convolutions, the delta state the delta layers' S (slot = its index among the layers of its kind).
        attention, convs, deltas = c.layers_of("attention"), c.layers_of("conv"), c.layers_of("delta")
        self.slot = {layer: i for kind in (attention, convs, deltas) for i, layer in enumerate(kind)}
        self.cache = KVCache.allocate(d, max(len(attention), 1), c.n_kv_heads, self.max_positions, c.head_dim,
                                      self.kv)
        self.history = ConvHistory(d, len(convs), c.hidden_size) if convs else None
        self.delta_state = None
        if deltas:
            self.history = ConvHistory(d, len(deltas), c.delta_conv_dim)
            self.delta_state = DeltaState(d, len(deltas), delta_shape(c, 1))
        self.restore_points = (RestorePoints(d, self.history, c.conv_length, self.delta_state)
                               if self.history is not None else None)
        self.written = 0    # positions 0..written−1 are in the cache and the rings
        # One cos/sin table per distinct RoPE of the recipe (Gemma 3: local and global bases), made once; a
        # GGUF's rope_freqs (Llama 3.x) and LongRoPE's factors ride in the scaling and are applied in the table.
        tables: dict[str, RopeTable] = {}
        self.layer_rope: dict[int, RopeTable | None] = {}
        self.layer_window: dict[int, int] = {}
        for i in attention:
            recipe = c.layer(i, self.max_positions)
            rope = recipe.rope
            if rope is not None and rope.key() not in tables:
                tables[rope.key()] = RopeTable.upload(d, c.head_dim, self.max_positions, rope.theta, rope.scaling,
                                                      rotary_dims=rope.dims)
            self.layer_rope[i] = None if rope is None else tables[rope.key()]
            self.layer_window[i] = recipe.window
        self.attention_args = {i: self._attention_args(i) for i in attention}
        self._step_upload = None
        self._decode_segments: list | None = None   # the decode step's launches between attentions
        self._decode_plans: dict[int, list] = {}    # attention partitions -> the step's launches
        self._decode_replays: dict = {}             # attention partitions -> those launches as one replay
        self._decode_replay(0)   # recorded now: a kernel the driver refuses shows at load

    def _norms_quantize(self) -> bool:
        """Whether some norm writing xb also writes it as Q8_1 blocks, for one row (``_xb_order``)."""
        norms = [self._attention_readers(layer) for layer in self.weights.layers]
        norms += [[("gate_up", layer.gate_up)] for layer in self.weights.layers] + [[("lm_head", self.weights.lm_head)]]
        return any(self._xb_order(readers) for readers in norms)

    def _attention_readers(self, w: DeviceLayer) -> list[tuple[str, object]]:
        """(role, weight) of each matrix of layer ``w`` that reads the norm before its attention, conv or DeltaNet."""
        return [(role, getattr(w, role)) for role in ATTENTION_SIDE if getattr(w, role) is not None]

    def _blocks_order(self, role: str, weight) -> int:
        """The order of the Q8_1 blocks the decode GEMV of ``weight`` can take x as from its caller (the int4
        GEMV's rows layout with int8 activations: Q8_TEXEL; the int8 GEMV's with groups of 32: Q8_NATURAL), else
        0 (it reads floats, or quantizes x itself)."""
        if isinstance(weight, Q4DeviceWeight) and self.plan.gemv[role].reads_quantized:
            return Q8_TEXEL
        if isinstance(weight, Q8DeviceWeight) and self.plan.q8("gemv", role, weight).reads_blocks(weight):
            return Q8_NATURAL
        return 0

    def _xb_order(self, readers: list[tuple[str, object]]) -> int:
        """The order a norm writes xb's blocks in for these readers, 0 for none: each GEMV reading the blocks shares
        the norm's quantization and launches none of its own; the int4 GEMVs' order where readers want both (an
        int8 reader then quantizes x itself)."""
        if self.config.hidden_size % 32:
            return 0
        orders = {self._blocks_order(role, w) for role, w in readers}
        return Q8_TEXEL if Q8_TEXEL in orders else Q8_NATURAL if Q8_NATURAL in orders else 0

    def _attention_quantizes(self) -> bool:
        """Whether the decode attention also writes its output as Q8_1 blocks, for the o projection: where an
        int4 o takes int8 activations in the rows layout, the heads are whole blocks of 32, and no gate
        multiplies the output after the attention (Qwen3.5's would leave the blocks stale)."""
        c = self.config
        if c.head_dim % 32 or c.attention_gate:
            return False
        return any(isinstance(self.weights.layers[i].o, Q4DeviceWeight) and self.plan.gemv["o"].reads_quantized
                   for i in c.layers_of("attention"))

    # -- the forward ------------------------------------------------------------------------------

    def _attention_args(self, layer: int) -> tuple:
        """(rope table or None, keyword arguments) of layer's attention launch: its RoPE, window, the scale,
        soft-cap and q/k norms where the recipe has them."""
        c, w = self.config, self.weights.layers[layer]
        kwargs = {}
        if self.layer_window[layer]:
            kwargs["window"] = self.layer_window[layer]
        if c.attention_scale:
            kwargs["scale"] = c.attention_scale
        if c.attn_softcap:
            kwargs["softcap"] = c.attn_softcap
        if c.qk_norm:
            kwargs.update(q_norm=w.q_norm, k_norm=w.k_norm, eps=c.rms_eps)
        return self.layer_rope[layer], kwargs

    def _linear(self, name: str, weight, x, y, m: int, decode: bool):
        """y = x·Wᵀ for m rows: the int4 GEMV (decode) or GEMM (prefill), or the fp16 GEMV for fp16 weights.

        ``name`` is the matrix's role (qkv, o, gate_up, down): gate_up carries the gate's activation·up
        epilogue (SiLU or GELU, by the recipe).
        """
        epilogue = self.plan.gate_epilogue if name == "gate_up" else "none"
        if isinstance(weight, Q8DeviceWeight):
            if decode:
                gemv = self.plan.q8("gemv", name, weight)
                quantized = self._quantized(x, m, Q8_NATURAL) if gemv.reads_blocks(weight) else None
                return gemv(weight, x, y, epilogue, quantized=quantized)
            if epilogue == "none" and weight.has_bias:
                epilogue = "bias"
            return self.plan.q8("gemm", name, weight, m)(weight, x, y, m, epilogue)
        if isinstance(weight, Q4DeviceWeight):
            if decode:
                return self.plan.gemv[name](weight, x, y, epilogue, quantized=self._quantized(x, m, Q8_TEXEL))
            if epilogue == "none" and weight.bias is not None:
                epilogue = "bias"
            return self.plan.prefill(m)[0][name](weight, x, y, m, epilogue)
        return self._linear_f16(weight, x, y, m, epilogue)

    def _linear_f16(self, weight: F16DeviceWeight, x, y, m: int, epilogue: str):
        """fp16 weights (unquantized checkpoints): the fp16 GEMV row by row, through scratch rows.

        The slow path: a checkpoint loaded with --quantize q4 runs the int4 kernels instead.
        """
        d, k, n = self.device, weight.k, weight.n
        gated = epilogue in ("silu_mul", "gelu_mul")
        cols = n // 2 if gated else n
        for r in range(m):
            d.copy(self.state.row_in, x, 4 * k, src_offset=4 * r * k)
            self.plan.gemv_f16(weight, self.state.row_in, self.state.row_out)
            result = self.state.row_out
            if gated:
                d.copy(self.state.row_up, self.state.row_out, 4 * cols, src_offset=4 * cols)
                self.plan.gate(self.state.row_out, self.state.row_up, self.state.row_act, cols)
                result = self.state.row_act
            d.copy(y, result, 4 * cols, dst_offset=4 * r * cols)

    def _quantized(self, x, m: int, order: int):
        """x's Q8_1 blocks in ``order`` where x is one row of xb and the norm that wrote it wrote them so
        (``_xb_blocks``), or of att and the decode attention writes them (``_attention_quantizes``), else None."""
        s = self.state
        if m != 1:
            return None
        if x is s.xb:
            return s.xb_q8 if s.xb_order == order else None
        return s.att_q8 if x is s.att and order == Q8_TEXEL else None

    def _xb_blocks(self, readers: list[tuple[str, object]], m: int) -> dict:
        """The keyword arguments of a norm writing xb for ``readers``: its Q8_1 blocks and their order where one row
        is written and some reader takes them; ``state.xb_order`` says which the readers find."""
        s = self.state
        s.xb_order = self._xb_order(readers) if m == 1 and s.xb_q8 is not None else 0
        return {"quantized": s.xb_q8, "order": s.xb_order} if s.xb_order else {}

    def _residual_norm(self, post_norm, gamma, m: int, readers: list[tuple[str, object]]):
        """The pending output in proj joins the residual x (through its own norm ``post_norm`` where the recipe
        has post-norms), then xb = rmsnorm(x)·γ (and, for one row, xb's Q8_1 blocks where its ``readers`` read
        them): one launch either way."""
        c, s = self.config, self.state
        blocks = self._xb_blocks(readers, m)
        if post_norm is None:
            self.plan.rmsnorm.residual(s.proj, s.x, gamma, s.xb, m, c.hidden_size, c.rms_eps, **blocks)
        else:
            self.plan.rmsnorm.post_residual(s.proj, s.x, post_norm, gamma, s.xb, m, c.hidden_size, c.rms_eps, **blocks)

    def _attend_decode(self, layer: int, pos: int, position=None):
        """Decode attention of one layer for the token at ``pos`` (``position``: the buffer and index the
        kernel reads it from; None: the wrapper uploads it)."""
        rope, kwargs = self.attention_args[layer]
        s = self.state
        self.plan.attn_decode(s.qkv, s.att, self.cache, rope, self.slot[layer], pos, position=position,
                              quantized=s.att_q8, **kwargs)

    def _layers(self, m: int, pos: int, decode: bool, attention=None, position=None):
        """Every decoder layer over m rows at positions pos..pos+m−1; leaves the last residual add pending.

        ``attention(layer)``, when given, replaces the decode attention (the decode plan records it apart);
        ``position`` (buffer, index), when given, is where the conv layers read ``pos`` on the device.
        """
        c, s = self.config, self.state
        for layer, w in enumerate(self.weights.layers):
            # attention (or conv) rmsnorm; from layer 1 on, the previous layer's FFN output joins the residual here
            if layer == 0:
                self.plan.rmsnorm.plain(s.x, w.attn_norm, s.xb, m, c.hidden_size, c.rms_eps,
                                        **self._xb_blocks(self._attention_readers(w), m))
            else:
                self._residual_norm(self.weights.layers[layer - 1].post_ffn_norm, w.attn_norm, m,
                                    self._attention_readers(w))
            if w.delta_qkv is not None:
                self._delta_layer(layer, w, m, pos, decode, position)
            elif w.conv_in is not None:
                # a conv layer: in-projection to B, C, x; C·(taps ⋆ B·x) over the last L positions; out-projection
                self._linear("conv_in", w.conv_in, s.xb, s.bcx, m, decode)
                self.plan.short_conv(s.bcx, w.conv_weight, self.history, self.slot[layer], s.mixed, m, pos,
                                     position=position)
                self._linear("conv_out", w.conv_out, s.mixed, s.proj, m, decode)
            else:
                # qkv for these positions (and the output's gate), then (q/k norm +) RoPE + KV append + attention
                self._linear("qkv", w.qkv, s.xb, s.qkv, m, decode)
                if w.attn_gate is not None:
                    self._linear("attn_gate", w.attn_gate, s.xb, s.gates, m, decode)
                if attention is not None:
                    attention(layer)
                elif decode:
                    self._attend_decode(layer, pos)
                else:
                    rope, kwargs = self.attention_args[layer]
                    self.plan.prefill(m)[1](s.qkv, s.att, self.cache, rope, self.slot[layer], pos, m, **kwargs)
                if w.attn_gate is not None:   # Qwen3.5: the attention output times σ(gate)
                    self.plan.attn_gate(s.gates, s.att, s.att, m * c.q_dim)
                self._linear("o", w.o, s.att, s.proj, m, decode)
            # ffn rmsnorm, with the attention output added into the residual
            self._residual_norm(w.post_attn_norm, w.ffn_norm, m, [("gate_up", w.gate_up)])
            # gated MLP: gate-up with the activation·up fused, then down
            self._linear("gate_up", w.gate_up, s.xb, s.hb, m, decode)
            self._linear("down", w.down, s.hb, s.proj, m, decode)

    def _delta_layer(self, layer: int, w: DeviceLayer, m: int, pos: int, decode: bool, position):
        """A Gated DeltaNet layer over m rows (``perfx.reference._delta_layer``): q|k|v, z and a|b projected; the
        convolution with SiLU over q|k|v (ring slot: the layer's); the recurrence over the layer's state (the
        token-by-token kernel for one row, the chunked one for more); the gated RMSNorm per v head, as an
        RMSNorm over rows of d_v and SiLU(z)·; the out-projection into proj."""
        c, s = self.config, self.state
        slot, value = self.slot[layer], c.delta_value_dim
        self._linear("delta_qkv", w.delta_qkv, s.xb, s.dqkv, m, decode)
        self._linear("delta_z", w.delta_z, s.xb, s.dz, m, decode)
        self._linear("delta_ab", w.delta_ab, s.xb, s.dab, m, decode)
        self.plan.short_conv(s.dqkv, w.conv_weight, self.history, slot, s.dconv, m, pos, position=position)
        recurrence = self.plan.delta_decode if m == 1 else self.plan.delta_prefill(m)
        recurrence(s.dconv, s.dab, self.delta_state.buffers[slot], s.dout, m, dt_bias=w.dt_bias, ssm_a=w.ssm_a,
                   eps=c.rms_eps)
        self.plan.rmsnorm.plain(s.dout, w.delta_norm, s.dconv, m * c.delta_v_heads, c.delta_v_dim, c.rms_eps)
        self.plan.delta_gate(s.dz, s.dconv, s.dout, m * value)
        self._linear("delta_out", w.delta_out, s.dout, s.proj, m, decode)

    def _final_norm(self, m: int):
        """The last layer's output joins the residual, then the final rmsnorm into xb."""
        self._residual_norm(self.weights.layers[-1].post_ffn_norm, self.weights.final_norm, m,
                            [("lm_head", self.weights.lm_head)])

    def _head(self, row: int):
        """Final residual add + rmsnorm and the lm_head, for one row (the last position) only."""
        c = self.config
        if row:
            nbytes = 4 * c.hidden_size
            for buffer in (self.state.proj, self.state.x):
                self.device.copy(buffer, buffer, nbytes, src_offset=row * nbytes)
        self._final_norm(1)
        head = self.weights.lm_head
        if isinstance(head, (Q8DeviceWeight, Q4DeviceWeight)):
            self._linear("lm_head", head, self.state.xb, self.state.logits, 1, decode=True)
        else:
            self.plan.gemv_f16(head, self.state.xb, self.state.logits)
        if c.final_softcap:
            self.plan.softcap(self.state.logits, c.vocab_size, c.final_softcap)

    def _head_rows(self, m: int, first: int) -> np.ndarray:
        """Final residual add + rmsnorm over the chunk's m rows and the lm_head over rows first..m−1:
        their logits (m − first, V), read back; the last row's are left in ``state.logits`` as ``_head`` does."""
        c, d = self.config, self.device
        v, hidden, count = c.vocab_size, c.hidden_size, m - first
        if self.state.all_logits is None:   # only perplexity needs these: decode never allocates them
            self.state.all_logits = d.empty((self.state.chunk, v), np.float32)
            self.state.head_in = d.empty((self.state.chunk, hidden), np.float32)
        self._final_norm(m)
        d.copy(self.state.head_in, self.state.xb, 4 * hidden * count, src_offset=4 * hidden * first)
        head = self.weights.lm_head
        if isinstance(head, Q8DeviceWeight):
            self.plan.q8("gemm", "lm_head", head, count)(head, self.state.head_in, self.state.all_logits, count)
        elif isinstance(head, Q4DeviceWeight):
            if self._lm_head_gemm is None:
                self._lm_head_gemm = GemmQ4(d, shape={"epilogue": "none"})
            self._lm_head_gemm(head, self.state.head_in, self.state.all_logits, count)
        else:
            for r in range(count):
                d.copy(self.state.row_in, self.state.head_in, 4 * hidden, src_offset=4 * hidden * r)
                self.plan.gemv_f16(head, self.state.row_in, self.state.logits)
                d.copy(self.state.all_logits, self.state.logits, 4 * v, dst_offset=4 * v * r)
        if c.final_softcap:
            self.plan.softcap(self.state.all_logits, count * v, c.final_softcap)
        d.copy(self.state.logits, self.state.all_logits, 4 * v, src_offset=4 * v * (count - 1))
        return d.read(np.empty((count, v), np.float32), self.state.all_logits)

    def _embed(self, m: int, ids):
        """The rows of the m token ids in ``ids`` (an int32 device buffer) into the residual stream, times the
        recipe's embedding scale (Gemma: √hidden)."""
        scale = {"scale": self.config.embedding_scale} if self.config.embedding_scale != 1.0 else {}
        if isinstance(self.weights.embedding, Q8DeviceWeight):
            table = self.weights.embedding
            self.plan.q8("embedding", "embedding", table, m)(table, ids, self.state.x, m, **scale)
        elif isinstance(self.weights.embedding, Q4DeviceWeight):
            self.plan.embed.q4(self.weights.embedding, ids, self.state.x, m, **scale)
        else:
            self.plan.embed.f16(self.weights.embedding, ids, self.state.x, m, **scale)

    def prefill(self, tokens: list[int], start_pos: int) -> None:
        """Run the prompt at positions start_pos.. (the cache before start_pos is reused); logits of the last.
        A model with recurrent state keeps a restore point at the prompt's end (``checkpoint``)."""
        part = self._prefill_chunks(tokens, start_pos)
        started = time.perf_counter()
        self.checkpoint()
        self._head(part - 1)
        self.host_seconds += time.perf_counter() - started

    def replay(self, tokens: list[int], start_pos: int) -> None:
        """Run tokens at positions start_pos.. through the layers only, no logits: the state (KV cache, rings,
        recurrent state) then stands after them (speculation: the accepted drafts again, after a rollback)."""
        self._prefill_chunks(tokens, start_pos)

    def prefill_logits(self, tokens: list[int], start_pos: int, first: int = 0) -> np.ndarray:
        """``prefill``, returning the logits of every position from tokens[first] on: (len − first, V) float32.

        Row i is the prediction after tokens[: first + i + 1] (perplexity reads the second half of a
        chunk). The lm_head runs as a GEMM over each prefill chunk's rows; decode is not touched.
        """
        if not 0 <= first < len(tokens):
            raise PerfxError(f"prefill_logits: first = {first} is outside the {len(tokens)} tokens")
        rows = []

        def head(chunk_first: int, m: int):
            if chunk_first + m > first:
                rows.append(self._head_rows(m, max(first - chunk_first, 0)))

        self._prefill_chunks(tokens, start_pos, head)
        return np.concatenate(rows)

    def _prefill_chunks(self, tokens: list[int], start_pos: int, after_chunk=None) -> int:
        """The layers over the prompt in chunks of ``self.state.chunk``; ``after_chunk(first, m)`` runs after each.
        Returns the last chunk's length (its rows are left in x and proj)."""
        if not tokens:
            raise PerfxError("prefill needs at least one token")
        end = start_pos + len(tokens)
        if end > self.max_positions:
            raise PerfxError(f"the prompt needs positions up to {end}, but the context holds {self.max_positions} "
                             f"(over by {end - self.max_positions}): shorten it or raise --ctx")
        self._check_ids(tokens)
        self._check_resume(start_pos)
        self._start_state(start_pos)
        self.written = end
        for first in range(0, len(tokens), self.state.chunk):
            part = tokens[first:first + self.state.chunk]
            started = time.perf_counter()
            self.state.ids[: len(part)].set(np.asarray(part, np.int32))
            self._embed(len(part), self.state.ids)
            self._layers(len(part), start_pos + first, decode=len(part) == 1)
            self.host_seconds += time.perf_counter() - started
            if after_chunk is not None:
                after_chunk(first, len(part))
        return len(part)

    def _decode_launches(self, pos: int) -> list:
        """The decode step for a token at ``pos``, as launches and copies with every argument bound.

        Everything but the attention is recorded once; the attention launches are recorded per partition count
        (their grid grows by one partition every PART positions) and read the position from ``step`` on the
        device, so one recording serves every position of its count.
        """
        parts = self.plan.attn_decode.partitions(pos)
        plan = self._decode_plans.get(parts)
        if plan is not None:
            return plan
        step = (self.state.step, 1)
        if self._decode_segments is None:
            segments: list[list] = [[]]
            with self.device.record() as launches:
                def split(layer: int):
                    segments[-1].extend(launches)
                    launches.clear()
                    segments.append([])

                self._embed(1, self.state.step)
                self._layers(1, 0, decode=True, attention=split, position=step)
                self._head(0)
                segments[-1].extend(launches)
            self._decode_segments = segments
        plan = list(self._decode_segments[0])
        with self.device.record() as launches:
            for layer, after in zip(self.config.layers_of("attention"), self._decode_segments[1:]):
                self._attend_decode(layer, pos, position=step)
                plan += launches + after
                launches.clear()
        self._decode_plans[parts] = plan
        return plan

    def _decode_replay(self, pos: int):
        """The decode step at ``pos`` as one replay (``Device.replay``): its launches one by one, or one command
        buffer where asked for and the driver has them."""
        parts = self.plan.attn_decode.partitions(pos)
        replay = self._decode_replays.get(parts)
        if replay is None:
            replay = self._decode_replays[parts] = self.device.replay(self._decode_launches(pos))
        return replay

    def decode_one(self, token: int, pos: int) -> None:
        """Feed one token at ``pos``; leaves its logits on the device.

        Per token the host uploads the token id and the position (8 bytes, without waiting) and replays the
        recorded step: no kernel argument is set and no wrapper runs (with PERFX_COMMAND_BUFFER=on, on a
        driver with command buffers, the whole step is one call).
        """
        if not 0 <= pos < self.max_positions:
            raise PerfxError(f"context full: position {pos} of {self.max_positions}; raise --ctx" if pos >= 0
                             else f"decode_one: position {pos} is negative")
        self._check_ids([token])
        self._check_resume(pos)
        self._start_state(pos)
        self.written = pos + 1
        started = time.perf_counter()
        replay = self._decode_replay(pos)
        # A fresh host array, held by the copy's event (kept, so the write stays non-blocking) until it has run.
        self._step_upload = self.device.write(self.state.step, np.array([token, pos], np.int32), wait=False)
        replay.enqueue(self.device.queue)
        self.host_seconds += time.perf_counter() - started

    def logits(self) -> np.ndarray:
        return self.state.logits.get()

    def argmax(self) -> int:
        self.plan.argmax_op(self.state.logits, self.config.vocab_size, self.state.best)
        return int(self.state.best.get()[0])

    def fill_to(self, pos: int) -> None:
        """Hold positions 0..pos−1 in the cache with arbitrary values, without running them (benchmarks: a decode
        step at position pos reads as many cached positions as a conversation of that length; only the values
        differ, which no kernel's cost depends on)."""
        if not 0 <= pos < self.max_positions:
            raise PerfxError(f"fill_to: position {pos} is outside the context of {self.max_positions} positions")
        self.cache.fill(self.device, 0.1)
        if self.history is not None:
            self.device.fill(self.history.buffer, np.float32(0.1))
        if self.delta_state is not None:
            self.delta_state.reset()
        if self.restore_points is not None:
            self.restore_points.clear()
        self.written = pos

    def can_resume(self, pos: int) -> bool:
        """Whether a forward may continue at ``pos`` from what the device holds: the KV cache holds every
        position before it, and each conv layer's ring still holds the inputs its convolution needs there
        (a rollback of up to ``HISTORY_ROWS`` − L + 1 positions)."""
        if not 0 <= pos <= self.written:
            return False
        return self._live_state_at(pos) or (self.restore_points is not None and pos in self.restore_points)

    def resume_point(self, pos: int) -> int:
        """The latest position at or before ``pos`` where a forward may continue (``can_resume``); 0 at worst."""
        if self.can_resume(pos):
            return pos
        kept = self.restore_points.positions if self.restore_points is not None else ()
        return max((p for p in kept if p <= min(pos, self.written)), default=0)

    def checkpoint(self, verification: bool = False) -> None:
        """Keep a restore point of the recurrent state at the last position run (``perfx.ops.restore_points``):
        one of the few kept, least recently used out, or (``verification``) the one a speculative step rolls
        back to. Nothing to do for a model without recurrent state."""
        if self.restore_points is None or (verification and self.can_roll_back):
            return
        if not (verification or self.written):   # zeros at 0: nothing to keep
            return
        self.restore_points.take(self.written, verification)

    @property
    def can_roll_back(self) -> bool:
        """Whether a forward may resume before the last position run without a restore point (a rejected
        speculative draft): a KV cache and conv rings can, a Gated DeltaNet state cannot."""
        return self.delta_state is None

    def _live_state_at(self, pos: int) -> bool:
        """Whether the state on the device serves a forward at ``pos`` as it is, without a restore point."""
        if self.delta_state is not None:   # S after the last position run only (or zeros from 0)
            return pos in (0, self.written)
        return self.history is None or self.history.resumable(self.config.conv_length, self.written - 1, pos)

    def _start_state(self, pos: int):
        """A forward is about to write from ``pos`` on: restore points after it are forgotten; from 0 the
        recurrent state starts from zeros (the conv rings need nothing: the kernel reads positions before 0 as
        zeros), elsewhere from the restore point at ``pos`` where the live state does not serve."""
        points = self.restore_points
        if points is None:
            return
        points.forget_after(pos)
        if pos == 0:
            self.history.first = 0
            if self.delta_state is not None:
                self.delta_state.reset()
        elif not self._live_state_at(pos):
            points.restore(pos)

    def _check_resume(self, pos: int):
        if self.delta_state is not None and not self.can_resume(pos):
            kept = sorted(self.restore_points.positions)
            raise PerfxError(f"position {pos}: this model's Gated DeltaNet layers hold their state after position "
                             f"{self.written - 1} only (positions 0..{self.written - 1} were run) and at the "
                             f"restore points {kept}; continue at {self.written}, at a restore point, or "
                             "prefill from 0")
        if self.history is not None and not self.can_resume(pos):
            raise PerfxError(f"position {pos}: this model's conv layers hold their state for positions "
                             f"{max(0, self.written - self.history.rows + self.config.conv_length - 1)}.."
                             f"{self.written} only (positions 0..{self.written - 1} were run); prefill from an "
                             "earlier position (0 always works)")

    def _check_ids(self, tokens):
        v = self.config.vocab_size
        bad = [t for t in tokens if not 0 <= int(t) < v]
        if bad:
            raise PerfxError(f"token id(s) {bad[:5]} outside the vocabulary of {v}")


def host_peak_bytes() -> int:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def load_model(name: str | None = None, device: Device | str | None = None, ctx: int | None = None,
               quantize: str | None = None, progress: bool | None = None, log=None,
               default_ctx: int = DEFAULT_CTX, tuning: bool = True, lm_head: str = "q8", kv: str = "f16",
               embedding: str = "head"):
    """Resolve ``name`` ("default", a path, "synthetic:<name>"), open it and load it on the device.

    Returns (model, source). ``log`` receives one-line progress notes (the CLI passes stderr's print).
    ``tuning`` False ignores every tuning database: the kernels run their built-in defaults. ``lm_head``
    ("q8", the default, or "fp16") is the form of the output projection and a tied embedding
    (``perfx.sources.open_model``). ``kv`` ("f16", the default, or "q8") is the KV cache's form (``Model.load``).
    ``embedding`` ("head", the default, or "q4") is the untied token embedding's form (``open_model``).
    """
    log = log or (lambda text: None)
    device = device if isinstance(device, Device) else Device(device)
    source = open_named(name, quantize=quantize, lm_head=lm_head, embedding=embedding)
    c = source.config
    log(f"perfx: model {source.describe().get('path', name)} on {device.caps.name} ({device.caps.platform}, "
        f"limits: {device.caps.limits}); {c.architecture}: {c.describe_recipe()}")
    model = Model.load(source, device, ctx=ctx, progress=progress, default_ctx=default_ctx,
                       database=default_database(tuning), log=log, kv=kv)
    r = model.load_report
    conv = f", conv state {r['conv_state_bytes'] / 2**20:.1f} MiB" if r["conv_state_bytes"] else ""
    if r["recurrent_state_bytes"]:
        conv += f", recurrent state {r['recurrent_state_bytes'] / 2**20:.1f} MiB"
    if r["restore_points"]:
        conv += (f", {r['restore_points']} restore points of the recurrent state "
                 f"{r['restore_point_bytes'] / 2**20:.1f} MiB")
    log(f"perfx: loaded in {r['load_s']:.1f}s: {r['weight_bytes'] / 2**20:.0f} MiB of weights, "
        f"{r['device_bytes'] / 2**20:.0f} MiB on the device (KV cache {r['kv']} {r['kv_cache_bytes'] / 2**20:.0f} MiB "
        f"for {r['ctx']} positions{conv}), host peak {r['host_peak_bytes'] / 2**20:.0f} MiB"
        + "".join(f"; {form} ×{count}" for form, count in r["int4_forms"].items()))
    return model, source
