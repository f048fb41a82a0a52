"""The step as data: the ordered kernel launches of a model's forward, built once from its recipe.

``decode_step`` gives the ops of one decode step (M = 1), ``prefill_step`` those of a prefill pass over a
chunk of M rows (one per M bucket, at the bucket's representative M). Each ``Op`` names its kernel family,
the shape its parameters are looked up (and tuned) by, the matrix it reads, the ``RunState`` buffers it
reads and writes, its epilogue and the layers it runs on. `perfx tune` measures exactly the (family, shape)
pairs of these ops (``perfx.tuning.problems``) and the kernel plan chooses a wrapper per op
(``perfx.plan``): the shapes are built here and nowhere else.

The ops of the layer block run layer by layer, in list order, each on the layers in its ``layers`` (an op of
another layer kind is skipped at a layer); the ops before and after it run once. The norms, the FFN and the
head are built here; what mixes positions in a layer is built by the mixer of its kind (``perfx.mixers``:
``Mixer.ops``). A matrix whose role takes several device forms over the layers (a Q4_K_M file's int4 and
int8 ``down``), or a table with several possible forms (the lm_head without the file's header), gives one op
per form: alternatives, each on the layers of its role. ``Op`` and the shapes are ``perfx.op``'s.
"""

from __future__ import annotations

import os
from dataclasses import replace

from perfx import moe
from perfx.errors import PerfxError
from perfx.mixers import mixer_class
from perfx.op import Op, StepOptions, embedding_shape, matrix_ops, norm_ops, role_forms, shared, softcap_shape
from perfx.ops.epilogue import gate_up_epilogue
from perfx.ops.gemv_q4_tail import HANDOFFS, handoff_for
from perfx.ops.sample import HISTORY_MAX
from perfx.tuning.database import M_BUCKETS, bucket_representative


def kinds_of(config) -> list[str]:
    """The model's layer kinds, in the order their first layers come."""
    return list(dict.fromkeys(r.kind for r in config.layers))


def matrix_dims(config, role: str) -> tuple[int, int, bool]:
    """(N, K, bias) of a matrix role, fused the way the loader fuses them: the FFN's and the head's, else its
    mixer's (``Mixer.linears``)."""
    c, h, p = config, config.hidden_size, config.per_layer_input
    own = {"gate_up": (2 * c.intermediate_size, h, False), "down": (h, c.intermediate_size, False),
           "lm_head": (c.vocab_size, h, False),
           # Gemma 4's per-layer embeddings: the gate and projection of each layer, the embedding's projection
           "ple_gate": (p, h, False), "ple_proj": (h, p, False), "ple_model": (c.n_layers * p, h, False),
           # Gemma 3n's LAuReL pair
           "laurel_l": (c.laurel_rank, h, False), "laurel_r": (h, c.laurel_rank, False)}
    if role in own:
        return own[role]
    return next((n, k, bias) for kind in kinds_of(c) for r, n, k, bias in mixer_class(kind).linears(c) if r == role)


def matrix_roles(config) -> tuple[str, ...]:
    """The matrix roles of the model's layers: each layer kind's mixer's (in the order the kinds first come),
    then gate_up and down, then Gemma 4's per-layer-embedding matrices where it has them, then Gemma 3n's LAuReL
    pair."""
    ple = ("ple_gate", "ple_proj", "ple_model") if config.per_layer_input else ()
    ple += ("laurel_l", "laurel_r") if config.altup_inputs else ()
    return tuple(r for kind in kinds_of(config) for r, *_ in mixer_class(kind).linears(config)) + ("gate_up",
                                                                                                   "down") + ple


def role_ops(config, role: str, m: int, options: StepOptions, gemm: bool = False, layers: tuple[int, ...] = (),
             reads: tuple[str, ...] = (), writes: tuple[str, ...] = (), forms=None, label: str | None = None,
             dims: tuple | None = None) -> list[Op]:
    """``perfx.op.matrix_ops`` for a role of this model, its dims the recipe's unless ``dims`` gives them (a weight
    the loader made otherwise)."""
    return matrix_ops(config, role, m, options, gemm, layers, reads, writes, dims=dims or matrix_dims(config, role),
                      forms=forms, label=label)


