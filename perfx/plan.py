"""Which kernel and parameters run each part of a model on a device: chosen once, from the tuning database.

``KernelPlan`` builds the decode kernels when a model is loaded, the prefill kernels per M bucket on first use
and the int8 kernels per matrix form on first use. Every shape it looks a kernel up by is one that `perfx tune`
measures for this model (``perfx.tuning.problems``), so a tuned entry is found whenever one exists; a choice
this driver refuses (a build failure, a kernel limit) is skipped with one line and remembered, and the next
one runs. The forward (``perfx.model``) only calls what the plan holds.
"""

from __future__ import annotations

import dataclasses

from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.formats import Q4_PAIRS
from perfx.ops.attention_decode import AttentionDecode
from perfx.ops.attention_prefill import AttentionPrefill
from perfx.ops.embedding_q8 import EmbeddingQ8
from perfx.ops.epilogue import gate_up_epilogue
from perfx.ops.gemm_q4 import FAMILIES as GEMM_FAMILIES, GemmQ4
from perfx.ops.gemm_q8 import GemmQ8
from perfx.ops.gemv_f16 import GemvF16
from perfx.ops.gemv_q4 import GemvQ4
from perfx.ops.gated_delta_net import GatedDeltaNetChunked, GatedDeltaNetRecurrent
from perfx.ops.gemv_q8 import GemvQ8
from perfx.ops.kv_cache import kv_shape
from perfx.ops.params import READ_NAMES
from perfx.ops.q4_weight import available_paths
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.ops.rmsnorm import RMSNorm
from perfx.ops.short_conv import ShortConv
from perfx.ops.small_ops import Argmax, Embedding, GeGLU, SigmoidMul, Softcap, SwiGLU
from perfx.runtime import BuildError, Device, KernelLimitError
from perfx.sources.base import Form
from perfx.tuning import SPECS
from perfx.tuning.database import Choice, Database, bucket_representative, m_bucket
from perfx.tuning.problems import (conv_shape, delta_shape, embedding_shape, gemm_shapes, gemv_shape, matrix_roles,
                                   model_problems, qk_norm, softcap_shape)


def one_run_times(choices: dict[str, Choice], anchor: str) -> dict[str, float]:
    """kind -> tuned time of the choices measured at the very shape looked up and in the anchor's results file
    (one device's run): times of two machines, or of two runs of one, differ by a third, so comparing kernels
    across files would choose by the machine rather than the kernel. Empty where the anchor has no such time."""
    first = choices[anchor]
    if not (first.exact and first.time_s):
        return {}
    return {kind: choice.time_s for kind, choice in choices.items()
            if choice.exact and choice.time_s and choice.file == first.file}


