"""Tool calls (perfx.tools): each family's format read back from the model's text, whole and streamed at every
split, malformed calls kept as content; tools, calls and results rendered through the families' real templates
(tests/data/templates); the grammar of a forced call, checked by llguidance itself."""

import json
import random
from pathlib import Path

import llguidance
import pytest

from perfx.families.family import ToolFormat
from perfx.families.gemma2 import GEMMA_TOOLS
from perfx.families.gptoss import HARMONY_TOOLS
from perfx.families.lfm2 import LFM2_TOOLS
from perfx.families.llama import LLAMA3_TOOLS
from perfx.families.phi3 import PHI4_TOOLS
from perfx.families.qwen2 import HERMES_TOOLS
from perfx.families.smollm3 import SMOLLM3_TOOLS
from perfx.tokenizer import Tokenizer
from perfx.tools import (CALL, GENERIC_TOOLS, HarmonyParser, ToolCall, call_grammar, call_text, render_messages,
                         reply_parser, tool_support)

TEMPLATES = Path(__file__).parent / "data" / "templates"
FORMATS = [HERMES_TOOLS, SMOLLM3_TOOLS, LLAMA3_TOOLS, PHI4_TOOLS, LFM2_TOOLS, GEMMA_TOOLS, HARMONY_TOOLS,
           GENERIC_TOOLS]
NAMES = ("get_weather", "get_time")
WEATHER = {"city": "Paris", "days": 3, "metric": True, "note": "a \"quoted\" word, ünïcode"}