def embedding_ops(config, m: int, options: StepOptions) -> list[Op]:
    """The gather of m token rows into the residual stream, one op per form of the table."""
    ids = "step" if m == 1 else "ids"
    forms = role_forms(config, "embedding", options, config.hidden_size)
    out = [Op(*embedding_shape(form, config.vocab_size, config.hidden_size, m), "embedding", (), "embedding",
              form, (ids,), ("x",), m=m) for form in forms]
    return out + per_layer_input_ops(config, m, options, ids)


def per_layer_input_ops(config, m: int, options: StepOptions, ids: str) -> list[Op]:
    """Gemma 4's per-layer inputs of m tokens: the rows of the per-layer table, the projection of the embedding,
    and (rmsnorm(projection)·γ + rows)/√2 over rows of P (one post-residual norm: ``perfx.model``); none without
    per-layer embeddings."""
    c, p = config, config.per_layer_input
    if not p:
        return []
    width = c.n_layers * p
    out = [Op(*embedding_shape(form, c.vocab_size, width, m), "per-layer table", (), "ple_table", form, (ids,),
              ("ple_in",), m=m) for form in role_forms(c, "ple_table", options, width)]
    out += role_ops(c, "ple_model", m, options, m > 1, (), ("x",), ("ple_proj",))
    return out + [Op("rmsnorm", {"m": m * c.n_layers, "k": p, "residual": True, "post": True}, "per-layer inputs",
                     reads=("ple_proj", "ple_in"), writes=("ple_in",), m=m)]


def ffn_ops(config, m: int, options: StepOptions, prefill: bool = False) -> list[Op]:
    """The gated MLP (a MoE layer's shared expert's too): gate_up with act(gate)·up fused, then down; the activation
    unfused where gate_up is fp16 (the fp16 GEMV, row by row, has no epilogue)."""
    c = config
    glu = "geglu" if gate_up_epilogue(c.ffn_activation) == "gelu_mul" else "swiglu"
    widths: dict[int, list[int]] = {}   # Gemma 4's layers differ in width, and a shared expert: one op a width
    for i in c.gated_mlp_layers:
        widths.setdefault(c.ffn_width(i), []).append(i)
    out = []
    for width, layers in widths.items():
        layers = tuple(layers)
        dims = {"gate_up": (2 * width, c.hidden_size, False), "down": (c.hidden_size, width, False)}
        if len(widths) == 1 and width == c.intermediate_size:
            dims = {"gate_up": None, "down": None}
        out += (role_ops(c, "gate_up", m, options, prefill, layers, ("xb",), ("hb",), dims=dims["gate_up"])
                + [shared(Op(glu, {"count": width}, f"{glu} (unfused)", layers, reads=("hb",), writes=("hb",), m=m),
                          prefill)]
                + role_ops(c, "down", m, options, prefill, layers, ("hb",), ("proj",), dims=dims["down"]))
    return out


def per_layer_ops(config, m: int, options: StepOptions, prefill: bool) -> list[Op]:
    """Gemma 4, after each layer's MLP: its output into the residual (through its post-norm), the per-layer
    input (the gate from the residual, GELU times the layer's inputs, the projection, into the residual through
    its norm), then the residual times the layer's scalar; none for other recipes."""
    c, layers = config, tuple(range(config.n_layers))
    if not (c.per_layer_input or c.layer_scale):
        return []
    close = Op("rmsnorm", {"m": m, "k": c.hidden_size, "residual": True, "post": True}, "residual", layers,
               reads=("x", "proj"), writes=("x",), m=m)
    out = [close]
    if c.per_layer_input:
        out += role_ops(c, "ple_gate", m, options, prefill, layers, ("x",), ("ple_g",))
        # measured at one row; a prefill pass runs the decode step's wrapper
        out.append(shared(Op("per_layer_gate", {"m": 1, "p": c.per_layer_input, "layers": c.n_layers},
                             "per-layer gate", layers, reads=("ple_g", "ple_in"), writes=("ple_g",), m=m), prefill))
        out += role_ops(c, "ple_proj", m, options, prefill, layers, ("ple_g",), ("proj",)) + [close]
    if c.layer_scale:
        out.append(shared(Op("layer_scale", {"count": c.hidden_size}, "layer scale", layers, reads=("x",),
                             writes=("x",), m=m), prefill))
    return out


