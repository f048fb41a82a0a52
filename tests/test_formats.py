"""4-bit formats: AWQ packing (golden value and round trips), GGUF blocks against the gguf package,
the device texel layout, and the errors for unsupported group sizes and bit widths."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from perfx import reference
from perfx.errors import PerfxError
from perfx.formats import (Q4Matrix, check_bits, from_awq_gemm, from_awq_gemv,
                           from_gguf_q4_0, from_gguf_q4_1, pack_scale_offset, pack_texels, row_splits,
                           to_awq_gemm, to_awq_gemv, unpack_texels)


def test_awq_gemm_golden_value():
    # Codes 0..7 in columns 0..7 of one row: AWQ's nibble order [0,2,4,6,1,3,5,7] packs them to 0x75316420.
    codes = np.arange(8, dtype=np.uint8).reshape(8, 1)  # output n (of N = 8) has code n; K = 1
    qweight, _, _ = to_awq_gemm(codes, np.zeros((8, 1), np.uint8), np.ones((8, 1), np.float16))
    assert qweight.shape == (1, 1)
    assert int(qweight.view(np.uint32)[0, 0]) == 0x75316420


def _random_awq_parts(rng, n, k, group):
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    zeros = rng.integers(0, 16, (n, k // group), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.02, (n, k // group)).astype(np.float16)
    return codes, zeros, scales


@pytest.mark.parametrize("n, k, group", [(8, 32, 32), (24, 128, 64), (40, 384, 128), (16, 4160, 64)])
def test_awq_gemm_round_trip(rng, n, k, group):
    codes, zeros, scales = _random_awq_parts(rng, n, k, group)
    qweight, qzeros, s = to_awq_gemm(codes, zeros, scales)
    assert qweight.shape == (k, n // 8) and qzeros.shape == (k // group, n // 8) and s.shape == (k // group, n)
    q4 = from_awq_gemm(qweight, qzeros, s, group)
    assert np.array_equal(q4.codes, codes) and np.array_equal(q4.scales, scales)
    # AWQ: w = (q − z)·s; the device form's fp16 offset m = −z·s costs at most half an fp16 ulp of m.
    awq = (codes.astype(np.float64) - np.repeat(zeros, group, 1)) * np.repeat(scales.astype(np.float64), group, 1)
    assert np.max(np.abs(q4.dequantize() - awq)) <= np.max(np.abs(awq)) * 2.0**-11


@pytest.mark.parametrize("n, k, group", [(8, 64, 32), (16, 256, 64), (8, 1024, 128), (8, 96, 32)])
def test_awq_gemv_round_trip(rng, n, k, group):
    codes, zeros, scales = _random_awq_parts(rng, n, k, group)
    qweight, qzeros, s = to_awq_gemv(codes, zeros, scales)
    assert qweight.shape == (n, k // 8)
    q4 = from_awq_gemv(qweight, qzeros, s, group)
    assert np.array_equal(q4.codes, codes) and np.array_equal(q4.scales, scales)
    assert np.allclose(q4.offsets.astype(np.float32), -zeros.astype(np.float32) * scales.astype(np.float32),
                       rtol=2.0**-10)


def test_awq_gemv_packs_sequentially():
    codes = np.tile(np.arange(8, dtype=np.uint8), (8, 4))  # (8, 32)
    qweight, _, _ = to_awq_gemv(codes, np.zeros((8, 1), np.uint8), np.ones((8, 1), np.float16))
    assert int(qweight.view(np.uint32)[0, 0]) == 0x76543210


@pytest.mark.parametrize("n, k", [(3, 32), (5, 96), (2, 256)])
def test_gguf_q4_0_matches_the_gguf_package(rng, n, k):
    """Blocks quantized by gguf.quants (llama.cpp's reference): w = d·(q − 8) exactly as gguf dequantizes."""
    raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType.Q4_0)
    q4 = from_gguf_q4_0(raw, n, k)
    theirs = quants.dequantize(raw, GGMLQuantizationType.Q4_0)
    np.testing.assert_array_equal(q4.dequantize().astype(np.float32), theirs.astype(np.float32))
    assert q4.codes.max() <= 15 and q4.group == 32


