"""The float64 references against plain loops on small inputs: the truth must be right too."""

import math

import numpy as np
import pytest

from perfx import reference as ref


def test_rmsnorm_residual_matches_a_loop(rng):
    x, r, g = rng.standard_normal(7), rng.standard_normal(7), rng.standard_normal(7)
    h, y = ref.rmsnorm_residual(x, r, g, eps=1e-5)
    hh = [x[i] + r[i] for i in range(7)]
    rms = math.sqrt(sum(v * v for v in hh) / 7 + 1e-5)
    np.testing.assert_allclose(h, hh, rtol=1e-15)
    np.testing.assert_allclose(y, [hh[i] / rms * g[i] for i in range(7)], rtol=1e-13)


def test_rmsnorm_post_residual_matches_a_loop(rng):
    p, x, gp, gn = (rng.standard_normal(7) for _ in range(4))
    h, y = ref.rmsnorm_post_residual(p, x, gp, gn, eps=1e-6)
    rms_p = math.sqrt(sum(v * v for v in p) / 7 + 1e-6)
    hh = [x[i] + p[i] / rms_p * gp[i] for i in range(7)]
    rms_h = math.sqrt(sum(v * v for v in hh) / 7 + 1e-6)
    np.testing.assert_allclose(h, hh, rtol=1e-13)
    np.testing.assert_allclose(y, [hh[i] / rms_h * gn[i] for i in range(7)], rtol=1e-13)


def test_gelu_tanh_geglu_and_softcap(rng):
    g, u = rng.standard_normal(6) * 3, rng.standard_normal(6)
    loop = [0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3))) for v in g]
    np.testing.assert_allclose(ref.gelu_tanh(g), loop, rtol=1e-13)
    np.testing.assert_allclose(ref.geglu(g, u), [loop[i] * u[i] for i in range(6)], rtol=1e-13)
    # within 1e-3 of the exact GELU, x·Φ(x) (the approximation's known accuracy), and not SiLU
    exact = [v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in g]
    np.testing.assert_allclose(ref.gelu_tanh(g), exact, atol=1e-3)
    assert np.max(np.abs(ref.gelu_tanh(g) - ref.silu(g))) > 1e-2
    # float32's extremes: the tails are x and 0, never inf or NaN
    x = np.array([-3.4e38, -1e20, -30.0, 30.0, 1e20, 3.4e38], np.float32)
    np.testing.assert_allclose(ref.gelu_tanh(x), [0, 0, 0, 30, 1e20, 3.4e38], rtol=1e-7)
    np.testing.assert_allclose(ref.softcap([-1e6, -3.0, 0.0, 30.0, 1e6], 30.0),
                               [-30.0, 30 * math.tanh(-0.1), 0.0, 30 * math.tanh(1.0), 30.0], rtol=1e-15)


def test_gemv_and_gemm_match_loops(rng):
    w, x, b = rng.standard_normal((5, 3)), rng.standard_normal((4, 3)), rng.standard_normal(5)
    loop = [[sum(x[m, k] * w[n, k] for k in range(3)) + b[n] for n in range(5)] for m in range(4)]
    np.testing.assert_allclose(ref.gemm(x, w, b), loop, rtol=1e-13)
    np.testing.assert_allclose(ref.gemv(w, x[1], b), loop[1], rtol=1e-13)


def test_swiglu_softmax_silu(rng):
    g, u = rng.standard_normal(6), rng.standard_normal(6)
    np.testing.assert_allclose(ref.swiglu(g, u), [g[i] / (1 + math.exp(-g[i])) * u[i] for i in range(6)], rtol=1e-13)
    s = ref.softmax(g)
    total = sum(math.exp(v) for v in g)
    np.testing.assert_allclose(s, [math.exp(v) / total for v in g], rtol=1e-13)


