"""The int4 GEMV with a tail (``kernels/gemv_q4_tail.cl``): gemv_q4's product on the rows layout, then, by the last
of its row sets to finish, the work that would otherwise be a launch of its own between this GEMV and the next:

- ``norm`` (the o and down projections): the residual add (through the output's own norm where the recipe has
  post-norms) and the next RMSNorm, with its Q8_1 blocks where the next GEMV reads int8 activations;
- ``q8`` (gate-up): its output as Q8_1 blocks, the down projection's input, so down quantizes nothing itself.

How the outputs cross work-groups (HANDOFF) follows the device: relaxed atomic stores and loads (plain moves on a
CPU) ordered by the counter's
acquire-release increment where its compiler takes OpenCL C 2.0 or later (built with that ``-cl-std``), OpenCL 1.2's
atomic store and load of every output elsewhere (``handoff_for``).

Its parameters are gemv_q4's rows layout's (``perfx.ops.gemv_q4.ROWS_LAYOUT``) but READ 1 (image2d row blocks, which
the product splits into several launches where the tail counts the row sets of one), and ARRIVAL: who counts on
the counter, every row set (0) or, with one lane a row set, each work-group once after a barrier (1). A set tuned for
the plain product at the same matrix runs here as ``tail_params`` makes it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyopencl as cl

from perfx.errors import PerfxError
from perfx.formats import Q4_PAIRS
from perfx.ops import device_buffer
from perfx.ops.epilogue import is_gated, output_rows
from perfx.ops.gemv_q4 import ROWS_LAYOUT, GemvQ4
from perfx.ops.params import Rule, Variants
from perfx.ops.q4_weight import LAYOUT_ROWS, Q4DeviceWeight
from perfx.runtime import Device

TAILS = {"norm": 1, "q8": 2}   # the TAIL define of each tail
ORDERS = (0, 1, 2)             # the Q8_1 blocks' order: none, kernels/q8_1.h's Q8_1_TEXEL, Q8_1_NATURAL

TAIL_ROWS = replace(
    ROWS_LAYOUT, family="gemv_q4_tail", source="gemv_q4_tail.cl",
    # ARRIVAL: who counts on the counter, every row set (0) or, with one lane a row set, each work-group once (1)
    space={**ROWS_LAYOUT.space, "READ": (0, 2), "ARRIVAL": (0, 1)},
    rules=(*ROWS_LAYOUT.rules,
           Rule("a work-group's one arrival (ARRIVAL 1) waits at a barrier for all its work-items: one lane a "
                "row set (LANES 1), where none has returned", lambda p, s: p["ARRIVAL"] == 0 or p["LANES"] == 1)),
    local_memory=lambda p, s: ROWS_LAYOUT.local_memory(p, s) + 4)   # and the last arrival's flag
PARAMS = Variants(family="gemv_q4_tail", key="LAYOUT", variants={LAYOUT_ROWS: TAIL_ROWS})


HANDOFFS = {"atomics": 0, "ordered": 1}   # the HANDOFF define of each hand-off


ORDERED_FEATURES = {"__opencl_c_atomic_order_acq_rel", "__opencl_c_atomic_scope_device"}


def handoff_for(caps) -> int:
    """The hand-off a device's compiler allows: ordered relaxed loads in OpenCL C 2.x, or 3.0 with the acquire-release
    order and the device scope among its features (Oclgrind lists 3.0 with none), else atomics."""
    if caps.opencl_c >= (3, 0):
        ordered = ORDERED_FEATURES <= set(caps.c_features)
    else:
        ordered = caps.opencl_c >= (2, 0)
    return HANDOFFS["ordered"] if ordered else HANDOFFS["atomics"]


def tail_params(params: dict) -> dict | None:
    """A gemv_q4 parameter set as this family's (the same product; a work-group's one arrival where it has one lane a
    row set), or None where it cannot carry a tail (the interleaved layout, image2d row blocks)."""
    if params.get("LAYOUT") != LAYOUT_ROWS or params.get("READ") not in TAIL_ROWS.space["READ"]:
        return None
    return {**params, "ARRIVAL": int(params["LANES"] == 1)}


class GemvQ4Tail(GemvQ4):
    """y = W·x on a rows-layout ``Q4DeviceWeight``, then its tail: ``norm`` or ``q8``, each one launch."""

    PARAMS = PARAMS

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None,
                 handoff: int | None = None):
        """``handoff``: a ``HANDOFFS`` value (None: ``handoff_for`` the device)."""
        super().__init__(device, params, shape)
        if handoff not in (None, *HANDOFFS.values()):
            raise PerfxError(f"gemv_q4_tail: handoff {handoff!r} is none of {HANDOFFS} (None: the device's)")
        self.handoff = handoff_for(device.caps) if handoff is None else handoff
        # the row sets' arrival count: zero at allocation, left zero by every launch's last arrival
        self._counter = device.alloc(4, np.zeros(1, np.int32), what="gemv_q4_tail counter")
        self._unused = device.alloc(64, np.zeros(16, np.float32), what="gemv_q4_tail placeholder")

    def kernel(self, group: int, epilogue: str, k: int = 0, form: int = Q4_PAIRS, extra: tuple = ()) -> cl.Kernel:
        """gemv_q4's kernel with the tail's ``extra`` defines and this wrapper's hand-off."""
        return super().kernel(group, epilogue, k, form, (*extra, ("HANDOFF", self.handoff)))

    def newest_c(self, defines: dict) -> bool:
        return super().newest_c(defines) or defines["HANDOFF"] == HANDOFFS["ordered"]

    def norm(self, weight: Q4DeviceWeight, x, y, residual, gamma, eps: float, out, post_gamma=None, blocks=None,
             order: int = 0, quantized=None) -> list:
        """Enqueue p = W·x into y, then residual += p (or += rmsnorm(p)·post_gamma) and out = rmsnorm(residual)·γ,
        with out's Q8_1 blocks (codes, steps and sums) in ``order`` where ``blocks`` is given; returns the events.
        ``quantized``: x's own Q8_1 blocks, as ``GemvQ4.events`` takes them."""
        n = weight.n
        if order not in ORDERS or (order and (blocks is None or n % 32)):
            raise PerfxError(f"gemv_q4_tail: Q8_1 blocks in order {order} need the blocks' buffers and N a multiple "
                             f"of 32 (N = {n}); pass order 0 for none")
        codes, steps = self._blocks(blocks, n) if order else (self._unused, self._unused)
        args = (self._counter, device_buffer(residual, 4 * n, "gemv_q4_tail residual"),
                device_buffer(gamma, 4 * n, "gemv_q4_tail γ"),
                self._unused if post_gamma is None else device_buffer(post_gamma, 4 * n, "gemv_q4_tail γ_post"),
                np.float32(eps), device_buffer(out, 4 * n, "gemv_q4_tail normed output"), codes, steps,
                cl.LocalMemory(4))
        defines = (("TAIL", TAILS["norm"]), ("POST", int(post_gamma is not None)), ("Q8X", order))
        return self.events(weight, x, y, "none", quantized, (defines, args))

    def quantize_output(self, weight: Q4DeviceWeight, x, y, blocks, order: int, epilogue: str = "none",
                        quantized=None) -> list:
        """Enqueue y = W·x (gate-up's epilogue where given), then y's Q8_1 blocks (codes, steps and sums) in
        ``order``; returns the events."""
        m = output_rows(weight.n, epilogue)
        if order not in ORDERS[1:] or m % 32:
            raise PerfxError(f"gemv_q4_tail: the output's Q8_1 blocks need order 1 or 2 (got {order}) and its length "
                             f"a multiple of 32 (got {m}{' gated' if is_gated(epilogue) else ''})")
        defines = (("TAIL", TAILS["q8"]), ("POST", 0), ("Q8X", order))
        args = (self._counter, self._unused, self._unused, self._unused, np.float32(0.0), self._unused,
                *self._blocks(blocks, m), cl.LocalMemory(4))
        return self.events(weight, x, y, epilogue, quantized, (defines, args))

    @staticmethod
    def _blocks(blocks, m: int) -> tuple:
        """The Q8_1 blocks' buffers of m values: m int8 codes, m/32 (step, sum) pairs."""
        return (device_buffer(blocks[0], m, "gemv_q4_tail Q8_1 codes"),
                device_buffer(blocks[1], 8 * (m // 32), "gemv_q4_tail Q8_1 steps and sums"))
