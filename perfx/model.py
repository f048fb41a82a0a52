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
from dataclasses import dataclass

import numpy as np

from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.formats import Q4Matrix, Q8Matrix
from perfx.ops.gemm_q4 import GemmQ4
from perfx.ops.gemv_f16 import F16DeviceWeight
from perfx.ops.kv_cache import KVCache, RopeTable
from perfx.ops.params import READ_NAMES
from perfx.ops.q4_weight import LAYOUT_ROWS, Q4DeviceWeight
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.plan import KernelPlan
from perfx.progress import Progress
from perfx.runtime import Device
from perfx.sources import open_named
from perfx.tuning.database import Database, default_database

DEFAULT_CTX = 4096
PREFILL_CHUNK = 256  # prompt tokens per prefill pass: bounds the activation buffers


@dataclass
class DeviceLayer:
    attn_norm: object          # float32 (hidden)
    qkv: object                # Q4DeviceWeight | F16DeviceWeight, (q_dim + 2·kv_dim, hidden), bias inside (Q4)
    o: object                  # (hidden, q_dim)
    ffn_norm: object           # float32 (hidden)
    gate_up: object            # (2·intermediate, hidden): gate rows, then up rows
    down: object               # (hidden, intermediate)
    q_norm: object = None      # float32 (D): per-head q norm (Qwen3, Gemma 3)
    k_norm: object = None      # float32 (D)
    post_attn_norm: object = None   # float32 (hidden): the attention output's own norm (Gemma)
    post_ffn_norm: object = None    # float32 (hidden): the FFN output's own norm (Gemma)


