"""The step as data: the ordered kernel launches of a model's forward, built once from its recipe.

``decode_step`` gives the ops of one decode step (M = 1), ``prefill_step`` those of a prefill pass over a
chunk of M rows (one per M bucket, at the bucket's representative M). Each ``Op`` names its kernel family,
the shape its parameters are looked up (and tuned) by, the matrix it reads, the ``RunState`` buffers it
reads and writes, its epilogue and the layers it runs on. `perfx tune` measures exactly the (family, shape)
pairs of these ops (``perfx.tuning.problems``) and the kernel plan chooses a wrapper per op
(``perfx.plan``): the shapes are built here and nowhere else.

The ops of the layer block run layer by layer, in list order, each on the layers in its ``layers`` (an op of
another layer kind is skipped at a layer); the ops before and after it run once. A matrix whose role takes
several device forms over the layers (a Q4_K_M file's int4 and int8 ``down``), or a table with several
possible forms (the lm_head without the file's header), gives one op per form: alternatives, each on the
layers of its role. The per-layer-kind builders (``attention_ops``, ``conv_ops``, ``delta_ops``,
``ffn_ops``) are separate so that each can move into its mixer's module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from perfx.ops.epilogue import gate_up_epilogue
from perfx.ops.kv_cache import kv_shape
from perfx.sources.base import Form
from perfx.tuning.database import M_BUCKETS, bucket_representative

# The form an fp16 lm_head takes by default (--lm-head q8); a GGUF's Q8_0 head has its scales alone, known
# from the file's header (``forms``).
DEFAULT_HEAD_FORM = Form("q8", 32)
DELTA_ROLES = ("delta_qkv", "delta_z", "delta_ab", "delta_out")


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

    @property
    def key(self) -> tuple[str, str]:
        """(family, the shape as canonical JSON): what `perfx tune` measures."""
        return self.family, json.dumps(self.shape, sort_keys=True)

    @property
    def per_token(self) -> int:
        """Launches per step: one per layer it runs on, or one."""
        return len(self.layers) or 1


@dataclass(frozen=True)
class StepOptions:
    """What the loader knows beside the recipe: the int4 group (None: chosen per K as quantize-on-load does),
    each role's device forms (``ModelSource.weight_forms``; None: the quantize-on-load rule, the lm_head as
    int8 or fp16), the KV cache's form and the positions the decode attention is built for."""

    group: int | None = None
    forms: dict | None = None
    kv: str = "f16"
    positions: int | None = None


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


def matrix_roles(config) -> tuple[str, ...]:
    """The matrix roles of the model's layers: qkv and o where it has attention layers (and attn_gate where
    they gate their output, Qwen3.5), conv_in and conv_out where it has conv layers (LFM2), the DeltaNet's
    projections where it has delta layers (Qwen3.5), gate_up and down everywhere."""
    kinds = {r.kind for r in config.layers}
    attention = ("qkv", "o") + (("attn_gate",) if config.attention_gate else ())
    return ((attention if "attention" in kinds else ()) + (("conv_in", "conv_out") if "conv" in kinds else ())
            + (DELTA_ROLES if "delta" in kinds else ()) + ("gate_up", "down"))


def conv_shape(config, m: int) -> dict:
    """The short convolution's shape key (``tuning/short_conv.py``) for m positions; its position past the
    first ring of history, where every launch reads the ring. LFM2's gated form over hidden channels, or
    Qwen3.5's plain one with SiLU over a delta layer's q|k|v."""
    if config.layers_of("delta"):
        return {"h": config.delta_conv_dim, "l": config.conv_length, "m": m, "pos": 131, "gated": False,
                "act": "silu"}
    return {"h": config.hidden_size, "l": config.conv_length, "m": m, "pos": 131, "gated": True}


def delta_shape(config, tokens: int) -> dict:
    """The Gated DeltaNet kernels' shape key (``tuning/gated_delta_net.py``) for a delta layer over ``tokens``
    tokens: the gates as the projections give them (a and b), the file's head map."""
    return {"n_k_heads": config.delta_k_heads, "n_v_heads": config.delta_v_heads, "d_k": config.delta_k_dim,
            "d_v": config.delta_v_dim, "tokens": tokens, "head_map": config.delta_head_map, "raw_gates": True}


def _q8_form_keys(form: Form) -> dict:
    """An int8 shape's form keys: f32 always, sym only where set (a pairs matrix's shape reads as before)."""
    return {"f32": form.f32, **({"sym": True} if form.symmetric else {})}


