"""`perfx perplexity` and the model's own BOS rule on every command path.

Perplexity against a float64 computation of llama-perplexity's method over the reference forward (the same
chunks, BOS replacing each chunk's first token where the model adds one, the second half scored): the
device logits are within 2e-3 of max|logits| of the reference (test_model.py), which moves a token's NLL
by at most ~2·2e-3·max|logits| ≈ 0.02 for these tiny models, so the mean NLL agrees within 0.02.
"""

import json
import re

import numpy as np
import pytest

from helpers.perplexity import reference_nll
from helpers.tiny_models import make_tiny_model, tiny_tokenizer, write_gguf
from perfx import cli
from perfx.commands.perplexity import chunk_plan
from perfx.errors import PerfxError
from perfx.sources import open_model

TEXT = ("kato rimu senla vo pira nesu talo mirek sova lenu. " * 40).strip()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppl")
    spm = tiny_tokenizer(root)
    model = make_tiny_model("gqa3", spm, np.random.default_rng(4))
    text = root / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    return {"no-bos": write_gguf(root / "nobos.gguf", model, add_bos=False).path,
            "bos": write_gguf(root / "bos.gguf", model, add_bos=True).path, "text": text}


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("which", ["no-bos", "bos"])
def test_perplexity_is_llama_perplexity_s_method(tiny, capsys, which):
    code, out, err = run_cli(capsys, "perplexity", tiny["text"], "--model", tiny[which], "--ctx", 32,
                             "--chunks", 3, "--json")
    assert code == 0, err
    result = json.loads(out)
    want_nll, want_count, starts_with_bos = reference_nll(tiny[which], TEXT, 32, 3)
    assert result["add_bos"] == (which == "bos") == starts_with_bos
    assert (result["chunks"], result["ctx"], result["scored"]) == (3, 32, want_count) and want_count == 3 * 15
    assert abs(result["nll"] - want_nll) <= 0.02
    assert result["ppl"] == pytest.approx(np.exp(result["nll"])) and result["tokens_per_s"] > 0
    assert len(result["running_ppl"]) == 3 and result["running_ppl"][-1] == pytest.approx(result["ppl"])
    # without --json: one line on stdout, speed on stderr
    code, out, err = run_cli(capsys, "perplexity", tiny["text"], "--model", tiny[which], "--ctx", 32, "--chunks", 1)
    assert code == 0 and out.startswith("PPL = ") and out.count("\n") == 1 and "tokens/s" in err


def test_perplexity_with_an_int8_kv_cache(tiny, capsys):
    """--kv q8 runs and scores within the fp16 cache's bound of the float64 reference (0.02, above): quantizing
    this tiny model's keys and values moved its mean NLL by 9e-5 (each value by at most 1/254 of its block's
    largest; random weights give no outlier channels)."""
    args = ["perplexity", tiny["text"], "--model", tiny["bos"], "--ctx", 32, "--chunks", 3, "--json"]
    code, out, err = run_cli(capsys, *args, "--kv", "q8")
    assert code == 0, err
    result = json.loads(out)
    assert result["kv"] == "q8" and "KV cache q8" in err
    want_nll, want_count, _ = reference_nll(tiny["bos"], TEXT, 32, 3)
    assert result["scored"] == want_count and abs(result["nll"] - want_nll) <= 0.02


@pytest.mark.parametrize("args, message", [
    (["--ctx", "31"], "--ctx must be an even number of at least 4 tokens, got 31"),
    (["--chunks", "0"], "--chunks must be at least 1, got 0"),
    (["--ctx", "32", "short"], r"tokenizes to \d+ tokens; perplexity with a context of 32 needs at least 64 "
                                r"\(as llama-perplexity\): give a longer text or a smaller --ctx"),
])
def test_perplexity_errors_are_one_clear_line(tiny, capsys, tmp_path, args, message):
    text = tiny["text"]
    if args[-1] == "short":
        text, args = tmp_path / "short.txt", args[:-1]
        text.write_text("kato rimu senla", encoding="utf-8")
    code, out, err = run_cli(capsys, "perplexity", text, "--model", tiny["no-bos"], *args)
    last = err.strip().splitlines()[-1]
    assert code == 2 and out == "" and last.startswith("perfx: error: ")
    assert re.search(message, last), err


def test_perplexity_file_errors(tiny, capsys, tmp_path):
    code, _, err = run_cli(capsys, "perplexity", tmp_path / "missing.txt", "--model", tiny["no-bos"])
    assert code == 2 and "missing.txt: no such file" in err
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("café".encode("latin-1"))
    code, _, err = run_cli(capsys, "perplexity", latin, "--model", tiny["no-bos"])
    assert code == 2 and "is not UTF-8 text" in err


def test_chunk_plan():
    assert chunk_plan(1000, 100, None) == 10 and chunk_plan(1000, 100, 3) == 3 and chunk_plan(1099, 100, 50) == 10
    with pytest.raises(PerfxError, match="needs at least 200"):
        chunk_plan(199, 100, None)


@pytest.mark.parametrize("which", ["no-bos", "bos"])
def test_generate_and_chat_prompts_follow_the_model_s_bos_rule(tiny, capsys, which):
    code, out, _ = run_cli(capsys, "generate", "--model", tiny[which], "--raw", "--json", "--max-tokens", "1",
                           "--temperature", "0", "-q", "kato rimu")
    ids = json.loads(out)["prompt_ids"]
    tok = open_model(tiny[which]).tokenizer
    assert (ids[0] == tok.bos_id) == (which == "bos")
    assert ids == tok.encode("kato rimu", add_bos=which == "bos")
    from perfx.commands.chat import Chat
    chat = Chat.__new__(Chat)
    chat.tokenizer, chat.system, chat.support = tok, None, None
    assert (chat.render([{"role": "user", "content": "hi"}])[0] == tok.bos_id) == (which == "bos")
