"""Which (family, shape) problems a model runs: what `perfx tune` and `perfx bench` measure.

Decode runs the GEMV path at M = 1; prefill runs the GEMM path (tall-skinny and tiled kernels) at
every prompt length, so both are tuned at one representative M per bucket (``M_BUCKETS``) and the
faster family per bucket is the crossover on this device. Which family a matrix runs follows its device
form (``perfx.sources.base.Form``: int4, int8 or fp16, read from the file's header by
``ModelSource.weight_forms``): a Q4_K_M file runs gemv_q4 and gemv_q8 for the same role in different
layers. Shape dicts use the keys each spec's ``make_case`` reads (built here, by the helpers the model
also uses); a family whose spec expects other keys is skipped with a note, never guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from perfx.ops.epilogue import gate_up_epilogue
from perfx.ops.kv_cache import kv_shape
from perfx.sources import open_named
from perfx.sources.base import Form
from perfx.tuning.database import M_BUCKETS, bucket_representative

# Contexts at which decode attention is tuned (capped by the model's max_positions).
DECODE_POSITIONS = (256, 2048)

@dataclass(frozen=True)
class Problem:
    family: str
    shape: dict
    label: str          # what the model uses it for: "qkv", "gate_up", "lm_head", "attention", ...
    per_token: int = 1  # launches per forward pass (layers): how much it matters


def _group(k: int, fixed: int | None = None) -> int | None:
    if fixed:
        return fixed if k % fixed == 0 else None
    return next((g for g in (128, 64, 32) if k % g == 0), None)


def qk_norm(config) -> dict:
    """The attention kernels' shape key for the per-head q/k norm, which changes their build."""
    return {"qk_norm": True} if config.qk_norm else {}


def softcap_shape(config) -> dict:
    return {"count": config.vocab_size, "cap": config.final_softcap}


DELTA_ROLES = ("delta_qkv", "delta_z", "delta_ab", "delta_out")


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


def _linears(config) -> list[tuple[str, int, int, str, bool, int]]:
    """(label, N, K, epilogue, bias, layers) of each matrix role of the layers, fused the way the loader fuses
    them, with how many layers have it."""
    c = config
    attention, convs, h = len(c.layers_of("attention")), len(c.layers_of("conv")), c.hidden_size
    deltas, value = len(c.layers_of("delta")), c.delta_value_dim
    rows = {"qkv": ("qkv", c.q_dim + 2 * c.kv_dim, h, "none", bool(c.qkv_bias), attention),
            "o": ("o", h, c.q_dim, "none", False, attention),
            "attn_gate": ("attn_gate", c.q_dim, h, "none", False, attention),
            "conv_in": ("conv_in", 3 * h, h, "none", False, convs),
            "conv_out": ("conv_out", h, h, "none", False, convs),
            "delta_qkv": ("delta_qkv", c.delta_conv_dim, h, "none", False, deltas),
            "delta_z": ("delta_z", value, h, "none", False, deltas),
            "delta_ab": ("delta_ab", 2 * c.delta_v_heads, h, "none", False, deltas),
            "delta_out": ("delta_out", h, value, "none", False, deltas),
            "gate_up": ("gate_up", 2 * c.intermediate_size, h, gate_up_epilogue(c.ffn_activation), False, c.n_layers),
            "down": ("down", h, c.intermediate_size, "none", False, c.n_layers)}
    return [rows[role] for role in matrix_roles(c)]


# The form an fp16 lm_head takes by default (--lm-head q8); a GGUF's Q8_0 head has its scales alone, known
# from the file's header (``forms``).
DEFAULT_HEAD_FORM = Form("q8", 32)


def _q8_form_keys(form: Form) -> dict:
    """An int8 shape's form keys: f32 always, sym only where set (a pairs matrix's shape reads as before)."""
    return {"f32": form.f32, **({"sym": True} if form.symmetric else {})}


def gemv_shape(config, label: str, form: Form, n: int, k: int, epilogue: str = "none",
               bias: bool = False) -> tuple[str, dict]:
    """(family, shape) of the decode GEMV of a matrix in ``form`` (the model looks its kernels up by this)."""
    if form.kind == "f16":
        return "gemv_f16", {"n": n, "k": k}
    shape = {"n": n, "k": k, "group": form.group, "epilogue": epilogue, "bias": bias}
    if form.kind == "q8":
        shape.update(_q8_form_keys(form))
    if label == "qkv":
        shape["parts"] = [config.q_dim, config.kv_dim, config.kv_dim]
    return ("gemv_q8" if form.kind == "q8" else "gemv_q4"), shape


