"""Tool calls through a model's own chat template: the tools and earlier calls and results rendered, the model's
calls parsed back (whole or as they stream), and the grammar a forced call must match.

Each family's format is data in its family file (``perfx.families.family.ToolFormat``): how its templates take
the tools, and how its models write a call. A template is asked what it renders, as llama.cpp's chat code asks
(a probe tool, call and result rendered once): where it renders no tools, they are described in the system
message in the family's own words (``ChatRules.prompted_tools``) or, for a family without any, in a generic
format (``GENERIC_TOOLS``, as llama.cpp's server does): a reply that is one JSON object, a call or an answer.
Where it renders no calls or no tool results, they are written into the messages in the format's own text.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

from perfx.constrain import JSON_OPTIONS
from perfx.errors import PerfxError
from perfx.families import FAMILIES, family_of
from perfx.families.family import ToolFormat

# No family's own: the reply is one JSON object, {"tool_call": {"name", "arguments"}} (or "tool_calls": [...])
# or {"response": "..."}, as llama.cpp's generic format (common/chat.cpp) asks.
GENERIC_TOOLS = ToolFormat(
    name="generic", body="envelope",
    instructions=("You can call these tools, one JSON object a line:\n{tools}\n\n"
                  "Reply with one JSON object and nothing else. To call a tool: "
                  '{"tool_call": {"name": <the tool\'s name>, "arguments": <an object of its arguments>}}. '
                  'To answer without a tool: {"response": <your answer>}.'),
    results=('{"tool_response": ', "}"))

PROBE_NAME, PROBE_RESULT = "perfx_probe_function", "perfx_probe_result"
_PROBE_TOOL = {"type": "function", "function": {"name": PROBE_NAME, "description": "a probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
_PROBE_CALL = {"id": "call_probe", "type": "function", "function": {"name": PROBE_NAME, "arguments": {"a": 1}}}


FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")   # OpenAI's rule for a function's name


class ToolError(PerfxError):
    """A list of tools that is not OpenAI's form: ``param`` names the part, ``code`` OpenAI's error code."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


def check_tools(tools) -> list[dict]:
    """OpenAI's ``tools`` checked: a list of ``{"type": "function", "function": {"name", "description",
    "parameters"}}`` with distinct names, each ``parameters`` a JSON Schema of an object. Raises ToolError."""
    if not isinstance(tools, list):
        raise ToolError('\'tools\' must be a list of {"type": "function", "function": {...}}', "tools", "invalid_type")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ToolError(f'\'{where}\' must be {{"type": "function", "function": {{"name", "description", '
                            '"parameters"}}}} (function tools are the only kind)', where)
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ToolError(f"'{where}.function.name' must be 1 to 64 letters, digits, underscores or dashes, got "
                            f"{json.dumps(name)[:70]}", f"{where}.function.name")
        if name in names:
            raise ToolError(f"two tools are named {name!r}", f"{where}.function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and (not isinstance(parameters, dict)
                                       or parameters.get("type", "object") != "object"):
            raise ToolError(f"'{where}.function.parameters' must be a JSON Schema of an object",
                            f"{where}.function.parameters")
    return [{"type": "function", "function": tool["function"]} for tool in tools]


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: OpenAI's ``tool_calls`` entry (``arguments`` a JSON object, as text)."""

    name: str
    arguments: str
    id: str = ""

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolSupport:
    """What a chat template does with tools: the format its model writes calls in, and whether the template
    itself renders the tools, assistant messages' calls and tool results (else perfx writes them in)."""

    format: ToolFormat
    renders_tools: bool
    renders_calls: bool
    renders_results: bool


_SUPPORT: dict[tuple, ToolSupport] = {}


