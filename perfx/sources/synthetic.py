"""Synthetic models: real shapes and recipes with random 4-bit weights, for benchmarks and tests without downloads.

``open_model("synthetic:llama-2-7b")`` (group 128 with 4-bit zero points, as the usual AWQ checkpoints),
``"synthetic:smollm2-135m"`` (group 32, as its Q4_0/Q4_1 GGUFs), ``"synthetic:tiny"``, and the phone-size shapes
of the other families (``gemma-3-270m``, ``qwen3-1.7b``, ``phi-4-mini``, ``lfm2-350m``, ``qwen3.5-0.8b``, ...:
their config.json values, group 32 as their Q4_0 GGUFs); each family file names its own (``Family.synthetic``).
The weights are generated lazily from a seed. Generating a 7B layer takes about a second, so models whose layers are large reuse one random
layer for every layer: benchmarks only need the bytes and the shapes, not distinct weights. The text
such a model produces is noise; there is no tokenizer (feed token ids).
"""

from __future__ import annotations

import numpy as np

from perfx import moe
from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.families import FAMILIES
from perfx.formats import MXFP4_FORM, MXFP4_VALUES, Q4_PAIRS, Q4_ZEROS, Q4Matrix, Q8Matrix, describe_q4_form
from perfx.sources.base import F16_FORM, Form, LayerWeights, ModelSource

# name -> (config, group size, int4 form): every family's presets (perfx.families, Family.synthetic)
SYNTHETIC_MODELS = {name: (ModelConfig.from_hf(dict(preset.config)), preset.group,
                           Q4_ZEROS if preset.zero_points else Q4_PAIRS)
                    for family in FAMILIES.values() for name, preset in family.synthetic.items()}
# name -> the form of its experts (Preset.experts): "q4", or "mxfp4" (gpt-oss's)
SYNTHETIC_EXPERTS = {name: preset.experts for family in FAMILIES.values() for name, preset in family.synthetic.items()}
# Above this many weights per layer, one random layer stands in for all of them.
DISTINCT_LAYER_LIMIT = 8_000_000
# Gemma 4's per-layer table is made up only up to this many values (E2B's has 2.3 G: gigabytes of random codes)
PER_LAYER_TABLE_LIMIT = 64_000_000
SYNTHETIC_PREFIX = "synthetic:"


def open_synthetic(name: str, seed: int = 0, lm_head: str = "q8", embedding: str = "head") -> SyntheticSource:
    """``"synthetic:<model>"`` -> its SyntheticSource; unknown names list the known ones."""
    key = name[len(SYNTHETIC_PREFIX):] if name.startswith(SYNTHETIC_PREFIX) else name
    if key not in SYNTHETIC_MODELS:
        raise PerfxError(f"unknown synthetic model {name!r}; known: "
                         f"{', '.join('synthetic:' + k for k in SYNTHETIC_MODELS)}")
    config, group, form = SYNTHETIC_MODELS[key]
    return SyntheticSource(key, config, group, seed, lm_head, form, embedding, SYNTHETIC_EXPERTS.get(key, "q4"))


