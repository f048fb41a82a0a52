"""A model whose greedy reply is a script: the tiny random model never calls a tool by itself, so the tool-call
paths of `perfx serve` and `perfx chat` get the text a model that does would write."""

from __future__ import annotations


class ScriptedModel:
    """The model, but its greedy reply is ``say``'s text (as the tokenizer's ids) and then an end of turn. The
    forward still runs every step, so the KV cache holds the reply as it would."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer, self.script = model, tokenizer, []
        self.masked = 0      # the script's tokens chosen under a grammar's mask so far

    def __getattr__(self, name):
        return getattr(self.model, name)

    def say(self, text: str):
        ids = self.tokenizer.encode(text)
        if ids and self.tokenizer.decode(ids[:1]) == "":
            ids = ids[1:]   # a SentencePiece text's bare prefix space, which a reply continuing its prompt lacks
        self.script = ids + [min(self.tokenizer.eos_ids)]
        self.masked = 0

    def argmax(self) -> int:
        return self.script[0]

    def greedy_tokens(self, token: int, pos: int, last: int):
        for q, chosen in zip(range(pos, last + 1), self.script[1:]):
            self.model.decode_one(token, q)
            token = chosen
            yield chosen

    def masked_token(self, allowed, config, seed: int, seen: list[int], pos: int) -> int:
        """Under a grammar (a constrained reply), the script's next token, which the grammar's mask must allow:
        the text a model writes, in its own tokens, is text the grammar takes."""
        token = self.script[self.masked]
        self.masked += 1
        assert allowed[token // 32] >> (token % 32) & 1, \
            f"the grammar forbids the script's token {token} ({self.tokenizer.decode([token])!r}) after {seen[-8:]}"
        return token
