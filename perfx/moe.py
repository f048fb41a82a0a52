"""The mixture-of-experts FFN, one mechanism for every family that has one (llama.cpp's build_moe_ffn,
src/llama-graph.cpp): the router (a GEMV to E logits), the gating (softmax, σ, or softmax over the chosen), an
optional selection bias that only chooses, the top k, renormalised weights and a scale; then each chosen expert's
gated MLP (its gate and up fused), weighted and summed. The recipe is ``ModelConfig``'s expert fields; the layers
from ``dense_layers`` on have it in place of the dense gated MLP.

On the device a decode step runs three launches a layer and never waits for the host: the router writes each
row's expert ids and weights to a device buffer (``kernels/moe_router.cl``), the gate-up GEMV reads the chosen
experts' rows by those ids, and the down GEMV sums the chosen experts' outputs with their weights into proj
(``kernels/gemv_moe.cl``). A prompt's rows are grouped by expert on the device (``kernels/gemm_moe.cl``: a
histogram, a prefix sum, a scatter), each expert's weights read once a tile of its rows, and each row's experts
summed in a fixed order.

A MoE block may hold a **shared expert** (``ModelConfig.expert_shared``: its width): a gated MLP every row runs beside
the routed experts, its output added to theirs — with ``expert_shared_gate`` times σ(x·w_gate) first, a 1-row gate
(Qwen3.5-MoE, llama.cpp's ffn_gate_inp_shexp). It is the gated MLP's roles (gate_up with act(gate)·up fused, down)
run through the dense MLP's GEMVs and GEMMs into proj; the gate scales its act(gate)·up rows in place
(``kernels/moe_shared_gate.cl``: σ(g·x) scales the down product's input, which is the same by linearity, so no
launch reads the hidden rows again); the routed down GEMV or GEMM then adds the experts into proj.

Like a mixer (``perfx.mixers``), this module holds both sides: what a source reads for a MoE layer
(``MoEWeights``, the expert roles' forms), the step's ops, the float64 step (``reference``), and the device
side (``DeviceMoE``: the weights, scratch and launches).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from perfx.formats import MXFP4_FORM, Form, Q4Matrix, Q8Matrix, fuse_rows, fused_form
from perfx.op import Op, StepOptions, shared
from perfx.ops.gemm_moe import GroupedExperts
from perfx.ops.gemv_moe import ExpertWeights, form_shape
from perfx.reference import gelu_tanh, linear, moe_experts, moe_route, moe_shared_gate, silu

# The expert roles: the fused gate-up of each expert, and its down; their source projections
EXPERT_ROLES = {"experts_gate_up": ("gate_exps", "up_exps"), "experts_down": ("down_exps",)}
# The scratch its launches share, as its ops name it (``DeviceMoE``'s buffers of these names less the prefix)
SCRATCH = ("moe_logits", "moe_ids", "moe_weights", "moe_h", "moe_groups")
# fp16 experts are held as int8 at this group (the routed GEMVs read int4 and int8)
F16_EXPERT_GROUP = 32
# The shared expert's matrix roles (the gated MLP's) and the source projections each fuses
SHARED_LINEARS = {"gate_up": ("gate_shexp", "up_shexp"), "down": ("down_shexp",)}


@dataclass
class MoEWeights:
    """A MoE layer's weights: host (from a source) or on the device (``DeviceMoE``)."""

    router: np.ndarray              # (E, hidden) float32: the router's logits
    gate_up: list                   # E host matrices (2·I, hidden), gate rows then up rows; ExpertWeights on the device
    down: list                      # E host matrices (hidden, I); ExpertWeights on the device
    selection_bias: np.ndarray | None = None   # (E,) float32, added to choose only
    # gpt-oss (``expert_biases``): the router's logits' bias (E,), each expert's gate-up bias (E, 2·I: gate then
    # up) and down bias (E, hidden), float32; None where the model has none
    router_bias: np.ndarray | None = None
    gate_up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None
    # the shared expert (ModelConfig.expert_shared): host matrices from a source, Linears on the device
    shared_gate_up: object = None   # (2·S, hidden): gate rows, then up rows
    shared_down: object = None      # (hidden, S)
    shared_gate: np.ndarray | None = None      # (hidden,) float32: its output times σ(x·shared_gate)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one expert's matrices (its gate-up and down), as a decode step reads them."""
        return self.gate_up[0].nbytes + self.down[0].nbytes