def gemm_shapes(form: Form, m: int, n: int, k: int, epilogue: str) -> list[tuple[str, dict]]:
    """(family, shape) of the prefill GEMMs of a matrix in ``form`` at M = m (none for fp16)."""
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


def _linear_forms(config, label: str, k: int, fixed: int | None, forms: dict | None) -> list[Form]:
    if forms is not None:
        return sorted(forms.get(label, ()))
    group = _group(k, fixed)
    return [Form("f16") if group is None else Form("q4", group)]  # without forms: the quantize-on-load rule


def _table_forms(config, label: str, fixed: int | None, forms: dict | None) -> list[Form]:
    if forms is not None:
        return sorted(forms.get(label, ()))
    int8 = [DEFAULT_HEAD_FORM] if config.hidden_size % DEFAULT_HEAD_FORM.group == 0 else []
    if label == "embedding":   # fp16 as loaded from most files, int8 as a tied Q8_0 or quantized head
        return [Form("f16")] + int8
    out = int8 + [Form("f16")]   # the default and `--lm-head fp16`
    group = _group(config.hidden_size, fixed)
    if not config.tie_embeddings and group is not None:   # a GGUF with a Q4 output.weight
        out.append(Form("q4", group))
    return out


def _decode(config, fixed: int | None, forms: dict | None = None, kv: str = "f16") -> list[Problem]:
    c, out = config, []
    for label, n, k, epilogue, bias, layers in _linears(c):
        for form in _linear_forms(c, label, k, fixed, forms):
            family, shape = gemv_shape(c, label, form, n, k, epilogue, bias)
            out.append(Problem(family, shape, label, layers))
    attention = len(c.layers_of("attention"))
    mixers = len(c.layers_of("conv")) + len(c.layers_of("delta"))
    if mixers:
        out.append(Problem("short_conv", conv_shape(c, 1), "conv", mixers))
    if c.layers_of("delta"):
        out.append(Problem("gated_delta_net_recurrent", delta_shape(c, 1), "delta", len(c.layers_of("delta"))))
    for form in _table_forms(c, "lm_head", fixed, forms):
        family, shape = gemv_shape(c, "lm_head", form, c.vocab_size, c.hidden_size)
        out.append(Problem(family, shape, "lm_head"))
    for positions in DECODE_POSITIONS:
        positions = min(positions, c.max_positions)
        out.append(Problem("attention_decode", {"n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
                                                "head_dim": c.head_dim, "positions": positions, **qk_norm(c),
                                                **kv_shape(kv)},
                           "attention", attention))
    out.append(Problem("rmsnorm", {"m": 1, "k": c.hidden_size, "residual": True}, "norm", 2 * c.n_layers + 1))
    if c.post_norms:   # Gemma's sandwich norms: the post-norm + residual + next pre-norm launch
        out.append(Problem("rmsnorm", {"m": 1, "k": c.hidden_size, "residual": True, "post": True}, "post-norm",
                           2 * c.n_layers))
    for form in _table_forms(c, "embedding", fixed, forms):
        out.append(Problem(*embedding_shape(form, c.vocab_size, c.hidden_size, 1), "embedding"))
    out.append(Problem("argmax", {"n": c.vocab_size}, "greedy sampling"))
    glu = "geglu" if gate_up_epilogue(c.ffn_activation) == "gelu_mul" else "swiglu"
    out.append(Problem(glu, {"count": c.intermediate_size}, f"{glu} (unfused)", c.n_layers))
    if c.final_softcap:
        out.append(Problem("softcap", softcap_shape(c), "final soft-cap"))
    if c.attention_gate:   # Qwen3.5: σ(gate)·attention output, and SiLU(z)· in the DeltaNet's norm
        out.append(Problem("sigmoid_mul", {"count": c.q_dim}, "attention gate", attention))
    if c.layers_of("delta"):
        out.append(Problem("swiglu", {"count": c.delta_value_dim}, "delta norm gate", len(c.layers_of("delta"))))
    return out


