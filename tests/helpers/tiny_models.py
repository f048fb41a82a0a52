"""Tiny random Llama-family models written to disk in every format perfx reads, for loader and end-to-end tests.

A ``TinyModel`` is a config plus float32 weights under Hugging Face names, in Hugging Face (rotate-half) row
order. The writers turn it into an fp16/bf16 safetensors directory (optionally sharded), an AWQ GEMM or GEMV
checkpoint, or a GGUF of any tensor types perfx reads (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
F16, BF16, F32), with a Llama-3 rope_freqs tensor or a sliding window where asked, each with the tiny
SentencePiece tokenizer and a ChatML template. The GGUF writer quantizes blocks with gguf.quants (llama.cpp's
reference quantizers in Python; K-quants with ``helpers.kquants``, since gguf.quants only dequantizes them)
and returns the weights the file really holds by llama.cpp's own dequantization, so the same model can be
written again as fp16 safetensors and perfx is checked against llama.cpp's definition.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import quants
from safetensors.numpy import save_file

from helpers.kquants import K_BLOCKS, quantize_k
from helpers.tiny_tokenizer import train_tiny_spm, write_tokenizer_to_gguf
from perfx.formats import to_awq_gemm, to_awq_gemv
from perfx.reference import permute_qk, unpermute_qk
from perfx.tokenizer import Tokenizer

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Shapes the kernels accept: head_dim 64, K multiples of 64, intermediate a multiple of the groups.
SHAPES = {
    # GQA 3: hidden 192 (not a multiple of 128: quantize-on-load falls back to group 64 there)
    "gqa3": dict(architecture="llama", hidden_size=192, intermediate_size=384, n_heads=3, n_kv_heads=1),
    # GQA 1 (multi-head), tied embeddings
    "gqa1": dict(architecture="llama", hidden_size=128, intermediate_size=256, n_heads=2, n_kv_heads=2,
                 tie_embeddings=True),
    # Qwen2: biases on q, k, v; GQA 2
    "qwen2": dict(architecture="qwen2", hidden_size=128, intermediate_size=256, n_heads=2, n_kv_heads=1,
                  qkv_bias=True),
    # Rows of 256 and 512: what K-quant blocks (256 weights) need; GQA 2
    "k256": dict(architecture="llama", hidden_size=256, intermediate_size=512, n_heads=4, n_kv_heads=2),
    # the same, tied embeddings (the lm_head is the embedding, in its file's type)
    "k256-tied": dict(architecture="llama", hidden_size=256, intermediate_size=512, n_heads=4, n_kv_heads=2,
                      tie_embeddings=True),
}

# The mixes llama.cpp's llama-quantize writes (llama-quant.cpp): Q4_K_M is Q4_K with attn_v and ffn_down in
# Q6_K in some layers; Q5_K_M the same over Q5_K. Embeddings Q4_K/Q5_K there (Q6_K for the output).
Q4_K_M = [
    {"q": "Q4_K", "k": "Q4_K", "v": "Q6_K", "o": "Q4_K", "gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"},
    {"q": "Q4_K", "k": "Q4_K", "v": "Q4_K", "o": "Q4_K", "gate": "Q4_K", "up": "Q4_K", "down": "Q4_K"},
]
Q5_K_M = [
    {"q": "Q5_K", "k": "Q5_K", "v": "Q6_K", "o": "Q5_K", "gate": "Q5_K", "up": "Q5_K", "down": "Q6_K"},
    {"q": "Q5_K", "k": "Q5_K", "v": "Q5_K", "o": "Q5_K", "gate": "Q5_K", "up": "Q5_K", "down": "Q5_K"},
]
# Every other type of the 32-weight family, and BF16, once each
MIXED_32 = [
    {"q": "Q5_0", "k": "Q5_1", "v": "Q8_0", "o": "Q5_1", "gate": "Q5_0", "up": "Q4_0", "down": "BF16"},
    {"q": "Q4_1", "k": "Q4_1", "v": "Q4_1", "o": "Q5_0", "gate": "Q8_0", "up": "Q8_0", "down": "Q5_1"},
]

LINEAR_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                  "self_attn.qkv_proj", "mlp.gate_up_proj",   # Phi-3's fused projections, one Linear each
                  # LFM2's: the attention's out_proj, the conv's in_proj and out_proj, the MLP's w1, w3, w2
                  "self_attn.out_proj", "conv.in_proj", "conv.out_proj", "feed_forward.w1", "feed_forward.w3",
                  "feed_forward.w2",
                  # Qwen3.5's DeltaNet projections (in_proj_a and in_proj_b, of Hv rows, stay fp16: the tiny
                  # model's 4 are no multiple of AWQ's 8 columns a packed int32)
                  "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj")


@dataclass
class TinyModel:
    config: dict                      # Hugging Face config.json contents
    weights: dict[str, np.ndarray]    # Hugging Face tensor name -> float32 array
    tokenizer_model: Path             # the SentencePiece tokenizer.model
    extra: dict = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return self.config["num_hidden_layers"]


def tiny_tokenizer(directory: Path) -> Path:
    """Train the tiny SentencePiece model once into directory (reused when already there)."""
    path = Path(directory) / "tokenizer.model"
    return path if path.is_file() else train_tiny_spm(directory)


def make_tiny_model(kind: str, tokenizer_model: Path, rng: np.random.Generator, n_layers: int = 2) -> TinyModel:
    """Random weights of a ``SHAPES[kind]`` model, scaled like a trained one (activations stay O(1))."""
    import sentencepiece

    shape = dict(SHAPES[kind])
    vocab = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer_model)).get_piece_size()
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads, head_dim = shape["n_heads"], shape["n_kv_heads"], 64
    config = {
        "architectures": ["Qwen2ForCausalLM" if shape["architecture"] == "qwen2" else "LlamaForCausalLM"],
        "model_type": shape["architecture"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": n_layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": shape.get("tie_embeddings", False),
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16",
    }

    def matrix(n, k):
        return (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden)).astype(np.float32),
         "model.norm.weight": norm(hidden)}
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = matrix(vocab, hidden)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    for i in range(n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        for module, (n, k) in zip(LINEAR_MODULES, [(q_dim, hidden), (kv_dim, hidden), (kv_dim, hidden),
                                                    (hidden, q_dim), (inter, hidden), (inter, hidden),
                                                    (hidden, inter)]):
            w[p + module + ".weight"] = matrix(n, k)
        if shape.get("qkv_bias"):
            for module, n in (("q_proj", q_dim), ("k_proj", kv_dim), ("v_proj", kv_dim)):
                w[p + f"self_attn.{module}.bias"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
    return TinyModel(config, w, Path(tokenizer_model))


# ---------------------------------------------------------------------------------------------
# Hugging Face directories


def _write_tokenizer_files(directory: Path, model: TinyModel):
    shutil.copy(model.tokenizer_model, directory / "tokenizer.model")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
        "add_eos_token": False, "chat_template": CHAT_TEMPLATE, "tokenizer_class": "LlamaTokenizer"}))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def save_safetensors_raw(path: Path, tensors: dict[str, tuple[str, tuple, bytes]]):
    """Write safetensors by hand (8-byte header size, JSON header, data): numpy cannot hold bf16."""
    header, offset, blobs = {}, 0, []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (as torch does)."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def write_hf(directory: Path, model: TinyModel, weights: dict[str, np.ndarray] | None = None,
             dtype: str = "F16", shards: int = 1, config_overrides: dict | None = None,
             drop: tuple[str, ...] = ()) -> Path:
    """An fp16 (or "BF16", "F32") Hugging Face directory; ``shards`` > 1 writes an index and several files.

    ``weights`` replaces the model's own (e.g. the weights a GGUF really holds); ``drop`` leaves tensors out.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(model.config, torch_dtype={"F16": "float16", "BF16": "bfloat16", "F32": "float32"}[dtype])
    config.update(config_overrides or {})
    (directory / "config.json").write_text(json.dumps(config))
    _write_tokenizer_files(directory, model)
    weights = {k: v for k, v in (weights or model.weights).items() if k not in drop}
    names = list(weights)
    groups = [names[i::shards] for i in range(shards)]
    files = ["model.safetensors"] if shards == 1 else [f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
                                                       for i in range(shards)]
    for file, group in zip(files, groups):
        if dtype == "BF16":
            save_safetensors_raw(directory / file, {
                n: ("BF16", weights[n].shape, to_bf16_bits(weights[n]).tobytes()) for n in group})
        else:
            np_dtype = np.float16 if dtype == "F16" else np.float32
            save_file({n: np.ascontiguousarray(weights[n], dtype=np_dtype) for n in group},
                      str(directory / file))
    if shards > 1:
        weight_map = {n: file for file, group in zip(files, groups) for n in group}
        index = {"metadata": {}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def write_awq(directory: Path, model: TinyModel, rng: np.random.Generator, group: int = 64,
              version: str = "gemm", not_convert: tuple[str, ...] = (),
              quantization_overrides: dict | None = None):
    """An AutoAWQ checkpoint with random codes, integer zeros and fp16 scales for every linear layer.

    Modules whose name contains one of ``not_convert`` stay fp16 (listed in modules_to_not_convert), as does
    lm_head. Returns (directory, parts): parts[module] = (codes (N, K) uint8, zeros (N, K/G), scales (N, K/G)
    fp16) for the quantized modules, in Hugging Face row order.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    quantization = {"quant_method": "awq", "w_bit": 4, "q_group_size": group, "zero_point": True,
                    "version": version, "modules_to_not_convert": list(not_convert) or None}
    quantization.update(quantization_overrides or {})
    config = dict(model.config, quantization_config=quantization)
    (directory / "config.json").write_text(json.dumps(config))
    _write_tokenizer_files(directory, model)
    tensors, parts = {}, {}
    pack = to_awq_gemm if version == "gemm" else to_awq_gemv
    for name, w in model.weights.items():
        module = name.rsplit(".", 1)[0]
        quantized = (name.endswith(".weight") and any(module.endswith(m) for m in LINEAR_MODULES)
                     and not any(skip in module for skip in not_convert))
        if not quantized:
            tensors[name] = w.astype(np.float16)
            continue
        n, k = w.shape
        codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
        zeros = rng.integers(0, 16, size=(n, k // group), dtype=np.uint8)
        scales = (rng.uniform(0.5, 1.5, size=(n, k // group)) / (8 * np.sqrt(k))).astype(np.float16)
        qweight, qzeros, packed_scales = pack(codes, zeros, scales)
        tensors[module + ".qweight"], tensors[module + ".qzeros"] = qweight, qzeros
        tensors[module + ".scales"] = packed_scales
        parts[module] = (codes, zeros, scales)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory, parts


# ---------------------------------------------------------------------------------------------
# GGUF: blocks quantized and read back by gguf.quants, llama.cpp's own reference in Python


def quantize_gguf(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks (N, bytes) uint8, the float64 weights they hold by llama.cpp's definition) of W (N, K)."""
    qtype = gguf.GGMLQuantizationType[kind]
    w = np.ascontiguousarray(w, dtype=np.float32)
    raw = quantize_k(w, kind) if kind in K_BLOCKS else quants.quantize(w, qtype)
    return raw, quants.dequantize(raw, qtype).astype(np.float64)


def encode_tensor(w: np.ndarray, kind: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None, np.ndarray]:
    """(array for GGUFWriter.add_tensor, its raw_dtype or None for a plain float array, the float64 it holds)."""
    if kind == "F16":
        return w.astype(np.float16), None, w.astype(np.float16).astype(np.float64)
    if kind == "F32":
        return w.astype(np.float32), None, w.astype(np.float32).astype(np.float64)
    if kind == "BF16":
        raw = quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.BF16)
        return raw, gguf.GGMLQuantizationType.BF16, quants.dequantize(raw, gguf.GGMLQuantizationType.BF16).astype(
            np.float64)
    raw, held = quantize_gguf(w, kind)
    return raw, gguf.GGMLQuantizationType[kind], held


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}

