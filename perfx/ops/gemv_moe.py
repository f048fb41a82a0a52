"""Routed-expert GEMVs of a mixture-of-experts FFN: the chosen experts' gate-up (with act(gate)·up fused) and
down (with the weighted sum of the chosen experts fused), reading each row's expert ids from the device buffer
``perfx.ops.moe_router`` writes, and only those experts' bytes.

Wraps ``kernels/gemv_moe.cl``. Every expert's matrix of one role lives in one ``ExpertWeights``: the experts
stacked, int4 (two codes a byte) or int8 codes, and a (scale, offset) per group, or the scale alone where the
file's form is symmetric (GGUF Q4_0, Q8_0), in fp16 where the file holds them so (a chosen expert then costs the
file's bytes) or float32; or MXFP4 (gpt-oss's experts) in the file's bits: e2m1 nibbles and an E8M0 exponent byte a
group of 32, 4.25 bits a weight. Any int4 or int8 host form (``perfx.formats``: Q4_0,
Q4_1, Q4_K, Q5_x, Q6_K, Q8_0, MXFP4) is held exactly. A prompt runs the same kernels over its m rows, each row through
its own experts.
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.formats import MXFP4_FORM, Q4_SYMMETRIC, Q4_ZEROS, Form, Q4Matrix, Q8Matrix, mxfp4_arrays
from perfx.ops import device_buffer
from perfx.ops.params import ParamSpace, Rule
from perfx.runtime import Device

ACTS = {"silu": 1, "gelu_tanh": 2, "swiglu_oai": 3}   # kernels/gemv_moe.cl's ACT
OPS = ("gate_up", "down")

PARAMS = ParamSpace(
    family="gemv_moe",
    source="gemv_moe.cl",
    space={"WGS": (64, 32, 128, 256),   # work-items per work-group, each taking whole groups along K in turn
           "ROWS": (1, 2, 4)},          # output rows per work-group
    rules=(Rule("the tree sum halves WGS: a power of two", lambda p, s: p["WGS"] & (p["WGS"] - 1) == 0),),
    work_group_size=lambda p, s: p["WGS"],
    local_memory=lambda p, s: 4 * p["ROWS"] * p["WGS"] * (2 if s.get("op", "gate_up") == "gate_up" else 1),
)


def expert_form(w) -> Form:
    """The device form an expert matrix takes: int4 or int8 at its group, ``symmetric`` where its scales alone are
    read (int4 z = 8, int8 m = 0), ``f32`` where its scales (or offsets) need float32: an int8 matrix made so
    (Q5_K, Q6_K), int4 zero points (m = −s·z); fp16 otherwise, as the file holds them. An MXFP4 matrix
    (``Q8Matrix.mxfp4``) takes the MXFP4 form, the file's bits."""
    if isinstance(w, Q8Matrix) and w.mxfp4:
        return MXFP4_FORM
    if isinstance(w, Q4Matrix):
        return Form("q4", w.group, f32=w.form == Q4_ZEROS, symmetric=w.form == Q4_SYMMETRIC)
    if isinstance(w, Q8Matrix):
        return Form("q8", w.group, f32=w.f32, symmetric=w.symmetric)
    raise PerfxError("expert matrices are held in the int4 or int8 form; an fp16 expert must be quantized first "
                     "(the sources hold fp16 experts as int8)")


def form_shape(form: Form) -> dict:
    """The shape keys of an expert form: bits, group, sym, f32; and mxfp4 (bits 4, group 32, sym) for MXFP4."""
    if form == MXFP4_FORM:
        return {"bits": 4, "group": form.group, "sym": True, "f32": False, "mxfp4": True}
    return {"bits": 4 if form.kind == "q4" else 8, "group": form.group, "sym": bool(form.symmetric),
            "f32": bool(form.f32)}


def shape_form(shape: dict) -> Form:
    """The expert form of a routed kernel's shape keys (``form_shape``'s inverse)."""
    if shape.get("mxfp4"):
        return MXFP4_FORM
    return Form("q4" if int(shape.get("bits", 4)) == 4 else "q8", int(shape.get("group", 32)), bool(shape.get("f32")),
                bool(shape.get("sym")))


