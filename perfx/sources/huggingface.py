"""Hugging Face model directories: config.json and safetensors, fp16/bf16 or AWQ int4 (gemm and gemv packings).

Tensors are read lazily from memory-mapped files, one at a time; AWQ projections become
``perfx.formats.Q4Matrix`` exactly (w = (q − z)·s is s·q + m with m = −z·s).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from perfx import formats
from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.families import family_of
from perfx.moe import MoEWeights, fuse_expert, held_form
from perfx.resources import read_json
from perfx.sources.base import (F16_FORM, Q8_QUANTIZE_GROUP, Form, Linear, ModelSource, check_finite,
                                fused_split_error, shape_error)
from perfx.tokenizer import Tokenizer

AWQ_VERSIONS = ("gemm", "gemv")

HF_LINEAR = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
             # a MoE block's shared expert (Qwen3.5-MoE's mlp.shared_expert)
             "gate_shexp": "mlp.shared_expert.gate_proj", "up_shexp": "mlp.shared_expert.up_proj",
             "down_shexp": "mlp.shared_expert.down_proj"}
HF_VECTOR = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
             "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
             "v_bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
             "k_norm": "self_attn.k_norm.weight", "o_bias": "self_attn.o_proj.bias", "sinks": "self_attn.sinks"}
CONV_TAPS = {"conv": "conv.conv.weight", "delta": "linear_attn.conv1d.weight"}
# Fused projections a checkpoint may hold (Phi-3), with the parts they replace
HF_FUSED = {"qkv": ("self_attn.qkv_proj", ("q", "k", "v")), "gate_up": ("mlp.gate_up_proj", ("gate", "up"))}
# Where the decoder's tensors live: text models, then the text part of multimodal Gemma 3 checkpoints (older
# and newer transformers name it differently).
HF_PREFIXES = (("model.", "lm_head"), ("language_model.model.", "language_model.lm_head"),
               ("model.language_model.", "lm_head"))
SAFETENSORS_DTYPES = {"F16": np.float16, "F32": np.float32, "BF16": None, "I32": np.int32, "U8": np.uint8}


class HFSource(ModelSource):
    """A Hugging Face model directory: config.json, model.safetensors (or an index of shards)."""

    format = "safetensors"

    def __init__(self, directory: Path, quantize: str | None = None, lm_head: str = "q8",
                 embedding: str = "head"):
        self.directory = directory
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise PerfxError(f"{directory} is not a Hugging Face model directory: it has no config.json. "
                             "Pass a directory with config.json and model.safetensors, or a .gguf file.")
        hf_config = read_json(config_path)
        super().__init__(ModelConfig.from_hf(hf_config), quantize, lm_head, embedding)
        generation = directory / "generation_config.json"
        self.generation_config = read_json(generation) if generation.is_file() else {}
        names = family_of(self.config.architecture).tensors
        quantization = hf_config.get("quantization_config") or {}
        # gpt-oss's checkpoints hold their experts in MXFP4 (_blocks, _scales), read exactly by _experts
        self.mxfp4 = quantization.get("quant_method") == "mxfp4" and names.hf_experts == "gpt_oss"
        self.awq = None if self.mxfp4 else _awq_settings(quantization, config_path)
        self.int4_group = self.awq["group"] if self.awq else None
        self._files = self._open_files()
        self._prefix, self._head = next(((p, h) for p, h in HF_PREFIXES if f"{p}embed_tokens.weight" in self._files),
                                        HF_PREFIXES[0])
        # the family's names where they differ from the common ones (Gemma's four norms a layer, LFM2's
        # operator_norm and feed_forward, Qwen3.5's linear_attn), and whether its checkpoints store w of norms
        # that multiply by 1 + w (Gemma, Qwen3.5; GGUF converters store 1 + w)
        self._vectors = {**HF_VECTOR, **names.hf_vectors}
        self._router, self._expert_layout = names.hf_router, names.hf_experts
        self._linears = {**HF_LINEAR, **names.hf_linears}
        self._final_norm = f"{self._prefix}{names.hf_final_norm}"
        self._norm_offset = names.hf_norm_offset
        self._check_tensors()

    # -- files -------------------------------------------------------------------------------------

    def _open_files(self) -> dict[str, tuple[Path, object]]:
        """Tensor name -> (file, safe_open handle); every file's header is read (and checked) here."""
        single, index = self.directory / "model.safetensors", self.directory / "model.safetensors.index.json"
        if single.is_file():
            paths = {None: single}
        elif index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise PerfxError(f"{index} has no weight_map; the index is corrupt, download it again")
            paths = {name: self.directory / file for name, file in weight_map.items()}
        else:
            found = sorted(p.name for p in self.directory.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
            raise PerfxError(f"{self.directory} has no model.safetensors or model.safetensors.index.json"
                             + (f" (found {', '.join(found)}: perfx reads only safetensors; convert with "
                                "transformers' save_pretrained(safe_serialization=True))" if found else ""))
        handles = {}
        for path in set(paths.values()):
            if not path.is_file():
                raise PerfxError(f"shard {path.name} listed in the index is missing from {self.directory}")
            try:
                handles[path] = safe_open(str(path), framework="numpy")
            except Exception as error:  # SafetensorError and friends: truncated, corrupt header
                raise PerfxError(f"{path} is not a readable safetensors file ({error}); the download is "
                                 "truncated or corrupt, fetch it again") from None
        files = {}
        for path, handle in handles.items():
            for name in handle.keys():
                files[name] = (path, handle)
        return files

    def _info(self, name: str) -> tuple[tuple[int, ...], str]:
        if name not in self._files:
            raise PerfxError(f"{self.directory}: tensor {name} is missing; the checkpoint is incomplete "
                             f"or is not a {self.config.architecture} model")
        path, handle = self._files[name]
        piece = handle.get_slice(name)
        return tuple(piece.get_shape()), piece.get_dtype()

    def _tensor(self, name: str, expected: tuple[int, ...] | None = None) -> np.ndarray:
        shape, dtype = self._info(name)
        if expected is not None and shape != tuple(expected):
            raise shape_error(str(self.directory), name, shape, expected, self.config)
        path, handle = self._files[name]
        if dtype not in SAFETENSORS_DTYPES:
            raise PerfxError(f"{path.name}: tensor {name} has dtype {dtype}; perfx reads F16, BF16, F32 "
                             "(and I32 for AWQ, U8 for MXFP4 experts)")
        try:
            tensor = _read_bf16(path, name, shape) if dtype == "BF16" else handle.get_tensor(name)
        except PerfxError:
            raise
        except Exception as error:
            raise PerfxError(f"{path}: could not read tensor {name} ({error}); the file is corrupt, "
                             "fetch it again") from None
        return check_finite(tensor, path, name)

    def _module(self, name: str, layer: int) -> str:
        return f"{self._prefix}layers.{layer}.{self._linears[name]}"

    def _fused_module(self, label: str, layer: int) -> str | None:
        if label not in HF_FUSED:   # Qwen3.5's a|b: two projections in every checkpoint
            return None
        module, parts = HF_FUSED[label]
        fused, first = f"{self._prefix}layers.{layer}.{module}", self._module(parts[0], layer)
        present = any(f"{fused}.{suffix}" in self._files for suffix in ("weight", "qweight"))
        return fused if present and not any(f"{first}.{x}" in self._files for x in ("weight", "qweight")) else None

    def _is_awq(self, module: str) -> bool:
        return self.awq is not None and f"{module}.qweight" in self._files

    def _check_tensors(self):
        """Every tensor the model needs exists with the right shape: fail at open, not at layer 20."""
        c = self.config
        self._check_shape(f"{self._prefix}embed_tokens.weight", self.expected_shape("embedding"))
        self._check_shape(self._final_norm, (c.hidden_size,))
        if not c.tie_embeddings:
            self._check_linear(self._head, self.expected_shape("lm_head"))
        if c.per_layer_input:
            self._per_layer_rows(check=True)
            self._check_linear(f"{self._prefix}per_layer_model_projection", self.expected_shape("per_layer_proj"))
            self._check_shape(f"{self._prefix}per_layer_projection_norm.weight",
                              (self.expected_vector("per_layer_norm"),))
        for i in range(c.n_layers):
            self._check_layer(i)

    def _check_layer(self, layer: int):
        """A layer holds what its kind's mixer reads: fused matrices that split as config.json says, each
        projection, the taps, the vectors."""
        c, mixer = self.config, self.mixer(layer)
        fused = set()
        for label in mixer.file_fused:
            module = self._fused_module(label, layer)
            if module is not None:
                self._check_fused(module, label)
                fused.update(HF_FUSED[label][1])
        for name in self.layer_parts(layer):
            if name not in fused:
                name = self.part_read_as(name, layer)
                self._check_linear(self._module(name, layer), self.expected_shape(name, layer))
        if mixer.taps(c):
            self._check_shape(self._conv_taps_name(layer), (mixer.taps(c), 1, c.conv_length))
        for name in self.vector_names(layer):
            self._check_shape(f"{self._prefix}layers.{layer}.{self._vectors[name]}",
                              (self.expected_vector(name, layer),))
        if c.is_moe(layer):
            self._check_experts(layer)

    # -- a MoE layer: the router ({block}.gate), the selection bias ({block}.expert_bias) and the experts, one
    # module each ({block}.experts.{e}.{gate, up, down} as the dense MLP names them) or stacked as transformers 5
    # saves them ({block}.experts.gate_up_proj (E, 2·I, hidden), {block}.experts.down_proj (E, hidden, I))

    def _moe_block(self, layer: int) -> str:
        return f"{self._prefix}layers.{layer}.{self._linears['gate'].rsplit('.', 1)[0]}"

    def _expert_module(self, part: str, layer: int, e: int) -> str:
        name = {"gate_exps": "gate", "up_exps": "up", "down_exps": "down"}[part]
        return f"{self._moe_block(layer)}.experts.{e}.{self._linears[name].rsplit('.', 1)[1]}"

    def _stacked_experts(self, layer: int) -> bool:
        return f"{self._moe_block(layer)}.experts.gate_up_proj" in self._files

    def _check_experts(self, layer: int):
        c, block = self.config, self._moe_block(layer)
        e, inter, hidden = c.n_experts, c.expert_intermediate, c.hidden_size
        self._check_shape(f"{block}.{self._router}.weight", (e, hidden))
        if c.expert_biases:
            self._check_shape(f"{block}.{self._router}.bias", (e,))
        if self._expert_layout == "gpt_oss":
            return self._check_gpt_oss_experts(block)
        if c.expert_bias:
            self._check_shape(f"{block}.expert_bias", (e,))
        if c.expert_shared_gate:   # transformers' shared_expert_gate: a Linear(hidden, 1)
            self._check_shape(f"{block}.shared_expert_gate.weight", (1, hidden))
        if self._stacked_experts(layer):
            self._check_shape(f"{block}.experts.gate_up_proj", (e, 2 * inter, hidden))
            self._check_shape(f"{block}.experts.down_proj", (e, hidden, inter))
            return
        for expert in range(e):
            for part in ("gate_exps", "up_exps", "down_exps"):
                shape = (hidden, inter) if part == "down_exps" else (inter, hidden)
                self._check_shape(f"{self._expert_module(part, layer, expert)}.weight", shape)
        extra = f"{block}.experts.{e}.{self._linears['gate'].rsplit('.', 1)[1]}.weight"
        if extra in self._files:
            raise PerfxError(f"{self.directory}: tensor {extra} exists, but config.json's num_experts = {e}; the "
                             "weights and config.json belong to different models")

    # gpt-oss (``hf_experts`` "gpt_oss"): {block}.experts.gate_up_proj (E, hidden, 2·I), its columns gate and up in
    # turn (transformers' GptOssExperts: gate_up[..., ::2], gate_up[..., 1::2]), gate_up_proj_bias (E, 2·I) the
    # same, down_proj (E, I, hidden), down_proj_bias (E, hidden); or, as openai's checkpoints hold them, MXFP4:
    # {proj}_blocks (E, rows, K/32, 16) uint8, two e2m1 codes a byte (the even element in the low nibble), and
    # {proj}_scales (E, rows, K/32) uint8 E8M0 exponents, rows the output features (gate and up interleaved)

    def _gpt_oss_parts(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        c = self.config
        e, inter, hidden = c.n_experts, c.expert_intermediate, c.hidden_size
        return {"gate_up_proj": ((e, hidden, 2 * inter), (e, 2 * inter)), "down_proj": ((e, inter, hidden), (e, hidden))}

    def _check_gpt_oss_experts(self, block: str):
        for proj, (shape, bias) in self._gpt_oss_parts().items():
            name = f"{block}.experts.{proj}"
            if f"{name}_blocks" in self._files:
                e, k, n = shape   # blocks of the (n, k) rows of each expert
                self._check_shape(f"{name}_blocks", (e, n, k // 32, 16))
                self._check_shape(f"{name}_scales", (e, n, k // 32))
            else:
                self._check_shape(name, shape)
            self._check_shape(f"{name}_bias", bias)

    def _gpt_oss_matrices(self, block: str, proj: str) -> list:
        """Each expert's (rows, K) matrix of ``proj`` in output-row order (gate_up: gate and up still interleaved):
        MXFP4 exactly as int8 codes (the doubled e2m1 values) with power-of-two float32 scales (``Q8Matrix.mxfp4``:
        the routed kernels hold it in the file's bits), else fp16."""
        name = f"{block}.experts.{proj}"
        if f"{name}_blocks" not in self._files:
            stacked = self._tensor(name)                          # (E, K, rows)
            return [np.ascontiguousarray(w.T).astype(np.float16) for w in stacked]
        blocks, scales = self._tensor(f"{name}_blocks"), self._tensor(f"{name}_scales")
        e, rows, groups, _ = blocks.shape
        codes = np.empty((e, rows, groups, 32), np.int8)
        codes[..., 0::2] = formats.MXFP4_VALUES[blocks & 0x0F]
        codes[..., 1::2] = formats.MXFP4_VALUES[blocks >> 4]
        # 2^(x − 127) of the e2m1 value is 2^(x − 128) of its doubled code: ggml's e8m0 half, as the GGUF reader
        s = formats.mxfp4_scales(scales)
        return [formats.Q8Matrix(codes[i].reshape(rows, groups * 32), s[i], np.zeros_like(s[i]), 32, f32=True,
                                 symmetric=True, mxfp4=True) for i in range(e)]

    def _gpt_oss_experts(self, layer: int, router, router_bias) -> MoEWeights:
        c, block = self.config, self._moe_block(layer)
        inter = c.expert_intermediate
        gate_up = self._gpt_oss_matrices(block, "gate_up_proj")
        down = self._gpt_oss_matrices(block, "down_proj")
        # gate rows (even) then up rows (odd), as the routed kernels hold an expert (the GGUF converter's split)
        order = np.concatenate([np.arange(0, 2 * inter, 2), np.arange(1, 2 * inter, 2)])
        gate_up_bias = self._tensor(f"{block}.experts.gate_up_proj_bias", (c.n_experts, 2 * inter))
        return MoEWeights(
            router=np.ascontiguousarray(router), router_bias=router_bias,
            gate_up=[fuse_expert([self._quantized(formats.permute_linear_rows(w, order))]) for w in gate_up],
            down=[fuse_expert([self._quantized(w)]) for w in down],
            gate_up_bias=np.ascontiguousarray(gate_up_bias[:, order], dtype=np.float32),
            down_bias=self._tensor(f"{block}.experts.down_proj_bias", (c.n_experts, c.hidden_size)).astype(np.float32))

    def _experts(self, layer: int) -> MoEWeights:
        c, block = self.config, self._moe_block(layer)
        router = self._tensor(f"{block}.{self._router}.weight", (c.n_experts, c.hidden_size)).astype(np.float32)
        if self._expert_layout == "gpt_oss":
            bias = (self._tensor(f"{block}.{self._router}.bias", (c.n_experts,)).astype(np.float32)
                    if c.expert_biases else None)
            return self._gpt_oss_experts(layer, router, bias)
        bias = self._tensor(f"{block}.expert_bias", (c.n_experts,)).astype(np.float32) if c.expert_bias else None
        shared_gate = None
        if c.expert_shared_gate:
            shared_gate = self._tensor(f"{block}.shared_expert_gate.weight",
                                       (1, c.hidden_size)).astype(np.float32).reshape(-1)
        if self._stacked_experts(layer):
            gate_up = self._tensor(f"{block}.experts.gate_up_proj")
            down = self._tensor(f"{block}.experts.down_proj")
            pairs = [([gate_up[e].astype(np.float16)], down[e].astype(np.float16)) for e in range(c.n_experts)]
        else:
            def read(part, e):
                return self._tensor(f"{self._expert_module(part, layer, e)}.weight").astype(np.float16)
            pairs = [([read("gate_exps", e), read("up_exps", e)], read("down_exps", e)) for e in range(c.n_experts)]
        return MoEWeights(router=np.ascontiguousarray(router), selection_bias=bias, shared_gate=shared_gate,
                          gate_up=[fuse_expert([self._quantized(p) for p in parts]) for parts, _ in pairs],
                          down=[fuse_expert([self._quantized(d)]) for _, d in pairs])

    def _expert_form(self, part: str, layer: int) -> Form:
        k = self.config.expert_intermediate if part == "down_exps" else self.config.hidden_size
        proj = "down_proj" if part == "down_exps" else "gate_up_proj"
        if self._expert_layout == "gpt_oss" and f"{self._moe_block(layer)}.experts.{proj}_blocks" in self._files:
            return formats.MXFP4_FORM   # as the GGUF reader holds it
        return held_form(self._quantized_form(F16_FORM, k))

    def _conv_taps_name(self, layer: int) -> str:
        return f"{self._prefix}layers.{layer}.{CONV_TAPS[self.config.layers[layer].kind]}"

    def _conv_weight(self, layer: int) -> np.ndarray:
        c = self.config
        channels = self.mixer(layer).taps(c)
        taps = self._tensor(self._conv_taps_name(layer), (channels, 1, c.conv_length))
        return np.ascontiguousarray(taps.reshape(channels, c.conv_length), dtype=np.float32)

    def _check_fused(self, module: str, label: str):
        expected = self.expected_shape(label)
        if self._is_awq(module):
            return self._check_linear(module, expected)
        shape, _ = self._info(f"{module}.weight")
        if shape != expected:
            raise fused_split_error(self.directory, f"{module}.weight", shape, label, self.config, "config.json",
                                    "intermediate_size", "the weights and config.json belong to different models")

    def _check_shape(self, name: str, expected):
        shape, _ = self._info(name)
        if shape != tuple(expected):
            raise shape_error(str(self.directory), name, shape, expected, self.config)

    def _check_linear(self, module: str, expected):
        if not self._is_awq(module):
            return self._check_shape(f"{module}.weight", expected)
        for suffix, shape in _awq_shapes(self.awq, *expected).items():
            self._check_shape(f"{module}.{suffix}", shape)

    # -- tensors -----------------------------------------------------------------------------------

    def _read_linear(self, module: str, expected) -> Linear:
        if not self._is_awq(module):
            return self._tensor(f"{module}.weight", expected).astype(np.float16)
        version, group = self.awq["version"], self.awq["group"]
        parts = [self._tensor(f"{module}.{suffix}") for suffix in ("qweight", "qzeros", "scales")]
        read = formats.from_awq_gemm if version == "gemm" else formats.from_awq_gemv
        return read(*parts, group)

    def _linear(self, name: str, layer: int) -> Linear:
        return self._read_linear(self._module(name, layer), self.expected_shape(name, layer))

    def _per_layer_rows(self, check: bool = False) -> np.ndarray | None:
        """The per-layer table (V, n_layers·P) fp16 (``check``: only its shape checked). Gemma 3n's checkpoints
        hold rows for the text vocabulary only (vocab_size_per_layer_input), and the converter pads the rest
        (the vision and audio tokens') with zeros to the full vocabulary: so here too."""
        name = f"{self._prefix}embed_tokens_per_layer.weight"
        (rows, width), _ = self._info(name)
        v, expected = self.config.vocab_size, self.expected_shape("per_layer_table")
        if rows > v or width != expected[1]:
            raise shape_error(str(self.directory), name, (rows, width), expected, self.config)
        if check:
            return None
        table = self._tensor(name).astype(np.float16)
        return table if rows == v else np.concatenate([table, np.zeros((v - rows, width), np.float16)])

    def has_part(self, name: str, layer: int) -> bool:
        module = self._module(name, layer)
        return f"{module}.weight" in self._files or f"{module}.qweight" in self._files

    def _per_layer_forms(self) -> dict[str, set[Form]]:
        # the table as the head's rule keeps the embedding (int8 by default: E2B's is 4.7 GB in fp16)
        width = self.config.n_layers * self.config.per_layer_input
        int8 = self.lm_head_form == "q8" and width % Q8_QUANTIZE_GROUP == 0
        table = Form("q8", Q8_QUANTIZE_GROUP) if int8 else F16_FORM
        module = f"{self._prefix}per_layer_model_projection"
        model = Form("q4", self.awq["group"]) if self._is_awq(module) else F16_FORM
        return {"ple_table": {table}, "ple_model": {self._quantized_form(model, self.config.hidden_size)}}

    def _altup_tables(self) -> tuple[np.ndarray, np.ndarray]:
        c = self.config
        return tuple(np.stack([self._tensor(f"{self._prefix}{name}.{i}.weight", (c.hidden_size, c.hidden_size))
                               for i in range(c.altup_inputs - 1)]).astype(np.float64)
                     for name in ("altup_projections", "altup_unembed_projections"))

    def _per_layer_tables(self) -> tuple:
        table = self._per_layer_rows()
        norm = self._tensor(f"{self._prefix}per_layer_projection_norm.weight",
                            (self.expected_vector("per_layer_norm"),)).astype(np.float32)
        model = self._read_linear(f"{self._prefix}per_layer_model_projection", self.expected_shape("per_layer_proj"))
        return self._as_head(table), self.quantized(model), norm + self._norm_offset

    def _fused(self, label: str, layer: int) -> Linear | None:
        module = self._fused_module(label, layer)
        return None if module is None else self._read_linear(module, self.expected_shape(label))

    def _vector(self, name: str, layer: int | None) -> np.ndarray:
        tensor = self._final_norm if name == "final_norm" else f"{self._prefix}layers.{layer}.{self._vectors[name]}"
        vector = self._tensor(tensor, (self.expected_vector(name, layer),)).astype(np.float32)
        if name == "ssm_a":   # A = −exp(A_log), as the converter stores ssm_a
            return -np.exp(vector.astype(np.float64)).astype(np.float32)
        return vector + self._norm_offset if name.endswith("norm") and name != "delta_norm" else vector

    def _part_form(self, name: str, layer: int) -> Form:
        module = self._module(name, layer)
        return Form("q4", self.awq["group"]) if self._is_awq(module) else F16_FORM

    def _fused_form(self, label: str, layer: int) -> Form | None:
        module = self._fused_module(label, layer)
        if module is None:
            return None
        return Form("q4", self.awq["group"]) if self._is_awq(module) else F16_FORM

    def _table_form(self, name: str) -> Form:
        return Form("q4", self.awq["group"]) if name == "lm_head" and self._is_awq(self._head) else F16_FORM

    def _embedding(self) -> np.ndarray:
        return self._tensor(f"{self._prefix}embed_tokens.weight", self.expected_shape("embedding")).astype(np.float16)

    def _lm_head(self) -> Linear:
        return self._read_linear(self._head, self.expected_shape("lm_head"))

    def _load_tokenizer(self):
        if not any((self.directory / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            return None
        return Tokenizer.from_hf_dir(self.directory)

    def describe(self) -> dict:
        files = sorted({path for path, _ in self._files.values()})
        dtypes = sorted({self._info(name)[1] for name in self._files})
        if self.awq:
            quantization = f"awq-{self.awq['version']} {formats.describe_q4_form(formats.Q4_ZEROS, self.awq['group'])}"
        else:
            quantization = "/".join(d.lower() for d in dtypes)
        if self.quantize:
            quantization += f", quantized to {self.quantize} on load"
        embedding = self._embedding_q4_group()
        if self.lm_head_form == "q8" and self.config.hidden_size % 32 == 0:
            quantization += ", lm_head int8 on load" if embedding else ", lm_head and embedding int8 on load"
        if embedding:
            quantization += f", embedding {formats.describe_q4_form(formats.Q4_ZEROS, embedding)} on load"
        return {"format": "safetensors", "path": str(self.directory), "files": [p.name for p in files],
                "file_size": sum(p.stat().st_size for p in files), "quantization": quantization,
                "architecture": self.config.architecture, "notes": list(self.notes)}


def _read_bf16(path: Path, name: str, shape) -> np.ndarray:
    """numpy has no bfloat16: map the tensor's bytes from the safetensors header and widen to float32.

    bf16 is the top half of an IEEE float32, so a 16-bit shift is exact.
    """
    with open(path, "rb") as stream:
        header_size = int.from_bytes(stream.read(8), "little")
        header = json.loads(stream.read(header_size))
    start, stop = header[name]["data_offsets"]
    raw = np.memmap(path, dtype=np.uint16, mode="r", offset=8 + header_size + start,
                    shape=((stop - start) // 2,))
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)


def _awq_settings(quantization: dict | None, config_path: Path) -> dict | None:
    """The AWQ parameters perfx needs, or None for an unquantized checkpoint; PerfxError for anything else."""
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method != "awq":
        raise PerfxError(f"{config_path}: quantization method {method!r} is not supported; perfx reads AWQ "
                         "int4 (version gemm or gemv) and fp16/bf16 checkpoints (add quantize='q4' to quantize "
                         "on load), or GGUF files (Q4_K_M, Q5_K_M, Q8_0, Q4_0, ...)")
    bits = quantization.get("w_bit", quantization.get("bits"))
    group = quantization.get("q_group_size", quantization.get("group_size"))
    version = str(quantization.get("version", "gemm")).lower()
    if bits != 4:
        raise PerfxError(f"{config_path}: AWQ with {bits}-bit weights is not supported; perfx's int4 kernels "
                         "need w_bit = 4 (group size 32, 64 or 128)")
    if group not in formats.GROUP_SIZES:
        raise PerfxError(f"{config_path}: AWQ group size {group} is not supported; perfx supports "
                         f"q_group_size {formats.GROUP_SIZES}")
    if version not in AWQ_VERSIONS:
        raise PerfxError(f"{config_path}: AWQ version {version!r} is not supported; perfx reads the "
                         f"{' and '.join(AWQ_VERSIONS)} packings (re-save the model with AutoAWQ "
                         "version 'gemm')")
    if quantization.get("zero_point", True) is not True:
        raise PerfxError(f"{config_path}: AWQ without zero points (zero_point false) is not supported; perfx "
                         "reads zero_point true checkpoints (AutoAWQ's default)")
    return {"version": version, "group": int(group),
            "modules_to_not_convert": list(quantization.get("modules_to_not_convert") or [])}


def _awq_shapes(awq: dict, n: int, k: int) -> dict[str, tuple[int, int]]:
    group = awq["group"]
    if k % group:
        raise PerfxError(f"AWQ group size {group} does not divide K = {k}; the checkpoint contradicts "
                         "its config")
    if awq["version"] == "gemm":
        return {"qweight": (k, n // 8), "qzeros": (k // group, n // 8), "scales": (k // group, n)}
    width = formats.awq_zeros_width(k, group)
    return {"qweight": (n, k // 8), "qzeros": (n, width), "scales": (n, 8 * width)}