def gemv_shape(config, label: str, form: Form, n: int, k: int, epilogue: str = "none",
               bias: bool = False) -> tuple[str, dict]:
    """(family, shape) of the decode GEMV of a matrix in ``form``."""
    if form.kind == "f16":
        return "gemv_f16", {"n": n, "k": k}
    shape = {"n": n, "k": k, "group": form.group, "epilogue": epilogue, "bias": bias}
    if form.kind == "q8":
        shape.update(_q8_form_keys(form))
    if label == "qkv":
        shape["parts"] = [config.q_dim, config.kv_dim, config.kv_dim]
    return ("gemv_q8" if form.kind == "q8" else "gemv_q4"), shape


def gemm_shapes(form: Form, m: int, n: int, k: int, epilogue: str) -> list[tuple[str, dict]]:
    """(family, shape) of the prefill GEMMs of a matrix in ``form`` at M = m, the kinds compared per bucket
    (none for fp16)."""
    if form.kind == "q4":
        shape = {"m": m, "n": n, "k": k, "group": form.group, "epilogue": epilogue}
        return [("gemm_q4_skinny", shape), ("gemm_q4_tiled", dict(shape)), ("gemm_q4_f16", dict(shape)),
                ("gemm_q4_lanes", dict(shape))]
    if form.kind == "q8":
        shape = {"m": m, "n": n, "k": k, "group": form.group, **_q8_form_keys(form), "epilogue": epilogue}
        return [("gemm_q8", shape), ("gemm_q8_lanes", dict(shape))]
    return []


def embedding_shape(form: Form, n: int, k: int, m: int) -> tuple[str, dict]:
    """(family, shape) of the embedding gather from a table in ``form``."""
    if form.kind == "q8":
        return "embedding_q8", {"n": n, "k": k, "group": form.group, **_q8_form_keys(form), "m": m}
    if form.kind == "q4":
        return "embedding_q4", {"n": n, "k": k, "group": form.group, "m": m}
    return "embedding_f16", {"n": n, "k": k, "m": m}


# -- the matrices --------------------------------------------------------------------------------------

def matrix_dims(config, role: str) -> tuple[int, int, bool]:
    """(N, K, bias) of a matrix role, fused the way the loader fuses them."""
    c, h = config, config.hidden_size
    return {"qkv": (c.q_dim + 2 * c.kv_dim, h, bool(c.qkv_bias)), "o": (h, c.q_dim, False),
            "attn_gate": (c.q_dim, h, False), "conv_in": (3 * h, h, False), "conv_out": (h, h, False),
            "delta_qkv": (c.delta_conv_dim, h, False), "delta_z": (c.delta_value_dim, h, False),
            "delta_ab": (2 * c.delta_v_heads, h, False), "delta_out": (h, c.delta_value_dim, False),
            "gate_up": (2 * c.intermediate_size, h, False), "down": (h, c.intermediate_size, False),
            "lm_head": (c.vocab_size, h, False)}[role]


def role_forms(config, role: str, options: StepOptions) -> list[Form]:
    """The device forms a matrix or table role takes: the file's (``options.forms``), else the quantize-on-load
    rule (int4 where K has a group, else fp16; the lm_head int8 by default, fp16, or int4 as an untied GGUF
    output; the embedding fp16 as loaded from most files, or int8 as a tied Q8_0 or quantized head)."""
    if options.forms is not None:
        return sorted(options.forms.get(role, ()))
    fixed = options.group
    if role not in ("embedding", "lm_head"):
        group = _group(matrix_dims(config, role)[1], fixed)
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
               reads: tuple[str, ...] = (), writes: tuple[str, ...] = (), dims: tuple | None = None,
               forms: list[Form] | None = None, label: str | None = None) -> list[Op]:
    """y = x·Wᵀ of one matrix role over m rows, one op per device form: the GEMV (decode, m = 1), or with
    ``gemm`` the GEMM kinds a prefill bucket compares at M = m (M = 1 included: the first bucket's crossover
    is tuned at one row), a bias riding in the GEMM's epilogue. ``dims`` (N, K, bias) and ``forms``
    override the recipe's and the file's (a weight the loader made otherwise)."""
    n, k, bias = dims or matrix_dims(config, role)
    epilogue = matrix_epilogue(config, role)
    label = label or role
    out = []
    for form in (forms if forms is not None else role_forms(config, role, options)):
        if not gemm:
            family, shape = gemv_shape(config, role, form, n, k, epilogue, bias)
            out.append(Op(family, shape, label, layers, role, form, reads, writes, epilogue))
        else:
            fused = "bias" if bias and epilogue == "none" else epilogue
            out += [Op(family, shape, label, layers, role, form, reads, writes, fused, m)
                    for family, shape in gemm_shapes(form, m, n, k, fused)]
    return out


