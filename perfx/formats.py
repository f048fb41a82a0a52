"""Weight formats: two device forms, int4 and int8, and the exact readers that map every source onto them.

The int4 form (``Q4Matrix``): W (N, K) as codes q ∈ [0, 15] with a scale s and an offset m per group of
G ∈ {32, 64, 128} along K, w = s·q + m, stored in the form the source's maths allows (``Q4Matrix.form``):

- AWQ: w = (q − z)·s: an fp16 scale and a 4-bit zero point per group (``Q4_ZEROS``, 2.5 bytes a group),
  m = −s·z formed in fp32 by the kernels (exact).
- GGUF Q4_0: w = d·(q − 8): the fp16 scale alone, z = 8 implied (``Q4_SYMMETRIC``, 2 bytes a group, exact).
- GGUF Q4_1: w = d·q + min, so s = d, m = min, as fp16 (s, m) pairs (``Q4_PAIRS``, 4 bytes a group, exact):
  min is no multiple of d, so no zero point holds it.
- GGUF Q4_K: w = d·sc·q − dmin·mn per sub-block of 32, so s = d·sc, m = −dmin·mn, pairs rounded once to
  fp16 (``from_gguf_q4_k`` says how close that is); m is no multiple of s either.

The int8 form (``Q8Matrix``): codes q ∈ [−128, 127] with a scale s and an offset m per group of
G ∈ {16, 32}, w = s·q + m; s and m are held as float32 on the host and go to the device as fp16
where fp16 holds every one exactly (``f32`` False) or as float32 (``f32`` True), as (s, m) pairs, or as
the scales alone where the type's offset is always 0 (``symmetric``: the kernels' SYM, 2 or 4 bytes a
group fewer to read). Every GGUF type whose values fit 8-bit codes reads into it exactly: Q8_0 (s = d,
symmetric), Q5_0 (codes q − 16, s = d, symmetric), Q5_1 (s = d, m = min), Q5_K (s = d·sc, m = −dmin·mn,
float32: d·sc has up to 17 significant bits), Q6_K (codes q − 32, s = d·sc with an int8 sc, G = 16,
float32, symmetric). fp16 matrices (an lm_head) are quantized into it round-to-nearest
(``Q8Matrix.quantize``). MXFP4 reads into it exactly too (``Q8Matrix.mxfp4`` marks it), and routed experts go to
the device in MXFP4's own bits again (``mxfp4_arrays``, ``MXFP4_FORM``).

On the device the int4 codes are rows contiguous along K, 32 codes per RGBA/UINT32 texel
(``pack_texels``), and each group's (s, m) in the matrix's form (``pack_group_scales``); the int8
codes are plain int8 rows (``perfx/ops/q8_weight.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from perfx.errors import PerfxError
from perfx.reference import dequantize_q4, dequantize_q4_zeros

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


# How the int4 form stores each group's (s, m): ``Q4_SCALES`` in kernels/q4.h, set from the weight.
Q4_PAIRS, Q4_ZEROS, Q4_SYMMETRIC = 0, 1, 2
Q4_FORM_NAMES = {Q4_PAIRS: "fp16 scale + fp16 offset", Q4_ZEROS: "fp16 scale + 4-bit zero",
                 Q4_SYMMETRIC: "fp16 scale, zero 8"}


def q4_scale_bytes(form: int, groups: int) -> int:
    """Device bytes of ``groups`` groups' scales in ``form``: 4 a group (half2 pairs), 2.5 (an fp16 scale and
    a 4-bit zero, two zeros a byte) or 2 (the scale alone)."""
    return {Q4_PAIRS: 4 * groups, Q4_ZEROS: 2 * groups + (groups + 1) // 2, Q4_SYMMETRIC: 2 * groups}[form]


def q4_form_defines(form: int) -> dict:
    """The kernel define a weight's form fixes: none for the pairs, the kernels' default."""
    return {"Q4_SCALES": form} if form != Q4_PAIRS else {}


def describe_q4_form(form: int, group: int) -> str:
    """"int4 g128, 2.5 bytes a group (fp16 scale + 4-bit zero)": what ``perfx info`` and the load line say."""
    return f"int4 g{group}, {q4_scale_bytes(form, 2) / 2:g} bytes a group ({Q4_FORM_NAMES[form]})"


@dataclass
class Q4Matrix:
    """W (N, K) in the int4 device form: codes (N, K) uint8 in [0, 15] and per group of G along K a scale and
    an offset, w = s·q + m, stored in one of three forms (``form``, kernels/q4.h's Q4_SCALES):

    - ``Q4_PAIRS``: scales and offsets (N, K/G) fp16, any m (GGUF Q4_1 and Q4_K, whose offsets are not s times
      an integer; quantize-on-load);
    - ``Q4_ZEROS``: scales fp16 and ``zeros`` (N, K/G) integers in [0, 15], w = s·(q − z) (AWQ);
    - ``Q4_SYMMETRIC``: scales fp16, z = 8 for every group (GGUF Q4_0).

    In the zero-point forms ``offsets`` is −s·z in float32 (exact: an fp16 times a 4-bit integer), as the kernels
    form it; make those matrices with ``with_zeros`` and ``symmetric``.
    """

    codes: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None
    group: int
    zeros: np.ndarray | None = None
    form: int = Q4_PAIRS

    def __post_init__(self):
        n, k = self.codes.shape
        check_group(k, self.group)
        expected = (n, k // self.group)
        if self.form not in Q4_FORM_NAMES:
            raise PerfxError(f"int4 form {self.form!r} is not one perfx knows: {Q4_FORM_NAMES}")
        if self.form == Q4_ZEROS:
            if self.zeros is None or np.shape(self.zeros) != expected:
                raise PerfxError(f"zero points {None if self.zeros is None else np.shape(self.zeros)} do not "
                                 f"match codes {self.codes.shape} with group {self.group}: expected {expected}")
            zeros = np.asarray(self.zeros)
            if zeros.size and (zeros.min() < 0 or zeros.max() > 15):
                raise PerfxError(f"zero points must be 4-bit integers in [0, 15], got [{zeros.min()}, {zeros.max()}]")
            self.zeros = np.ascontiguousarray(zeros, dtype=np.uint8)
        elif self.zeros is not None:
            raise PerfxError(f"an int4 matrix in the {Q4_FORM_NAMES[self.form]} form has no zero-point tensor")
        if self.scales.shape != expected or (self.form == Q4_PAIRS and np.shape(self.offsets) != expected):
            raise PerfxError(f"scales {self.scales.shape} / offsets {np.shape(self.offsets)} do not match "
                             f"codes {self.codes.shape} with group {self.group}: expected {expected}")
        self.codes = np.ascontiguousarray(self.codes, dtype=np.uint8)
        self.scales = np.ascontiguousarray(self.scales, dtype=np.float16)
        if self.form == Q4_PAIRS:
            self.offsets = np.ascontiguousarray(self.offsets, dtype=np.float16)
        else:
            self.offsets = -self.scales.astype(np.float32) * self.zero_points().astype(np.float32)

    @classmethod
    def with_zeros(cls, codes, scales, zeros, group: int) -> Q4Matrix:
        """w = s·(q − z) with a 4-bit zero point per group (AWQ, asymmetric GPTQ)."""
        return cls(codes, scales, None, group, zeros, Q4_ZEROS)

    @classmethod
    def symmetric(cls, codes, scales, group: int) -> Q4Matrix:
        """w = s·(q − 8) (GGUF Q4_0, symmetric GPTQ/AWQ)."""
        return cls(codes, scales, None, group, None, Q4_SYMMETRIC)

    def zero_points(self) -> np.ndarray:
        """(N, K/G) uint8 zero points of the zero-point forms (8 throughout for ``Q4_SYMMETRIC``)."""
        if self.form == Q4_PAIRS:
            raise PerfxError("an int4 matrix of (s, m) pairs has no zero points")
        return self.zeros if self.form == Q4_ZEROS else np.full(self.scales.shape, 8, np.uint8)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads: 4 bits per weight plus the form's bytes per group (``q4_scale_bytes``)."""
        n, k = self.shape
        return n * k // 2 + q4_scale_bytes(self.form, n * (k // self.group))

    def describe_form(self) -> str:
        return describe_q4_form(self.form, self.group)

    def dequantize(self) -> np.ndarray:
        if self.form == Q4_PAIRS:
            return dequantize_q4(self.codes, self.scales, self.offsets, self.group)
        return dequantize_q4_zeros(self.codes, self.scales, self.zero_points(), self.group)

    def as_pairs(self) -> Q4Matrix:
        """The same codes and scales with fp16 (s, m) pairs: m = −s·z rounded once to fp16 (exact for z = 8
        and for z a power of two; otherwise within 2⁻¹² of 15·s, a small fraction of one step s)."""
        if self.form == Q4_PAIRS:
            return self
        with np.errstate(over="ignore"):
            return Q4Matrix(self.codes, self.scales, self.offsets.astype(np.float16), self.group)

    def _like(self, codes, scales, offsets, zeros) -> Q4Matrix:
        """A matrix of this form from row-wise pieces of this one's arrays."""
        if self.form == Q4_PAIRS:
            return Q4Matrix(codes, scales, offsets, self.group)
        return Q4Matrix(codes, scales, None, self.group, zeros, self.form)

    @classmethod
    def quantize(cls, w: np.ndarray, group: int = 128, zeros: bool = False) -> Q4Matrix:
        """Round-to-nearest asymmetric quantization of W (N, K), for `--quantize q4` and for tests.

        ``zeros`` False: (s, m) pairs, s = (max − min)/15, m = min. True: AWQ's zero-point form, s =
        (max − min)/15 and z = rint(−min/s) clipped to [0, 15], q = rint(w/s) + z clipped to [0, 15] (AutoAWQ's
        pseudo_quantize_tensor), every weight within s/2 of its value where min ≤ 0 ≤ max.
        """
        w = np.asarray(w, dtype=np.float32)
        n, k = w.shape
        check_group(k, group)
        blocks = w.reshape(n, k // group, group)
        low, high = blocks.min(axis=2), blocks.max(axis=2)
        scales = np.maximum((high - low) / 15.0, 1e-8).astype(np.float16)
        s32 = scales.astype(np.float32)[..., None]
        if zeros:
            z = np.clip(np.rint(-low / s32[..., 0]), 0, 15)
            codes = np.clip(np.rint(blocks / s32) + z[..., None], 0, 15).astype(np.uint8).reshape(n, k)
            return cls.with_zeros(codes, scales, z.astype(np.uint8), group)
        offsets = low.astype(np.float16)
        m32 = offsets.astype(np.float32)[..., None]
        codes = np.clip(np.rint((blocks - m32) / s32), 0, 15).astype(np.uint8).reshape(n, k)
        return cls(codes, scales, offsets, group)

    @classmethod
    def random(cls, n: int, k: int, group: int, rng: np.random.Generator, scale: float = 0.02,
               form: int = Q4_PAIRS) -> Q4Matrix:
        """Random codes with scales ~ ``scale``/8 and offsets ≈ −8·s (zero points 6..10 for ``Q4_ZEROS``):
        weights of Llama-like size."""
        check_group(k, group)
        codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
        scales = (rng.uniform(0.5, 1.5, size=(n, k // group)) * scale / 8).astype(np.float16)
        if form == Q4_ZEROS:
            return cls.with_zeros(codes, scales, rng.integers(6, 11, size=scales.shape), group)
        if form == Q4_SYMMETRIC:
            return cls.symmetric(codes, scales, group)
        offsets = (-8 * scales.astype(np.float32) * rng.uniform(0.8, 1.2, size=scales.shape)).astype(np.float16)
        return cls(codes, scales, offsets, group)

    @staticmethod
    def concat(parts: list[Q4Matrix]) -> Q4Matrix:
        """Stack matrices along N (fused QKV, gate-up): done once at load time. Parts of one form keep it;
        zero points and symmetric parts become zero points (z = 8); a mix with pairs becomes pairs."""
        groups = {p.group for p in parts}
        ks = {p.shape[1] for p in parts}
        if len(groups) != 1 or len(ks) != 1:
            raise PerfxError(f"cannot fuse matrices with different K {sorted(ks)} or groups {sorted(groups)}")
        forms = {p.form for p in parts}
        codes, scales = np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts])
        if Q4_PAIRS in forms:
            return Q4Matrix(codes, scales, np.concatenate([p.as_pairs().offsets for p in parts]), groups.pop())
        if forms == {Q4_SYMMETRIC}:
            return Q4Matrix.symmetric(codes, scales, groups.pop())
        return Q4Matrix.with_zeros(codes, scales, np.concatenate([p.zero_points() for p in parts]), groups.pop())

    def rows(self, start: int, stop: int) -> Q4Matrix:
        return self._like(self.codes[start:stop], self.scales[start:stop], self.offsets[start:stop],
                          None if self.zeros is None else self.zeros[start:stop])

    def take_rows(self, index: np.ndarray) -> Q4Matrix:
        """Rows reordered or picked by ``index``: codes, scales and offsets (or zeros) move together (exact)."""
        return self._like(self.codes[index], self.scales[index], self.offsets[index],
                          None if self.zeros is None else self.zeros[index])

    def regroup(self, group: int) -> Q4Matrix:
        """The same weights with groups of ``group`` (a divisor of G): each (s, m) or (s, z) repeated (exact)."""
        if group == self.group:
            return self
        if self.group % group:
            raise PerfxError(f"cannot regroup int4 groups of {self.group} into groups of {group}")
        repeat = self.group // group
        zeros = None if self.zeros is None else np.repeat(self.zeros, repeat, axis=1)
        if self.form == Q4_PAIRS:
            return Q4Matrix(self.codes, np.repeat(self.scales, repeat, axis=1),
                            np.repeat(self.offsets, repeat, axis=1), group)
        return Q4Matrix(self.codes, np.repeat(self.scales, repeat, axis=1), None, group, zeros, self.form)


# ---------------------------------------------------------------------------------------------
# The int8 form

Q8_GROUP_SIZES = (16, 32)
Q8_QUANTIZE_GROUP = 32   # the group of fp16 matrices quantized to int8 on load (an lm_head)


def check_q8_group(k: int, group: int, what: str = "weight"):
    if group not in Q8_GROUP_SIZES:
        raise PerfxError(f"{what}: int8 group size {group} is not supported; perfx's int8 form has groups "
                         f"{Q8_GROUP_SIZES}")
    if k % group:
        raise PerfxError(f"{what}: group size {group} does not divide K = {k}")


def fp16_exact(values: np.ndarray) -> bool:
    """Whether every value survives a round trip through fp16 unchanged (and so is finite there)."""
    values = np.asarray(values, dtype=np.float32)
    with np.errstate(over="ignore"):
        return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


def q8_group_bytes(f32: bool, symmetric: bool) -> int:
    """Bytes of one int8 group's scale (and offset) on the device: 2 or 4 (fp16), 4 or 8 (float32)."""
    return (4 if f32 else 2) * (1 if symmetric else 2)


@dataclass
class Q8Matrix:
    """W (N, K) in the int8 form: codes (N, K) int8; scales, offsets (N, K/G) float32; w = s·q + m.

    ``f32`` says in which precision the device reads s and m: False, fp16, which must then hold every value
    exactly (checked here); True, float32. ``symmetric`` says the device reads the scales alone (every
    offset must then be 0, checked here). Both are fixed by where the matrix comes from (its GGUF type),
    never guessed from the values, so a model's kernel shapes are known from a file's header.
    """

    codes: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray
    group: int
    f32: bool = False
    symmetric: bool = False
    # the file's MXFP4 (``from_gguf_mxfp4``): codes the doubled e2m1 values, scales 2^(e − 128), groups of 32; the
    # routed-expert kernels hold such a matrix in the file's 4.25 bits a weight (``mxfp4_arrays``)
    mxfp4: bool = False

    def __post_init__(self):
        n, k = self.codes.shape
        check_q8_group(k, self.group)
        self.mxfp4 = bool(self.mxfp4)
        if self.mxfp4 and (self.group != MXFP4_GROUP or not (self.f32 and self.symmetric)):
            raise PerfxError(f"an MXFP4 int8 matrix has groups of {MXFP4_GROUP} and float32 scales alone, not group "
                             f"{self.group}, f32={self.f32}, symmetric={self.symmetric}")
        expected = (n, k // self.group)
        if self.scales.shape != expected or self.offsets.shape != expected:
            raise PerfxError(f"scales {self.scales.shape} / offsets {self.offsets.shape} do not match "
                             f"codes {self.codes.shape} with group {self.group}: expected {expected}")
        self.codes = np.ascontiguousarray(self.codes, dtype=np.int8)
        self.scales = np.ascontiguousarray(self.scales, dtype=np.float32)
        self.offsets = np.ascontiguousarray(self.offsets, dtype=np.float32)
        self.f32, self.symmetric = bool(self.f32), bool(self.symmetric)
        if not self.f32 and not (fp16_exact(self.scales) and fp16_exact(self.offsets)):
            raise PerfxError("an int8 matrix with fp16 scale/offset pairs holds values fp16 cannot represent "
                             "exactly; make it with f32=True")
        if self.symmetric and np.any(self.offsets):
            raise PerfxError("a symmetric int8 matrix (scales alone on the device) has nonzero offsets; "
                             "make it with symmetric=False")

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @property
    def group_bytes(self) -> int:
        """Bytes of one group's scale (and offset) on the device (``q8_group_bytes``)."""
        return q8_group_bytes(self.f32, self.symmetric)

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads: one byte per weight plus each group's scale (and offset)."""
        n, k = self.shape
        return n * k + self.group_bytes * n * (k // self.group)

    def dequantize(self) -> np.ndarray:
        return dequantize_q4(self.codes, self.scales, self.offsets, self.group)

    def group_values(self) -> np.ndarray:
        """What the device reads per group, in its precision (fp16 or float32): (N, K/G, 2) (s, m) pairs, or
        (N, K/G) scales where symmetric."""
        values = self.scales if self.symmetric else np.stack([self.scales, self.offsets], axis=-1)
        return np.ascontiguousarray(values.astype(np.float32 if self.f32 else np.float16))

    @classmethod
    def quantize(cls, w: np.ndarray, group: int = Q8_QUANTIZE_GROUP) -> Q8Matrix:
        """Round-to-nearest asymmetric int8 of W (N, K) with fp16 s and m (the lm_head's `--lm-head q8`).

        s = (max − min)/255 and m = min + 128·s per group, both rounded to fp16, then q = rint((w − m)/s)
        clipped to [−128, 127]: every weight within half a step s/2 plus the fp16 rounding of m.
        Done in row blocks, so a 128k-row vocabulary needs no float64 copy of itself.
        """
        w = np.asarray(w)
        n, k = w.shape
        check_q8_group(k, group)
        codes = np.empty((n, k), np.int8)
        scales = np.empty((n, k // group), np.float16)
        offsets = np.empty((n, k // group), np.float16)
        for start in range(0, n, 8192):
            stop = min(start + 8192, n)
            blocks = w[start:stop].astype(np.float32).reshape(stop - start, k // group, group)
            low, high = blocks.min(axis=2), blocks.max(axis=2)
            s = np.maximum((high - low) / 255.0, 2.0**-24).astype(np.float16)
            m = (low + 128.0 * s.astype(np.float32)).astype(np.float16)
            s32, m32 = s.astype(np.float32)[..., None], m.astype(np.float32)[..., None]
            codes[start:stop] = np.clip(np.rint((blocks - m32) / s32), -128, 127).reshape(stop - start, k)
            scales[start:stop], offsets[start:stop] = s, m
        return cls(codes, scales.astype(np.float32), offsets.astype(np.float32), group, f32=False)

    @classmethod
    def random(cls, n: int, k: int, group: int, rng: np.random.Generator, scale: float = 0.02,
               f32: bool = False, symmetric: bool = False) -> Q8Matrix:
        """Random codes with weights of Llama-like size: s ~ ``scale``/128, small offsets (none where
        ``symmetric``). With ``f32`` the scales carry more significant bits than fp16 holds (as Q5_K's and
        Q6_K's d·sc do)."""
        check_q8_group(k, group)
        codes = rng.integers(-128, 128, size=(n, k), dtype=np.int8)
        s = rng.uniform(0.5, 1.5, size=(n, k // group)) * scale / 128
        m = np.zeros_like(s) if symmetric else rng.uniform(-4, 4, size=s.shape) * s
        if not f32:
            s, m = s.astype(np.float16), m.astype(np.float16)
        return cls(codes, s.astype(np.float32), m.astype(np.float32), group, f32=f32, symmetric=symmetric)

    @classmethod
    def from_q4(cls, q4: Q4Matrix, group: int | None = None) -> Q8Matrix:
        """The int4 matrix in the int8 form (exact: 4-bit codes fit, fp16 s and m are fp16), regrouped to
        ``group`` (a divisor of its own, e.g. 16 beside a Q6_K part) where given."""
        group = group or min(q4.group, max(Q8_GROUP_SIZES))
        if q4.group % group or group not in Q8_GROUP_SIZES:
            raise PerfxError(f"an int4 matrix of group {q4.group} cannot go into int8 groups of {group}")
        repeat = q4.group // group
        # −s·z of a 4-bit zero point can need 15 significant bits: float32 pairs (fixed by the form). Pairs for
        # every int4 form, Q4_0's too, so the form of a fused matrix follows from its parts' kinds (``Form``).
        return cls(q4.codes.astype(np.int8), np.repeat(q4.scales.astype(np.float32), repeat, axis=1),
                   np.repeat(q4.offsets.astype(np.float32), repeat, axis=1), group, f32=q4.form == Q4_ZEROS)

    def regroup(self, group: int) -> Q8Matrix:
        """The same weights with groups of ``group`` (a divisor of G): each (s, m) repeated (exact)."""
        if group == self.group:
            return self
        if self.group % group:
            raise PerfxError(f"cannot regroup int8 groups of {self.group} into groups of {group}")
        repeat = self.group // group
        return Q8Matrix(self.codes, np.repeat(self.scales, repeat, axis=1),
                        np.repeat(self.offsets, repeat, axis=1), group, self.f32, self.symmetric)

    @staticmethod
    def concat(parts: list[Q8Matrix]) -> Q8Matrix:
        """Stack matrices along N (fused QKV, gate-up) at the smallest group; float32 if any part is, symmetric
        (MXFP4) only if every part is."""
        ks = {p.shape[1] for p in parts}
        if len(ks) != 1:
            raise PerfxError(f"cannot fuse matrices with different K {sorted(ks)}")
        group = min(p.group for p in parts)
        parts = [p.regroup(group) for p in parts]
        return Q8Matrix(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                        np.concatenate([p.offsets for p in parts]), group, any(p.f32 for p in parts),
                        all(p.symmetric for p in parts), all(p.mxfp4 for p in parts))

    def rows(self, start: int, stop: int) -> Q8Matrix:
        return Q8Matrix(self.codes[start:stop], self.scales[start:stop], self.offsets[start:stop], self.group,
                        self.f32, self.symmetric, self.mxfp4)

    def take_rows(self, index: np.ndarray) -> Q8Matrix:
        return Q8Matrix(self.codes[index], self.scales[index], self.offsets[index], self.group, self.f32,
                        self.symmetric, self.mxfp4)


# ---------------------------------------------------------------------------------------------
# Device layout


def pack_texels(codes: np.ndarray) -> np.ndarray:
    """codes (N, K) -> uint32 texels (N, K/32, 4): code 32·t + 8·c + j in component c, bits 4j..4j+3.

    A kernel unpacks 4 codes at once with ``(texel >> 4j) & 0xF`` (codes 8c + j, c = 0..3).
    """
    codes = np.asarray(codes, dtype=np.uint8)
    n, k = codes.shape
    if k % CODES_PER_TEXEL:
        raise PerfxError(f"K = {k} is not a multiple of {CODES_PER_TEXEL}")
    # Byte b of a little-endian component holds codes 2b (low nibble) and 2b + 1: packed in bytes, the
    # texels are those bytes read as uint32 (a 7B's weights pack many times faster than with uint32 shifts).
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view("<u4").reshape(n, k // 32, 4).astype(np.uint32, copy=False)


def unpack_texels(texels: np.ndarray) -> np.ndarray:
    """Inverse of ``pack_texels``."""
    texels = np.asarray(texels, dtype=np.uint32)
    n, t, _ = texels.shape
    shifts = (4 * np.arange(8, dtype=np.uint32))
    return ((texels[..., None] >> shifts) & 0xF).astype(np.uint8).reshape(n, t * 32)


def pack_scale_offset(scales: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(N, K/G) scales and offsets -> (N, K/G, 2) fp16: one 32-bit (s, m) load per group."""
    return np.ascontiguousarray(np.stack([scales, offsets], axis=-1).astype(np.float16))


def pack_group_scales(q4: Q4Matrix, interleaved: bool = False) -> np.ndarray:
    """The bytes of a matrix's scale_offset buffer in its form (kernels/q4.h), groups in row order (N, K/G) or,
    ``interleaved``, (K/G, N): half2 (s, m) pairs; or the fp16 scales, then (``Q4_ZEROS``) the zero points in
    the same order, two a byte, the even index in the low nibble."""
    order = (lambda a: a.T) if interleaved else (lambda a: a)
    if q4.form == Q4_PAIRS:
        pairs = pack_scale_offset(q4.scales, q4.offsets)
        return np.ascontiguousarray(pairs.transpose(1, 0, 2) if interleaved else pairs).view(np.uint8).reshape(-1)
    scales = np.ascontiguousarray(order(q4.scales)).view(np.uint8).reshape(-1)
    if q4.form == Q4_SYMMETRIC:
        return scales
    zeros = np.ascontiguousarray(order(q4.zeros)).reshape(-1)
    if zeros.size % 2:
        zeros = np.append(zeros, np.uint8(0))
    return np.concatenate([scales, zeros[0::2] | (zeros[1::2] << 4)])


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
    zeros = _unpack_int32_nibbles(qzeros, AWQ_GEMM_ORDER).T  # (N, K/G)
    return Q4Matrix.with_zeros(codes, scales.T.astype(np.float16), zeros, group)


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
    zeros = _unpack_int32_nibbles(qzeros, sequential)[:, : k // group]
    return Q4Matrix.with_zeros(codes, scales[:, : k // group].astype(np.float16), zeros, group)


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
# GGUF blocks (ggml-common.h: block_q4_0, block_q4_1, block_q5_0, block_q5_1, block_q8_0 of 32 weights;
# block_q4_K, block_q5_K, block_q6_K of 256). Read here rather than with gguf.quants, which dequantizes
# to floats: perfx keeps the integer codes and each group's scale and offset. The tests check every
# reader against gguf.quants.dequantize, llama.cpp's own definition in Python.

QK_K = 256  # weights per K-quant super-block
Q4_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", 16)])
Q4_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])
Q5_0_BLOCK = np.dtype([("d", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)])
Q5_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "<u4"), ("qs", "u1", 16)])
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
Q4_K_BLOCK = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)])
Q5_K_BLOCK = np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qh", "u1", 32), ("qs", "u1", 128)])
Q6_K_BLOCK = np.dtype([("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")])
MXFP4_BLOCK = np.dtype([("e", "u1"), ("qs", "u1", 16)])
# MXFP4's e2m1 values doubled (ggml's kvalues_mxfp4): integers, so they are int8 codes
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)
MXFP4_GROUP = 32
# code + 128 -> its e2m1 nibble (−0 and 0 alike: nibble 0), 255 where no e2m1 value is that code
_MXFP4_NIBBLE = np.full(256, 255, np.uint8)
_MXFP4_NIBBLE[MXFP4_VALUES[:8].astype(np.int16) + 128] = np.arange(8)
_MXFP4_NIBBLE[MXFP4_VALUES[9:].astype(np.int16) + 128] = np.arange(9, 16)


def mxfp4_scales(e: np.ndarray) -> np.ndarray:
    """2^(e − 128) in float32 of E8M0 bytes e (ggml's ggml_e8m0_to_fp32_half: exact, subnormal below e = 2)."""
    e = np.asarray(e).astype(np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).astype(np.uint32).view(np.float32)


def mxfp4_arrays(w) -> tuple[np.ndarray, np.ndarray]:
    """An MXFP4 matrix (``Q8Matrix.mxfp4``) in the file's bits: (N, K/2) uint8 e2m1 nibbles, two a byte with the even
    k low (the int4 forms' order), and (N, K/32) uint8 E8M0 exponents, s = 2^(e − 128) (``mxfp4_scales``)."""
    if not w.mxfp4:
        raise PerfxError("mxfp4_arrays: the matrix is not MXFP4 (Q8Matrix.mxfp4)")
    nibbles = _MXFP4_NIBBLE[w.codes.view(np.uint8) ^ np.uint8(0x80)]
    if nibbles.max(initial=0) == 255:
        raise PerfxError("an MXFP4 matrix holds codes that are no doubled e2m1 value (0, ±1, ±2, ±3, ±4, ±6, ±8, ±12)")
    bits = w.scales.view(np.uint32)
    low = np.maximum(bits >> np.uint32(21), 1)   # the subnormals 2^-127, 2^-128 of e = 1, 0: bits 1 << (21 + e)
    e = np.where(bits < 0x00800000, np.log2(low).astype(np.uint32), (bits >> np.uint32(23)) + 1)
    if np.any(e > 255) or not np.array_equal(mxfp4_scales(np.minimum(e, 255)), w.scales):
        raise PerfxError("an MXFP4 matrix holds scales that are no E8M0 power of two 2^(e − 128)")
    return np.ascontiguousarray(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)), np.ascontiguousarray(e.astype(np.uint8))


def _q4_block_codes(qs: np.ndarray) -> np.ndarray:
    """ggml stores weight j (< 16) in the low nibble of byte j and weight j + 16 in its high nibble."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q5_block_codes(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1: the low 4 bits as in Q4 blocks; bit i of the 32-bit qh is the fifth bit of weight i."""
    high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    return _q4_block_codes(qs) | (high << 4)


def _blocks(raw: np.ndarray, dtype: np.dtype, n: int, k: int, name: str, block: int = 32) -> np.ndarray:
    if k % block:
        raise PerfxError(f"GGUF tensor {name}: row length {k} is not a multiple of the {block}-weight block")
    data = np.frombuffer(np.ascontiguousarray(raw).tobytes() if not isinstance(raw, (bytes, memoryview)) else raw,
                         dtype=np.uint8)
    expected = n * (k // block) * dtype.itemsize
    if data.size != expected:
        raise PerfxError(f"GGUF tensor {name}: {data.size} bytes where ({n}, {k}) needs {expected}; "
                         "the file is truncated or its header lies about the shape")
    return data.view(dtype).reshape(n, k // block)


def from_gguf_q4_0(raw, n: int, k: int, name: str = "tensor") -> Q4Matrix:
    blocks = _blocks(raw, Q4_0_BLOCK, n, k, name)
    codes = _q4_block_codes(blocks["qs"]).reshape(n, k)
    return Q4Matrix.symmetric(codes, blocks["d"].astype(np.float16), 32)   # w = d·(q − 8): exact


def from_gguf_q4_1(raw, n: int, k: int, name: str = "tensor") -> Q4Matrix:
    """w = d·q + min: (s, m) pairs, as min is no multiple of d in general (no zero-point form holds it)."""
    blocks = _blocks(raw, Q4_1_BLOCK, n, k, name)
    codes = _q4_block_codes(blocks["qs"]).reshape(n, k)
    return Q4Matrix(codes, blocks["d"].astype(np.float16), blocks["m"].astype(np.float16), 32)


def from_gguf_q8_0(raw, n: int, k: int, name: str = "tensor") -> Q8Matrix:
    """w = d·q, q ∈ [−127, 127]: s = d, m = 0, exact in fp16, scales alone."""
    blocks = _blocks(raw, Q8_0_BLOCK, n, k, name)
    d = blocks["d"].astype(np.float32)
    return Q8Matrix(blocks["qs"].reshape(n, k), d, np.zeros_like(d), 32, symmetric=True)


def from_gguf_q5_0(raw, n: int, k: int, name: str = "tensor") -> Q8Matrix:
    """w = d·(q − 16), q ∈ [0, 31]: codes q − 16, s = d, m = 0, exact in fp16, scales alone."""
    blocks = _blocks(raw, Q5_0_BLOCK, n, k, name)
    codes = _q5_block_codes(blocks["qs"], blocks["qh"]).astype(np.int8) - 16
    d = blocks["d"].astype(np.float32)
    return Q8Matrix(codes.reshape(n, k), d, np.zeros_like(d), 32, symmetric=True)


def from_gguf_q5_1(raw, n: int, k: int, name: str = "tensor") -> Q8Matrix:
    """w = d·q + min, q ∈ [0, 31]: s = d, m = min, exact with fp16 pairs."""
    blocks = _blocks(raw, Q5_1_BLOCK, n, k, name)
    codes = _q5_block_codes(blocks["qs"], blocks["qh"]).astype(np.int8)
    return Q8Matrix(codes.reshape(n, k), blocks["d"].astype(np.float32), blocks["m"].astype(np.float32), 32)


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block from its 12 bytes (ggml's
    get_scale_min_k4): j < 4: sc = b[j] & 63, mn = b[j+4] & 63; j ≥ 4: the low 4 bits from b[j+4]
    (sc low nibble, mn high nibble) and the top 2 bits from the spare bits 6–7 of b[j−4] and b[j]."""
    b = packed.astype(np.uint8)
    low_sc, low_mn = b[..., 0:4] & 63, b[..., 4:8] & 63
    high_sc = (b[..., 8:12] & 0x0F) | ((b[..., 0:4] >> 6) << 4)
    high_mn = (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)
    return np.concatenate([low_sc, high_sc], axis=-1), np.concatenate([low_mn, high_mn], axis=-1)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 128 bytes in 4 chunks of 32; chunk c holds sub-block 2c in its low nibbles and 2c + 1
    in its high nibbles. Returns (..., 8, 32) codes per sub-block."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return ((chunks >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(*qs.shape[:-1], 8, 32)


def _k_scale_offset(blocks: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block of 32: s = d·sc and m = −dmin·mn, exact in float32 (an fp16 times a 6-bit integer
    has at most 17 significant bits)."""
    sc, mn = _k_scales_mins(blocks["scales"])
    d = blocks["d"].astype(np.float32)[..., None]
    dmin = blocks["dmin"].astype(np.float32)[..., None]
    return (d * sc).reshape(n, k // 32), (-(dmin * mn)).reshape(n, k // 32)


def from_gguf_q4_k(raw, n: int, k: int, name: str = "tensor") -> Q4Matrix:
    """Q4_K: w = d·sc·q − dmin·mn, q ∈ [0, 15], per sub-block of 32 in super-blocks of 256.

    Into the int4 form with G = 32, (s, m) pairs (m = −dmin·mn is no multiple of s: no zero-point form holds
    it): s = d·sc and m = −dmin·mn, exact in float32 but rounded once to the
    form's fp16 (an fp16 times a 6-bit sc can need 17 significant bits): |Δs| ≤ 2⁻¹¹·s and
    |Δm| ≤ 2⁻¹¹·|m| (relative to the smallest normal fp16, 2⁻²⁵ absolute), so each weight moves by at
    most 2⁻¹¹·(15·s + |m|), under 1% of one quantization step s for typical |m| ≲ 5·s. llama.cpp computes
    the same products in float32.
    """
    blocks = _blocks(raw, Q4_K_BLOCK, n, k, name, QK_K)
    codes = _k_low_nibbles(blocks["qs"]).reshape(n, k)
    s, m = _k_scale_offset(blocks, n, k)
    with np.errstate(over="ignore"):
        return Q4Matrix(codes, s.astype(np.float16), m.astype(np.float16), 32)


def from_gguf_q5_k(raw, n: int, k: int, name: str = "tensor") -> Q8Matrix:
    """Q5_K: w = d·sc·q − dmin·mn, q ∈ [0, 31] (Q4_K's nibbles plus a fifth bit: bit j of qh[i] for
    weight i of sub-block j). Into the int8 form with G = 32 and float32 pairs: exact."""
    blocks = _blocks(raw, Q5_K_BLOCK, n, k, name, QK_K)
    high = (blocks["qh"][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1   # (n, blocks, 8, 32)
    codes = (_k_low_nibbles(blocks["qs"]) | (high << 4)).astype(np.int8).reshape(n, k)
    s, m = _k_scale_offset(blocks, n, k)
    return Q8Matrix(codes, s, m, 32, f32=True)


def from_gguf_q6_k(raw, n: int, k: int, name: str = "tensor") -> Q8Matrix:
    """Q6_K: w = d·sc·(q − 32), q ∈ [0, 63], sc an int8 per sub-block of 16. Weight p (< 128) of half h
    of a super-block: low 4 bits in nibble p // 64 of ql[64h + p mod 64], high 2 bits at bits
    2·(p // 32) of qh[32h + p mod 32]. Into the int8 form with G = 16, codes q − 32, s = d·sc (exact in
    float32: at most 18 significant bits), m = 0, float32 scales alone: exact."""
    blocks = _blocks(raw, Q6_K_BLOCK, n, k, name, QK_K)
    ql = blocks["ql"].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    ql = (ql & 0x0F).reshape(n, -1, 2, 128)
    qh = blocks["qh"].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    qh = (qh & 0x03).reshape(n, -1, 2, 128)
    codes = ((ql | (qh << 4)).astype(np.int8) - 32).reshape(n, k)
    s = (blocks["d"].astype(np.float32)[..., None] * blocks["scales"].astype(np.float32)).reshape(n, k // 16)
    return Q8Matrix(codes, s, np.zeros_like(s), 16, f32=True, symmetric=True)


def from_gguf_mxfp4(raw, n: int, k: int, name: str = "tensor") -> Q8Matrix:
    """MXFP4 (gpt-oss's experts; llama-quantize's MXFP4_MOE): w = 2^(e − 128)·v, v a doubled e2m1 value of a
    nibble (ggml's ggml_e8m0_to_fp32_half): codes v ∈ [−12, 12], s = 2^(e − 128) in float32 (exact: a power of two,
    subnormal below e = 2), scales alone. Exact; the routed-expert kernels hold it in the file's bits again
    (``mxfp4_arrays``), other kernels as int8."""
    blocks = _blocks(raw, MXFP4_BLOCK, n, k, name)
    codes = MXFP4_VALUES[_q4_block_codes(blocks["qs"])].reshape(n, k)
    s = mxfp4_scales(blocks["e"])
    return Q8Matrix(codes, s, np.zeros_like(s), 32, f32=True, symmetric=True, mxfp4=True)


# GGUF tensor types perfx reads exactly into a device form, by reader.
GGUF_READERS = {"Q4_0": from_gguf_q4_0, "Q4_1": from_gguf_q4_1, "Q4_K": from_gguf_q4_k,
                "Q5_0": from_gguf_q5_0, "Q5_1": from_gguf_q5_1, "Q5_K": from_gguf_q5_k,
                "Q6_K": from_gguf_q6_k, "Q8_0": from_gguf_q8_0, "MXFP4": from_gguf_mxfp4}


# ---------------------------------------------------------------------------------------------
# Host matrices: a matrix's device form, and stacking and reordering rows in any form

HostMatrix = Union[Q4Matrix, Q8Matrix, np.ndarray]   # a weight W (N, K): the int4 or int8 form, or fp16


@dataclass(frozen=True, order=True)
class Form:
    """The device form of a matrix: kind "q4" (group G), "q8" (group G, float32 scales if f32, scales alone if
    symmetric), "f16", or "mxfp4" (routed experts only: e2m1 nibbles and E8M0 exponents, group 32)."""

    kind: str
    group: int = 0
    f32: bool = False
    symmetric: bool = False


F16_FORM = Form("f16")
MXFP4_FORM = Form("mxfp4", MXFP4_GROUP)


def form_of(w: HostMatrix) -> Form:
    if isinstance(w, Q4Matrix):
        return Form("q4", w.group)
    if isinstance(w, Q8Matrix):
        return Form("q8", w.group, w.f32, w.symmetric)
    return F16_FORM


def fused_form(parts: list[Form]) -> Form:
    """The form of matrices stacked along N (fused QKV, gate-up), the rule ``fuse_rows`` follows.

    All int4: int4 at the smallest group (regrouping repeats each (s, m): exact). Any fp16 part: fp16. Any
    other mix of int4 and int8: int8 at the smallest group, float32 if any part is, symmetric if every part is
    a symmetric int8 one (int4 parts bring pairs, ``Q8Matrix.from_q4``); int4 codes fit int8 and their fp16 s
    and m stay exact, so e.g. Q4_K q and k beside a Q6_K v fuse exactly at G = 16.
    """
    kinds = {p.kind for p in parts}
    if kinds == {"q4"}:
        return Form("q4", min(p.group for p in parts))
    if "f16" in kinds:
        return F16_FORM
    return Form("q8", min(min(p.group, Q8_QUANTIZE_GROUP) for p in parts), any(p.f32 for p in parts),
                all(p.kind == "q8" and p.symmetric for p in parts))


def to_fp16(w: HostMatrix, rows: int = 8192) -> np.ndarray:
    """W as fp16, dequantized a block of rows at a time (a float64 copy of a whole vocabulary is GBs)."""
    if isinstance(w, np.ndarray):
        return w.astype(np.float16)
    return np.concatenate([w.rows(i, min(i + rows, w.shape[0])).dequantize().astype(np.float16)
                           for i in range(0, w.shape[0], rows)])


def fuse_rows(parts: list[HostMatrix]) -> HostMatrix:
    """Stack projections along N in the form ``fused_form`` gives: exact except where an fp16 part makes
    the whole fp16 (e.g. an AWQ model with one projection in modules_to_not_convert)."""
    form = fused_form([form_of(p) for p in parts])
    if form.kind == "q4":
        return Q4Matrix.concat([p.regroup(form.group) for p in parts])
    if form.kind == "q8":
        return Q8Matrix.concat([Q8Matrix.from_q4(p) if isinstance(p, Q4Matrix) else p for p in parts])
    return np.concatenate([to_fp16(p) for p in parts])


def permute_linear_rows(w: HostMatrix, permutation: np.ndarray) -> HostMatrix:
    """Reorder the rows of W; for the int4 and int8 forms codes, scales and offsets move together (exact)."""
    if isinstance(w, (Q4Matrix, Q8Matrix)):
        return w.take_rows(permutation)
    return np.ascontiguousarray(w[permutation])