# (format, the model's text, the content expected, the calls expected as (name, arguments))
CASES = [
    (HERMES_TOOLS, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    (HERMES_TOOLS, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
     '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look.",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    # a call the reply ends in without its closer (a model stopped at its end of turn) is still a call
    (HERMES_TOOLS, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}', None,
     [("get_time", {"zone": "UTC"})]),
    # malformed: not JSON, an unknown tool, arguments that are no object: the text stays as the model wrote it
    (HERMES_TOOLS, 'Hm <tool_call>{"name": get_weather}</tool_call> ok', 'Hm <tool_call>{"name": get_weather}'
     '</tool_call> ok', []),
    (HERMES_TOOLS, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    (HERMES_TOOLS, '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', []),
    (HERMES_TOOLS, "a < b and <tool_cal is no tag", "a < b and <tool_cal is no tag", []),
    (SMOLLM3_TOOLS, '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>',
     None, [("get_weather", {"city": "Paris"})]),   # arguments written as a JSON string
    (LLAMA3_TOOLS, '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", {"city": "Paris"})]),
    (LLAMA3_TOOLS, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {}}', None, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (LLAMA3_TOOLS, '  {"type": "function", "name": "get_time", "parameters": {"zone": "CET"}}', None,
     [("get_time", {"zone": "CET"})]),
    (LLAMA3_TOOLS, '{"answer": 42}', '{"answer": 42}', []),
    (LLAMA3_TOOLS, '{"name": "Bob", "parameters": {}}', '{"name": "Bob", "parameters": {}}', []),
    (LLAMA3_TOOLS, "It is 22 degrees in Paris.", "It is 22 degrees in Paris.", []),
    (LLAMA3_TOOLS, '{"name": "get_time", "parameters": {"zone": "CET"}} and more',
     '{"name": "get_time", "parameters": {"zone": "CET"}} and more', []),
    (PHI4_TOOLS, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {}}]<|/tool_call|>', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (PHI4_TOOLS, '<|tool_call|>{"name": "get_time", "arguments": {}}<|/tool_call|>', None, [("get_time", {})]),
    (PHI4_TOOLS, '<|tool_call|>[{"name": "get_time"]<|/tool_call|>', '<|tool_call|>[{"name": "get_time"]<|/tool_call|>',
     []),
    (LFM2_TOOLS, '<|tool_call_start|>[get_weather(city="Paris", days=3, metric=true), get_time()]<|tool_call_end|>'
     "Checking both.", "Checking both.", [("get_weather", {"city": "Paris", "days": 3, "metric": True}),
                                          ("get_time", {})]),
    (LFM2_TOOLS, '<|tool_call_start|>[{"name": "get_time", "arguments": {"zone": "UTC"}}]<|tool_call_end|>', None,
     [("get_time", {"zone": "UTC"})]),    # llama.cpp's copy of LFM2's template writes JSON there
    (LFM2_TOOLS, "<|tool_call_start|>[get_time(__import__('os'))]<|tool_call_end|>",
     "<|tool_call_start|>[get_time(__import__('os'))]<|tool_call_end|>", []),
    (LFM2_TOOLS, "<|tool_call_start|>[get_time(zone=os.environ)]<|tool_call_end|>",
     "<|tool_call_start|>[get_time(zone=os.environ)]<|tool_call_end|>", []),
    (GEMMA_TOOLS, '```tool_code\n[get_weather(city="Paris")]\n```', None, [("get_weather", {"city": "Paris"})]),
    (GEMMA_TOOLS, "```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    # harmony: reasoning (analysis) is neither content nor call; a call's recipient in its channel or its role; its
    # <|call|> ends generation, so the text usually ends without it
    (HARMONY_TOOLS, '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}', None,
     [("get_weather", {"city": "Paris"})]),
    (HARMONY_TOOLS, ' to=functions.get_time<|channel|>commentary json<|message|>{"zone": "UTC"}<|call|>', None,
     [("get_time", {"zone": "UTC"})]),
    (HARMONY_TOOLS, '<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is '
     '22 C.<|return|>', "It is 22 C.", []),
    (HARMONY_TOOLS, '<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_time <|constrain|>json<|message|>{}', "Checking.", [("get_time", {})]),
    (HARMONY_TOOLS, '<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}',
     '<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}', []),
    (HARMONY_TOOLS, '<|channel|>commentary to=functions.get_time<|message|>{"zone": "UTC"', '<|channel|>commentary '
     'to=functions.get_time<|message|>{"zone": "UTC"', []),
    (HARMONY_TOOLS, '<|channel|>commentary to=functions.get_time<|message|>[1]<|call|>', '<|channel|>commentary '
     'to=functions.get_time<|message|>[1]<|call|>', []),
    (HARMONY_TOOLS, "Plain words, no channel.", "Plain words, no channel.", []),
    (HARMONY_TOOLS, '<|channel|>final<|message|>Done.<|end|>\n<|start|>assistant<|channel|>commentary '
     'to=functions.get_time <|constrain|>json<|message|>{}<|call|>\n', "Done.", [("get_time", {})]),
    (GENERIC_TOOLS, '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}', None,
     [("get_weather", {"city": "Paris"})]),
    (GENERIC_TOOLS, '{"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": '
     '{"zone": "UTC"}}]}', None, [("get_time", {}), ("get_time", {"zone": "UTC"})]),
    (GENERIC_TOOLS, '{"response": "Hello!"}', "Hello!", []),
    (GENERIC_TOOLS, "Hello! {not json}", "Hello! {not json}", []),
    (GENERIC_TOOLS, '{"tool_call": {"name": "get_time", "arguments": {}', '{"tool_call": {"name": "get_time", '
     '"arguments": {}', []),
]


def parsed(fmt: ToolFormat, pieces) -> tuple[str | None, list, list]:
    """(content, calls as (name, arguments), the events) of the text given to a parser in ``pieces``."""
    parser = reply_parser(fmt, NAMES)
    events = [event for piece in pieces for event in parser.feed(piece)] + parser.finish()
    content = "".join(value for kind, value in events if kind == "content")
    calls = [(value.name, json.loads(value.arguments)) for kind, value in events if kind == "call"]
    return (content or None) if calls else content, calls, events


@pytest.mark.parametrize("fmt, text, content, calls", CASES, ids=[f"{c[0].name}-{i}" for i, c in enumerate(CASES)])
def test_each_format_is_read_whole_and_at_every_split(fmt, text, content, calls):
    assert parsed(fmt, [text])[:2] == (content, calls)
    # Streamed: one character at a time, at each single split, and in random pieces, the same content and calls,
    # and no piece of a call ever given out as content.
    rng = random.Random(len(text))
    splits = [list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6))))
        splits.append([text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])
    for pieces in splits:
        got_content, got_calls, events = parsed(fmt, pieces)
        assert (got_content, got_calls) == (content, calls), pieces
        if calls:
            assert all(fmt.opener not in value for kind, value in events if kind == "content" and fmt.opener)
    ids = [value.id for kind, value in parsed(fmt, [text])[2] if kind == "call"]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_calls_written_in_a_format_read_back_as_they_were(fmt):
    calls = [ToolCall("get_weather", json.dumps(WEATHER)), ToolCall("get_time", "{}")]
    for some in (calls[:1], calls):
        text = call_text(fmt, some)
        assert parsed(fmt, [text])[1] == [(c.name, json.loads(c.arguments)) for c in some], text


