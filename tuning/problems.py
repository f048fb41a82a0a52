"""Which (family, shape) problems a model runs: what `perfx tune` and `perfx bench` measure.

Decode runs the GEMV path at M = 1; prefill runs the GEMM path (tall-skinny and tiled kernels) at
every prompt length, so both are tuned at one representative M per bucket (``M_BUCKETS``) and the
faster family per bucket is the crossover on this device. Shape dicts use the keys each spec's
``make_case`` reads; a family whose spec expects other keys is skipped with a note, never guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from perfx.sources import open_named
from perfx.tuning.database import M_BUCKETS, bucket_representative

# Contexts at which decode attention is tuned (capped by the model's max_positions).
DECODE_POSITIONS = (256, 2048)

@dataclass(frozen=True)
class Problem:
    family: str
    shape: dict
    label: str          # what the model uses it for: "qkv", "gate_up", "lm_head", "attention", ...
    per_token: int = 1  # launches per forward pass (layers): how much it matters


def model_shapes(name: str | None):
    """(config, group) of a ``--model`` value ("default", a path, "synthetic:<name>"); group is the int4
    group size the model's file fixes (``ModelSource.int4_group``), None where perfx chooses it per K."""
    source = open_named(name)
    return source.config, source.int4_group


def _group(k: int, fixed: int | None = None) -> int | None:
    if fixed:
        return fixed if k % fixed == 0 else None
    return next((g for g in (128, 64, 32) if k % g == 0), None)


def _linears(config) -> list[tuple[str, int, int, str, bool]]:
    """(label, N, K, epilogue, bias) of each int4 matrix of a layer, fused the way the loader fuses them."""
    c = config
    return [
        ("qkv", c.q_dim + 2 * c.kv_dim, c.hidden_size, "none", bool(c.qkv_bias)),
        ("o", c.hidden_size, c.q_dim, "none", False),
        ("gate_up", 2 * c.intermediate_size, c.hidden_size, "silu_mul", False),
        ("down", c.hidden_size, c.intermediate_size, "none", False),
    ]


def _decode(config, fixed: int | None) -> list[Problem]:
    c, out = config, []
    for label, n, k, epilogue, bias in _linears(c):
        group = _group(k, fixed)
        if group is None:  # the loader keeps such a layer fp16
            out.append(Problem("gemv_f16", {"n": n, "k": k}, label, c.n_layers))
            continue
        shape = {"n": n, "k": k, "group": group, "epilogue": epilogue, "bias": bias}
        if label == "qkv":
            shape["parts"] = [c.q_dim, c.kv_dim, c.kv_dim]
        out.append(Problem("gemv_q4", shape, label, c.n_layers))
    # The lm_head is fp16 when tied to the embedding and in most checkpoints besides (AutoAWQ and
    # --quantize q4 leave it fp16); an untied one may also come 4-bit (a GGUF with a Q4 output.weight).
    out.append(Problem("gemv_f16", {"n": c.vocab_size, "k": c.hidden_size}, "lm_head"))
    group = _group(c.hidden_size, fixed)
    if not c.tie_embeddings and group is not None:
        out.append(Problem("gemv_q4", {"n": c.vocab_size, "k": c.hidden_size, "group": group,
                                       "epilogue": "none", "bias": False}, "lm_head"))
    for positions in DECODE_POSITIONS:
        positions = min(positions, c.max_positions)
        out.append(Problem("attention_decode", {"n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
                                                "head_dim": c.head_dim, "positions": positions},
                           "attention", c.n_layers))
    out.append(Problem("rmsnorm", {"m": 1, "k": c.hidden_size, "residual": True}, "norm", 2 * c.n_layers + 1))
    out.append(Problem("embedding_f16", {"n": c.vocab_size, "k": c.hidden_size, "m": 1}, "embedding"))
    out.append(Problem("argmax", {"n": c.vocab_size}, "greedy sampling"))
    out.append(Problem("swiglu", {"count": c.intermediate_size}, "swiglu (unfused)", c.n_layers))
    return out


def _prefill(config, fixed: int | None) -> list[Problem]:
    c, out = config, []
    for bucket in range(len(M_BUCKETS)):
        m = bucket_representative(bucket)
        for label, n, k, epilogue, bias in _linears(c):
            group = _group(k, fixed)
            if group is None:
                continue
            if bias:
                epilogue = "bias"
            for family in ("gemm_q4_skinny", "gemm_q4_tiled", "gemm_q4_f16"):
                out.append(Problem(family, {"m": m, "n": n, "k": k, "group": group, "epilogue": epilogue},
                                   label, c.n_layers))
        if m > 1:
            out.append(Problem("attention_prefill", {"n_heads": c.n_heads, "n_kv_heads": c.n_kv_heads,
                                                     "head_dim": c.head_dim, "m": m, "p0": 0},
                               "attention", c.n_layers))
            out.append(Problem("rmsnorm", {"m": m, "k": c.hidden_size, "residual": True}, "norm",
                               2 * c.n_layers + 1))
            out.append(Problem("embedding_f16", {"n": c.vocab_size, "k": c.hidden_size, "m": m}, "embedding"))
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


def model_problems(config, families: dict, group: int | None = None) -> tuple[list[Problem], list[str]]:
    """Every (family, shape) the model runs for the given specs, and notes on what was left out.

    ``families`` maps family name to spec (``perfx.tuning.specs()`` or a selection of it). Duplicate
    shapes (the same matrix used twice) are merged, their labels joined. ``group`` fixes the int4 group
    size (from ``model_shapes``); None lets perfx choose per K as quantize-on-load does.
    """
    merged: dict[tuple, Problem] = {}
    notes, skipped = [], set()
    for problem in _decode(config, group) + _prefill(config, group):
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


def problems_for(model: str | None, families: dict, max_m: int | None = None) -> tuple[list[Problem], list[str]]:
    """The problems of a ``--model`` value for the chosen families, the prefill path only up to ``max_m``."""
    config, group = model_shapes(model)
    problems, notes = model_problems(config, families, group)
    if max_m is not None:
        problems = [p for p in problems if p.shape.get("m", 1) <= max_m]
    return problems, notes
