"""gemv_q4_split: every test shape at the defaults, every candidate at one, the scales' forms, determinism, errors;
and the index model at a GPU's limits (tuning/gemv_index.py): every set the tuner may choose there reads whole
32-byte sectors, and some set launches at least 4 work-groups a compute unit, at every int4 decode GEMV of the
default model, Llama-2-7B and Qwen3-1.7B, on the H200 and the Adreno presets."""

import numpy as np
import pytest

from helpers.spec_checks import assert_first_sets, assert_planned_sets, swept
from perfx import reference
from perfx.errors import PerfxError
from perfx.formats import Q4_SYMMETRIC, Q4_ZEROS, Q4Matrix
from perfx.ops.gemv_q4_split import PARAMS, GemvQ4Split, slice_texels, slices
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.tuning import gemv_index
from perfx.tuning.gemv_index import GPU_PRESETS, MODELS, model_shapes
from perfx.tuning.gemv_q4_split import SPEC
from perfx.tuning.spec import relative_error


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(SPEC), ids=[SPEC.describe(s) for s in SPEC.test_shapes])
def test_every_candidate(device, rng, index):
    """Each candidate at one of the shapes where it runs (the sets of SPLIT 8 only at the first, K = 4160: 130
    texels, which no SPLIT > 1 divides into even slices), and at each, a different build (group size, epilogue
    (SwiGLU, GeGLU), bias), the defaults and a subset holding every value of every parameter
    (helpers.spec_checks.plan)."""
    shape = SPEC.test_shapes[index]
    assert len(SPEC.params.candidates(shape, device.caps)) >= 8
    assert_planned_sets(SPEC, device, index, rng)


