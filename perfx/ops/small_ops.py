"""The small operations of a forward pass: embedding gathers (fp16 and int4 tables, each row times a scale),
argmax on the device (greedy decoding reads back one int, not a 152k-float logits vector), SwiGLU and GeGLU
for the unfused MLP path (SwiGLU also gates Qwen3.5's DeltaNet norm), σ(gate)·x for Qwen3.5's gated attention
output, and the final logits' soft cap (Gemma 2)."""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.gemv_f16 import F16DeviceWeight
from perfx.ops.params import SUBGROUPS_NEED, Checked, ParamSpace, Rule
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.runtime import Device

# One .cl file, seven families: each define carries its kernel's number (CLBlast's WGS1, WGS2, ...); the four
# elementwise kernels (swiglu, geglu, sigmoid_mul, softcap) share theirs (VW4, WGS4), each family tuned on its
# own.
EMBEDDING_F16 = ParamSpace(
    family="embedding_f16",
    source="small_ops.cl",
    space={"VW1": (8, 4), "WGS1": (64, 128, 32)},
    work_group_size=lambda p, s: p["WGS1"],
)
EMBEDDING_Q4 = ParamSpace(
    family="embedding_q4",
    source="small_ops.cl",
    space={"WGS2": (64, 32, 128),
           "LAYOUT": (0, 1)},   # the table's layout (rows along K, interleaved): set from the weight
    work_group_size=lambda p, s: p["WGS2"],
)
ARGMAX = ParamSpace(
    family="argmax",
    source="small_ops.cl",
    # SG3: the work-group step by a local-memory tree (0) or subgroup reductions of 64-bit keys (1)
    space={"WGS3": (128, 64, 256), "GROUPS3": (64, 16, 256), "VW3": (4, 1), "SG3": (0, 1)},
    rules=(Rule("the local-memory tree halves WGS3: a power of two",
                lambda p, s: p["WGS3"] & (p["WGS3"] - 1) == 0),),
    work_group_size=lambda p, s: p["WGS3"],
    local_memory=lambda p, s: 8 * p["WGS3"] * (2 if p["SG3"] else 1),
    needs={"SG3": SUBGROUPS_NEED},
)


def _elementwise(family: str) -> ParamSpace:
    return ParamSpace(family=family, source="small_ops.cl", space={"VW4": (4, 8, 1), "WGS4": (64, 128, 256)},
                      work_group_size=lambda p, s: p["WGS4"])


SWIGLU = _elementwise("swiglu")
GEGLU = _elementwise("geglu")
SIGMOID_MUL = _elementwise("sigmoid_mul")
SOFTCAP = _elementwise("softcap")


