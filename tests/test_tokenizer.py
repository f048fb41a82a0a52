"""Tokenizer tests: llama.cpp's ids for the default model and for the families phones run (Gemma 3, Qwen3,
SmolLM3, Phi-4-mini, Phi-3), round trips, streaming, chat templates and their thinking switch, stop tokens,
and SentencePiece tokenizers from a Hugging Face directory and from GGUF metadata."""

import copy
import functools
import json
import random
from pathlib import Path

import gguf
import pytest
import sentencepiece

from perfx.generate import PositionalState, SamplingConfig, generate
from perfx.sources.default import default_model_path
from perfx.errors import PerfxError
from perfx.gguf_file import GGUFFile
from perfx.tokenizer import CHATML_TEMPLATE, Tokenizer
from helpers.tiny_tokenizer import train_tiny_spm, write_tokenizer_only_gguf

# llama.cpp's ids for SmolLM2-135M-Instruct.Q4_1.gguf (special tokens parsed, no BOS).
DEFAULT_MODEL_VECTORS = {
    "Hello world! 12345 costs $6.78": [19556, 905, 17, 216, 33, 34, 35, 36, 37, 3499, 1885, 38, 30, 39, 40],
    "naïve café — 😀 übermäßig":
        [3546, 46494, 37366, 1841, 40303, 218, 5549, 137, 593, 93, 9023, 34878, 324],
    "  two spaces\n\nnew\tlines": [216, 827, 5600, 198, 198, 2241, 197, 5110],
    "<|im_start|>user\nHi<|im_end|>\n": [1, 4093, 198, 26843, 2, 198],
}

ROUND_TRIP_TEXTS = [
    "",
    " ",
    "Hello, world.",
    "   leading and trailing spaces   ",
    "tabs\tand\r\nwindows newlines\n\n\n",
    "naïve café — 😀 übermäßig",
    "日本語のテキストと中文",
    "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, skin tone 👍🏽",
    "combining e\u0301 and a\u0308, zero-width\u200bspace, BOM \ufeff, NUL \x00, DEL \x7f",
    "private use \ue000, replacement \ufffd, max \U0010ffff",
    "x = {'a': [1, 2.5e-3]}; // code <b>tags</b> & entities &amp;",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n",
]

SPM_TEXTS = [
    "hello world",
    "kato rimu senla doquizor.",
    "  two  spaces and trailing ",
    "Café naïve déjà vu 😀 日本",
    "line\nbreak\ttab",
    "0123 456.78 $%&",
]


@pytest.fixture(scope="module")
def default_tokenizer():
    # The default model is a hard requirement: no skip if it cannot be fetched.
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def tiny_spm_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_spm")
    train_tiny_spm(directory)
    return directory


# -- the default model (byte-level BPE from GGUF) ---------------------------------------------------

@pytest.mark.parametrize("text", list(DEFAULT_MODEL_VECTORS))
def test_default_model_matches_llama_cpp_ids(default_tokenizer, text):
    assert default_tokenizer.encode(text) == DEFAULT_MODEL_VECTORS[text]


def test_default_model_special_ids(default_tokenizer):
    assert default_tokenizer.vocab_size == 49152
    assert default_tokenizer.bos_id == 1
    assert {2, 0} <= default_tokenizer.eos_ids  # <|im_end|> and <|endoftext|>
    # The GGUF says add_bos_token = false; its ChatML template opens every turn with <|im_start|>.
    assert default_tokenizer.add_bos_token is False


def test_add_bos_is_not_doubled(default_tokenizer):
    assert default_tokenizer.encode("Hi", add_bos=True) == [1, 26843]
    assert default_tokenizer.encode("<|im_start|>user", add_bos=True) == [1, 4093]


def test_special_tokens_stay_text_without_parse_special(default_tokenizer):
    text = "<|im_start|>user"
    ids = default_tokenizer.encode(text, parse_special=False)
    assert 1 not in ids
    assert default_tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_default_model_round_trip(default_tokenizer, text):
    assert default_tokenizer.decode(default_tokenizer.encode(text)) == text


@pytest.mark.parametrize("text", list(DEFAULT_MODEL_VECTORS) + ROUND_TRIP_TEXTS)
def test_stream_matches_decode_and_never_splits_a_character(default_tokenizer, text):
    ids = default_tokenizer.encode(text)
    decoder = default_tokenizer.stream_decoder()
    pieces = [decoder.add(token_id) for token_id in ids] + [decoder.flush()]
    assert "".join(pieces) == default_tokenizer.decode(ids) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in piece for piece in pieces)