class Model:
    """A decoder resident on one device, with its KV cache and run state."""

    def __init__(self, config: ModelConfig, device: Device, max_positions: int, database: Database | None = None,
                 log=None):
        self.config, self.device, self.max_positions = config, device, max_positions
        self.database = database if database is not None else default_database()
        self.log = log or (lambda text: None)
        self.layers: list[DeviceLayer] = []
        self.weight_bytes = 0           # bytes one decode step reads (every weight once)
        self.host_seconds = 0.0         # time spent enqueueing (host work), summed over calls
        self.load_report: dict = {}

    # -- loading ----------------------------------------------------------------------------------

    @classmethod
    def load(cls, source, device: Device, ctx: int | None = None, progress: bool | None = None,
             default_ctx: int = DEFAULT_CTX, database: Database | None = None, log=None) -> Model:
        """Upload ``source`` (a ``perfx.sources.ModelSource``) to ``device`` with a KV cache of ``ctx`` positions
        (default: the model's context length, at most ``default_ctx``). Kernel parameters come from
        ``database`` (default: the user's and shipped tuning results; ``default_database(False)``: none);
        ``log`` receives one line for each tuned choice this driver refuses (the next one runs instead)."""
        c = source.config
        limit = c.max_positions or default_ctx
        ctx = min(limit, default_ctx) if ctx is None else int(ctx)
        if ctx < 2:
            raise PerfxError(f"--ctx must be at least 2, got {ctx}")
        if ctx > limit:
            raise PerfxError(f"--ctx {ctx} exceeds the model's context length {limit}")
        model = cls(c, device, ctx, database, log)
        started = time.perf_counter()
        bar = Progress(c.n_layers + 3, "loading", enabled=progress)
        first = source.layer(0)
        group = source.int4_group or (first.qkv.group if isinstance(first.qkv, Q4Matrix) else None)
        model.plan = KernelPlan(c, device, ctx, model.database, model.log, group, source.weight_forms())
        bar.update(note="kernels")
        embedding = source.embedding()
        model.embedding = model._upload(embedding, "token embedding", role="embedding")
        bar.update(note="embedding")
        for i in range(c.n_layers):
            w = first if i == 0 else source.layer(i)
            if w.qkv_bias is not None and isinstance(w.qkv, np.ndarray):
                raise PerfxError("an fp16 QKV projection with a bias (Qwen2) runs only quantized: pass --quantize q4")
            norms = {name: model._vector(getattr(w, name)) for name in ("q_norm", "k_norm", "post_attn_norm",
                                                                          "post_ffn_norm") if getattr(w, name) is not None}
            model.layers.append(DeviceLayer(
                attn_norm=model._vector(w.attn_norm),
                qkv=model._upload(w.qkv, f"layer {i} qkv", "qkv", bias=w.qkv_bias),
                o=model._upload(w.o, f"layer {i} o", "o"), ffn_norm=model._vector(w.ffn_norm),
                gate_up=model._upload(w.gate_up, f"layer {i} gate_up", "gate_up"),
                down=model._upload(w.down, f"layer {i} down", "down"), **norms))
            model.weight_bytes += (sum(x.nbytes for x in (w.qkv, w.o, w.gate_up, w.down))
                                   + 4 * (2 + 2 * c.post_norms) * c.hidden_size + 8 * c.qk_norm * c.head_dim)
            del w
            bar.update(note=f"layer {i}")
        first = None
        model.final_norm = model._vector(source.final_norm())
        head = source.lm_head()
        model.lm_head = model.embedding if head is None else model._upload(head, "lm_head", "lm_head")
        model.weight_bytes += (embedding if head is None else head).nbytes + 4 * c.hidden_size
        del embedding, head
        model._allocate_state()
        bar.update(note="run state")
        bar.close()
        device.queue.finish()
        model.load_report = {
            "load_s": time.perf_counter() - started, "device_bytes": device.allocated_bytes,
            "weight_bytes": model.weight_bytes, "kv_cache_bytes": model.cache.nbytes,
            "host_peak_bytes": host_peak_bytes(), "ctx": ctx,
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
        m = min(PREFILL_CHUNK, self.max_positions)
        f32 = np.float32
        self.chunk = m
        self.x = d.empty((m, c.hidden_size), f32)            # the residual stream
        self.xb = d.empty((m, c.hidden_size), f32)           # normed activations
        self.qkv = d.empty((m, c.qkv_dim), f32)
        self.att = d.empty((m, c.q_dim), f32)                # attention output, before o
        self.proj = d.empty((m, c.hidden_size), f32)         # o or down output, added into the residual
        self.hb = d.empty((m, 2 * c.intermediate_size), f32)  # SiLU(gate)·up (and gate|up for the fp16 path)
        self.logits_buf = d.empty(c.vocab_size, f32)
        self.all_logits = self.head_in = None   # (chunk, V) and (chunk, hidden), made by the first prefill_logits
        self._lm_head_gemm = None
        self.ids = d.empty(m, np.int32)
        self.step = d.empty(2, np.int32)                     # the decode step's (token id, position)
        widest = max(c.hidden_size, c.q_dim, c.qkv_dim, 2 * c.intermediate_size)
        self.row_in, self.row_out = d.empty(widest, f32), d.empty(widest, f32)   # fp16 slow path scratch
        self.row_up, self.row_act = d.empty(c.intermediate_size, f32), d.empty(c.intermediate_size, f32)
        self.best = d.empty(1, np.int32)
        self.cache = KVCache.allocate(d, c.n_layers, c.n_kv_heads, self.max_positions, c.head_dim)
        # One cos/sin table per distinct RoPE of the recipe (Gemma 3: local and global bases), made once; a
        # GGUF's rope_freqs (Llama 3.x) and LongRoPE's factors ride in the scaling and are applied in the table.
        tables: dict[str, RopeTable] = {}
        self.layer_rope: list[RopeTable | None] = []
        self.layer_window: list[int] = []
        for i in range(c.n_layers):
            recipe = c.layer(i, self.max_positions)
            rope = recipe.rope
            if rope is not None and rope.key() not in tables:
                tables[rope.key()] = RopeTable.upload(d, c.head_dim, self.max_positions, rope.theta, rope.scaling,
                                                      rotary_dims=rope.dims)
            self.layer_rope.append(None if rope is None else tables[rope.key()])
            self.layer_window.append(recipe.window)
        self.attention_args = [self._attention_args(i) for i in range(c.n_layers)]
        self._step_upload = None
        self._decode_segments: list | None = None   # the decode step's launches between attentions
        self._decode_plans: dict[int, list] = {}    # attention partitions -> the step's launches
        self._decode_launches(0)   # recorded now: a kernel the driver refuses shows at load

    # -- the forward ------------------------------------------------------------------------------

    def _attention_args(self, layer: int) -> tuple:
        """(rope table or None, keyword arguments) of layer's attention launch: its RoPE, window, the scale,
        soft-cap and q/k norms where the recipe has them."""
        c, w = self.config, self.layers[layer]
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
                return self.plan.q8("gemv", name, weight)(weight, x, y, epilogue)
            if epilogue == "none" and weight.has_bias:
                epilogue = "bias"
            return self.plan.q8("gemm", name, weight, m)(weight, x, y, m, epilogue)
        if isinstance(weight, Q4DeviceWeight):
            if decode:
                return self.plan.gemv[name](weight, x, y, epilogue)
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
            d.copy(self.row_in, x, 4 * k, src_offset=4 * r * k)
            self.plan.gemv_f16(weight, self.row_in, self.row_out)
            result = self.row_out
            if gated:
                d.copy(self.row_up, self.row_out, 4 * cols, src_offset=4 * cols)
                self.plan.gate(self.row_out, self.row_up, self.row_act, cols)
                result = self.row_act
            d.copy(y, result, 4 * cols, dst_offset=4 * r * cols)

    def _residual_norm(self, post_norm, gamma, m: int):
        """The pending output in proj joins the residual x (through its own norm ``post_norm`` where the recipe
        has post-norms), then xb = rmsnorm(x)·γ: one launch either way."""
        c = self.config
        if post_norm is None:
            self.plan.rmsnorm.residual(self.proj, self.x, gamma, self.xb, m, c.hidden_size, c.rms_eps)
        else:
            self.plan.rmsnorm.post_residual(self.proj, self.x, post_norm, gamma, self.xb, m, c.hidden_size, c.rms_eps)

    def _attend_decode(self, layer: int, pos: int, position=None):
        """Decode attention of one layer for the token at ``pos`` (``position``: the buffer and index the
        kernel reads it from; None: the wrapper uploads it)."""
        rope, kwargs = self.attention_args[layer]
        self.plan.attn_decode(self.qkv, self.att, self.cache, rope, layer, pos, position=position, **kwargs)

    def _layers(self, m: int, pos: int, decode: bool, attention=None):
        """Every decoder layer over m rows at positions pos..pos+m−1; leaves the last residual add pending.

        ``attention(layer)``, when given, replaces the decode attention (the decode plan records it apart).
        """
        c = self.config
        for layer, w in enumerate(self.layers):
            # attention rmsnorm; from layer 1 on, the previous layer's FFN output joins the residual here
            if layer == 0:
                self.plan.rmsnorm.plain(self.x, w.attn_norm, self.xb, m, c.hidden_size, c.rms_eps)
            else:
                self._residual_norm(self.layers[layer - 1].post_ffn_norm, w.attn_norm, m)
            # qkv for these positions, then (q/k norm +) RoPE + KV append + attention
            self._linear("qkv", w.qkv, self.xb, self.qkv, m, decode)
            if attention is not None:
                attention(layer)
            elif decode:
                self._attend_decode(layer, pos)
            else:
                rope, kwargs = self.attention_args[layer]
                self.plan.prefill(m)[1](self.qkv, self.att, self.cache, rope, layer, pos, m, **kwargs)
            self._linear("o", w.o, self.att, self.proj, m, decode)
            # ffn rmsnorm, with the attention output added into the residual
            self._residual_norm(w.post_attn_norm, w.ffn_norm, m)
            # gated MLP: gate-up with the activation·up fused, then down
            self._linear("gate_up", w.gate_up, self.xb, self.hb, m, decode)
            self._linear("down", w.down, self.hb, self.proj, m, decode)

    def _final_norm(self, m: int):
        """The last layer's output joins the residual, then the final rmsnorm into xb."""
        self._residual_norm(self.layers[-1].post_ffn_norm, self.final_norm, m)

    def _head(self, row: int):
        """Final residual add + rmsnorm and the lm_head, for one row (the last position) only."""
        c = self.config
        if row:
            nbytes = 4 * c.hidden_size
            for buffer in (self.proj, self.x):
                self.device.copy(buffer, buffer, nbytes, src_offset=row * nbytes)
        self._final_norm(1)
        if isinstance(self.lm_head, Q8DeviceWeight):
            self.plan.q8("gemv", "lm_head", self.lm_head)(self.lm_head, self.xb, self.logits_buf)
        elif isinstance(self.lm_head, Q4DeviceWeight):
            self.plan.gemv["lm_head"](self.lm_head, self.xb, self.logits_buf)
        else:
            self.plan.gemv_f16(self.lm_head, self.xb, self.logits_buf)
        if c.final_softcap:
            self.plan.softcap(self.logits_buf, c.vocab_size, c.final_softcap)

    def _head_rows(self, m: int, first: int) -> np.ndarray:
        """Final residual add + rmsnorm over the chunk's m rows and the lm_head over rows first..m−1:
        their logits (m − first, V), read back; the last row's are left in ``logits_buf`` as ``_head`` does."""
        c, d = self.config, self.device
        v, hidden, count = c.vocab_size, c.hidden_size, m - first
        if self.all_logits is None:   # only perplexity needs these: decode never allocates them
            self.all_logits = d.empty((self.chunk, v), np.float32)
            self.head_in = d.empty((self.chunk, hidden), np.float32)
        self._final_norm(m)
        d.copy(self.head_in, self.xb, 4 * hidden * count, src_offset=4 * hidden * first)
        head = self.lm_head
        if isinstance(head, Q8DeviceWeight):
            self.plan.q8("gemm", "lm_head", head, count)(head, self.head_in, self.all_logits, count)
        elif isinstance(head, Q4DeviceWeight):
            if self._lm_head_gemm is None:
                self._lm_head_gemm = GemmQ4(d, shape={"epilogue": "none"})
            self._lm_head_gemm(head, self.head_in, self.all_logits, count)
        else:
            for r in range(count):
                d.copy(self.row_in, self.head_in, 4 * hidden, src_offset=4 * hidden * r)
                self.plan.gemv_f16(head, self.row_in, self.logits_buf)
                d.copy(self.all_logits, self.logits_buf, 4 * v, dst_offset=4 * v * r)
        if c.final_softcap:
            self.plan.softcap(self.all_logits, count * v, c.final_softcap)
        d.copy(self.logits_buf, self.all_logits, 4 * v, src_offset=4 * v * (count - 1))
        return d.read(np.empty((count, v), np.float32), self.all_logits)

    def _embed(self, m: int, ids):
        """The rows of the m token ids in ``ids`` (an int32 device buffer) into the residual stream, times the
        recipe's embedding scale (Gemma: √hidden)."""
        scale = {"scale": self.config.embedding_scale} if self.config.embedding_scale != 1.0 else {}
        if isinstance(self.embedding, Q8DeviceWeight):
            self.plan.q8("embedding", "embedding", self.embedding, m)(self.embedding, ids, self.x, m, **scale)
        elif isinstance(self.embedding, Q4DeviceWeight):
            self.plan.embed.q4(self.embedding, ids, self.x, m, **scale)
        else:
            self.plan.embed.f16(self.embedding, ids, self.x, m, **scale)

    def prefill(self, tokens: list[int], start_pos: int) -> None:
        """Run the prompt at positions start_pos.. (the cache before start_pos is reused); logits of the last."""
        part = self._prefill_chunks(tokens, start_pos)
        started = time.perf_counter()
        self._head(part - 1)
        self.host_seconds += time.perf_counter() - started

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
        """The layers over the prompt in chunks of ``self.chunk``; ``after_chunk(first, m)`` runs after each.
        Returns the last chunk's length (its rows are left in x and proj)."""
        if not tokens:
            raise PerfxError("prefill needs at least one token")
        end = start_pos + len(tokens)
        if end > self.max_positions:
            raise PerfxError(f"the prompt needs positions up to {end}, but the context holds {self.max_positions} "
                             f"(over by {end - self.max_positions}): shorten it or raise --ctx")
        self._check_ids(tokens)
        for first in range(0, len(tokens), self.chunk):
            part = tokens[first:first + self.chunk]
            started = time.perf_counter()
            self.ids[: len(part)].set(np.asarray(part, np.int32))
            self._embed(len(part), self.ids)
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
        if self._decode_segments is None:
            segments: list[list] = [[]]
            with self.device.record() as launches:
                def split(layer: int):
                    segments[-1].extend(launches)
                    launches.clear()
                    segments.append([])

                self._embed(1, self.step)
                self._layers(1, 0, decode=True, attention=split)
                self._head(0)
                segments[-1].extend(launches)
            self._decode_segments = segments
        plan = list(self._decode_segments[0])
        with self.device.record() as launches:
            for layer, after in enumerate(self._decode_segments[1:]):
                self._attend_decode(layer, pos, position=(self.step, 1))
                plan += launches + after
                launches.clear()
        self._decode_plans[parts] = plan
        return plan

    def decode_one(self, token: int, pos: int) -> None:
        """Feed one token at ``pos``; leaves its logits on the device.

        Per token the host uploads the token id and the position (8 bytes, without waiting) and replays the
        recorded launches: no kernel argument is set and no wrapper runs.
        """
        if not 0 <= pos < self.max_positions:
            raise PerfxError(f"context full: position {pos} of {self.max_positions}; raise --ctx" if pos >= 0
                             else f"decode_one: position {pos} is negative")
        self._check_ids([token])
        started = time.perf_counter()
        launches = self._decode_launches(pos)
        queue = self.device.queue
        # A fresh host array, held by the copy's event (kept, so the write stays non-blocking) until it has run.
        self._step_upload = self.device.write(self.step, np.array([token, pos], np.int32), wait=False)
        for launch in launches:
            launch.enqueue(queue)
        self.host_seconds += time.perf_counter() - started

    def logits(self) -> np.ndarray:
        return self.logits_buf.get()

    def argmax(self) -> int:
        self.plan.argmax_op(self.logits_buf, self.config.vocab_size, self.best)
        return int(self.best.get()[0])

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
               default_ctx: int = DEFAULT_CTX, tuning: bool = True, lm_head: str = "q8"):
    """Resolve ``name`` ("default", a path, "synthetic:<name>"), open it and load it on the device.

    Returns (model, source). ``log`` receives one-line progress notes (the CLI passes stderr's print).
    ``tuning`` False ignores every tuning database: the kernels run their built-in defaults. ``lm_head``
    ("q8", the default, or "fp16") is the form of the output projection and a tied embedding
    (``perfx.sources.open_model``).
    """
    log = log or (lambda text: None)
    device = device if isinstance(device, Device) else Device(device)
    source = open_named(name, quantize=quantize, lm_head=lm_head)
    c = source.config
    log(f"perfx: model {source.describe().get('path', name)} on {device.caps.name} ({device.caps.platform}, "
        f"limits: {device.caps.limits}); {c.architecture}: {c.describe_recipe()}")
    model = Model.load(source, device, ctx=ctx, progress=progress, default_ctx=default_ctx,
                       database=default_database(tuning), log=log)
    r = model.load_report
    log(f"perfx: loaded in {r['load_s']:.1f}s: {r['weight_bytes'] / 2**20:.0f} MiB of weights, "
        f"{r['device_bytes'] / 2**20:.0f} MiB on the device (KV cache {r['kv_cache_bytes'] / 2**20:.0f} MiB "
        f"for {r['ctx']} positions), host peak {r['host_peak_bytes'] / 2**20:.0f} MiB")
    return model, source
