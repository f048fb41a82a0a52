"""gpt-oss's harmony format through `perfx serve` and the official openai client, and `perfx chat`, on a tiny
gpt-oss GGUF with a byte-level vocabulary, harmony's special tokens and gpt-oss's real chat template
(helpers.gptoss_models): the analysis channel as reasoning_content and the final one as content (whole and
streamed), calls parsed into tool_calls, results rendered back through the template for the answer, forced calls
and JSON answers kept to their grammar, bad conversations refused with a 400. The random model never writes
harmony by itself, so the replies read back are scripted (helpers.scripted_model); the forced calls and JSON
answers are the random model's own, sampled under the grammar."""

import json
import re

import numpy as np
import openai
import pytest

from helpers.gptoss_models import write_gptoss_gguf
from helpers.scripted_model import ScriptedModel
from perfx.commands.chat import Chat
from perfx.generate import SamplingConfig
from perfx.model import load_model
from test_serve import BOUNDED_TOOLS, MODEL, WEATHER_TOOLS, forced_calls, running_server

pytestmark = pytest.mark.one_implementation  # a server over a model: the default device only

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
THINK = "<|channel|>analysis<|message|>The user asks for the weather; call get_weather.<|end|><|start|>assistant"
CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
ANSWER = ("<|channel|>analysis<|message|>22 C and sunny: say so.<|end|><|start|>assistant<|channel|>final"
          "<|message|>It is 22 °C and sunny in Paris.<|return|>")


