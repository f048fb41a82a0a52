"""Short-convolution layers (LFM2): the in-projection to B, C and x; C·(taps ⋆ B·x) over the last L positions;
the out-projection.

State: one ring of the last inputs per conv layer (``perfx.ops.short_conv.ConvHistory``). A forward resumes
where the ring still holds the L − 1 inputs before it, or at a restore point of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from perfx.mixers import Mixer
from perfx.op import Op, StepOptions, shared
from perfx.ops.restore_points import RingPart
from perfx.ops.short_conv import ConvHistory
from perfx.reference import linear as linear64
from perfx.reference import short_conv


@dataclass
class ConvWeights:
    """A conv layer's weights: host matrices (from a source) or Linears (on the device)."""

    matrices: ClassVar[tuple[str, ...]] = ("conv_in", "conv_out")
    conv_in: object        # (3·hidden, hidden): B, C, x rows
    conv_weight: object    # float32 (hidden, L): the taps
    conv_out: object       # (hidden, hidden)


class ShortConvMixer(Mixer):
    kind = "conv"

    scratch = ("bcx", "mixed")
    state_fields = ("history",)

    # -- host side: conv_in and conv_out as the file holds them, the taps -----------------------------------

    Weights = ConvWeights
    misplaced = {("attention", "q"): "holds attention tensors but {arch}.attention.head_count_kv gives it no kv "
                                     "heads (a conv layer)"}

    @staticmethod
    def taps(c) -> int:
        return c.hidden_size

    @classmethod
    def synthetic(cls, c, random_matrix, rng) -> ConvWeights:
        hidden = c.hidden_size
        taps = (rng.standard_normal((hidden, c.conv_length)) / np.sqrt(c.conv_length)).astype(np.float32)
        return ConvWeights(conv_in=random_matrix(rng, 3 * hidden, hidden), conv_weight=taps,
                           conv_out=random_matrix(rng, hidden, hidden))

    @staticmethod
    def linears(c) -> list[tuple[str, int, int, bool]]:
        h = c.hidden_size
        return [("conv_in", 3 * h, h, False), ("conv_out", h, h, False)]

    @staticmethod
    def conv_shape(c, m: int) -> dict:
        """The short convolution's shape key (``tuning/short_conv.py``) for m positions: LFM2's gated form over
        hidden channels, at a position past the first ring of history, where every launch reads the ring."""
        return {"h": c.hidden_size, "l": c.conv_length, "m": m, "pos": 131, "gated": True}

    @classmethod
    def ops(cls, c, m: int, options: StepOptions, prefill: bool = False) -> list[Op]:
        """In-projection to B, C, x; the gated short convolution over the ring (tuned at one row: its wrapper runs
        every m); out-projection."""
        conv = Op("short_conv", cls.conv_shape(c, 1), "conv", tuple(c.layers_of(cls.kind)), reads=("bcx", "history"),
                  writes=("mixed", "history"), m=m)
        return (cls.matrix_ops(c, "conv_in", m, options, prefill, ("xb",), ("bcx",)) + [shared(conv, prefill)]
                + cls.matrix_ops(c, "conv_out", m, options, prefill, ("mixed",), ("proj",)))

    def upload(self, w, layer: int) -> int:
        m, h = self.model, w.mixing
        self.weights[layer] = ConvWeights(conv_in=m.upload(h.conv_in, f"layer {layer} conv in_proj", "conv_in"),
                                          conv_weight=m.vector(h.conv_weight),
                                          conv_out=m.upload(h.conv_out, f"layer {layer} conv out_proj", "conv_out"))
        return h.conv_in.nbytes + h.conv_out.nbytes + h.conv_weight.nbytes

    def xb_readers(self, layer: int) -> list:
        return [self.weights[layer].conv_in]

    def linears_of(self, layer: int) -> list:
        w = self.weights[layer]
        return [w.conv_in, w.conv_out]

    def allocate(self) -> None:
        c, d, s = self.model.config, self.model.device, self.model.state
        self.bcx = d.empty((s.chunk, 3 * c.hidden_size), np.float32)   # the in-projection [B | C | x]
        self.mixed = d.empty((s.chunk, c.hidden_size), np.float32)     # the gated convolution's output
        self.bind(self.new_state())

    def new_state(self) -> dict:
        return {"history": ConvHistory(self.model.device, len(self.layers), self.model.config.hidden_size)}

    def copy_state(self, src: dict, dst: dict, positions: int) -> None:
        copy_history(self.model.device, src["history"], dst["history"])

    def forward(self, layer: int, m: int, pos: int, decode: bool, position=None, split=None) -> None:
        model, w = self.model, self.weights[layer]
        w.conv_in(model.state.xb, self.bcx, m, decode, model.xb_blocks(m))
        model.plan.short_conv(self.bcx, w.conv_weight, self.history, self.slot[layer], self.mixed, m, pos,
                              position=position)
        w.conv_out(self.mixed, model.state.proj, m, decode)

    def forward_rows(self, layer: int, m: int, rows) -> None:
        model, w = self.model, self.weights[layer]
        h = model.config.hidden_size
        w.conv_in(model.state.xb, self.bcx, m, m == 1, model.xb_blocks(m))
        convolve_rows(model, rows, self, self.bcx, 3 * h, self.mixed, h,
                      lambda x, y, history, pos, position: model.plan.short_conv(
                          x, w.conv_weight, history, self.slot[layer], y, 1, pos, position=position))
        w.conv_out(self.mixed, model.state.proj, m, m == 1)

    @staticmethod
    def reference(xb, w, c, cache, layer: int, positions, recipe) -> np.ndarray:
        w = w.mixing
        y, cache.conv[layer] = short_conv(linear64(xb, w.conv_in), w.conv_weight, cache.conv[layer])
        return linear64(y, w.conv_out)

    # -- state rules: the rings hold the last HISTORY_ROWS inputs ----------------------------------------

    def state_report(self) -> dict:
        return {"conv_state_bytes": self.history.nbytes}

    def restore_parts(self) -> list:
        return [RingPart(self.history, self.model.config.conv_length)]

    def live_at(self, pos: int, written: int) -> bool:
        return self.history.resumable(self.model.config.conv_length, written - 1, pos)

    def reset(self) -> None:
        self.history.first = 0   # the kernel reads positions before 0 as zeros: nothing to clear

    def fill(self, value: float) -> None:
        self.model.device.fill(self.history.buffer, np.float32(value))

    def resume_error(self, pos: int, written: int, kept: list[int]) -> str | None:
        first = max(0, written - self.history.rows + self.model.config.conv_length - 1)
        return (f"position {pos}: this model's conv layers hold their state for positions {first}..{written} only "
                f"(positions 0..{written - 1} were run); prefill from an earlier position (0 always works)")


def copy_history(device, src, dst) -> None:
    """A ``ConvHistory``'s rings copied into another's of the same shape, on the device: the whole ring, since
    the positions it holds wrap around it."""
    device.copy(dst.buffer, src.buffer, src.nbytes)
    dst.first = src.first


def convolve_rows(model, rows, mixer, x, x_width: int, y, y_width: int, convolve) -> None:
    """The short convolution of each row of a batched step over its own sequence's ring: ``convolve(x, y,
    history, pos, position)`` for one row; row 0 reads x and writes y in place, the others through rows of
    scratch (the kernel reads and writes from the buffers' start)."""
    d = model.device
    x_row, y_row = mixer._row_scratch("conv x", x_width), mixer._row_scratch("conv y", y_width)
    for i, pos in enumerate(rows.positions):
        history = rows.state(mixer, i)["history"]
        if i == 0:
            convolve(x, y, history, pos, rows.position(i))
            continue
        d.copy(x_row, x, 4 * x_width, src_offset=4 * i * x_width)
        convolve(x_row, y_row, history, pos, rows.position(i))
        d.copy(y, y_row, 4 * y_width, dst_offset=4 * i * y_width)


MIXER = ShortConvMixer
