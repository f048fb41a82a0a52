"""Tuning specs of the small operations (kernels/small_ops.cl): embedding_f16, embedding_q4, argmax, swiglu,
geglu, sigmoid_mul, softcap.

Shapes: embedding_f16 n (table rows), k, m (ids gathered), optional block_bytes (forces the table's
split into row blocks); embedding_q4 n, k, group, m; both optionally scale (each row times it, Gemma's
√hidden; default 1); argmax n; swiglu and geglu count; softcap count, cap.
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.formats import Q4_PAIRS, Q4Matrix, q4_form_defines
from perfx.ops import small_ops
from perfx.ops.gemv_f16 import F16DeviceWeight
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.ops.small_ops import Argmax, Embedding, GeGLU, SigmoidMul, Softcap, SwiGLU
from perfx.tuning.spec import EMBEDDING_SCALES, Case, Spec, cached_per_params, f16_matrix, q4_matrix


def _ids(rng, n: int, m: int) -> np.ndarray:
    # Random rows, always including the first and the last (the edges of the first and last block).
    ids = rng.integers(0, n, m).astype(np.int32)
    ids[0], ids[-1] = n - 1, 0
    return ids


def _scale(shape) -> float:
    """The shape's row scale as the kernel receives it (float32), so the reference multiplies by the same."""
    return float(np.float32(shape.get("scale", 1.0)))


def _gather_case(device, wrapper, table, ids, k, expected, scale: float) -> Case:
    m = len(ids)
    ids_d = device.upload(ids)
    out = device.empty((m, k), np.float32)
    poison = np.full((m, k), np.nan, np.float32)

    def launch(params):
        events = wrapper(params)(table, ids_d, out, m, scale)
        return events if isinstance(events, list) else [events]

    def run(params):
        out.set(poison)
        for event in launch(params):
            event.wait()
        return {"out": out.get()}

    return Case(expected={"out": expected}, run=run, launch=launch)


def make_embedding_f16_case(device, shape, rng) -> Case:
    n, k, m = shape["n"], shape["k"], shape["m"]
    w = rng.standard_normal((n, k), dtype=np.float32).astype(np.float16)
    ids = _ids(rng, n, m)
    table = F16DeviceWeight.upload(device, w, shape.get("block_bytes"))
    embed = cached_per_params(lambda params: Embedding(device, params).f16)
    scale = _scale(shape)
    return _gather_case(device, embed, table, ids, k, reference.embed(w, ids) * scale, scale)


def make_embedding_q4_case(device, shape, rng) -> Case:
    n, k, m = shape["n"], shape["k"], shape["m"]
    q4 = Q4Matrix.random(n, k, shape["group"], rng, form=shape.get("form", Q4_PAIRS))   # tests set "form"
    ids = _ids(rng, n, m)
    # The table in each layout, uploaded when a candidate of that layout first runs.
    tables = cached_per_params(lambda key: Q4DeviceWeight.upload(device, q4, read_paths=("buffer",),
                                                                 layout=key["LAYOUT"]))
    embed = cached_per_params(lambda params: Embedding(device, params).q4)
    ids_d = device.upload(ids)
    out = device.empty((m, k), np.float32)
    scale = _scale(shape)

    def launch(params):
        return [embed(params)(tables({"LAYOUT": params["LAYOUT"]}), ids_d, out, m, scale)]

    def run(params):
        out.fill(np.float32(np.nan))
        for event in launch(params):
            event.wait()
        return {"out": out.get()}

    return Case(expected={"out": reference.embed(q4, ids) * scale}, run=run, launch=launch)


def make_argmax_case(device, shape, rng) -> Case:
    n = shape["n"]
    x = rng.standard_normal(n, dtype=np.float32)
    if n > 1:
        # A tie for the maximum: numpy (and the kernel) must return the lower index.
        i, j = np.sort(rng.choice(n, 2, replace=False))
        x[i] = x[j] = x.max() + 1
    x_d = device.upload(x)
    index = device.empty(1, np.int32)
    argmax = cached_per_params(lambda params: Argmax(device, params))

    def launch(params):
        return argmax(params)(x_d, n, index)

    def run(params):
        index.set(np.full(1, -1, np.int32))
        for event in launch(params):
            event.wait()
        return {"index": index.get().astype(np.float64)}

    return Case(expected={"index": np.array([reference.argmax(x)], np.float64)}, run=run, launch=launch)


