"""The decoder forward on the device: thin Python over perfx's kernels, read top to bottom like llama2.c.

The forward follows the model's recipe (``perfx.config``: norms before and optionally after each layer's mixer
and FFN, SiLU or GELU gates, scales and soft-caps), never the architecture's name; what mixes positions in a
layer is the mixer of its kind (``perfx.mixers``: attention with its RoPE, window and q/k norms, the short
convolution, the Gated DeltaNet), and each matrix is a ``perfx.linear.Linear`` that runs the kernels of its form.

``Model.load(source, device, ctx)`` uploads the weights once, layer by layer (the host holds one layer
at a time), in the layouts the kernels read; QKV and gate-up were fused by the loader. ``prefill`` runs the GEMM path over a prompt (logits for the last position only);
``prefill_logits`` also returns every position's logits from a given one on (perplexity); ``decode_one``
runs the GEMV path for one token: a recorded plan of launches, every argument bound, replayed per token after
one 8-byte upload of the token id and its position (the attention reads the position on the device).
"""

from __future__ import annotations

import resource
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.formats import Q4_PAIRS, Q4Matrix
from perfx.linear import Linear, Q4Linear, upload_linear
from perfx.mixers import Mixer, mixer_class
from perfx.moe import DeviceMoE
from perfx.ops import Q8_NATURAL, Q8_TEXEL
from perfx.ops.kv_cache import check_kv_form
from perfx.ops.logit_mask import mask_words
from perfx.ops.restore_points import RestorePoints
from perfx.ops.sample import HISTORY_MAX, Sample
from perfx.plan import KernelPlan, build_requests, load_buckets
from perfx.progress import Progress
from perfx.reference import sample as sample_token
from perfx.runtime import Device, resident_peak_bytes
from perfx.sources import open_named
from perfx.step import fuse_asked
from perfx.tuning.database import Database, default_database

DEFAULT_CTX = 4096
PREFILL_CHUNK = 256  # prompt tokens per prefill pass: bounds the activation buffers
# Prompts up to this many tokens (a chat's first turn, speculation's verify steps) find their kernels built at load,
# together with the decode step's
BUILT_AT_LOAD_M = 64
TOKEN_RING = 4       # the device-chosen tokens kept for the host to read (two are in flight at most)


@dataclass
class DeviceLayer:
    """One decoder layer on the device: its mixer (of the layer's kind, which holds the mixing weights), the
    norms around it and the gated MLP."""

    mixer: Mixer
    attn_norm: object          # float32 (hidden): the norm before the mixer
    ffn_norm: object           # float32 (hidden)
    gate_up: Linear | None     # (2·intermediate, hidden): gate rows, then up rows (a MoE layer: its shared
                               # expert's, None without one)
    down: Linear | None        # (hidden, intermediate)
    post_attn_norm: object = None   # float32 (hidden): the mixer output's own norm (Gemma)
    post_ffn_norm: object = None    # float32 (hidden): the FFN output's own norm (Gemma)
    moe: bool = False          # the FFN is the mixture of experts (``Model.moe`` holds its weights)
    # Gemma 4: the per-layer input's gate (P, hidden) and projection (hidden, P), its norm, the output scalar
    ple_gate: Linear = None
    ple_proj: Linear = None
    ple_norm: object = None         # float32 (hidden)
    out_scale: object = None        # float32 (1)
    altup: AltUpLayer | None = None  # Gemma 3n: AltUp's and LAuReL's weights

    def ffn_readers(self) -> list[Linear]:
        """The Linears that read the norm before the FFN: the gated MLP's (a MoE layer's shared expert's), none where
        the MoE router alone reads it (floats)."""
        return [] if self.gate_up is None else [self.gate_up]


@dataclass
class AltUpLayer:
    """Gemma 3n's weights of one layer beside its mixer and MLP (``kernels/altup.cl``)."""

    laurel_l: Linear        # (rank, hidden)
    laurel_r: Linear        # (hidden, rank)
    laurel_norm: object     # float32 (hidden)
    router: object          # float32 (A, hidden): the router's rows, read by the router kernel itself
    router_norm: object     # float32 (hidden): the router norm's γ / hidden
    predict: object         # float32 (A·A, A): the prediction's coefficients from the router
    correct: object         # float32 (A, A): the correction's
    correct_scale: object   # float32 (hidden): the corrected active stream's scale into the per-layer gate
    sparsity: float         # the sparse gate's multiple of the standard deviation (0: a dense gate)


@dataclass
class DeviceWeights:
    """A model's weights on the device, each matrix a Linear in the form its kernels read."""

    embedding: Linear = None
    layers: list[DeviceLayer] = field(default_factory=list)
    final_norm: object = None  # float32 (hidden)
    lm_head: Linear = None     # the embedding's weight in the lm_head role where tied
    # Gemma 4's per-layer embeddings: the token table (V, n_layers·P), the embedding's projection (n_layers·P,
    # hidden), the projection's norm γ/√2 (P), and vectors of ones (hidden and P) for the norms whose normed
    # output is not used
    ple_table: Linear = None
    ple_model: Linear = None
    ple_norm: object = None
    ones: object = None
    ones_p: object = None
    # Gemma 3n's AltUp projections (A − 1 each, (hidden, hidden) fp16): the embedding into the other streams,
    # and those streams back at the end
    altup_in: list = field(default_factory=list)
    altup_out: list = field(default_factory=list)
    nbytes: int = 0            # bytes one decode step reads: every weight once (a MoE layer: its router and k experts)

    def linears(self) -> list[Linear]:
        found = [self.embedding] + ([self.lm_head] if self.lm_head.weight is not self.embedding.weight else [])
        found += [w for w in (self.ple_table, self.ple_model) if w is not None]
        for i, layer in enumerate(self.layers):
            found += layer.mixer.linears_of(i) + [w for w in (layer.gate_up, layer.down) if w is not None]
            found += [w for w in (layer.ple_gate, layer.ple_proj) if w is not None]
            found += [layer.altup.laurel_l, layer.altup.laurel_r] if layer.altup is not None else []
        found += self.altup_in + self.altup_out
        return found

    def int4_forms(self) -> dict[str, int]:
        """{"int4 g128, 2.5 bytes a group (fp16 scale + 4-bit zero)": matrices in that form, ...}: the load line's
        count of the int4 weights by the form of their scales."""
        forms = (w.describe_form() for w in self.linears())
        return dict(Counter(form for form in forms if form is not None))


