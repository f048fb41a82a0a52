"""An op of a model's step: one kernel launch, with the shape its parameters are looked up (and tuned) by,
the weight it reads, the buffers it reads and writes, its epilogue and the layers it runs on; and the shapes
each kernel family's spec keys its parameters by (``tuning/<family>.py``'s ``make_case``).

The steps themselves are built in ``perfx.step``, from the ops the FFN and the head bring and those each layer
kind's mixer brings (``perfx.mixers``: ``Mixer.ops``): the shapes are built here and in the mixers, nowhere else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from perfx.formats import Form
from perfx.ops.epilogue import gate_up_epilogue
from perfx.ops.gemm_q4 import I8_MAX_M

# The form an fp16 lm_head takes by default (--lm-head q8); a GGUF's Q8_0 head has its scales alone, known
# from the file's header (``forms``).
DEFAULT_HEAD_FORM = Form("q8", 32)
# Families that may run a decode op in place of its own family, at the same shape (``Op.alternatives``).
DECODE_ALTERNATIVES = {"gemv_q4": ("gemv_q4_split",)}


@dataclass(frozen=True)
class Op:
    """One kernel launch of the step (on each layer of ``layers`` where it has some, else once).

    ``shape`` is the key its parameters are looked up and tuned by (``tuning/<family>.py``'s shape keys);
    ``m`` the rows it runs over. ``role`` says what the model uses it for ("qkv", "attention", "norm",
    "lm_head", ...): the label `perfx tune` lists. ``weight`` is the matrix or table role it reads (None: no
    weight), in device form ``form``; ``epilogue`` what its kernel fuses after the product. ``reads`` and
    ``writes`` name ``perfx.model.RunState`` buffers (and the model's "cache", "history" and "delta_state").
    ``shares``: the role of the decode op whose chosen wrapper runs this one too (the RMSNorm wrapper runs
    every norm; a prefill pass runs the short convolution, the gates and the head with the decode step's);
    ``measured`` False where its shape is that op's, so `perfx tune` measures it there alone.
    ``alternatives``: families that may run in its place at the same shape, measured beside it (the int4 decode
    GEMV's GPU-shaped form, gemv_q4_split), the plan running the one measured faster in one run.
    """

    family: str
    shape: dict = field(hash=False)
    role: str
    layers: tuple[int, ...] = ()
    weight: str | None = None
    form: Form | None = None
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    epilogue: str = "none"
    m: int = 1
    shares: str | None = None
    measured: bool = True
    alternatives: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        """(family, the shape as canonical JSON): what `perfx tune` measures."""
        return self.family, json.dumps(self.shape, sort_keys=True)

    @property
    def keys(self) -> list[tuple[str, str]]:
        """``key``, and the same shape for each of its ``alternatives``: every (family, shape) measured for it."""
        return [(family, self.key[1]) for family in (self.family, *self.alternatives)]

    @property
    def per_token(self) -> int:
        """Launches per step: one per layer it runs on, or one."""
        return len(self.layers) or 1


@dataclass(frozen=True)
class StepOptions:
    """What the loader knows beside the recipe: the int4 group (None: chosen per K as quantize-on-load does),
    each role's device forms (``ModelSource.weight_forms``; None: the quantize-on-load rule, the lm_head as
    int8 or fp16), the KV cache's form and the positions the decode attention is built for; ``fuse``: the decode
    step's norms and down's quantizing as tails of the GEMVs beside them where the recipe allows
    (``perfx.step.fused_step``; False: each its own launch)."""

    group: int | None = None
    forms: dict | None = None
    kv: str = "f16"
    positions: int | None = None
    fuse: bool = False


# -- shapes: the keys each spec's make_case reads -----------------------------------------------------

def _group(k: int, fixed: int | None = None) -> int | None:
    if fixed:
        return fixed if k % fixed == 0 else None
    return next((g for g in (128, 64, 32) if k % g == 0), None)


def qk_norm(config) -> dict:
    """The attention kernels' shape key for the per-head q/k norm, which changes their build."""
    return {"qk_norm": True} if config.qk_norm else {}


def softcap_shape(config) -> dict:
    return {"count": config.vocab_size, "cap": config.final_softcap}


def _q8_form_keys(form: Form) -> dict:
    """An int8 shape's form keys: f32 always, sym only where set (a pairs matrix's shape reads as before)."""
    return {"f32": form.f32, **({"sym": True} if form.symmetric else {})}


# Int4 matrices whose x no launch before them writes as Q8_1 blocks in the decode step: the GEMV quantizes x itself.
OWN_BLOCKS_ROLES = ("conv_out", "delta_out", "ple_gate", "ple_proj", "ple_model", "laurel_r")


def quantizes_x(config, role: str) -> bool:
    """Whether the decode step hands the int4 GEMV of ``role`` no Q8_1 blocks of its x, so that an int8-activation
    set quantizes x by a launch of its own there (``tuning/gemv_q4.py`` times it so): the roles of
    ``OWN_BLOCKS_ROLES``, and o where the attention writes none (an output gate after it, heads not whole blocks of
    32: ``AttentionMixer.writes_blocks``). down in the unfused step is not marked: its shape keys the entries the
    fused step's down reads too, which gate-up's tail hands blocks."""
    if role == "o":
        return bool(config.attention_gate) or config.head_dim % 32 != 0
    return role in OWN_BLOCKS_ROLES


def gemv_shape(config, label: str, form: Form, n: int, k: int, epilogue: str = "none",
               bias: bool = False) -> tuple[str, dict]:
    """(family, shape) of the decode GEMV of a matrix in ``form``."""
    if form.kind == "f16":
        return "gemv_f16", {"n": n, "k": k}
    shape = {"n": n, "k": k, "group": form.group, "epilogue": epilogue, "bias": bias}
    if form.kind == "q8":
        shape.update(_q8_form_keys(form))
    if label == "qkv" and not config.kv_shared:   # (a layer reading another's cache projects q alone)
        shape["parts"] = [config.q_dim, config.kv_dim, config.kv_dim]
    if form.kind == "q4" and quantizes_x(config, label):
        shape["quantizes_x"] = True
    return ("gemv_q8" if form.kind == "q8" else "gemv_q4"), shape


def gemm_shapes(form: Form, m: int, n: int, k: int, epilogue: str) -> list[tuple[str, dict]]:
    """(family, shape) of the prefill GEMMs of a matrix in ``form`` at M = m, the kinds compared per bucket
    (none for fp16)."""
    if form.kind == "q4":
        shape = {"m": m, "n": n, "k": k, "group": form.group, "epilogue": epilogue}
        # the int8-activation kernel for the few rows of a batched decode step (and of short prompt pieces)
        i8 = [("gemm_q4_i8", dict(shape))] if m <= I8_MAX_M else []
        return [("gemm_q4_skinny", shape), ("gemm_q4_tiled", dict(shape)), ("gemm_q4_f16", dict(shape)),
                ("gemm_q4_lanes", dict(shape))] + i8
    if form.kind == "q8":
        shape = {"m": m, "n": n, "k": k, "group": form.group, **_q8_form_keys(form), "epilogue": epilogue}
        i8 = [("gemm_q8_i8", dict(shape))] if m <= I8_MAX_M else []
        return [("gemm_q8", shape), ("gemm_q8_lanes", dict(shape))] + i8
    return []


def embedding_shape(form: Form, n: int, k: int, m: int) -> tuple[str, dict]:
    """(family, shape) of the embedding gather from a table in ``form``."""
    if form.kind == "q8":
        return "embedding_q8", {"n": n, "k": k, "group": form.group, **_q8_form_keys(form), "m": m}
    if form.kind == "q4":
        return "embedding_q4", {"n": n, "k": k, "group": form.group, "m": m}
    return "embedding_f16", {"n": n, "k": k, "m": m}


# -- the matrices --------------------------------------------------------------------------------------

def role_forms(config, role: str, options: StepOptions, k: int) -> list[Form]:
    """The device forms a matrix or table role takes: the file's (``options.forms``), else the quantize-on-load
    rule (int4 where K has a group, else fp16; the lm_head int8 by default, fp16, or int4 as an untied GGUF
    output; the embedding fp16 as loaded from most files, or int8 as a tied Q8_0 or quantized head)."""
    if options.forms is not None:
        return sorted(options.forms.get(role, ()))
    fixed = options.group
    if role not in ("embedding", "lm_head"):
        group = _group(k, fixed)
        return [Form("f16") if group is None else Form("q4", group)]
    int8 = [DEFAULT_HEAD_FORM] if config.hidden_size % DEFAULT_HEAD_FORM.group == 0 else []
    if role == "embedding":
        return [Form("f16")] + int8
    out = int8 + [Form("f16")]   # the default and `--lm-head fp16`
    group = _group(config.hidden_size, fixed)
    if not config.tie_embeddings and group is not None:   # a GGUF with a Q4 output.weight
        out.append(Form("q4", group))
    return out


def matrix_epilogue(config, role: str) -> str:
    """The epilogue a matrix's kernels fuse: the gate's activation·up for gate_up, else none."""
    return gate_up_epilogue(config.ffn_activation) if role == "gate_up" else "none"


def matrix_ops(config, role: str, m: int, options: StepOptions, gemm: bool = False, layers: tuple[int, ...] = (),
               reads: tuple[str, ...] = (), writes: tuple[str, ...] = (), *, dims: tuple,
               forms: list[Form] | None = None, label: str | None = None) -> list[Op]:
    """y = x·Wᵀ of one matrix role over m rows, one op per device form: the GEMV (decode, m = 1), or with
    ``gemm`` the GEMM kinds a prefill bucket compares at M = m (M = 1 included: the first bucket's crossover
    is tuned at one row), a bias riding in the GEMM's epilogue. ``dims``: the matrix's (N, K, bias); ``forms``
    override the file's (a weight the loader made otherwise)."""
    n, k, bias = dims
    epilogue = matrix_epilogue(config, role)
    label = label or role
    out = []
    for form in (forms if forms is not None else role_forms(config, role, options, k)):
        if not gemm:
            family, shape = gemv_shape(config, role, form, n, k, epilogue, bias)
            out.append(Op(family, shape, label, layers, role, form, reads, writes, epilogue,
                          alternatives=DECODE_ALTERNATIVES.get(family, ())))
        else:
            fused = "bias" if bias and epilogue == "none" else epilogue
            out += [Op(family, shape, label, layers, role, form, reads, writes, fused, m)
                    for family, shape in gemm_shapes(form, m, n, k, fused)]
    return out


def norm_ops(config, m: int, layers: tuple[int, ...], post_layers: tuple[int, ...] | None = None) -> list[Op]:
    """The residual add and RMSNorm into xb (one launch, by the norm's wrapper) over m rows, on ``layers``;
    where the recipe has post-norms (Gemma) and ``post_layers`` is given, the launches on those layers add the
    pending output through its post-norm: that variant is measured on its own (``shares``: the norm's wrapper
    runs it)."""
    shape = {"m": m, "k": config.hidden_size, "residual": True}
    out = [Op("rmsnorm", shape, "norm", layers, reads=("x", "proj"), writes=("x", "xb"), m=m)]
    if post_layers is not None and config.post_norms:
        out.append(Op("rmsnorm", {**shape, "post": True}, "post-norm", post_layers, reads=("x", "proj"),
                      writes=("x", "xb"), m=m, shares="norm"))
    return out


def shared(op: Op, prefill: bool) -> Op:
    """An op of the decode step that a prefill pass runs with the decode step's wrapper (tuned at one row)."""
    return replace(op, shares=op.role, measured=False) if prefill else op


