"""Constrained decoding: a grammar's hold on one reply, through llguidance (the engine llama.cpp and vLLM use).

A ``Constraint`` is made from a JSON schema (``from_json_schema``), from "any JSON object" (``json_object``,
OpenAI's JSON mode) or from a Lark grammar in llguidance's dialect (``from_lark``: text around JSON, such as a
tool call's ``<tool_call>`` + JSON + ``</tool_call>``). Each step the host asks it for the tokens allowed next
(``allowed``: a bitmask of one bit a token, uint32 words, token i at bit i mod 32 of word i / 32, the layout
``kernels/logit_mask.cl`` reads) and tells it the token chosen (``advance``). The end-of-generation ids are
allowed exactly when the grammar accepts what was made; ``done`` says that nothing but the end may follow.

llguidance is optional (``pip install 'perfx[structured]'``): a constraint asked for without it is a
PerfxError that says how to install it. Its tokenizer is built once per perfx tokenizer, from every id's
bytes; ids the tokenizer marks special (``Tokenizer.special_ids``) and its end-of-generation ids are named
by a grammar, never spelled by its text (llama.cpp's rule: their bytes start with 0xFF).
"""

from __future__ import annotations

import importlib.util
import json
import threading
import weakref

import numpy as np

from perfx.errors import PerfxError

INSTALL = "pip install 'perfx[structured]' (or: pip install llguidance)"
# Replies in compact JSON with one space after ':' and ',' (as json.dumps writes): no run of whitespace a
# model could fill its whole budget with (llguidance's whitespace_flexible), and what most models write anyway.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def available() -> bool:
    """Whether llguidance is installed: what is only constrained where it can be (the generic tool format's
    answers) goes unconstrained without it."""
    return importlib.util.find_spec("llguidance") is not None


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise PerfxError(f"constrained decoding (JSON schemas, JSON mode, grammars) needs llguidance: {INSTALL}") \
            from None
    return llguidance


class _Vocabulary:
    """A perfx tokenizer as llguidance's TokenizerWrapper reads one: every id's bytes, the special ids marked,
    the end-of-generation ids, and text to ids."""

    def __init__(self, tokenizer):
        special = set(tokenizer.special_ids) | set(tokenizer.eos_ids)
        if tokenizer.bos_id is not None:
            special.add(tokenizer.bos_id)
        self.tokens = [b"\xff" + b if i in special else b for i, b in enumerate(tokenizer.token_bytes())]
        self.special_token_ids = sorted(special)
        self.eos_token_id = min(tokenizer.eos_ids) if tokenizer.eos_ids else None
        self.bos_token_id = tokenizer.bos_id
        self._encode = tokenizer.encode
        self._bytes = tokenizer.token_bytes()
        self._by_bytes = {b: i for i, b in enumerate(self._bytes) if i not in special and b}
        self._longest = max(map(len, self._by_bytes), default=1)

    def __call__(self, text) -> list[int]:
        """Ids that spell exactly ``text`` where it continues a reply (llguidance asks for the tokens of forced
        text): perfx's encoding after a marker character, without the marker's ids, so that SentencePiece's
        prefix space (which starts a text, not a continuation) is not spelled; where the marker merged with the
        text, a greedy longest match."""
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        if not data:
            return []
        ids = self._encode("\x02" + data.decode("utf-8", errors="replace"), parse_special=False)
        held = b""
        for k, i in enumerate(ids):
            held += self._bytes[i]
            if held in (b"\x02", b" \x02"):
                rest = ids[k + 1:]
                if b"".join(self._bytes[i] for i in rest) == data:
                    return rest
                break
            if len(held) > 2:
                break
        return self._greedy(data)

    def _greedy(self, data: bytes) -> list[int]:
        ids, at = [], 0
        while at < len(data):
            for n in range(min(self._longest, len(data) - at), 0, -1):
                i = self._by_bytes.get(data[at:at + n])
                if i is not None:
                    ids.append(i)
                    at += n
                    break
            else:
                raise PerfxError(f"the tokenizer cannot spell the byte {data[at:at + 1]!r}: no token holds it")
        return ids


_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LL_LOCK = threading.Lock()


def ll_tokenizer(tokenizer):
    """llguidance's tokenizer of a perfx ``Tokenizer``, built once per tokenizer (a second or so for a large
    vocabulary)."""
    llg = _llguidance()
    with _LL_LOCK:
        made = _LL_TOKENIZERS.get(tokenizer)
        if made is None:
            vocabulary = _Vocabulary(tokenizer)
            eos = sorted(tokenizer.eos_ids) or None
            made = llg.LLTokenizer(llg.TokenizerWrapper(vocabulary), eos_token=eos)
            _LL_TOKENIZERS[tokenizer] = made
        return made


