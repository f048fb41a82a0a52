"""Gated DeltaNet (Qwen3.5, Qwen3-Next): the gated delta rule over a recurrent fp32 state, for T tokens.

``kernels/gated_delta_net.cl`` (the maths in its header; ``perfx.reference.gated_delta_net`` is the float64
truth): ``GatedDeltaNetRecurrent`` runs the recurrence token by token (decode, one token, or any T) with the
state in registers; ``GatedDeltaNetChunked`` runs it in chunks of CHUNK2 tokens (prefill), the chunk's k̂ and
q̂ tiles (fp32, or fp16 with HALF2 where the device has cl_khr_fp16) and state rows in local memory. Both take
the same arguments and give the same outputs and state.

The shape (a dict): n_k_heads, n_v_heads (a multiple of n_k_heads), d_k, d_v, and optionally head_map
("tile": v head h reads q/k head h mod Hk, llama.cpp's order in a GGUF; "interleave": h // (Hv/Hk), a Hugging
Face checkpoint's) and raw_gates (False: the gates are g and β; True: the projections' a and b, with dt_bias
and ssm_a per launch). Layouts (float32):

- qkv, token t at qkv_offset + t·qkv_stride: [q (Hk·d_k) | k (Hk·d_k) | v (Hv·d_v)], q and k as projected
  (the kernels normalise them);
- gates, token t at gates_offset + t·gates_stride: [g (Hv) | β (Hv)], g = log α (≤ 0) and β in (0, 1) as
  ggml_gated_delta_net takes them; raw_gates: [a (Hv) | b (Hv)]. gates None: they follow v in qkv's rows;
- state (Hv, d_v, d_k): S transposed, as llama.cpp's recurrent cache holds it (a value row of d_k
  contiguous floats: each row's recurrence is independent, so work-groups split rows and read them whole);
  read and written in place;
- out, token t at t·out_stride: o (Hv·d_v), head-major.
"""

from __future__ import annotations

import math

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import buffer_bytes, device_buffer
from perfx.ops.params import FP16_NEED, ParamSpace, Rule
from perfx.runtime import Device

HEAD_MAPS = {"tile": 0, "interleave": 1}
MAX_HEAD_DIM = 256


def _recurrent_local(params, shape) -> int:
    # five sums a work-item for the row reductions; one lane a row reduces nothing
    return 4 * 5 * params["LANES1"] * params["ROWS1"] if params["LANES1"] > 1 else 0


def chunked_local(params, shape) -> int:
    """Mirrors the chunked kernel's __local arrays: k̂, q̂ and state tiles (rows padded by one), L and P,
    the rows' sums, the chunk's gates."""
    c, rows, dkp = params["CHUNK2"], params["ROWS2"], shape["d_k"] + 1
    tile = 2 if params["HALF2"] else 4
    return tile * 2 * c * dkp + 4 * (rows * dkp + 2 * c * c + 2 * c * rows + 6 * c)


