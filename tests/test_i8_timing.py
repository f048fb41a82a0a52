"""An int8-activation (I8) set of the int4 decode GEMVs is timed as the decode step runs it: the GEMV alone, on x's
Q8_1 blocks written once before by the set's own quantizing kernel (``perfx.tuning.gemv_q4.step_blocks``), where
the step's norm, attention or gate-up tail has written them; and the check still covers that quantizing. Where the
step hands the GEMV no blocks (a shape marked ``quantizes_x``), its quantizing launch is timed with it."""

import numpy as np
import pytest

from perfx.op import StepOptions
from perfx.ops.gemv_q4 import GemvQ4
from perfx.ops.q4_weight import LAYOUT_ROWS
from perfx.sources.synthetic import open_synthetic
from perfx.step import decode_step
from perfx.tuning.gemv_q4 import SPEC as GEMV_Q4
from perfx.tuning.gemv_q4_tail import SPEC as GEMV_Q4_TAIL
from perfx.tuning.spec import time_case

# Off the tiles: 75 outputs (gate-up) and 37 rows, multiples of no ROWS × WGR but 1; K of 9 and 18 groups.
CASES = {
    "gemv_q4": (GEMV_Q4, {"n": 2 * 75, "k": 576, "group": 64, "epilogue": "silu_mul", "bias": False}),
    "gemv_q4_tail": (GEMV_Q4_TAIL, {"n": 37, "k": 576, "group": 32, "epilogue": "none", "bias": False,
                                    "tail": "norm"}),
}


def i8_sets(spec, shape, caps) -> list[dict]:
    """Two I8 sets of the rows layout that differ in their product's shape (one lane a row, lanes meeting in
    local memory), and the byte dot products' where the device has them."""
    found = [dict(p) for p in spec.params.candidates(shape, caps) if p["LAYOUT"] == LAYOUT_ROWS and p["I8"]
             and p["READ"] == 0]
    picked = [next(p for p in found if p["LANES"] == 1), next(p for p in found if p["LANES"] == 16)]
    picked += [p for p in found if p["I8"] == 2][:1]
    return picked


@pytest.mark.parametrize("family", list(CASES))
def test_an_i8_set_is_timed_without_the_quantizing_launch(device, rng, family):
    spec, shape = CASES[family]
    case = spec.make_case(device, shape, rng)
    for params in i8_sets(spec, shape, device.caps):
        errors = case.errors(params)
        assert max(errors.values()) <= spec.tolerance_for(params), (params, errors)
        with device.watch_kernels() as launched:
            if case.steady is not None:
                events = case.steady(params, case.steady_count)
                products = case.steady_count
            else:
                events, products = case.launch(params), 1
            for event in events:
                event.wait()
            time_case(case, params, warmup=1, repeat=2, device=device)
        assert set(launched) == {"gemv_q4"}, (params, sorted(launched))
        assert len(events) == products, params   # one launch a product: no quantizing launch before it


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("fault", ["wrong steps", "nothing written"])
def test_blocks_the_quantizing_gets_wrong_fail_the_check(device, rng, monkeypatch, family, fault):
    """The blocks are made by the set's own quantizing kernel and the GEMV's result is checked through them against
    the float64 product of the float x: a quantizing that writes wrong steps, or writes nothing (the blocks stay
    poisoned), fails the check."""
    spec, shape = CASES[family]
    quantize = GemvQ4.quantize

    def faulty(self, x, k, into=None):
        if fault == "nothing written":
            return [], into
        events, buffers = quantize(self, x, k, into)
        for event in events:
            event.wait()
        steps = into[1].get()
        into[1].set(steps * np.float32(2))   # every block's step and sum doubled: y twice what it should be
        return [], buffers

    case = spec.make_case(device, shape, rng)
    params = i8_sets(spec, shape, device.caps)[0]
    assert max(case.errors(params).values()) <= spec.tolerance_for(params)
    monkeypatch.setattr(GemvQ4, "quantize", faulty)
    errors = case.errors(params)
    assert errors["y"] > 10 * spec.tolerance_for(params), (fault, errors)


@pytest.mark.parametrize("family", list(CASES))
def test_where_the_step_hands_no_blocks_the_quantizing_launch_is_timed(device, rng, family):
    """A shape marked ``quantizes_x`` (the step's GEMV quantizes its x itself: ``perfx.op.quantizes_x``): each
    product of an I8 set is its quantizing launch and the GEMV, timed and checked together."""
    spec, shape = CASES[family]
    shape = {**shape, "quantizes_x": True}
    case = spec.make_case(device, shape, rng)
    params = i8_sets(spec, shape, device.caps)[0]
    assert max(case.errors(params).values()) <= spec.tolerance_for(params)
    with device.watch_kernels() as launched:
        if case.steady is not None:
            events, products = case.steady(params, case.steady_count), case.steady_count
        else:
            events, products = case.launch(params), 1
        for event in events:
            event.wait()
    assert set(launched) == {"gemv_q4", "gemv_q4_quantize_x"} and len(events) == 2 * products


def test_the_step_marks_the_gemvs_it_hands_no_blocks():
    """``quantizes_x`` on the int4 GEMVs whose x no launch before them writes as blocks (an LFM2's conv out-projection,
    Qwen3.5's DeltaNet out-projection and its gated attention's o), in the plain and the fused step; not on those
    the norm, the attention or gate-up's tail hands blocks (qkv, the default model's o, gate-up, down)."""
    def marked(name, fuse):
        ops = decode_step(open_synthetic(name).config, StepOptions(fuse=fuse))
        return {op.weight for op in ops if op.family.startswith("gemv_q4") and op.shape.get("quantizes_x")}

    for fuse in (False, True):
        assert marked("lfm2-350m", fuse) == {"conv_out"}
        assert marked("qwen3.5-0.8b", fuse) == {"delta_out", "o"}
        assert marked("llama-2-7b", fuse) == set()
