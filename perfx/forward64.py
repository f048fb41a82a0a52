"""The float64 forward of a whole model over a ``perfx.sources.ModelSource``: the end-to-end truth every device
forward and llama.cpp's outputs are judged by.

It follows the config's recipe (``perfx.config``) as the device forward does: each layer's mixer by its kind
(``perfx.mixers``: attention, short convolution, Gated DeltaNet, each with its own float64 step), the norms,
the gated MLP, the final norm, the classifier and its soft-cap — the maths of transformers' Llama, Mistral,
Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3, SmolLM3, LFM2 and Qwen3.5 models.
"""

from __future__ import annotations

import numpy as np

from perfx import moe
from perfx.mixers import mixer_class
from perfx.reference import embed, gelu_tanh, linear, rmsnorm, silu


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
        n_inter = c.intermediate_size
        out = linear(gate(gate_up[:, :n_inter]) * gate_up[:, n_inter:], w.down)
    return x + (rmsnorm(out, w.post_ffn_norm, c.rms_eps) if c.post_norms else out)


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
    for i in range(c.n_layers):
        w, recipe = source.layer(i), c.layer(i, ctx)
        # the mixer's rmsnorm, the mixer of the layer's kind, its output (through its own norm where the recipe
        # has post-norms) back into the residual
        xb = rmsnorm(x, w.attn_norm, c.rms_eps)
        out = mixer_class(recipe.kind).reference(xb, w, c, cache, i, positions, recipe)
        x = x + (rmsnorm(out, w.post_attn_norm, c.rms_eps) if c.post_norms else out)
        x = _ffn(x, w, c, gate)
    cache.length += m
    # final rmsnorm and the classifier (the embedding itself when tied)
    x = rmsnorm(x, source.final_norm(), c.rms_eps)
    head = source.lm_head()
    logits = linear(x, embedding if head is None else head)
    if c.final_softcap:
        logits = c.final_softcap * np.tanh(logits / c.final_softcap)
    return logits, cache