def embedding_ops(config, m: int, options: StepOptions) -> list[Op]:
    """The gather of m token rows into the residual stream, one op per form of the table."""
    ids = "step" if m == 1 else "ids"
    return [Op(*embedding_shape(form, config.vocab_size, config.hidden_size, m), "embedding", (), "embedding",
               form, (ids,), ("x",), m=m) for form in role_forms(config, "embedding", options)]


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


def _shared(op: Op, prefill: bool) -> Op:
    """An op of the decode step that a prefill pass runs with the decode step's wrapper (tuned at one row)."""
    return replace(op, shares=op.role, measured=False) if prefill else op


# -- the layer kinds -------------------------------------------------------------------------------------

def attention_ops(config, m: int, options: StepOptions, prefill: bool = False) -> list[Op]:
    """An attention layer: qkv, [the output's gate], attention (decode over the KV cache, or prefill over m
    rows), [σ(gate)·], o."""
    c, layers = config, tuple(config.layers_of("attention"))
    if not layers:
        return []
    out = matrix_ops(c, "qkv", m, options, prefill, layers, ("xb",), ("qkv",))
    if c.attention_gate:
        out += matrix_ops(c, "attn_gate", m, options, prefill, layers, ("xb",), ("gates",))
    out += attention_kernel_ops(c, m, options, layers)
    if c.attention_gate:
        out.append(_shared(Op("sigmoid_mul", {"count": c.q_dim}, "attention gate", layers, reads=("gates", "att"),
                              writes=("att",), m=m), prefill))
    return out + matrix_ops(c, "o", m, options, prefill, layers, ("att",), ("proj",))


def attention_kernel_ops(config, m: int, options: StepOptions, layers: tuple[int, ...] = ()) -> list[Op]:
    """The attention itself: over m rows from position 0 (prefill), or for one row over the KV cache at
    ``options.positions`` (capped by the model's); none for one row without positions (a prefill of one row
    runs the decode step's attention)."""
    c = config
    if m > 1:
        shape = {"n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "m": m, "p0": 0,
                 **qk_norm(c), **kv_shape(options.kv)}
        return [Op("attention_prefill", shape, "attention", layers, reads=("qkv", "cache"),
                   writes=("att", "cache"), m=m)]
    if options.positions is None:
        return []
    positions = min(options.positions, c.max_positions) if c.max_positions else options.positions
    shape = {"n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "positions": positions,
             **qk_norm(c), **kv_shape(options.kv)}
    return [Op("attention_decode", shape, "attention", layers, reads=("qkv", "cache"), writes=("att", "cache"))]


def short_conv_op(config, m: int, layers, reads, writes, prefill: bool) -> Op:
    """The short convolution, tuned at one row (its wrapper runs every m)."""
    return _shared(Op("short_conv", conv_shape(config, 1), "conv", layers, reads=reads, writes=writes, m=m), prefill)


def conv_ops(config, m: int, options: StepOptions, prefill: bool = False) -> list[Op]:
    """A conv layer (LFM2): in-projection to B, C, x; the gated short convolution over the ring; out-projection."""
    c, layers = config, tuple(config.layers_of("conv"))
    if not layers:
        return []
    return (matrix_ops(c, "conv_in", m, options, prefill, layers, ("xb",), ("bcx",))
            + [short_conv_op(c, m, layers, ("bcx", "history"), ("mixed", "history"), prefill)]
            + matrix_ops(c, "conv_out", m, options, prefill, layers, ("mixed",), ("proj",)))


def delta_ops(config, m: int, options: StepOptions, prefill: bool = False) -> list[Op]:
    """A Gated DeltaNet layer (Qwen3.5): q|k|v, z, a|b; the convolution with SiLU; the recurrence (token by
    token for one row, chunked for more); the gated RMSNorm per v head (rows of d_v, by the norm's wrapper)
    and SiLU(z)·; the out-projection."""
    c, layers = config, tuple(config.layers_of("delta"))
    if not layers:
        return []
    out = (matrix_ops(c, "delta_qkv", m, options, prefill, layers, ("xb",), ("dqkv",))
           + matrix_ops(c, "delta_z", m, options, prefill, layers, ("xb",), ("dz",))
           + matrix_ops(c, "delta_ab", m, options, prefill, layers, ("xb",), ("dab",))
           + [short_conv_op(c, m, layers, ("dqkv", "history"), ("dconv", "history"), prefill)])
    state = dict(reads=("dconv", "dab", "delta_state"), writes=("dout", "delta_state"), m=m)
    if m == 1:
        out.append(Op("gated_delta_net_recurrent", delta_shape(c, 1), "delta", layers, **state))
    else:
        out.append(Op("gated_delta_net_chunked", delta_shape(c, m), "delta", layers, **state))
    out.append(Op("rmsnorm", {"m": 1, "k": c.hidden_size, "residual": True}, "delta norm", layers,
                  reads=("dout",), writes=("dconv",), m=m, shares="norm", measured=False))
    out.append(_shared(Op("swiglu", {"count": c.delta_value_dim}, "delta norm gate", layers, reads=("dz", "dconv"),
                          writes=("dout",), m=m), prefill))
    return out + matrix_ops(c, "delta_out", m, options, prefill, layers, ("dout",), ("proj",))