@pytest.fixture(scope="module")
def harmony(tmp_path_factory, opencl_device):
    path, _ = write_gptoss_gguf(tmp_path_factory.mktemp("harmony") / f"{MODEL}.gguf", np.random.default_rng(7),
                                vocab="harmony")
    model, source = load_model(str(path), opencl_device, progress=False)
    assert source.tokenizer.chat_template and "<|channel|>" in source.tokenizer.chat_template
    return model, source.tokenizer


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_a_forced_call_s_grammar_opens_with_harmony_s_special_tokens(harmony, choice):
    """The request renders to a prompt ending in the generation prompt; the forced call's grammar, compiled for
    the model's tokenizer, allows only <|channel|> (the special token) first, then takes the call as the model
    writes it in its own tokens, ending where <|call|> would come."""
    from perfx.constrain import Constraint
    from perfx.serve.api import chat_prompt
    from perfx.tools import ToolCall, call_text

    _, tokenizer = harmony
    ids, _, _, tooling = chat_prompt({"messages": ASK, "tools": BOUNDED_TOOLS, "tool_choice": choice}, tokenizer,
                                     "gpt-oss")
    assert tokenizer.decode(ids).endswith("<|end|><|start|>assistant")
    constraint = Constraint.from_lark(tooling.grammar, tokenizer)
    first = constraint.allowed()
    assert [i for i in range(tokenizer.vocab_size) if first[i // 32] >> (i % 32) & 1] == \
        tokenizer.encode("<|channel|>")
    text = call_text(tooling.support.format, [ToolCall("get_time", '{"zone": "CET"}')]).removesuffix("<|call|>")
    for token in tokenizer.encode(text):
        assert not constraint.done
        constraint.advance(token)
    assert constraint.accepting


def test_a_call_its_result_and_the_answer_round_trip(harmony):
    """Reasoning then a call: reasoning_content and tool_calls (finish_reason "tool_calls"), whole and streamed as
    delta.reasoning_content and delta.tool_calls; the call and its result (and the reasoning before the call) are
    rendered by gpt-oss's template for the next turn, whose final channel is the answer."""
    model, tokenizer = harmony
    scripted = ScriptedModel(model, tokenizer)
    with running_server(scripted, tokenizer) as srv:
        client = srv.client()
        scripted.say(THINK + CALL)
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS, temperature=0,
                                               max_tokens=300)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.reasoning_content == "The user asks for the weather; call get_weather."
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        assert call.id.startswith("call_")

        scripted.say(THINK + CALL)
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS, temperature=0,
                                                     max_tokens=300, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
            "The user asks for the weather; call get_weather."
        assert "".join(d.content or "" for d in deltas) == ""
        [streamed] = [t for d in deltas for t in d.tool_calls or []]
        assert streamed.function.name == "get_weather" and json.loads(streamed.function.arguments) == {"city": "Paris"}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # the result sent back: the assistant's turn as the client got it (its reasoning too), then the tool's
        turn = ASK + [{"role": "assistant", "content": None, "reasoning_content": choice.message.reasoning_content,
                       "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 22, "sky": "sunny"}'}]
        scripted.say(ANSWER)
        answer = client.chat.completions.create(model=MODEL, messages=turn, tools=WEATHER_TOOLS, temperature=0,
                                                max_tokens=300)
        assert answer.choices[0].message.content == "It is 22 °C and sunny in Paris."
        assert answer.choices[0].message.reasoning_content == "22 C and sunny: say so."
        assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.tool_calls is None
        prompt = tokenizer.decode(srv.engine.conversation.cached)
        assert ("<|start|>assistant<|channel|>analysis<|message|>The user asks for the weather; call get_weather."
                "<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
                '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
                '"{\\"temperature\\": 22, \\"sky\\": \\"sunny\\"}"<|end|><|start|>assistant') in prompt, prompt
        assert "type get_weather = (_: {\ncity: string,\n}) => any;" in prompt
        # <|call|> ends a call's turn and <|return|> the answer's: what a model would write after them is not read
        after = "<|start|>assistant<|channel|>final<|message|>More."
        for script, content in ((THINK + CALL + after, None), (ANSWER + after, "It is 22 °C and sunny in Paris.")):
            scripted.say(script)
            reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS, temperature=0,
                                                   max_tokens=300)
            assert reply.choices[0].message.content == content
            assert reply.choices[0].finish_reason == ("tool_calls" if content is None else "stop")
    assert srv.engine.stats()["failed"] == 0


def test_reasoning_effort_reaches_the_template(harmony):
    """OpenAI's reasoning_effort is the template's: gpt-oss's system message says "Reasoning: low"."""
    model, tokenizer = harmony
    scripted = ScriptedModel(model, tokenizer)
    with running_server(scripted, tokenizer) as srv:
        for effort in ("low", None):
            scripted.say(ANSWER)
            srv.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=100,
                                                 **({"reasoning_effort": effort} if effort else {}))
            prompt = tokenizer.decode(srv.engine.conversation.cached)
            assert f"Reasoning: {effort or 'medium'}\n" in prompt, prompt


def test_without_tools_the_reasoning_is_apart_from_the_answer(harmony):
    """No tools: the reply is still read as harmony's messages, reasoning apart, streamed as it comes; a reply
    cut inside its analysis (max_tokens) is reasoning only, and its content empty."""
    model, tokenizer = harmony
    scripted = ScriptedModel(model, tokenizer)
    with running_server(scripted, tokenizer) as srv:
        client = srv.client()
        scripted.say(ANSWER)
        reply = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=300)
        message = reply.choices[0].message
        assert (message.content, message.reasoning_content) == ("It is 22 °C and sunny in Paris.",
                                                                "22 C and sunny: say so.")
        assert reply.choices[0].finish_reason == "stop"
        scripted.say(ANSWER)
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=300,
                                                     stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
        content = [d.content for d in deltas if d.content]
        assert len(reasoning) > 1, "reasoning streams token by token"
        assert ("".join(reasoning), "".join(content)) == ("22 C and sunny: say so.", "It is 22 °C and sunny in Paris.")
        assert not any(getattr(d, "reasoning_content", None) and d.content for d in deltas)
        scripted.say(ANSWER)
        cut = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=12)
        assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content == ""
        assert cut.choices[0].message.reasoning_content and "<|" not in cut.choices[0].message.reasoning_content


def test_forced_calls_from_the_random_model_parse_and_validate(harmony):
    """tool_choice "required" and a named function on the random model at temperature 1: the reply keeps to the
    harmony call's grammar (its markers the vocabulary's special tokens), so it is always one call whose arguments
    validate against the tool's parameters."""
    jsonschema = pytest.importorskip("jsonschema")
    model, tokenizer = harmony
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED_TOOLS}
    with running_server(model, tokenizer) as srv:
        client = srv.client()
        for seed, (stream, choice) in enumerate([(False, "required"), (True, "required"),
                                                 (False, {"type": "function", "function": {"name": "get_time"}}),
                                                 (True, {"type": "function", "function": {"name": "get_weather"}})]):
            calls, finish, content = forced_calls(client, stream, tool_choice=choice, temperature=1.0, seed=seed)
            assert len(calls) == 1 and finish == "tool_calls" and not content, (choice, calls, finish, content)
            name, arguments = calls[0]
            jsonschema.validate(json.loads(arguments), parameters[name])
            if isinstance(choice, dict):
                assert name == choice["function"]["name"]
        assert srv.engine.stats()["failed"] == 0


ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "degrees"],
                 "properties": {"city": {"type": "string", "maxLength": 10},
                                "degrees": {"type": "integer", "minimum": -50, "maximum": 60}}}


