"""Tuning spec of ``attention_decode``: RoPE + KV append + flash-decoding attention for one new token.

Shape keys: n_heads, n_kv_heads, head_dim, positions (the context after the append: the new token is at
position positions − 1), optionally qkv_offset (where [q | k | v] starts in the qkv buffer) and the layer
features of ``Features`` (qk_norm, which changes the build; rotary_dims, scale, softcap, window, per
launch) and kv ("q8": an int8 KV cache, which changes the build; absent: fp16), and q8_out (True: out is also
written as Q8_1 blocks for the o projection, its own build; the model runs it with the parameters tuned
without it). Cases run at layer 1 of a two-layer cache, so the layer offset is exercised; ``rotate`` switches to
layer 0 for timing, so a cache larger than the device's caches is not served from them twice in a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfx import reference
from perfx.ops.attention_decode import PARAMS, AttentionDecode
from perfx.ops.kv_cache import KVCache, RopeTable
from perfx.tuning.spec import Case, Spec, cached_per_params

THETA = 10000.0
LAYERS, LAYER = 2, 1
EPS = 1e-6
FEATURE_KEYS = ("qk_norm", "rotary_dims", "scale", "softcap", "window", "v_norm", "q_only", "sinks", "rows")


@dataclass
class Features:
    """A shape's layer features beyond the plain Llama attention, on the device and in float64.

    Shape keys (each optional): qk_norm (per-head RMSNorm of q and k before RoPE, random weights),
    rotary_dims (n_rot of the RoPE table; 0: no RoPE, rope=None; absent: head_dim), scale (absent: 1/√D),
    softcap (absent: 0, off), window (absent: 0, none), sinks (gpt-oss: a random sink logit per query head).
    """

    rope: object               # RopeTable, or None for NoPE
    rotary_dims: int           # 0: NoPE
    weights: tuple | None      # (q_norm, k_norm) float32 host arrays, with qk_norm
    launch: dict               # keyword arguments of enqueue
    attend: dict               # keyword arguments of reference.attention

    @classmethod
    def make(cls, device, shape, max_positions: int, rng) -> Features:
        d = shape["head_dim"]
        n_rot = shape.get("rotary_dims", d)
        rope = RopeTable.upload(device, d, max_positions, THETA, rotary_dims=n_rot) if n_rot else None
        attend = {"window": shape.get("window", 0), "scale": shape.get("scale"),
                  "softcap": shape.get("softcap", 0.0)}
        launch = dict(attend)
        weights = None
        if shape.get("qk_norm"):
            # Around 1, as trained norm weights are; never 0, so a dimension that skips its weight shows.
            weights = tuple(rng.uniform(0.5, 1.5, d).astype(np.float32) for _ in range(2))
            launch.update(q_norm=device.upload(weights[0]), k_norm=device.upload(weights[1]), eps=EPS)
        if shape.get("v_norm"):
            launch["eps"] = EPS
        if shape.get("sinks"):
            # logits about as large as the scores (and some larger), so a sink weighs from little to most
            sinks = rng.normal(0.5, 1.5, shape["n_heads"]).astype(np.float32)
            attend["sinks"], launch["sinks"] = sinks, device.upload(sinks)
        return cls(rope, n_rot, weights, launch, attend)

    def apply(self, x, positions, which: int) -> np.ndarray:
        """q (which 0) or k (which 1), (M, heads, D), as the kernel makes it: normalised, then rotated."""
        x = reference.f64(x)
        if self.weights is not None:
            x = reference.rmsnorm(x, self.weights[which], EPS)
        return reference.rope(x, positions, THETA, rotary_dims=self.rotary_dims) if self.rotary_dims else x


def describe_features(shape) -> str:
    return "".join(f" {key}={shape[key]}" for key in FEATURE_KEYS + ("kv", "q8_out") if key in shape)


def as_stored(x, kv: str) -> np.ndarray:
    """x (..., D) as a KV cache of form ``kv`` holds it, in float64: rounded to fp16, or quantized and
    dequantized by the q8 rule (``reference.kv_q8``)."""
    return reference.kv_q8(x) if kv == "q8" else reference.f64(x).astype(np.float16).astype(np.float64)


def random_cache(rng, kv: str, shape: tuple) -> np.ndarray:
    """Random keys or values as a cache of form ``kv`` holds them: fp16, or q8 values (codes times fp16
    scales, exact in float32, so that ``KVCache.write`` stores them as they are)."""
    x = as_stored(rng.standard_normal(shape, dtype=np.float32), kv)
    return x.astype(np.float16 if kv == "f16" else np.float32)


# How far from a rounding tie of the q8 rule a test's new keys and values are drawn, in codes (and for a scale,
# in fp16 ulps): the kernels quantize values computed in fp32, the reference those computed in float64, and
# the two differ by ~1e-5 of a code (127 codes × a few fp32 ulps), so with this margin both pick the same
# codes and scales and a case compares them exactly, and out to the fp32 tolerance; drawn freely, about one
# value in 10^5 would round the other way (one code: up to 1/127 of its block's largest value).
TIE_MARGIN = 1e-3


def near_q8_ties(x) -> np.ndarray:
    """Where x (..., D) quantizes within TIE_MARGIN of a tie of ``reference.quantize_kv_q8``: a value whose
    x/d lies that near n + 1/2, or the largest value of a block whose d lies that near halfway between two
    fp16 values."""
    x = reference.f64(x)
    blocks = np.abs(x.reshape(*x.shape[:-1], -1, reference.KV_BLOCK))
    amax = blocks.max(axis=-1, keepdims=True)
    d = amax / 127.0
    codes = blocks / np.where(d > 0, d, 1.0)
    near = np.abs(codes - np.floor(codes) - 0.5) < TIE_MARGIN
    _, exponent = np.frexp(d)                      # d in [2^(e−1), 2^e): its fp16 ulp is 2^(e−11)
    ulps = d / np.ldexp(1.0, exponent - 11)
    near |= (np.abs(ulps - np.floor(ulps) - 0.5) < TIE_MARGIN) & (blocks == amax)
    return near.reshape(x.shape)


def away_from_q8_ties(rng, qkv: np.ndarray, n_heads: int, n_kv_heads: int, head_dim: int, keys_of,
                      values_of=None) -> None:
    """Redraw, in place, the k and v elements of ``qkv`` (M, (H + 2·Hkv)·D) float32 whose new key (as
    ``keys_of(qkv)`` makes it, (M, Hkv, D): normalised and rotated) or value (as ``values_of(qkv)`` makes it:
    normed where the layer norms v; None: as it is) lies near a q8 rounding tie (``near_q8_ties``), until none
    does."""
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    for _ in range(100):
        values = qkv[:, q_dim + kv_dim:] if values_of is None else values_of(qkv).reshape(len(qkv), kv_dim)
        near = np.concatenate([near_q8_ties(keys_of(qkv)).reshape(len(qkv), kv_dim),
                               near_q8_ties(values)], axis=1)
        if not near.any():
            return
        rows, columns = np.nonzero(near)
        qkv[rows, q_dim + columns] = rng.standard_normal(len(rows), dtype=np.float32)
    raise RuntimeError("could not draw keys and values away from the q8 rounding ties")


def kv_value_bytes(shape) -> float:
    """Bytes a cache of the shape's form holds per value: fp16, or an int8 code and 1/32 of an fp16 scale."""
    return 1 + 2 / reference.KV_BLOCK if shape.get("kv") == "q8" else 2