def test_stream_holds_bytes_until_the_character_is_complete(default_tokenizer):
    ids = default_tokenizer.encode("😀")
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    decoder = default_tokenizer.stream_decoder()
    pieces = [decoder.add(token_id) for token_id in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1)
    assert pieces[-1] == "😀"


def test_stream_matches_decode_on_random_ids(default_tokenizer):
    rng = random.Random(1234)
    single_bytes = [i for i in range(default_tokenizer.vocab_size)
                    if len(default_tokenizer.token_text(i)) == 1]
    for _ in range(300):
        pool = single_bytes if rng.random() < 0.5 else range(default_tokenizer.vocab_size)
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 24))]
        assert "".join(default_tokenizer.stream(ids)) == default_tokenizer.decode(ids)


def test_default_model_chat_template(default_tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert default_tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert default_tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_decode_rejects_ids_outside_the_vocabulary(default_tokenizer):
    with pytest.raises(PerfxError, match="49152"):
        default_tokenizer.decode([5, 49152])
    with pytest.raises(PerfxError, match="-1"):
        default_tokenizer.decode([-1])


def test_hf_tokenizer_json_gives_the_same_ids(default_tokenizer, tmp_path):
    # A tokenizer.json saved from the GGUF-built tokenizer, as a Hugging Face directory would hold it.
    default_tokenizer._encoder.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": default_tokenizer.chat_template,
    }))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    for text, ids in DEFAULT_MODEL_VECTORS.items():
        assert tokenizer.encode(text) == ids
        assert tokenizer.decode(ids) == text
    assert tokenizer.bos_id == 1 and 2 in tokenizer.eos_ids and not tokenizer.add_bos_token
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages) == default_tokenizer.apply_chat_template(messages)


# -- SentencePiece: Hugging Face directory and GGUF ---------------------------------------------------

def test_spm_hf_dir_round_trip(tiny_spm_dir):
    tokenizer = Tokenizer.from_hf_dir(tiny_spm_dir)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tiny_spm_dir / "tokenizer.model"))
    assert tokenizer.vocab_size == processor.get_piece_size()
    assert tokenizer.bos_id == processor.bos_id() and processor.eos_id() in tokenizer.eos_ids
    for text in SPM_TEXTS + ROUND_TRIP_TEXTS[:7]:
        ids = tokenizer.encode(text)
        assert ids == processor.encode(text)
        assert tokenizer.decode(ids) == text
        assert "".join(tokenizer.stream(ids)) == text


def test_spm_gguf_matches_sentencepiece(tiny_spm_dir, tmp_path):
    model_path = tiny_spm_dir / "tokenizer.model"
    tokenizer = Tokenizer.from_gguf(write_tokenizer_only_gguf(tmp_path / "tiny.gguf", model_path))
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
    for text in SPM_TEXTS:
        assert tokenizer.encode(text) == processor.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.add_bos_token is True
    assert tokenizer.encode("hello", add_bos=True)[0] == processor.bos_id()


def test_spm_gguf_parses_special_tokens_like_llama_cpp(tiny_spm_dir, tmp_path):
    model_path = tiny_spm_dir / "tokenizer.model"
    tokenizer = Tokenizer.from_gguf(write_tokenizer_only_gguf(tmp_path / "tiny.gguf", model_path))
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model_path))
    start, end = processor.piece_to_id("<|im_start|>"), processor.piece_to_id("<|im_end|>")
    # llama.cpp encodes the text between special tokens on its own, each with the prefix space.
    assert tokenizer.encode("<|im_start|>user hi<|im_end|>") == (
        [start] + processor.encode("user hi") + [end])
    assert tokenizer.encode("<s>hi", add_bos=True) == [processor.bos_id()] + processor.encode("hi")
    assert end in tokenizer.eos_ids


def test_spm_style_tokenizer_json(tmp_path):
    # A Llama-2-style tokenizer.json: "▁" for spaces, byte fallback, one leading space stripped on decode.
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["\u2581"] + letters
    merges = [("\u2581", "t"), ("h", "e"), ("\u2581t", "he")]
    pieces += ["\u2581t", "he", "\u2581the"]
    backend = Backend(models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>",
                                 byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                "add_bos_token": True}))
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    assert tokenizer.encode("the") == [pieces.index("\u2581the")]
    assert tokenizer.encode("the", add_bos=True) == [1, pieces.index("\u2581the")]
    assert tokenizer.bos_id == 1 and tokenizer.eos_ids == {2} and tokenizer.add_bos_token
    for text in ["the theme", "  spaced  out ", "café — 😀"]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text == backend.decode(ids)
        assert "".join(tokenizer.stream(ids)) == text


