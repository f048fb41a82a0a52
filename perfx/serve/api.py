"""OpenAI's API as `perfx serve` speaks it: requests checked into what perfx runs, answers shaped as OpenAI's.

Pure functions of JSON documents (and the tokenizer, for prompts): no threads, no sockets, no model.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from perfx import constrain
from perfx.errors import PerfxError
from perfx.tools import (HARMONY_MARKERS, ToolCall, ToolError, ToolSupport, call_grammar, check_tools,
                         harmony_answer_grammar, render_messages, reply_parser, tool_support)

MAX_STOP_STRINGS = 4        # OpenAI's limit
MAX_CHOICES = 16            # n: choices of one request
MAX_LOGPROBS = 20           # alternatives per token: OpenAI's limit for chat (perfx allows it for completions too)
REASONING_EFFORTS = ("low", "medium", "high")    # what gpt-oss's template takes
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# perfx's stop reasons (generate.Stats.stop_reason) as OpenAI's finish_reason.
FINISH_REASONS = {"eos": "stop", "stop string": "stop", "grammar complete": "stop", "max tokens": "length",
                  "context full": "length"}
# Sampling fields a request may set: OpenAI's, then perfx's own under the names llama.cpp's and vLLM's servers
# give them. The names are SamplingConfig's; each range lies within what SamplingConfig accepts.
SAMPLING = {  # name: (integer?, allowed, rule)
    "temperature": (False, lambda v: 0 <= v <= 2, "between 0 and 2"),
    "top_p": (False, lambda v: 0 < v <= 1, "in (0, 1]"),
    "seed": (True, lambda v: -2 ** 63 <= v < 2 ** 64, "a 64-bit integer"),
    "top_k": (True, lambda v: v >= 0, "≥ 0 (0 is off)"),
    "min_p": (False, lambda v: 0 <= v < 1, "in [0, 1)"),
    "repetition_penalty": (False, lambda v: 0 < v <= 10, "in (0, 10]"),
}


class APIError(Exception):
    """An error answered as OpenAI answers it: an HTTP status and {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def shutting_down() -> APIError:
    return APIError(503, "perfx serve is shutting down; retry against a running server", code="shutting_down",
                    kind="server_error")


def unsupported(name: str, why: str) -> APIError:
    return APIError(400, f"'{name}' is not supported by perfx serve: {why}", param=name, code="unsupported_parameter")


# -- requests -------------------------------------------------------------------------------------------


def parse_json(raw: bytes | None) -> dict:
    """A request body as a JSON object; NaN and Infinity, which Python's json would take, are refused."""
    if raw is None:
        raise APIError(411, "a JSON body with a Content-Length is required", code="length_required")

    def refuse_constant(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=refuse_constant)
    except ValueError as error:  # UnicodeDecodeError included
        raise APIError(400, f"the body is not valid JSON: {error}", code="invalid_json") from None
    except RecursionError:
        body = None
    if body is None or nesting_depth(body) > MAX_JSON_DEPTH:
        raise APIError(400, f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep; no request of this "
                       "API needs that", code="invalid_json")
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return body


# Deeper than any chat request (messages → content parts → fields) needs; the code that reads a body walks it
# recursively, so a deeper one is refused before it can exhaust Python's stack.
MAX_JSON_DEPTH = 32


def nesting_depth(value) -> int:
    """How deeply lists and objects nest in a parsed JSON value (walked without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, depth)
            if depth > MAX_JSON_DEPTH:
                break
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def value_of(body: dict, name: str, kinds: tuple, what: str):
    """body[name] when it is of one of ``kinds`` (JSON booleans are not numbers), None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise APIError(400, f"'{name}' must be {what}, got {json.dumps(value)[:60]}", param=name,
                       code="invalid_type")
    return value


def number(body: dict, name: str, allowed, rule: str, whole: bool = False):
    """body[name] checked against ``allowed``; None when absent or null."""
    value = value_of(body, name, (int,) if whole else (int, float), "an integer" if whole else "a number")
    if value is not None and not allowed(value):
        raise APIError(400, f"'{name}' must be {rule}, got {value}", param=name, code="invalid_value")
    return value


@dataclass
class Request:
    """What chat and text completions share, checked."""
    sampling: dict              # the SamplingConfig fields this request sets; the server's defaults fill the rest
    max_tokens: int | None      # None: the server's default
    stop: list[str]
    stream: bool
    include_usage: bool
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1                  # choices of the one prompt, decoded together where the engine batches

    def choice_sampling(self, index: int, default_seed: int | None) -> dict:
        """The sampling of choice ``index``: its own seed stream (the seed, the request's or the server's, plus
        the index), so that choices differ where they sample; a fresh random one each where neither sets a seed."""
        seed = self.sampling.get("seed", default_seed)
        if index == 0 or seed is None:
            return self.sampling
        return {**self.sampling, "seed": (seed + index) % 2 ** 64}


def common_parameters(body: dict, model_id: str) -> Request:
    """Model, sampling, max_tokens, stop and streaming; refusals of what perfx cannot do. Unknown fields are
    ignored, as OpenAI does."""
    model = value_of(body, "model", (str,), "a string")
    if model is None:
        raise APIError(400, "'model' is required (GET /v1/models lists it)", param="model", code="missing_parameter")
    if model != model_id:
        raise APIError(404, f"The model '{model}' does not exist here: this server runs '{model_id}'",
                       param="model", code="model_not_found")
    n = number(body, "n", lambda v: 1 <= v <= MAX_CHOICES, f"between 1 and {MAX_CHOICES}", whole=True) or 1
    for name in ("frequency_penalty", "presence_penalty"):
        if number(body, name, lambda v: -2 <= v <= 2, "between -2 and 2"):
            raise unsupported(name, "use 'repetition_penalty' (perfx's multiplicative penalty; 1.0 is off)")
    sampling = {}
    for name, (whole, allowed, rule) in SAMPLING.items():
        value = number(body, name, allowed, rule, whole)
        if value is not None:
            sampling[name] = value
    if "seed" in sampling:
        sampling["seed"] %= 2 ** 64  # numpy's generator takes non-negative seeds only
    max_tokens = number(body, "max_completion_tokens", lambda v: v >= 1, "at least 1", whole=True)
    if max_tokens is None:
        max_tokens = number(body, "max_tokens", lambda v: v >= 1, "at least 1", whole=True)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    elif stop is None:
        stop = []
    elif (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
          or not all(isinstance(s, str) for s in stop)):
        raise APIError(400, f"'stop' must be a string or a list of up to {MAX_STOP_STRINGS} strings", param="stop",
                       code="invalid_value")
    stream_options = value_of(body, "stream_options", (dict,), "an object") or {}
    return Request(sampling, max_tokens, stop, stream=bool(value_of(body, "stream", (bool,), "a boolean")),
                   include_usage=bool(value_of(stream_options, "include_usage", (bool,), "a boolean")),
                   logit_bias=logit_bias_of(body), n=n)


def logit_bias_of(body: dict) -> dict[int, float]:
    """OpenAI's logit_bias, {"token id": bias in [-100, 100]}, as {id: bias} (ids are checked against the
    vocabulary by the engine)."""
    biases = value_of(body, "logit_bias", (dict,), 'an object of {"token id": bias}') or {}
    checked = {}
    for key, bias in biases.items():
        if not key.isdigit():
            raise APIError(400, f"'logit_bias' keys must be token ids (non-negative integers), got {key[:40]!r}",
                           param="logit_bias", code="invalid_value")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise APIError(400, f"'logit_bias' values must be numbers between -100 and 100, got "
                                f"{json.dumps(bias)[:40]} for token {key}", param="logit_bias", code="invalid_value")
        checked[int(key)] = float(bias)
    return checked


def requested_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each reply token's log-probability comes with; None when none are asked for.
    Chat: ``logprobs: true`` and ``top_logprobs: k``; text completions: ``logprobs: k``."""
    if chat:
        top = number(body, "top_logprobs", lambda v: 0 <= v <= MAX_LOGPROBS, f"between 0 and {MAX_LOGPROBS}",
                     whole=True)
        if not value_of(body, "logprobs", (bool,), "a boolean"):
            if top is not None:
                raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs",
                               code="invalid_value")
            return None
        return top or 0
    return number(body, "logprobs", lambda v: 0 <= v <= MAX_LOGPROBS, f"between 0 and {MAX_LOGPROBS}", whole=True)


@dataclass
class Tooling:
    """A chat request's tools: what the template renders, how the reply is read, what it must match (for gpt-oss,
    with no tools too: how its harmony reply is read)."""
    tools: list[dict]           # OpenAI's [{"type": "function", "function": {name, description, parameters}}]
    choice: str = "auto"        # "auto", "required" or "function" (the one named by ``name``)
    name: str | None = None
    parallel: bool = True       # parallel_tool_calls: false keeps the first call only
    support: ToolSupport | None = None  # the template's format and what it renders
    grammar: str | None = None  # what the whole reply must match, in llguidance's Lark: a forced call (required,
                                # or a named function), or the generic format's call or answer under "auto"

    def parser(self):
        return reply_parser(self.support.format, [t["function"]["name"] for t in self.tools])

    def read(self, text: str) -> tuple[str | None, list[ToolCall], str | None]:
        """A whole reply as (content, calls, reasoning: None but in a format with a reasoning channel)."""
        parser = self.parser()
        events = parser.feed(text) + parser.finish()
        content = "".join(value for kind, value in events if kind == "content")
        calls = [value for kind, value in events if kind == "call"]
        reasoning = "".join(value for kind, value in events if kind == "reasoning") or None
        return (content or None) if calls else content, calls if self.parallel else calls[:1], reasoning


def chat_prompt(body: dict, tokenizer, architecture: str | None = None
                ) -> tuple[list[int], list[dict], dict, Tooling | None]:
    """The prompt ids of a chat request, through the model's chat template; the messages and the template
    variables it rendered them with; the request's tools (None without, but for a harmony template, whose replies
    are always read for their channels: then a Tooling of no tools, with a JSON response_format's grammar)."""
    if body.get("functions") or body.get("function_call"):
        raise unsupported("functions", "use 'tools' and 'tool_choice' (the API's current names)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages",
                       code="invalid_value" if isinstance(messages, list) else "invalid_type")
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"'{where}' must be an object with 'role' and 'content'", param=where,
                           code="invalid_type")
        role = message.get("role")
        if role not in ROLES:
            raise APIError(400, f"'{where}.role' must be one of {', '.join(ROLES)}, got {json.dumps(role)[:40]}",
                           param=f"{where}.role", code="invalid_value")
        entry = {"role": ROLES[role]}
        calls = tool_calls_of(message, where) if role == "assistant" else []
        entry["content"] = message_text(message.get("content"), "assistant" if calls else role, where)
        if calls:
            entry["tool_calls"] = calls
        reasoning = message.get("reasoning_content") if role == "assistant" else None
        if reasoning is not None and not isinstance(reasoning, str):
            raise APIError(400, f"'{where}.reasoning_content' must be a string (the reasoning perfx serve returned), "
                                f"got {json.dumps(reasoning)[:60]}", param=f"{where}.reasoning_content",
                           code="invalid_type")
        if reasoning:   # a reasoning model's earlier reasoning, as perfx serve returned it (templates may render it)
            entry["reasoning_content"] = reasoning
        if role == "tool":
            call_id = value_of(message, "tool_call_id", (str,), "a string")
            if call_id is None:
                raise APIError(400, f"'{where}.tool_call_id' is required: the id of the call this message answers",
                               param=f"{where}.tool_call_id", code="missing_parameter")
            entry["tool_call_id"] = call_id
            name = value_of(message, "name", (str,), "a string") or call_name(messages[:i], call_id)
            if name:
                entry["name"] = name
        checked.append(entry)
    tooling = tools_of(body)
    if tooling is not None and response_schema(body) is not None:
        raise APIError(400, "'response_format' (JSON) cannot be combined with 'tools': a reply keeps to one grammar, "
                            "and the schema's would rule out every call. Send tool_choice \"none\" for a JSON "
                            "answer, or drop 'response_format' to let the model call the tools",
                       param="response_format", code="invalid_value")
    kwargs = template_kwargs(body)
    effort = value_of(body, "reasoning_effort", (str,), "a string")
    if effort is not None:
        # OpenAI's reasoning_effort, as vLLM gives it to gpt-oss's template ("Reasoning: low" in its system message)
        if effort not in REASONING_EFFORTS:
            raise APIError(400, f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got "
                                f"{json.dumps(effort)[:40]}", param="reasoning_effort", code="invalid_value")
        kwargs = {"reasoning_effort": effort, **kwargs}
    support = tool_support(tokenizer, architecture)
    rendered, variables = render_messages(checked, tooling.tools if tooling else None, support)
    variables = {**variables, **kwargs}
    if tooling is not None:
        tooling.support = support
        plan(tooling, tokenizer)
    elif support.format.body == "harmony":
        # gpt-oss's reply is read as harmony's messages with or without tools: its reasoning apart from its answer
        tooling = Tooling([], choice="none", support=support)
        schema = response_schema(body)
        if isinstance(schema, dict):
            # the JSON answer in the final channel, where the model writes its answer (the engine still compiles
            # the schema alone first: what llguidance lacks is named as the response_format's)
            tooling.grammar = harmony_answer_grammar(schema, single_token_markers(tokenizer, HARMONY_MARKERS))
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, **variables)
        # As `perfx chat`: the model's own BOS setting (a template that writes the BOS text keeps one BOS).
        return tokenizer.encode(text, add_bos=tokenizer.add_bos_token), rendered, variables, tooling
    except PerfxError as error:  # a template that refuses the conversation, text that is not UTF-8
        raise APIError(400, str(error), param="messages", code="invalid_value") from None


