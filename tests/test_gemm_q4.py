"""gemm_q4: the tall-skinny, lanes, int8-activation, tiled and (with cl_khr_fp16) fp16 int4 GEMM kernels, their
epilogues, both weight layouts, and the dispatcher."""

import numpy as np
import pytest

from helpers.spec_checks import assert_first_sets, assert_planned_sets, same_inputs_for_every_form, swept
from perfx.errors import PerfxError
from perfx.formats import Q4_SYMMETRIC, Q4_ZEROS, Q4Matrix
from perfx.ops.epilogue import output_rows
from perfx.ops.gemm_q4 import DEFAULT_CROSSOVER, GemmQ4
from perfx.ops.params import LOCAL_MEM_RESERVE
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.runtime import Device, Limits
from perfx.tuning.database import Database, result_record
from perfx.tuning import SPECS as ALL_SPECS
from perfx.tuning.gemm_q4 import F16, I8, LANES, SKINNY, TILED, expected_output, q8_rounded
from perfx.tuning.spec import relative_error

SPECS = {"skinny": SKINNY, "tiled": TILED, "f16": F16, "lanes": LANES, "i8": I8}
TOL = SKINNY.tolerance
# Against the exact X the int8 kernel's error is X's rounding to Q8_1 blocks: the rows-I8 GEMV's tolerance
I8_EXACT_TOL = ALL_SPECS["gemv_q4"].tolerance_for({**ALL_SPECS["gemv_q4"].params.defaults(), "I8": 1})
TOLERANCES = {"skinny": TOL, "tiled": TOL, "lanes": TOL, "f16": F16.tolerance_for(F16.params.defaults()),
              "i8": I8_EXACT_TOL}


def kinds(device, *names) -> list[str]:
    """The kernels of ``names`` this device runs: the fp16 one only with cl_khr_fp16."""
    return [kind for kind in names or ("skinny", "tiled", "f16", "lanes", "i8") if kind != "f16" or device.caps.fp16]


def _cases(kind):
    # Each candidate at one of the spec shapes (the gate-up epilogue: both weight halves, M passes and edges; the
    # others), and at each, a build of its own, the defaults and a subset holding every value of every parameter
    # (helpers.spec_checks.plan).
    spec = SPECS[kind]
    return [pytest.param(kind, i, id=f"{kind}-{spec.test_shapes[i]['epilogue']}") for i in swept(spec)]


@pytest.mark.parametrize("kind", ["skinny", "tiled", "f16", "lanes", "i8"])
def test_defaults_on_every_spec_shape(device, rng, kind):
    if kind not in kinds(device):
        pytest.skip(f"{device.caps.name} has no cl_khr_fp16")
    spec = SPECS[kind]
    for shape in spec.test_shapes:
        errors = spec.make_case(device, shape, rng).errors(spec.params.defaults())
        assert errors["y"] <= spec.tolerance_for(spec.params.defaults()), (shape, errors)


@pytest.mark.sweep
@pytest.mark.parametrize("kind,index", _cases("skinny") + _cases("tiled") + _cases("f16") + _cases("lanes")
                         + _cases("i8"))
def test_every_candidate_on_the_spec_shapes(device, rng, kind, index):
    spec = SPECS[kind]
    shape = spec.test_shapes[index]
    candidates = spec.params.candidates(shape, device.caps)
    if kind not in kinds(device):
        assert not candidates, "the fp16 GEMM is never a candidate without cl_khr_fp16"
        pytest.skip(f"{device.caps.name} has no cl_khr_fp16")
    assert spec.params.defaults() in candidates and len(candidates) >= 12
    assert {p["LAYOUT"] for p in candidates} == {0, 1}
    assert_planned_sets(spec, device, index, rng)


# The zero-point forms (kernels/q4.h Q4_SCALES 1 and 2) in each layout and through image2d row blocks (where the
# scales are indexed by global row), at each kernel's tolerance: m = −s·z is exact in fp32. 101 columns × 11
# groups: an odd count of zero points; M = 9 is no multiple of any tile.
FORM_CASES = [(Q4_ZEROS, {"m": 9, "n": 101, "k": 352, "group": 32, "epilogue": "bias"}),
              (Q4_SYMMETRIC, {"m": 5, "n": 2 * 50, "k": 320, "group": 64, "epilogue": "silu_mul"})]
