"""Tokenizers for Llama-family models: encoding, decoding, chat templates, streaming detokenization.

Sources: a Hugging Face model directory (tokenizer.json through `tokenizers`, or tokenizer.model through
`sentencepiece`) or the tokenizer embedded in a GGUF file, rebuilt so that it gives llama.cpp's ids.

Decoding is done here, not by the backends: every id maps to its bytes once, at load time, so
`decode()` and the streaming decoder are the same computation and agree exactly, and a UTF-8
character split across tokens is never emitted in halves.
"""

from __future__ import annotations

import codecs
import enum
import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import sentencepiece
from sentencepiece import sentencepiece_model_pb2
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from perfx.errors import PerfxError
from perfx.families import FAMILIES
from perfx.gguf_file import GGUFFile
from perfx.resources import read_json


class TokenType(enum.IntEnum):
    """Token kinds, numbered as in GGUF's tokenizer.ggml.token_type and SentencePiece's ModelProto."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Token kinds that llama.cpp splits out of the text before encoding when special tokens are parsed.
_PARSED_FROM_TEXT = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)

# Tokens that end generation wherever they are in the vocabulary, whatever their type and whatever the eos id
# says: llama.cpp's list (llama-vocab.cpp, special_eog_ids), so that a reply ends where llama-cli's would.
_END_OF_GENERATION_TOKENS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
}) | {token for family in FAMILIES.values() for token in family.chat.stop_tokens}   # and each family's turn ends
# Fill-in-the-middle padding, repository and file separators, which llama.cpp also treats as end of
# generation (a model that writes one has left the reply): the first of each kind found.
_FIM_END_TOKENS = (
    ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("<|file_sep|>",),
)
# Characters that C's isspace() takes, which llama.cpp strips after a right-stripping special token.
_C_WHITESPACE = " \t\n\v\f\r"

# Used when a model has no chat template of its own (as llama.cpp does)...
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ... unless it is of a family with a fallback of its own (ChatRules.fallback_template: Gemma's turns), found
# by its vocabulary.

# Pre-tokenizer regexes of llama.cpp (src/llama-vocab.cpp, llm_tokenizer_bpe), applied in turn, each
# splitting the pieces left by the one before; text between matches stays a piece of its own.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k's (GPT-4o; Phi-4-mini) as llama.cpp rewrites it: a letter outside a-z stands for an upper-case one
# and a letter outside A-Z for a lower-case one, where tiktoken's asks for the Unicode case classes and the
# combining marks (\p{M}). Words with marks (the Khmer of llama.cpp's test text) split apart otherwise and
# get other ids than tiktoken's; llama.cpp's are what GGUF users get.
_GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT_BPE_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre → (regexes, ignore_merges, add_bos default), grouped as llama.cpp groups them.
# SmolLM3's GGUF says "smaug-bpe" (Llama 3's regex, merges applied, no BOS), Qwen3's "qwen2", Phi-4-mini's
# "gpt-4o"; SmolLM2's "smollm".
_BPE_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {}
for _names, _spec in [
    (("default",), (_DEFAULT_BPE_REGEXES, False, False)),
    (("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"), ((_GPT2_REGEX,), False, False)),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     ((r"\p{N}", _GPT2_REGEX), False, False)),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2"),
     ((_LLAMA3_REGEX,), True, True)),
    (("dbrx", "smaug-bpe"), ((_LLAMA3_REGEX,), False, False)),
    (("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), ((_QWEN2_REGEX,), False, False)),
    (("gpt-4o", "llama4"), ((_GPT4O_REGEX,), False, False)),
]:
    for _name in _names:
        _BPE_PRE_TOKENIZERS[_name] = _spec
# and those a family brings (ChatRules.pre_tokenizers: Qwen3.5's "qwen35", combining marks kept with their letters)
for _family in FAMILIES.values():
    _BPE_PRE_TOKENIZERS.update(_family.chat.pre_tokenizers)

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPACE_MARKER = "\u2581"  # SentencePiece's "▁", which stands for a space inside pieces


def _gpt2_byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (openai/gpt-2, encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_OF_CHAR = {char: byte for byte, char in _gpt2_byte_to_char().items()}


def _token_bytes(token: str, kind: int, byte_level: bool) -> bytes:
    """The bytes one token stands for when decoded."""
    if kind in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN):
        return token.encode("utf-8")
    if byte_level:
        try:
            return bytes(_BYTE_OF_CHAR[char] for char in token)
        except KeyError:  # not byte-level text: a hand-added token stored as plain text
            return token.encode("utf-8")
    if kind == TokenType.BYTE and (match := _BYTE_PIECE.fullmatch(token)):
        return bytes([int(match[1], 16)])
    return token.replace(_SPACE_MARKER, " ").encode("utf-8")


class Tokenizer:
    """Text ↔ token ids for one model, with its chat template and stop tokens.

    Build one with `from_hf_dir` or `from_gguf`. `bos_id` may be None; `eos_ids` holds every id that
    ends generation; `add_bos_token` says whether the model expects a BOS at the start of a prompt.
    """

    def __init__(self, *, encoder: Callable[[str, bool], list[int]], tokens: list[str], types: list[int],
                 byte_level: bool, strip_leading_space: bool, bos_id: int | None, eos_ids: Iterable[int],
                 add_bos_token: bool, chat_template: str | None, bos_token: str = "", eos_token: str = ""):
        self._encoder = encoder
        self._token_bytes = [_token_bytes(token, kind, byte_level) for token, kind in zip(tokens, types)]
        self._tokens = tokens
        # The ids a grammar names as special tokens rather than spells as text (perfx.constrain), by llama.cpp's
        # rule for llguidance: control and unknown ids, and user-defined ones that look like tags (Qwen3's
        # <tool_call>; not Gemma's runs of spaces, which are text)
        self.special_ids = frozenset(
            i for i, (token, kind) in enumerate(zip(tokens, types))
            if kind in (TokenType.CONTROL, TokenType.UNKNOWN)
            or (kind == TokenType.USER_DEFINED and len(token) > 2 and token[0] == "<" and token[-1] == ">"))
        # SentencePiece puts a space before the first word ("▁Hello"); decoding takes it off again.
        self._strip_leading_space = strip_leading_space
        self.bos_id = bos_id
        self.eos_ids = frozenset(eos_ids)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token

    @property
    def vocab_size(self) -> int:
        return len(self._token_bytes)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry of one id, as stored (byte-level or "▁" forms included)."""
        self._check_ids([token_id])
        return self._tokens[token_id]

    def token_bytes(self) -> list[bytes]:
        """Every id's bytes, as decoding writes them (a SentencePiece "▁" is a space, a byte piece its byte)."""
        return list(self._token_bytes)

    def encode(self, text: str, add_bos: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of text.

        With parse_special, special tokens written in the text ("<|im_start|>") become their ids.
        With add_bos, a BOS is put first unless the ids already start with one: llama.cpp strips a
        chat template's leading BOS text before adding its own, and this has the same effect.
        Text that is not valid Unicode (lone surrogates: bytes that were not UTF-8, as Python decodes them
        from a command line or a pipe) is a PerfxError naming the first bad character.
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # the encoders' own error is a pybind11 cast failure
            near = text[max(error.start - 12, 0):error.end + 12]
            raise PerfxError(f"the text is not valid UTF-8: {error.object[error.start:error.end]!r} in {near!r} "
                             "is not a character (bytes in another encoding?); give UTF-8 text") from None
        ids = self._encoder(text, parse_special)
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids. Special tokens are written out; bytes that form no valid UTF-8 become U+FFFD."""
        ids = list(ids)
        self._check_ids(ids)
        text = b"".join(self._token_bytes[i] for i in ids).decode("utf-8", errors="replace")
        return text[1:] if self._strip_leading_space and text.startswith(" ") else text

    def stream_decoder(self) -> StreamDecoder:
        """A decoder that takes ids one at a time (see StreamDecoder)."""
        return StreamDecoder(self)

    def stream(self, ids: Iterable[int]) -> Iterator[str]:
        """Yield text pieces as ids arrive; their concatenation equals decode(ids)."""
        decoder = StreamDecoder(self)
        for token_id in ids:
            if piece := decoder.add(token_id):
                yield piece
        if piece := decoder.flush():
            yield piece

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """The prompt text for a conversation, rendered with the model's Jinja chat template.

        Rendering follows Hugging Face (sandboxed Jinja, trim_blocks and lstrip_blocks, with
        raise_exception, tojson, strftime_now, the {% generation %} tag, bos_token and eos_token available
        to the template). `template_kwargs` are more variables for the template, as Hugging Face's
        apply_chat_template takes them: enable_thinking=False turns Qwen3's and SmolLM3's thinking off.
        A model without a template gets ChatML (CHATML_TEMPLATE), or its family's fallback where its vocabulary
        has that family's turn tokens (Gemma's turns). A template that refuses a system message
        (Gemma 2's raises "System role not supported") gets it at the head of the next message, joined by a
        newline, as llama.cpp's chat code does. The result may start with the BOS text; encode(...,
        add_bos=True) then does not add a second BOS.
        """
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **template_kwargs}

        def render(conversation: list[dict[str, Any]]) -> str:
            return self._compiled_chat_template.render(
                variables, messages=conversation, add_generation_prompt=add_generation_prompt)

        try:
            try:
                return render(messages)
            except jinja2.TemplateError:
                if not messages or messages[0].get("role") != "system":
                    raise
                merged = [dict(message) for message in messages[1:2]]
                if merged:
                    merged[0]["content"] = f"{messages[0].get('content', '')}\n{merged[0].get('content', '')}"
                return render(merged + messages[2:])
        except jinja2.TemplateError as error:
            raise PerfxError(f"The chat template could not render this conversation: {error}") from error

    @property
    def has_thinking_switch(self) -> bool:
        """Whether the chat template reads enable_thinking (Qwen3, SmolLM3): a reasoning model that can be
        asked to answer without thinking first."""
        return "enable_thinking" in (self.chat_template or "")

    @property
    def fallback_chat_template(self) -> str:
        """The template a model without one of its own gets: its family's fallback where the vocabulary has that
        family's turn tokens (Gemma's), else ChatML."""
        vocabulary = set(self._tokens)
        return next((f.chat.fallback_template for f in FAMILIES.values()
                     if f.chat.fallback_template and set(f.chat.template_tokens) <= vocabulary), CHATML_TEMPLATE)

    @functools.cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        def raise_exception(message: str):
            raise jinja2.TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        environment.filters["tojson"] = tojson
        environment.globals["raise_exception"] = raise_exception
        environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return environment.from_string(self.chat_template or self.fallback_chat_template)
        except jinja2.TemplateSyntaxError as error:
            raise PerfxError(f"The model's chat template is not valid Jinja (line {error.lineno}: "
                             f"{error.message}); pass a model with a working template.") from error

    def _check_ids(self, ids: list[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= len(self._token_bytes)):
            bad = next(i for i in ids if not 0 <= i < len(self._token_bytes))
            raise PerfxError(f"Token id {bad} is outside this tokenizer's vocabulary "
                             f"(0 to {len(self._token_bytes) - 1}); were the ids made by another model?")

    # -- constructors ---------------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model directory.

        Reads tokenizer.json (through `tokenizers`) or else tokenizer.model (through `sentencepiece`),
        plus tokenizer_config.json (chat template, BOS/EOS tokens, add_bos_token) and
        generation_config.json / config.json (eos_token_id).
        """
        directory = Path(path)
        if not directory.is_dir():
            raise PerfxError(f"{directory} is not a directory; pass a Hugging Face model directory.")
        config = read_json(directory / "tokenizer_config.json", default={})
        if (directory / "tokenizer.json").is_file():
            build = _hf_tokenizers_parts
        elif (directory / "tokenizer.model").is_file():
            build = _hf_sentencepiece_parts
        else:
            raise PerfxError(
                f"No tokenizer found in {directory}: looked for tokenizer.json (Hugging Face tokenizers) "
                f"and tokenizer.model (SentencePiece). Copy the model's tokenizer files into it.")
        parts = build(directory, config)
        tokens = parts["tokens"]
        vocab = {token: i for i, token in enumerate(tokens) if token}
        model_config = read_json(directory / "config.json", default={})

        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))
        if bos_token:
            bos_id = vocab.get(bos_token)
        else:
            declared = _ids_in_range(model_config.get("bos_token_id", parts["bos_id"]), len(tokens))
            bos_id = declared[0] if declared else None
        # generation_config.json lists every id that ends a reply (Gemma 3: <eos> and <end_of_turn>).
        declared = _ids_in_range(parts["eos_id"], len(tokens))
        for source in (read_json(directory / "generation_config.json", default={}), model_config):
            declared += _ids_in_range(source.get("eos_token_id"), len(tokens))
        if eos_token in vocab:
            declared.append(vocab[eos_token])
        eos_ids = _end_of_generation_ids(tokens, declared)
        add_bos = config.get("add_bos_token")
        return cls(
            encoder=parts["encoder"], tokens=tokens, types=parts["types"],
            byte_level=parts["byte_level"], strip_leading_space=parts["strip_leading_space"],
            bos_id=bos_id, eos_ids=eos_ids,
            add_bos_token=parts["add_bos_token"] if add_bos is None else bool(add_bos),
            chat_template=_hf_chat_template(directory, config),
            bos_token=bos_token or (tokens[bos_id] if bos_id is not None else ""),
            eos_token=eos_token or (tokens[parts["eos_id"]] if parts["eos_id"] is not None else ""))

    @classmethod
    def from_gguf(cls, file_or_path: GGUFFile | str | Path) -> Tokenizer:
        """Load the tokenizer embedded in a GGUF file (a path or an open ``GGUFFile``).

        tokenizer.ggml.model "llama" is SentencePiece (rebuilt as a SentencePiece BPE model from the
        tokens, scores and types); "gpt2" is byte-level BPE (rebuilt with `tokenizers`, with
        llama.cpp's pre-tokenizer for tokenizer.ggml.pre). Both encode as llama.cpp does: special
        tokens are split out of the text first, and for SentencePiece each stretch of text after a
        special token starts with the prefix space. Whether a prompt gets a BOS follows
        tokenizer.ggml.add_bos_token when present, else llama.cpp's default for the tokenizer kind
        (the default model, SmolLM2, says false: its ChatML template starts every turn itself).
        """
        file = file_or_path if isinstance(file_or_path, GGUFFile) else GGUFFile(file_or_path)
        name, value = str(file.path), file.value

        model = value("tokenizer.ggml.model")
        tokens = value("tokenizer.ggml.tokens")
        if model is None or tokens is None:
            raise PerfxError(f"{name} has no embedded tokenizer (tokenizer.ggml.model/tokens missing); "
                             f"pass a model directory with tokenizer files instead.")
        types = value("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
        if model == "llama":
            scores = value("tokenizer.ggml.scores")
            if scores is None:
                raise PerfxError(f"{name}: SentencePiece tokenizer without tokenizer.ggml.scores.")
            # Gemma says false: no "▁" before the first word, and none after a special token.
            add_space_prefix = bool(value("tokenizer.ggml.add_space_prefix", True))
            processor = _sentencepiece_from_vocab(tokens, scores, types, add_space_prefix,
                                                  value("tokenizer.ggml.unknown_token_id", 0), name)
            encode_text, backend = processor.encode, processor
            byte_level, strip_leading_space, add_bos_default = False, add_space_prefix, True
        elif model == "gpt2":
            pre = value("tokenizer.ggml.pre", "default")
            merges = value("tokenizer.ggml.merges")
            if merges is None:
                raise PerfxError(f"{name}: BPE tokenizer without tokenizer.ggml.merges.")
            backend, add_bos_default = _byte_level_bpe(tokens, types, merges, pre, name)
            encode_text = _TokenizersEncoder(backend).text
            byte_level, strip_leading_space = True, False
        else:
            raise PerfxError(f"{name} uses tokenizer model {model!r}, which perfx does not support: it reads "
                             f"'llama' (SentencePiece) and 'gpt2' (byte-level BPE) tokenizers.")

        encoder = _SpecialTokenEncoder(encode_text, tokens, types,
                                       _rstrip_ids(value("general.name", ""), tokens, types), backend)
        bos_ids = _ids_in_range(value("tokenizer.ggml.bos_token_id"), len(tokens))
        eos_id = _ids_in_range(value("tokenizer.ggml.eos_token_id"), len(tokens))
        declared = [i for key in ("eos", "eot", "eom")
                    for i in _ids_in_range(value(f"tokenizer.ggml.{key}_token_id"), len(tokens))]
        fim_ids = [i for key in ("pad", "rep", "sep")
                   for i in _ids_in_range(value(f"tokenizer.ggml.fim_{key}_token_id"), len(tokens))]
        return cls(
            encoder=encoder, tokens=tokens, types=types, byte_level=byte_level,
            strip_leading_space=strip_leading_space, bos_id=bos_ids[0] if bos_ids else None,
            eos_ids=_end_of_generation_ids(tokens, declared, fim_ids),
            add_bos_token=bool(value("tokenizer.ggml.add_bos_token", add_bos_default)),
            chat_template=value("tokenizer.chat_template"),
            bos_token=tokens[bos_ids[0]] if bos_ids else "",
            eos_token=tokens[eos_id[0]] if eos_id else "")


class _GenerationTag(jinja2.ext.Extension):
    """Hugging Face's {% generation %} ... {% endgeneration %} (SmolLM3's template has it): it marks the
    assistant's text for training masks, and renders its body unchanged (transformers' AssistantTracker)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


class StreamDecoder:
    """Turns ids, added one at a time, into text pieces for printing as generation goes.

    A piece never ends in the middle of a UTF-8 character: incomplete bytes wait for the next
    token. Call flush() at the end; the pieces then concatenate to exactly Tokenizer.decode(ids).
    Like decode(), a SentencePiece model's first piece loses its prefix space ("▁Hello" → "Hello"),
    so a reply streamed after a chat prompt starts with its first word, as in Hugging Face's streamer.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = True

    def add(self, token_id: int) -> str:
        """Text completed by this token ("" while a character is still incomplete)."""
        self._tokenizer._check_ids([token_id])
        return self._emit(self._utf8.decode(self._tokenizer._token_bytes[token_id]))

    def flush(self) -> str:
        """Whatever is still held back (incomplete bytes come out as U+FFFD)."""
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if self._at_start and text:
            self._at_start = False
            if self._tokenizer._strip_leading_space and text.startswith(" "):
                return text[1:]
        return text


# -- encoders ------------------------------------------------------------------------------------------

class _TokenizersEncoder:
    """Encoding through a `tokenizers.Tokenizer`, which splits out added/special tokens itself."""

    def __init__(self, backend):
        self.backend = backend

    def __call__(self, text: str, parse_special: bool) -> list[int]:
        self.backend.encode_special_tokens = not parse_special
        return self.backend.encode(text, add_special_tokens=False).ids

    def text(self, text: str) -> list[int]:
        """Ids of text with no special token in it (split out before, as llama.cpp does)."""
        return self(text, parse_special=False)


class _SpecialTokenEncoder:
    """llama.cpp's encoding around special tokens (llama-vocab.cpp, tokenizer_st_partition), then
    `encode_text` for each stretch of text between them.

    Special tokens are taken longest first, each splitting every stretch left by the longer ones: control
    and unknown tokens only with parse_special, user-defined ones (Gemma's runs of spaces and newlines,
    Qwen3's <think>) always. The whitespace after a right-stripping token (Phi-3's) is dropped. Each stretch
    is encoded on its own, so a SentencePiece model gives each its prefix space, as llama.cpp gives one to
    the text after a special token.
    """

    def __init__(self, encode_text: Callable[[str], list[int]], tokens: list[str], types: list[int],
                 rstrip_ids: frozenset[int] = frozenset(), backend: Any = None):
        self.encode_text = encode_text
        self.backend = backend
        self.rstrip_ids = rstrip_ids
        # (text, id, split even without parse_special, first two characters or "" for a one-character token)
        self.specials = sorted(((token, i, kind == TokenType.USER_DEFINED, token[:2] if len(token) > 1 else "")
                                for i, (token, kind) in enumerate(zip(tokens, types))
                                if kind in _PARSED_FROM_TEXT and token), key=lambda special: -len(special[0]))

    def __call__(self, text: str, parse_special: bool) -> list[int]:
        pieces: list[str | int] = [text] if text else []
        # The text's character pairs rule out most of the thousands of special tokens (Gemma's <unusedN>)
        # at a set lookup each.
        pairs = {text[i:i + 2] for i in range(len(text) - 1)}
        for token, token_id, always, head in self.specials:
            if (always or parse_special) and (not head or head in pairs) and token in text:
                pieces = self._split(pieces, token, token_id)
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                ids.append(piece)
            else:
                ids += self.encode_text(piece)
        return ids

    def _split(self, pieces: list[str | int], token: str, token_id: int) -> list[str | int]:
        strip = token_id in self.rstrip_ids
        out: list[str | int] = []
        for piece in pieces:
            if isinstance(piece, int) or token not in piece:
                out.append(piece)
                continue
            for k, part in enumerate(piece.split(token)):
                if k:
                    out.append(token_id)
                    if strip:
                        part = part.lstrip(_C_WHITESPACE)
                if part:
                    out.append(part)
        return out


def _ids_in_range(value: Any, size: int) -> list[int]:
    """Token ids from a config value (an int, a list of ints or null) that exist in the vocabulary."""
    values = value if isinstance(value, list) else [value]
    return [i for i in values if isinstance(i, int) and 0 <= i < size]


def _special_tokens(tokens: list[str], types: list[int], kinds: tuple[int, ...]) -> dict[str, int]:
    return {token: i for i, (token, kind) in enumerate(zip(tokens, types)) if kind in kinds and token}


def _end_of_generation_ids(tokens: list[str], declared: Iterable[int] = (),
                            fim_ids: Iterable[int] = ()) -> set[int]:
    """The ids that end a reply, as llama.cpp finds them (llama-vocab.cpp, special_eog_ids).

    The end-of-generation names wherever they are, whatever their type; the fill-in-the-middle pad,
    repository and file-separator tokens (`fim_ids` where the file names them, else the first of each
    kind's names found); and the declared eos / eot / eom ids. Of a vocabulary with gpt-oss's <|return|>
    and <|call|> (or <|calls|> and <|flush|>), <|end|> ends only a message, not the reply; of one with
    Gemma 4's <|tool_response>, </s> is plain text: llama.cpp drops those two.
    """
    index = {token: i for i, token in enumerate(tokens) if token}
    ids = {index[name] for name in _END_OF_GENERATION_TOKENS if name in index}
    ids.update(fim_ids)
    if not fim_ids:
        ids.update(next((index[name] for name in names if name in index), None) for names in _FIM_END_TOKENS)
        ids.discard(None)
    ids.update(declared)
    texts = {tokens[i]: i for i in ids}
    calls = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and calls and ("<|return|>" in texts or "<|flush|>" in texts):
        ids.discard(texts["<|end|>"])
    if "</s>" in texts and "<|tool_response>" in texts:
        ids.discard(texts["</s>"])
    return ids


def _rstrip_ids(model_name: str, tokens: list[str], types: list[int]) -> frozenset[int]:
    """Special tokens after which llama.cpp drops whitespace: of a family with ChatRules.rstrip_names (Phi-3's),
    all but its rstrip_keep (<unk>, <s> and <|endoftext|>), chosen, as llama.cpp chooses them, by general.name
    (llama-vocab.cpp, load)."""
    name = model_name.lower()
    rules = next((f.chat for f in FAMILIES.values() if any(n in name for n in f.chat.rstrip_names)), None)
    if rules is None:
        return frozenset()
    keep = set(rules.rstrip_keep)
    return frozenset(i for i, (token, kind) in enumerate(zip(tokens, types))
                     if kind in _PARSED_FROM_TEXT and token not in keep)


# -- GGUF ----------------------------------------------------------------------------------------------

def _sentencepiece_from_vocab(tokens: list[str], scores: list[float], types: list[int],
                              add_space_prefix: bool, unknown_id: int, name: str):
    """A SentencePiece processor for a GGUF vocabulary, with llama.cpp's tokenizer behaviour."""
    proto = _sentencepiece_model_proto(tokens, scores, types, add_space_prefix, unknown_id)
    try:
        return sentencepiece.SentencePieceProcessor(model_proto=proto)
    except RuntimeError as error:
        raise PerfxError(f"{name}: its SentencePiece vocabulary could not be loaded ({error}).") from error


def _sentencepiece_model_proto(tokens: list[str], scores: list[float], types: list[int],
                               add_space_prefix: bool, unknown_id: int) -> bytes:
    """A SentencePiece ModelProto (sentencepiece's own sentencepiece_model.proto) for a GGUF vocabulary.

    Model type BPE: pieces merge in score order, which is llama.cpp's SPM algorithm. The "identity"
    normalizer with whitespace kept matches llama.cpp, which does not normalize; a GGUF does not carry
    the original normalization rules anyway. Special tokens never reach SentencePiece (they are split out
    first), so the pieces' types are set for the merging alone: user-defined pieces merge like any other,
    as in llama.cpp's vocabulary lookup, and of several pieces typed unknown (Phi-3's padding, as older
    converters wrote it) only the declared one stays so, since SentencePiece takes exactly one.
    """
    if not 0 <= unknown_id < len(tokens):
        unknown_id = next((i for i, kind in enumerate(types) if kind == TokenType.UNKNOWN), 0)
    proto = sentencepiece_model_pb2.ModelProto()
    for i, (token, score, kind) in enumerate(zip(tokens, scores, types)):
        if i == unknown_id:
            kind = TokenType.UNKNOWN
        elif kind == TokenType.UNKNOWN:
            kind = TokenType.UNUSED
        elif kind == TokenType.USER_DEFINED:
            kind = TokenType.NORMAL
        proto.pieces.add(piece=token, score=score, type=int(kind))
    proto.trainer_spec.model_type = sentencepiece_model_pb2.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = TokenType.BYTE in types
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = add_space_prefix
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    return proto.SerializeToString()


def _byte_level_bpe(tokens: list[str], types: list[int], merges: list[str], pre: str, name: str):
    """A `tokenizers` byte-level BPE with llama.cpp's pre-tokenizer for `pre`; returns (backend, add_bos).

    The special tokens are added to it too, so that a tokenizer.json saved from it encodes alike."""
    if pre not in _BPE_PRE_TOKENIZERS:
        known = ", ".join(sorted(_BPE_PRE_TOKENIZERS))
        raise PerfxError(f"{name} uses BPE pre-tokenizer {pre!r}, which perfx does not know; "
                         f"known ones: {known}.")
    regexes, ignore_merges, add_bos = _BPE_PRE_TOKENIZERS[pre]
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    options = {"ignore_merges": True} if ignore_merges else {}
    try:
        backend = tokenizers.Tokenizer(models.BPE(vocab, pairs, **options))
    except Exception as error:  # tokenizers raises plain Exception for inconsistent vocab/merges
        raise PerfxError(f"{name}: its BPE vocabulary and merges do not fit together ({error}).") from error
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()  # unused by perfx; keeps a saved tokenizer.json complete
    specials = _special_tokens(tokens, types, (TokenType.CONTROL, TokenType.UNKNOWN))
    user_defined = _special_tokens(tokens, types, (TokenType.USER_DEFINED,))
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in user_defined])
    return backend, add_bos