HARMONY_REPLY = ("<|channel|>analysis<|message|>The user wants <b>bold</b> text.<|end|><|start|>assistant"
                 "<|channel|>final<|message|>Here: **bold** <|ok|>.<|return|>")


def test_harmony_s_reasoning_and_answer_are_split_at_every_split():
    """gpt-oss's analysis channel is reasoning, its final channel the answer, however the text arrives: text that
    looks like a marker but is none (<b>, <|ok|>) stays in its channel."""
    rng = random.Random(0)
    splits = [[HARMONY_REPLY]] + [[HARMONY_REPLY[:i], HARMONY_REPLY[i:]] for i in range(1, len(HARMONY_REPLY))]
    splits += [list(HARMONY_REPLY)]
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(HARMONY_REPLY)), rng.randint(2, 8)))
        splits.append([HARMONY_REPLY[a:b] for a, b in zip([0] + cuts, cuts + [len(HARMONY_REPLY)])])
    for pieces in splits:
        parser = HarmonyParser(NAMES)
        events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
        assert {kind for kind, _ in events} == {"reasoning", "content"}, pieces
        assert "".join(v for k, v in events if k == "reasoning") == "The user wants <b>bold</b> text.", pieces
        assert "".join(v for k, v in events if k == "content") == "Here: **bold** <|ok|>.", pieces
    # reasoning streams as it comes: the analysis text is out before the final message's header arrives
    parser = HarmonyParser(NAMES)
    assert parser.feed("<|channel|>analysis<|message|>The user") == [("reasoning", "The user")]
    # a reply cut inside its analysis (max_tokens) is reasoning only
    assert parser.finish() == []


# -- rendering through the families' templates -------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]
TURN = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22 C, sunny"}]


def tokenizer_with(template: str | None) -> Tokenizer:
    tokens = ["<pad>", "<eos>", "<bos>", "a"]
    return Tokenizer(encoder=lambda text, special: [], tokens=tokens, types=[3] * len(tokens), byte_level=False,
                     strip_leading_space=False, bos_id=2, eos_ids=[1], add_bos_token=True, chat_template=template,
                     bos_token="<bos>", eos_token="<eos>")