def _part(params, space: ParamSpace):
    """The part of ``params`` that is ``space``'s: all of it where it is a set checked for that space."""
    if isinstance(params, Checked) and params.space is space:
        return params
    return {name: value for name, value in params.items() if name in space.space}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Embedding:
    """out (rows, K) float32 = table[ids]·scale, ids an int32 device buffer; an id outside [0, N) gives NaN.

    ``scale`` multiplies each gathered row in fp32: 1 for most models, √hidden for Gemma (llama.cpp's
    ggml_scale after the gather)."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        params = params or {}
        self.device = device
        f16 = EMBEDDING_F16.resolve(_part(params, EMBEDDING_F16), shape or {}, device.caps)
        q4 = EMBEDDING_Q4.resolve(_part(params, EMBEDDING_Q4), shape or {}, device.caps)
        unknown = set(params) - set(f16) - set(q4)
        if unknown:
            raise PerfxError(f"embedding: unknown parameters {sorted(unknown)}; "
                             f"known: {sorted({**f16, **q4})}")
        self.params = {**f16, **q4}
        self.f16_kernel = device.kernel(EMBEDDING_F16.source, "embedding_f16", f16)
        self.q4_kernel = device.kernel(EMBEDDING_Q4.source, "embedding_q4", q4)

    def _q4_kernel(self, table: Q4DeviceWeight):
        """The int4 gather for the table's layout and scales' form (the tuned WGS2; both come from the weight)."""
        return self.q4_kernel_for(table.layout, table.defines)

    def q4_kernel_for(self, layout: int, form_defines: dict):
        """The int4 gather for a table's layout and its scales' form defines (``Q4DeviceWeight.defines``)."""
        if layout == self.params["LAYOUT"] and not form_defines:
            return self.q4_kernel
        defines = {"WGS2": self.params["WGS2"], "LAYOUT": layout, **form_defines}
        return self.device.kernel(EMBEDDING_Q4.source, "embedding_q4", defines)

    def f16(self, table: F16DeviceWeight, ids, out, rows: int, scale: float = 1.0) -> list:
        """Gather from an fp16 table (possibly split in row blocks): one event per block, in order."""
        if rows < 1:
            raise PerfxError(f"embedding: rows = {rows} must be at least 1")
        ids = device_buffer(ids, 4 * rows, "embedding ids")
        out = device_buffer(out, 4 * rows * table.k, "embedding out")
        wgs, vw = self.params["WGS1"], self.params["VW1"]
        global_size = (_round_up(-(-table.k // vw), wgs), rows)
        return [self.device.launch(self.f16_kernel, global_size, (wgs, 1), np.int32(table.k),
                                   np.int32(table.n), np.int32(start), np.int32(stop), np.float32(scale), ids,
                                   block, out)
                for block, (start, stop) in zip(table.blocks, table.block_rows)]

    def q4(self, table: Q4DeviceWeight, ids, out, rows: int, scale: float = 1.0):
        """Gather and dequantize (w = s·q + m, any int4 form) from an int4 table loaded with the 'buffer' read path."""
        if rows < 1:
            raise PerfxError(f"embedding: rows = {rows} must be at least 1")
        if table.buffer is None:
            raise PerfxError("embedding_q4 reads the codes buffer: upload the table with read_paths "
                             "including 'buffer'")
        ids = device_buffer(ids, 4 * rows, "embedding ids")
        out = device_buffer(out, 4 * rows * table.k, "embedding out")
        wgs = self.params["WGS2"]
        return self.device.launch(self._q4_kernel(table), (_round_up(table.k // 32, wgs), rows), (wgs, 1),
                                  np.int32(table.k), np.int32(table.n), np.int32(table.group),
                                  np.float32(scale), ids, table.buffer, table.scale_offset, out)


class Argmax:
    """The index of the largest of x (n floats) into an int32 device buffer; ties to the lowest index."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        self.device = device
        self.params = ARGMAX.resolve(params, shape or {}, device.caps)
        self.wgs, self.groups = self.params["WGS3"], self.params["GROUPS3"]
        self.partial_kernel = device.kernel(ARGMAX.source, "argmax_partial", self.params)
        self.final_kernel = device.kernel(ARGMAX.source, "argmax_final", self.params)
        # One (value, index) pair per stage-1 work-group, whatever n: allocated once, here.
        self.partial_values = device.alloc(4 * self.groups, what="argmax partial values")
        self.partial_indices = device.alloc(4 * self.groups, what="argmax partial indices")

    def __call__(self, x, n: int, out_index) -> list:
        """Enqueue both stages; returns their two events (the second finishes last)."""
        if not 1 <= n < 2**31:
            raise PerfxError(f"argmax: n = {n} must be between 1 and 2³¹ − 1")
        x = device_buffer(x, 4 * n, "argmax x")
        out_index = device_buffer(out_index, 4, "argmax out_index")
        partial = self.device.launch(self.partial_kernel, (self.groups * self.wgs,), (self.wgs,), np.int32(n),
                                     x, self.partial_values, self.partial_indices)
        final = self.device.launch(self.final_kernel, (self.wgs,), (self.wgs,), self.partial_values,
                                   self.partial_indices, out_index)
        return [partial, final]


class SwiGLU:
    """out = SiLU(gate)·up over ``count`` floats (M rows of the intermediate size, flat)."""

    space, kernel_name = SWIGLU, "swiglu"   # GeGLU: the same op, its own family and kernel

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        self.device = device
        self.params = self.space.resolve(params, shape or {}, device.caps)
        self.kernel = device.kernel(self.space.source, self.kernel_name, self.params)

    def __call__(self, gate, up, out, count: int):
        """Enqueue out = act(gate)·up; out may alias gate or up. Returns the event."""
        name = self.kernel_name
        if count < 1:
            raise PerfxError(f"{name}: count = {count} must be at least 1")
        nbytes = 4 * count
        args = (device_buffer(gate, nbytes, f"{name} gate"), device_buffer(up, nbytes, f"{name} up"),
                device_buffer(out, nbytes, f"{name} out"))
        wgs = self.params["WGS4"]
        return self.device.launch(self.kernel, (_round_up(-(-count // self.params["VW4"]), wgs),), (wgs,),
                                  np.int32(count), *args)


class GeGLU(SwiGLU):
    """out = GELU(gate)·up over ``count`` floats, GELU's tanh form (Gemma's MLP, llama.cpp's ggml_gelu)."""

    space, kernel_name = GEGLU, "geglu"


class SigmoidMul(SwiGLU):
    """out = σ(gate)·up over ``count`` floats: Qwen3.5's attention output times the sigmoid of its gate."""

    space, kernel_name = SIGMOID_MUL, "sigmoid_mul"


class Softcap:
    """x = cap·tanh(x / cap) in place over ``count`` floats: Gemma 2's final-logit soft-capping."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        self.device = device
        self.params = SOFTCAP.resolve(params, shape or {}, device.caps)
        self.kernel = device.kernel(SOFTCAP.source, "softcap", self.params)

    def __call__(self, x, count: int, cap: float):
        """Enqueue the cap over x's first ``count`` floats. Returns the event."""
        if count < 1:
            raise PerfxError(f"softcap: count = {count} must be at least 1")
        if not cap > 0:
            raise PerfxError(f"softcap: cap = {cap} must be positive (a model's final_logit_softcapping)")
        wgs = self.params["WGS4"]
        return self.device.launch(self.kernel, (_round_up(-(-count // self.params["VW4"]), wgs),), (wgs,),
                                  np.int32(count), np.float32(cap), device_buffer(x, 4 * count, "softcap x"))