# -- Hugging Face directories --------------------------------------------------------------------------

def _token_content(entry: Any) -> str:
    """A special token from tokenizer_config.json: a string or an {"content": ...} object."""
    if isinstance(entry, dict):
        return entry.get("content", "")
    return entry or ""


def _hf_chat_template(directory: Path, config: dict) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template:
        return template
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return read_json(directory / "chat_template.json", default={}).get("chat_template")


def _hf_tokenizers_parts(directory: Path, config: dict) -> dict:
    path = directory / "tokenizer.json"
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises plain Exception on a bad file
        raise PerfxError(f"Could not load {path} ({error}); is the model download complete?") from error
    spec = read_json(path)
    byte_level, strip_leading_space = _hf_decoding_style(spec.get("decoder"), path)
    byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))

    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = [""] * (max(vocab.values()) + 1)
    types = [TokenType.UNUSED] * len(tokens)  # ids missing from the vocabulary decode to nothing
    for token, i in vocab.items():
        tokens[i] = token
        types[i] = TokenType.BYTE if byte_fallback and _BYTE_PIECE.fullmatch(token) else TokenType.NORMAL
    for i, added in backend.get_added_tokens_decoder().items():
        types[i] = TokenType.CONTROL if added.special else TokenType.USER_DEFINED

    bos_token = _token_content(config.get("bos_token"))
    return dict(encoder=_TokenizersEncoder(backend), tokens=tokens, types=types, byte_level=byte_level,
                strip_leading_space=strip_leading_space, bos_id=None, eos_id=None,
                add_bos_token=_post_processor_adds(spec.get("post_processor"), bos_token))


