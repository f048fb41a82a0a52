"""Fidelity against llama.cpp on the same GGUF files: prompt ids, perplexity, logits, greedy tokens.

Benchmark-only: llama-cpp-python (never a perfx dependency) quantizes and evaluates; perfx runs on its OpenCL
device. Steps, all on the same files and the same text:

1. files: the default model (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 tied embedding) written again as an F32
   GGUF from its dequantized weights (metadata copied), then requantized by llama.cpp's own
   ``llama_model_quantize`` to Q4_K_M, Q5_K_M and Q8_0. SmolLM2's rows of 576 are no multiple of 256, so
   llama-quantize writes its fallbacks there (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0) and K-quants only in
   ffn_down (rows of 1536); a tiny random Llama-3-style model with rows of 256 and a rope_freqs tensor
   (``--tiny``) is quantized to Q4_K_M and Q5_K_M as well, so every tensor there is a K-quant.
2. prompt ids: perfx's and llama.cpp's tokenization of the text (BOS by the model's own rule) must be equal.
3. perplexity by llama-perplexity's method (``perfx.commands.perplexity``) with perfx and with llama.cpp's
   logits (``logits_all``), the same chunks and the same NLL code; and the logits of the first chunk
   compared row by row (relative max error, top-1 agreement).
4. greedy tokens from the start of the text until the two engines part (llama.cpp quantizes activations to
   8 bits for its integer dot products, so exact agreement over long runs is not expected).

llama.cpp's side goes through ``benchmarks/peer_llamacpp.py`` (its model opening, logits and perplexity).

    python benchmarks/fidelity_llamacpp.py --out /tmp/fidelity --ctx 512 --greedy 64 --json > fidelity.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import gguf
import numpy as np
from gguf import quants

from peer_llamacpp import adds_bos, logits as llama_logits, open_llama, perplexity as llama_perplexity
from perfx import forward64
from perfx.commands.perplexity import nll_rows, perplexity
from perfx.model import load_model
from perfx.runtime import Device
from perfx.sources import open_model
from perfx.sources.default import default_model_path

TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
FTYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


# -- files ----------------------------------------------------------------------------------------------------


def write_f32_copy(src: Path, dst: Path) -> Path:
    """``src`` with every tensor dequantized to F32 (gguf.quants, llama.cpp's definition) and its metadata."""
    reader = gguf.GGUFReader(str(src))
    arch = bytes(reader.get_field("general.architecture").parts[-1]).decode()
    writer = gguf.GGUFWriter(str(dst), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        if name == "general.file_type":
            writer.add_key_value(name, 0, kind)   # ALL_F32
        elif kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                values = [bytes(field.parts[i]) for i in field.data]
            else:
                values = [v for i in field.data for v in field.parts[i].tolist()]
            writer.add_key_value(name, values, kind, sub)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_key_value(name, bytes(field.parts[-1]), kind)
        else:
            writer.add_key_value(name, field.parts[-1].tolist()[0], kind)
    for t in reader.tensors:
        n, k = (int(t.shape[1]), int(t.shape[0])) if len(t.shape) == 2 else (1, int(t.shape[0]))
        if t.tensor_type.name in ("F32", "F16"):
            data = np.asarray(t.data, dtype=np.float32).reshape(-1) if n == 1 else np.asarray(t.data, np.float32)
        else:
            data = quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(n, k).astype(np.float32)
        writer.add_tensor(t.name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def llama_quantize(src: Path, dst: Path, kind: str, threads: int = 2) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[kind])
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise SystemExit(f"llama_model_quantize {src} -> {kind} failed")
    return dst


def tiny_llama3(out: Path) -> Path:
    """A random Llama-3-style model with rows of 256 and a rope_freqs tensor, as an F32 GGUF (tests' writer)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from helpers.tiny_models import make_tiny_model, tiny_tokenizer, write_gguf
    from test_loader import LLAMA3_SCALING, converter_rope_freqs

    spm = tiny_tokenizer(out)
    model = make_tiny_model("k256", spm, np.random.default_rng(3))
    types = [{name: "F32" for name in ("q", "k", "v", "o", "gate", "up", "down")}]
    return write_gguf(out / "tiny-llama3-F32.gguf", model, types, embedding_type="F32", output_type="F32",
                      rope_freqs=converter_rope_freqs(64, 10000.0, LLAMA3_SCALING)).path


# -- the two engines ---------------------------------------------------------------------------------------------


def compare(path: Path, text: str, ctx: int, chunks: int | None, greedy: int, device, lm_head: str = "q8",
            threads: int = 2, with_reference: bool = False) -> dict:
    """Prompt ids, perplexity, first-chunk logits and greedy tokens of one file, perfx against llama.cpp."""
    llm = open_llama(path, threads, ctx, logits_all=True)
    llama_adds_bos = adds_bos(llm)
    theirs = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)   # llama-perplexity's tokenization
    model, source = load_model(str(path), device, ctx=ctx, progress=False, lm_head=lm_head)
    tok = source.tokenizer
    ours = tok.encode(text, add_bos=tok.add_bos_token, parse_special=False)
    n_chunks = min(len(ours) // ctx, chunks or 10**9)
    bos = tok.bos_id if tok.add_bos_token else None
    row = {"file": path.name, "lm_head": lm_head, "tokens": len(ours), "ids_equal": ours == theirs,
           "add_bos": {"perfx": tok.add_bos_token, "llama.cpp": llama_adds_bos}, "ctx": ctx, "chunks": n_chunks,
           "types": source.describe()["quantization"]}
    row["perfx"] = {k: v for k, v in perplexity(model, ours, ctx, n_chunks, bos).items() if k != "running_ppl"}
    started = time.perf_counter()
    row["llama.cpp"] = llama_perplexity(theirs[:n_chunks * ctx], ctx, lambda ids: llama_logits(llm, ids),
                                        llm.token_bos() if llama_adds_bos else None)
    row["llama.cpp"]["tokens_per_s"] = n_chunks * ctx / (time.perf_counter() - started)
    row["ppl_ratio"] = row["perfx"]["ppl"] / row["llama.cpp"]["ppl"]
    # logits of the first chunk, every position
    ids = list(ours[:ctx])
    a, b = model.prefill_logits(ids, 0, 0), llama_logits(llm, ids)
    rel = np.max(np.abs(a - b), axis=1) / np.max(np.abs(b), axis=1)
    row["logits"] = {"rel_max_median": float(np.median(rel)), "rel_max_worst": float(rel.max()),
                     "top1_agreement": float(np.mean(a.argmax(1) == b.argmax(1)))}
    if with_reference:   # the float64 reference forward on the first chunk: which engine is off
        want, _ = forward64.model_forward(source, ids)
        targets, half = ours[ctx // 2 + 1:ctx], ctx // 2

        def score(rows):
            return float(nll_rows(rows[half:ctx - 1], targets).mean())

        def off(rows):
            return float(np.median(np.max(np.abs(rows - want), axis=1) / np.max(np.abs(want), axis=1)))

        row["first_chunk_nll"] = {"reference": score(want), "perfx": score(a), "llama.cpp": score(b),
                                  "perfx_logits_vs_reference": off(a), "llama_cpp_logits_vs_reference": off(b)}
    # greedy tokens from the first 32 tokens of the text
    prompt = list(ours[:32])
    model.prefill(prompt, 0)
    mine, pos = [], len(prompt)
    for _ in range(greedy):
        mine.append(model.argmax())
        model.decode_one(mine[-1], pos)
        pos += 1
    llm.reset()
    llm.eval(prompt)
    other = []
    for _ in range(greedy):
        other.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([other[-1]])
    same = next((i for i, (x, y) in enumerate(zip(mine, other)) if x != y), greedy)
    row["greedy"] = {"steps": greedy, "identical_prefix": same, "perfx_text": tok.decode(mine),
                     "llama_cpp_text": tok.decode(other)}
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/perfx-fidelity"), help="where the GGUFs are written")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=None)
    parser.add_argument("--greedy", type=int, default=64)
    parser.add_argument("--files", default="Q4_1,Q4_1/fp16,Q4_K_M,Q5_K_M,Q8_0,tiny-F32,tiny-Q4_K_M,tiny-Q5_K_M",
                        help="which comparisons to run (comma-separated)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--reference", action="store_true",
                        help="also the float64 reference forward on each file's first chunk (slow: numpy float64)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    text = TEXT.read_text(encoding="utf-8")
    device = Device(args.device)
    wanted = args.files.split(",")
    default = default_model_path()
    files = {"Q4_1": (default, "q8"), "Q4_1/fp16": (default, "fp16")}
    if any(w in wanted for w in FTYPES):
        f32 = args.out / "smollm2-135m-F32.gguf"
        if not f32.exists():
            write_f32_copy(default, f32)
        for kind in FTYPES:
            dst = args.out / f"smollm2-135m-{kind}.gguf"
            if kind in wanted and not dst.exists():
                llama_quantize(f32, dst, kind)
            files[kind] = (dst, "q8")
    if any(w.startswith("tiny") for w in wanted):
        tiny = tiny_llama3(args.out)
        files["tiny-F32"] = (tiny, "q8")
        for kind in ("Q4_K_M", "Q5_K_M"):
            dst = args.out / f"tiny-llama3-{kind}.gguf"
            if not dst.exists():
                llama_quantize(tiny, dst, kind)
            files[f"tiny-{kind}"] = (dst, "q8")
    import llama_cpp

    report = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "device": device.caps.name,
              "llama_cpp_python": llama_cpp.__version__, "text": TEXT.name, "ctx": args.ctx, "rows": []}
    for name in wanted:
        path, head = files[name]
        ctx = min(args.ctx, open_model(path).config.max_positions)
        text_for = text if not name.startswith("tiny") else " ".join(["kato rimu senla vo pira nesu"] * 200)
        row = compare(path, text_for, ctx, args.chunks, args.greedy, device, head, with_reference=args.reference)
        row["name"] = name
        report["rows"].append(row)
        print(f"{name}: ids equal {row['ids_equal']}, PPL perfx {row['perfx']['ppl']:.4f} llama.cpp "
              f"{row['llama.cpp']['ppl']:.4f} (ratio {row['ppl_ratio']:.4f}), logits rel max median "
              f"{row['logits']['rel_max_median']:.2e}, top-1 {row['logits']['top1_agreement']:.3f}, greedy "
              f"identical for {row['greedy']['identical_prefix']}/{args.greedy}"
              + (f", first chunk NLL {row['first_chunk_nll']}" if args.reference else ""), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
