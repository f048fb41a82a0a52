"""llama-perplexity's method over the float64 reference forward: what `perfx perplexity` is checked against."""

from perfx import forward64
from perfx.commands.perplexity import nll_rows
from perfx.sources import open_model


def reference_nll(path, text: str, ctx: int, chunks: int) -> tuple[float, int, bool]:
    """(mean NLL, predictions scored, whether the ids start with BOS): each chunk of ``ctx`` tokens from an
    empty cache, its first token replaced by BOS where the model adds one, the second half scored."""
    source = open_model(path)
    tok = source.tokenizer
    ids = tok.encode(text, add_bos=tok.add_bos_token, parse_special=False)
    total, count = 0.0, 0
    for i in range(chunks):
        chunk = ids[i * ctx:(i + 1) * ctx]
        if tok.add_bos_token:
            chunk = [tok.bos_id] + chunk[1:]
        logits, _ = forward64.model_forward(source, chunk, ctx=ctx)
        nll = nll_rows(logits[ctx // 2:ctx - 1], ids[i * ctx + ctx // 2 + 1:(i + 1) * ctx])
        total, count = total + nll.sum(), count + len(nll)
    return total / count, count, ids[0] == tok.bos_id
