"""gemv_q4: every test shape at the defaults, every candidate at one, image splits, fused QKV, gate-up, errors."""

import numpy as np
import pytest

from helpers.spec_checks import assert_first_sets, assert_planned_sets, swept
from perfx import reference
from perfx.errors import PerfxError
from perfx.formats import Q4_PAIRS, Q4_SYMMETRIC, Q4_ZEROS, Q4Matrix
from perfx.ops.gemv_q4 import GemvQ4
from perfx.ops.params import READ_NAMES, required_subgroup_sizes
from perfx.ops.q4_weight import Q4DeviceWeight, image2d_is_view
from perfx.runtime import Device, Limits
from perfx.tuning.gemv_q4 import SPEC
from perfx.tuning.spec import relative_error

READ_CODES = {name: code for code, name in READ_NAMES.items()}


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(SPEC), ids=[SPEC.describe(s) for s in SPEC.test_shapes])
def test_every_candidate(device, rng, index):
    """Each candidate at one of the shapes, and at each, a different build (group size, epilogue (SwiGLU, GeGLU),
    bias), the defaults and a subset holding every value of every parameter (helpers.spec_checks.plan)."""
    shape = SPEC.test_shapes[index]
    assert len(SPEC.params.candidates(shape, device.caps)) >= 8
    assert_planned_sets(SPEC, device, index, rng)


def test_gpu_class_variants_are_candidates_where_the_device_has_them(device):
    """The interleaved layout runs everywhere; fp16 and subgroup variants exactly where the capabilities are."""
    candidates = SPEC.params.candidates(SPEC.test_shapes[0], device.caps)
    kinds = {(p["LAYOUT"], p.get("SG", 0), p["HALF"], p.get("XS", 0)) for p in candidates}
    caps = device.caps
    assert (1, 0, 0, 0) in kinds and (1, 0, 0, 1) in kinds
    assert any(p["HALF"] for p in candidates) == caps.fp16
    assert any(p.get("SG") or p.get("XS") == 2 for p in candidates) == caps.subgroups
    if caps.subgroups and caps.fp16:
        assert {(0, 1, 1, 0), (1, 0, 1, 2)} <= kinds
    sizes = {s for s in required_subgroup_sizes(caps) if caps.device_type != "CPU" or s <= 16}
    assert any(p["SUBGROUP"] for p in candidates) == bool(sizes & {8, 16, 64})


def test_shapes_cover_the_contract():
    shapes = SPEC.test_shapes
    assert {s["group"] for s in shapes} == {32, 64, 128}
    assert any(s["n"] % 8 and s["k"] % (64 * s["group"]) for s in shapes), "an off-grid shape"
    assert any(s.get("bias") and s.get("parts") for s in shapes), "a fused QKV with bias"
    assert {s.get("epilogue") for s in shapes} >= {"silu_mul", "gelu_mul"}, "gate-up with each activation"


# The zero-point forms (kernels/q4.h Q4_SCALES 1 and 2) on every path that loads a group's scales: GROUP_SUMS in
# fp32 and with HALF's centred offset, in each layout, and the interleaved int8-activation loop. Their m = −s·z is
# exact in fp32, so each set keeps its tolerance. 123 rows × 11 groups: an odd count of zero points (the last
# alone in its byte); the gate-up shape reads gate and up rows' zeros far apart.
FORM_CASES = [(Q4_ZEROS, {"n": 123, "k": 352, "group": 32, "epilogue": "none", "bias": True}),
              (Q4_ZEROS, {"n": 2 * 45, "k": 320, "group": 64, "epilogue": "silu_mul"}),
              (Q4_SYMMETRIC, {"n": 2 * 45, "k": 384, "group": 128, "epilogue": "gelu_mul"})]
SCALE_PATHS = {
    "rows": lambda p: p["LAYOUT"] == 0 and not p["HALF"],
    "rows image2d": lambda p: p["LAYOUT"] == 0 and p["READ"] == 1,
    "rows half": lambda p: p["LAYOUT"] == 0 and p["HALF"],
    "interleaved": lambda p: p["LAYOUT"] == 1 and not p["HALF"] and not p["I8"],
    "interleaved half": lambda p: p["LAYOUT"] == 1 and p["HALF"],
    "interleaved int8": lambda p: p["LAYOUT"] == 1 and p["I8"],
}


