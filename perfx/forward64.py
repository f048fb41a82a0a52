"""The float64 forward of a whole model over a ``perfx.sources.ModelSource``: the end-to-end truth every device
forward and llama.cpp's outputs are judged by.

It follows the config's recipe (``perfx.config``) as the device forward does: each layer's mixer by its kind
(``perfx.mixers``: attention, short convolution, Gated DeltaNet, each with its own float64 step), the norms,
the gated MLP, the final norm, the classifier and its soft-cap — the maths of transformers' Llama, Mistral,
Qwen2, Qwen3, Gemma 2, Gemma 3, Gemma 4, Phi-3, SmolLM3, LFM2 and Qwen3.5 models.
"""

from __future__ import annotations

import numpy as np

from perfx import moe
from perfx.mixers import mixer_class
from perfx.reference import embed, gaussian_top_k, gelu_tanh, linear, rmsnorm, silu


class ReferenceCache:
    """What a forward keeps of positions 0..T−1: keys and values per attention layer ((T, Hkv, D) float64
    each), per conv or delta layer the short convolution's state (its last L − 1 inputs), and per delta
    layer the Gated DeltaNet state (Hv, d_v, d_k)."""

    def __init__(self, n_layers: int):
        self.keys: list[np.ndarray | None] = [None] * n_layers
        self.values: list[np.ndarray | None] = [None] * n_layers
        self.conv: list[np.ndarray | None] = [None] * n_layers
        self.state: list[np.ndarray | None] = [None] * n_layers
        self.length = 0

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.keys[layer] is not None:
            k, v = np.concatenate([self.keys[layer], k]), np.concatenate([self.values[layer], v])
        self.keys[layer], self.values[layer] = k, v
        return k, v


def _ffn(x, w, c, gate):
    """ffn rmsnorm, the gated MLP (gate rows first, then up) or the mixture of experts, and the residual (through
    its post-norm)."""
    xb = rmsnorm(x, w.ffn_norm, c.rms_eps)
    if w.moe is not None:   # the mixture of experts in place of the gated MLP
        out = moe.reference(xb, w.moe, c)
    else:
        gate_up = linear(xb, w.gate_up)
        n_inter = w.gate_up.shape[0] // 2   # the layer's own width (Gemma 4's differ)
        out = linear(gate(gate_up[:, :n_inter]) * gate_up[:, n_inter:], w.down)
    return x + (rmsnorm(out, w.post_ffn_norm, c.rms_eps) if c.post_norms else out)


def per_layer_inputs(source, tokens, x) -> np.ndarray | None:
    """Gemma 4's per-layer inputs (M, n_layers, P) from the token rows of the per-layer table and the scaled
    embedding x (M, hidden), as llama.cpp's gemma4 builds them (build_inp_per_layer, project_per_layer_inputs):
    (rmsnorm(x·Wᵀ/√hidden per layer)·γ + table rows·√P)/√2. None where the recipe has none."""
    c = source.config
    tables = source.per_layer_tables()
    if tables is None:
        return None
    table, projection, norm = tables
    p, m = c.per_layer_input, len(tokens)
    rows = embed(table, tokens).reshape(m, c.n_layers, p) * np.sqrt(p)
    projected = (linear(x, projection) / np.sqrt(c.hidden_size)).reshape(m, c.n_layers, p)
    return (rmsnorm(projected, norm, c.rms_eps) + rows) / np.sqrt(2.0)


def _magnitude(x) -> np.ndarray:
    return np.sqrt(np.sum(x * x, axis=-1, keepdims=True))


def _router(x, u, c) -> np.ndarray:
    """AltUp's modalities (M, A): tanh(W_router·(rmsnorm(x)·γ / hidden))."""
    return np.tanh(linear(rmsnorm(x, u["altup_router_norm"], c.rms_eps) / c.hidden_size, u["altup_router"]))