class SyntheticSource(ModelSource):
    """Random int4 linear layers (scales ~ 0.02/8, offsets ≈ −8·s: pairs, or zero points 7..9), unit norms, fp16
    tables of std 0.02."""

    format = "synthetic"

    def __init__(self, name: str, config: ModelConfig, group: int, seed: int = 0, lm_head: str = "q8",
                 form: int = Q4_PAIRS, embedding: str = "head", experts: str = "q4"):
        super().__init__(config, lm_head=lm_head, embedding=embedding)
        self.name, self.group, self.seed, self.form = name, group, seed, form
        self.experts = experts   # "q4", or "mxfp4": the experts as gpt-oss's files hold them
        self.int4_group = group
        c = config
        per_layer = c.hidden_size * (c.qkv_dim + c.q_dim + 3 * max(c.intermediate_size,
                                                                   c.n_experts * c.expert_intermediate))
        self.distinct_layers = per_layer <= DISTINCT_LAYER_LIMIT
        self._shared_layers: dict[tuple, LayerWeights] = {}   # one per kind, shape (Gemma 4's differ), dense or MoE

    def _rng(self, *stream: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *stream])

    def _random_q4(self, rng: np.random.Generator, n: int, k: int) -> Q4Matrix:
        # rng.bytes & 0xF is several times faster than rng.integers for hundreds of millions of codes
        codes = (np.frombuffer(rng.bytes(n * k), dtype=np.uint8) & 0x0F).reshape(n, k)
        scales = (rng.uniform(0.5, 1.5, size=(n, k // self.group)) * 0.02 / 8).astype(np.float16)
        if self.form == Q4_ZEROS:
            zeros = rng.integers(7, 10, size=scales.shape, dtype=np.uint8)
            return Q4Matrix.with_zeros(codes, scales, zeros, self.group)
        offsets = (-8 * scales.astype(np.float32) * rng.uniform(0.9, 1.1, size=scales.shape)).astype(np.float16)
        return Q4Matrix(codes, scales, offsets, self.group)

    def _random_mxfp4(self, rng: np.random.Generator, n: int, k: int) -> Q8Matrix:
        """MXFP4 as the GGUF reader holds it (``perfx.formats.from_gguf_mxfp4``): doubled e2m1 codes, a power-of-two
        float32 scale a group of 32 (weights of about 0.01)."""
        codes = MXFP4_VALUES[np.frombuffer(rng.bytes(n * k), dtype=np.uint8) & 0x0F].reshape(n, k)
        scales = np.ldexp(1.0, rng.integers(-10, -7, size=(n, k // 32))).astype(np.float32)
        return Q8Matrix(codes, scales, np.zeros_like(scales), 32, f32=True, symmetric=True, mxfp4=True)

    def _make_layer(self, i: int) -> LayerWeights:
        c, rng = self.config.at(i), self._rng(1, i)   # the layer's own shapes
        hidden = c.hidden_size
        norms = {}
        if c.post_norms:
            norms.update(post_attn_norm=np.ones(hidden, np.float32), post_ffn_norm=np.ones(hidden, np.float32))
        if c.per_layer_input:
            norms.update(ple_gate=self._random_q4(rng, c.per_layer_input, hidden),
                         ple_proj=self._random_q4(rng, hidden, c.per_layer_input), ple_norm=np.ones(hidden, np.float32))
        if c.layer_scale:
            norms["out_scale"] = np.ones(1, np.float32)
        if c.altup_inputs:   # Gemma 3n: LAuReL's int4 pair, AltUp's small float matrices, unit norms
            a = c.altup_inputs

            def small(*shape):
                return (rng.standard_normal(shape) * 0.1).astype(np.float32)
            norms["altup"] = dict(laurel_l=self._random_q4(rng, c.laurel_rank, hidden),
                                  laurel_r=self._random_q4(rng, hidden, c.laurel_rank),
                                  altup_router=small(a, hidden), altup_predict=small(a * a, a),
                                  altup_correct=small(a, a), laurel_norm=np.ones(hidden, np.float32),
                                  altup_router_norm=np.ones(hidden, np.float32),
                                  altup_correct_scale=np.ones(hidden, np.float32))
        ffn = dict(attn_norm=np.ones(hidden, np.float32), ffn_norm=np.ones(hidden, np.float32))
        if c.is_moe(i):
            experts = self._random_mxfp4 if self.experts == "mxfp4" else self._random_q4
            ffn.update(gate_up=None, down=None, moe=moe.synthetic(c, experts, rng))
        else:
            ffn.update(gate_up=self._random_q4(rng, 2 * c.intermediate_size, hidden),
                       down=self._random_q4(rng, hidden, c.intermediate_size))
        # the kind's own weights, as its mixer makes them random
        mixing = self.mixer(i).synthetic(c, self._random_q4, rng)
        return LayerWeights(**ffn, mixing=mixing, **norms)

    def layer(self, i: int) -> LayerWeights:
        if not 0 <= i < self.config.n_layers:
            raise PerfxError(f"layer {i} does not exist: the model has {self.config.n_layers} layers")
        if self.distinct_layers:
            return self._make_layer(i)
        c = self.config
        shape_of = {j: (c.layers[j].kind, c.at(j).head_dim, c.at(j).n_kv_heads, c.at(j).kv_shared,
                        c.at(j).intermediate_size, c.is_moe(j)) for j in range(c.n_layers)}
        if shape_of[i] not in self._shared_layers:
            self._shared_layers[shape_of[i]] = self._make_layer(next(j for j in shape_of if shape_of[j] == shape_of[i]))
        return self._shared_layers[shape_of[i]]

    def _per_layer_tables(self) -> tuple:
        c, rng = self.config, self._rng(4)
        width = c.n_layers * c.per_layer_input
        if c.vocab_size * width > PER_LAYER_TABLE_LIMIT:
            raise PerfxError(f"synthetic:{self.name}: its per-layer table of {c.vocab_size} × {width} values is not "
                             "made up (gigabytes of random codes); `perfx tune` measures its shapes without it. "
                             "Run a Gemma 4 GGUF for its weights")
        return (self._random_q4(rng, c.vocab_size, width), self._random_q4(rng, width, c.hidden_size),
                np.ones(c.per_layer_input, np.float32))

    def _altup_tables(self) -> tuple[np.ndarray, np.ndarray]:
        c = self.config
        shape = (c.altup_inputs - 1, c.hidden_size, c.hidden_size)
        values = (np.arange(-128, 128) * (1.0 / 73.9 / np.sqrt(c.hidden_size))).astype(np.float32)
        return tuple(values[np.frombuffer(self._rng(stream).bytes(int(np.prod(shape))), np.uint8)].reshape(shape)
                     for stream in (5, 6))

    def _random_table(self, stream: int) -> np.ndarray:
        c = self.config
        rng = self._rng(stream)
        # random bytes through a 256-entry fp16 table (uniform, std 0.02): standard_normal and fp16
        # arithmetic in numpy take seconds for 7B's 131M entries
        values = (np.arange(-128, 128) * (0.02 / 73.9)).astype(np.float16)
        noise = np.frombuffer(rng.bytes(c.vocab_size * c.hidden_size), dtype=np.uint8)
        return values[noise].reshape(c.vocab_size, c.hidden_size)

    def _embedding(self) -> np.ndarray:
        return self._random_table(2)

    def _lm_head(self) -> np.ndarray:
        # fp16 like the lm_head of AWQ checkpoints (AutoAWQ leaves it unquantized); the head rule applies
        return self._random_table(3)

    def _part_form(self, name: str, layer: int) -> Form:
        return Form("q4", self.group)

    def _expert_form(self, part: str, layer: int) -> Form:
        if self.experts == "mxfp4":
            return MXFP4_FORM
        return Form("q4", self.group, f32=self.form == Q4_ZEROS)   # zero points' offsets −s·z are float32

    def _per_layer_forms(self) -> dict[str, set[Form]]:
        return {"ple_table": {Form("q4", self.group)}, "ple_model": {Form("q4", self.group)}}

    def _table_form(self, name: str) -> Form:
        return F16_FORM

    def final_norm(self) -> np.ndarray:
        return np.ones(self.config.hidden_size, np.float32)

    def describe(self) -> dict:
        head = ", lm_head int8" if self.lm_head_form == "q8" else ""
        if self._embedding_q4_group():
            head += f", embedding {describe_q4_form(Q4_ZEROS, self._embedding_q4_group())}"
        return {"format": "synthetic", "path": f"synthetic:{self.name}", "files": [], "file_size": 0,
                "quantization": f"random {describe_q4_form(self.form, self.group)}{head}"
                                + (", experts MXFP4 (e2m1 nibbles, E8M0 scales)" if self.experts == "mxfp4" else ""),
                "architecture": self.config.architecture,
                "notes": [] if self.distinct_layers else ["one random layer is reused for every layer"]}
