"""The tiny files of the families whose tests write them with their own writers (the mixtures of experts, Gemma 4),
as ``benchmarks/routed_families_llamacpp.py`` records llama.cpp's greedy answers on them and
``tests/test_routed_families_llamacpp.py`` checks perfx against those answers: one writer per family, a seed in,
a GGUF out, the same bytes on every machine.

Gemma 4's tiny pattern alternates sliding and global layers ([s, g] × 3, the last two sharing KV). llama.cpp's KV
reuse takes layer ``n_layer_kv_from_start − 2`` for a sliding layer and ``− 1`` for a global one, which is "the
last earlier layer of its kind" (perfx's and transformers' rule) only where the last layer holding a cache is
global and the one before it sliding, as in every published Gemma 4; the tests' other tiny pattern ([s, s, g] × 2)
is not such a model, and llama.cpp aborts on it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from helpers.gemma4_models import make_gemma4, write_gemma4_gguf
from helpers.moe_models import write_moe_gguf

PROMPT = [2, 10, 20, 30, 40, 50, 60, 70]      # ids: bos, then plain pieces of every tiny vocabulary
GEMMA4_PATTERN = ["sliding_attention", "full_attention"] * 3


def _gemma4(path: Path, seed: int, k_eq_v: bool) -> Path:
    model = make_gemma4(np.random.default_rng(seed), k_eq_v=k_eq_v, layer_types=GEMMA4_PATTERN)
    write_gemma4_gguf(path, model)
    return path


WRITERS = {
    "qwen3moe": lambda path, seed: write_moe_gguf(path, "qwen3_moe", np.random.default_rng(seed), vocab=True)[0],
    "lfm2moe": lambda path, seed: write_moe_gguf(path, "lfm2_moe", np.random.default_rng(seed), vocab=True)[0],
    "gemma4": lambda path, seed: _gemma4(path, seed, k_eq_v=False),
    "gemma4-k-eq-v": lambda path, seed: _gemma4(path, seed, k_eq_v=True),
}
