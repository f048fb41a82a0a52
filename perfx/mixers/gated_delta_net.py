"""Gated DeltaNet layers (Qwen3.5's linear attention): q|k|v, z and a|b projected; the short convolution with
SiLU over q|k|v; the recurrence over the layer's state S (token by token for one row, chunked for more); the
gated RMSNorm per v head, as an RMSNorm over rows of d_v and SiLU(z)·; the out-projection. llama.cpp's
qwen35.cpp build_layer_attn_linear, transformers' Qwen3_5GatedDeltaNet.

State: S per layer (``perfx.ops.gated_delta_net.DeltaState``), which holds the last position run only, and the
convolution's ring. A forward resumes at the last position run, at 0, or at a restore point; it cannot roll back
by itself, so speculation keeps a restore point before each verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from perfx.mixers import Mixer
from perfx.mixers.short_conv import convolve_rows, copy_history
from perfx.op import Op, StepOptions, shared
from perfx.ops.gated_delta_net import DeltaState
from perfx.ops.restore_points import DeltaPart, RingPart
from perfx.ops.short_conv import ConvHistory
from perfx.reference import gated_delta_gates, gated_delta_net, rmsnorm_gated, short_conv
from perfx.reference import linear as linear64

ROLES = ("delta_qkv", "delta_z", "delta_ab", "delta_out")
VECTORS = ("conv_weight", "dt_bias", "ssm_a", "delta_norm")


def delta_shape(config, tokens: int) -> dict:
    """The Gated DeltaNet kernels' shape key (``tuning/gated_delta_net.py``) for a delta layer over ``tokens``
    tokens: the gates as the projections give them (a and b), the file's head map."""
    return {"n_k_heads": config.delta_k_heads, "n_v_heads": config.delta_v_heads, "d_k": config.delta_k_dim,
            "d_v": config.delta_v_dim, "tokens": tokens, "head_map": config.delta_head_map, "raw_gates": True}


@dataclass
class DeltaWeights:
    """A delta layer's weights: host matrices (from a source) or Linears (on the device)."""

    matrices: ClassVar[tuple[str, ...]] = ROLES
    delta_qkv: object     # (2·Hk·d_k + Hv·d_v, hidden): q|k|v, the convolution's input
    delta_z: object       # (Hv·d_v, hidden): the output norm's gate z
    delta_ab: object      # (2·Hv, hidden): a, then b (the gates before softplus and sigmoid)
    delta_out: object     # (hidden, Hv·d_v)
    conv_weight: object   # float32 (channels, L): the convolution's taps
    dt_bias: object       # float32 (Hv)
    ssm_a: object         # float32 (Hv): −exp(A_log)
    delta_norm: object    # float32 (d_v): the gated RMSNorm's γ


