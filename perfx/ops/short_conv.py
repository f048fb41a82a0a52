"""The short causal convolution of LFM2's conv layers (and the plain form of Qwen3.5's), over a history ring.

Wraps ``kernels/short_conv.cl``: per channel, y = C·(w ⋆ (B·x)) over the last L positions (GATED) or
y = act(w ⋆ x). The convolution's state is a ring of R rows per layer (``ConvHistory``): u of position p in
row p mod R, so resuming at any position within R − L + 1 of the last one written (a new chat turn that
shares a prefix, a rejected speculative draft) needs no copy of the state. The position is read on the
device, as the decode attention reads it: a recorded launch serves every position.
"""

from __future__ import annotations

import numpy as np

from perfx.errors import PerfxError
from perfx.ops import DevicePosition, buffer_bytes
from perfx.ops.params import ParamSpace
from perfx.runtime import Device

HISTORY_ROWS = 64   # positions of u kept per layer: a rollback of up to R − L + 1 positions resumes exactly
MAX_LENGTH = 8      # the longest convolution built (LFM2: 3, Qwen3.5: 4)

PARAMS = ParamSpace(
    family="short_conv",
    source="short_conv.cl",
    space={"WGS": (128, 64, 256)},   # channels per work-group
    work_group_size=lambda p, s: p["WGS"],
)


class ConvHistory:
    """The rings of every conv layer of a model: (layers, R, H) float32 on the device."""

    def __init__(self, device: Device, layers: int, hidden: int, rows: int = HISTORY_ROWS):
        if layers < 1 or hidden < 1 or rows < 2:
            raise PerfxError(f"short_conv history: {layers} layers × {rows} rows × {hidden} channels do not fit")
        self.layers, self.hidden, self.rows = layers, hidden, rows
        # The first position whose row holds the text now run: 0, or where a restore point put the rings back
        # (``perfx.ops.restore_points``: it restores only the rows a forward there reads).
        self.first = 0
        self.nbytes = 4 * layers * rows * hidden
        self.buffer = device.alloc(self.nbytes, what=f"short_conv history ({layers} layers × {rows} positions)")

    def resumable(self, length: int, last: int, at: int) -> bool:
        """Whether the state before position ``at`` is still in the rings, the last position written being
        ``last`` (−1: none yet): positions at − L + 1 .. at − 1 neither overwritten nor before ``first``."""
        return at <= last + 1 and (at == 0 or (last - (at - length + 1) < self.rows
                                               and max(0, at - length + 1) >= self.first))


class ShortConv:
    """y (m, H) = the short convolution of m positions from ``pos`` for one layer's ring of a ``ConvHistory``.

    Constructed as every wrapper is, from the device, the tunables (``params``; None: the defaults) and the
    spec's shape: ``l`` the length L, ``gated`` (LFM2's B·x in, C· out; default True) or plain with ``act``
    ("none", "silu")."""

    def __init__(self, device: Device, params: dict | None = None, shape: dict | None = None):
        shape = dict(shape or {})
        length, gated, act = int(shape.get("l", 3)), bool(shape.get("gated", True)), shape.get("act", "none")
        if not 2 <= length <= MAX_LENGTH:
            raise PerfxError(f"short_conv: a convolution of length {length} is not supported (2 .. {MAX_LENGTH})")
        if act not in ("none", "silu") or (gated and act != "none"):
            raise PerfxError(f"short_conv: activation {act!r}: 'none', or 'silu' for the plain (ungated) form")
        self.device, self.length, self.gated = device, length, gated
        self.params = PARAMS.resolve(params, shape, device.caps)
        self.wgs = self.params["WGS"]
        defines = {**self.params, "CONV_L": length, "GATED": int(gated), "ACT": int(act == "silu")}
        self.kernel = device.kernel(PARAMS.source, "short_conv", defines)
        self.position = DevicePosition(device, "short_conv")

    def __call__(self, x, weight, history: ConvHistory, layer: int, y, m: int, pos: int, position=None):
        """Enqueue: ``x`` (m, 3H) [B | C | x] rows (gated) or (m, H); ``weight`` (H, L) float32; ``y`` (m, H).

        ``position`` (int32 buffer, index) holds ``pos`` when the launch runs (the decode step buffer); None:
        the wrapper writes ``pos`` into its own buffer. Returns the event."""
        h = history.hidden
        if m < 1 or pos < 0:
            raise PerfxError(f"short_conv: m = {m} positions from {pos}: m must be ≥ 1 and the position ≥ 0")
        if not 0 <= layer < history.layers:
            raise PerfxError(f"short_conv: layer {layer} is outside the history's {history.layers} layers")
        width = 3 * h if self.gated else h
        x_b, x_bytes = buffer_bytes(x, "short_conv x")
        w_b, w_bytes = buffer_bytes(weight, "short_conv weight")
        y_b, y_bytes = buffer_bytes(y, "short_conv y")
        if x_bytes < 4 * m * width or w_bytes < 4 * h * self.length or y_bytes < 4 * m * h:
            raise PerfxError(f"short_conv: x must hold {m}×{width}, the weight {h}×{self.length} and y {m}×{h} "
                             f"floats; they hold {x_bytes // 4}, {w_bytes // 4} and {y_bytes // 4}")
        positions, index = self.position(pos, position)
        return self.device.launch(
            self.kernel, (-(-h // self.wgs) * self.wgs,), (self.wgs,), np.int32(m), np.int32(h), x_b, w_b,
            history.buffer, np.int32(layer * history.rows * h), np.int32(history.rows),
            positions, np.int32(index), y_b)