def _hf_decoding_style(decoder: dict | None, path: Path) -> tuple[bool, bool]:
    """(byte_level, strip_leading_space) from tokenizer.json's decoder."""
    decoder = decoder or {}
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {step.get("type") for step in steps}
    if "ByteLevel" in kinds:
        return True, False
    if "Metaspace" in kinds:
        step = next(step for step in steps if step.get("type") == "Metaspace")
        prepends = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
        return False, prepends != "never"
    if any(step.get("type") == "Replace" and (step.get("pattern") or {}).get("String") == _SPACE_MARKER
           for step in steps):
        strips = any(step.get("type") == "Strip" and step.get("start", 0) > 0 for step in steps)
        return False, strips
    raise PerfxError(f"{path}: decoder {sorted(k for k in kinds if k)} is not supported; perfx decodes "
                     f"byte-level BPE and SentencePiece-style (\u2581) tokenizers.")


def _post_processor_adds(post_processor: dict | None, bos_token: str) -> bool:
    """Whether tokenizer.json's post-processor puts bos_token before a single sequence."""
    post_processor = post_processor or {}
    steps = (post_processor.get("processors", []) if post_processor.get("type") == "Sequence"
             else [post_processor])
    for step in steps:
        if step.get("type") == "TemplateProcessing" and step.get("single"):
            first = step["single"][0]
            return bool(bos_token) and first.get("SpecialToken", {}).get("id") == bos_token
    return False