def altup_ops(config, m: int, options: StepOptions, prefill: bool) -> list[Op]:
    """Gemma 3n's around each layer's mixer and FFN: LAuReL's pair (L, then R), and one op for the AltUp kernels
    (the router, prediction, correction, the per-layer input into the streams, LAuReL's combination, the sparse
    gate: kernels/altup.cl, measured together at one row); none for other recipes. The streams' projections
    into and out of AltUp are fp16 matrices run by the fp16 GEMV."""
    c, layers = config, tuple(range(config.n_layers))
    if not c.altup_inputs:
        return []
    out = role_ops(c, "laurel_l", m, options, prefill, layers, ("xb",), ("laurel_t",))
    out += role_ops(c, "laurel_r", m, options, prefill, layers, ("laurel_t",), ("laurel_out",))
    return out + [shared(Op("altup", {"m": 1, "k": c.hidden_size, "streams": c.altup_inputs,
                                      "n": c.intermediate_size}, "AltUp and LAuReL", layers,
                            reads=("streams", "pred", "x", "proj", "laurel_out", "hb"),
                            writes=("streams", "pred", "x", "xb", "sparse"), m=m), prefill)]


def layer_ops(config, m: int, options: StepOptions, prefill: bool = False) -> list[Op]:
    """The layer block: the norm before the mixer (adding the previous layer's output from layer 1 on), each
    layer kind's mixer (in the order the kinds first come), the norm before the FFN, the FFN: the gated MLP on the
    dense layers, the mixture of experts on the others (``perfx.moe``)."""
    layers = tuple(range(config.n_layers))
    post = not prefill   # the post-norm variant is measured at one row
    out = norm_ops(config, m, layers, layers[1:] if post else None)
    for kind in kinds_of(config):
        out += mixer_class(kind).ops(config, m, options, prefill)
    return (out + norm_ops(config, m, layers, layers if post else None) + ffn_ops(config, m, options, prefill)
            + moe.ops(config, m, options, prefill) + per_layer_ops(config, m, options, prefill)
            + altup_ops(config, m, options, prefill))


def head_ops(config, options: StepOptions, argmax: bool = True) -> list[Op]:
    """For the last row: the final norm, the lm_head (one op per possible form of the head), the soft-cap,
    and the argmax (greedy sampling)."""
    c = config
    out = norm_ops(c, 1, (), ())
    out += role_ops(c, "lm_head", 1, options, reads=("xb",), writes=("logits",))
    if c.final_softcap:
        out.append(Op("softcap", softcap_shape(c), "final soft-cap", reads=("logits",), writes=("logits",)))
    if argmax:
        out.append(Op("argmax", {"n": c.vocab_size}, "greedy sampling", reads=("logits",), writes=("best",)))
        out.append(Op("sample", sample_shape(c), "sampling", reads=("logits",), writes=("best",)))
    return out


def sample_shape(config) -> dict:
    """The draw's shape key (``tuning/sample.py``): the vocabulary, and the settings `perfx chat` samples with by
    default (``perfx.generate.SamplingConfig``'s), over a full penalty window."""
    return {"v": config.vocab_size, "top_k": 40, "temperature": 0.7, "top_p": 0.95, "min_p": 0.05, "penalty": 1.0,
            "history": HISTORY_MAX}


# -- the steps ---------------------------------------------------------------------------------------------

def decode_step(config, options: StepOptions) -> list[Op]:
    """The ops of one decode step (M = 1), in order: the embedding gather, the layer block, the head; where the
    recipe allows (``fuses``), the launches that only move data between two GEMVs as those GEMVs' tails
    (``fused_step``)."""
    step = embedding_ops(config, 1, options) + layer_ops(config, 1, options) + head_ops(config, options)
    return fused_step(config, step, mixer_outputs(config, options)) if options.fuse and fuses(config, options) else step


def mixer_outputs(config, options: StepOptions) -> tuple[str, ...] | None:
    """The matrix role that ends each layer kind's mixer (its decode ops' last, writing proj: attention's o, the
    short convolution's and the DeltaNet's out-projections), in the order the kinds first come; None where a
    mixer ends otherwise."""
    roles = []
    for kind in kinds_of(config):
        ops = mixer_class(kind).ops(config, 1, options)
        if not ops or ops[-1].weight is None or ops[-1].writes != ("proj",):
            return None
        roles.append(ops[-1].weight)
    return tuple(roles)


