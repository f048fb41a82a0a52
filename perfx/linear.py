"""A matrix of the model on the device: its weight and the kernels chosen for it.

Each ``Linear`` is one weight in one form — int4 (``Q4Linear``: gemv_q4 for decode, gemm_q4 for prompts),
int8 (``Q8Linear``: gemv_q8, gemm_q8 and its gather for a table) or fp16 (``F16Linear``: gemv_f16 row by row)
— so the forward calls ``linear(x, y, m, decode)`` and never asks what form a weight is in. The form is
chosen once, where the host matrix is uploaded (``upload_linear``).

The kernels themselves come from the model's plan (``perfx.plan.KernelPlan``), read when a Linear runs: the
plan is chosen before the weights are uploaded, and an int4 weight is laid out for the GEMV that reads it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from perfx.errors import PerfxError
from perfx.formats import Q4_PAIRS, Q4Matrix, Q8Matrix
from perfx.ops import Q8_NATURAL, Q8_TEXEL
from perfx.ops.gemv_f16 import F16DeviceWeight
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.ops.q8_weight import Q8DeviceWeight


class Linear(ABC):
    """y = x·Wᵀ for one matrix of role ``role`` (qkv, o, gate_up, down, conv_in, …, lm_head, embedding).

    ``model`` gives the plan (its kernels) and the run state (scratch rows for the fp16 path); gate_up carries
    the gate's activation·up epilogue of the recipe."""

    def __init__(self, model, role: str, weight, host_nbytes: int):
        self.model, self.role, self.weight = model, role, weight
        self.nbytes = host_nbytes   # bytes a decode step reads of it: the host matrix's, scales included

    @property
    def n(self) -> int:
        return self.weight.n

    _unfused = False   # set for one call by ``unfused``

    @property
    def epilogue(self) -> str:
        return self.model.plan.gate_epilogue if self.role == "gate_up" and not self._unfused else "none"

    def unfused(self, x, y, m: int, decode: bool):
        """gate_up's product without its activation·up: y (m, 2·intermediate) = gate rows, then up rows (Gemma 3n's
        sparse gates need the whole row of gates first)."""
        self._unfused = True
        try:
            return self(x, y, m, decode)
        finally:
            self._unfused = False

    def blocks_order(self, m: int = 1) -> int:
        """The order of the Q8_1 blocks of x that this matrix's product over m rows (the decode GEMV for one)
        reads when its caller has them (``perfx.ops.Q8_TEXEL`` or ``Q8_NATURAL``), 0 where it reads floats or
        quantizes x itself."""
        return 0

    def describe_form(self) -> str | None:
        """The int4 scales' form for the load line, None for other forms."""
        return None

    @abstractmethod
    def __call__(self, x, y, m: int, decode: bool, blocks=None):
        """y (m, N) = x (m, K)·Wᵀ: the decode GEMV for one row (``decode``), else the prompt GEMM. ``blocks``:
        x's Q8_1 blocks and their order (codes and scales, order), which the GEMV reads where it takes them."""

    def rows(self, x, y, count: int):
        """y (count, N) = x (count, K)·Wᵀ for the lm_head over a prompt's rows (perplexity)."""
        return self(x, y, count, decode=False)

    @abstractmethod
    def gather(self, ids, x, m: int, scale: float):
        """The rows of the m token ids in ``ids`` into x, times ``scale`` (the token embedding)."""

    def for_role(self, role: str) -> Linear:
        """The same weight in another role (a tied embedding is also the lm_head): no second copy."""
        return type(self)(self.model, role, self.weight, self.nbytes)

    def _blocks(self, blocks, order: int):
        return blocks[0] if blocks is not None and blocks[1] == order else None


class Q4Linear(Linear):
    """An int4 matrix (AWQ or GGUF Q4), in the layout and read path its decode GEMV reads."""

    # A fused decode step's tail after this matrix's GEMV (``perfx.model.Model._attach_tails``): run(wrapper, weight,
    # x, y, quantized) enqueues the GEMV with its tail (``perfx.ops.gemv_q4_tail``) and returns the events; used
    # while the model enqueues one row of a decode step (``Model.fusing``)
    tail = None

    def blocks_order(self, m: int = 1) -> int:
        plan = self.model.plan
        if m == 1:
            return Q8_TEXEL if plan.gemv[self._gemv_role].reads_quantized else 0
        # over several rows (a batched decode step, a short prompt): the int8-activation GEMM reads X as the
        # norm's Q8_1 blocks in texel order, the ones its own quantizing launch would write
        gemm = plan.prefill(m)[0].get(self.role)
        return Q8_TEXEL if gemm is not None and gemm.choose(m) == "i8" else 0

    def describe_form(self) -> str:
        return self.weight.describe_form()

    @property
    def _gemv_role(self) -> str:
        return "lm_head" if self.role == "embedding" else self.role

    def __call__(self, x, y, m: int, decode: bool, blocks=None):
        plan = self.model.plan
        if decode:
            if self.tail is not None and self.model.fusing:
                return self.tail(plan.gemv_tail[self.role], self.weight, x, y, self._blocks(blocks, Q8_TEXEL))[-1]
            return plan.gemv[self._gemv_role](self.weight, x, y, self.epilogue,
                                              quantized=self._blocks(blocks, Q8_TEXEL))
        epilogue = "bias" if self.epilogue == "none" and self.weight.bias is not None else self.epilogue
        return plan.prefill(m)[0][self.role](self.weight, x, y, m, epilogue,
                                             quantized=self._blocks(blocks, Q8_TEXEL))

    def rows(self, x, y, count: int):
        return self.model.plan.head_rows(self.weight, x, y, count)

    def gather(self, ids, x, m: int, scale: float):
        return self.model.plan.embed.q4(self.weight, ids, x, m, **_scale(scale))


