"""One layer's recipe: its rotary embedding (``Rope``) and what mixes its positions (``LayerRecipe``).

They sit below ``perfx.config`` and ``perfx.families`` so that a family file can build a model's layers and
``ModelConfig`` can look its family up; ``perfx.config`` exports both under their usual names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Rope:
    """One layer's rotary embedding: base θ, the first ``dims`` dimensions of each head rotated (rotate-half
    pairs (i, i + dims/2)), and Hugging Face's ``rope_scaling`` dict (``perfx.reference.rope_inv_freq``)."""

    theta: float
    dims: int
    scaling: dict | None = field(default=None, hash=False, compare=False)

    def key(self) -> str:
        """Equal for layers that can share one cos/sin table."""
        return json.dumps([self.theta, self.dims, self.scaling], sort_keys=True)

    def for_context(self, ctx: int) -> Rope:
        """LongRoPE (Phi-3) picks its per-pair factors by the context: the short ones up to the original
        context length, the long ones beyond it (llama.cpp's rule, from the cache size)."""
        s = self.scaling
        if not s or s.get("rope_type") != "longrope" or "short_factor" not in s:
            return self
        factors = s["long_factor"] if ctx > s["original_max_position_embeddings"] else s["short_factor"]
        return Rope(self.theta, self.dims, {"rope_type": "longrope", "freq_factors": list(factors),
                                            "attention_factor": s["attention_factor"]})


@dataclass(frozen=True)
class LayerRecipe:
    rope: Rope | None      # None: no rotary embedding on this layer (SmolLM3's NoPE layers)
    window: int = 0        # sliding window: a position attends to the last `window` positions (0: all)
    kind: str = "attention"   # what mixes the positions: "attention", "conv" (LFM2's gated short convolution) or
                              # "delta" (Qwen3.5's Gated DeltaNet linear attention)
    # Gemma 4's layers differ in their shapes: 0 / −1 take the model's (``ModelConfig``)
    head_dim: int = 0         # D of this layer's heads (Gemma 4: 256 sliding, 512 global)
    kv_heads: int = 0         # its KV heads
    ffn: int = 0              # its MLP's inner width (Gemma 4: twice as wide on the KV-sharing layers)
    kv_from: int = -1         # the earlier layer whose KV cache it reads, computing q only (−1: its own cache)
