"""`perfx serve` driven by the official `openai` client (and raw HTTP for what a client library never sends),
against a real server on 127.0.0.1 running a tiny random model. In-process servers share one loaded model;
the signal tests start `perfx serve` as a user does."""

import concurrent.futures
import copy
import gc
import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import openai
import pytest

from helpers.scripted_model import ScriptedModel
from helpers.schemas import random_schema
from helpers.tiny_models import write_endless_gguf
from perfx import cli, forward64
from perfx.generate import SamplingConfig
from perfx.model import load_model
from perfx.runtime import Device
from perfx.serve.engine import Engine, served_model_id
from perfx.serve.server import Server, ServeOptions
from perfx.sources import open_model
from perfx.tools import ToolCall, call_text, tool_support

pytestmark = pytest.mark.one_implementation  # a server over a model: the default device only

MODEL = "tiny"
DATA = Path(__file__).parent / "data"
HELLO = [{"role": "user", "content": "hello there"}]
TIMEOUT = 30  # seconds any one client call may take on a loaded machine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny random GGUF model (4096 positions) whose end-of-turn ids have zero rows in the lm_head: replies run
    until max_tokens, so a long one is surely still streaming when a test acts on it (as in test_chat.py)."""
    return write_endless_gguf(tmp_path_factory.mktemp("serve"), MODEL, 4096)


@pytest.fixture(scope="module")
def loaded(tiny, opencl_device):
    model, source = load_model(tiny, opencl_device, progress=False)
    assert served_model_id(source) == MODEL
    return model, source.tokenizer


class Running:
    def __init__(self, server: Server, logs: list[str]):
        self.server, self.engine, self.logs = server, server.engine, logs
        self.port = server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=api_key, timeout=TIMEOUT, **kwargs)

    def connection(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT)


@contextmanager
def running_server(model, tokenizer, queue_limit: int = 16, api_key: str | None = None, verbose: bool = False):
    """A server in this process on a free loopback port; stopped (every answer written) on leaving."""
    logs: list[str] = []
    options = ServeOptions(MODEL, default_max_tokens=16, api_key=api_key, verbose=verbose, log=logs.append)
    server = Server(("127.0.0.1", 0), Engine(model, tokenizer, queue_limit, SamplingConfig(seed=0)), options)
    accepting = threading.Thread(target=server.serve_forever, daemon=True)
    accepting.start()
    try:
        yield Running(server, logs)
    finally:
        server.stop()
        accepting.join(TIMEOUT)


class GatedModel:
    """The tiny model, but each decode step waits for ``gate``: a request stays running until the test says."""

    def __init__(self, model):
        self.model, self.gate = model, threading.Event()

    def __getattr__(self, name):
        return getattr(self.model, name)

    def decode_one(self, token: int, pos: int):
        assert self.gate.wait(TIMEOUT), "the test never opened the gate"
        self.model.decode_one(token, pos)

    # the decode loops on the device (greedy, sampled) run their steps themselves: each token waits there
    def greedy_tokens(self, *args):
        return self._gated(self.model.greedy_tokens(*args))

    def sampled_tokens(self, *args):
        return self._gated(self.model.sampled_tokens(*args))

    def _gated(self, tokens):
        for token in tokens:
            assert self.gate.wait(TIMEOUT), "the test never opened the gate"
            yield token


def chat_ids(tokenizer, messages) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages), add_bos=tokenizer.add_bos_token)


def urlopen_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:
        return response.read().decode()


# -- what a client sees ---------------------------------------------------------------------------------


def test_models_and_a_chat_that_continues_on_the_cache(loaded):
    model, tokenizer = loaded
    with running_server(model, tokenizer) as srv:
        client = srv.client()
        models = client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        assert client.models.retrieve(MODEL).id == MODEL

        first = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0.8, seed=5)
        choice = first.choices[0]
        assert first.object == "chat.completion" and first.model == MODEL
        assert choice.message.role == "assistant" and choice.message.content
        assert choice.finish_reason == "length"    # the tiny model never ends a turn by itself
        usage = first.usage
        assert usage.prompt_tokens == len(chat_ids(tokenizer, HELLO))  # the model's own BOS rule, as chat
        assert usage.completion_tokens == 12 and usage.total_tokens == usage.prompt_tokens + 12

        # The next turn of the same conversation prefills only its new tokens.
        conversation = HELLO + [{"role": "assistant", "content": choice.message.content},
                                {"role": "user", "content": "and then?"}]
        second = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=4)
        assert second.usage.prompt_tokens == len(chat_ids(tokenizer, conversation))
        assert second.usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens

        # Stop strings: greedy gibberish soon makes one of these letters; the reply stops before it.
        stopped = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=300, temperature=0,
                                                 stop=["a", "e", "o", "i"])
        assert stopped.choices[0].finish_reason == "stop"
        assert not set("aeoi") & set(stopped.choices[0].message.content)
        assert stopped.usage.completion_tokens < 300
        # perfx's own sampling, under the names other servers use.
        extra = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3,
                                               extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1})
        assert extra.usage.completion_tokens == 3
        health = json.loads(urlopen_text(f"http://127.0.0.1:{srv.port}/health"))
        assert health["status"] == "ok" and health["completed"] == 4 and health["running"] == 0
    # One line per request, with counts and timings and no text (no --verbose).
    assert len(srv.logs) == 7, srv.logs
    assert re.search(r"#3 POST /v1/chat/completions 200, prompt \d+ \(0 cached\), completion 12 \(length\), "
                     r"wait [\d.]+ s, TTFT [\d.]+ s, total [\d.]+ s", srv.logs[2]), srv.logs
    assert not any("hello there" in line or json.dumps(choice.message.content) in line for line in srv.logs)


def test_a_chat_continues_on_an_int8_kv_cache(tiny, opencl_device):
    """--kv q8: the next turn of a conversation prefills only its new ids on the cached q8 positions, and the
    logits it ends on are those of the whole conversation prefilled from nothing (as in test_chat.py)."""
    model, source = load_model(tiny, opencl_device, progress=False, kv="q8")
    tokenizer = source.tokenizer
    with running_server(model, tokenizer) as srv:
        client = srv.client()
        first = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, temperature=0)
        conversation = HELLO + [{"role": "assistant", "content": first.choices[0].message.content},
                                {"role": "user", "content": "and then?"}]
        second = client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=1, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        assert second.usage.prompt_tokens == len(chat_ids(tokenizer, conversation))
    via_cache = model.logits()
    model.prefill(chat_ids(tokenizer, conversation), 0)
    fresh = model.logits()
    assert np.abs(via_cache - fresh).max() <= 1e-2 * np.abs(fresh).max()
    assert re.search(r"prompt \d+ \([1-9]\d* cached\)", srv.logs[1]), srv.logs


def test_streamed_chat_and_text_completions(loaded):
    model, tokenizer = loaded
    with running_server(model, tokenizer) as srv:
        client = srv.client()
        chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10, stream=True,
                                                     stream_options={"include_usage": True}))
        assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
        assert all(c.usage is None for c in chunks[:-1])
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text

        plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
        assert plain.object == "text_completion" and plain.choices[0].finish_reason == "length"
        assert plain.usage.completion_tokens == 6 and plain.choices[0].text
        pieces = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True))
        assert pieces[-1].choices[0].finish_reason == "length"
        assert "".join(p.choices[0].text for p in pieces)
        ids = tokenizer.encode("Once upon a time", add_bos=tokenizer.add_bos_token)
        by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=2)
        assert by_ids.usage.prompt_tokens == len(ids)


# -- tool calls -----------------------------------------------------------------------------------------


def with_template(tokenizer, name: str):
    """The tokenizer with a family's real template (tests/data/templates)."""
    tokenizer = copy.copy(tokenizer)
    tokenizer.__dict__.pop("_compiled_chat_template", None)
    tokenizer.chat_template = (DATA / "templates" / name).read_text(encoding="utf-8")
    return tokenizer


WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tool_calls_round_trip_through_the_openai_client(loaded):
    """Qwen3's template and Hermes' calls: a call parsed into message.tool_calls (and streamed as
    delta.tool_calls), its result sent back as a tool message for the answer, forced and refused calls."""
    model, tokenizer = loaded
    tokenizer = with_template(tokenizer, "Qwen-Qwen3-0.6B.jinja")
    scripted = ScriptedModel(model, tokenizer)
    with running_server(scripted, tokenizer) as srv:
        client = srv.client()

        def ask(messages, script, **kwargs):
            scripted.say(script)
            return client.chat.completions.create(model=MODEL, messages=messages, tools=WEATHER_TOOLS,
                                                  temperature=0, max_tokens=200, **kwargs)

        reply = ask(ASK, "Let me check.\n" + CALL)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        assert json.loads(call.function.arguments) == {"city": "Paris"}

        # the tool's result, and the answer; the conversation so far is in the KV cache
        turn = ASK + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 22, "sky": "sunny"}'}]
        answer = ask(turn, "It is 22 degrees and sunny in Paris.")
        assert answer.choices[0].message.content == "It is 22 degrees and sunny in Paris."
        assert answer.choices[0].finish_reason == "stop" and answer.choices[0].message.tool_calls is None
        assert answer.usage.prompt_tokens_details.cached_tokens > reply.usage.prompt_tokens // 2

        # streamed: two calls, each whole in one delta, indexed
        scripted.say(CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS, temperature=0,
                                                     max_tokens=200, stream=True))
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
            (0, "get_weather", {"city": "Paris"}), (1, "get_time", {})]
        assert all(d.id and d.type == "function" for d in deltas)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
        assert len(ask(ASK, CALL + CALL.replace("Paris", "Oslo"), parallel_tool_calls=False).choices[0]
                   .message.tool_calls) == 1

        # a forced call: the reply keeps to its grammar, whose every token the script's must be (ScriptedModel)
        forced = ask(ASK, CALL.replace("Paris", "Oslo"),
                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert forced.choices[0].finish_reason == "tool_calls"
        assert json.loads(forced.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
        required = ask(ASK, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
                       tool_choice="required")
        assert required.choices[0].message.tool_calls[0].function.name == "get_time"

        # a malformed call stays text; with tool_choice "none" a call is not read
        broken = ask(ASK, '<tool_call>{"name": get_weather}</tool_call>')
        assert broken.choices[0].message.content == '<tool_call>{"name": get_weather}</tool_call>'
        assert broken.choices[0].finish_reason == "stop" and broken.choices[0].message.tool_calls is None
        refused = ask(ASK, CALL, tool_choice="none")
        assert refused.choices[0].message.content == CALL and refused.choices[0].message.tool_calls is None
        assert srv.engine.stats()["failed"] == 0
    # the log line counts the calls (every line is written once the server has stopped)
    assert re.search(r"completion \d+ \(stop\), 1 tool call,", srv.logs[0]), srv.logs
    assert re.search(r", 2 tool calls,", srv.logs[2]), srv.logs


FAMILY_TEMPLATES = [("Qwen-Qwen3-0.6B.jinja", "qwen3"), ("meta-llama-Llama-3.2-1B-Instruct.jinja", "llama"),
                    ("microsoft-Phi-4-mini-instruct.jinja", "phi3"), ("HuggingFaceTB-SmolLM3-3B.jinja", "smollm3"),
                    ("LiquidAI-LFM2-1.2B.jinja", "lfm2"), ("google-gemma-3-4b-it.jinja", "gemma3")]


@pytest.mark.parametrize("template, architecture", FAMILY_TEMPLATES, ids=[t[1] for t in FAMILY_TEMPLATES])
def test_each_family_s_template_round_trips_a_call(loaded, template, architecture):
    """Call, tool result, answer, through each family's real template and its model's own call text: the call
    read back (whole and streamed), the result rendered into the next prompt, the answer read as content."""
    model, tokenizer = loaded
    tokenizer = with_template(tokenizer, template)
    scripted = ScriptedModel(model, tokenizer)
    with running_server(scripted, tokenizer) as srv:
        srv.engine.architecture = architecture     # the tiny model is Llama's; the template is this family's
        client = srv.client()
        fmt = tool_support(tokenizer, architecture).format
        written = call_text(fmt, [ToolCall("get_weather", '{"city": "Paris"}')])
        for stream in (False, True):
            scripted.say(written)
            reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS, temperature=0,
                                                   max_tokens=200, stream=stream)
            if stream:
                chunks = list(reply)
                [call] = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
                assert chunks[-1].choices[0].finish_reason == "tool_calls"
            else:
                [call] = reply.choices[0].message.tool_calls
                assert reply.choices[0].finish_reason == "tool_calls"
            assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        turn = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude={"index"})]},
                      {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}]
        scripted.say("It is 22 degrees and sunny.")
        answer = client.chat.completions.create(model=MODEL, messages=turn, tools=WEATHER_TOOLS, temperature=0,
                                                max_tokens=200)
        assert answer.choices[0].message.content == "It is 22 degrees and sunny."
        prompt = tokenizer.decode(srv.engine.conversation.cached)
        assert "22 C, sunny" in prompt and "get_weather" in prompt and "Paris" in prompt