def kv_bytes(shape) -> int:
    """Bytes of K and V the attention reads: every position 0..p of every kv head."""
    return int(2 * kv_value_bytes(shape) * shape["positions"] * shape["n_kv_heads"] * shape["head_dim"])


def per_row(metric):
    """A metric of one token's launch, summed over a batched launch's rows (shape key ``rows``)."""
    def summed(shape) -> int:
        if shape.get("rows"):
            return sum(metric({**shape, "rows": None, "positions": pos + 1}) for pos in shape["rows"])
        return metric(shape)
    return summed


@per_row
def bytes_moved(shape) -> int:
    # The partials ((D + 2) floats per head and partition, written once and read once) are left out:
    # under 1/PART·(H/Hkv)·4 of the K/V bytes.
    h, hkv, d = shape["n_heads"], shape["n_kv_heads"], shape["head_dim"]
    return int(4 * (h + 2 * hkv) * d + 2 * kv_value_bytes(shape) * hkv * d + kv_bytes(shape) + 4 * h * d)


@per_row
def flops(shape) -> int:
    # q·k and w·v: 2·D each per (query head, position); RoPE and softmax are lower order.
    return 4 * shape["n_heads"] * shape["positions"] * shape["head_dim"]


def make_case(device, shape, rng) -> Case:
    if shape.get("rows"):
        return make_rows_case(device, shape, rng)
    h, hkv, d, positions = (shape[k] for k in ("n_heads", "n_kv_heads", "head_dim", "positions"))
    offset, kv = shape.get("qkv_offset", 0), shape.get("kv", "f16")
    pos = positions - 1
    max_positions = positions + 3  # a few rows past the new one, which must stay untouched
    q_only = bool(shape.get("q_only"))
    qkv = rng.standard_normal(offset + (h + (0 if q_only else 2 * hkv)) * d, dtype=np.float32)
    # The whole cache on the host: random values as the cache holds them in the rows before pos (earlier
    # tokens) and in the other layer, NaN from pos on (the row the kernel must write and must not read back,
    # and unused rows); q_only: row pos is there already (another layer wrote it), NaN after it.
    host_cache = []
    for _ in range(2):
        block = random_cache(rng, kv, (LAYERS, hkv, max_positions, d))
        block[LAYER, :, pos + q_only:] = np.nan
        host_cache.append(block)
    cache = KVCache.allocate(device, LAYERS, hkv, max_positions, d, form=kv)
    features = Features.make(device, shape, max_positions, rng)
    x = qkv[offset:]

    def rotated_keys(row):
        return features.apply(row[:, h * d: (h + hkv) * d].reshape(1, hkv, d), [pos], 1)
    def new_values(row):   # v, normed without a weight where the layer norms it (Gemma 4)
        v = reference.f64(row[:, (h + hkv) * d:].reshape(1, hkv, d))
        return reference.rmsnorm(v, 1.0, EPS) if shape.get("v_norm") else v
    if kv == "q8" and not q_only:
        away_from_q8_ties(rng, x.reshape(1, -1), h, hkv, d, rotated_keys, new_values)
    qkv_dev = device.upload(qkv)
    out = device.poisoned(h * d, np.float32)

    # Expected, float64: norm and RoPE on q and k; k and v as the cache stores them (fp16, or the q8 rule's
    # codes and scales), so the tolerance on out covers fp32 arithmetic and not the storage.
    q = features.apply(x[: h * d].reshape(1, h, d), [pos], 0)
    if q_only:   # row pos as it is in the cache: read, never written
        k = host_cache[0][LAYER, :, pos][None].astype(np.float64)
        k16, v16 = k, host_cache[1][LAYER, :, pos][None].astype(np.float64)
    else:
        k = rotated_keys(x.reshape(1, -1))
        k16 = as_stored(k, kv)
        v16 = as_stored(new_values(x.reshape(1, -1)), kv)
    keys = np.concatenate([host_cache[0][LAYER, :, :pos].transpose(1, 0, 2).astype(np.float64), k16])
    values = np.concatenate([host_cache[1][LAYER, :, :pos].transpose(1, 0, 2).astype(np.float64), v16])
    expected = {
        "out": reference.attention(q, keys, values, [pos], **features.attend).reshape(h * d),
        "keys": k16[0],
        "values": v16[0],
    }
    quantized = None
    if shape.get("q8_out"):
        # out's Q8_1 blocks must be a correct rounding of the kernel's own out (reference.q8_1_rounding_excess: 0)
        quantized = (device.empty(h * d, np.int8), device.empty((h * d // 32, 2), np.float32))
        expected["q8_excess"] = np.zeros(1)
    op = cached_per_params(lambda params: AttentionDecode(device, params, shape))
    state = {"layer": LAYER}

    def launch(params):
        return op(params).enqueue(qkv_dev, out, cache, features.rope, state["layer"], pos, offset,
                                  **features.launch, quantized=quantized)

    def run(params):
        state["layer"] = LAYER
        cache.write(device, *host_cache)
        out.fill(np.float32(np.nan))
        if quantized is not None:
            quantized[0].set(np.full(h * d, 127, np.int8))
            quantized[1].set(np.full((h * d // 32, 2), np.nan, np.float32))
        for event in launch(params):
            event.wait()
        k_dev, v_dev = cache.read(device, LAYER, positions)
        result = {"out": out.get(), "keys": k_dev[pos], "values": v_dev[pos]}
        if quantized is not None:
            result["q8_excess"] = np.array([reference.q8_1_rounding_excess(result["out"], quantized[0].get(),
                                                                           quantized[1].get())])
        return result

    def rotate():
        state["layer"] = 1 - state["layer"]

    case = Case(expected=expected, run=run, launch=launch, rotate=rotate)
    # For tests that look past the outputs: the cache rows around pos, the inputs, q and k as rotated.
    case.cache, case.host_cache, case.qkv, case.features = cache, host_cache, qkv, features
    case.q_rotated, case.k_rotated = q[0], k[0]
    case.op = op
    return case


ROWS_FIRST, ROWS_BUFFER = 2, 8   # a rows case's rows are rows 2.. of a qkv, out and position buffer of 8


def make_rows_case(device, shape, rng) -> Case:
    """The batched launch (``AttentionDecode.rows``, shape key ``rows``: each row's position, the longest at
    ``positions`` − 1): every row its own KV cache (random earlier rows, NaN from its position on) and token,
    one layer's features for all, the rows placed from ROWS_FIRST in buffers of ROWS_BUFFER rows (qkv rows 5
    floats apart past their [q | k | v]), so a row read or written at the wrong place shows. Outputs: every
    row's out, its appended k and v, the elements written outside its rows (0 expected), and the combine
    counters left non-zero (0 expected)."""
    h, hkv, d, kv = shape["n_heads"], shape["n_kv_heads"], shape["head_dim"], shape.get("kv", "f16")
    rows = list(shape["rows"])
    n, first = len(rows), ROWS_FIRST
    max_positions = shape["positions"] + 3
    features = Features.make(device, shape, max_positions, rng)
    width = (h + 2 * hkv) * d + 5
    qkv = rng.standard_normal((ROWS_BUFFER, width), dtype=np.float32)
    mine = qkv[first:first + n]

    def rotated_keys(x):
        return features.apply(x[:, h * d:(h + hkv) * d].reshape(n, hkv, d), rows, 1)
    if kv == "q8":
        away_from_q8_ties(rng, mine[:, :(h + 2 * hkv) * d], h, hkv, d, rotated_keys)
    q = features.apply(mine[:, :h * d].reshape(n, h, d), rows, 0)
    k_new = as_stored(rotated_keys(mine), kv)
    v_new = as_stored(mine[:, (h + hkv) * d:(h + 2 * hkv) * d].reshape(n, hkv, d), kv)
    hosts = []
    for pos in rows:
        blocks = [random_cache(rng, kv, (LAYERS, hkv, max_positions, d)) for _ in range(2)]
        for block in blocks:
            block[LAYER, :, pos:] = np.nan
        hosts.append(blocks)
    want = []
    for i, pos in enumerate(rows):
        keys, values = (np.concatenate([hosts[i][j][LAYER, :, :pos].transpose(1, 0, 2).astype(np.float64),
                                        new[i][None]]) for j, new in ((0, k_new), (1, v_new)))
        want.append(reference.attention(q[i][None], keys, values, [pos], **features.attend).reshape(h * d))
    expected = {"out": np.concatenate(want), "keys": k_new, "values": v_new, "written outside": np.zeros(1),
                "counters left": np.zeros(1)}
    positions = device.upload(np.array([7] * first + rows + [7] * (ROWS_BUFFER - first - n), np.int32))
    qkv_dev = device.upload(qkv)
    out = device.poisoned(ROWS_BUFFER * h * d, np.float32)
    caches = [KVCache.allocate(device, LAYERS, hkv, max_positions, d, form=kv) for _ in rows]
    op = cached_per_params(lambda params: AttentionDecode(device, params, shape))
    state = {"layer": LAYER}

    def launch(params):
        return op(params).rows(qkv_dev, out, caches, features.rope, state["layer"], rows, width, first,
                               position=(positions, 0), **features.launch)

    def run(params):
        state["layer"] = LAYER
        for cache, host in zip(caches, hosts):
            cache.write(device, *host)
        out.fill(np.float32(np.nan))
        for event in launch(params):
            event.wait()
        got = out.get().reshape(ROWS_BUFFER, h * d)
        stored = [cache.read(device, LAYER, pos + 1) for cache, pos in zip(caches, rows)]
        counters = op(params).rows_counters()
        return {"out": got[first:first + n].reshape(-1),
                "keys": np.stack([k[pos] for (k, _), pos in zip(stored, rows)]),
                "values": np.stack([v[pos] for (_, v), pos in zip(stored, rows)]),
                "written outside": np.array([np.count_nonzero(~np.isnan(np.delete(got, range(first, first + n), 0)))]),
                "counters left": np.array([np.count_nonzero(counters)])}

    def rotate():
        state["layer"] = 1 - state["layer"]

    return Case(expected=expected, run=run, launch=launch, rotate=rotate)


def heads(st):
    """Query heads, kv heads (the GQA ratio, up to 8) and head_dim (the kernels take multiples of 8 from 32;
    Gemma's 256 and Gemma 4's 512 too)."""
    @st.composite
    def draw_heads(draw):
        kv = draw(st.integers(1, 3))
        return {"n_heads": kv * draw(st.integers(1, 8)), "n_kv_heads": kv,
                "head_dim": draw(st.one_of(st.integers(4, 20).map(lambda n: 8 * n), st.just(256), st.just(512)))}
    return draw_heads()


def layer_features(st, head_dim: int):
    """Any of the per-layer features of ``Features``: q/k norm, partial or no RoPE, a scale, a soft-cap, a
    window, Gemma 4's v norm or q alone; and, where the head is whole blocks of 32, an int8 KV cache and out
    written as Q8_1 blocks too."""
    @st.composite
    def draw_features(draw):
        out = {}
        if draw(st.booleans()):
            out["qk_norm"] = True
        rotary = draw(st.sampled_from(["all", "partial", "none"]))
        if rotary == "partial":
            out["rotary_dims"] = 2 * draw(st.integers(1, head_dim // 2 - 1))
        elif rotary == "none":
            out["rotary_dims"] = 0
        if draw(st.booleans()):
            out["scale"] = draw(st.sampled_from([0.03, 0.0625, 0.1, 0.3]))
        if draw(st.booleans()):
            out["softcap"] = draw(st.sampled_from([1.0, 3.0, 50.0]))
        if draw(st.booleans()):
            out["window"] = draw(st.integers(1, 80))
        gemma4 = draw(st.sampled_from(["none", "v_norm", "q_only"]))   # Gemma 4's v norm, or a sharing layer
        if gemma4 != "none":
            out[gemma4] = True
        if draw(st.booleans()):
            out["sinks"] = True
        if head_dim % 32 == 0 and draw(st.booleans()):
            out["kv"] = "q8"
        if head_dim % 32 == 0 and draw(st.booleans()):
            out["q8_out"] = True
        return out
    return draw_features()


def fuzz_shapes(st):
    """Any heads, 1–300 positions, a qkv offset of 0–9, any layer features."""
    @st.composite
    def shape(draw):
        drawn = {**draw(heads(st)), "positions": draw(st.integers(1, 300)),
                 "qkv_offset": draw(st.integers(0, 9))}
        return {**drawn, **draw(layer_features(st, drawn["head_dim"]))}
    return shape()


# The int8 cache at GQA 1, 3, 4 and 8 and head_dim 64, 128 and 256, at positions just past a partition of
# each PART (32, 128, 256) or within the first; the last with the q/k norm and a window (Qwen3-like layers).
Q8_TEST_SHAPES = (
    {"n_heads": 4, "n_kv_heads": 4, "head_dim": 64, "positions": 33, "kv": "q8"},
    {"n_heads": 9, "n_kv_heads": 3, "head_dim": 128, "positions": 129, "qkv_offset": 3, "kv": "q8", "q8_out": True},
    {"n_heads": 8, "n_kv_heads": 2, "head_dim": 256, "positions": 257, "kv": "q8"},
    {"n_heads": 8, "n_kv_heads": 1, "head_dim": 128, "positions": 20, "qk_norm": True, "window": 12, "kv": "q8"},
)

SPEC = Spec(
    params=PARAMS,
    make_case=make_case,
    # the constructor builds what the shape's launches take (the batched build, or the one with Q8_1 blocks out)
    programs=lambda device, shape, params: AttentionDecode(device, params, shape),
    tolerance=1e-3,
    tolerance_why=(
        "keys: the kernel rotates in fp32 and the reference in float64 before both round to fp16, so an "
        "element near a rounding boundary may land one fp16 ulp apart (≤ 2^-10 of its value, ≤ 9.8e-4 of "
        "the max); values are rounded identically (exact). out is compared with attention over the fp16 "
        "K/V the cache holds, so it carries fp32 arithmetic (measured ≤ 1e-6 on the test shapes) plus the "
        "effect of those rare key flips through q·k/√D (< 1e-4). tests/test_attention_decode.py also "
        "checks out at 1e-5 against attention over the rows the kernel stored. kv=q8: the new k and v are drawn "
        "away from the q8 rule's rounding ties (TIE_MARGIN), so the stored codes and scales equal the float64 "
        "rule's and keys and values compare exactly (as codes × scales); out is compared with attention over "
        "the dequantized cache, so it carries fp32 arithmetic only, as for fp16."
    ),
    variant_tolerances={"HALF": (5e-3, (
        "HALF = 1: q·k in half: q rounds to half (≤ u = 2⁻¹¹ of each value; the keys are fp16 already) and "
        "each product and partial sum of a work-item's share of D rounds once more, so a score moves by "
        "~u·√D of |q||k|/√D, a few 1e-3 absolutely at most; softmax and p·V stay fp32, so out moves by about "
        "that much relative. Measured 4.0e-4 (T = 17), 7.8e-4 (T = 300, D = 64), 1.2e-3 (T = 300, "
        "D = 128) and up to 1.9e-3 (T = 129, D = 256) on the test shapes; 5e-3 leaves margin and still fails a "
        "causal mask off by one (> 1e-2)"))},
    test_shapes=(
        {"n_heads": 4, "n_kv_heads": 4, "head_dim": 64, "positions": 17},
        # out also as Q8_1 blocks (q8_out): through the combine (300 positions: 2 to 10 partitions) and through
        # the one partition's launch (a single position)
        {"n_heads": 9, "n_kv_heads": 3, "head_dim": 64, "positions": 300, "qkv_offset": 5, "q8_out": True},
        {"n_heads": 8, "n_kv_heads": 2, "head_dim": 128, "positions": 1, "q8_out": True},
        {"n_heads": 8, "n_kv_heads": 2, "head_dim": 128, "positions": 300, "qkv_offset": 3},
        # The 2026 families' layers, at positions just past a partition (PART 32 and 128) or on its edge:
        # Gemma 3 (D 256, GQA 4, q/k norm, a local layer's window, query_pre_attn_scalar ≠ D), Gemma 2
        # (GQA 8, soft-cap: scores of std ~2 against a cap of 1.5, so tanh bends them), Phi-4-mini (96 of 128
        # dimensions rotate), SmolLM3's NoPE layers (GQA 8), and all of them at once at D 64 (32 of 64 rotate).
        {"n_heads": 4, "n_kv_heads": 1, "head_dim": 256, "positions": 129, "qk_norm": True, "window": 100,
         "scale": 0.07, "q8_out": True},
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 256, "positions": 33, "scale": 0.125, "softcap": 1.5},
        {"n_heads": 12, "n_kv_heads": 4, "head_dim": 128, "positions": 161, "rotary_dims": 96, "qkv_offset": 2},
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 64, "positions": 256, "rotary_dims": 0},
        {"n_heads": 4, "n_kv_heads": 4, "head_dim": 64, "positions": 70, "rotary_dims": 32, "qk_norm": True,
         "softcap": 3.0, "window": 40, "scale": 0.2},
        *Q8_TEST_SHAPES,
        # Gemma 4 (E2B; its scale is 1, its learned q/k norms keeping q·k moderate, which these random norm
        # weights would not: a scale of 1/16 here): a global layer of 8 heads of 512 on one kv head (fewer
        # heads a work-group: HEADS), q/k normed, v normed without a weight, past a partition of 128 and of
        # 256; a sliding one of 256; the KV-sharing layers (q alone, the cache read, row p included), fp16 and
        # int8 caches
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 512, "positions": 257, "qk_norm": True, "v_norm": True,
         "scale": 0.0625, "rotary_dims": 128},
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 256, "positions": 70, "qk_norm": True, "v_norm": True,
         "scale": 0.0625, "window": 40, "kv": "q8", "q8_out": True},
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 512, "positions": 130, "qk_norm": True, "q_only": True,
         "scale": 0.0625, "qkv_offset": 3},
        {"n_heads": 4, "n_kv_heads": 2, "head_dim": 512, "positions": 33, "qk_norm": True, "v_norm": True,
         "kv": "q8", "scale": 0.0625},
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 256, "positions": 300, "q_only": True, "kv": "q8",
         "window": 100, "scale": 0.0625},
        # gpt-oss (64 heads of 64 over 8 kv heads: GQA 8): attention sinks on a sliding layer of 128 past several
        # partitions of each PART (the combine starts from the sink), on a full layer within one partition of
        # every PART (the one-partition output divides by the sink too), and with the int8 cache and Q8_1 out
        {"n_heads": 16, "n_kv_heads": 2, "head_dim": 64, "positions": 300, "window": 128, "sinks": True,
         "qkv_offset": 3},
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 64, "positions": 21, "sinks": True},
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 64, "positions": 130, "sinks": True, "kv": "q8", "q8_out": True},
        # A batched decode step's rows in one launch (rows: each row's position): five sequences across 1 to 9
        # partitions, at a head of 72 (9 vectors of VW 8: a V row that does not fill a work-group), partial
        # rotary and a soft-cap; the int8 cache with sinks; Gemma 3's layer (tests/test_attention_decode.py runs
        # every parameter set there)
        {"n_heads": 6, "n_kv_heads": 2, "head_dim": 72, "positions": 258, "rows": (3, 130, 40, 257, 0),
         "rotary_dims": 48, "softcap": 30.0},
        {"n_heads": 4, "n_kv_heads": 4, "head_dim": 64, "positions": 258, "rows": (3, 130, 40, 257, 0), "kv": "q8",
         "sinks": True},
        {"n_heads": 8, "n_kv_heads": 2, "head_dim": 256, "positions": 258, "rows": (3, 130, 40, 257, 0),
         "qk_norm": True, "window": 100, "scale": 0.1},
    ),
    bytes_moved=bytes_moved,
    reference=reference.attention,
    fuzz_shapes=fuzz_shapes,
    oclgrind_shapes=(
        {"n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "positions": 37, "qkv_offset": 3, "q8_out": True},
        {"n_heads": 2, "n_kv_heads": 1, "head_dim": 64, "positions": 1, "q8_out": True},
        # The per-layer features: q/k norm (its own build and local reductions), 32 of 64 dimensions rotating,
        # soft-cap, window, scale; then NoPE (no table bound).
        {"n_heads": 4, "n_kv_heads": 1, "head_dim": 64, "positions": 35, "qk_norm": True, "rotary_dims": 32,
         "softcap": 3.0, "window": 20, "scale": 0.2},
        {"n_heads": 2, "n_kv_heads": 1, "head_dim": 32, "positions": 9, "rotary_dims": 0},
        # The int8 cache: its quantizing append and the dequantizing reads, across two partitions of 32.
        {"n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "positions": 37, "kv": "q8"},
        # Gemma 4: v normed (at WGS 128 its 8 heads of 256 on one kv head split over two work-groups, HEADS 4,
        # the first appending); a layer reading another's cache, row p included
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 256, "positions": 9, "qk_norm": True, "v_norm": True},
        {"n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "positions": 11, "q_only": True, "kv": "q8"},
        # heads of 512: a kv head's 8 query heads in two groups (HEADS 4 at the defaults) over two partitions,
        # each group's last work-group combining its heads through its own counter
        {"n_heads": 8, "n_kv_heads": 1, "head_dim": 512, "positions": 130, "qk_norm": True, "v_norm": True},
        # a batched step's three rows in one launch, one across two partitions of 32, one past the others' grid
        {"n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "positions": 37, "rows": (5, 36, 0)},
    ),
    flops=flops,
    describe=lambda s: (f"H={s['n_heads']} Hkv={s['n_kv_heads']} D={s['head_dim']} T={s['positions']}"
                        + (f" offset={s['qkv_offset']}" if s.get("qkv_offset") else "") + describe_features(s)),
)