# -- chat templates ------------------------------------------------------------------------------------

def test_chatml_fallback_without_template(tiny_spm_dir):
    tokenizer = Tokenizer.from_hf_dir(tiny_spm_dir)
    assert tokenizer.chat_template is None
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")
    assert "<|im_start|>" in CHATML_TEMPLATE


def test_a_gemma_vocabulary_without_a_template_gets_gemma_s_turns():
    """A Gemma GGUF whose converter left the template out renders as google/gemma-3-4b-it's own template does
    for text conversations (its system message opens the first user turn); ChatML stays the fallback of
    every other vocabulary."""
    def tokenizer(tokens, template=None):
        return Tokenizer(encoder=lambda text, special: [], tokens=tokens, types=[3] * len(tokens),
                         byte_level=False, strip_leading_space=False, bos_id=2, eos_ids=[1], add_bos_token=True,
                         chat_template=template, bos_token="<bos>", eos_token="<eos>")
    gemma_tokens = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "a"]
    bare = tokenizer(gemma_tokens)
    real = tokenizer(gemma_tokens, (DATA / "templates" / "google-gemma-3-4b-it.jinja").read_text(encoding="utf-8"))
    conversations = [
        [{"role": "user", "content": "Hi "}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": " Hello. "}, {"role": "user", "content": "Bye"}],
    ]
    for messages in conversations:
        for generation_prompt in (True, False):
            assert (bare.apply_chat_template(messages, generation_prompt)
                    == real.apply_chat_template(messages, generation_prompt)), (messages, generation_prompt)
    assert bare.apply_chat_template(conversations[1]) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n")
    assert tokenizer(["<pad>", "<eos>", "<bos>", "a"]).apply_chat_template(conversations[0]).startswith("<|im_start|>")


def test_template_gets_hf_helpers_and_its_errors_become_perfx_errors(tiny_spm_dir, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes((tiny_spm_dir / "tokenizer.model").read_bytes())
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('roles must be user/assistant') }}"
        "{% endif %}{{ m['content'] | tojson }}{{ eos_token }}\n"
        "{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}))
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "é"}]) == '<s>"é"</s>\n'
    with pytest.raises(PerfxError, match="roles must be user/assistant"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


# -- errors --------------------------------------------------------------------------------------------

def test_unknown_gguf_tokenizer_model_is_named(tmp_path):
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[PAD]", "[UNK]", "hello"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(PerfxError, match="'bert'"):
        Tokenizer.from_gguf(path)


def test_unknown_bpe_pre_tokenizer_is_named(tmp_path):
    path = tmp_path / "bpe.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("no-such-pre")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(PerfxError, match="no-such-pre"):
        Tokenizer.from_gguf(path)


def test_directory_without_tokenizer_lists_what_was_looked_for(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(PerfxError, match="tokenizer.json.*tokenizer.model"):
        Tokenizer.from_hf_dir(tmp_path)


# -- the families phones run: llama.cpp's ids, BOS rules, stop tokens (tests/data/README.md) --------------

DATA = Path(__file__).parent / "data"
# fixture: (the token that ends a turn, whether a prompt gets a BOS, the BOS id)
FAMILIES = {
    "gemma3": ("<end_of_turn>", True, 2),
    "qwen3": ("<|im_end|>", False, None),
    "smollm3": ("<|im_end|>", False, None),
    "phi4-mini": ("<|end|>", False, None),
    "phi3": ("<|end|>", True, 1),
    "llama-bpe": ("<|eot_id|>", True, 128000),
}


@functools.cache
def family(name: str) -> tuple[Tokenizer, list[int], dict]:
    """The fixture's tokenizer, the original id of each of its ids, and its cases with llama.cpp's ids."""
    file = GGUFFile(DATA / "vocab" / f"{name}.gguf")
    original = [int(i) for i in file.value("perfx.original_token_ids")]
    return Tokenizer.from_gguf(file), original, json.loads((DATA / "vocab" / f"{name}.json").read_text())


def original_ids(name: str, ids: list[int]) -> list[int]:
    return [family(name)[1][i] for i in ids]


def pruned_id(name: str, token: str) -> int:
    tokenizer = family(name)[0]
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.token_text(i) == token)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_ids_are_llama_cpp_ids(name):
    tokenizer, _, data = family(name)
    for case in data["cases"]:
        ids = tokenizer.encode(case["text"], add_bos=case["add_bos"] and tokenizer.add_bos_token,
                               parse_special=case["parse_special"])
        assert original_ids(name, ids) == case["ids"], case["text"]


@pytest.mark.parametrize("name", ["gemma3", "qwen3", "smollm3", "phi4-mini"])
def test_family_ids_decode_to_the_text(name):
    tokenizer, _, data = family(name)
    for case in data["cases"]:
        ids = tokenizer.encode(case["text"], parse_special=case["parse_special"])
        assert tokenizer.decode(ids) == case["text"]
        assert "".join(tokenizer.stream(ids)) == case["text"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_bos_rule(name):
    tokenizer = family(name)[0]
    _, adds_bos, bos = FAMILIES[name]
    assert tokenizer.add_bos_token is adds_bos
    if adds_bos:
        assert original_ids(name, tokenizer.encode("Hi", add_bos=True))[0] == bos
        # A template's leading BOS text stays the only BOS.
        assert original_ids(name, tokenizer.encode(tokenizer.bos_token + "Hi", add_bos=True)).count(bos) == 1


def test_gemma_has_no_space_prefix():
    tokenizer = family("gemma3")[0]
    first = tokenizer.encode("Hello world")
    assert tokenizer.token_text(first[0]) == "Hello"            # no "▁Hello"
    assert tokenizer.decode(first) == "Hello world"
    turn = tokenizer.encode("<start_of_turn>user\nHi")
    assert [tokenizer.token_text(i) for i in turn] == ["<start_of_turn>", "user", "\n", "Hi"]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_stop_ids_are_llama_cpp_s(name):
    tokenizer, _, data = family(name)
    end_of_turn = FAMILIES[name][0]
    assert pruned_id(name, end_of_turn) in tokenizer.eos_ids
    assert sorted(original_ids(name, sorted(tokenizer.eos_ids))) == data["eog"]


def test_a_reply_ends_at_the_end_of_turn_token():
    """generate() stops at Gemma's <end_of_turn> (its GGUF's eos id is <eos>): the token is neither kept nor
    printed, and the reply is the text before it."""
    tokenizer = family("gemma3")[0]
    script = tokenizer.encode("Four.") + [pruned_id("gemma3", "<end_of_turn>")] + tokenizer.encode(" More")

    class Scripted(PositionalState):
        max_positions, weight_bytes, host_seconds = 64, 0, 0.0

        def __init__(self):
            self.next = iter(script)

        def prefill(self, tokens, start_pos):
            pass

        def decode_one(self, token, pos):
            pass

        def argmax(self):
            return next(self.next)

    pieces = []
    result = generate(Scripted(), tokenizer, tokenizer.encode("Hi"), 16, SamplingConfig(temperature=0),
                      on_text=pieces.append)
    assert result.text == "".join(pieces) == "Four."
    assert result.stats.stop_reason == "eos" and result.ids == tokenizer.encode("Four.")


def test_hf_generation_config_lists_every_stop_id(tiny_spm_dir, tmp_path):
    # Gemma 3's generation_config.json: eos_token_id [1, 106], <eos> and <end_of_turn>; here </s> and <|im_end|>.
    (tmp_path / "tokenizer.model").write_bytes((tiny_spm_dir / "tokenizer.model").read_bytes())
    processor = sentencepiece.SentencePieceProcessor(model_file=str(tiny_spm_dir / "tokenizer.model"))
    end = processor.piece_to_id("<|im_end|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, end]}))
    assert {2, end} <= Tokenizer.from_hf_dir(tmp_path).eos_ids


# -- chat templates of the families (tests/data/templates, as users download them) ------------------------

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! Who are you?"},
                {"role": "assistant", "content": "I am a model."}, {"role": "user", "content": "What is 2+2?"}]
QWEN3 = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi! Who are you?<|im_end|>\n"
         "<|im_start|>assistant\nI am a model.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
         "<|im_start|>assistant\n")
SMOLLM3_HEADER = ("<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nReasoning Mode: {mode}\n\n"
                  "## Custom Instructions\n\nBe brief.\n\n<|im_end|>\n"
                  "<|im_start|>user\nHi! Who are you?<|im_end|>\n")
GEMMA = ("<bos><start_of_turn>user\n{prefix}Hi! Who are you?<end_of_turn>\n<start_of_turn>model\nI am a model."
         "<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n")
# What transformers' apply_chat_template renders for CONVERSATION (Gemma 2: without its system message, which
# its template refuses), read off each template's logic.
RENDERED = [
    ("gemma3", "google-gemma-3-4b-it.jinja", {}, GEMMA.format(prefix="Be brief.\n\n")),
    ("gemma3", "google-gemma-2-2b-it.jinja", {}, GEMMA.format(prefix="")),
    ("qwen3", "Qwen-Qwen3-0.6B.jinja", {}, QWEN3),
    ("qwen3", "Qwen-Qwen3-0.6B.jinja", {"enable_thinking": False}, QWEN3 + "<think>\n\n</think>\n\n"),
    ("smollm3", "HuggingFaceTB-SmolLM3-3B.jinja", {},
     SMOLLM3_HEADER.format(mode="/think") + "<|im_start|>assistant\nI am a model.<|im_end|>\n"
     "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
    ("smollm3", "HuggingFaceTB-SmolLM3-3B.jinja", {"enable_thinking": False},
     SMOLLM3_HEADER.format(mode="/no_think") + "<|im_start|>assistant\n<think>\n\n</think>\n"
     "I am a model.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
     "<|im_start|>assistant\n<think>\n\n</think>\n"),
    ("phi4-mini", "microsoft-Phi-4-mini-instruct.jinja", {},
     "<|system|>Be brief.<|end|><|user|>Hi! Who are you?<|end|><|assistant|>I am a model.<|end|>"
     "<|user|>What is 2+2?<|end|><|assistant|>"),
    ("phi3", "microsoft-Phi-3.5-mini-instruct.jinja", {},
     "<|system|>\nBe brief.<|end|>\n<|user|>\nHi! Who are you?<|end|>\n<|assistant|>\nI am a model.<|end|>\n"
     "<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n"),
]


def with_template(name: str, template: str) -> Tokenizer:
    tokenizer = copy.copy(family(name)[0])
    tokenizer.__dict__.pop("_compiled_chat_template", None)
    tokenizer.chat_template = (DATA / "templates" / template).read_text(encoding="utf-8")
    return tokenizer


@pytest.mark.parametrize("name, template, kwargs, expected", RENDERED,
                         ids=[f"{r[1]}-{'no-think' if r[2] else 'default'}" for r in RENDERED])
def test_family_templates_render_as_transformers_does(name, template, kwargs, expected):
    tokenizer = with_template(name, template)
    messages = CONVERSATION[1:] if "gemma-2" in template else CONVERSATION
    assert tokenizer.apply_chat_template(messages, **kwargs) == expected
    assert tokenizer.has_thinking_switch is ("Qwen3" in template or "SmolLM3" in template)
    # The turns' ends are single ids, one a turn: the template's text and the vocabulary agree.
    ids = tokenizer.encode(expected)
    turns = [m for m in messages if m["role"] != "system" or name != "gemma3"]   # Gemma's system joins a turn
    assert ids.count(pruned_id(name, FAMILIES[name][0])) == len(turns)


def test_a_template_without_system_role_gets_the_system_prompt_in_the_first_message():
    # Gemma 2's template raises on a system message; llama.cpp then joins it to the next message.
    tokenizer = with_template("gemma3", "google-gemma-2-2b-it.jinja")
    assert tokenizer.apply_chat_template(CONVERSATION) == GEMMA.format(prefix="Be brief.\n")
    with pytest.raises(PerfxError, match="Conversation roles must alternate"):
        tokenizer.apply_chat_template(CONVERSATION[1:2] * 2)


def test_generation_tag_renders_its_body():
    # SmolLM3's own template marks assistant turns with transformers' {% generation %} tag.
    tokenizer = with_template("smollm3", "HuggingFaceTB-SmolLM3-3B.jinja")
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                               "{{ m.content }}{% set inner = 1 %}{% endgeneration %}{% else %}{{ m.content }}"
                               "{% endif %}|{% endfor %}")
    assert tokenizer.apply_chat_template(CONVERSATION[1:3]) == "Hi! Who are you?|I am a model.|"
