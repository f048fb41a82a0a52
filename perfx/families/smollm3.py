"""SmolLM3: Llama's recipe with no RoPE on every fourth layer (NoPE), Wq/Wk permuted in its GGUFs as Llama's."""

from __future__ import annotations

from perfx.errors import PerfxError
from perfx.families.family import (ChatRules, Family, GGUFHeader, HFConfig, LayerRecipe, Preset, TensorNames,
                                   ToolFormat)

# SmolLM3's template takes its tools as xml_tools (python_tools is its code agent's), and teaches Hermes' calls in
# its own words, used too where a template has no tool sections (llama.cpp's copy of it, Unsloth's edit).
SMOLLM3_TOOLS = ToolFormat(
    name="smollm3", marker="xml_tools", opener="<tool_call>", closer="</tool_call>", separator="\n",
    tools_variable="xml_tools",
    instructions=("### Tools\n\nYou may call one or more functions to assist with the user query.\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n\n<tools>\n{tools}\n"
                  "</tools>\n\nFor each function call, return a json object with function name and arguments within "
                  "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                  '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'))
NO_ROPE_STEP = 4   # llama.cpp hard-codes it (no GGUF key): layers with (i + 1) % 4 == 0 have no RoPE


def read_gguf(h: GGUFHeader) -> dict:
    return {"layers": tuple(LayerRecipe(None if (i + 1) % NO_ROPE_STEP == 0 else h.rope, h.window)
                            for i in range(h.n_layers))}


def read_hf(h: HFConfig) -> dict:
    uses = h.config.get("no_rope_layers")
    if uses is None:
        step = int(h.config.get("no_rope_layer_interval") or NO_ROPE_STEP)
        uses = [int((i + 1) % step != 0) for i in range(h.n_layers)]
    if len(uses) != h.n_layers:
        raise PerfxError(f"config.json: no_rope_layers lists {len(uses)} layers but the model has "
                         f"{h.n_layers}; the config is corrupt")
    # its config.json's sliding_window is not used
    return {"sliding_window": 0, "layers": tuple(LayerRecipe(h.rope if use else None, 0) for use in uses)}


FAMILY = Family(
    name="smollm3", order=6,
    gguf_names=("smollm3",), hf_names=("smollm3",),
    read_gguf=read_gguf, read_hf=read_hf,
    tensors=TensorNames(gguf_permuted_qk=True),
    chat=ChatRules(stop_tokens=("<|im_end|>", "<|end_of_text|>"), tool_formats=(SMOLLM3_TOOLS,),
                   prompted_tools=SMOLLM3_TOOLS),
    synthetic={
        "smollm3-3b": Preset(dict(model_type="smollm3", vocab_size=128256, hidden_size=2048, intermediate_size=11008,
                                  num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4, rope_theta=5e6,
                                  max_position_embeddings=65536, no_rope_layer_interval=4, tie_word_embeddings=True)),
    },
)