def ffn_ops(config, m: int, options: StepOptions, prefill: bool = False) -> list[Op]:
    """The gated MLP: gate_up with act(gate)·up fused, then down; the activation unfused where gate_up is
    fp16 (the fp16 GEMV, row by row, has no epilogue)."""
    c, layers = config, tuple(range(config.n_layers))
    glu = "geglu" if gate_up_epilogue(c.ffn_activation) == "gelu_mul" else "swiglu"
    return (matrix_ops(c, "gate_up", m, options, prefill, layers, ("xb",), ("hb",))
            + [_shared(Op(glu, {"count": c.intermediate_size}, f"{glu} (unfused)", layers, reads=("hb",),
                          writes=("hb",), m=m), prefill)]
            + matrix_ops(c, "down", m, options, prefill, layers, ("hb",), ("proj",)))


MIXER_OPS = {"attention": attention_ops, "conv": conv_ops, "delta": delta_ops}


def layer_ops(config, m: int, options: StepOptions, prefill: bool = False) -> list[Op]:
    """The layer block: the norm before the mixer (adding the previous layer's output from layer 1 on), each
    layer kind's mixer (in the order the kinds first appear), the norm before the FFN, the FFN."""
    layers = tuple(range(config.n_layers))
    post = not prefill   # the post-norm variant is measured at one row
    out = norm_ops(config, m, layers, layers[1:] if post else None)
    for kind in dict.fromkeys(r.kind for r in config.layers):
        out += MIXER_OPS[kind](config, m, options, prefill)
    return out + norm_ops(config, m, layers, layers if post else None) + ffn_ops(config, m, options, prefill)


def head_ops(config, options: StepOptions, argmax: bool = True) -> list[Op]:
    """For the last row: the final norm, the lm_head (one op per possible form of the head), the soft-cap,
    and the argmax (greedy sampling)."""
    c = config
    out = norm_ops(c, 1, (), ())
    out += matrix_ops(c, "lm_head", 1, options, reads=("xb",), writes=("logits",))
    if c.final_softcap:
        out.append(Op("softcap", softcap_shape(c), "final soft-cap", reads=("logits",), writes=("logits",)))
    if argmax:
        out.append(Op("argmax", {"n": c.vocab_size}, "greedy sampling", reads=("logits",), writes=("best",)))
    return out


# -- the steps ---------------------------------------------------------------------------------------------

def decode_step(config, options: StepOptions) -> list[Op]:
    """The ops of one decode step (M = 1), in order: the embedding gather, the layer block, the head."""
    return embedding_ops(config, 1, options) + layer_ops(config, 1, options) + head_ops(config, options)


def prefill_step(config, m: int, options: StepOptions) -> list[Op]:
    """The ops of a prefill pass over m rows (a bucket's representative M), in order: the gather, the layer
    block over m rows (each matrix's GEMM kinds compared per bucket), the final norm over the rows, the head
    for the last row (the decode step's ops); past 16 rows also the lm_head's int8 GEMM over every row
    (`perfx perplexity`, ``Model.prefill_logits``)."""
    out = embedding_ops(config, m, options) + layer_ops(config, m, options, prefill=True) + norm_ops(config, m, ())
    out += [_shared(op, True) for op in head_ops(config, options, argmax=False)]
    if m > 16:
        forms = [f for f in role_forms(config, "lm_head", options) if f.kind == "q8"]
        out += matrix_ops(config, "lm_head", m, options, True, (), ("head_in",), ("all_logits",), forms=forms,
                          label="lm_head (perplexity)")
    return out


def bucket_steps(config, options: StepOptions) -> dict[int, list[Op]]:
    """Prefill bucket index -> the prefill step at its representative M."""
    return {bucket: prefill_step(config, bucket_representative(bucket), options) for bucket in range(len(M_BUCKETS))}
