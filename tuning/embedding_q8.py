"""Tuning spec of embedding_q8, the gather from an int8 table (a tied embedding is the int8 lm_head).

Shape: n (table rows), k, group, f32, m (ids gathered), optional sym (scales alone), block_bytes (forces the table's split
into row blocks) and scale (each row times it, Gemma's √hidden; default 1).
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops import embedding_q8
from perfx.ops.embedding_q8 import EmbeddingQ8
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.tuning.spec import (EMBEDDING_SCALES, Case, Spec, cached_per_params, q8_group_bytes, q8_matrix,
                               q8_random)


def make_case(device, shape, rng) -> Case:
    n, k, m = shape["n"], shape["k"], shape["m"]
    q8 = q8_random(shape, rng, n)
    ids = rng.integers(0, n, m).astype(np.int32)
    ids[0], ids[-1] = n - 1, 0   # the edges of the first and the last block
    table = Q8DeviceWeight.upload(device, q8, max_block_bytes=shape.get("block_bytes"))
    ids_d = device.upload(ids)
    out = device.poisoned((m, k), np.float32)
    gather = cached_per_params(lambda params: EmbeddingQ8(device, params))
    scale = float(np.float32(shape.get("scale", 1.0)))   # as the kernel receives it

    def launch(params):
        return gather(params)(table, ids_d, out, m, scale)

    def run(params):
        out.fill(np.float32(np.nan))
        for event in launch(params):
            event.wait()
        return {"out": out.get()}

    expected = reference.embed(q8, ids) * scale
    return Case(expected={"out": expected}, run=run, launch=launch)


def fuzz_shapes(st):
    """Tables of up to 40 rows, K of 1–12 groups of 16 or 32, any int8 form, maybe in row blocks;
    1–5 ids; scale 1 or a Gemma-like √hidden."""
    @st.composite
    def shape(draw):
        n, k, group, form, block = draw(q8_matrix(st, 40))
        drawn = {"n": n, "k": k, "group": group, **form, "m": draw(st.integers(1, 5)),
                 "scale": draw(st.sampled_from(EMBEDDING_SCALES))}
        if block:
            drawn["block_bytes"] = block
        return drawn
    return shape()


SPEC = Spec(
    params=embedding_q8.PARAMS,
    make_case=make_case,
    programs=lambda device, shape, params: EmbeddingQ8(device, params).kernel(
        shape["group"], bool(shape.get("f32")), bool(shape.get("sym"))),
    tolerance=1e-6,
    tolerance_why=("w = s·q + m: s·q is exact in fp32 (≤ 19 significant bits) and the add rounds once (none "
                   "without m), 2⁻²⁴ of |w|, the scale once more; one wrong code or group is ≥ s, about 1/255 of the row's range"),
    test_shapes=(
        {"n": 300, "k": 4160, "group": 32, "f32": False, "m": 4},   # 520 chunks a row: off the work-group grid
        {"n": 40, "k": 576, "group": 16, "f32": True, "m": 3, "block_bytes": 9 * 576, "scale": 24.0},
        {"n": 17, "k": 256, "group": 32, "f32": False, "sym": True, "m": 2},
        {"n": 23, "k": 512, "group": 16, "f32": True, "sym": True, "m": 3, "block_bytes": 8 * 512},
    ),
    bytes_moved=lambda s: s["m"] * (s["k"] + q8_group_bytes(s) * (s["k"] // s["group"]) + 4 * s["k"] + 4),
    reference=reference.embed,
    fuzz_shapes=fuzz_shapes,
    # Three groups a row: the last row's fp16 scales alone are read a half2 at a time, one past the end.
    oclgrind_shapes=({"n": 11, "k": 48, "group": 16, "f32": True, "m": 3, "block_bytes": 4 * 48},
                     {"n": 7, "k": 48, "group": 16, "f32": False, "sym": True, "m": 3, "block_bytes": 3 * 48}),
    flops=lambda s: 2 * s["m"] * s["k"],
)