def _prefill(config, fixed: int | None, forms: dict | None = None, kv: str = "f16") -> list[Problem]:
    c, out = config, []
    for bucket in range(len(M_BUCKETS)):
        m = bucket_representative(bucket)
        for label, n, k, epilogue, bias, layers in _linears(c):
            if bias:
                epilogue = "bias"
            for form in _linear_forms(c, label, k, fixed, forms):
                for family, shape in gemm_shapes(form, m, n, k, epilogue):
                    out.append(Problem(family, shape, label, layers))
        if m > 16:   # the lm_head over a chunk's rows: `perfx perplexity` (chunks of hundreds of tokens)
            for form in _table_forms(c, "lm_head", fixed, forms):
                if form.kind == "q8":
                    out.extend(Problem(family, shape, "lm_head (perplexity)")
                               for family, shape in gemm_shapes(form, m, c.vocab_size, c.hidden_size, "none"))
        if m > 1 and c.layers_of("delta"):
            out.append(Problem("gated_delta_net_chunked", delta_shape(c, m), "delta", len(c.layers_of("delta"))))
        if m > 1:
            out.append(Problem("attention_prefill", {"n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
                                                     "head_dim": c.head_dim, "m": m, "p0": 0, **qk_norm(c),
                                                     **kv_shape(kv)},
                               "attention", len(c.layers_of("attention"))))
            out.append(Problem("rmsnorm", {"m": m, "k": c.hidden_size, "residual": True}, "norm",
                               2 * c.n_layers + 1))
            for form in _table_forms(c, "embedding", fixed, forms):
                out.append(Problem(*embedding_shape(form, c.vocab_size, c.hidden_size, m), "embedding"))
    return out


def _fits(spec, shape: dict) -> str | None:
    """None when ``shape`` has the keys the spec's own shapes have, else what differs."""
    keys = [set(s) for s in spec.test_shapes]
    if not keys:
        return None
    required, allowed = set.intersection(*keys), set.union(*keys)
    missing, unknown = required - set(shape), set(shape) - allowed
    if missing or unknown:
        return (f"its shapes have keys {sorted(allowed)}, problems.py makes {sorted(shape)}"
                + (f" (missing {sorted(missing)})" if missing else ""))
    return None


def model_problems(config, families: dict, group: int | None = None, forms: dict | None = None,
                   kv: str = "f16") -> tuple[list[Problem], list[str]]:
    """Every (family, shape) the model runs for the given specs, and notes on what was left out.

    ``families`` maps family name to spec (``perfx.tuning.SPECS`` or a selection of it). Duplicate
    shapes (the same matrix used twice) are merged, their labels joined. ``forms`` (``ModelSource.weight_forms``)
    gives each matrix role's device forms; without it, ``group`` fixes the int4 group size (None: chosen
    per K as quantize-on-load does), the lm_head is taken as int8 (the default) or fp16. ``kv``: the KV
    cache's form ("f16" or "q8"), part of the attention kernels' shapes.
    """
    merged: dict[tuple, Problem] = {}
    notes, skipped = [], set()
    for problem in _decode(config, group, forms, kv) + _prefill(config, group, forms, kv):
        spec = families.get(problem.family)
        if spec is None:
            continue
        why = _fits(spec, problem.shape)
        if why is not None:
            if problem.family not in skipped:
                notes.append(f"{problem.family}: skipped, {why}")
                skipped.add(problem.family)
            continue
        key = (problem.family, json.dumps(problem.shape, sort_keys=True))
        if key in merged:
            old = merged[key]
            if problem.label not in old.label.split("+"):
                merged[key] = Problem(old.family, old.shape, f"{old.label}+{problem.label}",
                                      old.per_token + problem.per_token)
        else:
            merged[key] = problem
    for family in families:
        if not any(p.family == family for p in merged.values()) and family not in skipped:
            notes.append(f"{family}: problems.py has no shapes for this family")
    return list(merged.values()), notes


def problems_for(model: str | None, families: dict, max_m: int | None = None,
                 lm_head: str = "q8", kv: str = "f16", embedding: str = "head") -> tuple[list[Problem], list[str]]:
    """The problems of a ``--model`` value for the chosen families, the prefill path only up to ``max_m``,
    with the lm_head in the form ``lm_head`` gives it (``perfx.sources.open_model``) and a KV cache of form
    ``kv``, the untied embedding in the form ``embedding`` gives it."""
    source = open_named(model, lm_head=lm_head, embedding=embedding)
    problems, notes = model_problems(source.config, families, source.int4_group, source.weight_forms(), kv)
    if max_m is not None:
        problems = [p for p in problems if p.shape.get("m", 1) <= max_m]
    return problems, notes
