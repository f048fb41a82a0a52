"""`perfx chat`: a streaming, multi-turn chat REPL on the KV cache.

The conversation continues on the cache: each turn renders the chat template for the whole conversation,
encodes it, and prefills only what the cache does not already hold (the longest common prefix of the new
ids and the ids in the cache is kept). On a terminal: a prompt with readline editing and history, a dim
stats line after each reply, Ctrl-C stopping a reply. With piped stdin: one turn per line, replies on
stdout, nothing else there, so scripts and tests can drive it. A reasoning model's reasoning in its own channel
(gpt-oss's analysis) is not the answer: on a terminal it is shown dim before it, piped it is left out.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from perfx.commands.options import (add_constraint_options, add_model_options, add_sampling_options,
                                    add_speculation_options, add_system_option, add_thinking_option,
                                    constraint_from_args, load_model_from_args, log, no_thinking_switch_note,
                                    sampling_config, speculator_from_args, system_prompt, thinking_kwargs)
from perfx.errors import PerfxError
from perfx.generate import Conversation, generate, system_prompt_end
from perfx.model import host_peak_bytes
from perfx.tools import ToolError, check_tools, render_messages, reply_parser, tool_support

HELP = """commands:
  /help           this list
  /reset          start a new conversation (the system prompt stays)
  /system TEXT    set the system prompt (it applies from the next turn); /system alone shows it
  /think [on|off] thinking before answering (Qwen3, SmolLM3); /think alone switches it
  /stats          device, model, context used, TTFT, prefill and decode speed, memory
  /save FILE      write the conversation as JSON
  /tool TEXT      the result of the model's oldest unanswered tool call (with --tools); the model goes on
                  once every call has its result
  /quit           leave (Ctrl-D or Ctrl-C at the prompt too)
Ctrl-C during a reply stops it; the partial reply stays in the conversation.
A line starting with // is sent as text with one / removed."""


def add_arguments(parser):
    """The options of `perfx chat`: model, sampling, speculation, --system, --no-think, a grammar for every
    reply."""
    add_model_options(parser)
    add_sampling_options(parser)
    add_speculation_options(parser)
    add_system_option(parser)
    add_thinking_option(parser)
    parser.add_argument("--tools", metavar="FILE",
                        help="a JSON file of tools the model may call, as OpenAI's API takes them: a list of "
                             '{"type": "function", "function": {"name", "description", "parameters"}} (or of the '
                             "functions alone); a call is shown, and /tool TEXT gives its result")
    add_constraint_options(parser, "every reply")


def main(args) -> int:
    """Run the chat REPL until /quit, Ctrl-D or Ctrl-C at the prompt (exit status 0).

    Raises PerfxError for bad option values or a model that cannot be loaded (the CLI prints it and exits 2).
    """
    if args.tools and (args.json_object or args.json_schema or args.grammar):
        given = "--json-object" if args.json_object else "--json-schema" if args.json_schema else "--grammar"
        raise PerfxError(f"--tools and {given} cannot be combined: {given} holds every reply to its grammar, which "
                         "leaves no room for a tool call. Give one or the other")
    sampling = sampling_config(args)
    interactive = sys.stdin.isatty()
    model, source = load_model_from_args(args, log=log)
    if source.tokenizer is None:
        raise PerfxError(f"{args.model} has no tokenizer: `perfx chat` needs one (synthetic models are for "
                         "`perfx bench`)")
    constraint = constraint_from_args(args, source.tokenizer)
    speculator = speculator_from_args(args, model, source.tokenizer, log=log)
    if speculator is not None:
        # the step costs measured now, before the first prompt, as serve's warm-up does: the first reply starts
        # at once, and a Ctrl-C during it stops the reply, not a measurement (the cache holds nothing yet)
        speculator.calibrate(model, 0)
    chat = Chat(model, source, sampling, args.max_tokens, system_prompt(args), interactive,
                think=not args.no_think, speculator=speculator, constraint=constraint,
                tools=read_tools(args.tools) if args.tools else None)
    if args.no_think and not source.tokenizer.has_thinking_switch:
        chat.note(no_thinking_switch_note(chat.model_name))
    return chat.loop()


