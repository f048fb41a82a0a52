"""rmsnorm (fused residual + RMSNorm, plain, and Gemma's post-norm + residual + RMSNorm): every test shape at
the defaults, every candidate at one of them, and the error paths."""

import numpy as np
import pytest

from helpers.spec_checks import assert_planned_sets, swept
from perfx import reference
from perfx.errors import PerfxError
from perfx.ops import Q8_NATURAL
from perfx.ops.gemv_q8 import GemvQ8
from perfx.ops.rmsnorm import RMSNorm
from perfx.tuning import relative_error
from perfx.tuning.rmsnorm import EPS, SPEC


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(SPEC), ids=[SPEC.describe(s) for s in SPEC.test_shapes])
def test_every_parameter_set_matches_reference(device, rng, index):
    """Each set at one of the shapes (helpers.spec_checks.plan), and at each (the decode step's two forms, the
    plain norm and the one writing int4-order Q8_1 blocks, and the others, each a build or entry of its own) the
    defaults and every value of every parameter."""
    assert_planned_sets(SPEC, device, index, rng)


def test_eps_and_residual_matter(device, rng):
    # Small activations, so eps changes y well beyond the tolerance: a kernel ignoring eps would fail.
    rows, dim, eps = 2, 300, 1e-2
    x = rng.standard_normal((rows, dim)).astype(np.float32) * 0.05
    r = rng.standard_normal((rows, dim)).astype(np.float32) * 0.05
    gamma = rng.uniform(0.5, 1.5, dim).astype(np.float32)
    r_d, y = device.upload(r), device.poisoned((rows, dim), np.float32)
    RMSNorm(device).residual(device.upload(x), r_d, device.upload(gamma), y, rows, dim, eps).wait()
    h, want = reference.rmsnorm_residual(x, r, gamma, eps)
    assert relative_error(r_d.get(), h) <= SPEC.tolerance
    assert relative_error(y.get(), want) <= SPEC.tolerance
    assert relative_error(y.get(), reference.rmsnorm_residual(x, r, gamma, EPS)[1]) > SPEC.tolerance
    assert relative_error(y.get(), reference.rmsnorm(x, gamma, eps)) > SPEC.tolerance


def test_post_residual_eps_and_each_gamma_matter(device, rng):
    """Both norms use eps, γ_post scales p before the add and γ_next the output: a kernel that skipped the
    post norm, swapped the two γ or ignored eps would fail. Rows of several work-groups' worth (K = 3000)."""
    rows, dim, eps = 2, 3000, 1e-2
    p = rng.standard_normal((rows, dim)).astype(np.float32) * 0.05   # small: eps changes the post norm
    x = rng.standard_normal((rows, dim)).astype(np.float32) * 0.05
    post, after = (rng.uniform(0.5, 1.5, dim).astype(np.float32) for _ in range(2))
    x_d, y = device.upload(x), device.poisoned((rows, dim), np.float32)
    p_d, post_d, after_d = device.upload(p), device.upload(post), device.upload(after)
    RMSNorm(device).post_residual(p_d, x_d, post_d, after_d, y, rows, dim, eps).wait()
    h, want = reference.rmsnorm_post_residual(p, x, post, after, eps)
    assert relative_error(x_d.get(), h) <= SPEC.tolerance
    assert relative_error(y.get(), want) <= SPEC.tolerance
    for wrong in (reference.rmsnorm_post_residual(p, x, post, after, EPS),   # eps ignored
                  reference.rmsnorm_post_residual(p, x, after, post, eps),   # γ swapped
                  reference.rmsnorm_residual(p, x, after, eps)):             # no post norm
        assert relative_error(y.get(), wrong[1]) > SPEC.tolerance


def test_poisoned_output_is_detected(device, rng):
    case = SPEC.make_case(device, SPEC.test_shapes[1], rng)
    y = case.run(SPEC.params.defaults())["y"]
    y[1, 5] = np.nan
    assert relative_error(y, case.expected["y"]) == float("inf")


def test_errors(device):
    norm = RMSNorm(device)
    x, y = device.empty((2, 64), np.float32), device.empty((2, 64), np.float32)
    gamma = device.empty(64, np.float32)
    with pytest.raises(PerfxError, match="rows = 0"):
        norm.plain(x, gamma, y, 0, 64, 1e-5)
    with pytest.raises(PerfxError, match="gamma holds 256 bytes where 512"):
        norm.plain(x, gamma, y, 1, 128, 1e-5)
    with pytest.raises(PerfxError, match="residual holds"):
        norm.residual(x, device.empty(64, np.float32), gamma, y, 2, 64, 1e-5)
    with pytest.raises(PerfxError, match="next_gamma holds 128 bytes where 256"):
        norm.post_residual(x, y, gamma, device.empty(32, np.float32), device.empty((2, 64), np.float32), 2, 64,
                           1e-5)
    with pytest.raises(PerfxError, match="dim = 0"):
        norm.post_residual(x, y, gamma, gamma, x, 1, 0, 1e-5)
    with pytest.raises(PerfxError, match="is not one of"):
        RMSNorm(device, {"WGS": 96})
    quantized = (device.empty(100, np.int8), device.empty((3, 2), np.float32))
    with pytest.raises(PerfxError, match="quantized per block of 32 needs dim a multiple of 32, not 100"):
        norm.plain(device.empty(100, np.float32), device.empty(100, np.float32), device.empty(100, np.float32), 1,
                   100, 1e-5, quantized=quantized)
    with pytest.raises(PerfxError, match="quantized y's steps and sums holds 24 bytes where 32"):
        norm.plain(x, gamma, y, 2, 64, 1e-5, quantized=(device.empty(128, np.int8), quantized[1]))
    with pytest.raises(PerfxError, match="the blocks' order is Q8_TEXEL or Q8_NATURAL, not 3"):
        norm.plain(x, gamma, y, 2, 64, 1e-5, quantized=(device.empty(128, np.int8), device.empty(8, np.float32)),
                   order=3)


def test_natural_blocks_are_the_int8_gemvs_own(device, rng):
    """The blocks a norm writes in x's own order are, byte for byte, those the int8 GEMV's quantizing launch
    makes of the norm's output, so an int8 GEMV reading them computes what it would have computed alone."""
    k = 640
    x = device.upload(rng.standard_normal(k, dtype=np.float32))
    gamma = device.upload(rng.uniform(0.5, 1.5, k).astype(np.float32))
    y = device.empty(k, np.float32)
    blocks = (device.empty(k, np.int8), device.empty((k // 32, 2), np.float32))
    RMSNorm(device).plain(x, gamma, y, 1, k, EPS, quantized=blocks, order=Q8_NATURAL).wait()
    events, (codes, steps) = GemvQ8(device, {"I8": 1}).quantize(y.data, k, 32)
    events[-1].wait()
    assert np.array_equal(blocks[0].get(), device.read(np.empty(k, np.int8), codes))
    assert np.array_equal(blocks[1].get(), device.read(np.empty((k // 32, 2), np.float32), steps))
    assert np.abs(blocks[0].get()).max() == 127