@pytest.mark.parametrize("form,shape", FORM_CASES, ids=["zeros-odd", "zeros-silu", "symmetric-gelu"])
def test_zero_point_forms(device, rng, form, shape):
    ran = assert_first_sets(SPEC, device, {**shape, "form": form}, rng, SCALE_PATHS)
    assert {"rows", "rows image2d", "interleaved", "interleaved int8"} <= set(ran)
    assert ("rows half" in ran) == device.caps.fp16


def test_detects_wrong_answers(device, rng):
    """The check can fail: a poisoned (unwritten) output and a reference without offsets both exceed it."""
    shape = SPEC.test_shapes[2]
    case = SPEC.make_case(device, shape, rng)
    assert relative_error(np.full(shape["n"], np.nan), case.expected["y"]) == np.inf
    y = case.run(SPEC.params.defaults())["y"]
    wrong = y.copy()
    wrong[-1] += 0.0025 * 3  # one code off by one, against an x of ~3
    assert relative_error(wrong, case.expected["y"]) > SPEC.tolerance


def _random_weight(device, rng, n, k, group, bias=False, read_paths=("image2d", "buffer"), form=Q4_PAIRS):
    q4 = Q4Matrix.random(n, k, group, rng, form=form)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    return q4, b, Q4DeviceWeight.upload(device, q4, b, read_paths=read_paths)


@pytest.fixture(scope="module")
def small_image_device(opencl_device):
    return Device(opencl_device.entry.index, limits=Limits(name="test", image2d_max_height=256))


@pytest.mark.parametrize("params,form", [({"LANES": 1, "ROWS": 4}, Q4_PAIRS), ({"LANES": 4, "ROWS": 2}, Q4_ZEROS),
                                         ({"LANES": 16, "ROWS": 1}, Q4_SYMMETRIC)])
def test_image_split(small_image_device, rng, params, form):
    """N = 1000 over four images of 256 rows; gate-up pairs whose gate and up rows sit in different images. The
    scales (and zero points) are indexed by the weight's global row, never the row within an image."""
    device = small_image_device
    q4, bias, weight = _random_weight(device, rng, 1000, 576, 64, bias=True, read_paths=("image2d",), form=form)
    assert weight.image_rows == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    x = rng.standard_normal(576).astype(np.float32)
    xd = device.upload(x)
    full = reference.gemv(q4.dequantize(), x, bias)
    gemv = GemvQ4(device, {**params, "READ": 1})

    y = device.poisoned(1000, np.float32)
    assert len(gemv.events(weight, xd, y)) == 4
    gemv(weight, xd, y).wait()
    assert relative_error(y.get(), full) <= SPEC.tolerance

    for epilogue, act, other in (("silu_mul", reference.swiglu, reference.geglu),
                                 ("gelu_mul", reference.geglu, reference.swiglu)):
        y = device.poisoned(500, np.float32)
        events = gemv.events(weight, xd, y, epilogue)
        assert len(events) > 2  # gate rows 0..499 over images 0-1, up rows 500..999 over images 1-3
        events[-1].wait()
        assert relative_error(y.get(), act(full[:500], full[500:])) <= SPEC.tolerance, epilogue
        assert relative_error(y.get(), other(full[:500], full[500:])) > 100 * SPEC.tolerance, "its activation"


def test_fused_qkv_slices_match_separate_products(device, rng):
    """The attention kernel reads q, k, v at offsets of the fused output: each slice is its own product."""
    parts = [Q4Matrix.random(n, 576, 32, rng) for n in (576, 192, 192)]
    bias = rng.standard_normal(960).astype(np.float32)
    weight = Q4DeviceWeight.upload(device, Q4Matrix.concat(parts), bias)
    x = rng.standard_normal(576).astype(np.float32)
    y = device.poisoned(960, np.float32)
    GemvQ4(device)(weight, device.upload(x), y.data).wait()
    out, start = y.get(), 0
    for part in parts:
        stop = start + part.shape[0]
        want = reference.gemv(part.dequantize(), x, bias[start:stop])
        assert relative_error(out[start:stop], want) <= SPEC.tolerance
        start = stop


