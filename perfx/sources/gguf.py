"""GGUF files (architectures llama, qwen2, qwen3, gemma2, gemma3, phi3, smollm3, lfm2, qwen35), every tensor type
llama.cpp's usual quantizations write.

Q4_0, Q4_1 and Q4_K go into the int4 form (G = 32); Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 into the int8 form
(G = 32, Q6_K 16), exactly (``perfx.formats``); F16, BF16 and F32 become fp16. So Q4_K_M and Q5_K_M files,
which mix Q4_K or Q5_K with Q5_0, Q6_K and Q8_0 tensors, run as they are. The header is checked when the
file is opened (every tensor present, of a type perfx reads, of the shape the config implies); tensors
are read from the memory map one at a time. llama.cpp permutes the rows of Wq and Wk of Llama-style models
for its interleaved RoPE; they are put back in Hugging Face's rotate-half order here. Phi-3 files hold QKV
(attn_qkv) and gate-up (ffn_up: gate rows, then up rows) fused, which is the form perfx's kernels read.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import quants

from perfx import formats
from perfx.config import ModelConfig
from perfx.errors import PerfxError
from perfx.families import family_of
from perfx.gguf_file import GGUFFile
from perfx.moe import MoEWeights, fuse_expert, held_form
from perfx.reference import unpermute_qk
from perfx.sources.base import (ALTUP_LINEARS, F16_FORM, Form, Linear, ModelSource, check_finite, fused_split_error,
                                permute_linear_rows, shape_error)
from perfx.tokenizer import Tokenizer

GGUF_LINEAR = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
               "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
               "gate_shexp": "ffn_gate_shexp", "up_shexp": "ffn_up_shexp", "down_shexp": "ffn_down_shexp",
               "conv_in": "shortconv.in_proj", "conv_out": "shortconv.out_proj",
               "delta_qkv": "attn_qkv", "delta_z": "attn_gate", "delta_a": "ssm_alpha", "delta_b": "ssm_beta",
               "delta_out": "ssm_out", "ple_gate": "inp_gate", "ple_proj": "proj",
               "laurel_l": "laurel_l", "laurel_r": "laurel_r", "altup_router": "altup_router",
               "altup_predict": "altup_predict_coef", "altup_correct": "altup_correct_coef"}
GGUF_VECTOR = {"attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight",
               "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
               "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
               "post_attn_norm": "post_attention_norm.weight", "post_ffn_norm": "post_ffw_norm.weight",
               "dt_bias": "ssm_dt.bias", "ssm_a": "ssm_a", "delta_norm": "ssm_norm.weight",
               "ple_norm": "post_norm.weight", "out_scale": "layer_output_scale.weight",
               "laurel_norm": "laurel_post_norm.weight", "altup_router_norm": "altup_router_norm.weight",
               "altup_correct_scale": "altup_correct_scale.weight",
               "o_bias": "attn_output.bias", "sinks": "attn_sinks.weight"}
# The taps of a layer's short convolution, by layer kind: the tensor, and the keys that size its length and its
# channels ({arch}: the architecture)
GGUF_CONV_TAPS = {"conv": ("shortconv.conv.weight", "{arch}.shortconv.l_cache", "hidden"),
                  "delta": ("ssm_conv1d.weight", "{arch}.ssm.conv_kernel",
                            "2 × {arch}.ssm.group_count × ssm.state_size + ssm.inner_size")}
# A MoE layer's tensors (perfx.moe): each expert projection stacked over the experts, the router, the selection bias
GGUF_EXPERTS = {"gate_exps": "ffn_gate_exps", "up_exps": "ffn_up_exps", "down_exps": "ffn_down_exps"}
GGUF_ROUTER, GGUF_SELECTION_BIAS = "ffn_gate_inp.weight", "exp_probs_b.bias"
GGUF_SHARED_GATE = "ffn_gate_inp_shexp.weight"   # the shared expert's σ gate, (hidden,)
GGUF_FUSED_EXPERTS = "ffn_gate_up_exps"   # gate and up of every expert in one (E, 2·I, hidden) tensor, where written
GGUF_ROUTER_BIAS = "ffn_gate_inp.bias"    # gpt-oss: the router's bias, and each expert tensor's (E, rows) bias
# Fused matrices a file may hold (Phi-3), with the parts they replace
GGUF_FUSED = {"qkv": ("attn_qkv", ("q", "k", "v")), "gate_up": ("ffn_up", ("gate", "up"))}
# Every tensor type perfx reads, and the device form it reads into.
GGUF_FORMS = {"Q4_0": Form("q4", 32), "Q4_1": Form("q4", 32), "Q4_K": Form("q4", 32),
              "Q5_0": Form("q8", 32, symmetric=True), "Q5_1": Form("q8", 32), "Q8_0": Form("q8", 32, symmetric=True),
              "Q5_K": Form("q8", 32, True), "Q6_K": Form("q8", 16, True, True), "MXFP4": Form("q8", 32, True, True),
              "F16": F16_FORM, "BF16": F16_FORM, "F32": F16_FORM}
GGUF_TYPES = tuple(GGUF_FORMS)
# The int4 types' scales' forms (perfx.formats): Q4_0's d·(q − 8), Q4_1's and Q4_K's (d, min) pairs
GGUF_Q4_SCALES = {"Q4_0": formats.Q4_SYMMETRIC, "Q4_1": formats.Q4_PAIRS, "Q4_K": formats.Q4_PAIRS}
UNSUPPORTED_TYPE_HELP = ("requantize the model with llama.cpp's llama-quantize to Q4_K_M, Q5_K_M, Q8_0 or Q4_0 "
                         "(from its F16 or Q8_0 GGUF), or download one of those files")


class GGUFSource(ModelSource):
    """A GGUF file of a supported architecture, any of ``GGUF_TYPES``, in the int4, int8 or fp16 form."""

    format = "gguf"
    int4_group = 32  # Q4_0, Q4_1 blocks and Q4_K sub-blocks

    def __init__(self, path: Path, quantize: str | None = None, lm_head: str = "q8", embedding: str = "head"):
        self.path = path
        self.file = GGUFFile(path)   # refuses a truncated or corrupt file, naming what runs past its end
        super().__init__(ModelConfig.from_gguf(self.file), quantize, lm_head, embedding)
        self.family = family_of(self.config.architecture)
        self._tensors = self.file.tensors
        self._check_tensors()

    def _check_tensors(self):
        c = self.config
        self._check("token_embd.weight", self.expected_shape("embedding"))
        self._check(self._final_norm_name(), (c.hidden_size,))
        if not c.tie_embeddings:
            self._check("output.weight", self.expected_shape("lm_head"))
        if c.per_layer_input:
            self._check("per_layer_token_embd.weight", self.expected_shape("per_layer_table"))
            self._check("per_layer_model_proj.weight", self.expected_shape("per_layer_proj"))
            self._check("per_layer_proj_norm.weight", (self.expected_vector("per_layer_norm"),))
        for i in range(c.n_layers):
            self._check_layer(i)

    def _check_layer(self, layer: int):
        """A layer holds what its kind's mixer reads: no tensor of another kind (the header would assign the kinds
        wrongly), fused matrices that split as the header says, each projection, the taps, the vectors."""
        c, mixer = self.config, self.mixer(layer)
        for (kind, part), why in mixer.misplaced.items():
            if kind in self.family.layer_kinds and self._part_tensor(kind, part, layer) in self._tensors:
                why = why.format(arch=c.architecture, keys=self._pattern_keys())
                raise PerfxError(f"{self.path}: layer {layer} {why}; the header does not describe this file")
        fused = set()
        for label in mixer.file_fused:
            if self._is_fused(label, layer):
                self._check_fused(label, layer)
                fused.update(GGUF_FUSED[label][1])
        parts = [self.part_read_as(name, layer) for name in self.layer_parts(layer) if name not in fused]
        if "q" in parts:
            self._check_heads(layer)
        for name in parts:
            self._check(f"blk.{layer}.{GGUF_LINEAR[name]}.weight", self.expected_shape(name, layer))
        if mixer.taps(c):
            self._check_conv_taps(layer)
        for name in ALTUP_LINEARS if c.altup_inputs else ():
            self._check(f"blk.{layer}.{GGUF_LINEAR[name]}.weight", self.expected_shape(name, layer))
        for name in self.vector_names(layer):
            self._check(self._vector_tensor(name, layer), (self.expected_vector(name, layer),))
        if c.is_moe(layer):
            self._check_experts(layer)

    def _check_experts(self, layer: int):
        """A MoE layer's router (E, hidden), its selection bias where the header has one, and each expert tensor
        (E, rows, K): a count or size that differs from the header's keys is named."""
        c, arch = self.config, self.config.architecture
        self._check_router(f"blk.{layer}.{GGUF_ROUTER}", (c.n_experts, c.hidden_size))
        if c.expert_bias:
            self._check_router(f"blk.{layer}.{GGUF_SELECTION_BIAS}", (c.n_experts,))
        if c.expert_biases:
            self._check_router(f"blk.{layer}.{GGUF_ROUTER_BIAS}", (c.n_experts,))
            for part in self._expert_bias_parts(layer):
                self._check_router(self._expert_bias_tensor(part, layer), (c.n_experts, self._expert_shape(part)[0]))
        if c.expert_shared_gate:
            self._check_shared_gate(layer)
        parts = dict(GGUF_EXPERTS)
        if self._fused_experts(layer):
            parts = {"gate_up_exps": GGUF_FUSED_EXPERTS, "down_exps": GGUF_EXPERTS["down_exps"]}
        for part, tensor in parts.items():
            name = f"blk.{layer}.{tensor}.weight"
            t = self._tensors.get(name)
            if t is None:
                raise PerfxError(f"{self.path}: tensor {name} is missing; the GGUF is incomplete or not a {arch} model")
            shape = tuple(int(d) for d in reversed(t.shape))
            want = (c.n_experts, *self._expert_shape(part))
            if len(shape) != 3 or shape[0] != c.n_experts:
                raise PerfxError(f"{self.path}: tensor {name} holds {shape[0] if len(shape) == 3 else shape} experts, "
                                 f"but {arch}.expert_count = {c.n_experts}; the header does not describe this file")
            if shape != want:
                raise PerfxError(f"{self.path}: tensor {name} has shape {shape}, but {arch}.expert_count, "
                                 f"embedding_length and expert_feed_forward_length need {want}; the header does not "
                                 "describe this file")
            if t.tensor_type.name not in GGUF_TYPES:
                raise PerfxError(f"{self.path}: tensor {name} has type {t.tensor_type.name}, which perfx does not "
                                 f"read; perfx reads GGUF tensor types {', '.join(GGUF_TYPES)}: "
                                 f"{UNSUPPORTED_TYPE_HELP}")

    def _check_router(self, name: str, want: tuple):
        t = self._tensors.get(name)
        if t is None:
            raise PerfxError(f"{self.path}: tensor {name} is missing; the GGUF is incomplete or not a "
                             f"{self.config.architecture} model")
        shape = tuple(int(d) for d in reversed(t.shape))
        if len(want) == 2 and shape != want and t.tensor_type.name in ("F32", "F16", "BF16"):
            raise PerfxError(f"{self.path}: tensor {name} has shape {shape}, but {self.config.architecture}"
                             f".expert_count, embedding_length and expert_feed_forward_length need {want} (a bias "
                             "a row of each expert); the header does not describe this file")
        if shape != want:
            raise PerfxError(f"{self.path}: tensor {name} has shape {shape}, but {self.config.architecture}"
                             f".expert_count and embedding_length need {want}; the header does not describe this file")
        return t

    def _expert_bias_parts(self, layer: int) -> tuple[str, ...]:
        """The expert projections whose biases a layer holds (gpt-oss): gate and up apart or fused, and down."""
        fused = f"blk.{layer}.{GGUF_FUSED_EXPERTS}.bias" in self._tensors
        return ("gate_up_exps", "down_exps") if fused else ("gate_exps", "up_exps", "down_exps")

    def _expert_bias_tensor(self, part: str, layer: int) -> str:
        return f"blk.{layer}.{GGUF_FUSED_EXPERTS if part == 'gate_up_exps' else GGUF_EXPERTS[part]}.bias"

    def _expert_bias(self, part: str, layer: int) -> np.ndarray:
        c = self.config
        name = self._expert_bias_tensor(part, layer)
        t = self._tensors[name]
        raw = np.asarray(t.data)
        values = (quants.dequantize(raw, gguf.GGMLQuantizationType.BF16) if t.tensor_type.name == "BF16"
                  else raw.astype(np.float32))
        return check_finite(values.reshape(c.n_experts, -1).astype(np.float32), self.path, name)

    def _check_shared_gate(self, layer: int):
        """A shared expert's σ gate: one float32 row of hidden values, as llama.cpp's converter writes it."""
        name, c = f"blk.{layer}.{GGUF_SHARED_GATE}", self.config
        t = self._tensors.get(name)
        if t is None:
            raise PerfxError(f"{self.path}: tensor {name} (the shared expert's gate) is missing; the GGUF is "
                             f"incomplete or not a {c.architecture} model")
        shape = tuple(int(d) for d in reversed(t.shape))
        if shape not in ((c.hidden_size,), (1, c.hidden_size)) or t.tensor_type.name not in ("F32", "F16"):
            raise PerfxError(f"{self.path}: tensor {name} is {t.tensor_type.name} of shape {shape}, but the shared "
                             f"expert's gate is one F32 row of {c.architecture}.embedding_length = {c.hidden_size}; "
                             "the header does not describe this file")
        return t

    def _fused_experts(self, layer: int) -> bool:
        """Whether the layer holds gate and up of its experts in one tensor (ffn_gate_up_exps), as some converters
        write them."""
        return (f"blk.{layer}.{GGUF_FUSED_EXPERTS}.weight" in self._tensors
                and f"blk.{layer}.{GGUF_EXPERTS['gate_exps']}.weight" not in self._tensors)

    def _expert_shape(self, part: str) -> tuple[int, int]:
        c = self.config
        if part == "gate_up_exps":
            return 2 * c.expert_intermediate, c.hidden_size
        return ((c.hidden_size, c.expert_intermediate) if part == "down_exps"
                else (c.expert_intermediate, c.hidden_size))

    def _expert_tensor(self, part: str, layer: int) -> str:
        if part != "down_exps" and self._fused_experts(layer):
            part = "gate_up_exps"
        return f"blk.{layer}.{GGUF_FUSED_EXPERTS if part == 'gate_up_exps' else GGUF_EXPERTS[part]}.weight"

    def _expert_form(self, part: str, layer: int) -> Form:
        kind = self._type(self._expert_tensor(part, layer))
        k = self._expert_shape(part)[1]
        return held_form(self._quantized_form(GGUF_FORMS[kind], k), symmetric_q4=kind == "Q4_0",
                         mxfp4=kind == "MXFP4")

    def _expert_matrices(self, part: str, layer: int) -> list:
        """Each expert's matrix of one projection ("gate_up_exps" where the file fuses gate and up), from its slice
        of the stacked tensor."""
        c = self.config
        name = f"blk.{layer}.{GGUF_FUSED_EXPERTS if part == 'gate_up_exps' else GGUF_EXPERTS[part]}.weight"
        t = self._tensors[name]
        n, k = self._expert_shape(part)
        kind = t.tensor_type.name
        raw = np.asarray(t.data)
        out = []
        for e in range(c.n_experts):
            if kind in formats.GGUF_READERS:
                w = formats.GGUF_READERS[kind](raw.reshape(c.n_experts, -1)[e], n, k, name)
            elif kind == "BF16":
                w = quants.dequantize(raw.reshape(c.n_experts, -1)[e], gguf.GGMLQuantizationType.BF16).reshape(n, k)
            else:
                w = raw.reshape(c.n_experts, n, k)[e].astype(np.float32)
            w = check_finite(w, self.path, f"{name} (expert {e})")
            out.append(self._quantized(w))   # --quantize q4: float experts in int4
        return out

    def _experts(self, layer: int) -> MoEWeights:
        c = self.config
        router = self._check_router(f"blk.{layer}.{GGUF_ROUTER}", (c.n_experts, c.hidden_size))
        if router.tensor_type.name in ("F32", "F16"):
            router = np.asarray(router.data, np.float32).reshape(c.n_experts, c.hidden_size)
        else:
            w = self._read(router.name, (c.n_experts, c.hidden_size))
            router = w.dequantize().astype(np.float32) if hasattr(w, "dequantize") else np.asarray(w, np.float32)
        bias = None
        if c.expert_bias:
            t = self._check_router(f"blk.{layer}.{GGUF_SELECTION_BIAS}", (c.n_experts,))
            bias = check_finite(np.asarray(t.data, np.float32).reshape(-1), self.path, t.name)
        shared_gate = None
        if c.expert_shared_gate:
            t = self._check_shared_gate(layer)
            shared_gate = check_finite(np.asarray(t.data, np.float32).reshape(-1), self.path, t.name)
        if self._fused_experts(layer):
            gate_up = [fuse_expert([w]) for w in self._expert_matrices("gate_up_exps", layer)]
        else:
            gates, ups = self._expert_matrices("gate_exps", layer), self._expert_matrices("up_exps", layer)
            gate_up = [fuse_expert([g, u]) for g, u in zip(gates, ups)]
        biases = {}
        if c.expert_biases:
            t = self._check_router(f"blk.{layer}.{GGUF_ROUTER_BIAS}", (c.n_experts,))
            parts = {part: self._expert_bias(part, layer) for part in self._expert_bias_parts(layer)}
            gate_up_bias = parts.get("gate_up_exps")
            if gate_up_bias is None:
                gate_up_bias = np.concatenate([parts["gate_exps"], parts["up_exps"]], axis=1)
            biases = dict(router_bias=check_finite(np.asarray(t.data, np.float32).reshape(-1), self.path, t.name),
                          gate_up_bias=np.ascontiguousarray(gate_up_bias), down_bias=parts["down_exps"])
        return MoEWeights(router=check_finite(np.ascontiguousarray(router), self.path, f"blk.{layer}.{GGUF_ROUTER}"),
                          selection_bias=bias, gate_up=gate_up, shared_gate=shared_gate,
                          down=[fuse_expert([d]) for d in self._expert_matrices("down_exps", layer)], **biases)

    def _part_tensor(self, kind: str, part: str, layer: int) -> str:
        """The tensor of a projection ("q", ...) or of a kind's taps ("taps") in ``layer``."""
        return f"blk.{layer}.{GGUF_CONV_TAPS[kind][0] if part == 'taps' else GGUF_LINEAR[part] + '.weight'}"

    def _vector_tensor(self, name: str, layer: int) -> str:
        # the family's name where it differs (llama.cpp's qwen35 takes the FFN's norm from post_attention_norm)
        return f"blk.{layer}.{self.family.tensors.gguf_vectors.get(name) or GGUF_VECTOR[name]}"

    def _pattern_keys(self) -> str:
        arch = self.config.architecture
        if f"{arch}.attention.recurrent_layers" in self.file.fields:
            return f"{arch}.attention.recurrent_layers"
        return f"{arch}.full_attention_interval"

    def _final_norm_name(self) -> str:
        return self.family.tensors.gguf_final_norm   # LFM2's: token_embd_norm

    def _check_conv_taps(self, layer: int):
        c = self.config
        tensor, length_key, channels_key = (key.format(arch=c.architecture)
                                            for key in GGUF_CONV_TAPS[c.layers[layer].kind])
        name = f"blk.{layer}.{tensor}"
        t = self._tensors.get(name)
        if t is None:
            raise PerfxError(f"{self.path}: tensor {name} is missing; the GGUF is incomplete or not a "
                             f"{c.architecture} model")
        shape = tuple(int(d) for d in reversed(t.shape))
        channels = self.mixer(layer).taps(c)
        if shape != (channels, c.conv_length):
            raise PerfxError(f"{self.path}: tensor {name} has shape {shape}, but {length_key} = {c.conv_length} and "
                             f"{channels_key} = {channels} need ({channels}, {c.conv_length}); the header does not "
                             "describe this file")
        if t.tensor_type.name not in ("F32", "F16"):
            raise PerfxError(f"{self.path}: tensor {name} is {t.tensor_type.name}; expected F32 or F16")
        return t

    def _is_fused(self, label: str, layer: int) -> bool:
        if label not in GGUF_FUSED or label not in self.file_fused(layer):
            return False
        tensor, parts = GGUF_FUSED[label]
        return (f"blk.{layer}.{tensor}.weight" in self._tensors
                and f"blk.{layer}.{GGUF_LINEAR[parts[0]]}.weight" not in self._tensors)

    def _check_fused(self, label: str, layer: int):
        """A fused tensor must split as the header says: q H·D, k and v Hkv·D rows; gate and up I rows each."""
        name = f"blk.{layer}.{GGUF_FUSED[label][0]}.weight"
        shape = tuple(int(d) for d in reversed(self._tensors[name].shape))
        expected = self.expected_shape(label)
        if shape != expected:
            raise fused_split_error(self.path, name, shape, label, self.config, "the header", "feed_forward_length",
                                    "the file is corrupt or its header belongs to another model")
        self._check(name, expected)

    def _check_heads(self, layer: int):
        """attn_q's rows are H × key_length: say which key is wrong when they are not."""
        c = self.config
        name = f"blk.{layer}.attn_q.weight"
        t = self._tensors.get(name)
        if t is None:
            return
        rows, want = int(t.shape[-1]), self.expected_shape("q", layer)[0]
        if rows != want:
            arch = c.architecture
            gate = " × 2 (q and its gate)" if c.attention_gate else ""
            d = c.at(layer).head_dim
            raise PerfxError(f"{self.path}: tensor {name} has {rows} rows, but {arch}.attention.head_count "
                             f"{c.n_heads} × {arch}.attention.key_length {d}{gate} = {want}"
                             + (f" (key_length does not divide the Q projection's {rows} rows)"
                                if rows % d else "") + "; the header does not describe this file")

    def _check(self, name: str, expected):
        t = self._tensors.get(name)
        if t is None:
            raise PerfxError(f"{self.path}: tensor {name} is missing; the GGUF is incomplete or not a "
                             f"{self.config.architecture} model")
        kind = t.tensor_type.name
        if kind not in GGUF_TYPES:
            raise PerfxError(f"{self.path}: tensor {name} has type {kind}, which perfx does not read; "
                             f"perfx reads GGUF tensor types {', '.join(GGUF_TYPES)} (so Q4_K_M, Q5_K_M, Q8_0, "
                             f"Q4_0 and Q4_1 files): {UNSUPPORTED_TYPE_HELP}")
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists ne[0] (K) first
        if len(expected) == 1:
            shape = (int(np.prod(shape)),)
        if shape != tuple(expected):
            raise shape_error(str(self.path), name, shape, expected, self.config)
        return t

    def _read(self, name: str, expected) -> Linear:
        """A matrix (N, K) in the form of its type (``GGUF_FORMS``): int4, int8, or fp16."""
        t = self._check(name, expected)
        n, k = expected
        kind = t.tensor_type.name
        if kind in formats.GGUF_READERS:
            w = formats.GGUF_READERS[kind](t.data, n, k, name)
        elif kind == "BF16":
            w = quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType.BF16).reshape(n, k)
            with np.errstate(over="ignore"):   # beyond fp16's range: refused just below, with the tensor named
                w = w.astype(np.float16)
        else:
            with np.errstate(over="ignore"):
                w = np.asarray(t.data).reshape(n, k).astype(np.float16)
        return check_finite(w, self.path, name)

    def _type(self, name: str) -> str:
        return self._tensors[name].tensor_type.name

    def int4_scales(self) -> dict[str, set[int]]:
        c = self.config
        out: dict[str, set[int]] = {}

        def add(role: str, types: list[str]):
            if all(t in GGUF_Q4_SCALES for t in types):   # int4 parts joined as Q4Matrix.concat joins them
                forms = {GGUF_Q4_SCALES[t] for t in types}
                out.setdefault(role, set()).add(formats.Q4_PAIRS if formats.Q4_PAIRS in forms else
                                                 forms.pop() if len(forms) == 1 else formats.Q4_ZEROS)
            elif self.quantize == "q4" and all(GGUF_FORMS[t].kind in ("q4", "f16") for t in types):
                out.setdefault(role, set()).add(formats.Q4_PAIRS)   # fp16 rounded to 4 bits on load
        for i in range(c.n_layers):
            for label, names in self.layer_linears(i).items():
                if len(names) > 1 and self._is_fused(label, i):
                    add(label, [self._type(f"blk.{i}.{GGUF_FUSED[label][0]}.weight")])
                else:
                    add(label, [self._type(f"blk.{i}.{GGUF_LINEAR[self.part_read_as(name, i)]}.weight")
                                for name in names])
        add("embedding", [self._type("token_embd.weight")])
        if not c.tie_embeddings:
            add("lm_head", [self._type("output.weight")])
        return out

    def _part_form(self, name: str, layer: int) -> Form:
        return GGUF_FORMS[self._type(f"blk.{layer}.{GGUF_LINEAR[name]}.weight")]

    def _fused_form(self, label: str, layer: int) -> Form | None:
        if not self._is_fused(label, layer):
            return None
        return GGUF_FORMS[self._type(f"blk.{layer}.{GGUF_FUSED[label][0]}.weight")]

    def _fused(self, label: str, layer: int) -> Linear | None:
        if not self._is_fused(label, layer):
            return None
        return self._read(f"blk.{layer}.{GGUF_FUSED[label][0]}.weight", self.expected_shape(label, layer))

    def _table_form(self, name: str) -> Form:
        return GGUF_FORMS[self._type("token_embd.weight" if name == "embedding" else "output.weight")]

    def _linear(self, name: str, layer: int) -> Linear:
        w = self._read(f"blk.{layer}.{GGUF_LINEAR[name]}.weight", self.expected_shape(name, layer))
        return self._unpermute(name, w)

    def has_part(self, name: str, layer: int) -> bool:
        return f"blk.{layer}.{GGUF_LINEAR[name]}.weight" in self._tensors

    def _altup_tables(self) -> tuple[np.ndarray, np.ndarray]:
        c, out = self.config, []
        for name in ("altup_proj.weight", "altup_unembd_proj.weight"):
            t = self._tensors.get(name)
            shape = (c.altup_inputs - 1, c.hidden_size, c.hidden_size)
            if t is None:
                raise PerfxError(f"{self.path}: tensor {name} is missing; the GGUF is incomplete or not a "
                                 f"{c.architecture} model")
            if tuple(int(d) for d in reversed(t.shape)) != shape:
                raise PerfxError(f"{self.path}: tensor {name} has shape {tuple(reversed(t.shape))} but "
                                 f"{c.altup_inputs} AltUp streams of {c.hidden_size} need {shape}")
            values = quants.dequantize(np.asarray(t.data), t.tensor_type)
            out.append(check_finite(np.asarray(values, np.float64).reshape(shape), self.path, name))
        return out[0], out[1]

    def _per_layer_forms(self) -> dict[str, set[Form]]:
        c = self.config
        model = GGUF_FORMS[self._type("per_layer_model_proj.weight")]
        return {"ple_table": {GGUF_FORMS[self._type("per_layer_token_embd.weight")]},
                "ple_model": {self._quantized_form(model, c.hidden_size)}}

    def _per_layer_tables(self) -> tuple:
        norm = self._check("per_layer_proj_norm.weight", (self.expected_vector("per_layer_norm"),))
        return (self._read("per_layer_token_embd.weight", self.expected_shape("per_layer_table")),
                self._read("per_layer_model_proj.weight", self.expected_shape("per_layer_proj")),
                check_finite(np.asarray(norm.data, dtype=np.float32).reshape(-1), self.path, norm.name))

    def _unpermute(self, name: str, w):
        """Undo llama.cpp's permutation of Wq/Wk rows (and biases), made for its interleaved RoPE."""
        if not self.family.tensors.gguf_permuted_qk or name not in ("q", "k", "q_bias", "k_bias"):
            return w
        heads = self.config.n_heads if name.startswith("q") else self.config.n_kv_heads
        return permute_linear_rows(w, unpermute_qk(np.arange(w.shape[0]), heads))

    def _conv_weight(self, layer: int) -> np.ndarray:
        c, t = self.config, self._check_conv_taps(layer)
        taps = np.asarray(t.data, dtype=np.float32).reshape(self.mixer(layer).taps(c), c.conv_length)
        return check_finite(np.ascontiguousarray(taps), self.path, t.name)

    def _vector(self, name: str, layer: int | None) -> np.ndarray:
        tensor = self._final_norm_name() if name == "final_norm" else self._vector_tensor(name, layer)
        t = self._check(tensor, (self.expected_vector(name, layer),))
        if t.tensor_type.name not in ("F32", "F16"):
            raise PerfxError(f"{self.path}: vector {tensor} is {t.tensor_type.name}; expected F32 or F16")
        vector = check_finite(np.asarray(t.data, dtype=np.float32).reshape(-1), self.path, tensor)
        return self._unpermute(name, vector)

    def _embedding(self) -> Linear:
        return self._read("token_embd.weight", self.expected_shape("embedding"))

    def _lm_head(self) -> Linear:
        return self._read("output.weight", self.expected_shape("lm_head"))

    def _load_tokenizer(self):
        if "tokenizer.ggml.model" not in self.file.fields:
            return None
        return Tokenizer.from_gguf(self.file)

    def describe(self) -> dict:
        counts: dict[str, int] = {}
        for t in self._tensors.values():
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        quantization = ", ".join(f"{kind} ×{n}" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        if self.quantize:
            quantization += f", fp16 layers quantized to {self.quantize} on load"
        if self.lm_head_form == "fp16":
            quantization += ", lm_head as fp16"
        return {"format": "gguf", "path": str(self.path), "files": [self.path.name],
                "file_size": self.path.stat().st_size, "quantization": quantization,
                "name": self.file.value("general.name"),
                "architecture": self.config.architecture, "notes": list(self.notes)}
