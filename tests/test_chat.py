"""`perfx chat` driven as a user drives it: a pseudo-terminal of our own (typing, Ctrl-C, Ctrl-D) and piped
stdin, against a tiny random model (gibberish, but every path, quickly) and against the default model."""

import copy
import fcntl
import json
import os
import re
import select
import subprocess
import sys
import termios
import time
from pathlib import Path

import numpy as np
import pytest

from helpers.scripted_model import ScriptedModel
from helpers.tiny_models import write_endless_gguf
from perfx.commands.chat import Chat
from perfx.errors import PerfxError
from perfx.generate import PositionalState
from perfx.serve.api import APIError, chat_prompt
from perfx.tokenizer import Tokenizer

pytestmark = pytest.mark.one_implementation  # model-level: the default device only

DATA = Path(__file__).parent / "data"
NO_SWITCH_NOTE = "has no thinking switch (its chat template does not read enable_thinking); it answers as usual"

STATS_LINE = re.compile(r"(\d+) tokens, TTFT \d+ ms, prefill [\d.]+ tok/s, decode [\d.]+ tok/s "
                        r"\([\d.]+ GB/s\)"
                        r"(?:, (?:lookup|draft): \d+/\d+ drafted accepted \(\d+%\), draft length [\d.]+, gain [\d.]+x)?"
                        r"(, stopped: [a-z ]+)?(\x1b\[0m)?\n")
PROMPT = re.compile(r"^> \Z", re.M)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


CHAT = ["-m", "perfx", "chat"]


def chat_env() -> dict:
    # TERM=dumb: readline then writes no bracketed-paste or other escape codes around the prompt.
    return dict(os.environ, TERM="dumb", PYTHONUNBUFFERED="1", COLUMNS="200")


