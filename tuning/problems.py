"""Which (family, shape) problems a model runs: what `perfx tune` and `perfx bench` measure.

Decode runs the GEMV path at M = 1; prefill runs the GEMM path (tall-skinny and tiled kernels) at
every prompt length, so both are tuned at one representative M per bucket (``M_BUCKETS``) and the
faster family per bucket is the crossover on this device. Which family a matrix runs follows its device
form (``perfx.formats.Form``: int4, int8 or fp16, read from the file's header by
``ModelSource.weight_forms``): a Q4_K_M file runs gemv_q4 and gemv_q8 for the same role in different
layers. The problems are the measured ops of the steps the model runs (``perfx.step``: the decode step, and
the prefill step of each M bucket), deduplicated by (family, shape): there is no second list. Shape dicts
use the keys each spec's ``make_case`` reads; a family whose spec expects other keys is skipped with a note,
never guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from perfx.sources import open_named
from perfx.op import Op, StepOptions
from perfx.step import bucket_steps, decode_step, fuse_asked, matrix_roles

# Contexts at which decode attention is tuned (capped by the model's max_positions).
DECODE_POSITIONS = (256, 2048)

@dataclass(frozen=True)
class Problem:
    family: str
    shape: dict
    label: str          # what the model uses it for: "qkv", "gate_up", "lm_head", "attention", ...
    per_token: int = 1  # launches per forward pass (layers): how much it matters


def tuned_steps(config, group: int | None = None, forms: dict | None = None, kv: str = "f16",
                caps=None) -> list[list[Op]]:
    """The steps `perfx tune` measures: the decode step at each of ``DECODE_POSITIONS`` (capped by the
    model's), then the prefill step of each M bucket (``perfx.tuning.database.M_BUCKETS``). Where a load on the
    device of ``caps`` fuses (``perfx.step.fuse_asked``: ``PERFX_FUSE``, else the device's compiler), the fused
    decode step (``perfx.step.fused_step``) brings the unfused step's ops too: the plain GEMVs its tails take their
    parameters from where the tails have no entry of their own, and the norms a step of one row runs unfused (``fuse``
    False, a batched step of one sequence)."""
    fuse = fuse_asked(caps)
    steps = [_decode_ops(config, StepOptions(group, forms, kv, positions, fuse)) for positions in DECODE_POSITIONS]
    return steps + list(bucket_steps(config, StepOptions(group, forms, kv)).values())


def _decode_ops(config, options: StepOptions) -> list[Op]:
    fused = decode_step(config, options)
    if not options.fuse:
        return fused
    keys = {(op.key, op.role) for op in fused}
    return fused + [op for op in decode_step(config, replace(options, fuse=False)) if (op.key, op.role) not in keys]


# The order problems are listed in, per step kind (`perfx tune` and `perfx bench` print them so): each role's
# matrices first (in ``matrix_roles`` order), then the other ops by label.
_DECODE_ORDER = ("conv", "delta", "lm_head", "attention", "norm", "post-norm", "embedding", "greedy sampling",
                 "swiglu (unfused)", "geglu (unfused)", "final soft-cap", "attention gate", "delta norm gate")
_PREFILL_ORDER = ("lm_head (every row)", "delta", "attention", "norm", "embedding")


def _listing_rank(op: Op, roles: tuple[str, ...], prefill: bool) -> tuple[int, int]:
    if op.weight in roles:
        return 0, roles.index(op.weight)
    order = _PREFILL_ORDER if prefill else _DECODE_ORDER
    return 1, order.index(op.role) if op.role in order else len(order)


def _step_problems(config, steps: list[list[Op]]) -> list[Problem]:
    """The measured ops of the steps as problems: within a step, the ops of one (family, shape, label) summed
    into one problem (launches per token); ordered for the listing."""
    roles, keyed = matrix_roles(config), []
    for index, step in enumerate(steps):
        prefill = index >= len(DECODE_POSITIONS)
        found: dict[tuple, list] = {}
        for position, op in enumerate(step):
            if not op.measured:
                continue
            key = (*op.key, op.role)
            if key in found:
                found[key][1] += op.per_token
            else:
                found[key] = [op, op.per_token, (int(prefill) * index, *_listing_rank(op, roles, prefill), index,
                                                 position)]
        keyed += [(order, Problem(family, op.shape, op.role, count)) for op, count, order in found.values()
                  for family in (op.family, *op.alternatives)]
    return [problem for _, problem in sorted(keyed, key=lambda pair: pair[0])]


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
                   kv: str = "f16", caps=None) -> tuple[list[Problem], list[str]]:
    """Every (family, shape) the model runs for the given specs, and notes on what was left out.

    ``families`` maps family name to spec (``perfx.tuning.SPECS`` or a selection of it). Duplicate
    shapes (the same matrix used twice) are merged, their labels joined. ``forms`` (``ModelSource.weight_forms``)
    gives each matrix role's device forms; without it, ``group`` fixes the int4 group size (None: chosen
    per K as quantize-on-load does), the lm_head is taken as int8 (the default) or fp16. ``kv``: the KV
    cache's form ("f16" or "q8"), part of the attention kernels' shapes. ``caps``: the device's, whose decode step
    may fuse its norms into GEMV tails (``tuned_steps``).
    """
    merged: dict[tuple, Problem] = {}
    notes, skipped = [], set()
    for problem in _step_problems(config, tuned_steps(config, group, forms, kv, caps)):
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
                 lm_head: str = "q8", kv: str = "f16", embedding: str = "head",
                 caps=None) -> tuple[list[Problem], list[str]]:
    """The problems of a ``--model`` value for the chosen families, the prefill path only up to ``max_m``,
    with the lm_head in the form ``lm_head`` gives it (``perfx.sources.open_model``) and a KV cache of form
    ``kv``, the untied embedding in the form ``embedding`` gives it, on the device of ``caps`` (``model_problems``)."""
    source = open_named(model, lm_head=lm_head, embedding=embedding)
    problems, notes = model_problems(source.config, families, source.int4_group, source.weight_forms(), kv,
                                    caps)
    if max_m is not None:
        problems = [p for p in problems if p.shape.get("m", 1) <= max_m]
    return problems, notes
