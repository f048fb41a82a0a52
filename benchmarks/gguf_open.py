"""Opening a GGUF: perfx's reader (perfx.gguf_file.GGUFFile) against gguf-py's GGUFReader.

Files: tests/data/vocab/*.gguf (pruned vocabularies, no tensors), a synthetic GGUF with a 262,144-token
SentencePiece vocabulary (Gemma 3's size: tokens, scores, token types) and a Q8_0 token_embd tensor, and any
path given. Each round opens every file with both readers, the order alternating between rounds; "open" is
the constructor, "+ vocabulary" adds reading tokens, scores and token types as Python lists (what
ModelConfig.from_gguf and Tokenizer.from_gguf take; for gguf-py by the formula perfx used with it). Printed:
the median over rounds, [min, max].

    python benchmarks/gguf_open.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from perfx.gguf_file import GGUFFile

ROOT = Path(__file__).resolve().parent.parent
VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")


def write_large_vocabulary(path: Path, n_tokens: int = 262_144, hidden: int = 64) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<pad>", "<eos>", "<bos>"] + [f"\u2581tok{i}" for i in range(3, n_tokens)])
    writer.add_token_scores((-np.arange(n_tokens, dtype=np.float32)).tolist())
    writer.add_token_types([3, 3, 3] + [1] * (n_tokens - 3))
    blocks = rng.integers(0, 256, (n_tokens, hidden // 32 * 34), dtype=np.uint8)
    writer.add_tensor("token_embd.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_py_value(field):
    if field.types[0] == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [item for i in field.data for item in field.parts[i].tolist()]
    return field.parts[-1].tolist()[0]


def ours(path: Path) -> tuple[float, float]:
    start = time.perf_counter()
    file = GGUFFile(path)
    opened = time.perf_counter()
    for name in VOCABULARY:
        file.value(name)
    return opened - start, time.perf_counter() - start


def theirs(path: Path) -> tuple[float, float]:
    start = time.perf_counter()
    reader = gguf.GGUFReader(str(path))
    opened = time.perf_counter()
    for name in VOCABULARY:
        if name in reader.fields:
            gguf_py_value(reader.fields[name])
    return opened - start, time.perf_counter() - start


def summary(samples: list[float]) -> str:
    return f"{statistics.median(samples):.4f} s [{min(samples):.4f}, {max(samples):.4f}]"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="more GGUF files to open")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        files = sorted((ROOT / "tests" / "data" / "vocab").glob("*.gguf")) + args.paths
        files.append(write_large_vocabulary(Path(tmp) / "vocab-262144.gguf"))
        times = {(path, reader.__name__): [] for path in files for reader in (ours, theirs)}
        for round_ in range(args.rounds):
            for path in files:
                for reader in ((ours, theirs) if round_ % 2 == 0 else (theirs, ours)):
                    times[path, reader.__name__].append(reader(path))
        print(f"{'file':34} {'reader':8} {'open':32} {'open + vocabulary':32} {'gguf-py / perfx (open)':>10}")
        for path in files:
            for reader in ("ours", "theirs"):
                samples = times[path, reader]
                ratio = (statistics.median(s[0] for s in times[path, "theirs"])
                         / statistics.median(s[0] for s in times[path, "ours"]))
                print(f"{path.name:34} {'perfx' if reader == 'ours' else 'gguf-py':8} "
                      f"{summary([s[0] for s in samples]):32} {summary([s[1] for s in samples]):32} "
                      + (f"{ratio:10.0f}×" if reader == "theirs" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