def held_expert(w):
    """An expert matrix as the routed GEMVs hold it: int4 and int8 as they are, fp16 as int8 (round to nearest)."""
    if isinstance(w, (Q4Matrix, Q8Matrix)):
        return w
    return Q8Matrix.quantize(np.asarray(w), F16_EXPERT_GROUP)


def fuse_expert(parts: list):
    """One expert's gate and up stacked (gate rows first), as the routed GEMVs hold it."""
    return held_expert(fuse_rows([held_expert(p) for p in parts]) if len(parts) > 1 else parts[0])


def held_form(form: Form, symmetric_q4: bool = False, mxfp4: bool = False) -> Form:
    """The routed GEMVs' form (``perfx.ops.gemv_moe.expert_form``) of a file's expert tensor of device form ``form``
    (``perfx.formats.Form``): int8's flags kept, int4 symmetric where the file's type is (Q4_0), fp16 as int8,
    MXFP4 (``mxfp4``: the file's type is) as the file holds it."""
    if mxfp4:
        return MXFP4_FORM
    if form.kind == "f16":
        return Form("q8", F16_EXPERT_GROUP)
    if form.kind == "q4":
        return Form("q4", form.group, symmetric=symmetric_q4)
    return form


def fused_held_form(parts: list[Form]) -> Form:
    """The form of gate and up of one expert stacked (``fuse_expert``), from their held forms: as they are where
    equal; int4 pairs where both are int4 of one group; else int8 at the smallest group (``fused_form``), MXFP4
    beside another form as its int8 form."""
    if len(set(parts)) == 1:
        return parts[0]
    parts = [Form("q8", p.group, True, True) if p == MXFP4_FORM else p for p in parts]
    if all(p.kind == "q4" for p in parts) and len({p.group for p in parts}) == 1:
        return Form("q4", parts[0].group, f32=any(p.f32 for p in parts))
    return fused_form(parts)


def synthetic(config, random_matrix, rng) -> MoEWeights:
    """Random weights of a MoE layer for ``synthetic:`` models: ``random_matrix(rng, n, k)`` int4 experts."""
    c, e = config, config.n_experts
    router = (rng.standard_normal((e, c.hidden_size)) / np.sqrt(c.hidden_size)).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.1).astype(np.float32) if c.expert_bias else None
    biases = {}
    if c.expert_biases:
        biases = dict(router_bias=(rng.standard_normal(e) * 0.1).astype(np.float32),
                      gate_up_bias=(rng.standard_normal((e, 2 * c.expert_intermediate)) * 0.1).astype(np.float32),
                      down_bias=(rng.standard_normal((e, c.hidden_size)) * 0.1).astype(np.float32))
    w = MoEWeights(router=router, selection_bias=bias, **biases,
                   gate_up=[random_matrix(rng, 2 * c.expert_intermediate, c.hidden_size) for _ in range(e)],
                   down=[random_matrix(rng, c.hidden_size, c.expert_intermediate) for _ in range(e)])
    if c.expert_shared:
        w.shared_gate_up = random_matrix(rng, 2 * c.expert_shared, c.hidden_size)
        w.shared_down = random_matrix(rng, c.hidden_size, c.expert_shared)
        if c.expert_shared_gate:
            w.shared_gate = (rng.standard_normal(c.hidden_size) / np.sqrt(c.hidden_size)).astype(np.float32)
    return w


# -- the step's ops ----------------------------------------------------------------------------------------

def router_shape(config) -> dict:
    c = config
    return {"e": c.n_experts, "k": c.hidden_size, "used": c.n_experts_used, "gating": c.expert_gating,
            "bias": c.expert_bias, "norm": c.expert_norm, "m": 1,
            **({"logit_bias": True} if c.expert_biases else {})}


def expert_act(config) -> str:
    """The experts' gated activation: their own (gpt-oss's clamped SwiGLU), else the model's FFN activation."""
    return config.expert_activation or config.ffn_activation


