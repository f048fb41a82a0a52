"""Gemma 3n's per-token operations (``kernels/altup.cl``): AltUp's router, prediction, correction, the per-layer
input into the streams and the magnitude-matched projections, LAuReL's combination with the attention's output
and the FFN's norm, and the sparse gate of the first layers (``AltUp``). The products around them (LAuReL's
rank-r pair, the streams' projections) are plain GEMVs and GEMMs (``perfx.linear``)."""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import device_buffer
from perfx.ops.params import ParamSpace, Rule
from perfx.runtime import Device

MAX_STREAMS = 8   # kernels/altup.cl MAX_STREAMS

ALTUP = ParamSpace(family="altup", source="altup.cl", space={"WGS": (128, 64, 256)},
                   rules=(Rule("the work-group's sums halve WGS: a power of two",
                               lambda p, s: p["WGS"] & (p["WGS"] - 1) == 0),),
                   work_group_size=lambda p, s: p["WGS"],
                   local_memory=lambda p, s: 4 * (MAX_STREAMS + 1) * p["WGS"] + 4 * MAX_STREAMS)

NAMES = ("altup_router", "altup_predict", "altup_correct", "altup_add_normed", "altup_rescale", "laurel_combine",
         "sparse_gate")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class AltUp:
    """The seven kernels of ``kernels/altup.cl`` at one parameter set; each method enqueues one launch over m rows
    of k floats and returns its event. Streams are A buffers' worth of rows ``stride`` floats apart in one buffer."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        self.device = device
        self.params = ALTUP.resolve(params, shape or {}, device.caps)
        self.kernels = {name: device.kernel(ALTUP.source, name, self.params) for name in NAMES}

    def _rows(self, name: str, m: int, *args):
        wgs = self.params["WGS"]
        return self.device.launch(self.kernels[name], (m * wgs,), (wgs,), *args)

    def _columns(self, name: str, m: int, k: int, *args):
        wgs = self.params["WGS"]
        return self.device.launch(self.kernels[name], (_round_up(k, wgs), m), (wgs, 1), *args)

    @staticmethod
    def _check(what: str, m: int, k: int, streams: int = 1, stride: int | None = None):
        if m < 1 or k < 1:
            raise PerfxError(f"{what}: {m} rows of {k}: both must be at least 1")
        if not 1 <= streams <= MAX_STREAMS:
            raise PerfxError(f"{what}: {streams} AltUp streams; the kernels hold 1 to {MAX_STREAMS}")
        if stride is not None and stride < m * k:
            raise PerfxError(f"{what}: streams {stride} floats apart overlap {m} rows of {k}")

    def router(self, x, gamma, w, mix, out, m: int, k: int, streams: int, n_out: int, eps: float, plus: float):
        """out (m, n_out) = plus + mix (n_out, A) · tanh(W (A, k) · (rmsnorm(x)·γ)) per row; γ the router norm's
        divided by the hidden size."""
        self._check("altup_router", m, k, streams)
        return self._rows("altup_router", m, np.int32(k), np.int32(streams), np.int32(n_out), np.float32(eps),
                          np.float32(plus), device_buffer(x, 4 * m * k, "altup_router x"),
                          device_buffer(gamma, 4 * k, "altup_router gamma"),
                          device_buffer(w, 4 * streams * k, "altup_router w"),
                          device_buffer(mix, 4 * n_out * streams, "altup_router mix"),
                          device_buffer(out, 4 * m * n_out, "altup_router out"))

    def predict(self, s, coefs, out, m: int, k: int, streams: int, stride: int):
        """out[j] = s[j] + Σ_i coefs[t][j·A + i]·s[i] over the A streams."""
        self._check("altup_predict", m, k, streams, stride)
        size = 4 * ((streams - 1) * stride + m * k)
        return self._columns("altup_predict", m, k, np.int32(k), np.int32(streams), np.int32(stride),
                             device_buffer(s, size, "altup_predict streams"),
                             device_buffer(coefs, 4 * m * streams * streams, "altup_predict coefs"),
                             device_buffer(out, size, "altup_predict out"))

    def correct(self, pred, y, scale, gamma, s, first, m: int, k: int, streams: int, stride: int):
        """s[j] = pred[j] + (y − pred[0])·scale[t][j]; first = s[0]·γ."""
        self._check("altup_correct", m, k, streams, stride)
        size = 4 * ((streams - 1) * stride + m * k)
        return self._columns("altup_correct", m, k, np.int32(k), np.int32(streams), np.int32(stride),
                             device_buffer(pred, size, "altup_correct pred"),
                             device_buffer(y, 4 * m * k, "altup_correct y"),
                             device_buffer(scale, 4 * m * streams, "altup_correct scale"),
                             device_buffer(gamma, 4 * k, "altup_correct gamma"),
                             device_buffer(s, size, "altup_correct streams"),
                             device_buffer(first, 4 * m * k, "altup_correct first"))

    def add_normed(self, p, gamma, s, m: int, k: int, streams: int, stride: int, first: int, eps: float):
        """s[j] += rmsnorm(p)·γ for first ≤ j < A."""
        self._check("altup_add_normed", m, k, streams, stride)
        if not 0 <= first <= streams:
            raise PerfxError(f"altup_add_normed: from stream {first} of {streams}")
        size = 4 * ((streams - 1) * stride + m * k)
        return self._rows("altup_add_normed", m, np.int32(k), np.int32(streams), np.int32(stride), np.int32(first),
                          np.float32(eps), device_buffer(p, 4 * m * k, "altup_add_normed p"),
                          device_buffer(gamma, 4 * k, "altup_add_normed gamma"),
                          device_buffer(s, size, "altup_add_normed streams"))

    def rescale(self, target, y, out, m: int, k: int, offset: int = 0, weight: float = 1.0,
                accumulate: bool = False):
        """out[offset:] (m, k) = (accumulate ? out : 0) + weight·y·|target|/|y| per row."""
        self._check("altup_rescale", m, k)
        if offset < 0:
            raise PerfxError(f"altup_rescale: offset {offset} is negative")
        return self._rows("altup_rescale", m, np.int32(k), np.int32(offset), np.float32(weight),
                          np.int32(bool(accumulate)), device_buffer(target, 4 * m * k, "altup_rescale target"),
                          device_buffer(y, 4 * m * k, "altup_rescale y"),
                          device_buffer(out, 4 * (offset + m * k), "altup_rescale out"))

    def laurel_combine(self, a, l, act, gamma_a, gamma_l, gamma_f, x, xb, m: int, k: int, eps: float):
        """x = (rmsnorm(a)·γ_a + act + xb + rmsnorm(l)·γ_l)/√2, then xb = rmsnorm(x)·γ_f."""
        self._check("laurel_combine", m, k)
        row = 4 * m * k
        return self._rows("laurel_combine", m, np.int32(k), np.float32(eps), device_buffer(a, row, "laurel a"),
                          device_buffer(l, row, "laurel l"), device_buffer(act, row, "laurel act"),
                          device_buffer(gamma_a, 4 * k, "laurel gamma_a"),
                          device_buffer(gamma_l, 4 * k, "laurel gamma_l"),
                          device_buffer(gamma_f, 4 * k, "laurel gamma_f"), device_buffer(x, row, "laurel x"),
                          device_buffer(xb, row, "laurel xb"))

    def sparse_gate(self, gu, out, m: int, n: int, z: float):
        """out (m, n) = GELU(max(gate − (mean + z·std), 0))·up over rows gu (m, 2n) of gate, then up."""
        if m < 1 or n < 1:
            raise PerfxError(f"sparse_gate: {m} rows of {n}: the gate needs at least 1 row of at least 1 value")
        return self._rows("sparse_gate", m, np.int32(n), np.float32(z),
                          device_buffer(gu, 8 * m * n, "sparse_gate gu"),
                          device_buffer(out, 4 * m * n, "sparse_gate out"))
