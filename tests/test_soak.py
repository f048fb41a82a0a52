"""Soak: the default model chats through a scripted session on a 256-position context until
the context has overflowed at least twice (the chat drops its oldest turns and re-prefills the rest) and it
has had at least MIN_TURNS turns, in process through ``perfx.commands.chat.Chat``, the class behind `perfx chat`.

Between turns nothing may grow but what is bounded: device memory is the load's plus the prefill GEMMs built
once per M bucket (a few bytes each; slack 1 MiB); host memory (resident set, /proc/self/statm) may move by at
most HOST_SLACK from the first overflow on, when the prefill kernels of both prompt-length buckets in use have
been built. Every reply must be text: not empty, mostly printable, with ASCII words in it. About 75 s on two
CPU cores: slow.
"""

import gc
import os
import re
import time

import pytest

from perfx.commands.chat import Chat
from perfx.generate import SamplingConfig
from perfx.model import load_model

pytestmark = pytest.mark.one_implementation  # model-level: the default device only

CTX = 256
MAX_TOKENS = 32
HOST_SLACK = 16 << 20    # allocator noise and Python's caches; a copy of the cache or logits per turn is more
DEVICE_SLACK = 1 << 20
MIN_TURNS = 16   # after the overflows, more turns: a trend in memory needs some length
MAX_TURNS = 40
SCRIPT = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "How many legs does a spider have?",
    "Write one sentence about the sea.",
    "What is two plus three?",
    "Give me a word that rhymes with cat.",
    "Why is the sky blue? Answer in one sentence.",
]


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def coherent(text: str) -> bool:
    printable = sum(ch.isprintable() or ch in "\n\t" for ch in text)
    words = re.findall(r"[A-Za-z]{3,}", text)
    return bool(text.strip()) and printable >= 0.95 * len(text) and len(words) >= 2


def test_coherent_rejects_noise():
    assert coherent("Paris is the capital of France.")
    for noise in ("", "   ", "\x00\x01\x02\x03 ab", "1 2 3", "\ufffd\ufffd ok"):
        assert not coherent(noise), noise


@pytest.mark.slow
def test_default_model_chats_through_two_context_overflows(device, capsys):
    model, source = load_model("default", device, ctx=CTX, progress=False)
    chat = Chat(model, source, SamplingConfig(temperature=0.7, seed=1), MAX_TOKENS, None, interactive=False)
    notes = []
    chat.note = lambda text, dim=False: notes.append(text)
    loaded_device = device.allocated_bytes
    overflows, turns, rows, started, first_overflow = 0, 0, [], time.perf_counter(), None
    while overflows < 2 or turns < MIN_TURNS:
        assert turns < MAX_TURNS, f"the context never overflowed twice in {MAX_TURNS} turns: {notes[-3:]}"
        before = len(notes)
        chat.turn(SCRIPT[turns % len(SCRIPT)])
        turns += 1
        capsys.readouterr()    # the streamed reply
        new = notes[before:]
        assert not [n for n in new if n.startswith("perfx: error")], new
        overflows += sum("context full" in n for n in new)
        if overflows and first_overflow is None:
            first_overflow = turns - 1   # index in rows of this turn
        gc.collect()
        rows.append((turns, len(chat.conversation.cached), device.allocated_bytes, resident_bytes()))
        reply = chat.messages[-1]
        assert reply["role"] == "assistant" and coherent(reply["content"]), (turns, reply["content"])
    elapsed = time.perf_counter() - started

    devices = [r[2] for r in rows]
    assert max(devices) - loaded_device <= DEVICE_SLACK, rows
    host = [r[3] for r in rows[first_overflow:]]
    assert max(host) - host[0] <= HOST_SLACK, rows
    replies = chat.replies
    generated = sum(s.generated_tokens for s in replies)
    steps = sum(max(s.generated_tokens - 1, 0) for s in replies)
    decode_s = sum(s.decode_s for s in replies if s.generated_tokens > 1)
    figures = {
        "turns": turns, "overflows": overflows, "ctx": CTX, "max_tokens": MAX_TOKENS,
        "seconds": round(elapsed, 1),
        "generated_tokens": generated, "decode_tok_s": round(steps / decode_s, 1) if decode_s else 0.0,
        "device_bytes_load": loaded_device, "device_bytes_growth": max(devices) - loaded_device,
        "first_overflow_turn": first_overflow + 1, "host_rss_growth_after_first_overflow_mib":
            round((max(host) - host[0]) / 2**20, 2), "host_rss_mib": [round(r[3] / 2**20) for r in rows],
        "positions_used": [r[1] for r in rows],
    }
    with capsys.disabled():
        print(f"\nsoak, default model: {figures}")