class Constraint:
    """The tokens a grammar allows next in one reply, and the reply's progress through it.

    Make one per reply (``copy`` a compiled one for the next); its methods are not thread-safe.
    """

    def __init__(self, grammar: str, tokenizer, what: str = "the grammar"):
        """``grammar``: llguidance's grammar (``llguidance.LLMatcher.grammar_from_*``); ``what`` names it in
        errors. Raises PerfxError when the grammar is invalid or uses what llguidance does not support."""
        llg = _llguidance()
        ll = ll_tokenizer(tokenizer)
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, ll)
        if failed:
            raise PerfxError(f"{what} is not supported: {messages[0]}")
        matcher = llg.LLMatcher(ll, grammar, log_level=0)
        if matcher.is_error():
            raise PerfxError(f"{what} is not supported: {matcher.get_error()}")
        self._setup(matcher, tokenizer, what)

    def _setup(self, matcher, tokenizer, what: str):
        self._matcher, self.tokenizer, self.what = matcher, tokenizer, what
        self.vocab_size = tokenizer.vocab_size
        self.eos_ids = sorted(tokenizer.eos_ids)
        self._eos = np.zeros((self.vocab_size + 31) // 32, np.uint32)
        for i in self.eos_ids:
            self._eos[i // 32] |= np.uint32(1 << (i % 32))

    @classmethod
    def from_json_schema(cls, schema: dict | str | bool, tokenizer) -> Constraint:
        """Replies that are JSON documents valid against ``schema`` (a dict, or its JSON text). Raises
        PerfxError naming what llguidance does not support (``Unimplemented keys: ["if", "then"]``) or what
        is wrong with the schema."""
        llg = _llguidance()
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise PerfxError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise PerfxError(f"a JSON schema is an object (or true/false), not {type(schema).__name__}")
        return cls(llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS), tokenizer,
                   "the JSON schema")

    @classmethod
    def json_object(cls, tokenizer) -> Constraint:
        """Replies that are any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls.from_json_schema({"type": "object"}, tokenizer)

    @classmethod
    def from_lark(cls, lark: str, tokenizer) -> Constraint:
        """Replies in a Lark grammar of llguidance's dialect (its ``start`` rule): ``%json {schema}`` embeds a
        JSON schema, and ``<name>`` a special token by its text, so a tool call is
        ``start: <tool_call> %json {...} </tool_call>`` where the tokenizer has those tokens (else write them
        as strings: ``"<tool_call>"``)."""
        return cls(_llguidance().LLMatcher.grammar_from_lark(lark), tokenizer, "the grammar")

    def copy(self) -> Constraint:
        """A constraint at the same point of the same grammar, advanced on its own from here."""
        other = object.__new__(Constraint)
        other._setup(self._matcher.deep_copy(), self.tokenizer, self.what)
        return other

    def allowed(self) -> np.ndarray:
        """The tokens allowed next: ceil(V / 32) uint32 words, V the tokenizer's vocabulary. The
        end-of-generation ids are set exactly where the grammar accepts the reply so far."""
        if self._matcher.is_error():
            raise PerfxError(f"{self.what}: {self._matcher.get_error()}")
        if self._matcher.is_stopped():
            return self._eos.copy()
        mask = np.frombuffer(self._matcher.compute_bitmask(), np.uint32)[: len(self._eos)].copy()
        eos = self._eos if self._matcher.is_accepting() else 0
        mask = (mask & ~self._eos) | eos
        if not mask.any():
            raise PerfxError(f"{self.what} allows no token here (the tokenizer cannot spell what it needs)")
        return mask

    def advance(self, token: int) -> None:
        """The reply goes on with ``token`` (one ``allowed`` gave; not an end-of-generation id)."""
        if not self._matcher.consume_token(int(token)):
            raise PerfxError(f"{self.what}: token {token} ({self.tokenizer.decode([token])!r}) is not allowed here"
                             f": {self._matcher.get_error()}")

    @property
    def accepting(self) -> bool:
        """Whether the reply so far is a whole sentence of the grammar (it may end here)."""
        return self._matcher.is_accepting()

    @property
    def done(self) -> bool:
        """Whether nothing but the end may follow: the reply is complete."""
        return self._matcher.is_stopped()