class Terminal:
    """A `perfx chat` process on a pseudo-terminal that is its controlling terminal (so \\x03 is SIGINT)."""

    def __init__(self, args: list[str], timeout: float = 30):
        master, slave = os.openpty()
        attrs = termios.tcgetattr(slave)
        attrs[3] |= termios.ISIG  # lflags: Ctrl-C sends SIGINT to the foreground process group
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        self.proc = subprocess.Popen(
            [sys.executable, *CHAT, *args], stdin=slave, stdout=slave, stderr=slave, env=chat_env(),
            start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(slave)
        self.fd, self.text, self.pos, self.timeout = master, "", 0, timeout

    def _read(self, deadline: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return False
        if not data:
            return False
        self.text += data.decode("utf-8", errors="replace").replace("\r\n", "\n")
        return True

    def expect(self, pattern, timeout: float | None = None) -> re.Match:
        """Wait for pattern in the output after the last match; the match's end becomes the new start."""
        pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            match = pattern.search(self.text, self.pos)
            if match:
                self.pos = match.end()
                return match
            if time.monotonic() >= deadline or (not self._read(deadline) and self.proc.poll() is not None):
                raise AssertionError(f"{pattern.pattern!r} did not appear; output since the last match:\n"
                                     f"{self.text[self.pos:][-3000:]!r}")

    def since(self, match_start: int) -> str:
        return self.text[match_start:self.pos]

    def send(self, text: str):
        os.write(self.fd, text.encode())

    def line(self, text: str):
        """Type a line at the prompt and press Enter."""
        self.send(text + "\r")

    def exit_status(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(min(deadline, time.monotonic() + 0.2))
        return self.proc.wait(timeout=1)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.fd)


def run_piped(args: list[str], stdin: str = "", timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *CHAT, *args], input=stdin, capture_output=True, text=True,
                          env=chat_env(), timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny random GGUF model with a 4096-position context whose end-of-turn ids have zero rows in the
    lm_head: their logit is 0 while hundreds of others are random, so greedy replies run until
    --max-tokens, long enough to interrupt, whatever the prompt."""
    return write_endless_gguf(tmp_path_factory.mktemp("chat"), "tiny", 4096)


def reply(term: Terminal) -> re.Match:
    """Wait for the end of a reply (its stats line) and the next prompt; returns the stats line match."""
    stats = term.expect(STATS_LINE)
    term.expect(PROMPT)
    return stats


# -- a tiny model on a terminal -----------------------------------------------------------------------


def test_terminal_session_turns_commands_overflow(tiny, tmp_path):
    # ctx 128 with replies of up to 16 tokens: the third or fourth turn has to drop the oldest ones.
    term = Terminal(["--model", tiny, "--ctx", "128", "--max-tokens", "16", "--seed", "1",
                     "--system", "Be kind."])
    try:
        term.expect(r"perfx: model .*tiny\.gguf .*on ")     # which device and model, before the prompt
        term.expect(r"perfx chat: .*context 128 positions")
        term.expect(PROMPT)
        term.line("hello there")
        term.expect("hello there\n")                       # readline echoes what was typed
        first = reply(term)
        assert "\x1b[2m" in term.text[first.start() - 10:first.start()]  # the stats line is dim
        term.line("how are you")
        reply(term)

        term.line("/stats")
        start = term.expect("/stats\n").end()
        term.expect(PROMPT)
        stats = term.since(start)
        for key in ("device", "model", "TTFT", "prefill", "decode", "bandwidth", "memory"):
            assert re.search(rf"^  {key} ", stats, re.M), stats
        used = int(re.search(r"context +(\d+) / 128 positions used, 4 messages", stats)[1])
        assert 0 < used < 128
        assert "replies    2," in stats

        term.line("/frobnicate")
        term.expect(r"perfx: unknown command /frobnicate; /help lists the commands\n")
        term.expect(PROMPT)
        term.line("/help")
        term.expect("/save FILE")
        term.expect(PROMPT)
        term.line("/system")
        term.expect("system prompt: Be kind.\n")
        term.expect(PROMPT)

        saved = tmp_path / "conversation.json"
        term.line(f"/save {saved}")
        term.expect(r"saved 4 messages to .*conversation\.json\n")
        term.expect(PROMPT)
        document = json.loads(saved.read_text())
        roles = [m["role"] for m in document["messages"]]
        assert roles == ["system", "user", "assistant", "user", "assistant"]
        assert document["messages"][0]["content"] == "Be kind."
        assert document["messages"][3]["content"] == "how are you"
        assert len(document["stats"]) == 2
        term.line(f"/save {tmp_path}/no/such/dir/c.json")
        term.expect(r"perfx: error: could not write .*c\.json: No such file or directory\n")
        term.expect(PROMPT)

        # Context overflow: more turns until the notice shows; each still gets a reply.
        for i in range(6):
            term.line(f"tell me more about the number {i}")
            stats = reply(term)
            if "context full" in term.text[:stats.start()]:
                break
        notice = re.search(r"perfx: context full \(128 positions\): dropped the oldest (\d+) turns? and "
                           r"re-prefilled the rest", term.text)
        assert notice, term.text[-2000:]
        term.line("/stats")
        term.expect(r"context +\d+ / 128 positions used")
        term.expect(PROMPT)

        term.line("/reset")
        term.expect("new conversation\n")
        term.expect(PROMPT)
        term.line("/stats")
        term.expect(r"0 messages")
        term.expect(PROMPT)
        term.line("hello again")
        reply(term)

        term.send("\x04")                                  # Ctrl-D at the prompt: a clean exit
        assert term.exit_status() == 0
        assert "Traceback" not in term.text
    finally:
        term.close()


def test_ctrl_c_stops_a_reply_and_the_session_goes_on(tiny):
    # Greedy replies of the tiny model never end before --max-tokens (see `tiny`): the reply is surely
    # still streaming when Ctrl-C arrives, and Ctrl-C never lands at the prompt by accident.
    term = Terminal(["--model", tiny, "--max-tokens", "3000", "--temperature", "0"])
    try:
        term.expect(PROMPT)
        term.line("tell me a long story")
        term.expect("tell me a long story\n")
        term.expect(r"(?s).{12}", timeout=60)             # the reply is streaming
        term.send("\x03")
        stats = reply(term)
        assert stats[2] == ", stopped: interrupted", stats[0]
        assert int(stats[1]) < 3000

        term.line("/stats")
        term.expect(r"context +(\d+) / 4096 positions used, 2 messages")  # the partial reply stays
        term.expect(PROMPT)
        term.line("and then?")
        term.expect("and then\\?\n")
        term.expect(r"(?s).{12}", timeout=60)
        term.send("\x03")
        reply(term)
        term.line("/stats")
        term.expect(r"4 messages")
        term.expect(PROMPT)

        # Ctrl-C at the prompt: a clean exit. A human pause first: a SIGINT landing in the microseconds
        # between readline printing the prompt and waiting for a key is only seen at the next key (CPython's
        # readline loop), which no person can hit but a test that answers the prompt at once can.
        time.sleep(0.5)
        term.send("\x03")
        assert term.exit_status() == 0
        assert "Traceback" not in term.text
    finally:
        term.close()


# -- the cache stays true to the conversation ----------------------------------------------------------


@pytest.mark.parametrize("kv", ["f16", "q8"])
def test_cache_matches_a_fresh_prefill_after_interrupt_overflow_and_reuse(tiny, device, kv):
    from perfx.commands.chat import Chat
    from perfx.generate import SamplingConfig
    from perfx.model import load_model

    model, source = load_model(tiny, device, ctx=160, progress=False, kv=kv)
    assert model.cache.form == kv
    chat = Chat(model, source, SamplingConfig(temperature=0), 40, "Be kind.", interactive=False)
    pieces = []

    def interrupt_at_the_fifth_piece(piece):
        pieces.append(piece)
        if len(pieces) == 5:
            raise KeyboardInterrupt

    chat.stream = interrupt_at_the_fifth_piece
    chat.turn("tell me a story")                   # interrupted: a partial reply, cache up to end_pos
    assert chat.replies[-1].stop_reason == "interrupted" and chat.messages[-1]["content"] == "".join(pieces)
    chat.stream = lambda piece: None
    chat.turn("and then?")                         # reuses the cache
    assert chat.replies[-1].prompt_tokens < len(chat.conversation.cached) - chat.replies[-1].generated_tokens
    for i in range(4):                             # until the oldest turns are dropped (ctx 160)
        chat.turn(f"more about {i}")
        if chat.messages[0]["content"] != "tell me a story":
            break
    assert chat.messages[0]["content"] != "tell me a story", "the context never overflowed"
    chat.max_tokens = 1                            # the next turn: prefill, sample one id, no decode step
    chat.turn("last question")
    via_cache = model.logits()
    ids = chat.render(chat.messages[:-1])
    assert ids[:len(chat.conversation.cached)] == chat.conversation.cached
    model.prefill(ids, 0)                          # the same conversation, prefilled from nothing
    fresh = model.logits()
    assert np.abs(via_cache - fresh).max() <= 1e-2 * np.abs(fresh).max()
    # A cache that is not the conversation's (a reply's ids left out) gives other logits: the check can fail.
    model.prefill(ids[:20] + ids[30:], 0)
    assert np.abs(model.logits() - fresh).max() > 1e-2 * np.abs(fresh).max()


WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city now",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_chat_shows_a_tool_call_and_takes_its_result(tiny, device, tmp_path, capsys):
    """--tools: a call the model makes is shown on its own line and kept as the reply's tool_calls; /tool gives
    its result, which the template renders back, and the model answers."""
    from perfx.commands.chat import read_tools
    from perfx.generate import SamplingConfig
    from perfx.model import load_model

    model, source = load_model(tiny, device, progress=False)
    tokenizer = copy.copy(source.tokenizer)
    tokenizer.chat_template = (DATA / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    scripted = ScriptedModel(model, tokenizer)
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([WEATHER_TOOL]))     # the functions alone, or OpenAI's {"type", "function"}
    chat = Chat(scripted, Source(tokenizer), SamplingConfig(temperature=0), 100, None, interactive=False,
                tools=read_tools(str(path)))
    scripted.say('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    chat.turn("Weather in Paris?")
    shown = capsys.readouterr()
    assert 'Checking.\n[tool call get_weather({"city": "Paris"})]' in shown.out
    assert "<tool_call>" not in shown.out and "give its result with /tool TEXT" in shown.err
    [call] = chat.messages[-1]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    scripted.say("It is 22 degrees.")
    chat.command("/tool 22 C, sunny")
    assert "It is 22 degrees." in capsys.readouterr().out
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "tool", "assistant"]
    prompt = tokenizer.decode(chat.render(chat.messages[:3]))
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
            and "<tool_response>\n22 C, sunny\n</tool_response>" in prompt)
    chat.command("/tool again")
    assert "no tool call waits for a result" in capsys.readouterr().err


def test_tools_files_are_checked(tiny, tmp_path):
    from perfx.commands.chat import read_tools

    path = tmp_path / "tools.json"
    for text, message in [("[", "not JSON"), ('[{"name": "two words"}]', "tools\\[0\\].function.name"),
                          ('{"f": 1}', "must be a list")]:
        path.write_text(text)
        with pytest.raises(PerfxError, match=message):
            read_tools(str(path))
    with pytest.raises(PerfxError, match="cannot read it"):
        read_tools(str(tmp_path / "missing.json"))
    path.write_text(json.dumps({"tools": [{"type": "function", "function": WEATHER_TOOL}]}))
    assert read_tools(str(path))[0]["function"]["name"] == "get_weather"
    run = run_piped(["--model", tiny, "--tools", str(path), "--max-tokens", "4", "--seed", "1"], "hello\n")
    assert run.returncode == 0 and len(STATS_LINE.findall(run.stderr)) == 1, run.stderr
    path.write_text("[1]")
    run = run_piped(["--model", tiny, "--tools", str(path)], "hello\n")
    assert run.returncode == 2 and "--tools" in run.stderr and "tools[0]" in run.stderr, run.stderr
    # a grammar for every reply leaves no room for a call: refused, before the model loads
    run = run_piped(["--model", tiny, "--tools", str(path), "--json-schema", str(path)], "hello\n")
    assert run.returncode == 2 and "--tools and --json-schema cannot be combined" in run.stderr, run.stderr


# -- piped stdin and errors ---------------------------------------------------------------------------


def test_piped_stdin_writes_only_replies(tiny, tmp_path):
    saved = tmp_path / "c.json"
    run = run_piped(["--model", tiny, "--max-tokens", "12", "--seed", "3"],
                    f"first question\n\n//etc is a folder\n/nope\n/save {saved}\n")
    assert run.returncode == 0, run.stderr
    assert "\x1b[" not in run.stdout + run.stderr          # no colours
    assert "> " not in run.stdout                           # no prompts
    document = json.loads(saved.read_text())
    assert [m["content"] for m in document["messages"] if m["role"] == "user"] == ["first question",
                                                                                    "/etc is a folder"]
    replies = [m["content"] for m in document["messages"] if m["role"] == "assistant"]
    # Each reply streamed to stdout, then a blank line; the save notice after them.
    assert run.stdout == f"{replies[0]}\n\n{replies[1]}\n\nsaved 4 messages to {saved}\n"
    assert len(STATS_LINE.findall(run.stderr)) == 2         # speed goes to stderr, not into the replies
    assert "perfx: unknown command /nope; /help lists the commands\n" in run.stderr


def test_a_message_longer_than_the_context_is_refused_and_the_session_goes_on(tiny):
    # --system '': the tiny vocabulary spells the default system prompt out letter by letter
    run = run_piped(["--model", tiny, "--ctx", "40", "--max-tokens", "30", "--seed", "4", "--system", ""],
                    "hello\n" + "many words " * 40 + "\nhi\n")
    assert run.returncode == 0, run.stderr
    assert ("perfx: error: this message does not fit the context of 40 positions with the system prompt: "
            "shorten it or raise --ctx\n") in run.stderr
    stats = STATS_LINE.findall(run.stderr)
    assert len(stats) == 2 and stats[0][1] == ", stopped: context full", run.stderr


def test_bad_flags_give_one_clear_line(tiny):
    for flags, message in [(["--temperature", "-1"], "perfx: error: --temperature must be ≥ 0, got -1.0"),
                           (["--top-p", "2"], "perfx: error: --top-p must be in (0, 1], got 2.0"),
                           (["--max-tokens", "0"], "perfx: error: --max-tokens must be at least 1, got 0"),
                           (["--model", "/no/such/model.gguf"],
                            "perfx: error: Model not found: /no/such/model.gguf")]:
        run = run_piped(["--model", tiny, *flags], "hello\n", timeout=60)
        assert run.returncode == 2, (flags, run.stderr)
        assert run.stderr.startswith(message), (flags, run.stderr)
        assert run.stderr.count("\n") == 1 and run.stdout == "", (flags, run.stderr)
    run = run_piped(["--model", tiny, "--ctx", "1"], "hello\n", timeout=60)  # fails at load, after the notes
    assert run.returncode == 2
    assert run.stderr.splitlines()[-1] == "perfx: error: --ctx must be at least 2, got 1"
    assert "Traceback" not in run.stderr
    run = run_piped(["--model", tiny, "--temperature", "warm"], "hello\n", timeout=60)
    assert run.returncode == 2 and "argument --temperature: invalid float value: 'warm'" in run.stderr


def test_harness_detects_a_missing_reply(tiny):
    # The checks above can fail: a pattern that never comes is reported, not waited on forever.
    term = Terminal(["--model", tiny, "--max-tokens", "4"], timeout=5)
    try:
        term.expect(PROMPT, timeout=60)
        with pytest.raises(AssertionError, match="did not appear"):
            term.expect("this text is never printed", timeout=1)
    finally:
        term.close()


# -- the default model ------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_answers_and_continues_on_the_cache():
    term = Terminal(["--temperature", "0", "--max-tokens", "48"], timeout=180)
    try:
        term.expect(r"perfx: model .*SmolLM2.*\.gguf .*on ", timeout=600)  # may fetch the model first
        term.expect(PROMPT, timeout=180)
        term.line("What is the capital of France?")
        start = term.expect(r"France\?\n").end()
        first = reply(term)
        answer = term.text[start:first.start()]
        assert "Paris" in answer, answer

        term.line("/stats")
        term.expect(r"prefill +last [\d.]+ tok/s \((\d+) tokens\)")
        term.expect(PROMPT)
        term.line("And what is the capital of Italy?")
        term.expect(r"Italy\?\n")
        reply(term)
        term.line("/stats")
        start = term.expect("/stats\n").end()
        term.expect(PROMPT)
        stats = term.since(start)
        # The second turn prefilled only its own tokens: the first turn's prompt and reply were in the cache.
        second_prefill = int(re.search(r"prefill +last [\d.]+ tok/s \((\d+) tokens\)", stats)[1])
        used = int(re.search(r"context +(\d+) / \d+ positions used, 4 messages", stats)[1])
        assert second_prefill < 30 < used, stats
        term.line("/quit")
        assert term.exit_status() == 0
    finally:
        term.close()


@pytest.mark.slow
def test_chat_and_generate_give_the_same_first_answer():
    """One default system prompt for both commands: the same question at temperature 0 gets the same reply."""
    question = "How many legs does a spider have?"
    flags = ["--temperature", "0", "--max-tokens", "32", "--ctx", "512"]
    generate = subprocess.run([sys.executable, "-m", "perfx", "generate", "-q", *flags, question],
                              capture_output=True, text=True, env=chat_env(), timeout=600)
    chat = run_piped(flags, question + "\n", timeout=600)
    assert generate.returncode == 0 and chat.returncode == 0, generate.stderr + chat.stderr
    assert "eight" in generate.stdout.lower() or "8" in generate.stdout, generate.stdout
    assert chat.stdout.strip() == generate.stdout.strip()


def test_generate_prints_no_compiler_output_unless_verbose(tiny, tmp_path):
    """pyopencl's "Non-empty compiler output" warnings (Intel's compiler reports every vectorised kernel)
    never reach the terminal: build logs belong to failures and to --verbose."""
    env = {**chat_env(), "PERFX_CACHE": str(tmp_path)}   # a fresh cache: every kernel is built in this run
    env.pop("PYOPENCL_COMPILER_OUTPUT", None)
    run = subprocess.run([sys.executable, "-m", "perfx", "generate", "--model", tiny, "--max-tokens", "3",
                          "--ctx", "256", "hello"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "CompilerWarning" not in run.stderr and "compiler output" not in run.stderr.lower(), run.stderr


# -- the thinking switch: --no-think, /think, chat_template_kwargs ------------------------------------------


@pytest.fixture(scope="module")
def qwen3() -> Tokenizer:
    """Qwen3's tokenizer (tests/data/vocab) with its own chat template, which reads enable_thinking."""
    tokenizer = Tokenizer.from_gguf(DATA / "vocab" / "qwen3.gguf")
    tokenizer.chat_template = (DATA / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    return tokenizer


class Source:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def describe(self):
        return {"path": "qwen3.gguf"}


def test_think_switch_in_chat(qwen3, capsys):
    chat = Chat(model=PositionalState(), source=Source(qwen3), sampling=None, max_tokens=8, system=None, interactive=False,
                think=False)
    question = [{"role": "user", "content": "2+2?"}]
    # Thinking off: the reply starts after an empty <think> block, as Qwen3's template writes it.
    assert qwen3.decode(chat.render(question)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    chat.command("/think")
    assert chat.think and capsys.readouterr().out == "thinking on; it applies from the next turn\n"
    assert qwen3.decode(chat.render(question)).endswith("<|im_start|>assistant\n")
    chat.command("/think off")
    assert not chat.think
    chat.command("/think maybe")
    assert "/think takes on or off" in capsys.readouterr().err and not chat.think


def test_no_think_on_a_model_without_the_switch_says_so(tiny):
    run = run_piped(["--model", tiny, "--no-think", "--max-tokens", "4", "--seed", "1"], "/think\nhello\n")
    assert run.returncode == 0, run.stderr
    assert run.stderr.count(NO_SWITCH_NOTE) == 2, run.stderr   # at the start, and at /think
    assert len(STATS_LINE.findall(run.stderr)) == 1             # the turn itself goes on as usual
    run = subprocess.run([sys.executable, "-m", "perfx", "generate", "--model", tiny, "--no-think",
                          "--max-tokens", "2", "--ctx", "256", "hello"], capture_output=True, text=True,
                         env=chat_env(), timeout=300)
    assert run.returncode == 0 and NO_SWITCH_NOTE in run.stderr, run.stderr


def test_help_documents_no_think():
    for command in ("generate", "chat"):
        run = subprocess.run([sys.executable, "-m", "perfx", command, "--help"], capture_output=True, text=True,
                             env=chat_env(), timeout=60)
        assert "--no-think" in run.stdout and "enable_thinking=false" in run.stdout.replace("\n", " ")


def test_serve_chat_template_kwargs(qwen3):
    body = {"messages": [{"role": "user", "content": "2+2?"}]}
    ids = chat_prompt(body, qwen3)[0]
    assert qwen3.decode(ids).endswith("<|im_start|>assistant\n")
    ids = chat_prompt({**body, "chat_template_kwargs": {"enable_thinking": False}}, qwen3)[0]
    assert qwen3.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for kwargs, message in [("off", "must be an object"), ({"messages": []}, "may not set 'messages'")]:
        with pytest.raises(APIError, match=message) as error:
            chat_prompt({**body, "chat_template_kwargs": kwargs}, qwen3)
        assert error.value.status == 400 and error.value.param == "chat_template_kwargs"
