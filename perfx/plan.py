"""Which kernel and parameters run each part of a model on a device: chosen once, from the tuning database.

``KernelPlan`` builds the decode kernels when a model is loaded, the prefill kernels per M bucket on first use
and the int8 kernels per matrix form on first use, each for an op of the model's built step (``perfx.step``:
the decode step, and the prefill step per M bucket), whose shapes are exactly those `perfx tune` measures for
this model (``perfx.tuning.problems``), so a tuned entry is found whenever one exists; no shape is built here. A
weight the file's header did not announce gets the op the step would build for it. A choice
this driver refuses (a build failure, a kernel limit) is skipped with one line and remembered, and the next
one runs. The forward (``perfx.model``) only calls what the plan holds.
"""

from __future__ import annotations

import dataclasses

from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.formats import Q4_PAIRS, Form, q4_form_defines
from perfx.ops import Q8_NATURAL, Q8_TEXEL
from perfx.ops.altup import AltUp
from perfx.ops.attention_decode import AttentionDecode
from perfx.ops.attention_prefill import AttentionPrefill
from perfx.ops.decode_loop import NextStep
from perfx.ops.embedding_q8 import EmbeddingQ8
from perfx.ops.epilogue import gate_up_epilogue
from perfx.ops.gemm_q4 import FAMILIES as GEMM_FAMILIES, GemmQ4
from perfx.ops.gemm_q8 import KINDS as Q8_KINDS, GemmQ8
from perfx.ops.gemv_f16 import GemvF16
from perfx.ops.gemv_q4 import GemvQ4
from perfx.ops.gemv_q4_split import GemvQ4Split
from perfx.ops.gemv_q4_tail import TAILS, GemvQ4Tail, tail_params
from perfx.ops.gated_delta_net import GatedDeltaNetChunked, GatedDeltaNetRecurrent
from perfx.ops.gemm_moe import GemmMoE
from perfx.ops.gemv_moe import GemvMoE
from perfx.ops.gemv_q8 import GemvQ8
from perfx.ops.logit_mask import LogitMask
from perfx.ops.moe_router import MoeRouter
from perfx.ops.moe_shared_gate import MoeSharedGate
from perfx.ops.params import READ_NAMES
from perfx.ops.per_layer import LayerScale, PerLayerGate
from perfx.ops.q4_weight import LAYOUT_ROWS, available_paths, held_paths
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.ops.rmsnorm import RMSNorm
from perfx.ops.sample import Sample
from perfx.ops.short_conv import ShortConv
from perfx.ops.small_ops import Argmax, Embedding, GeGLU, SigmoidMul, Softcap, SwiGLU
from perfx.runtime import BuildError, Device, KernelLimitError
from perfx.tuning import SPECS
from perfx.tuning.database import M_BUCKETS, Choice, Database, bucket_representative, m_bucket
from perfx import moe
from perfx.mixers.attention import AttentionMixer
from perfx.op import Op, StepOptions, matrix_epilogue, role_forms
from perfx.step import bucket_steps, decode_step, embedding_ops, matrix_dims, matrix_roles, role_ops


Q8_GEMM_KINDS = {space.family: kind for kind, space in Q8_KINDS.items()}   # gemm_q8_lanes -> "lanes"


def one_run_costs(choices: dict[str, Choice], anchor: str) -> dict[str, float]:
    """kind -> how much slower than the fastest its first choice is, at the M where that is worst: compared by the
    times measured at the very shape looked up and in the anchor's results file (one device's run; times of two
    machines, or of two runs of one, differ by a third, so comparing kernels across files would choose by the
    machine rather than the kernel), at each M of the bucket they all have times for (``served_ms``: a record
    without them has its bucket representative's). The kind of least cost runs: in a bucket of a batched decode
    step, each N is a rate the server holds for many steps, and a kind faster at N = 3 than another does not make
    up there for being slower at N = 2 (a short prompt runs once: any kind within that worst ratio of the fastest
    serves it). Empty where the anchor has no such time."""
    first = choices[anchor]
    if not (first.exact and first.time_s):
        return {}
    timed = {kind: choice.served or {None: choice.time_s} for kind, choice in choices.items()
             if choice.exact and choice.time_s and choice.file == first.file}
    ms = set.intersection(*(set(times) for times in timed.values()))
    if not ms:   # one record without times at the bucket's Ms: each compared at its representative
        timed, ms = {kind: {None: choices[kind].time_s} for kind in timed}, {None}
    fastest = {m: min(times[m] for times in timed.values()) for m in ms}
    return {kind: max(times[m] / fastest[m] for m in ms) for kind, times in timed.items()}


class _ByRole(dict):
    """Matrix role -> its int4 GEMV wrapper: chosen from the decode step's ops at load; a role the step has no
    int4 op for (a weight the file's header did not say is int4) is chosen on first use, by ``make(role)``."""

    def __init__(self, make, roles: tuple[str, ...]):
        super().__init__()
        self._make, self._roles = make, roles

    def __missing__(self, role: str):
        if role not in self._roles:
            raise KeyError(role)
        self[role] = wrapper = self._make(role)
        return wrapper

    def get(self, role, default=None):
        return self[role] if role in self or role in self._roles else default


