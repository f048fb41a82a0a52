"""Tuning specs of Gemma 4's per-layer operations (kernels/per_layer.cl): per_layer_gate and layer_scale.

Shapes: per_layer_gate m (rows), p (the per-layer width), layers (each row holds layers·p inputs; the case gates
the last layer's slice, so the offset and the stride are exercised); layer_scale count.
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops.per_layer import LAYER_SCALE, PER_LAYER_GATE, LayerScale, PerLayerGate
from perfx.tuning.spec import Case, Spec, cached_per_params


def make_gate_case(device, shape, rng) -> Case:
    m, p, layers = shape["m"], shape["p"], shape["layers"]
    gate = (rng.standard_normal((m, p)) * 3).astype(np.float32)   # both tails of GELU
    inputs = rng.standard_normal((m, layers * p)).astype(np.float32)
    offset = (layers - 1) * p
    gate_d, inputs_d, out = device.upload(gate), device.upload(inputs), device.empty((m, p), np.float32)
    poison = np.full((m, p), np.nan, np.float32)
    made = cached_per_params(lambda params: PerLayerGate(device, params))

    def launch(params):
        return [made(params)(gate_d, inputs_d, out, m, p, layers * p, offset)]

    def run(params):
        out.set(poison)
        for event in launch(params):
            event.wait()
        return {"out": out.get()}

    return Case(expected={"out": reference.per_layer_gate(gate, inputs, p, offset)}, run=run, launch=launch)


def make_scale_case(device, shape, rng) -> Case:
    count = shape["count"]
    x = rng.standard_normal(count).astype(np.float32)
    s = np.array([rng.uniform(0.2, 3.0)], np.float32)
    x_d, s_d = device.upload(x), device.upload(s)
    made = cached_per_params(lambda params: LayerScale(device, params))

    def launch(params):
        return [made(params)(x_d, s_d, count)]

    def run(params):
        x_d.set(x)   # scaled in place: the fresh values first
        for event in launch(params):
            event.wait()
        return {"x": x_d.get()}

    return Case(expected={"x": reference.layer_scale(x, s[0])}, run=run, launch=launch)


def gate_programs(device, shape, params) -> None:
    """The kernel a gate run at ``params`` builds: the wrapper's, made when it is."""
    PerLayerGate(device, params)


def scale_programs(device, shape, params) -> None:
    """The kernel a scale run at ``params`` builds: the wrapper's, made when it is."""
    LayerScale(device, params)


PER_LAYER_GATE_SPEC = Spec(
    params=PER_LAYER_GATE,
    make_case=make_gate_case,
    tolerance=1e-5,
    tolerance_why=("fp32 tanh (OpenCL allows 5 ulp) and a few products against float64: a few 2⁻²⁴ of each "
                   "element; a wrong slice or a skipped element is O(1) off"),
    test_shapes=({"m": 1, "p": 256, "layers": 35}, {"m": 7, "p": 16, "layers": 6}, {"m": 3, "p": 37, "layers": 2}),
    bytes_moved=lambda s: 12 * s["m"] * s["p"],
    reference=reference.per_layer_gate,
    fuzz_shapes=lambda st: st.fixed_dictionaries({"m": st.integers(1, 40), "p": st.integers(1, 300),
                                                  "layers": st.integers(1, 40)}),
    oclgrind_shapes=({"m": 3, "p": 37, "layers": 2},),
    flops=lambda s: 10 * s["m"] * s["p"],
    programs=gate_programs,
)

LAYER_SCALE_SPEC = Spec(
    params=LAYER_SCALE,
    make_case=make_scale_case,
    tolerance=1e-7,
    tolerance_why="one fp32 product: ≤ 2⁻²⁴ of each element; a skipped element is O(1) off",
    test_shapes=({"count": 1536}, {"count": 64 * 7 + 3}, {"count": 5}),
    bytes_moved=lambda s: 8 * s["count"],
    reference=reference.layer_scale,
    fuzz_shapes=lambda st: st.fixed_dictionaries({"count": st.integers(1, 20000)}),
    oclgrind_shapes=({"count": 203},),
    flops=lambda s: s["count"],
    programs=scale_programs,
)
