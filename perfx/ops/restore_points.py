"""Restore points: copies, on the device, of a model's recurrent state at chosen positions, so that a forward
can continue at such a position after later positions have run (a chat turn that edits an earlier one, serve
requests sharing a system prompt, a rejected speculative draft).

A KV cache is positional and keeps every position; the recurrent state does not. Qwen3.5's Gated DeltaNet
state S holds the last position only, and the conv rings (LFM2's, and the DeltaNet's short convolution) the
last ``HISTORY_ROWS``. A restore point at position p holds what a forward at p reads of them: every delta
layer's S after positions 0..p−1 and the ring rows of positions p − L + 1 .. p − 1 of every conv layer (the
rest of a ring is not read before it is written again). Taking and restoring one are device copies only.

``RestorePoints`` keeps ``kept`` of them, least recently used out, plus, where the model's state cannot roll
back by itself, one for speculative verification (the state before the verification forward, replaced every
step). All are allocated at load, so the device memory they take shows in the load line.
"""

from __future__ import annotations

import collections

from perfx.ops.gated_delta_net import DeltaState
from perfx.ops.short_conv import ConvHistory
from perfx.runtime import Device

KEPT = 3   # restore points kept for prompt ends (LRU): a system prompt, the last turns' boundaries


class DeltaPart:
    """What a restore point holds of the delta layers' states: every layer's S whole."""

    def __init__(self, delta: DeltaState):
        self.delta = delta
        self.nbytes = delta.nbytes

    def move(self, move, pos: int, offset: int) -> None:
        per_layer = self.nbytes // len(self.delta.buffers)
        for i, buffer in enumerate(self.delta.buffers):
            move(buffer, 0, offset + i * per_layer, per_layer)

    def restored(self, pos: int) -> None:
        pass


class RingPart:
    """What a restore point holds of a set of conv rings with convolutions of length ``length``: the rows of
    positions p − L + 1 .. p − 1 of every layer (the rest of a ring is not read before it is written again)."""

    def __init__(self, history: ConvHistory, length: int):
        self.history, self.rows = history, length - 1
        self.row_bytes = 4 * history.hidden
        self.nbytes = self.rows * history.layers * self.row_bytes

    def move(self, move, pos: int, offset: int) -> None:
        h = self.history
        # Positions before 0 are read as zeros by the kernel: only the rows of positions ≥ 0 matter.
        for j, q in enumerate(range(pos - self.rows, pos)):
            if q < 0:
                continue
            for layer in range(h.layers):
                move(h.buffer, (layer * h.rows + q % h.rows) * self.row_bytes,
                     offset + (j * h.layers + layer) * self.row_bytes, self.row_bytes)

    def restored(self, pos: int) -> None:
        self.history.first = max(0, pos - self.rows)


class RestorePoints:
    """Restore points of one model's recurrent state, made of ``parts`` (``DeltaPart``, ``RingPart``: each
    layer kind with recurrent state brings its own); ``verification``: keep a slot for a speculative step's
    rollback, where some part cannot roll back by itself."""

    def __init__(self, device: Device, parts: list, verification: bool, kept: int = KEPT):
        self.device, self.parts = device, list(parts)
        self.bytes_each = sum(part.nbytes for part in self.parts)
        slots = kept + verification
        self.buffers = [device.alloc(self.bytes_each, what=f"restore point {i + 1} of {slots}")
                        for i in range(slots)]
        self.nbytes = slots * self.bytes_each
        self.kept = kept
        self.positions: collections.OrderedDict[int, int] = collections.OrderedDict()   # position -> slot, LRU
        self.verification: int | None = None     # the position the verification slot holds

    def __contains__(self, pos: int) -> bool:
        return pos in self.positions or pos == self.verification

    def take(self, pos: int, verification: bool = False) -> None:
        """Copy the live state, which is the state at ``pos`` (the last position run), into a restore point:
        the verification slot, or the least recently used of the kept ones."""
        if verification:
            slot, self.verification = self.kept, pos
        elif pos in self.positions:
            slot = self.positions.pop(pos)
        elif len(self.positions) < self.kept:
            slot = len(self.positions)
        else:
            slot = self.positions.pop(next(iter(self.positions)))
        if not verification:
            self.positions[pos] = slot
        self._copy(pos, self.buffers[slot], to_point=True)

    def restore(self, pos: int) -> None:
        """Make the live state the one kept at ``pos`` (which must be held: ``pos in self``)."""
        if pos in self.positions:
            self.positions.move_to_end(pos)
            slot = self.positions[pos]
        else:
            slot = self.kept
        self._copy(pos, self.buffers[slot], to_point=False)
        for part in self.parts:
            part.restored(pos)

    def forget_after(self, pos: int) -> None:
        """A forward is about to write position ``pos``: the points after it describe text that is rewritten."""
        for kept in [p for p in self.positions if p > pos]:
            del self.positions[kept]
        if self.verification is not None and self.verification > pos:
            self.verification = None

    def clear(self) -> None:
        self.positions.clear()
        self.verification = None

    def _copy(self, pos: int, point, to_point: bool) -> None:
        d = self.device

        def move(live, live_offset: int, point_offset: int, nbytes: int):
            if to_point:
                d.copy(point, live, nbytes, src_offset=live_offset, dst_offset=point_offset)
            else:
                d.copy(live, point, nbytes, src_offset=point_offset, dst_offset=live_offset)

        offset = 0
        for part in self.parts:
            part.move(move, pos, offset)
            offset += part.nbytes