# (template, the model's architecture, the format, what the template renders itself (tools, calls, results),
#  texts the prompt holds)
RENDERINGS = [
    ("Qwen-Qwen3-0.6B.jinja", "qwen3", "hermes", (True, True, True),
     ['<tools>\n{"type": "function", "function": {"name": "get_weather"',
      '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
      '<|im_end|>', "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>\n"
      "<|im_start|>assistant\n"]),
    ("meta-llama-Llama-3.2-1B-Instruct.jinja", "llama", "llama3-json", (True, True, True),
     ["Environment: ipython", '"name": "get_weather"', '<|start_header_id|>assistant<|end_header_id|>\n\n'
      '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
      '<|start_header_id|>ipython<|end_header_id|>\n\n"22 C, sunny"<|eot_id|>']),
    # LFM2's own template renders no assistant calls: perfx writes them in, in the model's Python form
    ("LiquidAI-LFM2-1.2B.jinja", "lfm2", "lfm2", (True, False, True),
     ['List of tools: <|tool_list_start|>[{"type": "function", "function": {"name": "get_weather"',
      '<|im_start|>assistant\n<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|><|im_end|>',
      "<|im_start|>tool\n<|tool_response_start|>22 C, sunny<|tool_response_end|><|im_end|>"]),
    ("microsoft-Phi-4-mini-instruct.jinja", "phi3", "phi4-mini", (True, False, True),
     ['<|system|>Be brief.<|tool|>[{"name": "get_weather", "description": "The weather of a city"',
      '<|assistant|><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]<|/tool_call|><|end|>']),
    # llama.cpp's copy of SmolLM3's template has no tool sections: the tools are taught in SmolLM3's words
    ("HuggingFaceTB-SmolLM3-3B.jinja", "smollm3", "smollm3", (False, False, True),
     ["Be brief.\n\n### Tools\n\nYou may call one or more functions", '<tools>\n{"name": "get_weather"',
      '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>']),
    # Gemma's take no tools and no tool turns: the tools go in the first user turn, results in a user turn
    ("google-gemma-3-4b-it.jinja", "gemma3", "gemma", (False, False, False),
     ["<start_of_turn>user\nBe brief.\n\nYou have access to functions.", '{"name": "get_weather"',
      '<start_of_turn>model\n```tool_code\n[get_weather(city="Paris")]\n```<end_of_turn>',
      "<start_of_turn>user\n```tool_output\n22 C, sunny\n```<end_of_turn>\n<start_of_turn>model\n"]),
    # Phi-3.5's has none either, and the family no prompted format: the generic one
    ("microsoft-Phi-3.5-mini-instruct.jinja", "phi3", "generic", (False, False, False),
     ["You can call these tools", '"name": "get_weather"',
      '<|assistant|>\n{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}<|end|>',
      '<|user|>\n{"tool_response": 22 C, sunny}<|end|>']),
    # gpt-oss's (llama.cpp's copy of the checkpoint's): tools as a TypeScript namespace in the developer message,
    # the call with its recipient in the role, the result from functions.NAME, the tool result JSON-quoted
    ("openai-gpt-oss-120b.jinja", "gpt-oss", "harmony", (True, True, True),
     ["<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n"
      "// The weather of a city\ntype get_weather = (_: {\ncity: string,\n}) => any;\n\n"
      "} // namespace functions<|end|>",
      '<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant to=functions.get_weather<|channel|>'
      'commentary json<|message|>{"city": "Paris"}<|call|>',
      '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"22 C, sunny"<|end|>'
      "<|start|>assistant"]),
    (None, "llama", "generic", (False, False, True),   # no template: ChatML, which renders any role
     ["<|im_start|>system\nBe brief.\n\nYou can call these tools", "<|im_start|>tool\n22 C, sunny<|im_end|>"]),
]


@pytest.mark.parametrize("template, architecture, name, renders, texts", RENDERINGS, ids=[r[0] or "none"
                                                                                          for r in RENDERINGS])
def test_tools_calls_and_results_render_through_the_families_templates(template, architecture, name, renders,
                                                                          texts):
    tokenizer = tokenizer_with((TEMPLATES / template).read_text(encoding="utf-8") if template else None)
    support = tool_support(tokenizer, architecture)
    assert support.format.name == name
    assert (support.renders_tools, support.renders_calls, support.renders_results) == renders
    messages, variables = render_messages(TURN, TOOLS, support)
    prompt = tokenizer.apply_chat_template(messages, **variables)
    for text in texts:
        assert text in prompt, (text, prompt)
    assert "perfx_probe" not in prompt
    # Without tools (tool_choice "none"), the calls and results of the history are still rendered.
    messages, variables = render_messages(TURN, None, support)
    bare = tokenizer.apply_chat_template(messages, **variables)
    assert "22 C, sunny" in bare and "get_weather" in bare and "Be brief." in bare