def test_a_template_without_tools_gets_the_generic_format(loaded):
    """The tiny model's ChatML template renders no tools (as SmolLM2's, the default model's): they are described
    in the system message, and the reply is one JSON object, a call or an answer."""
    model, tokenizer = loaded
    scripted = ScriptedModel(model, tokenizer)
    with running_server(scripted, tokenizer) as srv:
        client = srv.client()
        scripted.say('{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}')
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS, temperature=0,
                                               max_tokens=200)
        assert reply.choices[0].finish_reason == "tool_calls"
        assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"
        scripted.say('{"response": "I cannot tell."}')
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS, temperature=0,
                                                     max_tokens=200, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "I cannot tell."
        assert chunks[-1].choices[0].finish_reason == "stop"


# bounded strings and numbers: a random model's call ends well within its max_tokens
BOUNDED_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                  "unit": {"enum": ["C", "F"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}]


def forced_calls(client, stream: bool, **options) -> tuple[list, str, str]:
    """A reply's calls as (name, arguments text), its finish_reason and its content, whole or streamed."""
    options = {"model": MODEL, **options}
    reply = client.chat.completions.create(messages=ASK, tools=BOUNDED_TOOLS, max_tokens=400, stream=stream,
                                           **options)
    if not stream:
        choice = reply.choices[0]
        return ([(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []],
                choice.finish_reason, choice.message.content or "")
    chunks = list(reply)
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    return ([(d.function.name, d.function.arguments) for d in deltas], chunks[-1].choices[0].finish_reason,
            "".join(c.choices[0].delta.content or "" for c in chunks))


@pytest.mark.parametrize("template, architecture", [(None, None)] + FAMILY_TEMPLATES,
                         ids=["generic"] + [t[1] for t in FAMILY_TEMPLATES])
def test_a_forced_call_from_a_random_model_always_parses_and_validates(loaded, template, architecture):
    """tool_choice "required" and a named function on the tiny random model (which never calls a tool by
    itself), sampled at temperature 1 with varied seeds, whole and streamed, through each family's format: the
    reply keeps to the call's grammar, so it is always a call whose arguments parse and validate against the
    tool's parameters, with finish_reason "tool_calls"."""
    jsonschema = pytest.importorskip("jsonschema")
    model, tokenizer = loaded
    tokenizer = with_template(tokenizer, template) if template else tokenizer
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED_TOOLS}
    with running_server(model, tokenizer) as srv:
        srv.engine.architecture = architecture
        client = srv.client()
        # parallel_tool_calls false with "required": one call, as a random model never ends a list of them
        for seed, (stream, choice) in enumerate([(False, "required"), (True, "required"),
                                                 (False, {"type": "function", "function": {"name": "get_time"}}),
                                                 (True, {"type": "function", "function": {"name": "get_weather"}})]):
            calls, finish, _ = forced_calls(client, stream, tool_choice=choice, temperature=1.0, seed=seed,
                                            parallel_tool_calls=False)
            assert calls and finish == "tool_calls", (choice, calls, finish)
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), parameters[name])
            assert len(calls) == 1
            if isinstance(choice, dict):
                assert calls[0][0] == choice["function"]["name"]
        assert srv.engine.stats()["failed"] == 0


def test_the_generic_format_s_reply_under_auto_is_a_call_or_an_answer(loaded):
    """A template without tools (the tiny model's ChatML, as the default model's) under tool_choice "auto": the
    reply keeps to the generic grammar, so the random model's every reply is a valid call or an answer, never
    loose text; a family's format under "auto" is not constrained (the model may answer in plain text)."""
    jsonschema = pytest.importorskip("jsonschema")
    model, tokenizer = loaded
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED_TOOLS}
    with running_server(model, tokenizer) as srv:
        client, answers = srv.client(), 0
        for seed in range(6):
            calls, finish, content = forced_calls(client, seed % 2 == 1, temperature=1.0, seed=seed)
            if calls:
                assert finish == "tool_calls"
                for name, arguments in calls:
                    jsonschema.validate(json.loads(arguments), parameters[name])
            elif finish == "stop":
                assert not content.startswith('{"'), content     # an answer, read out of its JSON
            else:
                # an answer cut by max_tokens (a random model's string rarely ends) stays as written
                assert finish == "length" and content.startswith('{"response": "'), (finish, content)
            answers += not calls
        assert 0 < answers < 6    # both kinds, from the seeds here
        assert srv.engine.stats()["failed"] == 0
    scripted = ScriptedModel(model, with_template(tokenizer, "Qwen-Qwen3-0.6B.jinja"))
    with running_server(scripted, scripted.tokenizer) as srv:
        scripted.say("It is sunny, I think.")
        reply = srv.client().chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS,
                                                     temperature=0, max_tokens=200)
        assert reply.choices[0].message.content == "It is sunny, I think."


def test_without_llguidance_a_forced_call_is_a_400_and_the_generic_auto_reply_goes_free(loaded, monkeypatch):
    from perfx import constrain

    monkeypatch.setitem(sys.modules, "llguidance", None)     # import llguidance fails, as when not installed
    monkeypatch.setattr(constrain, "available", lambda: False)
    model, tokenizer = loaded
    scripted = ScriptedModel(model, tokenizer)
    with running_server(scripted, tokenizer) as srv:
        client = srv.client()
        scripted.say("It is sunny.")
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS, max_tokens=50,
                                               temperature=0)
        assert reply.choices[0].message.content == "It is sunny."
        with pytest.raises(openai.BadRequestError, match=r"needs llguidance: pip install 'perfx\[structured\]'"):
            client.chat.completions.create(model=MODEL, messages=ASK, tools=WEATHER_TOOLS, tool_choice="required")