class KernelPlan:
    """The kernel wrappers a model runs, with their parameters: ``gemv`` (per matrix role), ``gemv_f16``,
    ``rmsnorm``, ``embed``, ``argmax_op``, ``gate`` (the unfused activation·up), ``softcap``, ``attn_decode``;
    ``prefill(m)`` and ``q8(...)`` on first use. ``tuned`` says where each choice came from."""

    def __init__(self, config: ModelConfig, device: Device, max_positions: int, database: Database, log,
                 group: int | None, forms: dict | None = None, kv: str = "f16", q4_form: int = Q4_PAIRS):
        self.config, self.device, self.max_positions = config, device, max_positions
        self.kv = kv   # the KV cache's form: part of the attention kernels' shapes
        self.q4_form = q4_form   # the int4 layers' scales form (kernels/q4.h Q4_SCALES): the kernels built first
        self.database, self.log = database, log
        self._choose_decode(group, forms)

    def _choose_decode(self, group: int | None, forms: dict | None):
        """Kernel objects with the tuned parameters for this model's shapes (database, else defaults).

        The shapes are exactly those `perfx tune` measures for this model (``tuning/problems.py``), so a
        tuned entry is found whenever one exists; prefill kernels are chosen per M bucket on first use,
        int8 ones per matrix form on first use (``_q8_op``).
        """
        c, d = self.config, self.device
        self.gate_epilogue = gate_up_epilogue(c.ffn_activation)
        self.tuned: dict[str, object] = {}
        self.tuned_shapes: dict[str, dict] = {}   # the shape each entry of `tuned` was looked up by
        self._q8_ops: dict[tuple, object] = {}
        problems, _ = model_problems(c, SPECS, group, forms, self.kv)
        self._problems = problems
        decode = {(p.family, label): p.shape for p in problems for label in p.label.split("+")
                  if p.family not in (*GEMM_FAMILIES, "attention_prefill")}

        def shape_of(family, label, **fallback):
            return decode.get((family, label), fallback)

        self.gemv = {}
        self.roles = matrix_roles(c)
        for name in self.roles + ("lm_head",):
            shape = shape_of("gemv_q4", name, n=c.vocab_size if name == "lm_head" else 1, k=c.hidden_size,
                             group=group or 32, epilogue="none", bias=False)

            def gemv(params, shape=shape):
                op = GemvQ4(d, params, shape)
                # built now: a driver that refuses it is seen here
                op.kernel(shape["group"], shape["epilogue"], form=self.q4_form)
                return op
            where = None
            if name == "lm_head" and c.tie_embeddings:
                # A tied int4 embedding is one weight: the gather reads its codes buffer, so the lm_head GEMV
                # reads that buffer or a view of it, never a second copy (image2d where it cannot be a view).
                def where(p):
                    return READ_NAMES[p["READ"]] in available_paths(d.caps, c.vocab_size, c.hidden_size, p["LAYOUT"])
            self.gemv[name] = self.choose("gemv_q4", shape, name, gemv, where)
        self.gemv_f16 = self.choose("gemv_f16", shape_of("gemv_f16", "lm_head", n=c.vocab_size, k=c.hidden_size),
                                     "lm_head", lambda p: GemvF16(d, p))
        self.rmsnorm = self.choose("rmsnorm", {"m": 1, "k": c.hidden_size, "residual": True}, "norm",
                                    lambda p: RMSNorm(d, p))
        self.embed = self.choose("embedding_f16", {"n": c.vocab_size, "k": c.hidden_size, "m": 1}, "embedding",
                                  lambda p: Embedding(d, p))
        self.argmax_op = self.choose("argmax", {"n": c.vocab_size}, "greedy sampling", lambda p: Argmax(d, p))
        # the gate's activation for fp16 (unquantized) matrices, where no GEMV epilogue fuses it
        if c.ffn_activation == "gelu_tanh":
            self.gate = self.choose("geglu", {"count": c.intermediate_size}, "geglu", lambda p: GeGLU(d, p))
        else:
            self.gate = self.choose("swiglu", {"count": c.intermediate_size}, "swiglu", lambda p: SwiGLU(d, p))
        self.softcap = (self.choose("softcap", softcap_shape(c), "final soft-cap", lambda p: Softcap(d, p))
                        if c.final_softcap else None)
        attention = {"n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, **qk_norm(c),
                     **kv_shape(self.kv)}
        self.attn_decode = self.choose(
            "attention_decode", {**attention, "positions": self.max_positions}, "decode",
            lambda p: AttentionDecode(d, p, {**attention, "positions": self.max_positions}))
        self.short_conv = None
        if c.layers_of("conv") or c.layers_of("delta"):
            conv = conv_shape(c, 1)
            self.short_conv = self.choose("short_conv", shape_of("short_conv", "conv", **conv), "conv",
                                          lambda p: ShortConv(d, p, conv))
        # Qwen3.5: σ(gate)·attention output; the DeltaNet recurrence (decode) and its norm's SiLU(z) gate
        self.attn_gate = (self.choose("sigmoid_mul", {"count": c.q_dim}, "attention gate", lambda p: SigmoidMul(d, p))
                          if c.attention_gate else None)
        self.delta_decode = self.delta_gate = None
        self._delta_prefill: dict[int, GatedDeltaNetChunked] = {}
        if c.layers_of("delta"):
            one = delta_shape(c, 1)
            self.delta_decode = self.choose("gated_delta_net_recurrent", shape_of("gated_delta_net_recurrent",
                                                                                  "delta", **one),
                                            "delta", lambda p: GatedDeltaNetRecurrent(d, p, one))
            self.delta_gate = self.choose("swiglu", {"count": c.delta_value_dim}, "delta norm gate",
                                          lambda p: SwiGLU(d, p))
        self._prefill_ops: dict[int, tuple] = {}
        # Each int4 weight is uploaded once, in the layout and for the read path its decode GEMV reads (the
        # GEMMs and the gather read whatever layout and path the weight has).
        self.read_paths = tuple(sorted({READ_NAMES[op.read] for op in self.gemv.values()}))

    def choose(self, family: str, shape: dict, label: str, make, where=None):
        """``make(params)`` (a wrapper, its kernels built) with the first parameters of the database's choices
        (device → architecture → vendor → defaults) that this driver builds and runs within the kernel's own
        limits. A choice it refuses is skipped with one line, and remembered so that later loads skip it.
        ``where`` narrows the choices to the sets it accepts (then the first accepted candidate closes the list)."""
        spec = SPECS[family]
        refused = []
        choices = self.database.choices(self.device, spec, shape)
        if where is not None:
            fallback = next((p for p in spec.params.candidates(shape, self.device.caps) if where(p)), None)
            choices = [c for c in choices if where(c.params)] + (
                [Choice(fallback, "default", "the first set that reads the weight as stored")] if fallback else [])
        for choice in choices:
            try:
                op = make(choice.params)
            except (BuildError, KernelLimitError) as error:
                if isinstance(error, BuildError) and error.compiler_lacks_cpu:
                    # no parameter set of any kernel builds here: say so once, and record no refusal
                    raise PerfxError(f"{family} ({label}): {error}") from error
                reason = (f"failed to build: {error.summary}" if isinstance(error, BuildError)
                          else str(error).splitlines()[0])[:200]
                self.log(f"perfx: {family} ({label}): the {choice.source} parameters {choice.params} were refused "
                         f"by this driver ({reason}); trying the next choice")
                self.database.refuse(self.device, spec, choice.params, reason)
                refused.append(f"{choice.source} {choice.params}: {reason}")
                continue
            if refused:
                choice = dataclasses.replace(choice, skipped=choice.skipped + tuple(f"refused by this driver: {r}"
                                                                                    for r in refused))
            self.tuned[f"{family} ({label})"] = choice
            self.tuned_shapes[f"{family} ({label})"] = shape
            return op
        raise PerfxError(f"{family} ({label}): no parameter set builds on {self.device.caps.name}: "
                         + "; ".join(refused) + ". Run `perfx selftest` and report the log")

    def prefill(self, m: int) -> tuple[dict, AttentionPrefill]:
        """The GEMM per matrix and the prefill attention tuned for m's bucket (built once per bucket)."""
        bucket = m_bucket(m)
        if bucket not in self._prefill_ops:
            rep = bucket_representative(bucket)
            shapes = {(p.family, label): p.shape for p in self._problems for label in p.label.split("+")
                      if p.shape.get("m") == rep}
            gemms = {}
            for name in self.roles:
                skinny = shapes.get(("gemm_q4_skinny", name))
                tiled = shapes.get(("gemm_q4_tiled", name))
                if skinny is None or tiled is None:   # an fp16 matrix: no GEMM
                    continue
                epilogue = skinny["epilogue"]
                label = f"{name}, M≈{rep}"

                def gemm(kind, shape):
                    def make(params):
                        op = GemmQ4(self.device, **{f"{kind}_params": params}, shape=shape, kind=kind)
                        for read in {params["READ"]} & {0, 1}:
                            op.kernel(kind, epilogue, read, form=self.q4_form)
                        return op
                    return make
                kinds = {"skinny": skinny, "tiled": tiled}
                if ("gemm_q4_lanes", name) in shapes:
                    kinds["lanes"] = shapes[("gemm_q4_lanes", name)]
                if self.device.caps.fp16:
                    kinds["f16"] = shapes.get(("gemm_q4_f16", name), skinny)
                choices = {}
                for kind, shape in kinds.items():
                    self.choose(f"gemm_q4_{kind}", shape, label, gemm(kind, shape))
                    choices[kind] = self.tuned[f"gemm_q4_{kind} ({label})"]
                # The fastest kernel measured on this device for this bucket (the fp16 and lanes ones only where
                # they were measured too). Only times measured at this very shape, in the skinny entry's file, are
                # compared (one_run_times): a record of another M (the nearest one a look-up falls back to) times
                # another problem, and another file another machine or run. Where skinny and
                # tiled were not both measured: on a CPU the fastest measured of the others (both CPU
                # implementations' tuned entries choose skinny or lanes at every bucket up to M = 256, and their
                # tiled kernel is several times slower at M = 64), else the tall-skinny kernel; elsewhere the default
                # crossover.
                timed = one_run_times(choices, "skinny")
                cpu = self.device.caps.device_type == "CPU"
                kind = (min(timed, key=timed.get) if "skinny" in timed and ("tiled" in timed or cpu)
                        else None)
                if kind is None and cpu:
                    kind = "skinny"
                gemms[name] = GemmQ4(self.device, choices["skinny"].params, choices["tiled"].params, None,
                                     shape=skinny, f16_params=choices["f16"].params if "f16" in choices else None,
                                     kind=kind, lanes_params=choices["lanes"].params if "lanes" in choices else None)
            c = self.config
            shape = shapes.get(("attention_prefill", "attention"),
                               {"n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "m": rep,
                                "p0": 0, **qk_norm(c), **kv_shape(self.kv)})
            attention = self.choose("attention_prefill", shape, f"prefill, M≈{rep}",
                                     lambda p: AttentionPrefill(self.device, p, shape))
            self._prefill_ops[bucket] = (gemms, attention)
        return self._prefill_ops[bucket]

    def delta_prefill(self, m: int) -> GatedDeltaNetChunked:
        """The chunked Gated DeltaNet kernel tuned for m's bucket (built once per bucket)."""
        bucket = m_bucket(m)
        if bucket not in self._delta_prefill:
            shape = delta_shape(self.config, bucket_representative(bucket))
            self._delta_prefill[bucket] = self.choose(
                "gated_delta_net_chunked", shape, f"delta, M≈{shape['tokens']}",
                lambda p: GatedDeltaNetChunked(self.device, p, shape))
        return self._delta_prefill[bucket]

    def _faster_q8_gemm(self, shapes: dict) -> str:
        """The int8 GEMM family to run at a bucket's shape (``shapes``: family -> shape): gemm_q8_lanes where its
        first choice and gemm_q8's were timed in one run (``one_run_times``) and lanes was the faster, else
        gemm_q8 (the register-tiled kernel written for a GPU's wave)."""
        first = {family: self.database.choices(self.device, SPECS[family], shape)[0]
                 for family, shape in shapes.items()}
        timed = one_run_times(first, "gemm_q8")
        return "gemm_q8_lanes" if timed.get("gemm_q8_lanes", float("inf")) < timed.get("gemm_q8", 0.0) else "gemm_q8"

    def q8(self, kind: str, name: str, weight: Q8DeviceWeight, m: int = 1):
        """The int8 kernel wrapper ("gemv", "gemm" or "embedding") for a matrix of this form, with the
        parameters tuned for its shape (``tuning/problems.py`` builds the same shapes), made once."""
        c = self.config
        form = Form("q8", weight.group, weight.f32, weight.symmetric)
        rep = bucket_representative(m_bucket(m)) if kind == "gemm" else 1
        key = (kind, name, form, rep)
        op = self._q8_ops.get(key)
        if op is None:
            epilogue = (self.gate_epilogue if name == "gate_up"
                        else ("bias" if weight.has_bias and kind == "gemm" else "none"))
            if kind == "gemv":
                family, shape = gemv_shape(c, name, form, weight.n, weight.k, epilogue, weight.has_bias)

                def make(params):
                    made = GemvQ8(self.device, params, shape)
                    made.kernel(weight.group, weight.f32, weight.symmetric, epilogue)   # built now: a refusal is seen here
                    return made
                op = self.choose(family, shape, name, make)
            elif kind == "gemm":
                shapes = dict(gemm_shapes(form, rep, weight.n, weight.k, epilogue))
                family = self._faster_q8_gemm(shapes)
                shape = shapes[family]

                def make(params):
                    made = GemmQ8(self.device, params, shape, "lanes" if family == "gemm_q8_lanes" else "skinny")
                    made.kernel(weight.group, weight.f32, weight.symmetric, epilogue)
                    return made
                op = self.choose(family, shape, f"{name}, M≈{rep}", make)
            else:
                family, shape = embedding_shape(form, weight.n, weight.k, rep)
                op = self.choose(family, shape, "embedding", lambda params: EmbeddingQ8(self.device, params))
            self._q8_ops[key] = op
        return op