def form_defines(shape: dict) -> dict:
    """The kernel defines the weights' form fixes (kernels/gemv_moe.cl, gemm_moe.cl: BITS, GROUP, SYM, HALF, MXFP4)."""
    form = shape_form(shape)
    if form == MXFP4_FORM:
        return {"BITS": 4, "GROUP": form.group, "SYM": 1, "HALF": 0, "MXFP4": 1}
    return {"BITS": 4 if form.kind == "q4" else 8, "GROUP": form.group, "SYM": int(form.symmetric),
            "HALF": int(not form.f32), "MXFP4": 0}


def expert_arrays(w, form: Form) -> tuple[np.ndarray, np.ndarray]:
    """(codes bytes, scales) of one expert in the device form: int4 codes two a byte (the even k low), or int8
    codes; per group (s, m) pairs or, symmetric, s alone, in fp16 or (``f32``) float32; MXFP4: e2m1 nibbles two a
    byte (the even k low) and one E8M0 byte a group (``perfx.formats.mxfp4_arrays``)."""
    if form == MXFP4_FORM:
        return mxfp4_arrays(w)
    codes = w.codes
    if form.kind == "q4":
        codes = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    else:
        codes = codes.view(np.uint8)
    dtype = np.float32 if form.f32 else np.float16
    scales = w.scales.astype(np.float32)
    if not form.symmetric:
        scales = np.stack([scales, np.asarray(w.offsets, np.float32)], axis=-1)
    return np.ascontiguousarray(codes), np.ascontiguousarray(scales.astype(dtype))


class ExpertWeights:
    """Every expert's matrix of one role on the device: (E, n, k) codes and their scales, in one form, and with
    ``bias`` (E, n) float32 each expert's bias of each row (gpt-oss)."""

    def __init__(self, device: Device, matrices: list, what: str = "experts", bias=None):
        if not matrices:
            raise PerfxError(f"{what}: no experts")
        forms = {expert_form(w) for w in matrices}
        shapes = {tuple(w.shape) for w in matrices}
        if len(forms) > 1 or len(shapes) > 1:
            raise PerfxError(f"{what}: the experts differ in form {sorted(forms)} or shape {sorted(shapes)}; every "
                             "expert of a layer's role is read by one kernel")
        self.form = forms.pop()
        self.n, self.k = shapes.pop()
        self.experts = len(matrices)
        if self.k % self.form.group or self.form.group % 8:
            raise PerfxError(f"{what}: K = {self.k} with groups of {self.form.group}: the routed GEMVs read groups of "
                             "a multiple of 8 weights that divide K")
        arrays = [expert_arrays(w, self.form) for w in matrices]
        self.codes_per_expert, self.scales_per_expert = arrays[0][0].nbytes, arrays[0][1].nbytes
        # one upload of each stacked array: the host holds one layer's role at a time, as it holds the layer
        self.codes = device.alloc(self.codes_per_expert * self.experts, np.stack([a[0] for a in arrays]),
                                  what=f"{what} codes")
        self.scales = device.alloc(self.scales_per_expert * self.experts, np.stack([a[1] for a in arrays]),
                                   what=f"{what} scales")
        self.bias, self.bias_per_expert = None, 0
        if bias is not None:
            bias = np.ascontiguousarray(bias, dtype=np.float32)
            if bias.shape != (self.experts, self.n):
                raise PerfxError(f"{what}: bias of shape {bias.shape} where the experts need ({self.experts}, {self.n})")
            self.bias_per_expert = 4 * self.n
            self.bias = device.alloc(bias.nbytes, bias, what=f"{what} bias")

    @property
    def expert_bytes(self) -> int:
        """Bytes a kernel reads of one expert."""
        return self.codes_per_expert + self.scales_per_expert + self.bias_per_expert