# Per-layer tensor types, chosen so every type, and a Q4/fp16 mix inside the fused qkv and gate_up, occur.
DEFAULT_GGUF_TYPES = [
    {"q": "Q4_0", "k": "Q4_0", "v": "Q4_0", "o": "Q4_1", "gate": "Q4_1", "up": "Q4_1", "down": "Q4_0"},
    {"q": "F16", "k": "Q4_1", "v": "Q4_1", "o": "Q8_0", "gate": "Q8_0", "up": "Q4_0", "down": "F32"},
]
SHORT = {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v", "self_attn.o_proj": "o",
         "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down"}


@dataclass
class GGUFWritten:
    path: Path
    weights: dict[str, np.ndarray]        # HF name -> the float64 weights the file holds, HF row order
    types: dict[str, str]                 # HF name -> GGUF type written


def write_gguf(path: Path, model: TinyModel, layer_types=None, embedding_type: str = "Q8_0",
               output_type: str = "F16", raw_override: dict | None = None,
               tokenizer: bool = True, rope_freqs: np.ndarray | None = None, sliding_window: int | None = None,
               add_bos: bool | None = None) -> GGUFWritten:
    """A GGUF of ``model`` as llama.cpp's converter writes it (Q/K rows permuted for llama; biases F32).

    ``raw_override`` maps a GGUF tensor name to (raw uint8 array, GGMLQuantizationType) written as is (for
    unsupported-type tests). ``rope_freqs`` (D/2 float32) is written as Llama 3.x's rope_freqs.weight;
    ``sliding_window`` as ``{arch}.attention.sliding_window``; ``add_bos`` as tokenizer.ggml.add_bos_token.
    """
    c = model.config
    arch = c["model_type"]
    layer_types = layer_types or DEFAULT_GGUF_TYPES
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("perfx tiny test model")
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_dimension_count(c["head_dim"])
    writer.add_vocab_size(c["vocab_size"])
    if sliding_window:
        writer.add_sliding_window(sliding_window)
    if tokenizer:
        write_tokenizer_to_gguf(writer, model.tokenizer_model)
        writer.add_chat_template(CHAT_TEMPLATE)
        if add_bos is not None:
            writer.add_add_bos_token(add_bos)

    written = GGUFWritten(Path(path), {}, {})
    raw_override = raw_override or {}

    def add(gguf_name: str, hf_name: str, kind: str, permute_heads: int | None = None):
        w = model.weights[hf_name]
        if permute_heads:      # llama.cpp's convert_hf_to_gguf permutes Wq/Wk (and their biases)
            w = permute_qk(w, permute_heads)
        if gguf_name in raw_override:
            raw, qtype = raw_override[gguf_name]
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
            written.types[hf_name] = qtype.name
            return
        written.types[hf_name] = kind
        data, raw_dtype, held = encode_tensor(w, kind)
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
        if permute_heads:      # back to HF order: what the loader must give
            held = unpermute_qk(held, permute_heads)
        written.weights[hf_name] = held

    add("token_embd.weight", "model.embed_tokens.weight", embedding_type)
    add("output_norm.weight", "model.norm.weight", "F32")
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    if "lm_head.weight" in model.weights:
        add("output.weight", "lm_head.weight", output_type)
    heads = {"self_attn.q_proj": c["num_attention_heads"], "self_attn.k_proj": c["num_key_value_heads"]}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        types = layer_types[i % len(layer_types)]
        add(f"blk.{i}.attn_norm.weight", p + "input_layernorm.weight", "F32")
        add(f"blk.{i}.ffn_norm.weight", p + "post_attention_layernorm.weight", "F32")
        for module, short in GGUF_NAMES.items():
            permute = heads.get(module) if arch == "llama" else None
            add(f"blk.{i}.{short}.weight", p + module + ".weight", types[SHORT[module]], permute)
            if p + module + ".bias" in model.weights:
                add(f"blk.{i}.{short}.bias", p + module + ".bias", "F32", permute)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def write_endless_gguf(directory: Path, name: str, positions: int) -> str:
    """A tiny random GGUF model (``positions`` positions) whose end-of-turn ids have zero rows in the lm_head:
    replies run until max_tokens or a stop string, so a long one is surely still going when a test acts on it."""
    model = make_tiny_model("gqa3", tiny_tokenizer(directory), np.random.default_rng(6))
    model.config["max_position_embeddings"] = positions
    path = directory / f"{name}.gguf"
    write_gguf(path, model)
    for eos in Tokenizer.from_gguf(path).eos_ids:
        model.weights["lm_head.weight"][eos] = 0
    write_gguf(path, model)
    return str(path)