def build_requests(config: ModelConfig, device: Device, max_positions: int, database: Database, group: int | None,
                   forms: dict | None = None, kv: str = "f16", q4_form: int = Q4_PAIRS, buckets=()) -> list[tuple]:
    """The builds a ``KernelPlan`` of these arguments makes (``(file, defines, newest_c)``, for
    ``Device.build_many``): its decode kernels and the prefill kernels of the M ``buckets``
    (``perfx.tuning.database.M_BUCKETS`` indices), collected without building anything (``Device.collecting``),
    each choice's first parameters. The decode step's int8 kernels, chosen per weight form, are not among them.
    The database is only read: a choice refused here is not recorded (the load that builds it records it)."""
    with device.collecting() as requests:
        plan = KernelPlan(config, device, max_positions, _ReadOnly(database), lambda text: None, group, forms, kv,
                          q4_form)
        for bucket in buckets:
            plan.prefill(bucket_representative(bucket))
            if config.layers_of("delta"):
                plan.delta_prefill(bucket_representative(bucket))
    return requests


def load_buckets(m: int) -> tuple[int, ...]:
    """The prefill M buckets (``M_BUCKETS`` indices) of prompts of 2 to ``m`` tokens (one token decodes)."""
    return tuple(range(1, m_bucket(max(2, m)) + 1))


class _ReadOnly:
    """A database whose refusals are not recorded: for a plan made only to collect its builds."""

    def __init__(self, database: Database):
        self._database = database

    def __getattr__(self, name):
        return getattr(self._database, name)

    def refuse(self, *args, **kwargs):
        pass