FORM_PATHS = {"rows": lambda p: p["LAYOUT"] == 0 and p["READ"] != 1, "image2d": lambda p: p["READ"] == 1,
              "interleaved": lambda p: p["LAYOUT"] == 1}


@pytest.mark.parametrize("kind", ["skinny", "tiled", "f16", "lanes", "i8"])
@pytest.mark.parametrize("form,shape", FORM_CASES, ids=["zeros", "symmetric"])
def test_zero_point_forms(device, rng, kind, form, shape):
    if kind not in kinds(device):   # the fp16 GEMM needs cl_khr_fp16: PoCL lacks it, Intel's runtime runs these
        pytest.skip(f"{device.caps.name} has no cl_khr_fp16")
    ran = assert_first_sets(SPECS[kind], device, {**shape, "form": form}, rng, FORM_PATHS)
    assert {"rows", "interleaved"} <= set(ran)


def _problem(device, rng, m, n, k, group, epilogue="none", read_paths=("image2d", "buffer"), extra_rows=1,
             layout=0):
    q4 = Q4Matrix.random(n, k, group, rng)
    bias = (0.1 * rng.standard_normal(n)).astype(np.float32) if epilogue == "bias" else None
    weight = Q4DeviceWeight.upload(device, q4, bias, read_paths=read_paths, layout=layout)
    x = rng.standard_normal((m, k)).astype(np.float32)
    cols = output_rows(n, epilogue)
    # One poisoned row more than M: a kernel writing past row M - 1 shows there.
    y = device.poisoned((m + extra_rows, cols), np.float32)
    return weight, device.upload(x), y, expected_output(x, q4, bias, epilogue)


def _run(gemm, kind, weight, x, y, m, epilogue="none"):
    gemm.run(kind, weight, x, y, m, epilogue).wait()
    out = y.get()
    assert np.isnan(out[m:]).all(), f"{kind} wrote past row M = {m}"
    return out[:m]


@pytest.mark.parametrize("m", [2, 7, 32, 33, 128, 300])
def test_dispatcher_over_m_off_the_tile_grid(device, rng, m):
    # N = 1000, K = 4160 (130 texels) with G = 64: no multiple of any tile.
    gemm = GemmQ4(device)
    weight, x, y, want = _problem(device, rng, m, 1000, 4160, 64)
    small = kinds(device, "skinny", "tiled", "f16", "lanes", "i8")
    for kind in small if m <= 33 else kinds(device, "tiled", "f16", "lanes"):
        y.fill(np.float32(np.nan))
        assert relative_error(_run(gemm, kind, weight, x, y, m), want) <= TOLERANCES[kind], kind
    y.fill(np.float32(np.nan))
    gemm(weight, x, y, m).wait()
    assert relative_error(y.get()[:m], want) <= TOL


@pytest.mark.parametrize("epilogue,m,n,k,group", [
    ("bias", 7, 576 + 2 * 192, 576, 32),    # SmolLM2's fused QKV with a Qwen-style bias
    ("bias", 45, 200, 4160, 64),
    ("silu_mul", 5, 2 * 200, 640, 128),     # gate-up: I = 200
    ("silu_mul", 40, 2 * 100, 4160, 64),
    ("gelu_mul", 40, 2 * 100, 4160, 64),    # GeGLU: I = 100, K off every tile
])
def test_epilogues_on_both_kernels(device, rng, epilogue, m, n, k, group):
    gemm = GemmQ4(device)
    for layout in (0, 1):
        weight, x, y, want = _problem(device, rng, m, n, k, group, epilogue, read_paths=None, layout=layout)
        for kind in kinds(device):
            y.fill(np.float32(np.nan))
            error = relative_error(_run(gemm, kind, weight, x, y, m, epilogue), want)
            assert error <= TOLERANCES[kind], (kind, layout)


@pytest.fixture(scope="module")
def small_image_device(opencl_device):
    # Images of at most 48 rows: the weight is split in row blocks, and gate and up rows of the
    # gate-up epilogues cross image boundaries at different columns.
    return Device(opencl_device.entry.index, limits=Limits(name="tiny-images", image2d_max_height=48))