def expert_forms(config, role: str, options: StepOptions) -> list[Form]:
    """The held forms an expert role takes: the file's (``options.forms``), else int4 at the loader's group."""
    if options.forms is not None:
        return sorted(options.forms.get(role, ()))
    return [Form("q4", options.group or 32)]


def expert_shape(config, role: str, form: Form) -> dict:
    """The routed GEMV's shape key (``tuning/gemv_moe.py``) of an expert role in a held form, at one row."""
    c = config
    gate_up = role == "experts_gate_up"
    shape = {"op": "gate_up" if gate_up else "down", "n": c.expert_intermediate if gate_up else c.hidden_size,
             "k": c.hidden_size if gate_up else c.expert_intermediate, "experts": c.n_experts,
             "used": c.n_experts_used, **form_shape(form), "m": 1}
    if gate_up:
        shape["act"] = expert_act(c)
    if c.expert_biases:
        shape["bias"] = True
    return shape


def ops(config, m: int, options: StepOptions, prefill: bool = False) -> list[Op]:
    """The MoE FFN's launches on its layers over m rows: the router, the chosen experts' gate-up, their weighted
    down into proj (one op per held form of each expert role). A decode step runs the routed GEMVs; a prefill pass
    the decode step's router over its rows (``shared``), then the grouped products (``gemm_moe``: its rows grouped
    by expert, measured per bucket at M = m)."""
    c = config
    layers = tuple(c.moe_layers)
    if not layers:
        return []
    out = []
    if c.expert_shared and c.expert_shared_gate:   # after the shared expert's gate-up (perfx.step's ffn ops)
        out.append(shared(Op("moe_shared_gate", {"m": 1, "k": c.hidden_size, "n": c.expert_shared},
                             "shared expert gate", layers, reads=("xb", "hb"), writes=("hb",), m=m), prefill))
    out.append(shared(Op("moe_router", router_shape(c), "router", layers, reads=("xb",),
                         writes=("moe_logits", "moe_ids", "moe_weights"), m=m), prefill))
    for role, reads, writes in (("experts_gate_up", ("xb", "moe_ids"), ("moe_h", "moe_groups")),
                                ("experts_down", ("moe_h", "moe_groups", "moe_weights"), ("proj",))):
        for form in expert_forms(c, role, options):
            shape = expert_shape(c, role, form)
            if prefill:
                out.append(Op("gemm_moe", {**shape, "m": m}, role, layers, role, form, reads, writes, m=m))
            else:
                out.append(Op("gemv_moe", shape, role, layers, role, form, reads, writes, m=m))
    return out


# -- the float64 step --------------------------------------------------------------------------------------

def reference(xb: np.ndarray, w: MoEWeights, config) -> np.ndarray:
    """The MoE FFN of the normed rows xb (M, hidden) in float64 (``perfx.forward64``)."""
    c = config
    ids, weights = moe_route(linear(xb, w.router, w.router_bias), c.n_experts_used, c.expert_gating,
                             w.selection_bias, c.expert_norm, c.expert_scale)
    out = moe_experts(xb, ids, weights, w.gate_up, w.down, expert_act(c), w.gate_up_bias, w.down_bias)
    if w.shared_gate_up is not None:   # the shared expert, on every row (σ-gated where it has a gate)
        hidden = linear(xb, w.shared_gate_up)
        width = hidden.shape[1] // 2
        hidden = (gelu_tanh if c.ffn_activation == "gelu_tanh" else silu)(hidden[:, :width]) * hidden[:, width:]
        if w.shared_gate is not None:
            hidden = moe_shared_gate(xb, w.shared_gate, hidden)
        out = out + linear(hidden, w.shared_down)
    return out


# -- the device side ---------------------------------------------------------------------------------------