def check_weight(family: str, op: str, weight: ExpertWeights, form: Form, rows: int, bias: bool) -> None:
    """Weights a routed kernel built for ``form``, ``rows`` and (with ``bias``) row biases can read."""
    if weight.form != form:
        raise PerfxError(f"{family}: weights in form {weight.form} given to a kernel built for {form}")
    if weight.n != rows:
        raise PerfxError(f"{family} {op}: experts of {weight.n} rows where {rows} are needed")
    if (weight.bias is not None) != bias:
        raise PerfxError(f"{family} {op}: experts " + ("without" if bias else "with") + " biases given to a kernel "
                         "built " + ("with" if bias else "without") + " them: make it with shape bias="
                         f"{weight.bias is not None}")


class GemvMoE:
    """The routed-expert GEMV of one role (the shape's ``op``: "gate_up" or "down") for weights of one form.

    The shape (``tuning/gemv_moe.py``): ``op``, ``n`` the output width (the experts' I for gate_up, the hidden
    size for down), ``k``, ``experts``, ``used``, the form (``bits``, ``group``, ``sym``, ``f32``, ``mxfp4``), ``act`` (gate_up),
    ``bias`` (the experts' rows have biases: gpt-oss)."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        shape = dict(shape or {})
        self.op = shape.get("op", "gate_up")
        if self.op not in OPS:
            raise PerfxError(f"gemv_moe: op {self.op!r} is not one of {OPS}")
        act = shape.get("act", "silu")
        if act not in ACTS:
            raise PerfxError(f"gemv_moe: activation {act!r} is not one of {tuple(ACTS)}")
        if int(shape.get("bits", 4)) not in (4, 8):
            raise PerfxError(f"gemv_moe: {shape['bits']}-bit weights: 4 or 8")
        self.form, self.bias = shape_form(shape), bool(shape.get("bias"))
        self.device = device
        self.params = PARAMS.resolve(params, shape, device.caps)
        self.wgs, self.rows = self.params["WGS"], self.params["ROWS"]
        defines = {**self.params, **form_defines(shape), "ACT": ACTS[act], "BIAS": int(self.bias)}
        self.kernel = device.kernel(PARAMS.source, f"moe_{self.op}", defines)
        self.no_bias = device.alloc(4, what="gemv_moe no bias") if not self.bias else None

    def _check(self, weight: ExpertWeights, rows: int):
        check_weight("gemv_moe", self.op, weight, self.form, rows, self.bias)

    def _bias(self, weight):
        return weight.bias if weight.bias is not None else self.no_bias

    def gate_up(self, weight: ExpertWeights, x, ids, h, m: int, used: int):
        """h (m, used, I) = act(gate)·up of each row's chosen experts; x (m, K), ids (m, used) int32."""
        inter, k = weight.n // 2, weight.k
        self._check(weight, 2 * inter)
        args = (device_buffer(ids, 4 * m * used, "gemv_moe ids"), device_buffer(x, 4 * m * k, "gemv_moe x"),
                weight.codes, weight.scales, self._bias(weight),
                device_buffer(h, 4 * m * used * inter, "gemv_moe h"))
        groups = -(-inter // self.rows)
        return self.device.launch(self.kernel, (groups * self.wgs, used, m), (self.wgs, 1, 1), np.int32(inter),
                                  np.int32(k), np.int32(used), np.int32(weight.experts), *args)

    def down(self, weight: ExpertWeights, h, ids, weights, y, m: int, used: int, accumulate: bool = False):
        """y (m, N) (+)= Σ_j weights[r, j]·down_e(h[r, j]) over each row's chosen experts."""
        n, k = weight.n, weight.k
        self._check(weight, n)
        args = (device_buffer(ids, 4 * m * used, "gemv_moe ids"),
                device_buffer(weights, 4 * m * used, "gemv_moe weights"),
                device_buffer(h, 4 * m * used * k, "gemv_moe h"), weight.codes, weight.scales,
                self._bias(weight), device_buffer(y, 4 * m * n, "gemv_moe y"))
        groups = -(-n // self.rows)
        return self.device.launch(self.kernel, (groups * self.wgs, 1, m), (self.wgs, 1, 1), np.int32(n), np.int32(k),
                                  np.int32(used), np.int32(weight.experts), *args, np.int32(int(accumulate)))
