"""A model whose greedy reply is a script: the tiny random model never calls a tool by itself, so the tool-call
paths of `perfx serve` and `perfx chat` get the text a model that does would write."""

from __future__ import annotations


class ScriptedModel:
    """The model, but its greedy reply is ``say``'s text (as the tokenizer's ids) and then an end of turn. The
    forward still runs every step, so the KV cache holds the reply as it would."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer, self.script = model, tokenizer, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def say(self, text: str):
        self.script = self.tokenizer.encode(text) + [min(self.tokenizer.eos_ids)]

    def argmax(self) -> int:
        return self.script[0]

    def greedy_tokens(self, token: int, pos: int, last: int):
        for q, chosen in zip(range(pos, last + 1), self.script[1:]):
            self.model.decode_one(token, q)
            token = chosen
            yield chosen
