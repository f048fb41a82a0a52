"""Prompt ids identical to llama.cpp's, BOS rule included.

llama.cpp tokenizes with ``add_special`` = the model's own ``tokenizer.ggml.add_bos_token`` (llama_tokenize
adds BOS only where the vocabulary says so); perfx's commands encode with ``add_bos=tokenizer.add_bos_token``.
The default model says add_bos_token = false, so neither adds one. llama-cpp-python is a benchmark tool here,
never a perfx dependency: without it these tests are skipped, saying how to get it.
"""

import numpy as np
import pytest

from helpers.llamacpp import INSTALL, import_llama_cpp
from helpers.tiny_models import make_tiny_model, tiny_tokenizer, write_gguf
from perfx.commands.options import DEFAULT_SYSTEM
from perfx.sources import open_model
from perfx.sources.default import default_model_path

pytest.importorskip("llama_cpp", reason=INSTALL)
llama_cpp = import_llama_cpp()

TEXTS = [
    "The capital of France is",
    "How many legs does a spider have?",
    "  leading spaces, trailing newline\n",
    "Numbers 1234567 and 3.14159, symbols <>&%$, email a.b@c.org",
    "def f(x):\n    return x ** 2  # squares\n\n\nprint(f(12))",
    "Unicode: café, naïve, 東京, Ελληνικά, emoji 🙂 and a tab\tend",
    "",
]


def llama_ids(path, text: str) -> list[int]:
    """llama.cpp's ids as its tools make them: special tokens parsed, BOS by the model's own rule."""
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)


def perfx_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_bos=tokenizer.add_bos_token)


def test_default_model_prompt_ids_are_llama_cpp_ids():
    path = default_model_path()
    tokenizer = open_model(path).tokenizer
    assert tokenizer.add_bos_token is False          # the default model's own rule: no BOS
    chats = [tokenizer.apply_chat_template([{"role": "system", "content": DEFAULT_SYSTEM},
                                            {"role": "user", "content": text}]) for text in TEXTS[:3]]
    for text in TEXTS + chats:
        assert perfx_ids(tokenizer, text) == llama_ids(path, text), text


@pytest.mark.parametrize("add_bos", [True, False, None])
def test_the_model_s_own_bos_rule_as_llama_cpp_applies_it(tmp_path, add_bos):
    """A SentencePiece model saying add_bos_token true, false, or nothing (llama.cpp's default for SPM: true)."""
    spm = tiny_tokenizer(tmp_path)
    model = make_tiny_model("gqa1", spm, np.random.default_rng(0), n_layers=1)
    path = write_gguf(tmp_path / "m.gguf", model, add_bos=add_bos).path
    tokenizer = open_model(path).tokenizer
    assert tokenizer.add_bos_token == (add_bos is not False)
    for text in ("kato rimu senla", "hello world", ""):
        ids = perfx_ids(tokenizer, text)
        assert ids == llama_ids(path, text), text
        assert (ids[:1] == [tokenizer.bos_id]) == (add_bos is not False)