def test_shapes_are_off_every_tile():
    """N not a multiple of any set's rows a work-group past 8, K's 130 texels not SPLIT equal slices: the last
slice is shorter at SPLIT 2, 4, 8 (TS 66, 34, 18); at 16, 13 slices of 10."""
    shapes = SPEC.test_shapes
    assert {s["group"] for s in shapes} == {32, 64, 128}
    first = shapes[0]
    sets = SPEC.params.candidates(first)
    assert all(first["n"] % (p["ROWS"] * p["WGR"]) for p in sets if p["ROWS"] * p["WGR"] > 8)
    assert all(first["k"] // 32 % slice_texels(first["k"], p["SPLIT"]) for p in sets if p["SPLIT"] in (2, 4, 8))
    assert {p["SPLIT"] for p in sets} == set(PARAMS.space["SPLIT"])
    assert {s.get("epilogue") for s in shapes} >= {"silu_mul", "gelu_mul"}
    assert any(s.get("bias") and s.get("parts") for s in shapes)


FORM_CASES = [(Q4_ZEROS, {"n": 123, "k": 352, "group": 32, "epilogue": "none", "bias": True}),
              (Q4_SYMMETRIC, {"n": 2 * 45, "k": 1408, "group": 128, "epilogue": "gelu_mul"})]


@pytest.mark.parametrize("form,shape", FORM_CASES, ids=["zeros-odd", "symmetric-gelu"])
def test_zero_point_forms(device, rng, form, shape):
    """The scales' other forms (kernels/q4.h Q4_SCALES 1 and 2), at one slice and at the most slices."""
    ran = assert_first_sets(SPEC, device, {**shape, "form": form}, rng,
                            {"one slice": lambda p: p["SPLIT"] == 1, "split": lambda p: p["SPLIT"] >= 4})
    assert set(ran) == {"one slice", "split"}


def test_detects_wrong_answers(device, rng):
    """The check can fail: a poisoned (unwritten) output and one code off both exceed it."""
    shape = SPEC.test_shapes[2]
    case = SPEC.make_case(device, shape, rng)
    assert relative_error(np.full(shape["n"], np.nan), case.expected["y"]) == np.inf
    y = case.run(SPEC.params.defaults())["y"]
    wrong = y.copy()
    wrong[-1] += 0.0025 * 3
    assert relative_error(wrong, case.expected["y"]) > SPEC.tolerance


def test_sets_of_one_split_share_their_reduction(device):
    """The reduction reads SPLIT and K (its slice count), the epilogue and the bias, not the product's tiles: the
    sets of one SPLIT share its program (one build a SPLIT in a sweep, not one a set), and every other SPLIT, K or
    bias has its own. test_every_candidate checks each set's output through the shared one."""
    shape = SPEC.test_shapes[0]
    sets = [p for p in SPEC.params.candidates(shape, device.caps) if p["SPLIT"] == 4]
    first, other = sets[0], next(p for p in sets if p["LANES"] != sets[0]["LANES"] or p["ROWS"] != sets[0]["ROWS"])
    args = (shape["group"], "none", shape["k"])
    reduction = GemvQ4Split(device, first, shape).kernels(*args)[1]
    assert GemvQ4Split(device, other, shape).kernels(*args)[1] is reduction
    split_8 = next(p for p in SPEC.params.candidates(shape, device.caps) if p["SPLIT"] == 8)
    assert GemvQ4Split(device, split_8, shape).kernels(*args)[1] is not reduction
    assert GemvQ4Split(device, first, shape).kernels(*args, bias=True)[1] is not reduction


def test_runs_are_deterministic_and_the_scratch_serves_several_matrices(device, rng):
    """The slices' partial sums meet in a fixed order: two runs give the same bits. One wrapper serves matrices
    of different N and K one after the other (its scratch per N, its builds per K)."""
    params = next(p for p in SPEC.params.candidates({"n": 300, "k": 2048, "group": 64}, device.caps)
                  if p["SPLIT"] == 8)
    gemv = GemvQ4Split(device, params)
    outputs = []
    for n, k in ((300, 2048), (77, 1024), (300, 2048)):
        q4 = Q4Matrix.random(n, k, 64, np.random.default_rng(n + k))
        weight = Q4DeviceWeight.upload(device, q4, read_paths=("buffer",))
        x = np.random.default_rng(k).standard_normal(k).astype(np.float32)
        y = device.poisoned(n, np.float32)
        gemv(weight, device.upload(x), y).wait()
        assert relative_error(y.get(), reference.gemv(q4.dequantize(), x)) <= SPEC.tolerance
        outputs.append(y.get())
    assert np.array_equal(outputs[0], outputs[2])


def test_errors(device, rng):
    q4 = Q4Matrix.random(10, 64, 32, rng)
    rows = Q4DeviceWeight.upload(device, q4, read_paths=("buffer",))
    interleaved = Q4DeviceWeight.upload(device, q4, read_paths=("buffer",), layout=1)
    x, y = device.upload(rng.standard_normal(64).astype(np.float32)), device.empty(10, np.float32)
    gemv = GemvQ4Split(device)
    with pytest.raises(PerfxError, match="upload it with layout=0"):
        gemv(interleaved, x, y)
    image_only = Q4DeviceWeight.upload(device, q4, read_paths=("image2d",)) if device.caps.image_support else None
    if image_only is not None and image_only.buffer is None:
        with pytest.raises(PerfxError, match="without the 'buffer' read path"):
            gemv(image_only, x, y)
    odd = Q4DeviceWeight.upload(device, Q4Matrix.random(9, 64, 32, rng), read_paths=("buffer",))
    with pytest.raises(PerfxError, match="silu_mul needs gate and up rows of equal count.*N = 9 .odd"):
        gemv(odd, x, y, "silu_mul")
    with pytest.raises(PerfxError, match="unknown epilogue 'bias'"):   # 'none' adds a weight's bias
        gemv(rows, x, y, "bias")
    with pytest.raises(PerfxError, match="x holds 128 bytes"):
        gemv(rows, device.empty(32, np.float32), y)
    with pytest.raises(PerfxError, match="y holds"):
        gemv(rows, x, device.empty(9, np.float32))
    with pytest.raises(PerfxError, match="work-group holds 32 to 256"):
        GemvQ4Split(device, {"LANES": 4, "WGR": 1})
    with pytest.raises(PerfxError, match="each slice of K"):   # ⌈18/16⌉ = 2 texels a slice for 32 lanes
        GemvQ4Split(device, {"SPLIT": 16, "LANES": 32, "WGR": 1}, {"k": 576})


# -- the index model at a GPU's limits ------------------------------------------------------------------------

CASES = [(model, role, preset) for model in MODELS for role in model_shapes(model) for preset in GPU_PRESETS]
IDS = [f"{model}-{role}-{preset.name}" for model, role, preset in CASES]


@pytest.mark.parametrize("model,role,preset", CASES, ids=IDS)
def test_every_set_reads_whole_sectors_and_one_fills_the_compute_units(model, role, preset):
    """Every set the tuner may choose at the preset's limits: every modelled load of the codes uses each 32-byte
    sector it touches whole, for each wave width; at least one set launches ≥ 4 work-groups a compute unit, and
    the model's pick does (whole sectors first, then ≥ 4 a compute unit)."""
    shape = model_shapes(model)[role]
    sets = gemv_index.split_sets(shape, preset)
    assert sets, f"no gemv_q4_split set fits {shape} at {preset.name}'s limits"
    figures = [(p, gemv_index.split_figures(p, shape, preset)) for p in sets]
    partial = [(p, f["sector_use"]) for p, f in figures if f["sector_use"] < 1.0]
    assert not partial, f"sets reading part of a sector: {partial[:4]}"
    assert max(f["per_cu"] for _, f in figures) >= 4
    assert gemv_index.best(figures)[1]["per_cu"] >= 4


def test_the_model_launches_as_the_wrapper_does(device):
    """The model's work-groups are the wrapper's launch: (row blocks × slices) of LANES × WGR work-items."""
    shape = model_shapes("smollm2-135m")["qkv"]
    for params in SPEC.params.candidates(shape, device.caps)[::7]:
        global_size, local_size = GemvQ4Split(device, params, shape).launch_shape(shape["n"], shape["k"])
        blocks, slices, work_group = gemv_index.split_launch(params, shape)
        assert local_size == (work_group, 1)
        assert global_size == (work_group * blocks, slices)


def test_the_model_sees_half_sectors():
    """The model can fail: gemv_q4's rows kernel, whose lanes each read a group's texels (16 bytes at a stride of
    G/2 bytes), uses half of each sector at G = 64 and 128 wherever LANES > 1, as issue 41 measured."""
    shape = model_shapes("llama-2-7b")["o"]
    h200 = GPU_PRESETS[0]
    figures = [(p, gemv_index.rows_figures(p, shape, h200)) for p in gemv_index.rows_sets(shape, h200)]
    assert figures and all(f["sector_use"] == 0.5 for p, f in figures if p["LANES"] > 1)
    assert gemv_index.sector_use([0, 16, 32, 48]) == 1.0 and gemv_index.sector_use([0, 64]) == 0.5
    assert slice_texels(4160, 4) == 34 and slice_texels(576, 16) == 2
    assert slices(4160, 16) == 13 and slices(4160, 4) == 4   # slices of 10 texels: 13, none empty


def test_rows_kernel_figures_print(capsys):
    """gemv_q4's rows kernel through the same model, printed for benchmarks/NOTES.md (not asserted)."""
    print(gemv_index.table("rows", models=("smollm2-135m", "llama-2-7b")))
    assert "| llama-2-7b | o |" in capsys.readouterr().out