class KernelPlan:
    """The kernel wrappers a model runs, with their parameters: ``gemv`` (per matrix role), ``gemv_f16``,
    ``rmsnorm``, ``embed``, ``argmax_op``, ``gate`` (the unfused activation·up), ``softcap``, ``attn_decode``;
    ``prefill(m)`` and ``q8(...)`` on first use. Each is chosen for an op of the built step (``step``: the
    decode step, ``buckets``: the prefill step per M bucket, ``perfx.step``), the ops `perfx tune` measures;
    ``wrapper(op)`` gives the one an op runs with. ``tuned`` says where each choice came from."""

    def __init__(self, config: ModelConfig, device: Device, max_positions: int, database: Database, log,
                 group: int | None, forms: dict | None = None, kv: str = "f16", q4_form: int = Q4_PAIRS,
                 fuse: bool = False, q4_scales: dict | None = None):
        self.config, self.device, self.max_positions = config, device, max_positions
        self.kv = kv   # the KV cache's form: part of the attention kernels' shapes
        self.q4_form = q4_form   # the int4 layers' scales form (kernels/q4.h Q4_SCALES): the kernels built first
        # matrix role -> the scales' forms of its int4 weights, where the file's header tells (``q4_forms``)
        self.q4_scales = q4_scales or {}
        self._head_rows = None
        self.database, self.log = database, log
        self.group = group
        self.options = StepOptions(group, forms, kv, max_positions, fuse)
        self.step = decode_step(config, self.options)
        self.buckets = bucket_steps(config, self.options)
        self._choose_decode()

    def _choose_decode(self):
        """Kernel objects with the tuned parameters for the decode step's ops (database, else defaults).

        The ops' shapes are exactly those `perfx tune` measures for this model (``perfx.step``), so a tuned
        entry is found whenever one exists; prefill kernels are chosen per M bucket on first use, int8 ones
        per matrix form on first use (``q8``).
        """
        c = self.config
        self.gate_epilogue = gate_up_epilogue(c.ffn_activation)
        self.tuned: dict[str, object] = {}
        self.tuned_shapes: dict[str, dict] = {}   # the shape each entry of `tuned` was looked up by
        self._q8_ops: dict[tuple, object] = {}
        self._wrappers: dict[Op, object] = {}   # op -> the wrapper chosen for it
        self._prefill_ops: dict[int, tuple] = {}
        self._delta_prefill: dict[int, GatedDeltaNetChunked] = {}
        self.roles = matrix_roles(c)
        self.gemv = _ByRole(self._gemv_fallback, self.roles + ("lm_head",))
        self.gemv_tail: dict[str, GemvQ4Tail] = {}   # matrix role -> its GEMV with a tail (a fused decode step)
        self._gemv_f16 = self._embed = self._attn_decode = None
        self.softcap = self.short_conv = self.attn_gate = self.delta_decode = self.delta_gate = None
        self.rmsnorm = self.argmax_op = self.gate = self.sample = None
        self.moe_router = self.moe_shared_gate = None
        self._moe_gemvs: dict[tuple, GemvMoE] = {}
        self._moe_gemms: dict[tuple, GemmMoE] = {}
        self.per_layer_gate = self.layer_scale = self.altup = None
        self._next_step = self._logit_mask = None
        for op in self.step:
            if op.shares is None:
                self._choose_op(op)
        for op in self.step:   # an int4 table's gather, for the layout and scales' forms the table is held in
            if op.family == "embedding_q4":
                role = "ple_table" if op.weight == "ple_table" else "embedding"
                for form in self.q4_forms(role):
                    self.embed.q4_kernel_for(self.q4_upload(role)[0], q4_form_defines(form))

    @property
    def read_paths(self) -> tuple[str, ...]:
        """The read paths of the int4 GEMVs chosen. Each int4 weight is uploaded once, in the layout and for the
        read path its decode GEMV reads (the GEMMs and the gather read whatever layout and path the weight has)."""
        return tuple(sorted({READ_NAMES[op.read] for op in self.gemv.values()}))

    def _choose_op(self, op: Op):
        """The wrapper of one op of the decode step (the int8 ones are chosen on first use, per weight)."""
        d, family, shape = self.device, op.family, op.shape
        if family == "gemv_q4":
            self.gemv[op.weight] = wrapper = self._gemv_q4(op)
        elif family == "gemv_q4_tail":
            self.gemv_tail[op.weight] = wrapper = self._gemv_q4_tail(op)
        elif family == "gemv_f16":
            # one fp16 GEMV serves every fp16 matrix (row by row): chosen for the lm_head's op where the step
            # has one, else for the first fp16 matrix's
            if self._gemv_f16 is None:
                chosen = next((o for o in self.step if o.family == family and o.weight == "lm_head"), op)
                self._gemv_f16 = self.choose(family, chosen.shape, chosen.weight, lambda p: GemvF16(d, p))
            wrapper = self._gemv_f16
        elif family == "rmsnorm":
            if self.rmsnorm is None:
                self.rmsnorm = self.choose(family, shape, op.role, lambda p: RMSNorm(d, p))
            wrapper = self.rmsnorm
        elif family == "embedding_f16":
            self._embed = wrapper = self.choose(family, shape, "embedding", lambda p: Embedding(d, p))
        elif family == "embedding_q4":   # the gather's wrapper holds the int4 kernel too
            wrapper = self.embed
        elif family == "argmax":
            self.argmax_op = wrapper = self.choose(family, shape, op.role, lambda p: Argmax(d, p))
        elif family == "sample":
            self.sample = wrapper = self.choose(family, shape, op.role, lambda p: Sample(d, p, shape))
        elif op.role in ("swiglu (unfused)", "geglu (unfused)"):
            # the gate's activation for fp16 (unquantized) matrices, where no GEMV epilogue fuses it
            wrapper = GeGLU if family == "geglu" else SwiGLU
            self.gate = wrapper = self.choose(family, shape, family, lambda p, w=wrapper: w(d, p))
        elif family == "softcap":
            self.softcap = wrapper = self.choose(family, shape, op.role, lambda p: Softcap(d, p))
        elif family == "attention_decode":   # one a shape of layer (Gemma 4's); attn_decode the first
            wrapper = self.choose(family, shape, f"decode {shape['head_dim']}" if self._attn_decode else "decode",
                                  lambda p: AttentionDecode(d, p, shape))
            self._attn_decode = self._attn_decode or wrapper
        elif family == "per_layer_gate":
            self.per_layer_gate = wrapper = self.choose(family, shape, op.role, lambda p: PerLayerGate(d, p))
        elif family == "layer_scale":
            self.layer_scale = wrapper = self.choose(family, shape, op.role, lambda p: LayerScale(d, p))
        elif family == "altup":   # Gemma 3n's AltUp, LAuReL and sparse-gate kernels
            self.altup = wrapper = self.choose(family, shape, op.role, lambda p: AltUp(d, p))
        elif family == "short_conv":
            if self.short_conv is None:
                self.short_conv = self.choose(family, shape, op.role, lambda p: ShortConv(d, p, shape))
            wrapper = self.short_conv
        elif family == "sigmoid_mul":   # Qwen3.5: σ(gate)·attention output
            self.attn_gate = wrapper = self.choose(family, shape, op.role, lambda p: SigmoidMul(d, p))
        elif family == "gated_delta_net_recurrent":
            self.delta_decode = wrapper = self.choose(family, shape, op.role,
                                                      lambda p: GatedDeltaNetRecurrent(d, p, shape))
        elif op.role == "delta norm gate":   # the DeltaNet norm's SiLU(z)·
            self.delta_gate = wrapper = self.choose(family, shape, op.role, lambda p: SwiGLU(d, p))
        elif family == "moe_router":
            self.moe_router = wrapper = self.choose(family, shape, op.role, lambda p: MoeRouter(d, p, shape))
        elif family == "moe_shared_gate":   # a shared expert's σ gate
            self.moe_shared_gate = wrapper = self.choose(family, shape, op.role, lambda p: MoeSharedGate(d, p))
        elif family == "gemv_moe":   # a routed expert GEMV, per expert role and held form
            wrapper = self._moe_gemvs[(op.weight, op.form)] = self.choose(family, shape, op.role,
                                                                          lambda p: GemvMoE(d, p, shape))
        else:
            return   # gemv_q8, embedding_q8: per weight, on first use (``q8``)
        self._wrappers[op] = wrapper

    def _gemv_q4(self, op: Op):
        """The int4 GEMV of a matrix op; the lm_head's of a tied int4 embedding reads the gather's buffer."""
        d, c, shape, name = self.device, self.config, op.shape, op.weight
        forms = self.q4_forms("embedding" if name == "lm_head" and c.tie_embeddings else name)

        def gemv(params):
            made = GemvQ4(d, params, shape)
            # built now: a driver that refuses it is seen here (with the quantizing of x the product launches first)
            for form in forms:
                made.kernel(shape["group"], shape["epilogue"], form=form)
            if made.reads_quantized:
                made.quantize_kernel()
            return made
        if name == "lm_head" and c.tie_embeddings:
            # A tied int4 embedding is one weight: the gather reads its codes buffer, so the lm_head GEMV
            # reads that buffer or a view of it, never a second copy (image2d where it cannot be a view).
            def where(p):
                return READ_NAMES[p["READ"]] in available_paths(d.caps, c.vocab_size, c.hidden_size, p["LAYOUT"])
            return self.choose("gemv_q4", shape, name, gemv, where)
        if "gemv_q4_split" in op.alternatives and self._faster_alternative(
                {"gemv_q4": shape, "gemv_q4_split": shape}, "gemv_q4", "gemv_q4_split"):
            def split(params):
                made = GemvQ4Split(d, params, shape)
                for form in forms:
                    made.kernels(shape["group"], shape["epilogue"], shape["k"], form, shape["bias"])
                return made
            return self.choose("gemv_q4_split", shape, name, split)
        return self.choose("gemv_q4", shape, name, gemv)

    def _gemv_q4_tail(self, op: Op) -> GemvQ4Tail:
        """The GEMV with a tail of a matrix op of a fused step, and (``gemv``) its role's plain GEMV, which the
        unfused paths of one row run (a batched step of one sequence): both on the rows layout with a buffer or
        image1d read, so one upload of the weight serves both. The tail's parameters are its own tuned entry's
        where the database has one, else those of the plain GEMV chosen at the same matrix (the same product)."""
        d, shape, name = self.device, op.shape, op.weight
        base = {k: v for k, v in shape.items() if k not in ("tail", "post")}
        forms = self.q4_forms(name)

        def plain(params):
            made = GemvQ4(d, params, base)
            for form in forms:
                made.kernel(base["group"], base["epilogue"], form=form)
            return made
        self.gemv[name] = chosen = self.choose("gemv_q4", base, name, plain, lambda p: tail_params(p) is not None)
        order = 1 if shape["tail"] == "q8" or self.config.hidden_size % 32 == 0 else 0
        defines = (("TAIL", TAILS[shape["tail"]]), ("POST", int(bool(shape.get("post")))), ("Q8X", order))
        # a norm's tail writes int8 blocks in the order the matrices after it read them, none where none does
        # (``Model._xb_order``): each built
        variants = ([defines[:2] + (("Q8X", q8x),) for q8x in (0, Q8_TEXEL, Q8_NATURAL)]
                    if shape["tail"] == "norm" and order else [defines])

        def tail(params):
            made = GemvQ4Tail(d, params, shape)
            for form in forms:
                for extra in variants:
                    made.kernel(shape["group"], shape["epilogue"], form=form, extra=extra)
            return made
        own = self.database.choices(d, SPECS["gemv_q4_tail"], shape)[0]
        same_upload = {"LAYOUT": chosen.layout, "READ": chosen.read}
        if own.source != "default" and all(own.params[k] == v for k, v in same_upload.items()):
            return self.choose("gemv_q4_tail", shape, name, tail, lambda p: all(p[k] == v for k, v in
                                                                             same_upload.items()))
        made = GemvQ4Tail(d, tail_params(chosen.params), shape)
        for form in forms:
            for extra in variants:
                made.kernel(shape["group"], shape["epilogue"], form=form, extra=extra)
        self.tuned[f"gemv_q4_tail ({name})"] = self.tuned[f"gemv_q4 ({name})"]
        self.tuned_shapes[f"gemv_q4_tail ({name})"] = shape
        return made

    def _faster_alternative(self, shapes: dict, family: str, alternative: str) -> bool:
        """Whether ``alternative``'s first choice was timed faster than ``family``'s in one run (``one_run_costs``),
        each at its shape in ``shapes`` (family -> shape): an alternative runs only where this device measured it
        faster (the GPU-shaped GEMV, the int8 GEMM a column a lane)."""
        first = {f: self.database.choices(self.device, SPECS[f], shapes[f])[0] for f in (family, alternative)}
        costs = one_run_costs(first, family)
        return costs.get(alternative, float("inf")) < costs.get(family, 0.0)

    def _gemv_fallback(self, role: str):
        """The int4 GEMV of a role the step has no int4 op for, as its op would be at the loader's group."""
        form = Form("q4", self.group or 32)
        return self._gemv_q4(role_ops(self.config, role, 1, self.options, forms=[form])[0])

    def moe_gemv(self, role: str, form: Form) -> GemvMoE:
        """The routed-expert GEMV of an expert role ("experts_gate_up", "experts_down") in a held form: the step's,
        else (experts the header did not announce in this form) as the step would build it."""
        if (role, form) not in self._moe_gemvs:
            op = next(op for op in moe.ops(self.config, 1, StepOptions(forms={role: {form}})) if op.weight == role)
            self._choose_op(op)
        return self._moe_gemvs[(role, form)]

    @property
    def gemv_f16(self):
        """The fp16 GEMV (every fp16 matrix, row by row): the lm_head's op's, else the first fp16 matrix's,
        else (fp16 weights the header did not announce) as the lm_head's would be."""
        if self._gemv_f16 is None:
            self._choose_op(role_ops(self.config, "lm_head", 1, self.options, forms=[Form("f16")])[0])
        return self._gemv_f16

    @property
    def embed(self):
        """The fp16 (and int4) gather: the fp16 table's op's, else as an fp16 table's would be."""
        if self._embed is None:
            self._choose_op(embedding_ops(self.config, 1, StepOptions(forms={"embedding": {Form("f16")}}))[0])
        return self._embed

    @property
    def next_step(self) -> NextStep:
        """The decode loop's hand-over of the chosen token to the next step (nothing to tune), made on first use."""
        if self._next_step is None:
            self._next_step = NextStep(self.device)
        return self._next_step

    @property
    def logit_mask(self) -> LogitMask:
        """Constrained decoding's mask over the logits, chosen on first use (built ahead with the load's other
        kernels: ``build_requests``); its one launch a step over V bits is no op of the step `perfx tune`
        measures."""
        if self._logit_mask is None:
            d = self.device
            self._logit_mask = self.choose("logit_mask", {"n": self.config.vocab_size, "rows": 1, "allowed": 0.5},
                                           "constrained decoding", lambda p: LogitMask(d, p))
        return self._logit_mask

    @property
    def attn_decode(self):
        """The decode attention: the step's, else (no attention layer) as an attention layer's would be."""
        if self._attn_decode is None:
            self._choose_op(AttentionMixer.kernel_ops(self.config, 1, self.options)[0])
        return self._attn_decode

    def attention_at(self, layer: int, m: int = 1):
        """The attention wrapper of ``layer``: the decode step's op's on that layer for one row, else m's prefill
        bucket's (built on first use): each shape of layer its own (Gemma 4's)."""
        if m == 1:
            op = next((o for o in self.step if o.family == "attention_decode" and layer in o.layers), None)
            return self.attn_decode if op is None else self._wrappers[op]
        bucket = m_bucket(m)
        first = self.prefill(m)[1]
        op = next((o for o in self.buckets[bucket] if o.family == "attention_prefill" and layer in o.layers), None)
        if op is None:
            return first
        if op not in self._wrappers:
            shape = op.shape
            self._wrappers[op] = self.choose("attention_prefill", shape, f"prefill {shape['head_dim']}, M≈{op.m}",
                                             lambda p: AttentionPrefill(self.device, p, shape))
        return self._wrappers[op]

    def ops(self, m: int = 1) -> list[Op]:
        """The ops of the step a pass over m rows runs: the decode step for one, else m's prefill bucket's."""
        return self.step if m == 1 else self.buckets[m_bucket(m)]

    def wrapper(self, op: Op):
        """The wrapper chosen for ``op`` (one of ``step`` or ``buckets``), or None where none is yet: an op
        that shares another's wrapper gets that op's; the prefill and int8 ones exist once first used."""
        if op.shares is not None:
            owner = next((o for o in self.step if o.role == op.shares and o.family == op.family
                          and o.shares is None and o.key == op.key), None)
            owner = owner or next((o for o in self.step if o.role == op.shares and o.family == op.family
                                   and o.shares is None), None)
            owner = owner or next((o for o in self.step if o.family == op.family and o.shares is None), None)
            return None if owner is None else self._wrappers.get(owner)
        return self._wrappers.get(op)

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
        """The GEMM per matrix and the prefill attention tuned for m's bucket (built once per bucket), chosen
        for the ops of the bucket's step."""
        bucket = m_bucket(m)
        if bucket not in self._prefill_ops:
            rep = bucket_representative(bucket)
            ops = self.buckets[bucket]
            gemms = {}
            for name in self.roles:
                # the GEMM kinds of the role's int4 form (of its last, where the header names several)
                kinds_of: dict = {}
                for op in ops:
                    if op.weight == name and op.family in GEMM_FAMILIES:
                        kinds_of.setdefault(op.form, {})[op.family.removeprefix("gemm_q4_")] = op
                if not kinds_of:   # an fp16 or int8 matrix: no int4 GEMM
                    continue
                found = list(kinds_of.values())[-1]
                skinny = found["skinny"].shape
                epilogue = skinny["epilogue"]
                label = f"{name}, M≈{rep}"

                layout, held = self._q4_reads(name)

                def gemm(kind, shape, layout=layout, held=held):
                    def make(params):
                        op = GemmQ4(self.device, **{f"{kind}_params": params}, shape=shape, kind=kind)
                        # as the prompt runs it: on the path and layout the weight is uploaded in, each form
                        read = GemmQ4.read_of(params["READ"], held)
                        for form in self.q4_forms(name):
                            op.kernel(kind, epilogue, read, layout, form)
                        return op
                    return make
                kinds = {"skinny": found["skinny"], "tiled": found["tiled"]}
                for extra in ("lanes", "i8"):
                    if extra in found:
                        kinds[extra] = found[extra]
                if self.device.caps.fp16:
                    kinds["f16"] = found.get("f16", found["skinny"])
                # The fastest kernel measured on this device for this bucket (the fp16, lanes and int8 ones only
                # where they were measured too), over the Ms the bucket serves (one_run_costs). Only times measured
                # at this very shape, in the skinny entry's file, are compared: a record of another M (the nearest
                # one a look-up falls back to) times another problem, and another file another machine or run.
                # Where skinny and tiled were not both measured: on a CPU the fastest measured of the others (both
                # CPU implementations' tuned entries choose skinny or lanes at every bucket up to M = 256, and their
                # tiled kernel is several times slower at M = 64), else the tall-skinny kernel; elsewhere the default
                # crossover. Only the kinds that run are built (a fixed kind, or skinny and tiled either side of the
                # crossover): a kind built only to be compared would cost the load its compile (most of a cold
                # load's builds) and never run. The comparison reads each kind's first choice; where a kind that
                # runs is refused by this driver, its next choice takes its place and the comparison is made again.
                choices = {kind: self.database.choices(self.device, SPECS[f"gemm_q4_{kind}"], op.shape)[0]
                           for kind, op in kinds.items()}
                cpu = self.device.caps.device_type == "CPU"
                while True:
                    costs = one_run_costs(choices, "skinny")
                    kind = (min(costs, key=costs.get) if "skinny" in costs and ("tiled" in costs or cpu)
                            else None)
                    if kind is None and cpu:
                        kind = "skinny"
                    changed = False
                    for run in ((kind,) if kind is not None else ("skinny", "tiled")):
                        op = kinds[run]
                        self._wrappers[op] = self.choose(f"gemm_q4_{run}", op.shape, label, gemm(run, op.shape))
                        built = self.tuned[f"gemm_q4_{run} ({label})"]
                        changed = changed or built.params != choices[run].params
                        choices[run] = built
                    if not changed:
                        break
                gemms[name] = GemmQ4(self.device, choices["skinny"].params, choices["tiled"].params, None,
                                     shape=skinny, f16_params=choices["f16"].params if "f16" in choices else None,
                                     kind=kind, lanes_params=choices["lanes"].params if "lanes" in choices else None,
                                     i8_params=choices["i8"].params if "i8" in choices else None)
                if kind == "i8":   # the launch each call makes first, from the product's program (built above)
                    read = GemmQ4.read_of(gemms[name].params["i8"]["READ"], held)
                    for form in self.q4_forms(name):
                        gemms[name].kernel("i8", epilogue, read, layout, form)
                    gemms[name].quantize_kernel()
                elif kind == "f16":
                    gemms[name].convert_kernel()
            op = next((op for op in ops if op.family == "attention_prefill"), None)
            if op is None:   # no attention layer: as one would be
                op = AttentionMixer.kernel_ops(self.config, rep, self.options)[0]
            shape = op.shape
            attention = self.choose("attention_prefill", shape, f"prefill, M≈{rep}",
                                    lambda p: AttentionPrefill(self.device, p, shape))
            self._wrappers[op] = attention
            self._prefill_ops[bucket] = (gemms, attention)
            for op in ops:   # the grouped expert products of a MoE model, built with the bucket's other kernels
                if op.family == "gemm_moe":
                    self.moe_gemm(op.weight, op.form, rep)
        return self._prefill_ops[bucket]

    def q4_upload(self, role: str) -> tuple[int, set[str]]:
        """(layout, read paths) an int4 weight of ``role`` is uploaded for (``perfx.linear.upload_linear``): its
        decode GEMV's, a tied embedding's also the codes buffer the gather reads; a table only gathered from (an
        untied embedding, Gemma 4's per-layer table) as rows in a buffer."""
        if role == "ple_table" or (role == "embedding" and not self.config.tie_embeddings):
            return LAYOUT_ROWS, {"buffer"}
        gemv = self.gemv["lm_head" if role == "embedding" else role]
        return gemv.layout, {READ_NAMES[gemv.read]} | ({"buffer"} if role == "embedding" else set())

    def _q4_reads(self, role: str) -> tuple[int, set[int]]:
        """(layout, the READ codes held) of an int4 weight of ``role`` once uploaded (``q4_upload``)."""
        layout, paths = self.q4_upload(role)
        k = self.config.hidden_size if role in ("embedding", "lm_head") else matrix_dims(self.config, role)[1]
        held = held_paths(self.device.caps, k, paths)
        return layout, {code for code, name in READ_NAMES.items() if name in held}

    def q4_forms(self, role: str) -> tuple[int, ...]:
        """The scales' forms (``perfx.formats`` Q4_PAIRS ...) of the int4 weights of ``role``: the file's, where
        its header tells (``q4_scales``), else the form the int4 kernels are built for first."""
        return tuple(sorted(self.q4_scales.get(role, ()))) or (self.q4_form,)

    @property
    def head_rows(self) -> GemmQ4:
        """The int4 lm_head's GEMM over many rows (perplexity, speculation's verification, a batched decode
        step): the tall-skinny kernel at its defaults, no op of a step being tuned for it."""
        if self._head_rows is None:
            self._head_rows = GemmQ4(self.device, shape={"epilogue": "none"})
        return self._head_rows

    def build_head_rows(self, most: int) -> None:
        """The kernels ``head_rows`` runs on this model's int4 lm_head (a tied one is the embedding's weight) over up
        to ``most`` rows: the tall-skinny one, and the tiled one past its crossover."""
        forms = role_forms(self.config, "lm_head", self.options, self.config.hidden_size)
        if not any(form.kind == "q4" for form in forms):
            return
        role = "embedding" if self.config.tie_embeddings else "lm_head"
        layout, held = self._q4_reads(role)
        gemm = self.head_rows
        for kind in dict.fromkeys((gemm.choose(1), gemm.choose(most))):
            for form in self.q4_forms(role):
                gemm.kernel(kind, "none", GemmQ4.read_of(gemm.params[kind]["READ"], held), layout, form)

    def build_q8(self, ops) -> None:
        """The int8 kernels of ``ops`` (the decode step's or a bucket's), chosen as ``q8`` chooses them when a weight
        of that form first runs: built ahead (``build_requests``)."""
        for op in ops:
            if op.family in ("gemv_q8", "embedding_q8") and op.m == 1:
                weight = _Q8Shape.of(op, op.shape.get("bias", False))
                if op.family == "gemv_q8":
                    self.q8("gemv", op.weight, weight)
                else:   # every table's gather is the embedding's wrapper (``Q8Linear.gather``)
                    self.q8("embedding", "embedding", weight)
            elif op.family in Q8_GEMM_KINDS and op.weight is not None:
                self.q8("gemm", op.weight, _Q8Shape.of(op, op.epilogue == "bias"), op.m)

    def build_block_writers(self) -> None:
        """The norms' and the decode attention's variants that also write their output as Q8_1 blocks, in each order
        some decode GEMV of the plan reads them (int8 activations: ``perfx.model.Model._xb_order``,
        ``AttentionMixer.writes_blocks``): those the decode step takes where its GEMVs read int8 activations."""
        c = self.config
        texel = any(getattr(g, "reads_quantized", False) for g in self.gemv.values())
        natural = any(key[0] == "gemv" and key[2].group == 32 and made.params["I8"]
                      for key, made in self._q8_ops.items())
        if c.hidden_size % 32 == 0:
            for order, wanted in ((Q8_TEXEL, texel), (Q8_NATURAL, natural)):
                if wanted:
                    self.rmsnorm.kernels(order)
        o = dict.get(self.gemv, "o")   # the o projection's int4 GEMV where the step has one (no fallback made)
        if c.head_dim % 32 == 0 and not c.attention_gate and getattr(o, "reads_quantized", False):
            for op in self.step:
                if op.family == "attention_decode" and self.wrapper(op) is not None:
                    self.wrapper(op).kernels(True)

    def moe_gemm(self, role: str, form: Form, m: int) -> GemmMoE:
        """The grouped routed-expert products of an expert role in a held form, tuned for m's bucket: the bucket
        step's op, else (experts the header did not announce in this form) as the step would build it."""
        bucket = m_bucket(m)
        key = (role, form, bucket)
        if key not in self._moe_gemms:
            rep = bucket_representative(bucket)
            op = next((op for op in self.buckets[bucket] if op.family == "gemm_moe" and op.weight == role
                       and op.form == form), None)
            if op is None:
                op = next(op for op in moe.ops(self.config, rep, StepOptions(forms={role: {form}}), prefill=True)
                          if op.family == "gemm_moe")
            shape = op.shape
            self._moe_gemms[key] = self._wrappers[op] = self.choose(
                "gemm_moe", shape, f"{role}, M≈{rep}", lambda p: GemmMoE(self.device, p, shape))
        return self._moe_gemms[key]

    def delta_prefill(self, m: int) -> GatedDeltaNetChunked:
        """The chunked Gated DeltaNet kernel tuned for m's bucket (built once per bucket), for its step's op."""
        bucket = m_bucket(m)
        if bucket not in self._delta_prefill:
            op = next(op for op in self.buckets[bucket] if op.family == "gated_delta_net_chunked")
            shape = op.shape
            self._delta_prefill[bucket] = self._wrappers[op] = self.choose(
                "gated_delta_net_chunked", shape, f"delta, M≈{shape['tokens']}",
                lambda p: GatedDeltaNetChunked(self.device, p, shape))
        return self._delta_prefill[bucket]

    def _faster_q8_gemm(self, shapes: dict) -> str:
        """The int8 GEMM family to run at a bucket's shape (``shapes``: family -> shape): of gemm_q8_lanes and
        (at the few rows of a batched decode step) gemm_q8_i8, the fastest whose first choice was timed in one
        run with gemm_q8's and faster than it over the Ms the bucket serves (``one_run_costs``), else gemm_q8 (the
        register-tiled kernel written for a GPU's wave)."""
        first = {f: self.database.choices(self.device, SPECS[f], shape)[0] for f, shape in shapes.items()}
        costs = one_run_costs(first, "gemm_q8")
        return min(costs, key=costs.get) if "gemm_q8" in costs else "gemm_q8"

    def _q8_step_ops(self, kind: str, name: str, weight: Q8DeviceWeight, form: Form, rep: int) -> list[Op]:
        """The ops of the built step for an int8 weight of this form and size (the GEMV, the GEMM kinds of
        rep's bucket, or the gather), else, for a weight the header did not announce (or the lm_head's GEMM
        in a bucket the step runs none in), the ops as the step would build them for it."""
        c, options = self.config, self.options
        if kind == "embedding":
            found = [op for op in self.step if op.family == "embedding_q8" and op.form == form
                     and op.shape["n"] == weight.n and op.shape["k"] == weight.k]
            return found or [op for op in embedding_ops(c, 1, StepOptions(forms={"embedding": {form}}))]
        gemm = kind == "gemm"
        ops = self.buckets[m_bucket(rep)] if gemm else self.step
        families = ("gemm_q8", "gemm_q8_lanes", "gemm_q8_i8") if gemm else ("gemv_q8",)
        base = matrix_epilogue(c, name)
        epilogue = "bias" if gemm and weight.has_bias and base == "none" else base
        found = [op for op in ops if op.family in families and op.weight == name and op.form == form
                 and op.shape["n"] == weight.n and op.shape["k"] == weight.k and op.epilogue == epilogue
                 and (gemm or op.shape["bias"] == weight.has_bias)]
        return found or role_ops(c, name, rep, options, gemm, dims=(weight.n, weight.k, weight.has_bias),
                                 forms=[form])

    def q8(self, kind: str, name: str, weight: Q8DeviceWeight, m: int = 1):
        """The int8 kernel wrapper ("gemv", "gemm" or "embedding") for a matrix of this form, with the
        parameters tuned for its op of the built step, made once."""
        form = Form("q8", weight.group, weight.f32, weight.symmetric)
        rep = bucket_representative(m_bucket(m)) if kind == "gemm" else 1
        key = (kind, name, form, rep)
        made = self._q8_ops.get(key)
        if made is None:
            ops = self._q8_step_ops(kind, name, weight, form, rep)
            if kind == "gemv":
                op = ops[0]
                epilogue, shape = op.epilogue, op.shape

                def make(params):
                    wrapper = GemvQ8(self.device, params, shape)
                    wrapper.kernel(weight.group, weight.f32, weight.symmetric, epilogue)   # built now: a refusal is seen here
                    if wrapper.params["I8"]:   # x quantized by its own launch where no norm's blocks serve
                        wrapper.quantize_kernel(weight.group)
                    return wrapper
                made = self.choose(op.family, shape, name, make)
            elif kind == "gemm":
                shapes = {op.family: op.shape for op in ops}
                family = self._faster_q8_gemm(shapes)
                op = next(op for op in ops if op.family == family)
                epilogue, shape = op.epilogue, op.shape

                def make(params):
                    wrapper = GemmQ8(self.device, params, shape, Q8_GEMM_KINDS[family])
                    wrapper.kernel(weight.group, weight.f32, weight.symmetric, epilogue)
                    if wrapper.kind == "i8":   # the rounding of X each call launches first
                        wrapper.quantize_kernel(weight.group)
                    return wrapper
                made = self.choose(family, shape, f"{name}, M≈{rep}", make)
            else:
                op = ops[0]
                def make(params):
                    wrapper = EmbeddingQ8(self.device, params)
                    wrapper.kernel(weight.group, weight.f32, weight.symmetric)
                    return wrapper
                made = self.choose(op.family, op.shape, "embedding", make)
            self._wrappers[op] = made
            self._q8_ops[key] = made
        return made