def tool_support(tokenizer, architecture: str | None = None) -> ToolSupport:
    """The tool format of ``tokenizer``'s chat template (probed once per template): a family's whose marker the
    template holds (the model's own family's first), else its family's prompted format, else the generic one."""
    template = tokenizer.chat_template or ""
    key = (template, architecture)
    if key not in _SUPPORT:
        own = family_of(architecture) if architecture else None
        families = ([own] if own else []) + [f for f in FAMILIES.values() if f is not own]
        found = next((fmt for family in families for fmt in family.chat.tool_formats
                      if fmt.marker and fmt.marker in template), None)
        if found is not None and _renders(tokenizer, found, tools=True):
            _SUPPORT[key] = ToolSupport(found, True, _renders(tokenizer, found, calls=True),
                                        _renders(tokenizer, found, results=True))
        else:
            prompted = (own.chat.prompted_tools if own else None) or GENERIC_TOOLS
            _SUPPORT[key] = ToolSupport(prompted, False, _renders(tokenizer, prompted, calls=True),
                                        _renders(tokenizer, prompted, results=True))
    return _SUPPORT[key]


def _renders(tokenizer, fmt: ToolFormat, tools=False, calls=False, results=False) -> bool:
    """Whether the template writes a probe tool (its name), a probe call (its name) or a probe result (its
    text) into the prompt, without refusing the conversation."""
    messages = [{"role": "user", "content": "x"}]
    if calls or results:
        messages.append({"role": "assistant", "content": "", "tool_calls": [_PROBE_CALL]})
    if results:
        messages.append({"role": "tool", "tool_call_id": "call_probe", "name": PROBE_NAME, "content": PROBE_RESULT})
    variables = _tools_variables(fmt, [_PROBE_TOOL], messages) if tools else {}
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **variables)
    except PerfxError:
        return False
    return (PROBE_RESULT if results else PROBE_NAME) in text


def _tools_variables(fmt: ToolFormat, tools: list[dict], messages: list[dict]) -> dict:
    """The template variables that carry ``tools``; a format that takes them in the system message's "tools"
    field (Phi-4-mini's) gets them there too, a system message added where there is none."""
    if fmt.tools_in_system:
        if not messages or messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": ""})
        messages[0] = {**messages[0], "tools": json.dumps([t["function"] for t in tools], ensure_ascii=False)}
    return {fmt.tools_variable: tools}


def render_messages(messages: list[dict], tools: list[dict] | None, support: ToolSupport) -> tuple[list, dict]:
    """OpenAI chat messages (assistant ``tool_calls``, ``role: "tool"`` results) and ``tools`` (OpenAI's
    ``[{"type": "function", "function": {...}}]``, or None) as the template takes them: (messages, the template
    variables to add). What the template does not render is written into the messages in the format's text."""
    fmt = support.format
    if fmt.body == "harmony":
        messages = _harmony_messages(messages)
        tools = [_described(t) for t in tools] if tools else tools
    out: list[dict] = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None) or []
        if message["role"] == "assistant" and calls:
            if support.renders_calls:
                message["tool_calls"] = [_template_call(call) for call in calls]
            else:
                text = call_text(fmt, [ToolCall(c["function"]["name"], _arguments_text(c)) for c in calls])
                message["content"] = (message.get("content") or "") + text
        if message["role"] == "tool" and not support.renders_results:
            result = fmt.results[0] + (message.get("content") or "") + fmt.results[1]
            if out and out[-1].get("from_tool"):   # one turn for the results of one step's calls
                out[-1]["content"] += "\n" + result
                continue
            message = {"role": "user", "content": result, "from_tool": True}
        message["content"] = message.get("content") or ""
        out.append(message)
    for message in out:
        message.pop("from_tool", None)
    variables: dict[str, Any] = {}
    if tools:
        if support.renders_tools:
            variables = _tools_variables(fmt, tools, out)
        else:
            described = fmt.instructions.replace(
                "{tools}", "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools))
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}".lstrip()}
            else:
                out.insert(0, {"role": "system", "content": described})
    return out, variables