class DeviceMoE:
    """The MoE layers of a model on the device: each one's router, selection bias and experts, and the scratch
    the launches share (the logits, each row's expert ids and weights, the experts' act(gate)·up)."""

    def __init__(self, model, layers: list[int]):
        self.model, self.layers = model, list(layers)
        self.weights: dict[int, MoEWeights] = {}

    def upload(self, w: MoEWeights, layer: int) -> int:
        """Layer ``layer``'s MoE weights onto the device; the bytes a decode step reads of them (the router, the
        bias and the chosen experts only)."""
        m, c = self.model, self.model.config
        self.weights[layer] = MoEWeights(
            router=m.vector(w.router), selection_bias=None if w.selection_bias is None else m.vector(w.selection_bias),
            router_bias=None if w.router_bias is None else m.vector(w.router_bias),
            gate_up=ExpertWeights(m.device, [held_expert(e) for e in w.gate_up], f"layer {layer} experts gate_up",
                                  bias=w.gate_up_bias),
            down=ExpertWeights(m.device, [held_expert(e) for e in w.down], f"layer {layer} experts down",
                               bias=w.down_bias))
        device = self.weights[layer]
        active = c.n_experts_used * (device.gate_up.expert_bytes + device.down.expert_bytes)
        if w.shared_gate_up is not None:   # the shared expert: the gated MLP's Linears, read whole every step
            device.shared_gate_up = m.upload(w.shared_gate_up, f"layer {layer} shared expert gate_up", "gate_up")
            device.shared_down = m.upload(w.shared_down, f"layer {layer} shared expert down", "down")
            active += w.shared_gate_up.nbytes + w.shared_down.nbytes
            if w.shared_gate is not None:
                device.shared_gate = m.vector(w.shared_gate)
                active += w.shared_gate.nbytes
        return active + sum(v.nbytes for v in (w.router, w.selection_bias, w.router_bias) if v is not None)

    def shared_linears(self, layer: int) -> tuple:
        """(gate_up, down) Linears of layer ``layer``'s shared expert, (None, None) where it has none."""
        w = self.weights[layer]
        return w.shared_gate_up, w.shared_down

    def allocate(self) -> None:
        c, d, s = self.model.config, self.model.device, self.model.state
        self.logits = d.empty((s.chunk, c.n_experts), np.float32)
        self.ids = d.empty((s.chunk, c.n_experts_used), np.int32)
        self.route_weights = d.empty((s.chunk, c.n_experts_used), np.float32)
        self.h = d.empty((s.chunk, c.n_experts_used, c.expert_intermediate), np.float32)
        # a prompt chunk's (row, expert) pairs grouped by expert, and each pair's down product
        self.groups = GroupedExperts(d, c.n_experts, s.chunk, c.n_experts_used, c.hidden_size)

    def forward(self, layer: int, m: int, decode: bool | None = None) -> None:
        """The MoE FFN of m rows of xb into proj: the shared expert (where the layer has one) into proj, then the
        routed experts (added to it): one row by the routed GEMVs, more grouped by expert."""
        model, c, w = self.model, self.model.config, self.weights[layer]
        plan, s, used = model.plan, model.state, c.n_experts_used
        shared, decode = w.shared_gate_up is not None, m == 1 if decode is None else decode
        if shared:
            w.shared_gate_up(s.xb, s.hb, m, decode, model.xb_blocks(m))
            if w.shared_gate is not None:
                plan.moe_shared_gate(s.xb, w.shared_gate, s.hb, m, c.hidden_size, c.expert_shared)
            w.shared_down(s.hb, s.proj, m, decode)
        plan.moe_router(s.xb, w.router, w.selection_bias, self.logits, self.ids, self.route_weights, m,
                        c.hidden_size, c.expert_scale, logit_bias=w.router_bias)
        if m == 1:
            plan.moe_gemv("experts_gate_up", w.gate_up.form).gate_up(w.gate_up, s.xb, self.ids, self.h, m, used)
            plan.moe_gemv("experts_down", w.down.form).down(w.down, self.h, self.ids, self.route_weights, s.proj, m,
                                                            used, accumulate=shared)
            return
        plan.moe_gemm("experts_gate_up", w.gate_up.form, m).gate_up(w.gate_up, s.xb, self.ids, self.h, m, used,
                                                                    self.groups)
        plan.moe_gemm("experts_down", w.down.form, m).down(w.down, self.h, self.route_weights, s.proj, m, used,
                                                          self.groups, accumulate=shared)