def test_rope_rotate_half_matches_a_loop(rng):
    m, heads, d, theta = 3, 2, 8, 10000.0
    x = rng.standard_normal((m, heads, d))
    positions = [0, 5, 17]
    out = ref.rope(x, positions, theta)
    for i, p in enumerate(positions):
        for h in range(heads):
            for j in range(d // 2):
                angle = p * theta ** (-2 * j / d)
                a, b = x[i, h, j], x[i, h, j + d // 2]
                assert out[i, h, j] == pytest.approx(a * math.cos(angle) - b * math.sin(angle), rel=1e-12, abs=1e-14)
                assert out[i, h, j + d // 2] == pytest.approx(b * math.cos(angle) + a * math.sin(angle), rel=1e-12,
                                                              abs=1e-14)


@pytest.mark.parametrize("d, n_rot", [(8, 4), (12, 8), (8, 8)])
def test_partial_rope_rotates_the_first_dimensions_only(rng, d, n_rot):
    """Partial rotary (HF partial_rotary_factor, llama.cpp NEOX with n_rot < head_dim): pairs (i, i + n_rot/2)
    at frequencies θ^(−2i/n_rot); dimensions from n_rot on pass unchanged."""
    m, heads, theta = 2, 3, 10000.0
    x = rng.standard_normal((m, heads, d))
    positions = [3, 11]
    out = ref.rope(x, positions, theta, rotary_dims=n_rot)
    half = n_rot // 2
    for i, p in enumerate(positions):
        for h in range(heads):
            for j in range(half):
                angle = p * theta ** (-2 * j / n_rot)
                a, b = x[i, h, j], x[i, h, j + half]
                want = (a * math.cos(angle) - b * math.sin(angle), b * math.cos(angle) + a * math.sin(angle))
                assert (out[i, h, j], out[i, h, j + half]) == pytest.approx(want, rel=1e-12, abs=1e-14)
    np.testing.assert_array_equal(out[..., n_rot:], x[..., n_rot:])


def test_gguf_permutation_turns_interleaved_rope_into_rotate_half(rng):
    # llama.cpp applies RoPE to pairs (2i, 2i+1) on GGUF-permuted Wq rows; perfx un-permutes and uses
    # rotate-half pairs (i, i + D/2). Both must give the same rotated q up to the row order.
    heads, d, k = 2, 8, 5
    w = rng.standard_normal((heads * d, k))
    x = rng.standard_normal(k)
    q_hf = (w @ x).reshape(1, heads, d)
    q_gguf = (ref.permute_qk(w, heads) @ x).reshape(heads, d)
    np.testing.assert_array_equal(ref.unpermute_qk(ref.permute_qk(w, heads), heads), w)
    pos, theta = 7, 10000.0
    rotated = ref.rope(q_hf, [pos], theta)[0]
    inter = np.empty_like(q_gguf)
    for i in range(d // 2):
        angle = pos * theta ** (-2 * i / d)
        a, b = q_gguf[:, 2 * i], q_gguf[:, 2 * i + 1]
        inter[:, 2 * i] = a * math.cos(angle) - b * math.sin(angle)
        inter[:, 2 * i + 1] = b * math.cos(angle) + a * math.sin(angle)
    np.testing.assert_allclose(ref.unpermute_qk(inter.reshape(heads * d, 1), heads).reshape(heads, d), rotated,
                               rtol=1e-12, atol=1e-12)


def test_llama3_rope_scaling_keeps_high_and_scales_low_frequencies():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    plain, scaled = ref.rope_inv_freq(128, 500000.0), ref.rope_inv_freq(128, 500000.0, scaling)
    assert scaled[0] == plain[0]                       # short wavelength: kept
    assert scaled[-1] == pytest.approx(plain[-1] / 8)  # long wavelength: divided by factor
    assert np.all(scaled <= plain)
    with pytest.raises(ValueError, match="rope_scaling type 'dynamic' is not supported"):
        ref.rope_inv_freq(64, 1e4, {"type": "dynamic", "factor": 2})


@pytest.mark.parametrize("h, hkv", [(4, 4), (6, 2), (8, 2)])
def test_attention_matches_a_loop_with_gqa_and_causality(rng, h, hkv):
    m, t, d = 3, 5, 4
    q, k, v = rng.standard_normal((m, h, d)), rng.standard_normal((t, hkv, d)), rng.standard_normal((t, hkv, d))
    positions = [2, 3, 4]
    out = ref.attention(q, k, v, positions)
    for i, p in enumerate(positions):
        for head in range(h):
            kv = head // (h // hkv)
            scores = [sum(q[i, head, c] * k[j, kv, c] for c in range(d)) / math.sqrt(d) for j in range(p + 1)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            want = [sum(weights[j] * v[j, kv, c] for j in range(p + 1)) / total for c in range(d)]
            np.testing.assert_allclose(out[i, head], want, rtol=1e-12)


def test_attention_scale_and_softcap_match_a_loop(rng):
    """s = q·k·scale, then Gemma 2's soft-cap c·tanh(s/c), then the causal softmax."""
    m, t, h, hkv, d, scale, cap = 2, 4, 2, 1, 4, 0.7, 1.3
    q, k, v = rng.standard_normal((m, h, d)), rng.standard_normal((t, hkv, d)), rng.standard_normal((t, hkv, d))
    positions = [2, 3]
    out = ref.attention(q, k, v, positions, scale=scale, softcap=cap)
    for i, p in enumerate(positions):
        for head in range(h):
            scores = [cap * math.tanh(sum(q[i, head, c] * k[j, 0, c] for c in range(d)) * scale / cap)
                      for j in range(p + 1)]
            weights = [math.exp(s - max(scores)) for s in scores]
            want = [sum(weights[j] * v[j, 0, c] for j in range(p + 1)) / sum(weights) for c in range(d)]
            np.testing.assert_allclose(out[i, head], want, rtol=1e-12)
    np.testing.assert_allclose(ref.attention(q, k, v, positions, scale=d ** -0.5),
                               ref.attention(q, k, v, positions), rtol=1e-14)