def tool_calls_of(message: dict, where: str) -> list[dict]:
    """An assistant message's tool_calls, checked: [{"id", "type": "function", "function": {name, arguments}}]."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise APIError(400, f"'{where}.tool_calls' must be a list of calls", param=f"{where}.tool_calls",
                       code="invalid_type")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments", ""), str)):
            raise APIError(400, f"'{where}.tool_calls[{j}]' must be {{\"id\", \"type\": \"function\", \"function\": "
                                "{\"name\": string, \"arguments\": a JSON string}}", param=f"{where}.tool_calls[{j}]",
                           code="invalid_value")
    return calls


def call_name(messages: list, call_id: str) -> str | None:
    """The function an earlier assistant message's call ``call_id`` named (templates that write a result's name)."""
    for message in reversed(messages):
        for call in (message.get("tool_calls") or []) if isinstance(message, dict) else []:
            if isinstance(call, dict) and call.get("id") == call_id:
                return (call.get("function") or {}).get("name")
    return None


def tools_of(body: dict) -> Tooling | None:
    """`tools` and `tool_choice` checked; None without tools, or with tool_choice "none" (the template then
    renders no tools and the reply is read as text, as OpenAI's model then makes no call)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "'tool_choice' is only allowed when 'tools' are given", param="tool_choice",
                           code="invalid_value")
        return None
    try:
        tools = check_tools(tools)
    except ToolError as error:
        raise APIError(400, str(error), param=error.param, code=error.code) from None
    names = {t["function"]["name"] for t in tools}
    parallel = value_of(body, "parallel_tool_calls", (bool,), "a boolean")
    tooling = Tooling(tools, parallel=parallel is not False)
    if choice in (None, "auto", "required"):
        tooling.choice = choice or "auto"
    elif choice == "none":
        return None
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)):
        if choice["function"]["name"] not in names:
            raise APIError(400, f"'tool_choice' names {choice['function']['name']!r}, which is not among 'tools'",
                           param="tool_choice", code="invalid_value")
        tooling.choice, tooling.name = "function", choice["function"]["name"]
    else:
        raise APIError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice",
                       code="invalid_value")
    return tooling