@pytest.mark.parametrize("layout, i8", [(0, 1), (0, 2), (1, 1)], ids=["rows", "rows-dot", "interleaved"])
@pytest.mark.parametrize("group", [32, 128])
def test_int8_activations_are_exact_to_their_own_quantization(device, rng, layout, i8, group):
    """I8's only approximation is x rounded to Q8 per block of 32: against the float64 product of the same
    weights and the quantized x, it is as exact as the fp32 kernels (SPEC.tolerance), in either layout (the
    rows kernel's x quantized by its own launch, the interleaved one's in each work-group) and in either form
    of the rows kernel's products (int16 pairs, I8 1; byte dot products, I8 2, where the device has
    cl_khr_integer_dot_product, and never offered where it has not), at groups of one block and of four. This
    holds the offset term to Σ of the quantized x (Q8_1's sum): with the exact Σx the error doubled (4.6e-2 on
    gate-up)."""
    shape = {"n": 3072, "k": 640, "group": group, "epilogue": "silu_mul"}
    params = next((p for p in SPEC.params.candidates(shape, device.caps) if p.get("I8") == i8
                   and p["LAYOUT"] == layout), None)
    if i8 == 2 and not device.caps.integer_dot_product:
        assert params is None, "byte dot products are offered only where the driver has them"
        return
    assert params is not None, "the int8-activation variants run on every device"
    weight = Q4Matrix.random(shape["n"], shape["k"], group, rng)
    x = rng.standard_normal(shape["k"]).astype(np.float32)
    x[rng.integers(0, 256)::256] *= 40
    y = device.poisoned(shape["n"] // 2, np.float32)
    uploaded = Q4DeviceWeight.upload(device, weight, None, ("buffer",), layout=layout)
    for event in GemvQ4(device, params, shape).events(uploaded, device.upload(x), y, "silu_mul"):
        event.wait()
    full = reference.gemv(weight.dequantize(), reference.quantize_activations_q8(x))
    half = shape["n"] // 2
    assert relative_error(y.get(), reference.swiglu(full[:half], full[half:])) <= SPEC.tolerance
    exact = reference.gemv(weight.dequantize(), x)
    assert relative_error(y.get(), reference.swiglu(exact[:half], exact[half:])) > SPEC.tolerance  # it is I8


def test_errors(device, rng):
    _, _, buffer_only = _random_weight(device, rng, 10, 64, 32, read_paths=("buffer",))
    _, _, image_only = _random_weight(device, rng, 10, 64, 32, read_paths=("image2d",))
    x, y = device.upload(rng.standard_normal(64).astype(np.float32)), device.empty(10, np.float32)
    with pytest.raises(PerfxError, match="without the 'image2d' read path"):
        GemvQ4(device, {"READ": 1})(buffer_only, x, y)
    with pytest.raises(PerfxError, match="without the 'buffer' read path"):
        GemvQ4(device, {"READ": 0})(image_only, x, y)
    gemv = GemvQ4(device)
    _, _, odd = _random_weight(device, rng, 9, 64, 32)
    for epilogue in ("silu_mul", "gelu_mul"):
        with pytest.raises(PerfxError, match=f"{epilogue} needs gate and up rows of equal count.*N = 9 .odd"):
            gemv(odd, x, y, epilogue)
    with pytest.raises(PerfxError, match="unknown epilogue 'gelu'; choose one of none, silu_mul, gelu_mul"):
        gemv(buffer_only, x, y, "gelu")
    with pytest.raises(PerfxError, match="unknown epilogue 'bias'"):   # 'none' adds a weight's bias
        gemv(buffer_only, x, y, "bias")
    with pytest.raises(PerfxError, match="x holds 128 bytes"):
        gemv(buffer_only, device.empty(32, np.float32), y)
    with pytest.raises(PerfxError, match="y holds"):
        gemv(buffer_only, x, device.empty(9, np.float32))
    with pytest.raises(PerfxError, match="must be a cl.Buffer"):
        gemv(buffer_only, np.zeros(64, np.float32), y)
    with pytest.raises(PerfxError, match="gemv_q4 quantized x holds 16 bytes where 64 are needed"):
        GemvQ4(device, {"LAYOUT": 0, "LANES": 1, "I8": 1})(buffer_only, x, y, quantized=(
            device.empty(16, np.int8), device.empty((2, 2), np.float32)))
    with pytest.raises(PerfxError, match="unknown parameter"):
        GemvQ4(device, {"WPT": 2})
    with pytest.raises(PerfxError, match="READ="):
        GemvQ4(device, {"READ": "texture"})


def test_each_weight_is_on_the_device_once(device, rng):
    """Codes and scales are allocated once whatever the read paths: image1d_buffer (and, where the device has
    cl_khr_image2d_from_buffer, image2d) are views of the codes buffer."""
    device = Device(device.entry.index)   # a count of its own: the shared one's moves as other tests' buffers go
    n, k, group = 300, 2048, 64   # 64 texels a row: a multiple of Intel's image pitch alignment
    q4 = Q4Matrix.random(n, k, group, rng)
    kept = []   # each weight stays alive, so the next upload's count is its own
    for layout in (0, 1):
        before = device.allocated_bytes
        weight = Q4DeviceWeight.upload(device, q4, layout=layout)
        kept.append(weight)
        assert device.allocated_bytes - before == n * k // 2 + 4 * n * (k // group)
        assert weight.buffer is not None
        caps = device.caps
        assert (weight.image1d is not None) == (caps.image1d_buffer_texels > 0)
        assert bool(weight.images) == (layout == 0 and image2d_is_view(caps, k))
        assert weight.images_are_views or not weight.images
        x = rng.standard_normal(k).astype(np.float32)
        want = reference.gemv(q4.dequantize(), x)
        shape = {"n": n, "k": k, "group": group, "epilogue": "none", "bias": False}
        for read in weight.read_paths:
            params = next((p for p in SPEC.params.candidates(shape, caps)
                           if p["LAYOUT"] == layout and p["READ"] == READ_CODES[read]), None)
            if params is None:   # image1d_buffer with rows along K: a GPU-class variant, absent here
                continue
            y = device.poisoned(n, np.float32)
            GemvQ4(device, params)(weight, device.upload(x), y).wait()
            assert relative_error(y.get(), want) <= SPEC.tolerance, (layout, read)


def test_image2d_alone_is_the_only_copy(device, rng):
    """Where image2d cannot view a buffer, asking for it alone makes no codes buffer."""
    device = Device(device.entry.index)   # a count of its own: the shared one's moves as other tests' buffers go
    q4 = Q4Matrix.random(40, 576, 32, rng)
    before = device.allocated_bytes
    weight = Q4DeviceWeight.upload(device, q4, read_paths=("image2d",))
    if not weight.images_are_views:
        assert weight.buffer is None and weight.image1d is None
    assert device.allocated_bytes - before == q4.nbytes
    with pytest.raises(PerfxError, match="interleaved"):
        Q4DeviceWeight.upload(device, q4, read_paths=("image2d",), layout=1)


@pytest.mark.parametrize("form", [Q4_ZEROS, Q4_SYMMETRIC])
def test_zero_point_forms_allocate_their_bytes(device, rng, form):
    """The scales buffer holds the form's bytes (2.5 or 2 a group), and nbytes counts exactly those."""
    device = Device(device.entry.index)   # a count of its own: the shared one's moves as other tests' buffers go
    q4 = Q4Matrix.random(123, 352, 32, rng, form=form)
    before = device.allocated_bytes
    weight = Q4DeviceWeight.upload(device, q4, read_paths=("buffer",), layout=1)
    groups = 123 * 11
    assert weight.form == form and weight.defines == {"Q4_SCALES": form}
    assert device.allocated_bytes - before == weight.nbytes == q4.nbytes == 123 * 352 // 2 + (
        2 * groups + (groups + 1) // 2 if form == Q4_ZEROS else 2 * groups)


def test_layout_mismatch_is_refused(device, rng):
    _, _, rows = _random_weight(device, rng, 10, 64, 32, read_paths=("buffer",))
    x, y = device.upload(rng.standard_normal(64).astype(np.float32)), device.empty(10, np.float32)
    with pytest.raises(PerfxError, match="upload it with layout=1"):
        GemvQ4(device, {"LAYOUT": 1, "SLICES": 1, "ROWS": 2})(rows, x, y)