def _gated_case_maker(op, answer):
    """Cases of out = act(gate)·up by the op class (SwiGLU, GeGLU) against its float64 ``answer``."""
    def make_case(device, shape, rng) -> Case:
        count = shape["count"]
        gate = rng.standard_normal(count, dtype=np.float32) * 4  # both of the activation's tails
        up = rng.standard_normal(count, dtype=np.float32)
        gate_d, up_d, out = device.upload(gate), device.upload(up), device.empty(count, np.float32)
        poison = np.full(count, np.nan, np.float32)
        made = cached_per_params(lambda params: op(device, params))

        def launch(params):
            return [made(params)(gate_d, up_d, out, count)]

        def run(params):
            out.set(poison)
            for event in launch(params):
                event.wait()
            return {"out": out.get()}

        return Case(expected={"out": answer(gate, up)}, run=run, launch=launch)

    return make_case


def make_softcap_case(device, shape, rng) -> Case:
    count, cap = shape["count"], shape["cap"]
    logits = rng.standard_normal(count, dtype=np.float32) * 2 * cap   # the cap's linear part and its tails
    x = device.upload(logits)
    softcap = cached_per_params(lambda params: Softcap(device, params))

    def launch(params):
        return [softcap(params)(x, count, cap)]

    def run(params):
        x.set(logits)   # capped in place: the fresh logits first
        for event in launch(params):
            event.wait()
        return {"x": x.get()}

    return Case(expected={"x": reference.softcap(logits, float(np.float32(cap)))}, run=run, launch=launch)


def fuzz_embedding_f16(st):
    """Tables of up to 60 rows of K up to 700, maybe in row blocks; 1–5 ids; scale 1 or a Gemma-like √hidden."""
    return st.builds(lambda table, m, scale: {**table, "m": m, "scale": scale}, f16_matrix(st, 60, 700),
                     st.integers(1, 5), st.sampled_from(EMBEDDING_SCALES))


def fuzz_embedding_q4(st):
    """Tables of up to 40 rows, K of 1–8 groups of 32, 64 or 128; 1–5 ids; scale 1 or a Gemma-like √hidden."""
    return st.builds(lambda matrix, m, scale: {"n": matrix[0], "k": matrix[1], "group": matrix[2], "m": m,
                                               "scale": scale},
                     q4_matrix(st, 40), st.integers(1, 5), st.sampled_from(EMBEDDING_SCALES))


EMBEDDING_F16 = Spec(
    params=small_ops.EMBEDDING_F16,
    make_case=make_embedding_f16_case,
    programs=lambda device, shape, params: Embedding(device, params),
    tolerance=1e-7,
    tolerance_why=("a copy, every fp16 value exact in fp32, times the float32 scale: one rounding (≤ 2⁻²⁴ ≈ "
                   "6e-8 of each value; none at scale 1); a wrong row or element is O(1) off"),
    test_shapes=(
        {"n": 1000, "k": 576, "m": 6, "block_bytes": 300 * 576 * 2},  # table split over 4 buffers
        {"n": 50, "k": 1003, "m": 3, "scale": 1003 ** 0.5},   # K mod 8 = 3: a short last chunk; Gemma's √K
        {"n": 20, "k": 4096, "m": 1},
    ),
    bytes_moved=lambda s: s["m"] * s["k"] * (2 + 4) + 4 * s["m"],
    reference=reference.embed,
    fuzz_shapes=fuzz_embedding_f16,
    oclgrind_shapes=({"n": 10, "k": 203, "m": 3, "block_bytes": 4 * 203 * 2, "scale": 14.25},),
)