RECURRENT_PARAMS = ParamSpace(
    family="gated_delta_net_recurrent",
    source="gated_delta_net.cl",
    space={
        "LANES1": (16, 8, 32, 4, 1),   # work-items a state row (a power of two)
        "ROWS1": (4, 8, 16),           # state rows a work-group
    },
    rules=(Rule("a lane holds at most 128 of its row's floats (registers): LANES1 ≥ d_k / 128",
                lambda p, s: -(-s["d_k"] // p["LANES1"]) <= 128),
           Rule("LANES1 at most d_k rounded up to a power of two (more lanes would only idle)",
                lambda p, s: p["LANES1"] == 1 or p["LANES1"] // 2 < s["d_k"])),
    work_group_size=lambda p, s: p["LANES1"] * p["ROWS1"],
    local_memory=_recurrent_local,
)

CHUNKED_PARAMS = ParamSpace(
    family="gated_delta_net_chunked",
    source="gated_delta_net.cl",
    space={
        "CHUNK2": (16, 32, 8, 64),     # tokens a chunk
        "ROWS2": (16, 32, 8),          # state rows a work-group
        "WGS2": (64, 128, 32),         # work-items a work-group
        "HALF2": (0, 1),               # the k̂ and q̂ tiles in local memory as fp16 (cl_khr_fp16)
    },
    work_group_size=lambda p, s: p["WGS2"],
    local_memory=chunked_local,
    needs={"HALF2": FP16_NEED},
)


def check_shape(what: str, shape: dict) -> dict:
    """The shape with its defaults filled in; a PerfxError naming what does not fit."""
    hk, hv, dk, dv = (shape.get(key) for key in ("n_k_heads", "n_v_heads", "d_k", "d_v"))
    if not all(isinstance(n, (int, np.integer)) and n > 0 for n in (hk, hv, dk, dv)):
        raise PerfxError(f"{what}: n_k_heads, n_v_heads, d_k and d_v must be positive integers, got "
                         f"{hk}, {hv}, {dk}, {dv}")
    if hv % hk:
        raise PerfxError(f"{what}: {hv} v heads cannot share {hk} q/k heads (n_v_heads must be a multiple "
                         "of n_k_heads)")
    if dk > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        raise PerfxError(f"{what}: head sizes d_k = {dk}, d_v = {dv}: at most {MAX_HEAD_DIM} are supported")
    head_map = shape.get("head_map", "tile")
    if head_map not in HEAD_MAPS:
        raise PerfxError(f"{what}: head_map {head_map!r} is not one of {list(HEAD_MAPS)} (tile: a GGUF's "
                         "order, interleave: a Hugging Face checkpoint's)")
    return {**shape, "head_map": head_map, "raw_gates": bool(shape.get("raw_gates", False))}


class _GatedDeltaNet:
    space: ParamSpace
    kernel_name: str

    def __init__(self, device: Device, params: dict | None, shape: dict):
        self.device = device
        self.shape = shape = check_shape(self.space.family, shape)
        self.n_k_heads, self.n_v_heads = shape["n_k_heads"], shape["n_v_heads"]
        self.d_k, self.d_v = shape["d_k"], shape["d_v"]
        self.raw_gates = shape["raw_gates"]
        self.params = self.space.resolve(params, shape, device.caps)
        defines = {"HK": self.n_k_heads, "HV": self.n_v_heads, "DK": self.d_k, "DV": self.d_v,
                   "HEAD_MAP": HEAD_MAPS[shape["head_map"]], "RAW_GATES": int(self.raw_gates), **self.params}
        self.kernel = device.kernel(self.space.source, self.kernel_name, defines)
        self.qkv_size = 2 * self.n_k_heads * self.d_k + self.n_v_heads * self.d_v
        self.out_size = self.n_v_heads * self.d_v
        # Bound to dt_bias and ssm_a when the gates are g and β (the kernel does not read them).
        self.placeholder = device.alloc(4, what=f"{self.space.family} placeholder")

    def _geometry(self) -> tuple[tuple, tuple]:
        raise NotImplementedError

    def _rows(self, array, what: str, offset: int, stride: int, width: int, tokens: int):
        buffer, nbytes = buffer_bytes(array, f"{self.space.family} {what}")
        if offset < 0 or stride < width:
            raise PerfxError(f"{self.space.family}: {what} offset {offset} must be ≥ 0 and its stride {stride} "
                             f"≥ the {width} floats of a token")
        need = offset + (tokens - 1) * stride + width
        if nbytes // 4 < need:
            raise PerfxError(f"{self.space.family}: {what} must hold {need} float32 for {tokens} token(s) "
                             f"(offset {offset}, stride {stride}, {width} a token); it holds {nbytes // 4}")
        return buffer

    def __call__(self, qkv, gates, state, out, tokens: int = 1, *, qkv_offset: int = 0,
                 qkv_stride: int | None = None, gates_offset: int | None = None,
                 gates_stride: int | None = None, out_stride: int | None = None, dt_bias=None, ssm_a=None,
                 scale: float | None = None, eps: float = 1e-6):
        """o of ``tokens`` tokens into ``out`` and the state advanced past them, in place; returns the event.

        Layouts in the module docstring. Strides default to a token's own width (qkv: [q | k | v], followed
        by [g | β] when ``gates`` is None); ``gates_offset`` defaults to 0, or to just after v when ``gates``
        is None. ``dt_bias`` and ``ssm_a`` (Hv float32 each) are needed with raw_gates and not read
        otherwise. ``scale`` multiplies q̂ (None: 1/√d_k); ``eps`` bounds ‖q‖ and ‖k‖ from below
        (ggml_l2_norm's; Qwen3.5: rms_norm_eps, 1e-6). Buffers are cl.Buffers or whole pyopencl Arrays.
        """
        family, hv = self.space.family, self.n_v_heads
        if not isinstance(tokens, (int, np.integer)) or tokens < 1:
            raise PerfxError(f"{family}: tokens must be a positive integer, got {tokens!r}")
        if gates is None:
            gates = qkv
            qkv_stride = self.qkv_size + 2 * hv if qkv_stride is None else qkv_stride
            gates_offset = qkv_offset + self.qkv_size if gates_offset is None else gates_offset
            gates_stride = qkv_stride if gates_stride is None else gates_stride
        qkv_stride = self.qkv_size if qkv_stride is None else qkv_stride
        gates_offset = 0 if gates_offset is None else gates_offset
        gates_stride = 2 * hv if gates_stride is None else gates_stride
        out_stride = self.out_size if out_stride is None else out_stride
        qkv_b = self._rows(qkv, "qkv", qkv_offset, qkv_stride, self.qkv_size, tokens)
        gates_b = self._rows(gates, "gates", gates_offset, gates_stride, 2 * hv, tokens)
        out_b = self._rows(out, "out", 0, out_stride, self.out_size, tokens)
        state_b = device_buffer(state, 4 * hv * self.d_v * self.d_k, f"{family} state (Hv·d_v·d_k float32)")
        if self.raw_gates:
            if dt_bias is None or ssm_a is None:
                raise PerfxError(f"{family}: raw gates (a and b) need dt_bias and ssm_a ({hv} float32 each)")
            dt_bias = device_buffer(dt_bias, 4 * hv, f"{family} dt_bias")
            ssm_a = device_buffer(ssm_a, 4 * hv, f"{family} ssm_a")
        else:
            dt_bias = ssm_a = self.placeholder
        scale = 1.0 / math.sqrt(self.d_k) if scale is None else scale
        global_size, local_size = self._geometry()
        return self.device.launch(self.kernel, global_size, local_size, np.int32(tokens), qkv_b,
                                  np.int32(qkv_offset), np.int32(qkv_stride), gates_b, np.int32(gates_offset),
                                  np.int32(gates_stride), dt_bias, ssm_a, state_b, out_b, np.int32(out_stride),
                                  np.float32(scale), np.float32(eps))


class GatedDeltaNetRecurrent(_GatedDeltaNet):
    """The recurrence token by token, the state in registers (decode: one token; any T works).

    ``params``: ``RECURRENT_PARAMS`` (LANES1, ROWS1); None → the defaults, or the first set that fits.
    ``shape``: the module docstring's dict.
    """

    space = RECURRENT_PARAMS
    kernel_name = "gated_delta_net_recurrent"

    def _geometry(self):
        lanes, rows = self.params["LANES1"], self.params["ROWS1"]
        return (-(-self.d_v // rows) * lanes * rows, self.n_v_heads), (lanes * rows, 1)


class GatedDeltaNetChunked(_GatedDeltaNet):
    """The recurrence in chunks of CHUNK2 tokens (prefill): equal to the token-by-token one, any T.

    ``params``: ``CHUNKED_PARAMS`` (CHUNK2, ROWS2, WGS2); None → the defaults, or the first set that fits.
    ``shape``: the module docstring's dict.
    """

    space = CHUNKED_PARAMS
    kernel_name = "gated_delta_net_chunked"

    def _geometry(self):
        rows, wgs = self.params["ROWS2"], self.params["WGS2"]
        return (-(-self.d_v // rows) * wgs, self.n_v_heads), (wgs, 1)


class DeltaState:
    """The recurrent state S of every delta layer of a model, one (Hv, d_v, d_k) float32 buffer a layer on the
    device, read and written in place by the kernels. Unlike a KV cache it holds one position only, the last
    one run: a forward resumes from it at that position, or starts again from zeros at 0."""

    def __init__(self, device: Device, layers: int, shape: dict):
        shape = check_shape("delta state", shape)
        self.device = device
        per_layer = 4 * shape["n_v_heads"] * shape["d_v"] * shape["d_k"]
        self.nbytes = layers * per_layer
        self.buffers = [device.alloc(per_layer, what=f"Gated DeltaNet state (layer {i} of {layers})")
                        for i in range(layers)]

    def reset(self) -> None:
        """Every layer's S to zero (a forward from position 0)."""
        for buffer in self.buffers:
            self.device.fill(buffer, np.float32(0))