class GatedDeltaNetMixer(Mixer):
    kind = "delta"
    can_roll_back = False   # S holds the last position only

    scratch = ("dqkv", "dconv", "dz", "dab", "dout")
    state_fields = ("history", "state")

    # -- host side: q|k|v, z and the out-projection as the file holds them, a and b fused (both a row per v
    # head), the taps, the gates' vectors and the norm's γ ------------------------------------------------

    Weights = DeltaWeights
    fuses = {"delta_ab": ("delta_a", "delta_b")}
    misplaced = {("attention", "q"): "holds attention tensors (attn_q) but {keys} make it a linear-attention layer"}

    @staticmethod
    def part_shapes(c) -> dict[str, tuple[int, int]]:
        return {"delta_a": (c.delta_v_heads, c.hidden_size), "delta_b": (c.delta_v_heads, c.hidden_size)}

    @staticmethod
    def host_vectors(c) -> dict[str, int]:
        return {"dt_bias": c.delta_v_heads, "ssm_a": c.delta_v_heads, "delta_norm": c.delta_v_dim}

    @staticmethod
    def taps(c) -> int:
        return c.delta_conv_dim

    @classmethod
    def synthetic(cls, c, random_matrix, rng) -> DeltaWeights:
        hidden, channels, value, hv = c.hidden_size, c.delta_conv_dim, c.delta_value_dim, c.delta_v_heads
        taps = (rng.standard_normal((channels, c.conv_length)) / np.sqrt(c.conv_length)).astype(np.float32)
        return DeltaWeights(delta_qkv=random_matrix(rng, channels, hidden), conv_weight=taps,
                            delta_z=random_matrix(rng, value, hidden), delta_ab=random_matrix(rng, 2 * hv, hidden),
                            delta_out=random_matrix(rng, hidden, value), dt_bias=np.ones(hv, np.float32),
                            ssm_a=-np.ones(hv, np.float32), delta_norm=np.ones(c.delta_v_dim, np.float32))

    @staticmethod
    def linears(c) -> list[tuple[str, int, int, bool]]:
        h, value = c.hidden_size, c.delta_value_dim
        return [("delta_qkv", c.delta_conv_dim, h, False), ("delta_z", value, h, False),
                ("delta_ab", 2 * c.delta_v_heads, h, False), ("delta_out", h, value, False)]

    @staticmethod
    def conv_shape(c, m: int) -> dict:
        """The short convolution's shape key (``tuning/short_conv.py``): the plain form with SiLU over q|k|v, at a
        position past the first ring of history."""
        return {"h": c.delta_conv_dim, "l": c.conv_length, "m": m, "pos": 131, "gated": False, "act": "silu"}

    @classmethod
    def ops(cls, c, m: int, options: StepOptions, prefill: bool = False) -> list[Op]:
        """q|k|v, z, a|b; the convolution with SiLU (tuned at one row); the recurrence (token by token for one row,
        chunked for more); the gated RMSNorm per v head (rows of d_v, by the norm's wrapper) and SiLU(z)·; the
        out-projection."""
        layers = tuple(c.layers_of(cls.kind))
        conv = Op("short_conv", cls.conv_shape(c, 1), "conv", layers, reads=("dqkv", "history"),
                  writes=("dconv", "history"), m=m)
        out = (cls.matrix_ops(c, "delta_qkv", m, options, prefill, ("xb",), ("dqkv",))
               + cls.matrix_ops(c, "delta_z", m, options, prefill, ("xb",), ("dz",))
               + cls.matrix_ops(c, "delta_ab", m, options, prefill, ("xb",), ("dab",)) + [shared(conv, prefill)])
        state = dict(reads=("dconv", "dab", "delta_state"), writes=("dout", "delta_state"), m=m)
        if m == 1:
            out.append(Op("gated_delta_net_recurrent", delta_shape(c, 1), "delta", layers, **state))
        else:
            out.append(Op("gated_delta_net_chunked", delta_shape(c, m), "delta", layers, **state))
        out.append(Op("rmsnorm", {"m": 1, "k": c.hidden_size, "residual": True}, "delta norm", layers,
                      reads=("dout",), writes=("dconv",), m=m, shares="norm", measured=False))
        out.append(shared(Op("swiglu", {"count": c.delta_value_dim}, "delta norm gate", layers, reads=("dz", "dconv"),
                             writes=("dout",), m=m), prefill))
        return out + cls.matrix_ops(c, "delta_out", m, options, prefill, ("dout",), ("proj",))

    def upload(self, w, layer: int) -> int:
        m, h = self.model, w.mixing
        linears = {role: m.upload(getattr(h, role), f"layer {layer} {role}", role) for role in ROLES}
        vectors = {name: m.vector(getattr(h, name)) for name in VECTORS}
        self.weights[layer] = DeltaWeights(**linears, **vectors)
        return sum(getattr(h, name).nbytes for name in ROLES + VECTORS)

    def xb_readers(self, layer: int) -> list:
        w = self.weights[layer]
        return [w.delta_qkv, w.delta_z, w.delta_ab]

    def linears_of(self, layer: int) -> list:
        return [getattr(self.weights[layer], role) for role in ROLES]

    def allocate(self) -> None:
        c, d, s = self.model.config, self.model.device, self.model.state
        f32, channels, value = np.float32, c.delta_conv_dim, c.delta_value_dim
        self.dqkv = d.empty((s.chunk, channels), f32)   # q|k|v, then convolved into dconv
        self.dconv = d.empty((s.chunk, channels), f32)
        self.dz = d.empty((s.chunk, value), f32)
        self.dab = d.empty((s.chunk, 2 * c.delta_v_heads), f32)
        self.dout = d.empty((s.chunk, value), f32)       # the recurrence's output, then normed and gated
        self.bind(self.new_state())

    def new_state(self) -> dict:
        c, d = self.model.config, self.model.device
        return {"history": ConvHistory(d, len(self.layers), c.delta_conv_dim),
                "state": DeltaState(d, len(self.layers), delta_shape(c, 1))}

    def copy_state(self, src: dict, dst: dict, positions: int) -> None:
        device = self.model.device
        copy_history(device, src["history"], dst["history"])
        per_layer = src["state"].nbytes // len(src["state"].buffers)
        for source, target in zip(src["state"].buffers, dst["state"].buffers):
            device.copy(target, source, per_layer)

    def forward(self, layer: int, m: int, pos: int, decode: bool, position=None, split=None) -> None:
        model, w = self.model, self.weights[layer]
        c, plan, xb, blocks = model.config, model.plan, model.state.xb, model.xb_blocks(m)
        slot = self.slot[layer]
        w.delta_qkv(xb, self.dqkv, m, decode, blocks)
        w.delta_z(xb, self.dz, m, decode, blocks)
        w.delta_ab(xb, self.dab, m, decode, blocks)
        plan.short_conv(self.dqkv, w.conv_weight, self.history, slot, self.dconv, m, pos, position=position)
        recurrence = plan.delta_decode if m == 1 else plan.delta_prefill(m)
        recurrence(self.dconv, self.dab, self.state.buffers[slot], self.dout, m, dt_bias=w.dt_bias, ssm_a=w.ssm_a,
                   eps=c.rms_eps)
        plan.rmsnorm.plain(self.dout, w.delta_norm, self.dconv, m * c.delta_v_heads, c.delta_v_dim, c.rms_eps)
        plan.delta_gate(self.dz, self.dconv, self.dout, m * c.delta_value_dim)
        w.delta_out(self.dout, model.state.proj, m, decode)

    def forward_rows(self, layer: int, m: int, rows) -> None:
        model, w = self.model, self.weights[layer]
        c, plan, xb, blocks = model.config, model.plan, model.state.xb, model.xb_blocks(m)
        slot, decode, channels, value = self.slot[layer], m == 1, c.delta_conv_dim, c.delta_value_dim
        w.delta_qkv(xb, self.dqkv, m, decode, blocks)
        w.delta_z(xb, self.dz, m, decode, blocks)
        w.delta_ab(xb, self.dab, m, decode, blocks)
        convolve_rows(model, rows, self, self.dqkv, channels, self.dconv, channels,
                      lambda x, y, history, pos, position: plan.short_conv(
                          x, w.conv_weight, history, slot, y, 1, pos, position=position))
        # each row's recurrence on its own sequence's S; row 0 writes dout in place, the others through scratch
        out = self._row_scratch("delta out", value)
        for i in range(m):
            plan.delta_decode(self.dconv, self.dab, rows.state(self, i)["state"].buffers[slot],
                              self.dout if i == 0 else out, 1, qkv_offset=i * channels,
                              gates_offset=i * 2 * c.delta_v_heads, dt_bias=w.dt_bias, ssm_a=w.ssm_a, eps=c.rms_eps)
            if i:
                model.device.copy(self.dout, out, 4 * value, dst_offset=4 * i * value)
        plan.rmsnorm.plain(self.dout, w.delta_norm, self.dconv, m * c.delta_v_heads, c.delta_v_dim, c.rms_eps)
        plan.delta_gate(self.dz, self.dconv, self.dout, m * value)
        w.delta_out(self.dout, model.state.proj, m, decode)

    @staticmethod
    def reference(xb, w, c, cache, layer: int, positions, recipe) -> np.ndarray:
        m, w = xb.shape[0], w.mixing
        hk, hv, dk, dv = c.delta_k_heads, c.delta_v_heads, c.delta_k_dim, c.delta_v_dim
        y, cache.conv[layer] = short_conv(linear64(xb, w.delta_qkv), w.conv_weight, cache.conv[layer], gated=False,
                                          act="silu")
        q = y[:, :hk * dk].reshape(m, hk, dk)
        k = y[:, hk * dk:2 * hk * dk].reshape(m, hk, dk)
        v = y[:, 2 * hk * dk:].reshape(m, hv, dv)
        ab = linear64(xb, w.delta_ab)
        g, beta = gated_delta_gates(ab[:, :hv], ab[:, hv:], w.dt_bias, w.ssm_a)
        o, cache.state[layer] = gated_delta_net(q, k, v, g, beta, cache.state[layer], c.delta_head_map,
                                                eps=c.rms_eps)
        z = linear64(xb, w.delta_z).reshape(m, hv, dv)
        return linear64(rmsnorm_gated(o, z, w.delta_norm, c.rms_eps).reshape(m, hv * dv), w.delta_out)

    # -- state rules: S holds the last position run only --------------------------------------------------

    def state_report(self) -> dict:
        return {"conv_state_bytes": self.history.nbytes, "recurrent_state_bytes": self.state.nbytes}

    def restore_parts(self) -> list:
        return [DeltaPart(self.state), RingPart(self.history, self.model.config.conv_length)]

    def live_at(self, pos: int, written: int) -> bool:
        return pos in (0, written)   # S after the last position run only (or zeros from 0)

    def reset(self) -> None:
        self.history.first = 0
        self.state.reset()

    def fill(self, value: float) -> None:
        self.model.device.fill(self.history.buffer, np.float32(value))
        self.state.reset()

    def resume_error(self, pos: int, written: int, kept: list[int]) -> str | None:
        return (f"position {pos}: this model's Gated DeltaNet layers hold their state after position {written - 1} "
                f"only (positions 0..{written - 1} were run) and at the restore points {kept}; continue at "
                f"{written}, at a restore point, or prefill from 0")


MIXER = GatedDeltaNetMixer