def test_tools_and_a_json_response_format_do_not_combine(loaded):
    """A reply keeps to one grammar: a JSON response_format with tools (not "none") is a 400 saying so; with
    tool_choice "none" the schema holds."""
    model, tokenizer = loaded
    with running_server(model, tokenizer) as srv:
        client = srv.client()
        for choice in ("required", "auto", {"type": "function", "function": {"name": "get_time"}}):
            with pytest.raises(openai.BadRequestError, match="cannot be combined with 'tools'") as error:
                client.chat.completions.create(model=MODEL, messages=ASK, tools=BOUNDED_TOOLS, tool_choice=choice,
                                               response_format=json_schema_format(PERSON))
            assert error.value.body["param"] == "response_format"
        reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=BOUNDED_TOOLS, tool_choice="none",
                                               max_tokens=300, response_format={"type": "json_object"})
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
        # a tool whose parameters use what llguidance lacks: a 400 on 'tools'
        odd = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}}}]
        with pytest.raises(openai.BadRequestError, match="Unimplemented keys") as error:
            client.chat.completions.create(model=MODEL, messages=ASK, tools=odd, tool_choice="required")
        assert error.value.body["param"] == "tools"


@pytest.mark.slow
def test_the_default_model_s_calls_through_perfx_serve():
    """`perfx serve` on the README's model (SmolLM2: the generic format) and the openai client: forced calls,
    greedy and sampled, whole and streamed, always parse and validate; under "auto" a call or an answer."""
    jsonschema = pytest.importorskip("jsonschema")
    from perfx.sources.default import default_model_path

    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED_TOOLS}
    server = ServeProcess(str(default_model_path()), "--ctx", "2048")
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=120, max_retries=0)
        served = client.models.list().data[0].id
        for seed, (stream, choice, temperature) in enumerate([
                (False, "required", 0.0), (True, "required", 1.0),
                (False, {"type": "function", "function": {"name": "get_weather"}}, 1.0),
                (True, {"type": "function", "function": {"name": "get_time"}}, 0.0)]):
            calls, finish, _ = forced_calls(client, stream, tool_choice=choice, temperature=temperature, seed=seed,
                                            parallel_tool_calls=False, model=served)
            assert len(calls) == 1 and finish == "tool_calls", (choice, calls, finish)
            jsonschema.validate(json.loads(calls[0][1]), parameters[calls[0][0]])
        calls, finish, content = forced_calls(client, False, temperature=0.0, model=served)
        assert (finish == "tool_calls" and calls) or (finish == "stop" and content), (calls, finish, content)
    finally:
        server.close()


def test_four_concurrent_clients_each_get_their_whole_reply(loaded):
    model, tokenizer = loaded
    with running_server(model, tokenizer) as srv:
        def converse(i: int):
            stream = srv.client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"question number {i}"}], max_tokens=24,
                stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            return text, reasons, chunks[-1].usage

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(converse, range(4), timeout=4 * TIMEOUT))
        for text, reasons, usage in results:
            assert text and reasons == ["length"] and usage.completion_tokens == 24
        assert srv.engine.stats()["completed"] == 4 and srv.engine.stats()["cancelled"] == 0


def test_a_client_that_disconnects_mid_stream_frees_its_turn(loaded):
    model, tokenizer = loaded
    with running_server(model, tokenizer) as srv:
        client = srv.client()
        stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4000, stream=True)
        iterator = iter(stream)
        next(iterator)                             # the role chunk: the request is running
        assert next(iterator).choices[0].delta.content is not None
        stream.close()                             # the client goes away mid-stream
        started = time.monotonic()
        after = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4)
        assert after.choices[0].finish_reason == "length"
        assert time.monotonic() - started < TIMEOUT
        stats = srv.engine.stats()
        assert stats["cancelled"] == 1 and stats["completed"] == 1
    cancelled = [line for line in srv.logs if "(cancelled)" in line]
    assert len(cancelled) == 1 and "client gone" in cancelled[0], srv.logs
    # Generation stopped at once: far from the 4000 tokens asked for (each takes about a millisecond here).
    assert int(re.search(r"completion (\d+) \(cancelled\)", cancelled[0])[1]) < 1000, cancelled[0]


def test_a_client_that_leaves_before_a_non_streamed_answer_frees_its_turn(loaded):
    model, tokenizer = loaded
    gated = GatedModel(model)
    with running_server(gated, tokenizer) as srv:
        connection = srv.connection()
        connection.request("POST", "/v1/chat/completions", json.dumps(
            {"model": MODEL, "messages": HELLO, "max_tokens": 4000}), {"Content-Type": "application/json"})
        assert srv.engine.wait_for(lambda s: s["running"] == 1, TIMEOUT)
        gated.gate.set()                           # generating, with nothing written to the client until the end
        connection.close()
        assert srv.engine.wait_for(lambda s: s["cancelled"] == 1, TIMEOUT)
        assert srv.client().completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    cancelled = [line for line in srv.logs if "(cancelled)" in line]
    assert len(cancelled) == 1 and int(re.search(r"completion (\d+)", cancelled[0])[1]) < 4000, srv.logs


def test_stopping_ends_idle_keep_alive_connections_so_the_model_can_go(tiny, opencl_device):
    """A keep-alive connection's thread waits for the client's next request, holding the server, its engine and
    the model: stop() ends it and waits for it. Left running, it let the model's device memory go whenever the
    client closed (a client left to the collector: at some later test's gc.collect()), in the middle of whatever
    counted the device's bytes then."""
    device = Device(opencl_device.entry.index)   # a count of this test's own
    model, source = load_model(tiny, device, progress=False)
    with running_server(model, source.tokenizer) as srv:
        connection = srv.connection()
        connection.request("GET", "/health")
        assert connection.getresponse().read()   # answered: the connection stays open for a next request
    del model, source, srv
    gc.collect()
    assert device.allocated_bytes == 0
    assert connection.sock.recv(1) == b""       # the server closed its end
    connection.close()


def test_the_queue_limit_answers_429(loaded):
    model, tokenizer = loaded
    gated = GatedModel(model)
    with running_server(gated, tokenizer, queue_limit=1) as srv:
        client = srv.client(max_retries=0)         # the client would otherwise retry a 429 by itself
        running = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, stream=True)
        chunks = iter(running)
        next(chunks)                               # running, and held at its first decode step
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.chat.completions.create, model=MODEL, messages=HELLO, max_tokens=3)
            assert srv.engine.wait_for(lambda s: s["waiting"] == 1, TIMEOUT)
            with pytest.raises(openai.RateLimitError) as refused:
                client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
            error = refused.value.response.json()["error"]
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
            assert "queue holds 1" in error["message"]
            assert refused.value.response.headers["Retry-After"] == "1"
            gated.gate.set()
            assert list(chunks)[-1].choices[0].finish_reason == "length"    # the running one, unharmed
            assert waiting.result(TIMEOUT).usage.completion_tokens == 3
        stats = srv.engine.stats()
        assert (stats["completed"], stats["rejected"], stats["waiting"]) == (2, 1, 0)