def _harmony_messages(messages: list[dict]) -> list[dict]:
    """Messages as gpt-oss's template takes them: an assistant message's reasoning (``reasoning_content``, as
    perfx serve returns it) in its ``thinking`` field, and one call a message (the template renders only the
    first of a message's calls, and names each result after the call before it), each call's result right after
    it."""
    out: list[dict] = []
    results = {m.get("tool_call_id"): m for m in messages if m["role"] == "tool"}
    placed: set[int] = set()
    for message in messages:
        if message["role"] == "tool":
            if id(message) not in placed:
                out.append(message)
            continue
        message = dict(message)
        reasoning = message.pop("reasoning_content", None)
        calls = message.get("tool_calls") or []
        if message["role"] == "assistant" and (reasoning or calls):
            # with a call, the template takes the reasoning in content or thinking but not both
            text = "\n\n".join(t for t in (reasoning, message.get("content")) if t) if calls else reasoning
            if calls:
                message["content"] = ""
            if text:
                message["thinking"] = text
        if message["role"] != "assistant" or len(calls) < 2:
            out.append(message)
            continue
        for i, call in enumerate(calls):
            out.append({**message, "tool_calls": [call]} if i == 0 else
                       {"role": "assistant", "content": "", "tool_calls": [call]})
            result = results.get(call.get("id"))
            if result is not None and id(result) not in placed:
                placed.add(id(result))
                out.append(result)
    return out


def _described(tool: dict) -> dict:
    # gpt-oss's template writes "// " + description, which fails on a tool without one (OpenAI's is optional)
    function = tool["function"]
    return {**tool, "function": {**function, "description": function.get("description") or ""}}


def _template_call(call: dict) -> dict:
    # Templates write arguments with tojson (Llama's) or as they are when a string (Qwen's): an object serves both.
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {"id": call.get("id", ""), "type": "function",
            "function": {"name": call["function"]["name"], "arguments": arguments}}


def _arguments_text(call: dict) -> str:
    arguments = call["function"].get("arguments")
    return arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)


# -- a call as the model writes it ------------------------------------------------------------------------


def call_text(fmt: ToolFormat, calls: list[ToolCall]) -> str:
    """``calls`` written as a model of format ``fmt`` writes them."""
    if fmt.body == "harmony":
        return HARMONY_START.join(f"{CHANNEL}commentary to=functions.{c.name} {CONSTRAIN}json{MESSAGE}"
                                  f"{json.dumps(_json_object(c.arguments), ensure_ascii=False)}{CALL}" for c in calls)
    if fmt.body == "envelope":
        items = [{"name": c.name, "arguments": _json_object(c.arguments)} for c in calls]
        return json.dumps({"tool_call": items[0]} if len(items) == 1 else {"tool_calls": items}, ensure_ascii=False)
    if fmt.body == "pythonic":
        return fmt.opener + "[" + ", ".join(_pythonic_call(c) for c in calls) + "]" + fmt.closer
    objects = [json.dumps({"name": c.name, fmt.arguments_key: _json_object(c.arguments)}, ensure_ascii=False)
               for c in calls]
    if fmt.listed:
        return fmt.opener + fmt.separator + "[" + ", ".join(objects) + "]" + fmt.separator + fmt.closer
    if not fmt.opener:
        return "; ".join(objects)
    return "\n".join(fmt.opener + fmt.separator + o + fmt.separator + fmt.closer for o in objects)


def _json_object(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _pythonic_call(call: ToolCall) -> str:
    arguments = _json_object(call.arguments)
    pairs = arguments.items() if isinstance(arguments, dict) else ()
    return f"{call.name}(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in pairs) + ")"


# -- reading the model's calls back ------------------------------------------------------------------------