EMBEDDING_Q4 = Spec(
    params=small_ops.EMBEDDING_Q4,
    make_case=make_embedding_q4_case,
    programs=lambda device, shape, params: Embedding(device, params).q4_kernel_for(
        params["LAYOUT"], q4_form_defines(shape.get("form", Q4_PAIRS))),
    tolerance=1e-6,
    tolerance_why=("w = s·q + m with s and m fp16 and q < 16: s·q is exact in fp32 and the fma rounds once "
                   "(2⁻²⁴ of |w|), the scale once more; one wrong nibble or group is ≥ s, about 1/15 of the "
                   "row's range"),
    test_shapes=(
        {"n": 300, "k": 4160, "group": 64, "m": 4},  # 130 texels a row: not a multiple of the work-group
        {"n": 40, "k": 576, "group": 32, "m": 3, "scale": 24.0},   # Gemma's √576
        {"n": 17, "k": 256, "group": 128, "m": 2},
    ),
    bytes_moved=lambda s: s["m"] * (s["k"] // 2 + 4 * (s["k"] // s["group"]) + 4 * s["k"] + 4),
    reference=reference.embed,
    fuzz_shapes=fuzz_embedding_q4,
    oclgrind_shapes=({"n": 9, "k": 320, "group": 64, "m": 3, "scale": 17.9},),
    flops=lambda s: 2 * s["m"] * s["k"],
)

ARGMAX = Spec(
    params=small_ops.ARGMAX,
    make_case=make_argmax_case,
    programs=lambda device, shape, params: Argmax(device, params),
    tolerance=0.0,
    tolerance_why="an index: exactly numpy.argmax's (ties to the lowest index) or wrong",
    test_shapes=({"n": 152064}, {"n": 32001}, {"n": 1003}, {"n": 5}),
    bytes_moved=lambda s: 4 * s["n"],
    reference=reference.argmax,
    fuzz_shapes=lambda st: st.fixed_dictionaries({"n": st.integers(1, 40000)}),
    oclgrind_shapes=({"n": 1003},),
)

SWIGLU = Spec(
    params=small_ops.SWIGLU,
    make_case=_gated_case_maker(SwiGLU, reference.swiglu),
    programs=lambda device, shape, params: SwiGLU(device, params),
    tolerance=1e-5,
    tolerance_why=("fp32 exp (OpenCL allows 3 ulp), one division and one product against float64: a few "
                   "2⁻²⁴ of each element; an element skipped or a wrong activation is far above 1e-5"),
    test_shapes=({"count": 3 * 1536}, {"count": 11008 + 5}, {"count": 7}),
    bytes_moved=lambda s: 12 * s["count"],
    reference=reference.swiglu,
    fuzz_shapes=lambda st: st.fixed_dictionaries({"count": st.integers(1, 12000)}),
    oclgrind_shapes=({"count": 203},),
    flops=lambda s: 4 * s["count"],
)

GEGLU = Spec(
    params=small_ops.GEGLU,
    make_case=_gated_case_maker(GeGLU, reference.geglu),
    programs=lambda device, shape, params: GeGLU(device, params),
    tolerance=1e-5,
    tolerance_why=("fp32 tanh (OpenCL allows 5 ulp) and a few products against float64: a few 2⁻²⁴ of each "
                   "element; for gate ≪ 0, where 1 + tanh(·) cancels, tanh's 5 ulp of 1 times 0.5·|gate·up|, "
                   "still ~1e-7 of max|out|. An element skipped, or SiLU in GELU's place (2e-2 on the first "
                   "shape), is far above 1e-5"),
    test_shapes=({"count": 6912 + 3}, {"count": 7}),   # Gemma 3 1B's intermediate size, off the vector width
    bytes_moved=lambda s: 12 * s["count"],
    reference=reference.geglu,
    fuzz_shapes=lambda st: st.fixed_dictionaries({"count": st.integers(1, 12000)}),
    oclgrind_shapes=({"count": 203},),
    flops=lambda s: 10 * s["count"],
)

SIGMOID_MUL = Spec(
    params=small_ops.SIGMOID_MUL,
    make_case=_gated_case_maker(SigmoidMul, reference.sigmoid_mul),
    programs=lambda device, shape, params: SigmoidMul(device, params),
    tolerance=1e-5,
    tolerance_why=("fp32 exp (OpenCL allows 3 ulp), one division and one product against float64: a few "
                   "2⁻²⁴ of each element; an element skipped or SiLU in σ's place is far above 1e-5"),
    test_shapes=({"count": 8 * 256 + 3}, {"count": 7}),   # Qwen3.5-0.8B's attention output (8 heads of 256) + 3
    bytes_moved=lambda s: 12 * s["count"],
    reference=reference.sigmoid_mul,
    fuzz_shapes=lambda st: st.fixed_dictionaries({"count": st.integers(1, 12000)}),
    oclgrind_shapes=({"count": 203},),
    flops=lambda s: 4 * s["count"],
)

SOFTCAP = Spec(
    params=small_ops.SOFTCAP,
    make_case=make_softcap_case,
    programs=lambda device, shape, params: Softcap(device, params),
    tolerance=1e-6,
    tolerance_why=("one fp32 division, tanh (OpenCL allows 5 ulp) and product against float64: a few 2⁻²⁴ of "
                   "cap, itself the bound on |x|; a logit left uncapped is off by up to its own size"),
    test_shapes=({"count": 256000 + 3, "cap": 30.0}, {"count": 5, "cap": 30.0}),   # Gemma 2's vocabulary + 3
    bytes_moved=lambda s: 8 * s["count"],
    reference=reference.softcap,
    fuzz_shapes=lambda st: st.fixed_dictionaries({"count": st.integers(1, 300000),
                                                  "cap": st.sampled_from([30.0, 1.5])}),
    oclgrind_shapes=({"count": 203, "cap": 30.0},),
    flops=lambda s: 3 * s["count"],
)