def plan(tooling: Tooling, tokenizer):
    """The grammar of a reply under ``tooling``'s tool_choice, which the engine compiles into the reply's
    constraint. A forced call (required, a named function): the whole reply is a call, the format's opening
    included, its arguments by their parameters' schema. Under "auto", the generic format's reply is a call or
    an answer (as llama.cpp's server constrains it; unconstrained without llguidance, which a forced call needs);
    a family's format is left free (the model may answer in plain text), and its calls are read from what it
    writes."""
    fmt = tooling.support.format
    forced = tooling.choice in ("required", "function")
    if forced or (fmt.body == "envelope" and constrain.available()):
        # a marker that is one token of the vocabulary is named by its id: the model writes that token, which a
        # grammar engine may not take for the marker's text when it is special (Phi-4-mini's, Qwen's tags)
        markers = HARMONY_MARKERS if fmt.body == "harmony" else (fmt.opener, fmt.closer)
        single = single_token_markers(tokenizer, markers)
        tooling.grammar = call_grammar(fmt, tooling.tools, tooling.name, answer=not forced, special_ids=single,
                                       parallel=tooling.parallel)


def single_token_markers(tokenizer, markers) -> dict[str, int]:
    """Each of ``markers`` that is one token of the vocabulary, by its id."""
    return {marker: ids[0] for marker in markers if marker for ids in [tokenizer.encode(marker)] if len(ids) == 1}