class ToolCallParser:
    """The model's reply, as text pieces arrive, split into content and calls (of the tools named ``names``).

    ``feed`` and ``finish`` return events, ``("content", text)`` or ``("call", ToolCall)``, in reply order:
    content is held back only while it may be the start of a call, a call is given whole once it has ended.
    Text that is not a well-formed call of a known tool stays content, exactly as the model wrote it.
    Whitespace around calls is no content.
    """

    def __init__(self, fmt: ToolFormat, names: Iterable[str]):
        self.fmt, self.names = fmt, set(names)
        self.openers = [o for o in (fmt.opener, *fmt.also_openers) if o]
        self.pending = ""           # text not yet given out
        self.opened = None          # the opener of the call being read (None outside one)
        self.bare = not fmt.opener  # at the start of a reply that may itself be a call (no opener: Llama 3.x's)
        self.blank = ""             # whitespace held until what follows says whether it is content
        self.calls = 0

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.pending += text
        return self._scan(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        """The events of what was held back, once the reply has ended."""
        events = self._scan(final=True)
        if self.bare:
            events += self._bare_end()
        elif self.opened is not None:   # a call the reply ended in, its closer never written
            calls = self._calls(self.pending)
            events += ([("call", c) for c in calls] if calls is not None
                       else self._content(self.opened + self.pending))
        self.pending, self.opened, self.bare = "", None, False
        if self.blank and not self.calls:
            events.append(("content", self.blank))
        self.blank = ""
        return events

    def _scan(self, final: bool) -> list:
        events = []
        while True:
            if self.bare:
                if final or self._may_be_bare(self.pending.lstrip()):
                    return events    # held whole: the end of the reply says whether it is a call
                self.bare = False
            if self.opened is not None:
                at = self.pending.find(self.fmt.closer) if self.fmt.closer else -1
                if at < 0:
                    return events    # held until its closer, or the end of the reply
                body, self.pending = self.pending[:at], self.pending[at + len(self.fmt.closer):]
                calls = self._calls(body)
                events += ([("call", c) for c in calls] if calls is not None
                           else self._content(self.opened + body + self.fmt.closer))
                self.opened = None
                continue
            found = [(self.pending.find(o), o) for o in self.openers if o in self.pending]
            if found:
                at, opener = min(found)
                events += self._content(self.pending[:at])
                self.pending, self.opened = self.pending[at + len(opener):], opener
                continue
            hold = 0 if final else max((_partial_suffix(self.pending, o) for o in self.openers), default=0)
            events += self._content(self.pending[:len(self.pending) - hold])
            self.pending = self.pending[len(self.pending) - hold:]
            return events

    def _content(self, text: str) -> list:
        # trailing whitespace is held: before a call it is no content, and it comes out the same however the
        # text was split
        kept = text.rstrip()
        if not kept:
            self.blank += text
            return []
        out, self.blank = self.blank + kept, text[len(kept):]
        return [("content", out)]

    def _may_be_bare(self, text: str) -> bool:
        """Whether ``text`` (the reply so far, stripped) may still be a bare call: an opener (Llama 3.1's
        <|python_tag|>), or a JSON object opened with a key a call starts with."""
        if any(text.startswith(o) or o.startswith(text) for o in self.fmt.also_openers):
            return True
        keys = ("tool_call", "tool_calls", "response") if self.fmt.body == "envelope" else ("name", "type")
        head = re.match(r'\{\s*(?:"(\w*)(")?)?', text)
        if head is None:
            return not text
        word, closed = head.group(1), head.group(2)
        if head.end() == len(text):
            return word is None or any(key.startswith(word) for key in keys)
        return bool(closed) and word in keys

    def _bare_end(self) -> list:
        text = self.pending
        body = text.strip()
        for opener in self.fmt.also_openers:
            if body.startswith(opener):
                body = body[len(opener):]
        if self.fmt.body == "envelope":
            return self._envelope(body, text)
        calls = self._json_calls(_json_values(body))
        if calls is None:
            return self._content(text)
        return [("call", c) for c in calls]

    def _envelope(self, body: str, text: str) -> list:
        values = _json_values(body)
        value = values[0] if values is not None and len(values) == 1 else None
        if isinstance(value, dict) and set(value) == {"response"} and isinstance(value["response"], str):
            return self._content(value["response"])
        if isinstance(value, dict) and len(value) == 1:
            items = value.get("tool_calls", [value["tool_call"]] if "tool_call" in value else None)
            calls = self._json_calls([items] if isinstance(items, list) else None)
            if calls is not None:
                return [("call", c) for c in calls]
        return self._content(text)

    def _calls(self, body: str) -> list[ToolCall] | None:
        """The calls between an opener and a closer, or None when they are not well-formed calls of known tools."""
        if self.fmt.body == "pythonic":
            calls = self._json_calls(_json_values(body.strip()))
            return calls if calls is not None else self._pythonic(body.strip())
        return self._json_calls(_json_values(body.strip()))

    def _json_calls(self, values: list | None) -> list[ToolCall] | None:
        if not values:
            return None
        items = [item for value in values for item in (value if isinstance(value, list) else [value])]
        calls = []
        for item in items:
            if not isinstance(item, dict) or item.get("name") not in self.names:
                return None
            arguments = item.get("arguments", item.get("parameters", {}))
            if isinstance(arguments, str):   # some models write the arguments as a JSON string
                arguments = _json_object(arguments)
            if not isinstance(arguments, dict):
                return None
            calls.append(self._call(item["name"], arguments))
        return calls or None

    def _pythonic(self, body: str) -> list[ToolCall] | None:
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, ValueError):
            return None
        items = tree.elts if isinstance(tree, ast.List) else [tree]
        calls = []
        for item in items:
            if (not isinstance(item, ast.Call) or not isinstance(item.func, ast.Name) or item.args
                    or item.func.id not in self.names):
                return None
            arguments = {}
            for keyword in item.keywords:
                if keyword.arg is None:
                    return None
                try:
                    arguments[keyword.arg] = _literal(keyword.value)
                except ValueError:
                    return None
            calls.append(self._call(item.func.id, arguments))
        return calls or None

    def _call(self, name: str, arguments: dict) -> ToolCall:
        self.calls += 1
        self.blank = ""
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False), new_call_id())


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.AST):
    """A Python literal, JSON's true, false and null taken too (models mix them into Python calls)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("a ** in a literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    value = ast.literal_eval(node)
    if isinstance(value, (set, bytes, complex)):
        raise ValueError("not a JSON value")
    return value


def _json_values(text: str) -> list | None:
    """The JSON values ``text`` holds one after another (separated by whitespace, commas or semicolons, as
    models write several calls), or None when it is anything else."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at == len(text):
            return values or None
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that starts ``marker`` (held back: the marker may be coming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# gpt-oss's harmony format: its markers are single special tokens of its vocabulary
START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
HARMONY_START = START + "assistant"
HARMONY_MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
_HEADER_STARTS = (START, CHANNEL, " to=")   # how a message's header (after <|start|>assistant) may begin
_HEADER_LIMIT = 256     # a header longer than this is no header: the text is content
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"(\w+)")