@pytest.mark.parametrize("epilogue", ["none", "bias", "silu_mul", "gelu_mul"])
def test_image_row_blocks(small_image_device, rng, epilogue):
    device = small_image_device
    m, n = 9, 2 * 70
    weight, x, y, want = _problem(device, rng, m, n, 320, 32, epilogue, read_paths=("image2d",))
    assert len(weight.images) == 3 and (weight.buffer is None) != weight.images_are_views
    gemm = GemmQ4(device, skinny_params={"READ": 1}, tiled_params={"READ": 1}, lanes_params={"READ": 1},
                  i8_params={"READ": 1}, f16_params={"READ": 1} if device.caps.fp16 else None)
    for kind in kinds(device):
        y.fill(np.float32(np.nan))
        assert relative_error(_run(gemm, kind, weight, x, y, m, epilogue), want) <= TOLERANCES[kind], kind


def test_read_path_falls_back_to_what_the_weight_holds(device, rng):
    m = 6
    buffer_only, x, y, want = _problem(device, rng, m, 90, 256, 64, read_paths=("buffer",))
    gemm = GemmQ4(device, skinny_params={"READ": 1}, tiled_params={"READ": 1}, lanes_params={"READ": 1},
                  i8_params={"READ": 1}, f16_params={"READ": 1} if device.caps.fp16 else None)
    for kind in kinds(device):
        y.fill(np.float32(np.nan))
        assert relative_error(_run(gemm, kind, buffer_only, x, y, m), want) <= TOLERANCES[kind], kind
    image_only, x, y, want = _problem(device, rng, m, 90, 256, 64, read_paths=("image2d",))
    gemm = GemmQ4(device, skinny_params={"READ": 0}, tiled_params={"READ": 0}, lanes_params={"READ": 0},
                  i8_params={"READ": 0}, f16_params={"READ": 2} if device.caps.fp16 else None)
    for kind in kinds(device):
        y.fill(np.float32(np.nan))
        assert relative_error(_run(gemm, kind, image_only, x, y, m), want) <= TOLERANCES[kind], kind


# The int8 kernel's forms of its products (kernels/gemm_q4_i8.cl): int16 pairs, two rows of X a conversion, byte
# dot products (where the device lists cl_khr_integer_dot_product).
I8_FORMS = [pytest.param({}, id="pairs"), pytest.param({"PAIR": 1}, id="paired"),
            pytest.param({"DOT": 1}, id="bytedots")]