def test_a_json_answer_is_written_in_the_final_channel_and_validates(harmony):
    """response_format json_schema on gpt-oss: the reply opens its final channel and writes JSON there, so the
    random model's content always parses and validates, and it is no reasoning; a schema llguidance cannot take is
    a 400 naming the response_format."""
    jsonschema = pytest.importorskip("jsonschema")
    model, tokenizer = harmony
    with running_server(model, tokenizer) as srv:
        client = srv.client()
        form = {"type": "json_schema", "json_schema": {"name": "weather", "schema": ANSWER_SCHEMA, "strict": True}}
        for seed, stream in enumerate((False, True, False)):
            reply = client.chat.completions.create(model=MODEL, messages=ASK, response_format=form, temperature=1.0,
                                                   seed=seed, max_tokens=200, stream=stream)
            if stream:
                deltas = [c.choices[0].delta for c in reply if c.choices]
                content = "".join(d.content or "" for d in deltas)
                assert not any(getattr(d, "reasoning_content", None) for d in deltas)
            else:
                content = reply.choices[0].message.content
                assert reply.choices[0].finish_reason == "stop"
                assert getattr(reply.choices[0].message, "reasoning_content", None) is None
            jsonschema.validate(json.loads(content), ANSWER_SCHEMA)
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL, messages=ASK, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}, "then": {}}}})
        assert error.value.body["param"] == "response_format"


def test_bad_conversations_are_a_400_naming_the_fault(harmony):
    model, tokenizer = harmony
    with running_server(model, tokenizer) as srv:
        client = srv.client()
        bad = [
            # harmony's own markers in an assistant's content: the template says where the text belongs
            (ASK + [{"role": "assistant", "content": "<|channel|>analysis<|message|>hm"}, ASK[0]],
             "passed a message containing <|channel|> tags"),
            # a tool's result with no call before it
            (ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "22"}], "no previous assistant message "
                                                                                   "with a tool call"),
            (ASK + [{"role": "assistant", "content": "", "reasoning_content": 5}, ASK[0]],
             "'messages\\[1\\].reasoning_content' must be a string"),
        ]
        for messages, message in bad:
            with pytest.raises(openai.BadRequestError, match=message):
                client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER_TOOLS, max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="'reasoning_effort' must be one of low, medium, high"):
            client.chat.completions.create(model=MODEL, messages=ASK, reasoning_effort="extreme", max_tokens=4)
        assert srv.engine.stats()["failed"] == 0


class Source:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def describe(self):
        return {"path": "gpt-oss.gguf"}


@pytest.mark.parametrize("terminal", [False, True], ids=["piped", "terminal"])
def test_chat_shows_the_answer_and_the_reasoning_dim_or_not_at_all(harmony, capsys, terminal):
    """`perfx chat` on gpt-oss: piped, only the final channel is written; on a terminal the reasoning is shown dim
    before it. A call is shown and kept with its reasoning; /tool's result goes back through the template."""
    model, tokenizer = harmony
    scripted = ScriptedModel(model, tokenizer)
    chat = Chat(scripted, Source(tokenizer), SamplingConfig(temperature=0), 300, None, interactive=False,
                tools=[{"type": "function", "function": WEATHER_TOOLS[0]["function"]}])
    chat.colour = terminal
    scripted.say(ANSWER)
    chat.turn("Weather?")
    out = capsys.readouterr().out
    if terminal:    # each piece dim on its own, so that a reply stopped by Ctrl-C leaves the terminal as it was
        dim = re.findall("\x1b\\[2m(.*?)\x1b\\[0m", out)
        assert "".join(dim) == "22 C and sunny: say so.", out
        assert re.sub("\x1b\\[\\d+m", "", out).strip() == "22 C and sunny: say so.\nIt is 22 °C and sunny in Paris."
    else:
        assert out.strip() == "It is 22 °C and sunny in Paris."
    assert chat.messages[-1] == {"role": "assistant", "content": "It is 22 °C and sunny in Paris.",
                                 "reasoning_content": "22 C and sunny: say so."}
    scripted.say(THINK + CALL)
    chat.turn("And tomorrow?")
    out = re.sub("\x1b\\[\\d+m", "", capsys.readouterr().out)
    assert '[tool call get_weather({"city": "Paris"})]' in out and "<|" not in out
    assert out.startswith("The user asks for the weather; call get_weather.\n[tool call") == terminal, out
    scripted.say(ANSWER)
    chat.command("/tool 23 C")
    prompt = tokenizer.decode(chat.render(chat.messages[:5]))
    assert ("<|start|>assistant<|channel|>analysis<|message|>The user asks for the weather; call get_weather.<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"23 C"<|end|>') in prompt
    assert "It is 22 °C and sunny in Paris." in capsys.readouterr().out