class HarmonyParser:
    """gpt-oss's reply, as text pieces arrive, read as harmony's messages: ``("reasoning", text)`` for the
    analysis channel, ``("content", text)`` for the final one (and commentary without a recipient, a preamble
    to the user), ``("call", ToolCall)`` for a commentary message to ``functions.NAME`` (one of ``names``) whose
    body is a JSON object. A message's header is held until its <|message|>, a call until it ends (<|call|>, or
    the end of the reply: <|call|> ends generation, so it is not in the text); reasoning and content stream as
    they come. A call of an unknown tool, arguments that are not a JSON object, text outside any message: content,
    exactly as the model wrote it (as llama.cpp's gpt-oss parser keeps what it cannot read)."""

    def __init__(self, names: Iterable[str]):
        self.names = set(names)
        self.pending = ""
        self.state = "header"       # "header" (before a message's <|message|>), "body" or "loose" (no message)
        self.kind = None            # the body's: "reasoning", "content" or "call"
        self.header = ""            # the call's header, written back as content if the call is no call
        self.name = None            # the call's function
        self.body = ""              # the call's body so far
        self.calls = 0

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.pending += text
        return self._scan(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        events = self._scan(final=True)
        if self.state == "body" and self.kind == "call":
            events += self._end_call("")
        elif self.state == "header" and self.pending.strip("\n"):
            events.append(("content", self.pending))
        self.pending, self.state = "", "header"
        return events

    def _scan(self, final: bool) -> list:
        events = []
        while self.pending:
            if self.state == "header":
                at = self.pending.find(MESSAGE)
                if at < 0:
                    if self._may_be_header(self.pending):
                        return events        # held until its <|message|> or the end of the reply
                    self.state = "loose"
                    continue
                events += self._open(self.pending[:at])
                self.pending = self.pending[at + len(MESSAGE):]
            elif self.state == "loose":
                at = self.pending.find(START, 1)
                if at < 0:
                    hold = 0 if final else _partial_suffix(self.pending, START)
                    events.append(("content", self.pending[:len(self.pending) - hold]))
                    self.pending = self.pending[len(self.pending) - hold:]
                    return [e for e in events if e[1]]
                events.append(("content", self.pending[:at]))
                self.pending, self.state = self.pending[at:], "header"
            else:
                found = [(self.pending.find(m), m) for m in (END, CALL, RETURN) if m in self.pending]
                if not found:
                    hold = 0 if final else max(_partial_suffix(self.pending, m) for m in (END, CALL, RETURN))
                    events += self._body(self.pending[:len(self.pending) - hold])
                    self.pending = self.pending[len(self.pending) - hold:]
                    return events
                at, marker = min(found)
                events += self._body(self.pending[:at])
                if self.kind == "call":
                    events += self._end_call(marker)
                self.pending, self.state = self.pending[at + len(marker):], "header"
        return events

    @staticmethod
    def _may_be_header(text: str) -> bool:
        # whitespace between messages is no content
        text = text.lstrip("\n")
        return len(text) <= _HEADER_LIMIT and any(text.startswith(s) or s.startswith(text) for s in _HEADER_STARTS)

    def _open(self, header: str) -> list:
        """A message's header read: its channel, and its recipient (a call) if any."""
        header = header.lstrip("\n")
        self.state, self.header = "body", header + MESSAGE
        recipient = _RECIPIENT.search(header.replace(CHANNEL, " " + CHANNEL).replace(CONSTRAIN, " " + CONSTRAIN))
        channel = _CHANNEL.search(header)
        if recipient is not None:
            self.kind, self.name, self.body = "call", recipient.group(1), ""
            return []
        if channel is None:     # no channel: no message of harmony's; its text is content
            self.kind = "content"
            return [("content", self.header)]
        self.kind = "reasoning" if channel.group(1) == "analysis" else "content"
        return []

    def _body(self, text: str) -> list:
        if not text:
            return []
        if self.kind == "call":
            self.body += text
            return []
        return [(self.kind, text)]

    def _end_call(self, marker: str) -> list:
        name = self.name[len("functions."):] if self.name.startswith("functions.") else None
        arguments = _json_values(self.body.strip())
        if (name in self.names and arguments is not None and len(arguments) == 1
                and isinstance(arguments[0], dict)):
            self.calls += 1
            return [("call", ToolCall(name, json.dumps(arguments[0], ensure_ascii=False), new_call_id()))]
        return [("content", self.header + self.body + marker)]


def reply_parser(fmt: ToolFormat, names: Iterable[str]):
    """The parser of a reply in ``fmt``: harmony's (which also splits reasoning from content), or the others'."""
    return HarmonyParser(names) if fmt.body == "harmony" else ToolCallParser(fmt, names)


# -- the grammar a forced call matches ---------------------------------------------------------------------


def call_grammar(fmt: ToolFormat, tools: list[dict], name: str | None = None, answer: bool = False,
                 special_ids: dict[str, int] | None = None, parallel: bool = True) -> str:
    """The grammar, in llguidance's Lark (JSON Schema inline as ``%json``), of a whole reply that is a call in
    ``fmt``, the format's own text around it included: one call of ``name``, or one or more calls of any of
    ``tools`` (OpenAI's ``tool_choice`` "required"; one only without ``parallel``, parallel_tool_calls false);
    with ``answer`` (the generic format under "auto"), an answer instead is allowed too. JSON is compact, as a
    response_format's (``perfx.constrain.JSON_OPTIONS``). Each call's arguments match its parameters' JSON
    Schema, so they always parse.
    ``special_ids``: the format's markers that are one special token of the vocabulary, by their id (a
    special token is not the text it spells; llguidance names it ``<[id]>``)."""
    special_ids = special_ids or {}
    several = name is None and parallel
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise PerfxError(f"no tool named {name!r} among the request's tools")

    def text(marker: str) -> str:
        return f"<[{special_ids[marker]}]>" if marker in special_ids else json.dumps(marker)

    def schema(function: dict, key: str) -> dict:
        return {"type": "object", "properties": {"name": {"const": function["name"]},
                                                 key: function.get("parameters") or {"type": "object"}},
                "required": ["name", key], "additionalProperties": False}

    def inline(value: dict) -> str:
        # compact JSON, as a response_format's: no run of whitespace a model could fill its whole budget with
        return "%json " + json.dumps({"x-guidance": JSON_OPTIONS, **value}, ensure_ascii=False)

    if fmt.body == "harmony":
        # one call a turn (<|call|> ends it), made at once: the analysis channel before it is free text that a
        # grammar could not bound, and a forced call must end
        lines = ["start: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
        lines += [f"call_{i}: {text(CHANNEL)} {json.dumps('commentary to=functions.' + f['name'] + ' ')} "
                  f"{text(CONSTRAIN)} \"json\" {text(MESSAGE)} {inline(f.get('parameters') or {'type': 'object'})}"
                  for i, f in enumerate(chosen)]
        return "\n".join(lines) + "\n"
    one = {"anyOf": [schema(f, "arguments" if fmt.body == "envelope" else fmt.arguments_key) for f in chosen]}
    if fmt.body == "envelope":
        calls = {"type": "object", "properties": {"tool_call": one}, "required": ["tool_call"],
                 "additionalProperties": False}
        reply = {"anyOf": [calls, {"type": "object", "properties": {"response": {"type": "string"}},
                                   "required": ["response"], "additionalProperties": False}]} if answer else calls
        return f"start: {inline(reply)}\n"
    opener, closer = text(fmt.opener) if fmt.opener else "", text(fmt.closer) if fmt.closer else ""
    separator = json.dumps(fmt.separator) if fmt.separator else ""
    if fmt.body == "pythonic":
        more = '(", " call)*' if several else ""
        lines = [f'start: {opener} "[" call {more} "]" {closer}',
                 "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))]
        lines += [f"call_{i}: {json.dumps(f['name'] + '(')} {_pythonic_arguments(f, inline)} \")\""
                  for i, f in enumerate(chosen)]
        return "\n".join(lines) + "\n"
    if fmt.listed:
        items = {"type": "array", "items": one, "minItems": 1, **({} if several else {"maxItems": 1})}
        return f"start: {opener} {separator} {inline(items)} {separator} {closer}\n"
    if not fmt.opener:
        return f"start: {inline(one)}\n"
    block = f"{opener} {separator} {inline(one)} {separator} {closer}"
    return f"start: block{' (WS block)*' if several else ''}\nblock: {block}\nWS: /[ \\t\\n]{{0,2}}/\n"


def harmony_answer_grammar(schema: dict, special_ids: dict[str, int] | None = None) -> str:
    """The grammar of a gpt-oss reply that is a JSON answer following ``schema`` (a response_format's): the answer
    in its final channel, opened as the model opens it (with no analysis before it: a grammar could not bound that
    free text, and the reply must end). Markers that are one special token are named by ``special_ids``."""
    special_ids = special_ids or {}

    def text(marker: str) -> str:
        return f"<[{special_ids[marker]}]>" if marker in special_ids else json.dumps(marker)

    return (f'start: {text(CHANNEL)} "final" {text(MESSAGE)} %json '
            f"{json.dumps({'x-guidance': JSON_OPTIONS, **schema}, ensure_ascii=False)}\n")


def _pythonic_arguments(function: dict, inline) -> str:
    """``name=value`` for each parameter, in the schema's order: the required ones always, each optional one
    or not, separated by ", " (a value is JSON: Python's own literals but for true, false and null, which the
    parser takes)."""
    parameters = function.get("parameters") or {}
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    items = [(json.dumps(key + "="), inline(value if isinstance(value, dict) else {}), key in required)
             for key, value in properties.items()]

    SEPARATOR = '", "'

    def from_(i: int, first: bool) -> str:
        # the arguments from the i-th on, none written yet when ``first``
        if i == len(items):
            return ""
        key, value, needed = items[i]
        here = f"{'' if first else SEPARATOR} {key} {value}"
        rest_after = from_(i + 1, False)
        if needed:
            return f"{here} {rest_after}"
        skipped = from_(i + 1, first)
        return f"(({here} {rest_after}) | ({skipped}))" if skipped.strip() else f"(({here} {rest_after}))?"

    return from_(0, True)
