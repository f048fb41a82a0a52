"""Weight formats: AWQ packing (golden value and round trips), every GGUF block type against the gguf
package (llama.cpp's definition), the int8 form (quantize, regroup, fuse), the device texel layout, and the
errors for unsupported group sizes, bit widths and truncated tensors."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from perfx import reference
from perfx.errors import PerfxError
from helpers.kquants import quantize_k, random_k_blocks
from perfx.formats import (GGUF_READERS, Q4_PAIRS, Q4_SYMMETRIC, Q4_ZEROS, Q4Matrix, Q8Matrix, check_bits,
                           describe_q4_form, from_awq_gemm, from_awq_gemv, from_gguf_q4_0, from_gguf_q4_1,
                           from_gguf_q4_k, pack_group_scales, pack_scale_offset, pack_texels, row_splits,
                           to_awq_gemm, to_awq_gemv, unpack_texels)
from perfx.formats import MXFP4_VALUES, mxfp4_arrays, mxfp4_scales


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
    # AWQ: w = (q − z)·s, held as it is: the scales and the zero points (exact)
    assert q4.form == Q4_ZEROS and np.array_equal(q4.zeros, zeros)
    awq = (codes.astype(np.float64) - np.repeat(zeros, group, 1)) * np.repeat(scales.astype(np.float64), group, 1)
    np.testing.assert_array_equal(q4.dequantize(), awq)
    assert q4.nbytes == n * k // 2 + 2 * n * (k // group) + -(-n * (k // group) // 2)


@pytest.mark.parametrize("n, k, group", [(8, 64, 32), (16, 256, 64), (8, 1024, 128), (8, 96, 32)])
def test_awq_gemv_round_trip(rng, n, k, group):
    codes, zeros, scales = _random_awq_parts(rng, n, k, group)
    qweight, qzeros, s = to_awq_gemv(codes, zeros, scales)
    assert qweight.shape == (n, k // 8)
    q4 = from_awq_gemv(qweight, qzeros, s, group)
    assert np.array_equal(q4.codes, codes) and np.array_equal(q4.scales, scales)
    assert q4.form == Q4_ZEROS and np.array_equal(q4.zeros, zeros)
    # m = −s·z as the kernels form it: exact in float32
    np.testing.assert_array_equal(q4.offsets, -zeros.astype(np.float32) * scales.astype(np.float32))


def test_awq_shapes_that_disagree_are_clear_errors(rng):
    codes, zeros, scales = _random_awq_parts(rng, 16, 128, 64)
    qweight, qzeros, s = to_awq_gemm(codes, zeros, scales)
    with pytest.raises(PerfxError, match=r"AWQ GEMM shapes disagree.*expected qzeros \(2, 2\)"):
        from_awq_gemm(qweight, qzeros[:1], s, 64)
    with pytest.raises(PerfxError, match=r"zero points \(16, 1\) do not match codes \(16, 128\) with group 64"):
        Q4Matrix.with_zeros(codes, scales, zeros[:, :1], 64)
    with pytest.raises(PerfxError, match=r"zero points must be 4-bit integers in \[0, 15\], got \[0, 16\]"):
        Q4Matrix.with_zeros(codes, scales, np.where(zeros == zeros.max(), 16, zeros), 64)
    with pytest.raises(PerfxError, match="has no zero-point tensor"):
        Q4Matrix(codes, scales, scales, 64, zeros)


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
    # the scale alone (z = 8 implied), 2 bytes a group: the same weights as the pairs (d, −8·d) it replaces
    assert q4.form == Q4_SYMMETRIC and q4.nbytes == n * k // 2 + 2 * n * (k // 32)
    pairs = Q4Matrix(q4.codes, q4.scales, (-8 * q4.scales.astype(np.float32)).astype(np.float16), 32)
    np.testing.assert_array_equal(q4.dequantize(), pairs.dequantize())


@pytest.mark.parametrize("n, k", [(3, 32), (4, 160)])
def test_gguf_q4_1_matches_the_gguf_package(rng, n, k):
    raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType.Q4_1)
    q4 = from_gguf_q4_1(raw, n, k)
    theirs = quants.dequantize(raw, GGMLQuantizationType.Q4_1)
    # gguf computes d·q + m in float32; ours is float64 of the same fp16 values.
    np.testing.assert_allclose(q4.dequantize(), theirs, rtol=1e-6, atol=1e-7)
    assert q4.form == Q4_PAIRS   # min is no multiple of d: no zero point holds it


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


def test_group_scales_bytes_follow_the_layout(rng):
    """pack_group_scales: pairs as pack_scale_offset; the zero-point form's fp16 scales, then its zeros two a
    byte (the even index in the low nibble), both in the layout's group order (3 × 3 groups: an odd count)."""
    codes = rng.integers(0, 16, (3, 96), dtype=np.uint8)
    scales = rng.uniform(0.5, 2, (3, 3)).astype(np.float16)
    zeros = rng.integers(0, 16, (3, 3), dtype=np.uint8)
    q4 = Q4Matrix.with_zeros(codes, scales, zeros, 32)
    for interleaved, order in ((False, lambda a: a), (True, lambda a: a.T)):
        raw = pack_group_scales(q4, interleaved)
        assert raw.nbytes == 9 * 2 + 5 == q4.nbytes - 3 * 96 // 2
        np.testing.assert_array_equal(raw[:18].view(np.float16), order(scales).reshape(-1))
        z = order(zeros).reshape(-1)
        assert [(raw[18 + i // 2] >> (4 * (i % 2))) & 0xF for i in range(9)] == z.tolist()
        assert raw[22] >> 4 == 0
    symmetric = Q4Matrix.symmetric(codes, scales, 32)
    np.testing.assert_array_equal(pack_group_scales(symmetric, True).view(np.float16), scales.T.reshape(-1))
    pairs = q4.as_pairs()
    assert pairs.form == Q4_PAIRS
    np.testing.assert_array_equal(pack_group_scales(pairs).view(np.float16).reshape(3, 3, 2),
                                  pack_scale_offset(pairs.scales, pairs.offsets))
    assert describe_q4_form(Q4_ZEROS, 128) == "int4 g128, 2.5 bytes a group (fp16 scale + 4-bit zero)"
    assert describe_q4_form(Q4_SYMMETRIC, 32) == "int4 g32, 2 bytes a group (fp16 scale, zero 8)"
    assert describe_q4_form(Q4_PAIRS, 32) == "int4 g32, 4 bytes a group (fp16 scale + fp16 offset)"


def test_zero_point_forms_fuse_regroup_and_take_rows(rng):
    """concat keeps a shared form (zeros beside symmetric parts become zeros, z = 8; a pairs part makes pairs),
    regroup repeats each zero, take_rows moves them with their rows: all exact."""
    zeros = Q4Matrix.random(8, 128, 64, rng, form=Q4_ZEROS)
    symmetric = Q4Matrix.random(4, 128, 64, rng, form=Q4_SYMMETRIC)
    pairs = Q4Matrix.random(4, 128, 64, rng)
    mixed = Q4Matrix.concat([zeros, symmetric])
    assert mixed.form == Q4_ZEROS and (mixed.zeros[8:] == 8).all()
    assert Q4Matrix.concat([symmetric, symmetric]).form == Q4_SYMMETRIC
    assert Q4Matrix.concat([zeros, pairs]).form == Q4_PAIRS
    for fused in (mixed, Q4Matrix.concat([symmetric, pairs])):
        np.testing.assert_array_equal(fused.rows(0, 8).dequantize()[:4], fused.dequantize()[:4])
    np.testing.assert_array_equal(mixed.dequantize(), np.concatenate([zeros.dequantize(), symmetric.dequantize()]))
    np.testing.assert_array_equal(zeros.regroup(32).dequantize(), zeros.dequantize())
    index = rng.permutation(8)
    np.testing.assert_array_equal(zeros.take_rows(index).dequantize(), zeros.dequantize()[index])
    q8 = Q8Matrix.from_q4(zeros)
    assert q8.f32 and np.array_equal(q8.dequantize(), zeros.dequantize())


def test_quantize_with_zero_points_is_within_half_a_step(rng):
    w = rng.standard_normal((16, 256)).astype(np.float32)
    q4 = Q4Matrix.quantize(w, 128, zeros=True)
    assert q4.form == Q4_ZEROS
    step = np.repeat(q4.scales.astype(np.float64), 128, axis=1)
    # half a step (the zero point rounds too: z = rint(−min/s) moves the grid by up to s/2, which the
    # clipped codes at the ends absorb to within one step), with the fp16 rounding of s over 15 steps
    assert np.all(np.abs(q4.dequantize() - w) <= step + 15 * step * 2.0**-11)


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


# -- every other GGUF type, against gguf.quants.dequantize ------------------------------------------


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q8_0"])
def test_gguf_32_weight_blocks_read_exactly_into_the_int8_form(rng, kind):
    """Blocks quantized by gguf.quants: the int8 form holds them exactly in fp16, Q8_0's and Q5_0's as their
    scales alone (every offset 0), Q5_1's as (s, m) pairs."""
    n, k = 5, 256
    raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[kind])
    q8 = GGUF_READERS[kind](raw, n, k, "t")
    theirs = quants.dequantize(raw, GGMLQuantizationType[kind]).astype(np.float64)
    assert isinstance(q8, Q8Matrix) and q8.group == 32 and not q8.f32
    assert q8.symmetric == (kind != "Q5_1") and q8.nbytes == n * k + (4 if kind == "Q5_1" else 2) * n * k // 32
    # Q5_1's d·q + m is rounded to float32 by gguf (one rounding); Q8_0 and Q5_0's d·q are exact there.
    np.testing.assert_allclose(q8.dequantize(), theirs, rtol=0, atol=2.0**-24 * np.abs(theirs).max())
    if kind != "Q5_1":
        np.testing.assert_array_equal(q8.dequantize(), theirs)
    lo, hi = {"Q5_0": (-16, 15), "Q5_1": (0, 31), "Q8_0": (-127, 127)}[kind]
    assert lo <= q8.codes.min() and q8.codes.max() <= hi


@pytest.mark.parametrize("kind", ["Q5_K", "Q6_K"])
@pytest.mark.parametrize("blocks", ["random bits", "quantized"])
def test_gguf_k_quants_read_exactly_into_the_int8_form(rng, kind, blocks):
    """Q5_K (G = 32) and Q6_K (G = 16): s = d·sc is exact in float32, so the form holds every weight as
    gguf's float32 dequantization does (Q5_K's d·sc·q − dmin·mn rounds once in float32 there)."""
    n, k = 3, 512
    w = rng.standard_normal((n, k)).astype(np.float32)
    raw = random_k_blocks(kind, n, k, rng) if blocks == "random bits" else quantize_k(w, kind)
    q8 = GGUF_READERS[kind](raw, n, k, "t")
    theirs = quants.dequantize(raw, GGMLQuantizationType[kind]).astype(np.float64)
    assert isinstance(q8, Q8Matrix) and q8.f32 and q8.group == (32 if kind == "Q5_K" else 16)
    assert q8.symmetric == (kind == "Q6_K")   # Q6_K's float32 scales alone, 4 bytes a group of 16
    np.testing.assert_allclose(q8.dequantize(), theirs, rtol=0, atol=2.0**-24 * np.abs(theirs).max())
    assert q8.codes.min() >= (-32 if kind == "Q6_K" else 0) and q8.codes.max() <= 31
    if blocks == "quantized":   # the test quantizer is a real one: K-quant error, not noise
        assert np.max(np.abs(theirs - w)) < 0.3


@pytest.mark.parametrize("blocks", ["random bits", "quantized"])
def test_gguf_q4_k_reads_into_the_int4_form_within_fp16_rounding(rng, blocks):
    """Q4_K -> int4 form, G = 32: codes exact; s = d·sc and m = −dmin·mn rounded once to fp16, so each
    weight is within 2⁻¹¹·(15·s + |m|) of llama.cpp's float32 value (plus its own float32 rounding)."""
    n, k = 4, 512
    w = rng.standard_normal((n, k)).astype(np.float32)
    raw = random_k_blocks("Q4_K", n, k, rng) if blocks == "random bits" else quantize_k(w, "Q4_K")
    q4 = from_gguf_q4_k(raw, n, k, "t")
    theirs = quants.dequantize(raw, GGMLQuantizationType.Q4_K).astype(np.float64)
    assert isinstance(q4, Q4Matrix) and q4.group == 32 and q4.codes.max() <= 15
    s = np.repeat(q4.scales.astype(np.float64), 32, axis=1)
    m = np.repeat(np.abs(q4.offsets.astype(np.float64)), 32, axis=1)
    bound = 2.0**-11 * (15 * s + m) + 2.0**-24 * np.abs(theirs).max()
    assert np.all(np.abs(q4.dequantize() - theirs) <= bound)
    # the codes are exactly llama.cpp's: with every sub-block's scale 1 and min 0 the value is the code
    blocks_ = raw.view(np.uint8).reshape(-1, 144).copy()
    blocks_[:, 0:2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)   # d = 1
    blocks_[:, 2:4] = 0                                                  # dmin = 0
    blocks_[:, 4:16] = np.array([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1], np.uint8)   # sc = 1, mn = 0 for all 8
    codes = quants.dequantize(blocks_.reshape(raw.shape), GGMLQuantizationType.Q4_K)
    np.testing.assert_array_equal(q4.codes, codes)


@pytest.mark.parametrize("kind, block_bytes", [("Q4_K", 144), ("Q5_K", 176), ("Q6_K", 210), ("Q5_0", 22),
                                               ("Q5_1", 24), ("Q8_0", 34)])
def test_truncated_or_misshapen_blocks_are_clear_errors(kind, block_bytes):
    block = 256 if kind.endswith("_K") else 32
    with pytest.raises(PerfxError, match=rf"blk.3.ffn_down.weight: {2 * block_bytes - 1} bytes where "
                                         rf"\(2, {block}\) needs {2 * block_bytes}"):
        GGUF_READERS[kind](b"\0" * (2 * block_bytes - 1), 2, block, "blk.3.ffn_down.weight")
    if kind.endswith("_K"):
        with pytest.raises(PerfxError, match=r"row length 128 is not a multiple of the 256-weight block"):
            GGUF_READERS[kind](b"\0" * block_bytes, 2, 128, "t")


# -- the int8 form ---------------------------------------------------------------------------------


def test_q8_quantize_is_within_half_a_step_with_fp16_pairs(rng):
    w = (rng.standard_normal((24, 256)) * 0.05).astype(np.float16)
    q8 = Q8Matrix.quantize(w, 32)
    assert not q8.f32 and q8.codes.dtype == np.int8 and q8.nbytes == 24 * 256 + 4 * 24 * 8
    step = np.repeat(q8.scales.astype(np.float64), 32, axis=1)
    offset = np.repeat(np.abs(q8.offsets.astype(np.float64)), 32, axis=1)
    err = np.abs(q8.dequantize() - w.astype(np.float64))
    assert np.all(err <= 0.5 * step + 2.0**-11 * offset + 1e-9)
    # 8 bits: a few hundred times finer than the 4-bit form's steps on the same weights
    assert np.max(err) < np.max(np.abs(Q4Matrix.quantize(w, 32).dequantize() - w)) / 8


def test_q8_pairs_must_be_exact_in_fp16_unless_f32(rng):
    q8 = Q8Matrix.random(4, 64, 16, rng, f32=True)
    assert q8.group_values().dtype == np.float32 and q8.group_values().shape == (4, 4, 2)
    assert q8.nbytes == 4 * 64 + 8 * 4 * 4
    with pytest.raises(PerfxError, match="fp16 cannot represent exactly; make it with f32=True"):
        Q8Matrix(q8.codes, q8.scales, q8.offsets, 16, f32=False)


def test_symmetric_q8_holds_its_scales_alone_and_needs_zero_offsets(rng):
    """What the device reads of a symmetric matrix is (N, K/G) scales, 2 (fp16) or 4 (float32) bytes a group;
    a matrix with an offset cannot claim the form."""
    for f32, group_bytes in ((False, 2), (True, 4)):
        q8 = Q8Matrix.random(5, 64, 16, rng, f32=f32, symmetric=True)
        values = q8.group_values()
        assert values.shape == (5, 4) and values.dtype == (np.float32 if f32 else np.float16)
        np.testing.assert_array_equal(values.astype(np.float32), q8.scales)
        assert q8.group_bytes == group_bytes and q8.nbytes == 5 * 64 + group_bytes * 5 * 4
        assert not np.any(q8.offsets) and q8.rows(1, 3).symmetric and q8.regroup(16).symmetric
    asymmetric = Q8Matrix.random(5, 64, 16, rng)
    with pytest.raises(PerfxError, match="symmetric int8 matrix .* has nonzero offsets"):
        Q8Matrix(asymmetric.codes, asymmetric.scales, asymmetric.offsets, 16, symmetric=True)
    both = Q8Matrix.concat([q8, Q8Matrix.random(2, 64, 32, rng, symmetric=True)])
    assert both.symmetric and both.group == 16
    assert not Q8Matrix.concat([q8, asymmetric]).symmetric   # one part with offsets: pairs for all
    with pytest.raises(PerfxError, match=r"int8 group size 64 is not supported.*\(16, 32\)"):
        Q8Matrix.quantize(np.ones((2, 128), np.float32), 64)


def test_q4_in_the_int8_form_and_fusion_at_the_smallest_group(rng):
    """A Q4_K/Q4_0 part beside a Q6_K part: both exact in the int8 form at G = 16."""
    a = Q4Matrix.random(8, 64, 32, rng)
    b = Q8Matrix.random(4, 64, 16, rng, f32=True)
    c = Q8Matrix.random(6, 64, 32, rng)
    fused = Q8Matrix.concat([Q8Matrix.from_q4(a), b, c])
    assert fused.group == 16 and fused.f32 and fused.shape == (18, 64)
    np.testing.assert_array_equal(fused.dequantize(), np.concatenate([a.dequantize(), b.dequantize(),
                                                                      c.dequantize()]))
    assert not Q8Matrix.from_q4(a).f32      # fp16 s and m stay fp16 pairs
    np.testing.assert_array_equal(Q8Matrix.from_q4(Q4Matrix.random(2, 256, 128, rng)).group, 32)
    with pytest.raises(PerfxError, match="cannot regroup int8 groups of 16 into groups of 32"):
        b.regroup(32)


def test_mxfp4_in_the_file_s_bits_round_trips_every_code_and_exponent(rng):
    """The MXFP4 device arrays (nibbles, the even k low; E8M0 bytes) give back every weight of gguf-py's MXFP4
    dequantization, every nibble and all 256 exponents (the subnormal scales of e = 0, 1 too); a matrix whose codes
    or scales no MXFP4 block holds is refused, naming what is wrong."""
    n, k = 16, 512
    blocks = np.zeros((n, k // 32, 17), np.uint8)
    blocks[..., 0] = np.arange(n * k // 32).reshape(n, k // 32) % 256
    blocks[..., 1:] = rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8)
    raw = blocks.reshape(n, -1)
    w = GGUF_READERS["MXFP4"](raw, n, k)
    with np.errstate(over="ignore"):   # gguf-py's float32 products overflow to ±inf at the largest exponents
        want = quants.dequantize(raw, GGMLQuantizationType.MXFP4)
    nibbles, exponents = mxfp4_arrays(w)
    assert nibbles.shape == (n, k // 2) and exponents.shape == (n, k // 32)
    np.testing.assert_array_equal(exponents, blocks[..., 0])
    codes = np.stack([nibbles & 15, nibbles >> 4], axis=-1).reshape(n, k)
    got = MXFP4_VALUES[codes].astype(np.float64) * np.repeat(mxfp4_scales(exponents).astype(np.float64), 32, axis=1)
    with np.errstate(over="ignore"):   # as gguf-py's
        np.testing.assert_array_equal(got.astype(np.float32), want)
    bad = Q8Matrix(w.codes.copy(), w.scales, w.offsets, 32, f32=True, symmetric=True, mxfp4=True)
    bad.codes[0, 5] = 5
    with pytest.raises(PerfxError, match="no doubled e2m1 value"):
        mxfp4_arrays(bad)
    bad = Q8Matrix(w.codes, w.scales * 1.5, w.offsets, 32, f32=True, symmetric=True, mxfp4=True)
    with pytest.raises(PerfxError, match="no E8M0 power of two"):
        mxfp4_arrays(bad)
    with pytest.raises(PerfxError, match="groups of 32"):
        Q8Matrix(w.codes, np.repeat(w.scales, 2, axis=1), np.repeat(w.offsets, 2, axis=1), 16, f32=True,
                 symmetric=True, mxfp4=True)