def fuse_asked(caps=None) -> bool:
    """Whether the decode step runs its norms as GEMV tails: ``PERFX_FUSE=tails`` or ``off`` says; unset, where the
    device's compiler orders the tails' hand-off (``perfx.ops.gemv_q4_tail.handoff_for``: OpenCL C 2.0+, relaxed
    atomics ordered by the counter), which both CPU runtimes' do. There the tails cut a dense layer's launches from
    8 to 5 for the device time of the launches they replace and less host time (benchmarks/NOTES.md, "the GEMV
    tails' ordered hand-off back"); an OpenCL 1.2 compiler's hand-off locks every output (14–25% more device time),
    so its devices keep each norm its own launch. ``caps`` None (no device): as ``PERFX_FUSE`` alone says."""
    value = os.environ.get("PERFX_FUSE", "").strip().lower()
    if value not in ("", "off", "tails"):
        raise PerfxError(f"PERFX_FUSE={value!r}: it takes tails (the norms as GEMV tails) or off")
    if value:
        return value == "tails"
    return caps is not None and handoff_for(caps) == HANDOFFS["ordered"]


def fuses(config, options: StepOptions) -> bool:
    """Whether the decode step fuses its norms into the GEMVs beside them: each layer's mixer ends in a matrix
    writing proj (``mixer_outputs``), every layer has the gated MLP (no mixture of experts, no per-layer inputs or
    output scalar after the MLP, one FFN width), and those matrices and gate-up and down are int4 alone (the tails
    are gemv_q4's rows kernel's: ``kernels/gemv_q4_tail.cl``)."""
    c, outputs = config, mixer_outputs(config, options)
    if outputs is None or list(c.dense_ffn_layers) != list(range(c.n_layers)):
        return False
    if c.per_layer_input or c.layer_scale or len({c.at(i).intermediate_size for i in range(c.n_layers)}) != 1:
        return False
    return all([f.kind for f in role_forms(c, role, options, matrix_dims(c, role)[1])] == ["q4"]
               for role in (*outputs, "gate_up", "down"))


def fused_step(config, step: list[Op], outputs: tuple[str, ...]) -> list[Op]:
    """The decode step with its norms as tails (``perfx.ops.gemv_q4_tail``): the matrix ending each mixer
    (``outputs``: attention's o, ...) adds its output into the residual and writes the norm before the MLP (through the post-norm where the recipe has one), down does
    the same with the next layer's norm, or the final norm after the last layer, and gate-up writes its output's
    Q8_1 blocks, down's int8 input (where its output is whole blocks). The norms of the layer block and the
    final norm go; the norm of the embedding's output runs once before the layers. Each tail's shape is its
    GEMV's with ``tail`` (and ``post``), measured by `perfx tune` as the family gemv_q4_tail."""
    post = {"post": True} if config.post_norms else {}
    gated = config.intermediate_size % 32 == 0
    tails = {role: {"tail": "norm", **post} for role in (*outputs, "down")}
    if gated:
        tails["gate_up"] = {"tail": "q8"}
    out, first_norm = [], None
    for op in step:
        if op.family == "rmsnorm" and op.role in ("norm", "post-norm"):
            if first_norm is None and op.role == "norm":
                first_norm = replace(op, layers=())
            continue
        if op.family == "gemv_q4" and op.weight in tails:
            op = replace(op, family="gemv_q4_tail", shape={**op.shape, **tails[op.weight]}, alternatives=())
        out.append(op)
    at = next(i for i, op in enumerate(out) if op.layers)   # the norm of the embedding's output, before the layers
    return out[:at] + [first_norm] + out[at:]


def prefill_step(config, m: int, options: StepOptions) -> list[Op]:
    """The ops of a prefill pass over m rows (a bucket's representative M), in order: the gather, the layer
    block over m rows (each matrix's GEMM kinds compared per bucket), the final norm over the rows, the head
    for the last row (the decode step's ops); from 2 rows on also the lm_head's int8 GEMM over every row
    (`perfx perplexity`, ``Model.prefill_logits``; a batched decode step of m sequences, ``perfx.batch``)."""
    out = embedding_ops(config, m, options) + layer_ops(config, m, options, prefill=True) + norm_ops(config, m, ())
    out += [shared(op, True) for op in head_ops(config, options, argmax=False)]
    if m > 1:
        forms = [f for f in role_forms(config, "lm_head", options, config.hidden_size) if f.kind == "q8"]
        out += role_ops(config, "lm_head", m, options, True, (), ("head_in",), ("all_logits",), forms=forms,
                        label="lm_head (every row)")
    return out


def bucket_steps(config, options: StepOptions) -> dict[int, list[Op]]:
    """Prefill bucket index -> the prefill step at its representative M."""
    return {bucket: prefill_step(config, bucket_representative(bucket), options) for bucket in range(len(M_BUCKETS))}
