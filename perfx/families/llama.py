"""Llama (1, 2, 3.x) and the models that are Llama to both file formats: Mistral (Hugging Face model_type
mistral; its GGUFs say llama) and SmolLM2. The common recipe, nothing added: RMSNorm before attention and the
SwiGLU FFN, RoPE on every dimension of every layer."""

from __future__ import annotations

from perfx.families.family import ChatRules, Family, GGUFHeader, HFConfig, Preset, TensorNames, ToolFormat

# Llama 3.1-3.3's JSON calls: the reply is {"name": ..., "parameters": {...}}, after <|python_tag|> at times;
# their templates render tool results in "ipython" turns. SmolLM2's and Mistral's templates have no tools.
LLAMA3_TOOLS = ToolFormat(name="llama3-json", marker="<|start_header_id|>ipython", also_openers=("<|python_tag|>",),
                          arguments_key="parameters")


def read_gguf(h: GGUFHeader) -> dict:
    return {}


def read_hf(h: HFConfig) -> dict:
    # Llama's config.json may carry a sliding_window it does not use; Mistral's is in force
    return {} if h.architecture == "mistral" else {"sliding_window": 0}


def _config(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, theta: float,
            positions: int, tied: bool) -> dict:
    return dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                rms_norm_eps=1e-5, rope_theta=theta, max_position_embeddings=positions, tie_word_embeddings=tied)


FAMILY = Family(
    name="llama", order=0,
    gguf_names=("llama",), hf_names=("llama", "mistral"),
    read_gguf=read_gguf, read_hf=read_hf,
    hf_rms_eps=1e-5,
    # llama.cpp's converter permutes Wq/Wk for its interleaved RoPE (LLAMA_ROPE_TYPE_NORM)
    tensors=TensorNames(gguf_permuted_qk=True),
    # Llama 3's turn and message ends, Llama 2's and Mistral's </s>, SmolLM2's ChatML end
    chat=ChatRules(stop_tokens=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "</s>", "<|im_end|>"),
                   tool_formats=(LLAMA3_TOOLS,)),
    synthetic={
        # group 128 with 4-bit zero points, as the usual AWQ checkpoints
        "llama-2-7b": Preset(_config(32000, 4096, 11008, 32, 32, 32, 10000.0, 4096, False), 128, zero_points=True),
        # group 32, as its Q4_0/Q4_1 GGUFs
        "smollm2-135m": Preset(_config(49152, 576, 1536, 30, 9, 3, 100000.0, 8192, True)),
        "tiny": Preset(_config(512, 192, 384, 2, 3, 1, 10000.0, 256, False), 64),
    },
)