@dataclass
class RunState:
    """The activations of a forward, preallocated once (llama2.c's RunState): ``chunk`` rows for a prefill
    chunk, row 0 for a decode step. Each mixer keeps its own scratch (``perfx.mixers``)."""

    chunk: int
    x: object          # (chunk, hidden) the residual stream
    xb: object         # (chunk, hidden) normed activations
    proj: object       # (chunk, hidden) a mixer's or down's output, added into the residual
    hb: object         # (chunk, 2·intermediate) act(gate)·up (and gate|up on the fp16 path)
    logits: object     # (V) the last position's logits
    ids: object        # (chunk) int32 prompt ids
    step: object       # (2) int32 the decode step's token id and position
    best: object       # (1) int32 the argmax
    tokens: object     # (TOKEN_RING) int32 the tokens the device chose, by position mod TOKEN_RING
    row_in: object     # fp16 slow path scratch rows
    row_out: object
    row_up: object
    row_act: object
    all_logits: object = None   # (chunk, V) and (chunk, hidden): made by the first prefill_logits only
    head_in: object = None
    # Gemma 4: each row's per-layer inputs (chunk, n_layers·P), the embedding's projection and a norm's unused
    # output (the same), one layer's gate (chunk, P)
    ple_in: object = None
    ple_proj: object = None
    ple_tmp: object = None
    ple_g: object = None
    # One row of xb as Q8_1 blocks (hidden int8 codes, hidden/32 (step, sum) pairs), written by a norm that
    # writes xb where a GEMV reading that xb takes int8 activations (Model._xb_order), in the order xb_order
    # (perfx.ops.Q8_TEXEL or Q8_NATURAL; 0: the last norm wrote none)
    xb_q8: tuple | None = None
    xb_order: int = 0
    # The same for up to chunk rows (chunk·hidden codes, chunk·hidden/32 pairs, row by row), written where the
    # int8-activation GEMMs over several rows read xb (a batched decode step, a short prompt); made on first use
    xb_rows_q8: tuple | None = None
    # Gemma 3n: AltUp's A streams and their prediction (A blocks of (chunk, hidden), chunk·hidden apart), the
    # router's coefficients (chunk, A·A) and the correction's scales (chunk, A), LAuReL's L·x (chunk, rank) and
    # R·L·x (chunk, hidden), the sparse gate's output (chunk, intermediate)
    streams: object = None
    pred: object = None
    coefs: object = None
    scales: object = None
    laurel_t: object = None
    laurel_out: object = None
    sparse: object = None
    # One row of hb as Q8_1 blocks in the int4 texel order, written by gate-up's tail in a fused decode step where
    # down reads int8 activations (Model._attach_tails)
    hb_q8: tuple | None = None

    @classmethod
    def allocate(cls, device: Device, c: ModelConfig, chunk: int) -> RunState:
        f32 = np.float32
        inter = max(c.intermediate_size, c.expert_shared)   # the widest gated MLP: dense, or a shared expert
        # the fp16 slow path's rows: any fp16 matrix's input or output (Gemma 3n's per-layer model projection
        # makes n_layers·P of the hidden size)
        widest = max(c.hidden_size, c.q_dim, c.qkv_dim, 2 * inter, c.n_layers * c.per_layer_input, c.laurel_rank)
        return cls(
            chunk=chunk, x=device.empty((chunk, c.hidden_size), f32), xb=device.empty((chunk, c.hidden_size), f32),
            proj=device.empty((chunk, c.hidden_size), f32), hb=device.empty((chunk, 2 * inter), f32),
            logits=device.empty(c.vocab_size, f32), ids=device.empty(chunk, np.int32),
            step=device.empty(2, np.int32), best=device.empty(1, np.int32), tokens=device.empty(TOKEN_RING, np.int32),
            row_in=device.empty(widest, f32), row_out=device.empty(widest, f32),
            row_up=device.empty(inter, f32), row_act=device.empty(inter, f32),
            **({} if not c.per_layer_input else dict(
                ple_in=device.empty((chunk, c.n_layers * c.per_layer_input), f32),
                ple_proj=device.empty((chunk, c.n_layers * c.per_layer_input), f32),
                ple_tmp=device.empty((chunk, c.n_layers * c.per_layer_input), f32),
                ple_g=device.empty((chunk, c.per_layer_input), f32))),
            **({} if not c.altup_inputs else dict(
                streams=device.empty((c.altup_inputs, chunk, c.hidden_size), f32),
                pred=device.empty((c.altup_inputs, chunk, c.hidden_size), f32),
                coefs=device.empty((chunk, c.altup_inputs ** 2), f32), scales=device.empty((chunk, c.altup_inputs), f32),
                laurel_t=device.empty((chunk, c.laurel_rank), f32), laurel_out=device.empty((chunk, c.hidden_size), f32),
                sparse=device.empty((chunk, c.intermediate_size), f32))))


