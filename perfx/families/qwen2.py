"""Qwen2 and Qwen2.5: Llama's recipe with biases on the Q, K and V projections, always."""

from __future__ import annotations

from perfx.families.family import ChatRules, Family, GGUFHeader, HFConfig, Preset, TensorNames, ToolFormat

# Hermes' tool calls, which Qwen2.5's, Qwen3's and Qwen3.5's templates render and their models write: one JSON
# call between <tool_call> tags (one token each in their vocabularies). The instructions are the templates' own.
HERMES_TOOLS = ToolFormat(
    name="hermes", marker="<tool_call>", opener="<tool_call>", closer="</tool_call>", separator="\n",
    instructions=("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
                  "</tools>\n\nFor each function call, return a json object with function name and arguments within "
                  "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                  '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'))


def read_gguf(h: GGUFHeader) -> dict:
    return {}   # the biases are found by their tensors (blk.0.attn_q.bias)


def read_hf(h: HFConfig) -> dict:
    # config.json carries a sliding_window too, used only with use_sliding_window (off in every released model,
    # and not what transformers does by default)
    return {"sliding_window": 0, "qkv_bias": True}


FAMILY = Family(
    name="qwen2", order=1,
    gguf_names=("qwen2",), hf_names=("qwen2",),
    read_gguf=read_gguf, read_hf=read_hf,
    tensors=TensorNames(),
    chat=ChatRules(stop_tokens=("<|im_end|>", "<|endoftext|>"), tool_formats=(HERMES_TOOLS,),
                   prompted_tools=HERMES_TOOLS),
    synthetic={
        # Qwen/Qwen2.5-0.5B(-Instruct)'s config.json
        "qwen2.5-0.5b": Preset(dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                    rope_theta=1e6, max_position_embeddings=32768, tie_word_embeddings=True)),
    },
)