def response_schema(body: dict) -> dict | bool | None:
    """The JSON schema a request's ``response_format`` asks the reply to follow: OpenAI's ``json_object`` is any
    JSON object, ``json_schema`` its ``json_schema.schema`` (absent: any JSON value); None for ``text`` or no
    format. Every schema is enforced, ``strict`` or not."""
    response_format = value_of(body, "response_format", (dict,), "an object")
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind != "json_schema":
        raise APIError(400, f"'response_format.type' must be text, json_object or json_schema, got "
                            f"{json.dumps(kind)[:40]}", param="response_format.type", code="invalid_value")
    spec = value_of(response_format, "json_schema", (dict,), "an object")
    if spec is None:
        raise APIError(400, "'response_format.json_schema' is required with type json_schema: "
                            "{\"name\": ..., \"schema\": {...}, \"strict\": true}",
                       param="response_format.json_schema", code="missing_parameter")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise APIError(400, "'response_format.json_schema.name' must be a non-empty string, as OpenAI requires",
                       param="response_format.json_schema.name", code="invalid_value")
    if not isinstance(spec.get("strict", False), bool) and spec.get("strict") is not None:
        raise APIError(400, "'response_format.json_schema.strict' must be a boolean",
                       param="response_format.json_schema.strict", code="invalid_type")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, "'response_format.json_schema.schema' must be a JSON schema (an object)",
                       param="response_format.json_schema.schema", code="invalid_type")
    return schema


