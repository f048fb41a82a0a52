"""The tiny files of the families whose tests write them with their own writers (the mixtures of experts, Gemma 4
and 3n, Qwen3.5-MoE),
as ``benchmarks/routed_families_llamacpp.py`` records llama.cpp's greedy answers on them and
``tests/test_routed_families_llamacpp.py`` checks perfx against those answers: one writer per family, a seed in,
a GGUF out, the same bytes on every machine.

Gemma 4's tiny pattern alternates sliding and global layers ([s, g] × 3, the last two sharing KV). llama.cpp's KV
reuse takes layer ``n_layer_kv_from_start − 2`` for a sliding layer and ``− 1`` for a global one, which is "the
last earlier layer of its kind" (perfx's and transformers' rule) only where the last layer holding a cache is
global and the one before it sliding, as in every published Gemma 4; the tests' other tiny pattern ([s, s, g] × 2)
is not such a model, and llama.cpp aborts on it.

llama.cpp's gemma3n fixes what every published Gemma 3n has, whatever the file says: the first 20 layers hold
caches (``n_layer_kv_from_start``), the first 10 have sparse gates (z of 0.95), per-layer inputs of 256 values and
LAuReL of rank 64. Its tiny file is such a model: 22 narrow layers, sliding and global as [s, s, s, s, g] × 4 then
[s, g], the last two sharing KV. Its sparse layers' FFN outputs are scaled by ``GEMMA3N_SPARSE_FFN_GAIN``: a sparse
gate keeps the few of 96 values just above a cutoff, and the post-FFN norm brings that difference of near-equal
numbers back to the stream's size, so over 22 random layers llama.cpp's rounding (8-bit activations into its Q8_0
and Q4_0 products) moved its logits by 0.4–1.0 from the float64 forward's; scaled, the two part by rounding only
(0.03–0.16, benchmarks/NOTES.md) and every layer still moves the logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from helpers.family_models import family_tokenizer, make_family_model, write_family_gguf
from helpers.gemma3n_models import make_gemma3n, write_gemma3n_gguf
from helpers.gemma4_models import make_gemma4, write_gemma4_gguf
from helpers.gptoss_models import write_gptoss_gguf
from helpers.moe_models import write_moe_gguf

PROMPT = [2, 10, 20, 30, 40, 50, 60, 70]      # ids: bos, then plain pieces of every tiny vocabulary
GEMMA4_PATTERN = ["sliding_attention", "full_attention"] * 3
GEMMA3N_LAYERS = 22
GEMMA3N_SPARSE_FFN_GAIN = 0.2


def _gemma4(path: Path, seed: int, k_eq_v: bool) -> Path:
    model = make_gemma4(np.random.default_rng(seed), k_eq_v=k_eq_v, layer_types=GEMMA4_PATTERN)
    write_gemma4_gguf(path, model)
    return path


def _gemma3n(path: Path, seed: int) -> Path:
    n = GEMMA3N_LAYERS
    model = make_gemma3n(np.random.default_rng(seed), num_hidden_layers=n, intermediate_size=[96] * n,
                         hidden_size_per_layer_input=256, laurel_rank=64, num_kv_shared_layers=n - 20,
                         activation_sparsity_pattern=[0.95] * 10 + [0.0] * (n - 10),
                         layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 4 + ["sliding_attention",
                                                                                               "full_attention"])
    for i in range(10):   # the layers llama.cpp gives sparse gates
        name = f"blk.{i}.post_ffw_norm.weight"
        model.weights[name] = (model.weights[name] * GEMMA3N_SPARSE_FFN_GAIN).astype(np.float32)
    write_gemma3n_gguf(path, model)
    return path


def _qwen35moe(path: Path, seed: int) -> Path:
    model = make_family_model("qwen35moe", family_tokenizer(path.parent, "qwen35moe"), np.random.default_rng(seed))
    return write_family_gguf(path, model).path


WRITERS = {
    "qwen3moe": lambda path, seed: write_moe_gguf(path, "qwen3_moe", np.random.default_rng(seed), vocab=True)[0],
    "lfm2moe": lambda path, seed: write_moe_gguf(path, "lfm2_moe", np.random.default_rng(seed), vocab=True)[0],
    "gemma4": lambda path, seed: _gemma4(path, seed, k_eq_v=False),
    "gemma4-k-eq-v": lambda path, seed: _gemma4(path, seed, k_eq_v=True),
    "gemma3n": _gemma3n,
    "gpt-oss": lambda path, seed: write_gptoss_gguf(path, np.random.default_rng(seed), vocab=True)[0],
    "qwen35moe": _qwen35moe,
}
