"""4-bit weight formats: one device form for every 4-bit source, and the exact readers that map onto it.

The device form (``Q4Matrix``): W (N, K) as codes q ∈ [0, 15] with one fp16 scale s and one fp16
offset m per group of G ∈ {32, 64, 128} along K, w = s·q + m.

- AWQ: w = (q − z)·s, so m = −z·s (rounded once to fp16: at most 2⁻¹² of 15·s, a small fraction of
  one quantization step).
- GGUF Q4_0: w = d·(q − 8), so s = d, m = −8·d (exact). Q4_1: w = d·q + min, so s = d, m = min (exact).

On the device the codes are rows contiguous along K, 32 codes per RGBA/UINT32 texel (``pack_texels``),
and (s, m) pairs interleaved as half2 per group (``pack_scale_offset``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfx.errors import PerfxError
from perfx.reference import dequantize_q4

GROUP_SIZES = (32, 64, 128)
CODES_PER_TEXEL = 32  # 4 components × 8 nibbles
AWQ_GEMM_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ GEMM int32 holds column AWQ_GEMM_ORDER[i]


def check_group(k: int, group: int, what: str = "weight"):
    if group not in GROUP_SIZES:
        raise PerfxError(f"{what}: group size {group} is not supported; perfx supports {GROUP_SIZES}")
    if k % group:
        raise PerfxError(f"{what}: group size {group} does not divide K = {k}; "
                         "K must be a multiple of the group size")


def check_bits(bits: int, what: str = "weight"):
    if bits != 4:
        raise PerfxError(f"{what}: {bits}-bit weights are not supported here; perfx's int4 kernels need "
                         "bits = 4 (re-quantize with group size 32, 64 or 128)")


@dataclass
class Q4Matrix:
    """W (N, K) in the device form: codes (N, K) uint8 in [0, 15]; scales, offsets (N, K/G) fp16."""

    codes: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray
    group: int

    def __post_init__(self):
        n, k = self.codes.shape
        check_group(k, self.group)
        expected = (n, k // self.group)
        if self.scales.shape != expected or self.offsets.shape != expected:
            raise PerfxError(f"scales {self.scales.shape} / offsets {self.offsets.shape} do not match "
                             f"codes {self.codes.shape} with group {self.group}: expected {expected}")
        self.codes = np.ascontiguousarray(self.codes, dtype=np.uint8)
        self.scales = np.ascontiguousarray(self.scales, dtype=np.float16)
        self.offsets = np.ascontiguousarray(self.offsets, dtype=np.float16)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads: 4 bits per weight plus fp16 scale and offset per group."""
        n, k = self.shape
        return n * k // 2 + 4 * n * (k // self.group)

    def dequantize(self) -> np.ndarray:
        return dequantize_q4(self.codes, self.scales, self.offsets, self.group)

    @classmethod
    def quantize(cls, w: np.ndarray, group: int = 128) -> Q4Matrix:
        """Round-to-nearest asymmetric quantization of W (N, K), for `--quantize q4` and for tests."""
        w = np.asarray(w, dtype=np.float32)
        n, k = w.shape
        check_group(k, group)
        blocks = w.reshape(n, k // group, group)
        low, high = blocks.min(axis=2), blocks.max(axis=2)
        scales = np.maximum((high - low) / 15.0, 1e-8).astype(np.float16)
        offsets = low.astype(np.float16)
        s32, m32 = scales.astype(np.float32)[..., None], offsets.astype(np.float32)[..., None]
        codes = np.clip(np.rint((blocks - m32) / s32), 0, 15).astype(np.uint8).reshape(n, k)
        return cls(codes, scales, offsets, group)

    @classmethod
    def random(cls, n: int, k: int, group: int, rng: np.random.Generator, scale: float = 0.02) -> Q4Matrix:
        """Random codes with scales ~ ``scale``/8 and offsets ≈ −8·s: weights of Llama-like size."""
        check_group(k, group)
        codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
        scales = (rng.uniform(0.5, 1.5, size=(n, k // group)) * scale / 8).astype(np.float16)
        offsets = (-8 * scales.astype(np.float32) * rng.uniform(0.8, 1.2, size=scales.shape)).astype(np.float16)
        return cls(codes, scales, offsets, group)

    @staticmethod
    def concat(parts: list[Q4Matrix]) -> Q4Matrix:
        """Stack matrices along N (fused QKV, gate-up): done once at load time."""
        groups = {p.group for p in parts}
        ks = {p.shape[1] for p in parts}
        if len(groups) != 1 or len(ks) != 1:
            raise PerfxError(f"cannot fuse matrices with different K {sorted(ks)} or groups {sorted(groups)}")
        return Q4Matrix(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                        np.concatenate([p.offsets for p in parts]), groups.pop())

    def rows(self, start: int, stop: int) -> Q4Matrix:
        return Q4Matrix(self.codes[start:stop], self.scales[start:stop], self.offsets[start:stop], self.group)


# ---------------------------------------------------------------------------------------------
# Device layout


def pack_texels(codes: np.ndarray) -> np.ndarray:
    """codes (N, K) -> uint32 texels (N, K/32, 4): code 32·t + 8·c + j in component c, bits 4j..4j+3.

    A kernel unpacks 4 codes at once with ``(texel >> 4j) & 0xF`` (codes 8c + j, c = 0..3).
    """
    codes = np.asarray(codes, dtype=np.uint32)
    n, k = codes.shape
    if k % CODES_PER_TEXEL:
        raise PerfxError(f"K = {k} is not a multiple of {CODES_PER_TEXEL}")
    nibbles = codes.reshape(n, k // 32, 4, 8)
    shifts = (4 * np.arange(8, dtype=np.uint32))
    return np.bitwise_or.reduce(nibbles << shifts, axis=3).astype(np.uint32)


def unpack_texels(texels: np.ndarray) -> np.ndarray:
    """Inverse of ``pack_texels``."""
    texels = np.asarray(texels, dtype=np.uint32)
    n, t, _ = texels.shape
    shifts = (4 * np.arange(8, dtype=np.uint32))
    return ((texels[..., None] >> shifts) & 0xF).astype(np.uint8).reshape(n, t * 32)


def pack_scale_offset(scales: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(N, K/G) scales and offsets -> (N, K/G, 2) fp16: one 32-bit (s, m) load per group."""
    return np.ascontiguousarray(np.stack([scales, offsets], axis=-1).astype(np.float16))


def row_splits(n: int, max_rows: int) -> list[tuple[int, int]]:
    """Row ranges [start, stop) of at most ``max_rows`` each: how N is split over several images."""
    if max_rows <= 0:
        raise ValueError("max_rows must be positive")
    return [(start, min(start + max_rows, n)) for start in range(0, n, max_rows)]


# ---------------------------------------------------------------------------------------------
# AWQ


def _unpack_int32_nibbles(packed: np.ndarray, order) -> np.ndarray:
    """(R, C) int32 -> (R, 8·C) uint8, nibble i of each word going to column order[i] of its 8."""
    words = np.asarray(packed).astype(np.uint32)
    r, c = words.shape
    out = np.empty((r, c, 8), dtype=np.uint8)
    for i, column in enumerate(order):
        out[:, :, column] = (words >> np.uint32(4 * i)) & 0xF
    return out.reshape(r, 8 * c)


def _pack_int32_nibbles(values: np.ndarray, order) -> np.ndarray:
    values = np.asarray(values).astype(np.uint32)
    r, c8 = values.shape
    if c8 % 8:
        raise PerfxError(f"AWQ packs 8 codes per int32: {c8} is not a multiple of 8")
    v = values.reshape(r, c8 // 8, 8)
    words = np.zeros((r, c8 // 8), dtype=np.uint32)
    for i, column in enumerate(order):
        words |= (v[:, :, column] & 0xF) << np.uint32(4 * i)
    return words.view(np.int32)


def from_awq_gemm(qweight, qzeros, scales, group: int) -> Q4Matrix:
    """AutoAWQ GEMM tensors of a Linear(K -> N): qweight (K, N/8), qzeros (K/G, N/8), scales (K/G, N)."""
    qweight, qzeros, scales = np.asarray(qweight), np.asarray(qzeros), np.asarray(scales)
    k = qweight.shape[0]
    n = qweight.shape[1] * 8
    check_group(k, group, "AWQ qweight")
    if qzeros.shape != (k // group, n // 8) or scales.shape != (k // group, n):
        raise PerfxError(f"AWQ GEMM shapes disagree: qweight {qweight.shape}, qzeros {qzeros.shape}, "
                         f"scales {scales.shape}; expected qzeros {(k // group, n // 8)}, scales {(k // group, n)} "
                         f"for group {group}")
    codes = _unpack_int32_nibbles(qweight, AWQ_GEMM_ORDER).T          # (N, K)
    zeros = _unpack_int32_nibbles(qzeros, AWQ_GEMM_ORDER).T.astype(np.float32)  # (N, K/G)
    s = scales.T.astype(np.float16)
    return Q4Matrix(codes, s, (-zeros * s.astype(np.float32)).astype(np.float16), group)


def to_awq_gemm(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray):
    """Pack (N, K) codes, (N, K/G) integer zeros and fp16 scales as AutoAWQ GEMM: the tests' checkpoint writer."""
    codes, zeros = np.asarray(codes), np.asarray(zeros)
    qweight = _pack_int32_nibbles(codes.T, AWQ_GEMM_ORDER)
    qzeros = _pack_int32_nibbles(zeros.T, AWQ_GEMM_ORDER)
    return qweight, qzeros, np.ascontiguousarray(np.asarray(scales, dtype=np.float16).T)


def awq_zeros_width(k: int, group: int) -> int:
    """AutoAWQ's ``calculate_zeros_width``: int32 columns of qzeros in the GEMV layout (padded)."""
    multiplier = {32: 4, 64: 2}.get(group, 1)
    base = -(-(k // group) // 8)
    return -(-base // multiplier) * multiplier


def from_awq_gemv(qweight, qzeros, scales, group: int) -> Q4Matrix:
    """AutoAWQ GEMV tensors: qweight (N, K/8) packed along K in order; qzeros (N, W), scales (N, 8·W) padded."""
    qweight, qzeros, scales = np.asarray(qweight), np.asarray(qzeros), np.asarray(scales)
    n, k = qweight.shape[0], qweight.shape[1] * 8
    check_group(k, group, "AWQ qweight")
    width = awq_zeros_width(k, group)
    if qzeros.shape != (n, width) or scales.shape != (n, 8 * width):
        raise PerfxError(f"AWQ GEMV shapes disagree: qweight {qweight.shape}, qzeros {qzeros.shape}, "
                         f"scales {scales.shape}; expected qzeros {(n, width)}, scales {(n, 8 * width)}")
    sequential = tuple(range(8))
    codes = _unpack_int32_nibbles(qweight, sequential)
    zeros = _unpack_int32_nibbles(qzeros, sequential)[:, : k // group].astype(np.float32)
    s = scales[:, : k // group].astype(np.float16)
    return Q4Matrix(codes, s, (-zeros * s.astype(np.float32)).astype(np.float16), group)


def to_awq_gemv(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray):
    """Pack as AutoAWQ GEMV (with its zero-padding of qzeros and scales)."""
    codes, zeros = np.asarray(codes), np.asarray(zeros)
    n, k = codes.shape
    group = k // zeros.shape[1]
    width = awq_zeros_width(k, group)
    padded_zeros = np.zeros((n, 8 * width), dtype=np.uint32)
    padded_zeros[:, : zeros.shape[1]] = zeros
    padded_scales = np.zeros((n, 8 * width), dtype=np.float16)
    padded_scales[:, : scales.shape[1]] = scales
    sequential = tuple(range(8))
    return _pack_int32_nibbles(codes, sequential), _pack_int32_nibbles(padded_zeros, sequential), padded_scales


# ---------------------------------------------------------------------------------------------
# GGUF blocks (ggml-common.h: block_q4_0, block_q4_1; 32 weights a block). Read here rather than with
# gguf.quants, which dequantizes to floats: perfx keeps the 4-bit codes and per-block scale and offset.
# The tests check these readers against gguf.quants.dequantize, llama.cpp's own definition.

Q4_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", 16)])
Q4_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])


def _q4_block_codes(qs: np.ndarray) -> np.ndarray:
    """ggml stores weight j (< 16) in the low nibble of byte j and weight j + 16 in its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _blocks(raw: np.ndarray, dtype: np.dtype, n: int, k: int, name: str) -> np.ndarray:
    if k % 32:
        raise PerfxError(f"GGUF tensor {name}: row length {k} is not a multiple of the 32-weight block")
    data = np.frombuffer(np.ascontiguousarray(raw).tobytes() if not isinstance(raw, (bytes, memoryview)) else raw,
                         dtype=np.uint8)
    expected = n * (k // 32) * dtype.itemsize
    if data.size != expected:
        raise PerfxError(f"GGUF tensor {name}: {data.size} bytes where ({n}, {k}) needs {expected}; "
                         "the file is truncated or its header lies about the shape")
    return data.view(dtype).reshape(n, k // 32)


def from_gguf_q4_0(raw, n: int, k: int, name: str = "tensor") -> Q4Matrix:
    blocks = _blocks(raw, Q4_0_BLOCK, n, k, name)
    codes = _q4_block_codes(blocks["qs"]).reshape(n, k)
    d = blocks["d"].astype(np.float16)
    return Q4Matrix(codes, d, (-8 * d.astype(np.float32)).astype(np.float16), 32)


def from_gguf_q4_1(raw, n: int, k: int, name: str = "tensor") -> Q4Matrix:
    blocks = _blocks(raw, Q4_1_BLOCK, n, k, name)
    codes = _q4_block_codes(blocks["qs"]).reshape(n, k)
    return Q4Matrix(codes, blocks["d"].astype(np.float16), blocks["m"].astype(np.float16), 32)