def _hf_sentencepiece_parts(directory: Path, config: dict) -> dict:
    path = directory / "tokenizer.model"
    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as error:
        raise PerfxError(f"Could not load {path} as a SentencePiece model ({error}).") from error
    tokens = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    types = [_sentencepiece_piece_type(processor, i) for i in range(len(tokens))]
    # Tokens added on top of the SentencePiece model (ids past its end), from tokenizer_config.json.
    for key, entry in sorted(config.get("added_tokens_decoder", {}).items(), key=lambda item: int(item[0])):
        i = int(key)
        if i >= len(tokens):
            tokens += [""] * (i + 1 - len(tokens))
            types += [TokenType.UNUSED] * (i + 1 - len(types))
            tokens[i] = _token_content(entry)
            types[i] = TokenType.CONTROL if entry.get("special", True) else TokenType.USER_DEFINED
    return dict(encoder=_SpecialTokenEncoder(processor.encode, tokens, types, backend=processor),
                tokens=tokens, types=types,
                byte_level=False, strip_leading_space=processor.normalize("x").startswith(_SPACE_MARKER),
                bos_id=_non_negative(processor.bos_id()), eos_id=_non_negative(processor.eos_id()),
                # Llama's slow tokenizer adds BOS unless tokenizer_config.json says otherwise.
                add_bos_token=True)


def _sentencepiece_piece_type(processor, i: int) -> TokenType:
    # The Python API cannot tell user-defined pieces from normal ones; both decode the same way.
    if processor.is_control(i):
        return TokenType.CONTROL
    if processor.is_unknown(i):
        return TokenType.UNKNOWN
    if processor.is_byte(i):
        return TokenType.BYTE
    if processor.is_unused(i):
        return TokenType.UNUSED
    return TokenType.NORMAL


def _non_negative(value: int) -> int | None:
    return value if value >= 0 else None
