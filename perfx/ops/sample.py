"""Sampling the next token on the device (``kernels/sample.cl``): the host sampler's distribution
(``perfx.reference.sampling_probs`` of the repetition-penalised logits) drawn with a counter-based uniform
(Philox-4x32-10 of the seed and a counter, ``perfx.reference.sampling_uniform``), so a float64 reference given
the same (seed, counter) draws the same token. Two launches, as the argmax: a pass over the logits in GROUPS
work-groups keeping each group's TOPK best, then one work-group merging them and drawing.

What the device serves (``Sample.supports``): a temperature of 0 (the penalised argmax), or top_k between 1
and TOPK, or no top-k (0, or at least V) where V ≤ TOPK; a repetition-penalty history of at most 256 ids.
Anything else is the host sampler's.
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import DevicePosition, device_buffer
from perfx.ops.params import ParamSpace, Rule
from perfx.runtime import Device

HISTORY_MAX = 256   # kernels/sample.cl HISTORY_MAX: the host sampler's window, history[-256:]


def _top_k_fits(top_k: int, v: int, topk: int) -> bool:
    """Whether a top_k (0: none) at vocabulary size v is served with TOPK candidates."""
    if top_k == 0 or top_k >= v:
        return v <= topk
    return 1 <= top_k <= topk


PARAMS = ParamSpace(
    family="sample",
    source="sample.cl",
    space={"TOPK": (64, 128), "GROUPS": (64, 16, 256)},
    rules=(Rule("top_k must be 1..TOPK (or none where V ≤ TOPK); greedy (temperature 0) needs nothing",
                lambda p, s: s.get("temperature", 1.0) == 0
                or _top_k_fits(s.get("top_k", 1), s.get("v", 1), p["TOPK"])),),
    work_group_size=lambda p, s: p["TOPK"],
    local_memory=lambda p, s: 32 * p["TOPK"] + 8 * p["TOPK"] + 4 * (512 + 256) + 4,
)


class Sample:
    """out (1 int32) = the token drawn from V logits after a history of ids, at (seed, counter, position).

    The logits are only read: the penalty is applied to each logit as it is read, each distinct history id
    once. ``position``, where given, is (an int32 device buffer, index) read on the device as the Philox
    counter's third word (the decode step's position, so a recorded launch draws afresh each step); else 0.
    """

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        self.device = device
        self.params = PARAMS.resolve(params, shape or {}, device.caps)
        self.topk, self.groups = self.params["TOPK"], self.params["GROUPS"]
        self.partial_kernel = device.kernel(PARAMS.source, "sample_partial", self.params)
        self.final_kernel = device.kernel(PARAMS.source, "sample_final", self.params)
        self.partial_keys = device.alloc(8 * self.groups * self.topk, what="sample partial keys")
        self.partial_max = device.alloc(4 * self.groups, what="sample partial maxima")
        self.partial_sum = device.alloc(4 * self.groups, what="sample partial sums")
        self.no_history = device.alloc(4, what="sample empty history")
        self.position = DevicePosition(device, "sample")
        self.append_kernel = device.kernel(PARAMS.source, "sample_history_append", self.params)

    def supports(self, config, v: int) -> bool:
        """Whether a ``SamplingConfig`` (temperature, top_k, top_p, min_p, repetition_penalty) at vocabulary
        size v is drawn on the device (with the last 256 ids of the history, as the host sampler takes);
        False: the host sampler's. top_p, min_p and the penalty are served at any value."""
        return config.temperature == 0 or _top_k_fits(config.top_k, v, self.topk)

    def __call__(self, logits, v: int, out, *, temperature: float, top_k: int, top_p: float = 1.0,
                 min_p: float = 0.0, penalty: float = 1.0, history=None, h: int = 0, seed: int = 0,
                 counter: int = 0, position=None) -> list:
        """Enqueue both passes; returns their two events (the second finishes last)."""
        if not 1 <= v < 2**31 - 1:
            raise PerfxError(f"sample: V = {v} must be between 1 and 2³¹ − 2")
        if temperature < 0 or not 0 < top_p <= 1 or not 0 <= min_p < 1 or not penalty > 0:
            raise PerfxError(f"sample: temperature {temperature} ≥ 0, top_p {top_p} in (0, 1], min_p {min_p} in "
                             f"[0, 1) and penalty {penalty} > 0 are needed (SamplingConfig's rules)")
        if temperature > 0 and not _top_k_fits(top_k, v, self.topk):
            raise PerfxError(f"sample: top_k = {top_k} at V = {v} is not served on the device (1..{self.topk}, "
                             f"or none where V ≤ {self.topk}): sample on the host (Sample.supports)")
        if not 0 <= h <= HISTORY_MAX:
            raise PerfxError(f"sample: a history of {h} ids; the device takes the last {HISTORY_MAX} at most")
        if not 0 <= seed < 2**64 or not 0 <= counter < 2**64:
            raise PerfxError(f"sample: seed {seed} and counter {counter} must be 64-bit unsigned integers")
        logits = device_buffer(logits, 4 * v, "sample logits")
        out = device_buffer(out, 4, "sample out")
        history = device_buffer(history, 4 * h, "sample history") if h else self.no_history
        greedy = temperature == 0
        inv_t = np.float32(1.0 if greedy else 1.0 / max(float(temperature), 1e-8))
        k = top_k if 1 <= top_k < v else self.topk
        positions, index = self.position(0, position)
        partial = self.device.launch(self.partial_kernel, (self.groups * self.topk,), (self.topk,), np.int32(v),
                                     logits, history, np.int32(h), np.float32(penalty), inv_t, self.partial_keys,
                                     self.partial_max, self.partial_sum)
        final = self.device.launch(self.final_kernel, (self.topk,), (self.topk,), np.int32(v), self.partial_keys,
                                   self.partial_max, self.partial_sum, inv_t, np.int32(greedy), np.int32(k),
                                   np.float32(top_p), np.float32(min_p), np.uint32(seed & 0xFFFFFFFF),
                                   np.uint32(seed >> 32), np.uint32(counter & 0xFFFFFFFF),
                                   np.uint32(counter >> 32), positions, np.int32(index), out)
        return [partial, final]

    def append(self, chosen, step, history):
        """The decode loop's penalty window: history[(step[1] + 1) mod 256] = chosen[0] (before ``NextStep`` moves
        the position on), history a ring of 256 int32 ids by position, unused slots −1."""
        return self.device.launch(self.append_kernel, (1,), (1,), device_buffer(chosen, 4, "sample chosen"),
                                  device_buffer(step, 8, "sample step"),
                                  device_buffer(history, 4 * HISTORY_MAX, "sample history ring"))