def scrape(srv) -> dict[str, float]:
    """/metrics over plain HTTP, parsed as Prometheus reads its text format: every sample line `name{labels} value`
    after a `# TYPE` line naming its family."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=TIMEOUT) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    samples, typed = {}, set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind in ("counter", "gauge")
            typed.add(name)
        elif line and not line.startswith("#"):
            match = re.fullmatch(r'([a-z_]+)(\{[a-z_]+="[a-z]+"\})? (\S+)', line)
            assert match, line
            assert match[1] in typed, f"{match[1]} has no # TYPE line"
            samples[match[1] + (match[2] or "")] = float(match[3])
    return samples


def test_metrics_count_requests_and_tokens(loaded):
    model, tokenizer = loaded
    with running_server(model, tokenizer, queue_limit=0) as srv:
        before = scrape(srv)
        assert before['perfx_requests_total{outcome="completed"}'] == 0
        assert before["perfx_sequences_running"] == before["perfx_sequences_waiting"] == 0
        client = srv.client()
        reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5)
        pieces = list(client.completions.create(model=MODEL, prompt="once upon", max_tokens=4, stream=True))
        assert pieces
        with pytest.raises(openai.BadRequestError):     # refused before it reaches the model: no outcome
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=0)
        after = scrape(srv)
        assert after['perfx_requests_total{outcome="completed"}'] == 2
        assert after['perfx_requests_total{outcome="failed"}'] == 0
        assert after['perfx_requests_total{outcome="rejected"}'] == 0
        assert after["perfx_completion_tokens_total"] == reply.usage.completion_tokens + 4
        text_prompt = tokenizer.encode("once upon", add_bos=tokenizer.add_bos_token)
        assert after["perfx_prompt_tokens_total"] == reply.usage.prompt_tokens + len(text_prompt)
        assert after["perfx_decode_tokens_per_second"] > 0
        assert after["perfx_sequences_running"] == after["perfx_sequences_waiting"] == 0


# The device's logits are within 2e-3 of the float64 forward's, relative to their largest (the forward's own
# tolerance, as tests/test_batch.py holds it); a log-softmax moves by at most twice a logit's error (the logit's
# own and the log-sum-exp's), so log-probabilities are held to twice that, in units of the largest logit.
LOGPROB_TOLERANCE = 2 * 2e-3


def log_softmax64(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    return row - (row.max() + np.log(np.exp(row - row.max()).sum()))


def test_logprobs_match_a_float64_log_softmax_of_the_model_s_logits(tiny, loaded):
    model, tokenizer = loaded
    vocabulary = tokenizer.token_bytes()
    source = open_model(tiny)
    with running_server(model, tokenizer) as srv:
        client = srv.client()
        whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0,
                                               logprobs=True, top_logprobs=5)
        entries = whole.choices[0].logprobs.content
        assert len(entries) == whole.usage.completion_tokens == 6
        assert "".join(e.token for e in entries) == whole.choices[0].message.content
        streamed = [e for chunk in client.chat.completions.create(
                        model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5,
                        stream=True)
                    if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in entries]
        sampled = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=1, seed=3,
                                                 logprobs=True)
        assert len(sampled.choices[0].logprobs.content) == 6
        assert not sampled.choices[0].logprobs.content[0].top_logprobs     # top_logprobs unset: none
        text = client.completions.create(model=MODEL, prompt="once upon", max_tokens=4, temperature=0, logprobs=3)
        chunks = [c.choices[0].logprobs for c in client.completions.create(
            model=MODEL, prompt="once upon", max_tokens=4, temperature=0, logprobs=3, stream=True)
            if c.choices and c.choices[0].logprobs]
        streamed_text = [(t, lp, o) for c in chunks for t, lp, o in zip(c.tokens, c.token_logprobs, c.text_offset)]
    # the float64 forward, step by step along the reply: each token is the greedy one of the ids its bytes name (a
    # byte-fallback id and a piece may spell the same bytes)
    prompt = chat_ids(tokenizer, HELLO)
    want, cache = forward64.model_forward(source, prompt)
    for step, (entry, again) in enumerate(zip(entries, streamed)):
        logits = want[-1]
        token = max((i for i, raw in enumerate(vocabulary) if raw == bytes(entry.bytes)), key=lambda i: logits[i])
        lp, scale = log_softmax64(logits), np.abs(logits).max()
        assert abs(entry.logprob - lp[token]) <= LOGPROB_TOLERANCE * scale
        assert abs(again.logprob - entry.logprob) <= LOGPROB_TOLERANCE * scale
        best = np.sort(lp)[::-1][:5]    # values, not ids: a near-tie may order two ids either way
        assert len(entry.top_logprobs) == 5
        assert np.abs(np.array([t.logprob for t in entry.top_logprobs]) - best).max() <= LOGPROB_TOLERANCE * scale
        assert entry.top_logprobs[0].logprob == max(t.logprob for t in entry.top_logprobs)
        assert entry.logprob >= entry.top_logprobs[-1].logprob   # greedy: the chosen token is among the top
        want, cache = forward64.model_forward(source, [token], len(prompt) + step, cache)
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert "".join(logprobs.tokens) == text.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(4)]
    assert [(t, o) for t, _, o in streamed_text] == list(zip(logprobs.tokens, logprobs.text_offset))
    assert np.allclose([lp for _, lp, _ in streamed_text], logprobs.token_logprobs, atol=1e-5)
    assert all(len(top) <= 3 and max(top.values()) >= lp for top, lp in zip(logprobs.top_logprobs,
                                                                           logprobs.token_logprobs))


def test_logit_bias_forces_and_forbids_tokens(loaded):
    model, tokenizer = loaded
    with running_server(model, tokenizer) as srv:
        client = srv.client()

        def greedy(**options):
            reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
                                                   logprobs=True, **options)
            return [bytes(e.bytes) for e in reply.choices[0].logprobs.content]
        plain = greedy()
        forced = tokenizer.encode("a")[-1]
        assert greedy(logit_bias={str(forced): 100}) == [tokenizer.token_bytes()[forced]] * 4
        banned = {str(i): -100 for i, raw in enumerate(tokenizer.token_bytes()) if raw == plain[0]}
        assert greedy(logit_bias=banned)[0] != plain[0]
        # sampled, streamed: the bias holds on the host sampler's path too
        stream = client.completions.create(model=MODEL, prompt="once upon", max_tokens=4, temperature=1, seed=5,
                                           logit_bias={str(forced): 100}, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == tokenizer.decode([forced] * 4)


def test_n_choices_each_sample_their_own_seed_stream(loaded, monkeypatch):
    """One at a time (the default engine): choice i samples with the seed plus i; the prompt is prefilled once
    and the later choices resume on it from the cache (one id each, for the first token's logits)."""
    model, tokenizer = loaded
    prefilled = []
    prefill = model.prefill
    monkeypatch.setattr(model, "prefill", lambda tokens, start, *a, **k: prefilled.append(len(tokens)) or prefill(
        tokens, start, *a, **k))
    with running_server(model, tokenizer, queue_limit=3) as srv:
        client = srv.client()
        question = [{"role": "user", "content": "three choices, one prompt"}]
        greedy = client.chat.completions.create(model=MODEL, messages=question, max_tokens=5, temperature=0, n=3)
        assert prefilled == [len(chat_ids(tokenizer, question)), 1, 1]
        assert len({c.message.content for c in greedy.choices}) == 1
        assert greedy.usage.prompt_tokens_details.cached_tokens == 0
        with pytest.raises(openai.BadRequestError, match="'n' asks for 5 choices, but this server runs 1 and "
                                                         "queues 3 at most"):
            client.chat.completions.create(model=MODEL, messages=question, max_tokens=5, n=5)
        settings = {"model": MODEL, "messages": HELLO, "max_tokens": 6, "temperature": 1}
        whole = client.chat.completions.create(n=3, seed=11, **settings)
        assert [c.index for c in whole.choices] == [0, 1, 2]
        texts = [c.message.content for c in whole.choices]
        assert len(set(texts)) > 1                              # sampled choices differ
        # choice i is what one request with seed 11 + i gets, streamed or not
        assert texts == [client.chat.completions.create(seed=11 + i, **settings).choices[0].message.content
                         for i in range(3)]
        streamed = {}
        chunks = list(client.chat.completions.create(n=3, seed=11, stream=True,
                                                     stream_options={"include_usage": True}, **settings))
        for chunk in chunks:
            for choice in chunk.choices:
                streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
        assert [streamed[i] for i in range(3)] == texts
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 18
        assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == len(chat_ids(tokenizer, HELLO))
        text = client.completions.create(model=MODEL, prompt="once upon", max_tokens=3, temperature=0, n=2)
        assert len(text.choices) == 2 and text.choices[0].text == text.choices[1].text   # greedy: alike
        # log-probabilities come with each choice
        scored = client.completions.create(model=MODEL, prompt="once upon", max_tokens=3, temperature=0, n=2,
                                           logprobs=2)
        assert [c.logprobs.tokens for c in scored.choices] == [scored.choices[0].logprobs.tokens] * 2
        assert all(len(c.logprobs.token_logprobs) == 3 for c in scored.choices)


# -- bad input and access -------------------------------------------------------------------------------


def call(connection, method: str, path: str, body=None, headers=None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    return response.status, dict(response.getheaders()), json.loads(response.read())


def test_bad_requests_get_openai_errors_and_the_server_stays_up(loaded):
    model, tokenizer = loaded
    chat = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    chat_cases = [  # (body, status, param, code)
        (b"{not json", 400, None, "invalid_json"),
        (b"[1, 2]", 400, None, "invalid_json"),
        (b"\xff\xfe{}", 400, None, "invalid_json"),
        (b"[" * 100_000 + b"]" * 100_000, 400, None, "invalid_json"),   # nested past any request: no stack overflow
        (json.dumps(chat).replace('"max_tokens": 2', '"temperature": NaN').encode(), 400, None, "invalid_json"),
        ({"messages": HELLO}, 400, "model", "missing_parameter"),
        ({**chat, "model": "gpt-4o"}, 404, "model", "model_not_found"),
        ({"model": MODEL}, 400, "messages", "invalid_type"),
        ({**chat, "messages": []}, 400, "messages", "invalid_value"),
        ({**chat, "messages": "hello"}, 400, "messages", "invalid_type"),
        ({**chat, "messages": ["hello"]}, 400, "messages[0]", "invalid_type"),
        ({**chat, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "invalid_value"),
        ({**chat, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "invalid_type"),
        ({**chat, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         400, "messages[0].content", "invalid_value"),
        ({**chat, "messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages", "invalid_value"),
        ({**chat, "messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages",
         "context_length_exceeded"),
        ({**chat, "temperature": "hot"}, 400, "temperature", "invalid_type"),
        ({**chat, "temperature": 2.5}, 400, "temperature", "invalid_value"),
        ({**chat, "top_p": 0}, 400, "top_p", "invalid_value"),
        ({**chat, "top_k": -1}, 400, "top_k", "invalid_value"),
        ({**chat, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ({**chat, "max_tokens": True}, 400, "max_tokens", "invalid_type"),
        ({**chat, "max_completion_tokens": 1.5}, 400, "max_completion_tokens", "invalid_type"),
        ({**chat, "seed": "x"}, 400, "seed", "invalid_type"),
        ({**chat, "stream": "yes"}, 400, "stream", "invalid_type"),
        ({**chat, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
        ({**chat, "stop": 7}, 400, "stop", "invalid_value"),
        ({**chat, "n": 0}, 400, "n", "invalid_value"),
        ({**chat, "n": 17}, 400, "n", "invalid_value"),
        ({**chat, "logprobs": 3}, 400, "logprobs", "invalid_type"),
        ({**chat, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
        ({**chat, "logprobs": True, "top_logprobs": 2.5}, 400, "top_logprobs", "invalid_type"),
        ({**chat, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
        ({**chat, "logit_bias": [1]}, 400, "logit_bias", "invalid_type"),
        ({**chat, "logit_bias": {"x": 1}}, 400, "logit_bias", "invalid_value"),
        ({**chat, "logit_bias": {"-3": 1}}, 400, "logit_bias", "invalid_value"),
        ({**chat, "logit_bias": {"5": 101}}, 400, "logit_bias", "invalid_value"),
        ({**chat, "logit_bias": {"5": "up"}}, 400, "logit_bias", "invalid_value"),
        ({**chat, "logit_bias": {str(10 ** 9): 1}}, 400, "logit_bias", "invalid_value"),
        ({**chat, "logit_bias": {"5": 1}, "response_format": {"type": "json_object"}}, 400, "logit_bias",
         "invalid_value"),
        ({**chat, "presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter"),
        ({**chat, "tools": {"f": 1}}, 400, "tools", "invalid_type"),
        ({**chat, "tools": [{"type": "retrieval"}]}, 400, "tools[0]", "invalid_value"),
        ({**chat, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, 400, "tools[0].function.name",
         "invalid_value"),
        ({**chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, 400,
         "tools[0].function.parameters", "invalid_value"),
        ({**chat, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice", "invalid_value"),
        ({**chat, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"}, 400,
         "tool_choice", "invalid_value"),
        ({**chat, "tool_choice": "required"}, 400, "tool_choice", "invalid_value"),
        ({**chat, "functions": [{"name": "f"}]}, 400, "functions", "unsupported_parameter"),
        ({**chat, "messages": HELLO + [{"role": "tool", "content": "22 C"}]}, 400, "messages[1].tool_call_id",
         "missing_parameter"),
        ({**chat, "messages": HELLO + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}]}, 400,
         "messages[1].tool_calls[0]", "invalid_value"),
        ({**chat, "response_format": "json"}, 400, "response_format", "invalid_type"),
        ({**chat, "response_format": {"type": "xml"}}, 400, "response_format.type", "invalid_value"),
        ({**chat, "response_format": {"type": "json_schema"}}, 400, "response_format.json_schema",
         "missing_parameter"),
        ({**chat, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, 400,
         "response_format.json_schema.name", "invalid_value"),
        ({**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, 400,
         "response_format.json_schema.schema", "invalid_type"),
        ({**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}}, 400,
         "response_format.json_schema.strict", "invalid_type"),
        ({**chat, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "if": {}, "then": {}}}}}, 400, "response_format",
         "unsupported_schema"),
    ]
    text = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    text_cases = [
        ({**text, "prompt": 5}, 400, "prompt", "invalid_type"),
        ({**text, "prompt": ["one", "two"]}, 400, "prompt", "invalid_value"),
        ({**text, "prompt": [10 ** 6]}, 400, "prompt", "invalid_value"),
        ({**text, "echo": True}, 400, "echo", "unsupported_parameter"),
        ({**text, "logprobs": 21}, 400, "logprobs", "invalid_value"),
        ({**text, "logprobs": True}, 400, "logprobs", "invalid_type"),
    ]
    with running_server(model, tokenizer) as srv:
        connection = srv.connection()               # one keep-alive connection carries every case
        for path, cases in (("/v1/chat/completions", chat_cases), ("/v1/completions", text_cases)):
            for body, status, param, code in cases:
                got, _, document = call(connection, "POST", path, body)
                assert (got, document["error"]["param"], document["error"]["code"]) == (status, param, code), \
                    (body, document)
                assert set(document["error"]) == {"message", "type", "param", "code"}
                assert document["error"]["type"] == "invalid_request_error" and document["error"]["message"]
        status, _, document = call(connection, "GET", "/v1/chat/completions")
        assert status == 405 and document["error"]["code"] == "method_not_allowed"
        status, _, document = call(connection, "POST", "/v1/embeddings", {"input": "x"})
        assert status == 404 and "Invalid URL" in document["error"]["message"]
        status, _, document = call(connection, "GET", "/v1/models/gpt-4o")
        assert status == 404 and document["error"]["code"] == "model_not_found"
        # Unknown fields are ignored, as OpenAI does.
        status, _, document = call(connection, "POST", "/v1/chat/completions", {**chat, "future_field": {"x": 1}})
        assert status == 200 and document["choices"][0]["finish_reason"] == "length"

        # What client libraries never send: no Content-Length, a huge one, a garbled request line.
        bare = srv.connection()
        bare.putrequest("POST", "/v1/chat/completions")
        bare.endheaders()
        response = bare.getresponse()
        assert response.status == 411 and json.loads(response.read())["error"]["code"] == "length_required"
        status, headers, document = call(srv.connection(), "POST", "/v1/chat/completions", b"{}",
                                         {"Content-Length": str(1 << 30)})
        assert status == 413 and headers["Connection"] == "close"
        with socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT) as raw:
            raw.sendall(b"NONSENSE\r\n\r\n")
            answer = raw.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.") and b" 400 " in answer.split(b"\r\n")[0]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"]

        # The official client raises its own error classes for these.
        client = srv.client(max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-4o", messages=HELLO)
        with pytest.raises(openai.BadRequestError, match="maximum context length is 4096 tokens"):
            client.completions.create(model=MODEL, prompt="word " * 5000)
        assert client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).usage.completion_tokens == 2
        assert srv.engine.stats()["failed"] == 0


def test_the_api_key_is_required_and_verbose_logs_text(loaded):
    model, tokenizer = loaded
    with running_server(model, tokenizer, api_key="s3cret", verbose=True) as srv:
        with pytest.raises(openai.AuthenticationError) as refused:
            srv.client(api_key="wrong").models.list()
        assert refused.value.response.json()["error"]["code"] == "invalid_api_key"
        status, _, document = call(srv.connection(), "POST", "/v1/chat/completions",
                                   {"model": MODEL, "messages": HELLO})
        assert status == 401 and document["error"]["code"] == "invalid_api_key"
        assert call(srv.connection(), "GET", "/health")[0] == 200      # liveness checks need no key
        reply = srv.client(api_key="s3cret").chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
        assert reply.choices[0].message.content
    assert any("hello there" in line for line in srv.logs)
    assert any(json.dumps(reply.choices[0].message.content, ensure_ascii=False) in line for line in srv.logs)
    assert not any("s3cret" in line for line in srv.logs)


# -- the command ----------------------------------------------------------------------------------------


def test_help_teaches_with_examples(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = capsys.readouterr().out
    for expected in ("examples:", "curl http://127.0.0.1:8080/v1/chat/completions", "--api-key", "--queue",
                     "429", "SIGTERM"):
        assert expected in text


class ServeProcess:
    """`perfx serve` as a user starts it, on a free port; stderr read as it comes."""

    def __init__(self, tiny: str, *flags: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "perfx", "serve", "--model", tiny, "--port", "0", *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        listening = self.expect(r"on http://127\.0\.0\.1:(\d+)/v1", timeout=120)
        self.url = f"http://127.0.0.1:{listening[1]}/v1"

    def _read(self):
        for line in self.proc.stderr:
            self.stderr.append(line)
            self.lines.put(line)

    def expect(self, pattern: str, timeout: float = TIMEOUT) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{pattern!r} never came; stderr:\n{''.join(self.stderr)}") from None
            if match := re.search(pattern, line):
                return match

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT)


def test_sigterm_mid_stream_and_sigint_when_idle_stop_cleanly(tiny):
    server = ServeProcess(tiny)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=TIMEOUT, max_retries=0)
        stream = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4000, stream=True)
        chunks = iter(stream)
        next(chunks)
        next(chunks)
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in chunks:                        # the running request is stopped and told why
                pass
        assert server.proc.wait(TIMEOUT) == 0
        server.expect(r"perfx serve: stopped \(0 completed, 1 cancelled, 0 failed, 0 rejected\)")
        assert "Traceback" not in "".join(server.stderr)
    finally:
        server.close()

    server = ServeProcess(tiny)
    try:
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(TIMEOUT) == 0
        assert "Traceback" not in "".join(server.stderr)
    finally:
        server.close()


def test_an_address_in_use_is_one_clear_line(tiny, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--model", tiny, "--port", str(port)]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"perfx: error: cannot listen on 127.0.0.1:{port}: ")


# -- structured outputs (response_format) ---------------------------------------------------------------

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["cat", "dog", "fish"]}}}}


def json_schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": strict}}


def test_json_schema_replies_parse_and_validate_through_the_openai_client(loaded):
    """The tiny random model writes noise unconstrained; with response_format every reply, sampled at
    temperature 1 with varied seeds, streamed or not, parses and validates, and finishes "stop"."""
    jsonschema = pytest.importorskip("jsonschema")
    model, tokenizer = loaded
    with running_server(model, tokenizer) as srv:
        client = srv.client()
        free = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=30, seed=1)
        with pytest.raises(ValueError):
            json.loads(free.choices[0].message.content)
        for seed in range(4):
            reply = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=300, temperature=1.0,
                                                   seed=seed, response_format=json_schema_format(PERSON))
            assert reply.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
        pieces, finish = [], None
        for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=300, stream=True,
                                                    temperature=1.0, seed=9,
                                                    response_format=json_schema_format(PERSON, strict=False)):
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "stop"
        jsonschema.validate(json.loads("".join(pieces)), PERSON)
        mode = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=400, temperature=0,
                                              response_format={"type": "json_object"})
        assert isinstance(json.loads(mode.choices[0].message.content), dict)
        text = client.completions.create(model=MODEL, prompt="A person:", max_tokens=300, temperature=1.0, seed=2,
                                         extra_body={"response_format": json_schema_format(PERSON)})
        jsonschema.validate(json.loads(text.choices[0].text), PERSON)
        cut = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4,
                                             response_format=json_schema_format(PERSON))
        assert cut.choices[0].finish_reason == "length" and '{"name'.startswith(cut.choices[0].message.content)
        with pytest.raises(openai.BadRequestError, match=r'Unimplemented keys: \["if", "then"\]'):
            client.chat.completions.create(model=MODEL, messages=HELLO, response_format=json_schema_format(
                {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}))
        assert srv.engine.stats()["failed"] == 0


def test_the_openai_client_parses_a_pydantic_model_reply(loaded):
    """`client.chat.completions.parse(response_format=Model)`: the client turns a Pydantic model into a strict
    schema ($defs, $ref, anyOf with null, titles) and parses the reply back into the model."""
    pydantic = pytest.importorskip("pydantic")
    class Address(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=8)
        zip: Optional[int] = pydantic.Field(ge=0, le=99999)

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        role: Literal["admin", "user"]
        addresses: list[Address] = pydantic.Field(max_length=2)

    model, tokenizer = loaded
    with running_server(model, tokenizer) as srv:
        for seed in range(3):
            reply = srv.client().chat.completions.parse(model=MODEL, messages=HELLO, max_tokens=300,
                                                        temperature=1.0, seed=seed, response_format=Person)
            person = reply.choices[0].message.parsed
            assert isinstance(person, Person) and person.role in ("admin", "user") and len(person.addresses) <= 2


@pytest.mark.slow
def test_two_hundred_random_schemas_at_temperature_one_all_validate(loaded):
    """The issue's goal: 200 requests with varied JSON schemas at temperature 1, some streamed; every reply
    parses and validates, and finishes "stop"."""
    jsonschema = pytest.importorskip("jsonschema")
    model, tokenizer = loaded
    rng = np.random.default_rng(200)
    with running_server(model, tokenizer) as srv:
        client = srv.client()
        for i in range(200):
            schema = random_schema(rng, kind="object" if i % 2 else None)
            options = dict(model=MODEL, messages=HELLO, max_tokens=300, temperature=1.0, seed=i,
                           response_format=json_schema_format(schema))
            if i % 4 == 3:
                chunks = list(client.chat.completions.create(stream=True, **options))
                text = "".join(c.choices[0].delta.content or "" for c in chunks)
                finish = chunks[-1].choices[0].finish_reason
            else:
                reply = client.chat.completions.create(**options)
                text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
            assert finish == "stop", (schema, text)
            jsonschema.validate(json.loads(text), schema)
        assert srv.engine.stats()["completed"] >= 200


def test_warm_up_outlives_a_vocabulary_that_cannot_spell_json(loaded, monkeypatch):
    """The start-up's JSON-mode step is a warm-up only: a vocabulary that cannot spell JSON leaves the server
    running (its JSON requests get the error), it does not stop it."""
    pytest.importorskip("llguidance")
    from perfx.constrain import Constraint
    from perfx.errors import PerfxError
    from perfx.serve.engine import warm_up
    model, tokenizer = loaded

    def cannot(self):
        raise PerfxError("the grammar allows no token here (the tokenizer cannot spell what it needs)")
    monkeypatch.setattr(Constraint, "allowed", cannot)
    warm_up(model, tokenizer)