class Model:
    """A decoder resident on one device: its weights, mixers (with their state), run state, the kernel plan,
    the forward.

    The state contract generation, speculation, serve and chat rely on: ``can_resume(pos)``,
    ``resume_point(pos)``, ``checkpoint(verification)``, ``can_roll_back`` and ``keeps_restore_points``."""

    def __init__(self, config: ModelConfig, device: Device, max_positions: int, database: Database | None = None,
                 log=None, kv: str = "f16"):
        if config.altup_inputs and config.altup_active != 0:
            raise PerfxError(f"{config.architecture}: AltUp's active stream is {config.altup_active}; the device "
                             "forward runs stream 0 through the layers (as Gemma 3n's checkpoints do)")
        if config.altup_inputs and not (config.per_layer_input and all(r.ffn in (0, config.intermediate_size)
                                                                        for r in config.layers)):
            raise PerfxError(f"{config.architecture}: the device forward runs AltUp with per-layer inputs and one "
                             "MLP width, as Gemma 3n has them")
        self.config, self.device, self.max_positions = config, device, max_positions
        self.kv = check_kv_form(kv, config.head_dim, "--kv")   # the KV cache's form: "f16" or "q8"
        self.database = database if database is not None else default_database()
        self.log = log or (lambda text: None)
        self.weights = DeviceWeights()
        # one mixer a layer kind the recipe has, in the order of their first layers
        kinds = list(dict.fromkeys(r.kind for r in config.layers))
        self.mixers: list[Mixer] = [mixer_class(kind)(self, config.layers_of(kind)) for kind in kinds]
        self.mixer_of = {layer: mixer for mixer in self.mixers for layer in mixer.layers}
        self.moe = DeviceMoE(self, config.moe_layers) if config.n_experts else None   # the MoE FFNs
        self.host_seconds = 0.0         # time spent enqueueing (host work), summed over calls
        self.fused = False      # whether a decode step of one row runs the norms as GEMV tails (_attach_tails)
        self.fusing = False     # whether the layers being enqueued now run them so (``_layers``)
        self._final_norm_done = False   # the last layer's down wrote the final norm (a fused step)
        self.load_report: dict = {}

    @property
    def weight_bytes(self) -> int:
        """Bytes one decode step reads: every weight once."""
        return self.weights.nbytes

    @property
    def cache(self):
        """The KV cache of the model's attention layers (None: it has none)."""
        return next((mixer.cache for mixer in self.mixers if mixer.cache is not None), None)

    # -- loading ----------------------------------------------------------------------------------

    @classmethod
    def load(cls, source, device: Device, ctx: int | None = None, progress: bool | None = None,
             default_ctx: int = DEFAULT_CTX, database: Database | None = None, log=None, kv: str = "f16",
             fuse: bool | None = None) -> Model:
        """Upload ``source`` (a ``perfx.sources.ModelSource``) to ``device`` with a KV cache of ``ctx`` positions
        (default: the model's context length, at most ``default_ctx``) in the form ``kv`` ("f16", or "q8": int8
        codes and an fp16 scale per 32, ``perfx.ops.kv_cache``). Kernel parameters come from
        ``database`` (default: the user's and shipped tuning results; ``default_database(False)``: none);
        ``log`` receives one line for each tuned choice this driver refuses (the next one runs instead); ``fuse``
        True runs the decode step's norms as tails of the GEMVs beside them (``perfx.step.fused_step``), False each
        its own launch, None as ``PERFX_FUSE`` asks, else as the device's compiler allows (``perfx.step.fuse_asked``)."""
        c = source.config
        fuse = fuse_asked(device.caps) if fuse is None else fuse
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
        group, form = _int4_plan(source, first)
        # the decode step's kernels and a first prompt's (and speculation's steps of a few tokens) built together,
        # on every core (a cached one is a look-up), while the weights upload: the plan waits only for the kernels
        # it makes (the decode step's, built first), and the load for the rest at its end; a longer prompt's are
        # built for its length's bucket when it first comes, and `perfx warm` builds every bucket's ahead
        scales = source.int4_scales()
        builds = device.build_in_background(
            build_requests(c, device, ctx, model.database, group, source.weight_forms(), model.kv, form,
                           load_buckets(min(ctx, BUILT_AT_LOAD_M)), fuse, scales),
            on_done=lambda key, error: bar.update(0, note=f"building kernels/{key[0]}"))
        try:
            model.plan = KernelPlan(c, device, ctx, model.database, model.log, group, source.weight_forms(), model.kv,
                                    form, fuse, scales)
            bar.update(note="kernels")
            embedding = source.embedding()
            model.weights.embedding = model.upload(embedding, "token embedding", "embedding")
            model._upload_per_layer_tables(source)
            model._upload_altup_tables(source)
            bar.update(note="embedding")
            for i in range(c.n_layers):
                w = first if i == 0 else source.layer(i)
                mixer = model.mixer_of[i]
                nbytes = mixer.upload(w, i)
                if w.moe is not None:
                    layer = DeviceLayer(mixer, attn_norm=model.vector(w.attn_norm), ffn_norm=model.vector(w.ffn_norm),
                                        gate_up=None, down=None, moe=True)
                    nbytes += model.moe.upload(w.moe, i) + 4 * 2 * c.hidden_size
                    layer.gate_up, layer.down = model.moe.shared_linears(i)   # its shared expert's, where it has one
                else:
                    layer = DeviceLayer(mixer, attn_norm=model.vector(w.attn_norm), ffn_norm=model.vector(w.ffn_norm),
                                        gate_up=model.upload(w.gate_up, f"layer {i} gate_up", "gate_up"),
                                        down=model.upload(w.down, f"layer {i} down", "down"))
                    nbytes += w.gate_up.nbytes + w.down.nbytes + 4 * 2 * c.hidden_size
                for name in ("post_attn_norm", "post_ffn_norm", "ple_norm", "out_scale"):
                    if getattr(w, name) is not None:
                        setattr(layer, name, model.vector(getattr(w, name)))
                        nbytes += getattr(w, name).nbytes
                for name in ("ple_gate", "ple_proj"):
                    if getattr(w, name) is not None:
                        setattr(layer, name, model.upload(getattr(w, name), f"layer {i} {name}", name))
                        nbytes += getattr(w, name).nbytes
                if w.altup is not None:
                    layer.altup = model._upload_altup(w.altup, i)
                    nbytes += sum(v.nbytes for v in w.altup.values())
                model.weights.layers.append(layer)
                model.weights.nbytes += nbytes
                del w
                bar.update(note=f"layer {i}")
            first = None
            model.weights.final_norm = model.vector(source.final_norm())
            head = source.lm_head()
            weights = model.weights
            weights.lm_head = (weights.embedding.for_role("lm_head") if head is None
                               else model.upload(head, "lm_head", "lm_head"))
            model.weights.nbytes += (embedding if head is None else head).nbytes + 4 * c.hidden_size
            del embedding, head
            model._allocate_state()
            bar.update(note="run state")
        except BaseException:   # a load that fails or is interrupted waits only for the builds under way
            builds.cancel()
            raise
        builds.wait()
        bar.close()
        device.queue.finish()
        points = model.restore_points
        model.load_report = {
            "load_s": time.perf_counter() - started, "device_bytes": device.allocated_bytes,
            "weight_bytes": model.weights.nbytes, "kv_cache_bytes": 0, "kv": model.kv,
            "conv_state_bytes": 0, "recurrent_state_bytes": 0,
            "restore_points": len(points.buffers) if points is not None else 0,
            "restore_point_bytes": points.nbytes if points is not None else 0,
            "host_peak_bytes": host_peak_bytes(), "ctx": ctx, "int4_forms": model.weights.int4_forms(),
        }
        for mixer in model.mixers:
            model.load_report.update(mixer.state_report())
        return model

    def _upload_per_layer_tables(self, source) -> None:
        """Gemma 4's per-layer table, kept on the device in the file's form (a token's row of n_layers·P values
        is what a step reads of it), the embedding's projection and its norm (γ/√2: the per-layer inputs are
        (rmsnorm(projection)·γ + rows)/√2); vectors of ones for the norms whose normed output is not used."""
        tables = source.per_layer_tables()
        if tables is None:
            return
        c, w = self.config, self.weights
        table, projection, norm = tables
        w.ple_table = self.upload(table, "per-layer table", "ple_table")
        w.ple_model = self.upload(projection, "per-layer projection", "ple_model")
        w.ple_norm = self.vector(np.asarray(norm, np.float64) / np.sqrt(2.0))
        w.ones, w.ones_p = self.vector(np.ones(c.hidden_size)), self.vector(np.ones(c.per_layer_input))
        w.nbytes += table.nbytes // c.vocab_size + projection.nbytes + norm.nbytes

    def _upload_altup_tables(self, source) -> None:
        """Gemma 3n's AltUp projections, fp16 (as the files hold them): (A − 1) into the streams, (A − 1) back."""
        if not self.config.altup_inputs:
            return
        into, back = source.altup_tables()
        w = self.weights
        for j, (a, b) in enumerate(zip(into, back), 1):
            w.altup_in.append(self.upload(np.asarray(a, np.float32), f"altup_proj {j}", "altup_proj"))
            w.altup_out.append(self.upload(np.asarray(b, np.float32), f"altup_unembd_proj {j}", "altup_unembd"))
            # each read once a forward: at the embedding, and before the head
            w.nbytes += 2 * 2 * a.size

    def _upload_altup(self, u: dict, i: int) -> AltUpLayer:
        """A layer's AltUp and LAuReL weights: LAuReL's pair as Linears, the router and its coefficients (floats
        from the source) as the router kernel reads them."""
        c = self.config

        return AltUpLayer(
            laurel_l=self.upload(u["laurel_l"], f"layer {i} laurel_l", "laurel_l"),
            laurel_r=self.upload(u["laurel_r"], f"layer {i} laurel_r", "laurel_r"),
            laurel_norm=self.vector(u["laurel_norm"]), router=self.vector(u["altup_router"]),
            router_norm=self.vector(np.asarray(u["altup_router_norm"], np.float64) / c.hidden_size),
            predict=self.vector(u["altup_predict"]), correct=self.vector(u["altup_correct"]),
            correct_scale=self.vector(u["altup_correct_scale"]), sparsity=float(c.sparsity[i]))

    def vector(self, v: np.ndarray):
        """A float32 vector (a norm's γ, a convolution's taps) on the device."""
        v = np.ascontiguousarray(v, dtype=np.float32)
        return self.device.alloc(v.nbytes, v, what="norm weight")

    def upload(self, w, what: str, role: str, bias=None) -> Linear:
        """One matrix, once, as the Linear of its form (``perfx.linear.upload_linear``)."""
        return upload_linear(self, w, what, role, bias)

    def _allocate_state(self):
        """The run state, preallocated once (llama2.c's RunState), for decode and for a prefill chunk; each
        mixer's state and scratch; the restore points of the recurrent state, where some mixer has one."""
        c, d = self.config, self.device
        self.state = RunState.allocate(d, c, min(PREFILL_CHUNK, self.max_positions))
        if any(self._xb_order(readers) for readers in self._xb_readers()):
            self.state.xb_q8 = (d.empty(c.hidden_size, np.int8), d.empty((c.hidden_size // 32, 2), np.float32))
        for mixer in self.mixers:
            mixer.allocate()
        if self.moe is not None:
            self.moe.allocate()
        parts = [part for mixer in self.mixers for part in mixer.restore_parts()]
        self.restore_points = (RestorePoints(d, parts, verification=not self.can_roll_back) if parts else None)
        self.written = 0    # positions 0..written−1 are in the cache and the recurrent state
        self._step_upload = None
        self._decode_segments: list | None = None   # the decode step's launches between the spliced ones
        self._spliced: list = []                    # (mixer, layer) of each launch recorded per position
        self._decode_plans: dict[tuple, list] = {}  # partitions -> the step's launches
        self._decode_replays: dict = {}             # partitions -> those launches as one replay
        self._greedy_replays: dict = {}             # partitions -> the step choosing and handing over its token
        self._handover: list | None = None          # the argmax and next_step launches, recorded once
        self._sampled_replays: dict = {}            # partitions -> the step drawing its token, for the settings below
        self._sampled_settings: tuple | None = None  # the sampling settings and seed the draws were recorded with
        self._sample, self._sample_history = None, None   # the sample kernel and the penalty's window, on first use
        self._mask = None   # constrained decoding: the bitmask, the draw's position and its penalty window (first use)
        self._mask_uploads: list = []   # their last copies' events (each holds its host array)
        self._attach_tails()
        self._decode_replay(0)   # recorded now: a kernel the driver refuses shows at load
        self.greedy_launches(0)  # and the hand-over's kernels built now, not in the first token's time

    def _xb_readers(self) -> list[list[Linear]]:
        """The readers of each norm that writes xb: a layer's mixer, its MLP, the lm_head."""
        layers = self.weights.layers
        return ([layer.mixer.xb_readers(i) for i, layer in enumerate(layers)]
                + [layer.ffn_readers() for layer in layers] + [[self.weights.lm_head]])

    def _xb_order(self, readers: list[Linear]) -> int:
        """The order a norm writes xb's blocks in for these readers, 0 for none: each GEMV reading the blocks shares
        the norm's quantization and launches none of its own; the int4 GEMVs' order where readers want both (an
        int8 reader then quantizes x itself)."""
        return self._rows_order(readers, 1)

    def _rows_order(self, readers: list[Linear], m: int) -> int:
        """``_xb_order`` for a norm over m rows, whose readers are the products over m rows."""
        if self.config.hidden_size % 32:
            return 0
        orders = {r.blocks_order(m) for r in readers}
        return Q8_TEXEL if Q8_TEXEL in orders else Q8_NATURAL if Q8_NATURAL in orders else 0

    # -- the forward ------------------------------------------------------------------------------

    def xb_blocks(self, m: int):
        """(codes and scales, order) of xb's Q8_1 blocks where the last norm wrote them for its m rows, else None."""
        s = self.state
        if not s.xb_order:
            return None
        return (s.xb_q8, s.xb_order) if m == 1 else (s.xb_rows_q8, s.xb_order)

    def _norm_blocks(self, readers: list[Linear], m: int) -> dict:
        """The keyword arguments of a norm writing xb for ``readers``: its Q8_1 blocks and their order where some
        reader takes them (one row: the decode GEMVs; several: the int8-activation GEMMs of a batched step or a
        short prompt, so none of them launches its own quantizing); ``state.xb_order`` says which the readers
        find."""
        s = self.state
        if m == 1:
            s.xb_order = self._xb_order(readers) if s.xb_q8 is not None else 0
            return {"quantized": s.xb_q8, "order": s.xb_order} if s.xb_order else {}
        s.xb_order = self._rows_order(readers, m) if m <= s.chunk else 0
        if not s.xb_order:
            return {}
        if s.xb_rows_q8 is None:   # made on first use: a model that never runs these GEMMs holds none
            h = self.config.hidden_size
            s.xb_rows_q8 = (self.device.empty(s.chunk * h, np.int8),
                            self.device.empty((s.chunk * h // 32, 2), np.float32))
        return {"quantized": s.xb_rows_q8, "order": s.xb_order}

    def _residual_norm(self, post_norm, gamma, m: int, readers: list[Linear]):
        """The pending output in proj joins the residual x (through its own norm ``post_norm`` where the recipe
        has post-norms), then xb = rmsnorm(x)·γ (and, for one row, xb's Q8_1 blocks where its ``readers`` read
        them): one launch either way."""
        c, s = self.config, self.state
        blocks = self._norm_blocks(readers, m)
        if post_norm is None:
            self.plan.rmsnorm.residual(s.proj, s.x, gamma, s.xb, m, c.hidden_size, c.rms_eps, **blocks)
        else:
            self.plan.rmsnorm.post_residual(s.proj, s.x, post_norm, gamma, s.xb, m, c.hidden_size, c.rms_eps, **blocks)

    def _layers(self, m: int, pos: int, decode: bool, position=None, split=None, rows=None, mark=None):
        """Every decoder layer over m rows at positions pos..pos+m−1; leaves the last residual add pending.

        ``position`` (buffer, index), when given, is where the mixers read ``pos`` on the device; ``split``, when
        given, receives the launches that depend on the position (the decode recording records them apart).
        ``rows`` (``perfx.mixers.Rows``), when given, makes the m rows those of a batched decode step instead:
        each its own sequence's token, at its own position (``perfx.batch``). ``mark(i)``, when given, is called
        before layer i's launches (``step_launches`` counts them a layer).
        """
        c, s = self.config, self.state
        # a fused step (one row of a decode step): the norms run as tails of the o and down GEMVs (_attach_tails),
        # the first layer's here, on the embedding's output
        self.fusing = fusing = self.fused and m == 1 and decode and rows is None
        if c.altup_inputs:
            self._altup_layers(m, pos, decode, position, split, rows, mark)
            return
        if fusing:
            self.plan.rmsnorm.plain(s.x, self.weights.layers[0].attn_norm, s.xb, m, c.hidden_size, c.rms_eps,
                                    **self._norm_blocks(self.weights.layers[0].mixer.xb_readers(0), m))
        for i, w in enumerate(self.weights.layers):
            if mark is not None:
                mark(i)
            # the mixer's rmsnorm; from layer 1 on, the previous layer's FFN output joins the residual here
            readers = w.mixer.xb_readers(i)
            if fusing:
                pass   # the previous layer's down wrote xb (or, at layer 0, the norm above)
            elif i == 0 or self._closes_layers:
                self.plan.rmsnorm.plain(s.x, w.attn_norm, s.xb, m, c.hidden_size, c.rms_eps,
                                        **self._norm_blocks(readers, m))
            else:
                self._residual_norm(self.weights.layers[i - 1].post_ffn_norm, w.attn_norm, m, readers)
            # attention, short convolution or Gated DeltaNet: the mixer of the layer's kind, into proj
            if rows is None:
                w.mixer.forward(i, m, pos, decode, position=position, split=split)
            else:
                w.mixer.forward_rows(i, m, rows)
            # ffn rmsnorm, with the mixer's output added into the residual (the o projection's tail where fused)
            if not fusing:
                self._residual_norm(w.post_attn_norm, w.ffn_norm, m, w.ffn_readers())
            if w.moe:   # the mixture of experts: its shared expert, the router, the chosen experts' gate-up and down
                self.moe.forward(i, m, decode)
                continue
            # gated MLP: gate-up with the activation·up fused, then down
            w.gate_up(s.xb, s.hb, m, decode, self.xb_blocks(m))
            w.down(s.hb, s.proj, m, decode, (s.hb_q8, Q8_TEXEL) if fusing and w.gate_up.tail is not None else None)
            if self._closes_layers:
                self._per_layer(i, w, m, decode)
        self._final_norm_done, self.fusing = fusing, False

    def _altup_layers(self, m: int, pos: int, decode: bool, position=None, split=None, rows=None, mark=None):
        """Gemma 3n's layers over AltUp's A streams (llama.cpp's gemma3n-iswa.cpp, ``perfx.forward64``), leaving
        the residual whole in x: the embedding and its projections at its magnitude; per layer the streams
        predicted from each other (the router on the active one, stream 0), the active one through the mixer and
        LAuReL, the (sparse) MLP, every stream corrected by the layer's output, the per-layer input into the
        others; at the end the others projected back at stream 0's magnitude and the A averaged."""
        c, s, plan, weights = self.config, self.state, self.plan, self.weights
        op, d = plan.altup, self.device
        a, h, eps, p = c.altup_inputs, c.hidden_size, c.rms_eps, c.per_layer_input
        stride = s.chunk * h
        d.copy(s.streams, s.x, 4 * m * h)
        for j, into in enumerate(weights.altup_in, 1):
            into(s.x, s.proj, m, decode)
            op.rescale(s.x, s.proj, s.streams, m, h, offset=j * stride)
        for i, w in enumerate(weights.layers):
            if mark is not None:
                mark(i)
            u = w.altup
            # predict every stream from all of them; the active one's rmsnorm
            op.router(s.streams, u.router_norm, u.router, u.predict, s.coefs, m, h, a, a * a, eps, 0.0)
            op.predict(s.streams, s.coefs, s.pred, m, h, a, stride)
            plan.rmsnorm.plain(s.pred, w.attn_norm, s.xb, m, h, eps,
                               **self._norm_blocks(w.mixer.xb_readers(i) + [u.laurel_l], m))
            # the mixer into proj, LAuReL's R·L·xb beside it; both with the active stream into x, the FFN's norm
            if rows is None:
                w.mixer.forward(i, m, pos, decode, position=position, split=split)
            else:
                w.mixer.forward_rows(i, m, rows)
            u.laurel_l(s.xb, s.laurel_t, m, decode, self.xb_blocks(m))
            s.xb_order = 0   # the norms below write xb without its int8 blocks
            u.laurel_r(s.laurel_t, s.laurel_out, m, decode)
            op.laurel_combine(s.proj, s.laurel_out, s.pred, w.post_attn_norm, u.laurel_norm, w.ffn_norm, s.x, s.xb,
                              m, h, eps)
            # the MLP: on the sparse layers gate-up unfused, the gate's Gaussian top-k, GELU·up; its output
            # through its post-norm into x (the layer's output)
            if u.sparsity:
                w.gate_up.unfused(s.xb, s.hb, m, decode)
                op.sparse_gate(s.hb, s.sparse, m, c.intermediate_size, u.sparsity)
                w.down(s.sparse, s.proj, m, decode)
            else:
                w.gate_up(s.xb, s.hb, m, decode)
                w.down(s.hb, s.proj, m, decode)
            plan.rmsnorm.post_residual(s.proj, s.x, w.post_ffn_norm, weights.ones, s.xb, m, h, eps)
            # correct every stream by the active one's innovation; the corrected active one, scaled, into xb
            op.router(s.x, u.router_norm, u.router, u.correct, s.scales, m, h, a, a, eps, 1.0)
            op.correct(s.pred, s.x, s.scales, u.correct_scale, s.streams, s.xb, m, h, a, stride)
            # the per-layer input into the other streams
            w.ple_gate(s.xb, s.ple_g, m, decode)
            plan.per_layer_gate(s.ple_g, s.ple_in, s.ple_g, m, p, c.n_layers * p, i * p)
            w.ple_proj(s.ple_g, s.proj, m, decode)
            op.add_normed(s.proj, w.ple_norm, s.streams, m, h, a, stride, 1, eps)
        # the others projected back at stream 0's magnitude, the A averaged into x
        op.rescale(s.streams, s.streams, s.x, m, h, weight=1.0 / a)
        for j, back in enumerate(weights.altup_out, 1):
            d.copy(s.xb, s.streams, 4 * m * h, src_offset=4 * j * stride)
            back(s.xb, s.proj, m, decode)
            op.rescale(s.streams, s.proj, s.x, m, h, weight=1.0 / a, accumulate=True)

    @property
    def _closes_layers(self) -> bool:
        """Whether each layer ends with its residual whole (Gemma 4: the per-layer input and the output scalar
        come after the MLP's output joins it), so the next norm is a plain one."""
        return bool(self.config.per_layer_input or self.config.layer_scale)

    def _attach_tails(self):
        """A fused decode step (the plan's ``gemv_tail``: ``perfx.step.fused_step``): the matrix ending each layer's
        mixer (attention's o, ...) adds its output into the residual and writes xb normed for the MLP, its down does the same for the next
        layer's mixer (the final norm for the lm_head after the last), through the post-norms where the recipe has
        them, and its gate-up writes hb's Q8_1 blocks where down reads int8 activations. Each is a tail of the
        GEMV (``Q4Linear.tail``), run where ``_layers`` enqueues one row of a decode step. A matrix that is not
        int4 after all (a weight the file's header did not announce) leaves the step unfused."""
        c, s, tails, layers = self.config, self.state, self.plan.gemv_tail, self.weights.layers
        if not tails:
            return
        outputs = set(tails) - {"gate_up", "down"}   # the matrix ending each mixer (perfx.step.mixer_outputs)
        linears = [(next((x for x in w.mixer.linears_of(i) if x.role in outputs), None), w.gate_up, w.down)
                   for i, w in enumerate(layers)]
        if not all(isinstance(x, Q4Linear) for trio in linears for x in trio):
            return

        def norm_tail(gamma, post, readers):
            def run(wrapper, weight, x, y, quantized):
                s.xb_order = order = self._xb_order(readers) if s.xb_q8 is not None else 0
                return wrapper.norm(weight, x, y, s.x, gamma, c.rms_eps, s.xb, post, s.xb_q8, order, quantized)
            return run

        def quantize_tail(wrapper, weight, x, y, quantized):
            return wrapper.quantize_output(weight, x, y, s.hb_q8, Q8_TEXEL, self.plan.gate_epilogue, quantized)

        for i, ((o, gate_up, down), w) in enumerate(zip(linears, layers)):
            o.tail = norm_tail(w.ffn_norm, w.post_attn_norm, w.ffn_readers())
            after = layers[i + 1] if i + 1 < len(layers) else None
            down.tail = (norm_tail(after.attn_norm, w.post_ffn_norm, after.mixer.xb_readers(i + 1)) if after
                         else norm_tail(self.weights.final_norm, w.post_ffn_norm, [self.weights.lm_head]))
            if "gate_up" in tails and down.blocks_order() == Q8_TEXEL:
                gate_up.tail = quantize_tail
                if s.hb_q8 is None:
                    width = c.intermediate_size
                    s.hb_q8 = (self.device.empty(width, np.int8), self.device.empty((width // 32, 2), np.float32))
        self.fused = True

    def _per_layer(self, i: int, w: DeviceLayer, m: int, decode: bool):
        """Gemma 4, after layer i's MLP: its output into the residual through its post-norm; the per-layer input
        x + rmsnorm(W_proj·(GELU(W_gate·x) ⊙ the layer's inputs))·γ; the residual times the layer's scalar (as
        llama.cpp's gemma4). The norms' normed output (into xb, with γ = 1) is not used."""
        c, s, plan, weights = self.config, self.state, self.plan, self.weights
        hidden, eps = c.hidden_size, c.rms_eps
        plan.rmsnorm.post_residual(s.proj, s.x, w.post_ffn_norm, weights.ones, s.xb, m, hidden, eps)
        if w.ple_gate is not None:
            p = c.per_layer_input
            w.ple_gate(s.x, s.ple_g, m, decode)
            plan.per_layer_gate(s.ple_g, s.ple_in, s.ple_g, m, p, c.n_layers * p, i * p)
            w.ple_proj(s.ple_g, s.proj, m, decode)
            plan.rmsnorm.post_residual(s.proj, s.x, w.ple_norm, weights.ones, s.xb, m, hidden, eps)
        if w.out_scale is not None:
            plan.layer_scale(s.x, w.out_scale, m * hidden)
        s.xb_order = 0

    def _final_norm(self, m: int):
        """The last layer's output joins the residual, then the final rmsnorm into xb (done already by the last
        down's tail in a fused step)."""
        if self._final_norm_done:
            self._final_norm_done = False
            return
        if self._closes_layers:
            s, c = self.state, self.config
            self.plan.rmsnorm.plain(s.x, self.weights.final_norm, s.xb, m, c.hidden_size, c.rms_eps,
                                    **self._norm_blocks([self.weights.lm_head], m))
            return
        self._residual_norm(self.weights.layers[-1].post_ffn_norm, self.weights.final_norm, m, [self.weights.lm_head])

    def _head(self, row: int):
        """Final residual add + rmsnorm and the lm_head, for one row (the last position) only."""
        c, s = self.config, self.state
        if row:
            nbytes = 4 * c.hidden_size
            for buffer in (s.proj, s.x):
                self.device.copy(buffer, buffer, nbytes, src_offset=row * nbytes)
        self._final_norm(1)
        self.weights.lm_head(s.xb, s.logits, 1, True, self.xb_blocks(1))
        if c.final_softcap:
            self.plan.softcap(s.logits, c.vocab_size, c.final_softcap)

    def _head_rows(self, m: int, first: int) -> np.ndarray:
        """Final residual add + rmsnorm over the chunk's m rows and the lm_head over rows first..m−1:
        their logits (m − first, V), read back; the last row's are left in ``state.logits`` as ``_head`` does."""
        c, d, s = self.config, self.device, self.state
        v, hidden, count = c.vocab_size, c.hidden_size, m - first
        if s.all_logits is None:   # only perplexity needs these: decode never allocates them
            s.all_logits = d.empty((s.chunk, v), np.float32)
            s.head_in = d.empty((s.chunk, hidden), np.float32)
        self._final_norm(m)
        d.copy(s.head_in, s.xb, 4 * hidden * count, src_offset=4 * hidden * first)
        self.weights.lm_head.rows(s.head_in, s.all_logits, count)
        if c.final_softcap:
            self.plan.softcap(s.all_logits, count * v, c.final_softcap)
        d.copy(s.logits, s.all_logits, 4 * v, src_offset=4 * v * (count - 1))
        return d.read(np.empty((count, v), np.float32), s.all_logits)

    def _embed(self, m: int, ids):
        """The rows of the m token ids in ``ids`` (an int32 device buffer) into the residual stream, times the
        recipe's embedding scale (Gemma: √hidden); Gemma 4's per-layer inputs of those tokens."""
        self.weights.embedding.gather(ids, self.state.x, m, self.config.embedding_scale)
        w, c, s = self.weights, self.config, self.state
        if w.ple_table is not None:
            # (rmsnorm(x·W/√hidden)·γ + rows·√P)/√2, each token's n_layers rows of P: the rows times √P/√2, γ/√2,
            # and 1/√hidden moved into the norm's eps (rmsnorm(y/a) with eps is rmsnorm(y) with a²·eps)
            p = c.per_layer_input
            w.ple_table.gather(ids, s.ple_in, m, float(np.sqrt(p / 2.0)))
            w.ple_model(s.x, s.ple_proj, m, m == 1)
            self.plan.rmsnorm.post_residual(s.ple_proj, s.ple_in, w.ple_norm, w.ones_p, s.ple_tmp, m * c.n_layers, p,
                                            c.rms_eps * c.hidden_size)

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

    def decode_launches(self, pos: int) -> list:
        """The decode step for a token at ``pos``, as launches and copies with every argument bound.

        Everything but the launches whose grid depends on the position (the attention's: one partition more
        every PART positions) is recorded once; those are recorded per partition count of each mixer and read
        the position from ``step`` on the device, so one recording serves every position of its count.
        """
        key = tuple(mixer.partitions(pos) for mixer in self.mixers)
        plan = self._decode_plans.get(key)
        if plan is not None:
            return plan
        step = (self.state.step, 1)
        if self._decode_segments is None:
            segments: list[list] = [[]]
            with self.device.record() as launches:
                def split(mixer, layer: int):
                    segments[-1].extend(launches)
                    launches.clear()
                    segments.append([])
                    self._spliced.append((mixer, layer))

                self._embed(1, self.state.step)
                self._layers(1, 0, decode=True, position=step, split=split)
                self._head(0)
                segments[-1].extend(launches)
            self._decode_segments = segments
        plan = list(self._decode_segments[0])
        with self.device.record() as launches:
            for (mixer, layer), after in zip(self._spliced, self._decode_segments[1:]):
                mixer.record_varying(layer, pos, step)
                plan += launches + after
                launches.clear()
        self._decode_plans[key] = plan
        return plan

    def _decode_replay(self, pos: int):
        """The decode step at ``pos`` as one replay (``Device.replay``): its launches one by one, or one command
        buffer where asked for and the driver has them."""
        key = tuple(mixer.partitions(pos) for mixer in self.mixers)
        replay = self._decode_replays.get(key)
        if replay is None:
            replay = self._decode_replays[key] = self.device.replay(self.decode_launches(pos))
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

    def greedy_tokens(self, token: int, pos: int, last: int) -> Iterator[int]:
        """Feed ``token`` at ``pos``, then yield the greedy token after each position from ``pos`` to ``last``,
        feeding each at the next position while positions up to ``last`` remain.

        Each step chooses its token on the device (the argmax) and writes it, with the next position, where the
        next step reads them (``kernels/decode_loop.cl``), so the host enqueues step n + 1 before it reads step
        n's token: the device never waits for the host between steps. A consumer that stops early (an end of
        generation, a stop string, a cancel) leaves one step run past its reply; what that step wrote to the
        cache lies past the last position used and is never read. A model whose state cannot roll back
        (``can_roll_back``) runs step by step instead, so its state stands after the reply.
        """
        self._check_positions("greedy_tokens", pos, last)
        return self._chosen_tokens(token, pos, last, self._greedy_replays, self._greedy_handover, self.argmax)

    def greedy_launches(self, pos: int) -> list:
        """The decode step at ``pos`` as ``greedy_tokens`` runs it: ``decode_launches`` and the hand-over (the
        argmax, and the chosen token written where the next step reads it)."""
        return self.decode_launches(pos) + self._greedy_handover()

    def step_launches(self, pos: int) -> dict:
        """The kernel launches of the greedy decode step at ``pos`` (``greedy_launches``), counted by where they
        run: ``before`` the layers (the embedding gather), each layer's (``layers``, in order, with its kind in
        ``kinds``), ``after`` them (the final norm, the head, the argmax and the hand-over). Nothing runs."""
        step, marks = (self.state.step, 1), []
        with self.device.record() as launches:
            self._embed(1, self.state.step)
            self._layers(1, pos, decode=True, position=step,
                         split=lambda mixer, layer: mixer.record_varying(layer, pos, step),
                         mark=lambda i: marks.append(len(launches)))
            marks.append(len(launches))
            self._head(0)
        steps = list(launches) + self._greedy_handover()
        ends = [sum(1 for op in steps[:at] if hasattr(op, "kernel")) for at in marks]
        total = sum(1 for op in steps if hasattr(op, "kernel"))
        return {"before": ends[0], "layers": [b - a for a, b in zip(ends, ends[1:])], "after": total - ends[-1],
                "kinds": [self.mixer_of[i].kind for i in range(self.config.n_layers)], "total": total}

    def _greedy_handover(self) -> list:
        if self._handover is None:
            s = self.state
            self._handover = self._record_handover(lambda: self.plan.argmax_op(s.logits, self.config.vocab_size,
                                                                                s.best))
        return self._handover

    def _record_handover(self, choose) -> list:
        """The launches of ``choose()`` (the chosen token into ``state.best``) and of its hand-over to the next step,
        recorded."""
        s = self.state
        with self.device.record() as handover:
            choose()
            self.plan.next_step(s.best, s.step, s.tokens, TOKEN_RING)
        return list(handover)

    def _check_positions(self, what: str, pos: int, last: int) -> None:
        if not pos <= last < self.max_positions:
            raise PerfxError(f"{what}: positions {pos}..{last} are outside the context of {self.max_positions}")

    def _chosen_tokens(self, token: int, pos: int, last: int, replays: dict, handover, choose_now) -> Iterator[int]:
        """The decode loop on the device shared by ``greedy_tokens`` and ``sampled_tokens``: each step's replay (in
        ``replays`` by the partitions of its position) ends with ``handover()``'s launches; where the state cannot
        roll back, step by step, ``choose_now()`` giving each token."""
        if not self.can_roll_back:
            for q in range(pos, last + 1):
                self.decode_one(token, q)
                token = choose_now()
                yield token
            return
        self._check_ids([token])
        self._check_resume(pos)
        self._enqueue_chosen(pos, replays, handover, token)
        for q in range(pos, last + 1):
            if q < last:
                self._enqueue_chosen(q + 1, replays, handover)
            slot = np.empty(1, np.int32)
            self.device.read_later(slot, self.state.tokens, 4 * ((q + 1) % TOKEN_RING)).wait()
            yield int(slot[0])

    def _enqueue_chosen(self, pos: int, replays: dict, handover, token: int | None = None) -> None:
        """Enqueue the decode step at ``pos`` that chooses its token and hands it to the next step; ``token``: the
        token to feed, uploaded first (None: the previous step handed it over on the device)."""
        self._start_state(pos)
        self.written = pos + 1
        started = time.perf_counter()
        key = tuple(mixer.partitions(pos) for mixer in self.mixers)
        replay = replays.get(key)
        if replay is None:
            replay = replays[key] = self.device.replay(self.decode_launches(pos) + handover())
        if token is not None:
            self._step_upload = self.device.write(self.state.step, np.array([token, pos], np.int32), wait=False)
        replay.enqueue(self.device.queue)
        self.host_seconds += time.perf_counter() - started

    def samples_on_device(self, config) -> bool:
        """Whether ``sampled_tokens`` draws with ``config`` (a ``SamplingConfig``, not greedy) on the device:
        the sample kernel serves it (``Sample.supports``) and the state can roll back (the loop runs a step
        ahead)."""
        return self.can_roll_back and not config.greedy and self._sampler().supports(config, self.config.vocab_size)

    def _sampler(self) -> Sample:
        """The plan's draw (``kernels/sample.cl``), and the penalty's window on the device, made on first use."""
        if self._sample is None:
            self._sample = self.plan.sample
            self._sample_history = self.device.empty(HISTORY_MAX, np.int32)
        return self._sample

    def sampled_tokens(self, token: int, pos: int, last: int, config, seed: int, seen: list[int]) -> Iterator[int]:
        """As ``greedy_tokens``, each token drawn on the device instead (``kernels/sample.cl``): from the host
        sampler's distribution after ``seen`` (the ids so far, ``token`` last) with the uniform of (``seed``, 0,
        the step's position), the penalty's window of the last 256 ids kept on the device and appended by each
        step. ``PositionalState.sampled_tokens`` is the same loop on the host, drawing the same tokens."""
        self._check_positions("sampled_tokens", pos, last)
        if not self._sampler().supports(config, self.config.vocab_size):
            raise PerfxError(f"sampled_tokens: {config} is not drawn on the device (Model.samples_on_device)")
        window = np.full(HISTORY_MAX, -1, np.int32)
        for j, seen_id in enumerate(reversed(list(seen)[-HISTORY_MAX:])):
            window[(pos - j) % HISTORY_MAX] = seen_id
        self._sample_history.set(window)
        settings = (config.temperature, config.top_k, config.top_p, config.min_p, config.repetition_penalty, seed)
        if settings != self._sampled_settings:   # a new request's draw: the last one's replays are not kept
            self._sampled_replays.clear()
            self._sampled_settings = settings

        def draw_now() -> int:
            self._enqueue_sample(config, seed)
            return int(self.state.best.get()[0])
        return self._chosen_tokens(token, pos, last, self._sampled_replays,
                                   lambda: self._record_handover(lambda: self._enqueue_sample(config, seed)), draw_now)

    def _enqueue_sample(self, config, seed: int) -> None:
        """The draw from the logits at the position in ``state.step``, its token appended to the window."""
        s = self.state
        self._sample(s.logits, self.config.vocab_size, s.best, temperature=config.temperature, top_k=config.top_k,
                     top_p=config.top_p, min_p=config.min_p, penalty=config.repetition_penalty,
                     history=self._sample_history, h=HISTORY_MAX, seed=seed, counter=0, position=(s.step, 1))
        self._sample.append(s.best, s.step, self._sample_history)

    def masked_token(self, allowed: np.ndarray, config, seed: int, seen: list[int], pos: int) -> int:
        """The next token after the last forward (of position ``pos``) among the tokens ``allowed`` (a bitmask of
        uint32 words, ``perfx.constrain``; tokens past it are forbidden): the mask is uploaded and applied to the
        logits on the device (``kernels/logit_mask.cl``), then the argmax or, as ``sampled_tokens`` draws, the
        draw with ``config`` after ``seen`` at (``seed``, 0, ``pos``). The logits are read back only for settings
        the device does not draw (``Sample.supports``), for the host sampler."""
        s, v = self.state, self.config.vocab_size
        words = mask_words(v)
        if self._mask is None:
            self._mask = (self.device.empty(words, np.uint32), self.device.empty(1, np.int32),
                          self.device.empty(HISTORY_MAX, np.int32))
        mask, position, history = self._mask
        padded = np.zeros(words, np.uint32)
        padded[:min(len(allowed), words)] = allowed[:words]
        started = time.perf_counter()
        # Written without waiting (the forward before it may still run): each fresh host array is held by its
        # copy's event, kept until the next call, when the blocking read below has seen every copy done.
        self._mask_uploads = [self.device.write(mask, padded, wait=False)]
        self.plan.logit_mask(s.logits, v, mask)
        window = np.asarray(list(seen)[-HISTORY_MAX:], np.int32)
        on_device = not config.greedy and self._sampler().supports(config, v)
        if on_device:
            self._mask_uploads.append(self.device.write(position, np.array([pos], np.int32), wait=False))
            if len(window):
                self._mask_uploads.append(self.device.write(history, window, wait=False))
            self._sample(s.logits, v, s.best, temperature=config.temperature, top_k=config.top_k,
                         top_p=config.top_p, min_p=config.min_p, penalty=config.repetition_penalty, history=history,
                         h=len(window), seed=seed, counter=0, position=(position, 0))
        self.host_seconds += time.perf_counter() - started
        if config.greedy:
            return self.argmax()
        if not on_device:
            return sample_token(self.logits(), window, config.temperature, config.top_k, config.top_p,
                                config.min_p, config.repetition_penalty, seed, 0, pos)
        return int(s.best.get()[0])

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
        for mixer in self.mixers:
            mixer.fill(0.1)
        if self.restore_points is not None:
            self.restore_points.clear()
        self.written = pos

    # -- the state contract: where a forward may continue ----------------------------------------------

    @property
    def keeps_restore_points(self) -> bool:
        """Whether some layer's state is recurrent (it holds the last positions only), so that a forward can
        continue at an earlier position only from a restore point kept there (``checkpoint``)."""
        return self.restore_points is not None

    @property
    def can_roll_back(self) -> bool:
        """Whether a forward may resume before the last position run without a restore point (a rejected
        speculative draft): a KV cache and conv rings can, a Gated DeltaNet state cannot."""
        return all(mixer.can_roll_back for mixer in self.mixers)

    def can_resume(self, pos: int) -> bool:
        """Whether a forward may continue at ``pos`` from what the device holds: every mixer's state serves
        it as it is (a KV cache holds every position before it; a conv ring the inputs its convolution needs
        there), or a restore point was kept there."""
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

    def _live_state_at(self, pos: int) -> bool:
        """Whether the state on the device serves a forward at ``pos`` as it is, without a restore point."""
        return all(mixer.live_at(pos, self.written) for mixer in self.mixers)

    def _start_state(self, pos: int):
        """A forward is about to write from ``pos`` on: restore points after it are forgotten; from 0 the
        recurrent state starts from zeros, elsewhere from the restore point at ``pos`` where the live state does
        not serve."""
        points = self.restore_points
        if points is None:
            return
        points.forget_after(pos)
        if pos == 0:
            for mixer in self.mixers:
                mixer.reset()
        elif not self._live_state_at(pos):
            points.restore(pos)

    def _check_resume(self, pos: int):
        if self.restore_points is None or self.can_resume(pos):
            return
        kept = sorted(self.restore_points.positions)
        for mixer in self.mixers:
            reason = mixer.resume_error(pos, self.written, kept)
            if reason:
                raise PerfxError(reason)

    def _check_ids(self, tokens):
        v = self.config.vocab_size
        bad = [t for t in tokens if not 0 <= int(t) < v]
        if bad:
            raise PerfxError(f"token id(s) {bad[:5]} outside the vocabulary of {v}")


def _int4_plan(source, first) -> tuple[int | None, int]:
    """The int4 group the kernels are chosen for (the file's, else the first layer's fused QKV's) and the scales'
    form the int4 kernels are built for first (``kernels/q4.h`` Q4_SCALES)."""
    qkv = first.linears().get("qkv") if isinstance(first.linears().get("qkv"), Q4Matrix) else None
    return source.int4_group or (qkv.group if qkv else None), qkv.form if qkv else Q4_PAIRS


def kernel_requests(source, device: Device, ctx: int | None = None, database: Database | None = None,
                    kv: str = "f16", max_m: int = PREFILL_CHUNK, default_ctx: int = DEFAULT_CTX) -> list[tuple]:
    """The builds a ``Model.load`` of ``source`` makes, and its prefills of up to ``max_m`` tokens, as
    ``Device.build_many`` takes them (``perfx.plan.build_requests``), found without building any: what
    `perfx warm` builds at once."""
    c = source.config
    limit = c.max_positions or default_ctx
    ctx = min(limit, default_ctx) if ctx is None else int(ctx)
    group, form = _int4_plan(source, source.layer(0))
    return build_requests(c, device, ctx, database if database is not None else default_database(), group,
                          source.weight_forms(), kv, form, load_buckets(min(ctx, max_m)), fuse_asked(device.caps),
                          source.int4_scales())


def host_peak_bytes() -> int:
    """Peak resident memory of this process: VmHWM where the system tells (``resident_peak_bytes``), else
    ru_maxrss (KiB on Linux, bytes on macOS)."""
    peak = resident_peak_bytes()
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def load_model(name: str | None = None, device: Device | str | None = None, ctx: int | None = None,
               quantize: str | None = None, progress: bool | None = None, log=None,
               default_ctx: int = DEFAULT_CTX, tuning: bool = True, lm_head: str = "q8", kv: str = "f16",
               embedding: str = "head", fuse: bool | None = None):
    """Resolve ``name`` ("default", a path, "synthetic:<name>"), open it and load it on the device.

    Returns (model, source). ``log`` receives one-line progress notes (the CLI passes stderr's print).
    ``tuning`` False ignores every tuning database: the kernels run their built-in defaults. ``lm_head``
    ("q8", the default, or "fp16") is the form of the output projection and a tied embedding
    (``perfx.sources.open_model``). ``kv`` ("f16", the default, or "q8") is the KV cache's form (``Model.load``).
    ``embedding`` ("head", the default, or "q4") is the untied token embedding's form (``open_model``).
    ``fuse``: the decode step's norms as GEMV tails (True), each its own launch (False), or as ``PERFX_FUSE`` asks,
    else as the device allows (None; ``Model.load``).
    """
    log = log or (lambda text: None)
    device = device if isinstance(device, Device) else Device(device)
    source = open_named(name, quantize=quantize, lm_head=lm_head, embedding=embedding)
    c = source.config
    log(f"perfx: model {source.describe().get('path', name)} on {device.caps.name} ({device.caps.platform}, "
        f"limits: {device.caps.limits}); {c.architecture}: {c.describe_recipe()}")
    model = Model.load(source, device, ctx=ctx, progress=progress, default_ctx=default_ctx,
                       database=default_database(tuning), log=log, kv=kv, fuse=fuse)
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