class Q8Linear(Linear):
    """An int8 matrix (GGUF Q5_x, Q6_K, Q8_0 and the quantized lm_head), in row blocks."""

    def _gemv(self):
        return self.model.plan.q8("gemv", self.role, self.weight)

    def blocks_order(self, m: int = 1) -> int:
        return Q8_NATURAL if m == 1 and self._gemv().reads_blocks(self.weight) else 0

    def __call__(self, x, y, m: int, decode: bool, blocks=None):
        plan = self.model.plan
        if decode:
            gemv = self._gemv()
            quantized = self._blocks(blocks, Q8_NATURAL) if gemv.reads_blocks(self.weight) else None
            return gemv(self.weight, x, y, self.epilogue, quantized=quantized)
        epilogue = "bias" if self.epilogue == "none" and self.weight.has_bias else self.epilogue
        return plan.q8("gemm", self.role, self.weight, m)(self.weight, x, y, m, epilogue)

    def gather(self, ids, x, m: int, scale: float):
        return self.model.plan.q8("embedding", "embedding", self.weight, m)(self.weight, ids, x, m, **_scale(scale))


class F16Linear(Linear):
    """An fp16 matrix (an unquantized checkpoint): the fp16 GEMV row by row, through scratch rows. The slow
    path: a checkpoint loaded with --quantize q4 runs the int4 kernels instead."""

    def __call__(self, x, y, m: int, decode: bool, blocks=None):
        d, plan, s = self.model.device, self.model.plan, self.model.state
        k, n = self.weight.k, self.weight.n
        gated = self.epilogue in ("silu_mul", "gelu_mul")
        cols = n // 2 if gated else n
        if self.role == "lm_head" and m == 1:   # straight into the logits
            return plan.gemv_f16(self.weight, x, y)
        for r in range(m):
            d.copy(s.row_in, x, 4 * k, src_offset=4 * r * k)
            plan.gemv_f16(self.weight, s.row_in, s.row_out)
            result = s.row_out
            if gated:
                d.copy(s.row_up, s.row_out, 4 * cols, src_offset=4 * cols)
                plan.gate(s.row_out, s.row_up, s.row_act, cols)
                result = s.row_act
            d.copy(y, result, 4 * cols, dst_offset=4 * r * cols)

    def rows(self, x, y, count: int):
        d, s, k, v = self.model.device, self.model.state, self.weight.k, self.weight.n
        for r in range(count):
            d.copy(s.row_in, x, 4 * k, src_offset=4 * k * r)
            self.model.plan.gemv_f16(self.weight, s.row_in, s.logits)
            d.copy(y, s.logits, 4 * v, dst_offset=4 * v * r)

    def gather(self, ids, x, m: int, scale: float):
        return self.model.plan.embed.f16(self.weight, ids, x, m, **_scale(scale))


def _scale(scale: float) -> dict:
    return {"scale": scale} if scale != 1.0 else {}


def int4_as_int8(w: Q4Matrix) -> Q8Matrix:
    """The values of an int4 matrix in the int8 form of the fewest bytes that holds them exactly: (s, m) pairs
    keep their fp16 pair beside codes 0..15 (1.125 bytes a weight at group 32); the zero-point forms become codes
    q − z beside their fp16 scale alone (symmetric: 1.0625), w = s·(q − z) unchanged."""
    if w.form == Q4_PAIRS:
        return Q8Matrix(w.codes.astype(np.int8), w.scales, w.offsets, w.group)
    codes = w.codes.astype(np.int8)
    n, k = codes.shape
    codes.reshape(n, k // w.group, w.group)[...] -= w.zero_points().astype(np.int8)[:, :, None]
    return Q8Matrix(codes, w.scales, np.zeros(w.scales.shape, np.float32), w.group, symmetric=True)


def upload_linear(model, w, what: str, role: str, bias=None) -> Linear:
    """One weight, once, as the Linear of its form: int4 in the layout and read path of the GEMV that reads it
    in decode (``role``: qkv, o, gate_up, down, lm_head, …, or embedding, whose gather reads the codes buffer)."""
    device, plan = model.device, model.plan
    if role == "ple_table" and isinstance(w, Q4Matrix) and w.codes.size // 2 > device.caps.max_alloc:
        # an int4 table is one codes buffer: past the device's largest allocation (a Q4_K Gemma 4 E2B per-layer
        # table is 1.2 GB, an Adreno allocation at most 1 GiB) it is held as int8 of the same values, which the
        # int8 form keeps in row blocks
        w = int4_as_int8(w)
    if isinstance(w, Q8Matrix):
        return Q8Linear(model, role, Q8DeviceWeight.upload(device, w, bias, what=what), w.nbytes)
    if isinstance(w, Q4Matrix):
        layout, paths = plan.q4_upload(role)
        weight = Q4DeviceWeight.upload(device, w, bias, read_paths=tuple(sorted(paths)), what=what, layout=layout)
        return Q4Linear(model, role, weight, w.nbytes)
    if bias is not None:
        raise PerfxError(f"{what}: an fp16 matrix with a bias (Qwen2's QKV) runs only quantized: pass --quantize q4")
    return F16Linear(model, role, F16DeviceWeight.upload(device, w, what=what), w.nbytes)