def test_harmony_renders_each_of_several_calls_with_its_result_and_the_reasoning_before_a_call():
    """gpt-oss's template renders one call a message and names a result after the call before it: a message of
    two calls becomes two, each followed by its own result; the reasoning sent back (reasoning_content, as perfx
    serve returns it) goes to the template's thinking field, rendered before a call that no answer follows yet."""
    tokenizer = tokenizer_with((TEMPLATES / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8"))
    support = tool_support(tokenizer, "gpt-oss")
    calls = [{"id": f"call_{c}", "type": "function", "function": {"name": n, "arguments": a}}
             for c, n, a in (("a", "get_weather", '{"city": "Paris"}'), ("b", "get_time", "{}"))]
    turn = [{"role": "user", "content": "Weather and time?"},
            {"role": "assistant", "content": None, "reasoning_content": "Two tools.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_b", "content": "noon"},
            {"role": "tool", "tool_call_id": "call_a", "content": "22 C"}]
    tools = TOOLS + [{"type": "function", "function": {"name": "get_time"}}]    # no description, no parameters
    messages, variables = render_messages(turn, tools, support)
    prompt = tokenizer.apply_chat_template(messages, **variables)
    assert ("<|start|>assistant<|channel|>analysis<|message|>Two tools.<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"22 C"<|end|>'
            "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"
            '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"noon"<|end|>'
            "<|start|>assistant") in prompt, prompt
    assert "type get_time = () => any;" in prompt
    # once answered, the reasoning of the earlier turn is dropped, as the template does
    answered = turn + [{"role": "assistant", "content": "22 C at noon.", "reasoning_content": "Done."},
                       {"role": "user", "content": "Thanks"}]
    prompt = tokenizer.apply_chat_template(*render_messages(answered, tools, support)[:1],
                                           **render_messages(answered, tools, support)[1])
    assert "Two tools." not in prompt and "Done." not in prompt
    assert "<|start|>assistant<|channel|>final<|message|>22 C at noon.<|end|><|start|>user<|message|>Thanks" in prompt


def test_a_template_s_own_format_wins_over_the_family_s_default():
    # A Llama model with Qwen's template (a fine-tune, or Hermes-3 on Llama 3.1): Hermes' format, from its marker.
    tokenizer = tokenizer_with((TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8"))
    assert tool_support(tokenizer, "llama").format.name == "hermes"
    # SmolLM3's own template (with its tool sections) takes the tools as xml_tools.
    template = ("{% if xml_tools is defined %}{% for t in xml_tools %}{{ t | tojson }}{% endfor %}{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    support = tool_support(tokenizer_with(template), "smollm3")
    assert support.format.name == "smollm3" and support.renders_tools
    messages, variables = render_messages(TURN[:2], TOOLS, support)
    assert set(variables) == {"xml_tools"}
    assert '"name": "get_weather"' in tokenizer_with(template).apply_chat_template(messages, **variables)


# -- the grammar of a forced call -------------------------------------------------------------------------


class ByteTokenizer:
    """One token a byte (and an end of text): llguidance then checks text against a grammar byte by byte."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([i]) for i in range(256)] + [b"\xff<eos>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokenizer()))
SCHEMA_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "additionalProperties": False,
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                       "metric": {"type": "boolean"}, "note": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}}}},
]


def matches(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, grammar)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def written(fmt, calls) -> str:
    # harmony's call ends with <|call|>, which ends generation: the grammar ends before it
    text = call_text(fmt, calls)
    return text.removesuffix(CALL) if fmt.body == "harmony" else text


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_forced_call_s_grammar_takes_valid_calls_only(fmt):
    good = ToolCall("get_weather", json.dumps(WEATHER, ensure_ascii=False))
    for name in ("get_weather", None):
        grammar = call_grammar(fmt, SCHEMA_TOOLS, name)
        assert llguidance.LLMatcher.validate_grammar(grammar) == ""
        assert matches(grammar, written(fmt, [good]))
        assert matches(grammar, written(fmt, [ToolCall("get_weather", '{"city": "Oslo"}')]))
        for bad in ('{"town": "Oslo"}', '{"city": 5}', '{"city": "Oslo", "days": 0}', "{}"):
            assert not matches(grammar, written(fmt, [ToolCall("get_weather", bad)])), bad
        assert not matches(grammar, "It is sunny.")
    named = call_grammar(fmt, SCHEMA_TOOLS, "get_weather")
    assert not matches(named, written(fmt, [ToolCall("get_time", "{}")]))
    assert matches(call_grammar(fmt, SCHEMA_TOOLS), written(fmt, [ToolCall("get_time", '{"zone": "CET"}')]))
    if fmt.body != "envelope" and (fmt.opener or fmt.listed):
        # "required" takes several calls; a named function one, and so does parallel_tool_calls false
        two = call_text(fmt, [good, ToolCall("get_time", "{}")])
        assert matches(call_grammar(fmt, SCHEMA_TOOLS), two) and not matches(named, two)
        assert not matches(call_grammar(fmt, SCHEMA_TOOLS, parallel=False), two)
        assert matches(call_grammar(fmt, SCHEMA_TOOLS, parallel=False), call_text(fmt, [good]))


def test_the_generic_format_s_reply_is_a_call_or_an_answer():
    grammar = call_grammar(GENERIC_TOOLS, SCHEMA_TOOLS, answer=True)
    assert matches(grammar, '{"response": "It is sunny."}')
    assert matches(grammar, '{"tool_call": {"name": "get_time", "arguments": {}}}')
    assert not matches(grammar, "It is sunny.")
    assert not matches(call_grammar(GENERIC_TOOLS, SCHEMA_TOOLS), '{"response": "It is sunny."}')


def test_special_token_markers_are_named_by_id():
    grammar = call_grammar(PHI4_TOOLS, SCHEMA_TOOLS, "get_time", special_ids={"<|tool_call|>": 200025,
                                                                              "<|/tool_call|>": 200026})
    assert grammar.startswith("start: <[200025]> ") and "<[200026]>" in grammar
    with pytest.raises(Exception, match="no tool named 'nope'"):
        call_grammar(PHI4_TOOLS, SCHEMA_TOOLS, "nope")


@pytest.mark.parametrize("vocab, template, architecture, choice, ending", [
    ("qwen3", "Qwen-Qwen3-0.6B.jinja", "qwen3", "required", "<|im_start|>assistant\n"),
    ("phi4-mini", "microsoft-Phi-4-mini-instruct.jinja", "phi3",
     {"type": "function", "function": {"name": "get_weather"}}, "<|assistant|>"),
], ids=["qwen3-required", "phi4-mini-named"])
def test_a_forced_call_s_grammar_opens_it_in_the_model_s_own_tokens(vocab, template, architecture, choice, ending):
    """With real vocabularies (tests/data/vocab): the prompt ends with the generation prompt, and the reply's
    grammar, compiled for the model's tokenizer, allows only the call's opening first (its marker as the single
    token the model writes, named by its id), then takes the call the model writes in its own tokens."""
    from perfx.constrain import Constraint
    from perfx.serve.api import chat_prompt

    tokenizer = Tokenizer.from_gguf(Path(__file__).parent / "data" / "vocab" / f"{vocab}.gguf")
    tokenizer.chat_template = (TEMPLATES / template).read_text(encoding="utf-8")
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": SCHEMA_TOOLS, "tool_choice": choice}
    ids, _, _, tooling = chat_prompt(body, tokenizer, architecture)
    assert tokenizer.decode(ids).endswith(ending)
    fmt = tooling.support.format
    [opener_id], [closer_id] = tokenizer.encode(fmt.opener), tokenizer.encode(fmt.closer)
    assert f"<[{opener_id}]>" in tooling.grammar and f"<[{closer_id}]>" in tooling.grammar
    constraint = Constraint.from_lark(tooling.grammar, tokenizer)
    first = constraint.allowed()
    assert [i for i in range(tokenizer.vocab_size) if first[i // 32] >> (i % 32) & 1] == [opener_id]
    for token in tokenizer.encode(call_text(fmt, [ToolCall("get_weather", '{"city": "Oslo"}')])):
        assert not constraint.done
        constraint.advance(token)
    assert constraint.accepting