def build_requests(config: ModelConfig, device: Device, max_positions: int, database: Database, group: int | None,
                   forms: dict | None = None, kv: str = "f16", q4_form: int = Q4_PAIRS, buckets=(),
                   fuse: bool = False, q4_scales: dict | None = None) -> list[tuple]:
    """The builds a ``KernelPlan`` of these arguments makes (``(file, defines, newest_c)``, for
    ``Device.build_many``), collected without building anything (``Device.collecting``), each choice's first
    parameters: the decode step's kernels (its int8 ones for each weight form, the hand-over of a chosen token), and
    for each of the M ``buckets`` (``perfx.tuning.database.M_BUCKETS`` indices) the prefill kernels and the
    lm_head's over every row (perplexity, speculation's verification, a batched decode step of that many rows) and
    a batched decode step's attention;
    constrained decoding's mask. The database is only read: a choice refused here is not recorded (the load that
    builds it records it)."""
    with device.collecting() as requests:
        plan = KernelPlan(config, device, max_positions, _ReadOnly(database), lambda text: None, group, forms, kv,
                          q4_form, fuse, q4_scales)
        plan.build_q8(plan.step)
        plan.build_block_writers()
        plan.next_step   # made at its first use: the hand-over of a chosen token to the next step
        plan.logit_mask   # and constrained decoding's mask
        for bucket in buckets:
            plan.prefill(bucket_representative(bucket))
            for layer in config.layers_of("attention"):   # each shape of layer its own (Gemma 4's)
                plan.attention_at(layer, bucket_representative(bucket))
            if config.layers_of("delta"):
                plan.delta_prefill(bucket_representative(bucket))
            plan.build_q8(plan.buckets[bucket])
        if buckets:   # over the rows of a prompt of the largest bucket
            low, high = M_BUCKETS[max(buckets)]
            plan.build_head_rows(min(high or low, max_positions))
            for layer in config.layers_of("attention"):   # a batched decode step's attention, its rows in one launch
                plan.attention_at(layer).rows_kernel()
    return requests


def load_buckets(m: int) -> tuple[int, ...]:
    """The prefill M buckets (``M_BUCKETS`` indices) of prompts of 2 to ``m`` tokens (one token decodes)."""
    return tuple(range(1, m_bucket(max(2, m)) + 1))


@dataclasses.dataclass(frozen=True)
class _Q8Shape:
    """What ``KernelPlan.q8`` reads of an int8 weight, for one not uploaded yet: the form and size of an op's."""

    n: int
    k: int
    group: int
    f32: bool
    symmetric: bool
    has_bias: bool

    @classmethod
    def of(cls, op: Op, bias: bool) -> _Q8Shape:
        return cls(op.shape["n"], op.shape["k"], op.form.group, op.form.f32, op.form.symmetric, bool(bias))


class _ReadOnly:
    """A database whose refusals are not recorded: for a plan made only to collect its builds."""

    def __init__(self, database: Database):
        self._database = database

    def __getattr__(self, name):
        return getattr(self._database, name)

    def refuse(self, *args, **kwargs):
        pass
