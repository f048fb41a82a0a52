"""A tiny SentencePiece tokenizer, trained in well under a second, and its export into GGUF metadata.

The model is byte-fallback BPE with the "identity" normalizer and whitespace kept, like Llama's own
tokenizer.model, so llama.cpp's tokenizer and SentencePiece give the same ids for plain text.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import gguf
import sentencepiece

USER_DEFINED_SYMBOLS = ("<|im_start|>", "<|im_end|>")

_SYLLABLES = ("ka", "to", "ri", "mu", "sen", "la", "do", "pe", "qui", "zor", "an", "el", "ba", "ne", "vo",
              "the", "ing", "er", "st", "ou")


def tiny_corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    """Made-up sentences over a fixed syllable set, plus a few lines of accents, digits and symbols."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(300)]
    sentences = [
        " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + rng.choice(".!?,")
        for _ in range(lines)
    ]
    extras = ["Hello world! Café naïve déjà vu, über alles.", "0123456789 $ % & # ( ) [ ] + - = /"]
    return sentences + extras


def train_tiny_spm(directory: str | Path, vocab_size: int = 400, add_dummy_prefix: bool = True) -> Path:
    """Train the tiny model and write it as directory/tokenizer.model; returns that path.

    ``add_dummy_prefix`` False gives Gemma's kind of tokenizer.model (no "▁" put before the text).
    """
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(tiny_corpus()), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=add_dummy_prefix,
        user_defined_symbols=list(USER_DEFINED_SYMBOLS), num_threads=1, minloglevel=2,
    )
    path = Path(directory) / "tokenizer.model"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return path


def write_tokenizer_to_gguf(writer: gguf.GGUFWriter, sp_model_path: str | Path) -> None:
    """Add the model's vocabulary to writer as tokenizer.ggml.* keys, as llama.cpp's converter does."""
    model_bytes = Path(sp_model_path).read_bytes()
    processor = sentencepiece.SentencePieceProcessor(model_proto=model_bytes)
    size = processor.get_piece_size()
    writer.add_tokenizer_model("llama")
    writer.add_token_list([processor.id_to_piece(i) for i in range(size)])
    writer.add_token_scores([processor.get_score(i) for i in range(size)])
    writer.add_token_types(piece_types(model_bytes))
    writer.add_bos_token_id(processor.bos_id())
    writer.add_eos_token_id(processor.eos_id())
    writer.add_unk_token_id(processor.unk_id())
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(processor.normalize("x").startswith("\u2581"))


def write_tokenizer_only_gguf(path: str | Path, sp_model_path: str | Path, arch: str = "llama") -> Path:
    """A GGUF file holding just the tokenizer (no tensors)."""
    writer = gguf.GGUFWriter(str(path), arch)
    write_tokenizer_to_gguf(writer, sp_model_path)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def piece_types(model_bytes: bytes) -> list[int]:
    """Each piece's type (1 normal ... 6 byte), read from the serialized ModelProto.

    sentencepiece's Python API cannot tell user-defined pieces apart, and its pb2 module needs the
    protobuf package, so the few fields needed are read straight from the wire format:
    ModelProto.pieces = 1, SentencePiece.type = 3 (default NORMAL).
    """
    types = []
    for number, value in _proto_fields(model_bytes):
        if number == 1:
            fields = dict(_proto_fields(value))
            types.append(fields.get(3, gguf.TokenType.NORMAL))
    return types


def _proto_fields(data: bytes):
    """(field number, value) pairs of one protobuf message: ints for varints, bytes otherwise."""
    position = 0

    def varint() -> int:
        nonlocal position
        result = shift = 0
        while True:
            byte = data[position]
            position += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return result

    while position < len(data):
        key = varint()
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            yield number, varint()
        elif wire_type == 2:
            length = varint()
            yield number, data[position:position + length]
            position += length
        elif wire_type == 5:
            yield number, data[position:position + 4]
            position += 4
        elif wire_type == 1:
            yield number, data[position:position + 8]
            position += 8
        else:
            raise ValueError(f"unexpected protobuf wire type {wire_type}")