def read_tools(path: str) -> list[dict]:
    """The tools of a --tools file: OpenAI's list of function tools, or of the functions alone."""
    try:
        tools = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as error:
        raise PerfxError(f"--tools {path}: cannot read it ({error.strerror or error})") from None
    except ValueError as error:
        raise PerfxError(f"--tools {path}: not JSON ({error})") from None
    if isinstance(tools, dict) and "tools" in tools:
        tools = tools["tools"]
    if isinstance(tools, list):
        tools = [{"type": "function", "function": t} if isinstance(t, dict) and "type" not in t else t for t in tools]
    try:
        return check_tools(tools)
    except ToolError as error:
        raise PerfxError(f"--tools {path}: {error}") from None


class Chat:
    """One conversation: the messages, the ids in the KV cache, and the stats of every reply."""

    think = True  # thinking before answering, where the template has the switch (/think, --no-think)

    def __init__(self, model, source, sampling, max_tokens: int, system: str | None, interactive: bool,
                 think: bool = True, speculator=None, constraint=None, tools: list[dict] | None = None):
        self.model, self.source, self.tokenizer = model, source, source.tokenizer
        self.speculator = speculator     # perfx.speculative.Speculator, or None: one token a step
        self.constraint = constraint     # perfx.constrain.Constraint every reply keeps to (a copy each), or None
        self.sampling, self.max_tokens, self.system = sampling, max_tokens, system
        self.think = think
        self.interactive = interactive
        self.colour = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        self.messages: list[dict] = []   # user and assistant turns; the system prompt is kept apart
        self.tools = tools               # OpenAI's function tools the model may call (--tools), or None
        if tools:
            self.support = tool_support(self.tokenizer, model.config.architecture)
        else:   # the replies are read without tools too where the template is harmony's (gpt-oss's channels)
            support = tool_support(self.tokenizer)
            self.support = support if support.format.body == "harmony" else None
        self.parser = None               # the reply's calls and reasoning, read as it streams
        self.shown: list = []            # ... and what it gave out so far: ("content", text), ("call", ToolCall),
                                         # ("reasoning", text)
        self.unanswered: list = []       # the last reply's calls that have no result yet (/tool)
        self.conversation = Conversation(model.resume_point)   # the ids the KV cache holds
        self.replies = []                # Stats of every reply this session (kept across /reset)
        described = source.describe()
        self.model_path = str(described.get("path", "?"))
        self.model_name = Path(self.model_path).name
        self.model_title = described.get("name") or self.model_name

    # -- the loop -----------------------------------------------------------------------------------

    def loop(self) -> int:
        if self.interactive:
            try:
                import readline  # noqa: F401  (importing it gives input() line editing and history)
            except ImportError:
                pass
            self.note(f"perfx chat: {self.model_name} on {self.model.device.caps.name}, context "
                      f"{self.model.max_positions} positions. /help for commands, Ctrl-D to leave.", dim=True)
        while True:
            try:
                line = input("> " if self.interactive else "")
            except EOFError:
                if self.interactive:
                    sys.stdout.write("\n")
                return 0
            except KeyboardInterrupt:
                sys.stdout.write("\n")
                return 0
            line = line.strip()
            try:
                if line.startswith("/") and not line.startswith("//"):
                    if self.command(line) == "quit":
                        return 0
                elif line:
                    self.turn(line[1:] if line.startswith("//") else line)
            except KeyboardInterrupt:
                # Ctrl-C in a command or in the bookkeeping after a reply: the conversation's ids are cut
                # back before the cache is written and set after, so they still describe it; the session
                # goes on.
                sys.stdout.write("\n")

    def note(self, text: str, dim: bool = False):
        """One line on stderr, so it never mixes into replies: notices, errors, the per-reply stats."""
        sys.stdout.flush()
        dim = dim and self.colour and sys.stderr.isatty()
        sys.stderr.write(f"\x1b[2m{text}\x1b[0m\n" if dim else text + "\n")
        sys.stderr.flush()

    # -- one turn -----------------------------------------------------------------------------------

    def render(self, messages: list[dict]) -> list[int]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        conversation, variables = system + messages, thinking_kwargs(self.tokenizer, self.think)
        if self.support is not None:
            conversation, tools = render_messages(conversation, self.tools, self.support)
            variables = {**tools, **variables}
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, **variables)
        return self.tokenizer.encode(text, add_bos=self.tokenizer.add_bos_token)

    def restore_at(self, ids: list[int]) -> list[int]:
        """The system prompt's end, where a model with recurrent state keeps a restore point: /reset and the
        dropping of old turns resume there."""
        if self.system is None or not self.model.keeps_restore_points:
            return []
        system = [{"role": "system", "content": self.system}]
        return [system_prompt_end(self.tokenizer, system, ids, **thinking_kwargs(self.tokenizer, self.think))]

    def fit(self, ids: list[int]) -> list[int] | None:
        """Drop the oldest turns until the prompt plus a reply fits the context; None if the new message
        alone does not fit. A context smaller than twice --max-tokens keeps half of itself for the reply."""
        ctx = self.model.max_positions
        reserve = min(self.max_tokens, ctx // 2)
        dropped = 0
        while len(ids) + reserve > ctx and len(self.messages) > 1:
            # A turn is a user message and the reply after it (a reply may be missing after an error).
            del self.messages[0]
            dropped += 1
            while len(self.messages) > 1 and self.messages[0]["role"] != "user":   # its reply, calls, results
                del self.messages[0]
            ids = self.render(self.messages)
        if dropped:
            self.note(f"perfx: context full ({ctx} positions): dropped the oldest {dropped} turn"
                      f"{'s' if dropped > 1 else ''} and re-prefilled the rest")
        if len(ids) >= ctx:
            return None
        return ids

    def turn(self, text: str):
        self.reply({"role": "user", "content": text})

    def reply(self, message: dict):
        """``message`` (the user's, or a tool's result) added to the conversation, and the model's reply to it."""
        self.messages.append(message)
        self.unanswered = []
        if self.support is not None:
            self.parser = self.support_parser()
        try:
            ids = self.fit(self.render(self.messages))
            if ids is None:
                self.messages.pop()
                self.note(f"perfx: error: this message does not fit the context of "
                          f"{self.model.max_positions} positions with the system prompt: shorten it "
                          "or raise --ctx")
                return
            start, todo = self.conversation.resume(ids)
            result = generate(self.model, self.tokenizer, todo, self.max_tokens, self.sampling,
                              start_pos=start, on_text=self.stream, history=ids[:start],
                              speculator=self.speculator, restore_at=self.restore_at(ids),
                              constraint=self.constraint.copy() if self.constraint is not None else None)
        except KeyboardInterrupt:
            # Outside generate's own handling (template, encoding): the turn did not happen.
            self.messages.pop()
            sys.stdout.write("\n")
            self.note("perfx: interrupted")
            return
        except PerfxError as error:
            self.messages.pop()
            sys.stdout.write("\n")
            self.note(f"perfx: error: {error}")
            return
        self.conversation.record(ids, result)
        if self.parser is not None:
            # the calls stored as OpenAI's tool_calls, which the template renders back in its own form
            self.show(self.parser.finish())
            self.unanswered = [value for kind, value in self.shown if kind == "call"]
            content = "".join(value for kind, value in self.shown if kind == "content")
            reasoning = "".join(value for kind, value in self.shown if kind == "reasoning")
            self.messages.append({"role": "assistant", "content": content,
                                  **({"reasoning_content": reasoning} if reasoning else {}),
                                  **({"tool_calls": [c.as_openai() for c in self.unanswered]} if self.unanswered
                                     else {})})
        else:
            # Stored exactly as generated (a partial reply too): the template closes the turn next time.
            self.messages.append({"role": "assistant", "content": result.text})
        self.replies.append(result.stats)
        sys.stdout.write("\n" if self.interactive else "\n\n")
        sys.stdout.flush()
        reason = result.stats.stop_reason
        self.note(result.stats.line() + ("" if reason in ("eos", "grammar complete", "") else f", stopped: {reason}"),
                  dim=True)
        if self.unanswered:
            self.note(f"perfx: the model called {', '.join(c.name for c in self.unanswered)}: give "
                      f"{'each result' if len(self.unanswered) > 1 else 'its result'} with /tool TEXT")

    def support_parser(self):
        self.shown = []      # the reply's events so far: its content and its calls
        return reply_parser(self.support.format, [t["function"]["name"] for t in self.tools or []])

    def stream(self, piece: str):
        if self.parser is not None:
            return self.show(self.parser.feed(piece))
        sys.stdout.write(piece)
        sys.stdout.flush()

    def show(self, events: list):
        """A reply's content as it comes, and each call the model makes, on a line of its own; reasoning dim on a
        terminal, ended by a line break before the answer, and left out of piped output."""
        for kind, value in events:
            # a call goes on a line of its own after what was written (reasoning is written on a terminal only)
            after = "\n" if any(k != "reasoning" or self.colour for k, _ in self.shown) else ""
            if kind == "reasoning":
                if self.colour:
                    sys.stdout.write(f"\x1b[2m{value}\x1b[0m")
            elif kind == "content" and self.shown and self.shown[-1][0] == "reasoning" and self.colour:
                sys.stdout.write("\n")
            self.shown.append((kind, value))
            if kind == "content":
                sys.stdout.write(value)
            elif kind == "call":
                sys.stdout.write(f"{after}[tool call {value.name}({value.arguments})]")
        sys.stdout.flush()

    def answer_call(self, text: str):
        """/tool TEXT: the result of the oldest unanswered call; the model replies once all have theirs."""
        if not self.unanswered:
            self.note("perfx: error: no tool call waits for a result" + ("" if self.tools else
                                                                        " (give tools with --tools FILE)"))
            return
        call = self.unanswered.pop(0)
        result = {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": text}
        if not self.unanswered:
            return self.reply(result)
        self.messages.append(result)
        waiting = len(self.unanswered)
        print(f"result of {call.name} kept; {waiting} more call{'s' if waiting > 1 else ''} to answer")

    # -- commands -----------------------------------------------------------------------------------

    def command(self, line: str) -> str | None:
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/quit", "/exit"):
            return "quit"
        if name == "/help":
            print(HELP)
        elif name == "/reset":
            self.messages.clear()
            self.unanswered = []
            # The system prompt's ids stay in the cache for the next turn; the rest is forgotten.
            self.conversation.keep_prefix(self.render([]))
            print("new conversation")
        elif name == "/system":
            if rest:
                self.system = rest
                print("system prompt set; it applies from the next turn")
            else:
                print(f"system prompt: {self.system}" if self.system is not None
                      else "no system prompt of our own (the model's chat template decides)")
        elif name == "/think":
            self.switch_thinking(rest)
        elif name == "/stats":
            print(self.stats_text())
        elif name == "/tool":
            self.answer_call(rest)
        elif name == "/save":
            if not rest:
                self.note("perfx: error: /save needs a file name: /save FILE")
            else:
                self.save(Path(rest).expanduser())
        else:
            self.note(f"perfx: unknown command {name}; /help lists the commands")
        sys.stdout.flush()
        return None

    def switch_thinking(self, rest: str):
        if rest not in ("", "on", "off"):
            self.note("perfx: error: /think takes on or off: /think on, /think off, or /think to switch")
            return
        if not self.tokenizer.has_thinking_switch:
            self.note(no_thinking_switch_note(self.model_name))
            return
        self.think = not self.think if not rest else rest == "on"
        print(f"thinking {'on' if self.think else 'off'}; it applies from the next turn")

    def stats_text(self) -> str:
        caps, report, replies = self.model.device.caps, self.model.load_report, self.replies
        mib = 2 ** 20
        rows = [("device", f"{caps.name} ({caps.platform})"),
                ("model", f"{self.model_title} ({self.model_path})"),
                ("context", f"{len(self.conversation.cached)} / {self.model.max_positions} positions used, "
                            f"{len(self.messages)} messages")]
        if replies:
            last = replies[-1]
            prompt_tokens = sum(s.prompt_tokens for s in replies)
            prefill_s = sum(s.prefill_s for s in replies)
            steps = sum(max(s.generated_tokens - 1, 0) for s in replies)
            decode_s = sum(s.decode_s for s in replies if s.generated_tokens > 1)
            mean_decode = steps / decode_s if decode_s else 0.0
            rows += [
                ("replies", f"{len(replies)}, {sum(s.generated_tokens for s in replies)} tokens"),
                ("TTFT", f"last {1e3 * last.ttft_s:.0f} ms, mean "
                         f"{1e3 * sum(s.ttft_s for s in replies) / len(replies):.0f} ms"),
                ("prefill", f"last {last.prefill_tok_s:.1f} tok/s ({last.prompt_tokens} tokens), mean "
                            f"{prompt_tokens / prefill_s if prefill_s else 0.0:.1f} tok/s"),
                ("decode", f"last {last.decode_tok_s:.1f} tok/s, mean {mean_decode:.1f} tok/s"),
                ("bandwidth", f"last {last.decode_gb_s:.2f} GB/s, mean "
                              f"{self.model.weight_bytes * mean_decode / 1e9:.2f} GB/s "
                              f"({self.model.weight_bytes / mib:.0f} MiB read per token)"),
            ]
            drafted = sum(s.drafted for s in replies)
            if self.speculator is not None:
                accepted = sum(s.accepted for s in replies)
                steps = sum(s.verify_steps for s in replies)
                ratios = self.speculator.costs.ratios()
                rows.append(("speculate", f"{self.speculator.mode} ({self.speculator.drafter}): last "
                                          f"{last.speculation_line() or 'nothing drafted'}; all replies "
                                          f"{accepted}/{drafted} drafted accepted"
                                          f"{f' ({100 * accepted / drafted:.0f}%)' if drafted else ''}, draft "
                                          f"length {drafted / steps if steps else 0:.1f}"))
                if ratios:
                    rows.append(("step cost", "M tokens / one: "
                                 + ", ".join(f"{m}: {r:.2f}" for m, r in ratios.items())))
        else:
            rows.append(("replies", "none yet"))
        rows.append(("memory", f"{report.get('device_bytes', 0) / mib:.0f} MiB on the device (weights "
                               f"{report.get('weight_bytes', 0) / mib:.0f} MiB, KV cache {report.get('kv', 'f16')} "
                               f"{report.get('kv_cache_bytes', 0) / mib:.0f} MiB), host peak "
                               f"{host_peak_bytes() / mib:.0f} MiB"))
        return "\n".join(f"  {key:10} {value}" for key, value in rows)

    def save(self, path: Path):
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        document = {
            "model": self.model_path, "system": self.system, "messages": system + self.messages,
            "sampling": vars(self.sampling), "max_tokens": self.max_tokens,
            "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stats": [s.as_dict() for s in self.replies],
        }
        try:
            path.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        except OSError as error:
            self.note(f"perfx: error: could not write {path}: {error.strerror or error}")
            return
        print(f"saved {len(self.messages)} messages to {path}")