@pytest.mark.parametrize("form", I8_FORMS)
@pytest.mark.parametrize("group", [32, 128])
def test_int8_kernel_is_exact_to_its_own_rounding_of_x(device, request, group, form):
    """gemm_q4_i8's one approximation is X rounded to Q8_1 blocks: against the float64 product of the same weights
    and X so rounded it holds the fp32 tolerance in each form of its products, against the exact X it does not
    (it is the int8 kernel), and its calls at M = 2, 4, 8 (the batched decode step's) and then 3 (a smaller X in
    the scratch grown for 8; paired, a pass of two rows and one of a single row) each write their M rows and no
    more."""
    n, k = 2 * 203, 640
    rng = same_inputs_for_every_form(request)
    if form.get("DOT") and not device.caps.integer_dot_product:
        with pytest.raises(PerfxError, match="need cl_khr_integer_dot_product"):
            GemmQ4(device, kind="i8", i8_params=form)
        # the refusal above is this device's check; the products themselves need the extension to run
        pytest.skip(f"{device.caps.name} has no cl_khr_integer_dot_product")
    q4 = Q4Matrix.random(n, k, group, rng)
    weight = Q4DeviceWeight.upload(device, q4, None, ("buffer",))
    gemm = GemmQ4(device, kind="i8", i8_params=form)
    for m in (2, 4, 8, 3):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, rng.integers(0, 256)::256] *= 40
        y = device.poisoned((m + 1, n // 2), np.float32)
        out = _run(gemm, "i8", weight, device.upload(x), y, m, "silu_mul")
        rounded = q8_rounded(x)
        assert relative_error(out, expected_output(rounded, q4, None, "silu_mul")) <= TOL, m
        exact = relative_error(out, expected_output(x, q4, None, "silu_mul"))
        assert TOL < exact <= I8_EXACT_TOL, m


# The skinny GEMMs go over M in full passes of MT rows (or the lanes kernels' MB), then over the remainder:
# each value of the space, with the int8 kernels' paired rows too.
M_PASSES = {"skinny": [{"MT": v} for v in SKINNY.params.space["MT"]],
            "lanes": [{"MB": v} for v in LANES.params.space["MB"]],
            "i8": [{"MT": v, "PAIR": pair} for v in I8.params.space["MT"] for pair in (0, 1)]}


@pytest.mark.parametrize("kind", list(M_PASSES))
def test_every_remainder_of_the_m_passes(device, rng, kind):
    """At each rows-a-pass value M_PASS (MT or MB), M = 1 .. 2·M_PASS + 1: fewer rows than one pass (M = 1
    among them), one full pass and each remainder 0 .. M_PASS − 1, two full passes and one row; each call's M
    rows match the float64 reference (of X rounded as the int8 kernel rounds it, for that kernel) and nothing is
    written past row M."""
    n, k, group = 101, 192, 64   # columns off every ROWS·WGS; 3 groups of 2 texels
    q4 = Q4Matrix.random(n, k, group, rng)
    bias = (0.1 * rng.standard_normal(n)).astype(np.float32)
    weight = Q4DeviceWeight.upload(device, q4, bias, ("buffer",))
    top = 2 * max(max(p.values()) for p in M_PASSES[kind]) + 1
    x = rng.standard_normal((top, k)).astype(np.float32)
    x[:, rng.integers(0, 64)::64] *= 40
    want = expected_output(q8_rounded(x) if kind == "i8" else x, q4, bias, "bias")
    for params in M_PASSES[kind]:
        gemm = GemmQ4(device, shape={"n": n, "k": k, "group": group, "epilogue": "bias"}, kind=kind,
                      **{f"{kind}_params": params})
        rows = params.get("MT", params.get("MB"))
        for m in range(1, 2 * rows + 2):
            y = device.poisoned((m + 1, n), np.float32)
            out = _run(gemm, kind, weight, device.upload(x[:m]), y, m, "bias")
            assert relative_error(out, want[:m]) <= TOL, (params, m)


def test_int8_kernel_forms_are_offered_where_they_build(device):
    """The tuner may choose paired rows anywhere, byte dot products exactly where the device lists
    cl_khr_integer_dot_product, and never both: the pairs are int lanes the byte dot products do not have."""
    shape = I8.test_shapes[0]
    candidates = I8.params.candidates(shape, device.caps)
    assert any(p["PAIR"] for p in candidates)
    assert any(p["DOT"] for p in candidates) == device.caps.integer_dot_product
    assert not any(p["DOT"] and p["PAIR"] for p in candidates)
    both = {**I8.params.defaults(), "MT": 2, "DOT": 1, "PAIR": 1}
    assert "DOT 0" in I8.params.why_invalid(both, shape, device.caps)
    with pytest.raises(PerfxError, match="rows of X are paired"):
        GemmQ4(device, kind="i8", i8_params=both)


def test_dispatcher_choice_is_as_documented(device):
    gemm = GemmQ4(device)
    assert gemm.crossover == DEFAULT_CROSSOVER == 32
    assert [gemm.choose(m) for m in (1, 16, 32, 33, 1024)] == ["skinny"] * 3 + ["tiled"] * 2
    assert GemmQ4(device, crossover=8).choose(9) == "tiled"
    assert GemmQ4(device, crossover=0).choose(1) == "tiled"
    assert GemmQ4(device, kind="tiled").choose(1) == "tiled"
    if device.caps.fp16:
        assert GemmQ4(device, kind="f16").choose(1000) == "f16"
    else:
        with pytest.raises(PerfxError, match="needs cl_khr_fp16"):
            GemmQ4(device, kind="f16")


def test_the_check_can_fail(device, rng):
    m = 4
    gemm = GemmQ4(device)
    weight, x, y, want = _problem(device, rng, m, 64, 256, 32)
    out = _run(gemm, "skinny", weight, x, y, m)
    assert relative_error(out, want) <= TOL
    wrong = want.copy()
    wrong[:, 5] *= 1.01  # one output column off by 1%
    assert relative_error(out, wrong) > TOL
    poisoned = out.copy()
    poisoned[1, 2] = np.nan
    assert relative_error(poisoned, want) == float("inf")


def test_errors_name_the_problem(device, rng):
    gemm = GemmQ4(device)
    weight, x, y, _ = _problem(device, rng, 4, 63, 256, 32, extra_rows=0)
    with pytest.raises(PerfxError, match="unknown epilogue 'gelu'"):
        gemm(weight, x, y, 4, epilogue="gelu")
    with pytest.raises(PerfxError, match="without a bias"):
        gemm(weight, x, y, 4, epilogue="bias")
    for epilogue in ("silu_mul", "gelu_mul"):
        with pytest.raises(PerfxError, match="2·I rows, got N = 63"):
            gemm(weight, x, y, 4, epilogue=epilogue)
    with pytest.raises(PerfxError, match="M must be a positive integer"):
        gemm(weight, x, y, 0)
    with pytest.raises(PerfxError, match="X holds 4096 bytes, less than the 5120"):
        gemm(weight, x, y, 5)
    with pytest.raises(PerfxError, match="unknown kernel 'huge'"):
        gemm.run("huge", weight, x, y, 4)
    with pytest.raises(PerfxError, match="crossover must be"):
        GemmQ4(device, crossover=-1)
    with pytest.raises(PerfxError, match=r"gemm_q4_tiled: parameters .* VWN=16 is not one of"):
        GemmQ4(device, tiled_params={"NWG": 64, "NDIMC": 8, "VWN": 16})
    phone = Device(limits=Limits(name="small-local", local_mem=6144))
    with pytest.raises(PerfxError, match="32768 bytes of local memory > the device's 6144"):
        GemmQ4(phone, tiled_params={"MWG": 64, "NWG": 64, "KWG": 64})
    # Made for the plain epilogue (12 KiB of tiles), asked for gate-up (two weight tiles, 20 KiB): refused.
    phone = Device(limits=Limits(name="16k-local", local_mem=16 << 10))
    gate_up, x, y, _ = _problem(phone, rng, 4, 64, 256, 32, "silu_mul", extra_rows=0)
    with pytest.raises(PerfxError, match="cannot run the silu_mul epilogue .* local memory"):
        GemmQ4(phone, tiled_params={"MWG": 32, "NWG": 64, "VWN": 4, "KWG": 32}).tiled(gate_up, x, y, 4, "silu_mul")


def test_a_tuned_tile_that_does_not_fit_the_gate_up_epilogue_gives_way_to_the_next(rng, tmp_path):
    """24 KiB and a driver's reserve: X and one weight tile of KWG = 64 fit (24 KiB), two (the gate-up
    epilogue's) do not. Passed explicitly that is an error; looked up, it is skipped for the defaults, with the
    reason kept."""
    device = Device(limits=Limits(name="24k-local", local_mem=(24 << 10) + LOCAL_MEM_RESERVE))
    gate_up = {"m": 37, "n": 2 * 70, "k": 320, "group": 32, "epilogue": "silu_mul"}
    assert GemmQ4(device, tiled_params={"KWG": 64}).params["tiled"]["KWG"] == 64   # fits the plain epilogue
    with pytest.raises(PerfxError, match="local memory"):
        GemmQ4(device, tiled_params={"KWG": 64}, shape=gate_up)
    db = Database(tmp_path / "user", tmp_path / "none")
    db.save_result(device, result_record(TILED, gate_up, {**TILED.params.defaults(), "KWG": 64}, 1e-3, None,
                                         device.fingerprint))
    choice = db.choices(device, TILED, gate_up)[0]
    assert choice.source == "default" and choice.params == TILED.params.defaults()
    assert any("local memory" in why for why in choice.skipped), choice.skipped
    gemm = GemmQ4(device, tiled_params=choice.params, shape=gate_up)
    weight, x, y, want = _problem(device, rng, 37, 2 * 70, 320, 32, "silu_mul")
    assert relative_error(_run(gemm, "tiled", weight, x, y, 37, "silu_mul"), want) <= TOL