def template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs`: more variables for the chat template, as vLLM's and llama.cpp's servers take them
    ({"enable_thinking": false} turns Qwen3's and SmolLM3's thinking off); the template is sandboxed."""
    kwargs = value_of(body, "chat_template_kwargs", (dict,), "an object") or {}
    for name in kwargs:
        if name in ("messages", "add_generation_prompt"):
            raise APIError(400, f"'chat_template_kwargs' may not set '{name}': the request's own fields give it",
                           param="chat_template_kwargs", code="invalid_value")
    return kwargs


def message_text(content, role: str, where: str) -> str:
    """A message's text: a string, or a list of text parts (OpenAI's content array)."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
        raise APIError(400, f"'{where}.content' may hold only text parts ({{\"type\": \"text\", \"text\": ...}}): "
                            "perfx serve runs text-only models", param=f"{where}.content", code="invalid_value")
    raise APIError(400, f"'{where}.content' must be a string or a list of text parts", param=f"{where}.content",
                   code="invalid_type")


def text_prompt(body: dict, tokenizer) -> list[int]:
    """The prompt ids of a text completion: a string, or token ids; one prompt per request."""
    if value_of(body, "echo", (bool,), "a boolean"):
        raise unsupported("echo", "the reply does not repeat the prompt")
    if body.get("suffix"):
        raise unsupported("suffix", "no fill-in-the-middle")
    if number(body, "best_of", lambda v: v >= 1, "at least 1", whole=True) not in (None, 1):
        raise unsupported("best_of", "no server-side choice among several (use 'n' and choose on the client)")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        try:
            ids = tokenizer.encode(prompt, add_bos=tokenizer.add_bos_token)
        except PerfxError as error:
            raise APIError(400, str(error), param="prompt", code="invalid_value") from None
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        if not all(0 <= t < tokenizer.vocab_size for t in prompt):
            raise APIError(400, f"'prompt' has token ids outside the vocabulary (0 to {tokenizer.vocab_size - 1})",
                           param="prompt", code="invalid_value")
        ids = list(prompt)
    else:
        raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                       param="prompt", code="invalid_type" if not isinstance(prompt, list) else "invalid_value")
    if not ids:
        raise APIError(400, "the prompt is empty and this model adds no BOS: give some text", param="prompt",
                       code="invalid_value")
    return ids


def check_fits(ids: list[int], ctx: int, param: str):
    if len(ids) >= ctx:
        raise APIError(400, f"This model's maximum context length is {ctx} tokens, and the prompt takes {len(ids)} "
                            "(the reply needs at least one more): shorten it, or restart perfx serve with a larger "
                            "--ctx", param=param, code="context_length_exceeded")


# -- answers --------------------------------------------------------------------------------------------


@dataclass
class Answer:
    """The JSON shapes of one response: a whole completion, its stream chunks, the usage chunk."""
    chat: bool
    model: str
    created: int
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    offset: int = 0     # a text completion's characters so far, for its logprobs' text_offset
    index: int = 0      # the choice being answered (n > 1)

    def logprobs(self, entries: list[dict] | None) -> dict | None:
        """OpenAI's logprobs of a choice (or a chunk's) from ``Engine.token_logprobs`` entries; None without."""
        if entries is None:
            return None
        if self.chat:
            return {"content": entries, "refusal": None}
        offsets = []
        for entry in entries:
            offsets.append(self.offset)
            self.offset += len(entry["token"])
        tops = []
        for entry in entries:
            top = {}
            for alternative in entry["top_logprobs"]:   # most likely first: two ids that spell alike keep the first
                top.setdefault(alternative["token"], alternative["logprob"])
            tops.append(top)
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": tops, "text_offset": offsets}

    def _envelope(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id, "object": kind, "created": self.created,
                "model": self.model}

    def whole(self, text: str | None, finish_reason: str, usage: dict, calls: list[ToolCall] = (),
              logprobs: list[dict] | None = None, reasoning: str | None = None) -> dict:
        message = {"role": "assistant", "content": text}
        if reasoning is not None:   # as llama.cpp's and vLLM's servers return a reasoning model's thinking
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        choice = {"index": self.index, "message": message} if self.chat else {"index": self.index, "text": text}
        return {**self._envelope(chunk=False),
                "choices": [{**choice, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}],
                "usage": usage}

    def chunk(self, delta, include_usage: bool, finish_reason: str | None = None,
              logprobs: list[dict] | None = None) -> dict:
        """A chat chunk's delta (dict) or a text completion's piece (str); ``logprobs``: the entries of the
        tokens it carries."""
        choice = {"index": self.index, "delta": delta} if self.chat else {"index": self.index, "text": delta}
        document = {**self._envelope(chunk=True),
                    "choices": [{**choice, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}]}
        if include_usage:
            document["usage"] = None  # as OpenAI: null on every chunk but the last
        return document

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._envelope(chunk=True), "choices": [], "usage": usage}