@pytest.mark.parametrize("n, k", [(3, 32), (4, 160)])
def test_gguf_q4_1_matches_the_gguf_package(rng, n, k):
    raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType.Q4_1)
    q4 = from_gguf_q4_1(raw, n, k)
    theirs = quants.dequantize(raw, GGMLQuantizationType.Q4_1)
    # gguf computes d·q + m in float32; ours is float64 of the same fp16 values.
    np.testing.assert_allclose(q4.dequantize(), theirs, rtol=1e-6, atol=1e-7)


def test_truncated_gguf_tensor_is_a_clear_error():
    with pytest.raises(PerfxError, match=r"blk.0.attn_q.weight: 36 bytes where \(2, 32\) needs 40"):
        from_gguf_q4_1(b"\0" * 36, 2, 32, "blk.0.attn_q.weight")


@pytest.mark.parametrize("n, k", [(1, 32), (7, 96), (33, 4160)])
def test_texel_layout_round_trip_and_bit_positions(rng, n, k):
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    texels = pack_texels(codes)
    assert texels.shape == (n, k // 32, 4) and texels.dtype == np.uint32
    assert np.array_equal(unpack_texels(texels), codes)
    # code 32t + 8c + j lives in component c at bits 4j..4j+3
    t, c, j = (k // 32) - 1, 2, 5
    assert (int(texels[0, t, c]) >> (4 * j)) & 0xF == codes[0, 32 * t + 8 * c + j]


def test_scale_offset_pairs_and_row_splits():
    s = np.array([[1, 2]], np.float16)
    m = np.array([[3, 4]], np.float16)
    assert pack_scale_offset(s, m).tolist() == [[[1, 3], [2, 4]]]
    assert row_splits(1000, 256) == [(0, 256), (256, 512), (512, 768), (768, 1000)]


def test_quantize_round_to_nearest_is_within_half_a_step(rng):
    w = rng.standard_normal((16, 256)).astype(np.float32)
    q4 = Q4Matrix.quantize(w, 64)
    step = np.repeat(q4.scales.astype(np.float64), 64, axis=1)
    # half a step, plus the fp16 rounding of the offset (the group minimum)
    assert np.all(np.abs(q4.dequantize() - w) <= 0.5 * step + np.abs(w) * 2.0**-10 + 1e-6)


def test_concat_stacks_rows(rng):
    a, b = Q4Matrix.random(8, 64, 32, rng), Q4Matrix.random(4, 64, 32, rng)
    fused = Q4Matrix.concat([a, b])
    assert fused.shape == (12, 64)
    np.testing.assert_array_equal(fused.dequantize()[8:], b.dequantize())
    with pytest.raises(PerfxError, match="cannot fuse"):
        Q4Matrix.concat([a, Q4Matrix.random(4, 128, 32, rng)])


def test_group_size_must_divide_k():
    with pytest.raises(PerfxError, match="group size 64 does not divide K = 96"):
        Q4Matrix.quantize(np.ones((2, 96), np.float32), 64)
    with pytest.raises(PerfxError, match="group size 48 is not supported"):
        Q4Matrix.quantize(np.ones((2, 96), np.float32), 48)


def test_bits_other_than_4_are_refused():
    with pytest.raises(PerfxError, match="8-bit weights are not supported here"):
        check_bits(8, "model.layers.0.q_proj")
    check_bits(4)


def test_dequantize_reference_matches_a_plain_loop(rng):
    q4 = Q4Matrix.random(3, 64, 32, rng)
    loop = np.empty((3, 64))
    for r in range(3):
        for c in range(64):
            loop[r, c] = float(q4.scales[r, c // 32]) * q4.codes[r, c] + float(q4.offsets[r, c // 32])
    np.testing.assert_allclose(reference.dequantize_q4(q4.codes, q4.scales, q4.offsets, 32), loop, rtol=1e-15)