def _altup_layers(source, x, inputs, cache, positions, ctx) -> np.ndarray:
    """Gemma 3n's layers over AltUp's A streams (llama.cpp's gemma3n-iswa.cpp): the embedding and its projections
    at its magnitude; per layer the streams predicted from each other, the active one through LAuReL, attention
    and the MLP, every stream corrected by the result, the per-layer input added to the others; at the end the
    others projected back (at the active one's magnitude) and the A averaged. Returns the residual (M, hidden)."""
    c = source.config
    eps, act, n_streams = c.rms_eps, c.altup_active, c.altup_inputs
    into, back = source.altup_tables()
    target = _magnitude(x)
    streams = np.stack([x] + [(y := linear(x, w)) * target / _magnitude(y) for w in into])   # (A, M, hidden)
    for i in range(c.n_layers):
        w, recipe = source.layer(i), c.layer(i, ctx)
        u = w.altup
        # predict every stream from all of them: coefficients (A, A) per row from the active one's router
        coefs = linear(_router(streams[act], u, c), u["altup_predict"]).reshape(-1, n_streams, n_streams)
        predictions = streams + np.einsum("mjk,kmh->jmh", coefs, streams)
        active = predictions[act]
        xb = rmsnorm(active, w.attn_norm, eps)
        laurel = xb + rmsnorm(linear(linear(xb, u["laurel_l"]), u["laurel_r"]), u["laurel_norm"], eps)
        out = mixer_class(recipe.kind).reference(xb, w, c, cache, i, positions, recipe)
        attended = (rmsnorm(out, w.post_attn_norm, eps) + active + laurel) / np.sqrt(2.0)
        hb = rmsnorm(attended, w.ffn_norm, eps)
        gate_up = linear(hb, w.gate_up)
        n_inter = w.gate_up.shape[0] // 2
        gate = gate_up[:, :n_inter]
        if c.sparsity[i]:
            gate = gaussian_top_k(gate, c.sparsity[i])
        out = linear(gelu_tanh(gate) * gate_up[:, n_inter:], w.down)
        layer_out = rmsnorm(out, w.post_ffn_norm, eps) + attended
        # correct every stream by the innovation of the active one
        scale = linear(_router(layer_out, u, c), u["altup_correct"]) + 1.0      # (M, A)
        streams = predictions + (layer_out - active)[None] * scale.T[:, :, None]
        # the per-layer input, from the corrected active stream, into the other streams
        gated = gelu_tanh(linear(streams[act] * u["altup_correct_scale"], w.ple_gate)) * inputs[:, i]
        streams[1:] += rmsnorm(linear(gated, w.ple_proj), w.ple_norm, eps)
    target = _magnitude(streams[act])
    back_projected = [(y := linear(s, w)) * target / _magnitude(y) for s, w in zip(streams[1:], back)]
    return (streams[0] + sum(back_projected)) / n_streams


def _per_layer(x, w, c, inputs):
    """Gemma 4's per-layer input into the residual: x + rmsnorm(W_proj·(GELU(W_gate·x) ⊙ inputs))·γ."""
    gated = gelu_tanh(linear(x, w.ple_gate)) * inputs
    return x + rmsnorm(linear(gated, w.ple_proj), w.ple_norm, c.rms_eps)


def model_forward(source, tokens, start_pos: int = 0, cache: ReferenceCache | None = None, ctx: int | None = None):
    """Logits (M, V) float64 for M tokens at positions start_pos.., and the updated cache.

    ``source`` is a perfx.sources.ModelSource (weights read layer by layer, dequantized to float64);
    ``cache`` holds positions 0..start_pos−1 (None: a new one, start_pos must then be 0). ``ctx`` is the context
    the model runs in (LongRoPE picks its factors by it); None: the positions this call reaches.
    """
    c = source.config
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    m = len(tokens)
    cache = ReferenceCache(c.n_layers) if cache is None else cache
    if cache.length != start_pos:
        raise ValueError(f"cache holds {cache.length} positions but start_pos is {start_pos}")
    positions = np.arange(start_pos, start_pos + m)
    ctx = start_pos + m if ctx is None else ctx
    gate = gelu_tanh if c.ffn_activation == "gelu_tanh" else silu

    embedding = source.embedding()
    x = embed(embedding, tokens) * c.embedding_scale  # (M, hidden) residual stream
    inputs = per_layer_inputs(source, tokens, x)     # (M, n_layers, P) or None
    if c.altup_inputs:
        x = _altup_layers(source, x, inputs, cache, positions, ctx)
    for i in range(0 if c.altup_inputs else c.n_layers):
        w, recipe = source.layer(i), c.layer(i, ctx)
        # the mixer's rmsnorm, the mixer of the layer's kind, its output (through its own norm where the recipe
        # has post-norms) back into the residual
        xb = rmsnorm(x, w.attn_norm, c.rms_eps)
        out = mixer_class(recipe.kind).reference(xb, w, c, cache, i, positions, recipe)
        x = x + (rmsnorm(out, w.post_attn_norm, c.rms_eps) if c.post_norms else out)
        x = _ffn(x, w, c, gate)
        # Gemma 4: the layer's per-layer input, then its output scalar on the whole residual
        if inputs is not None:
            x = _per_layer(x, w, c, inputs[:, i])
        if w.out_scale is not None:
            x = x * float(w.out_scale[0])
    cache.length += m
    # final rmsnorm and the classifier (the embedding itself when tied)
    x = rmsnorm(x, source.final_norm(), c.rms_eps)
    head = source.lm_head()
    logits = linear(x, embedding if head is None else head)
    if c.final_softcap:
        logits = c.final_softcap * np.tanh(logits / c.final_softcap)
    return logits, cache
