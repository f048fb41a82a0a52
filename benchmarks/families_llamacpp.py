"""llama.cpp's answers on the tiny model of each 2026 phone family, the truth perfx's loaders are checked against.

For each family of ``tests/helpers/family_models.py`` (gemma3, gemma2, qwen3, phi3, smollm3, lfm2, qwen35): the tiny random
model at a fixed seed, written by ``write_family_gguf`` with its default tensor types (Q4_0 / Q8_0, Q4_K /
Q6_K on ffn_down, Q8_0 embeddings), is run by llama.cpp's CPU backend (2 threads): the prompt (llama.cpp's
own ids for ``PROMPT_TEXT``, BOS by the model's rule), then ``GREEDY`` greedy tokens, each position's logits
kept. Phi-3 runs twice: with n_ctx 256 (= original_context_length: llama.cpp takes the short rope factors)
and 512 (the long ones). The seed is the first from 0 whose greedy run is clear: every step's top logit at
least ``MIN_MARGIN`` above the next (llama.cpp rounds activations to 8 bits, so smaller margins could flip
between engines) and at least ``MIN_DISTINCT`` different tokens. The JSON keeps, per family, the writer's
settings, the prompt ids, llama.cpp's greedy tokens, the margins and the logits at the last prompt position
and at the last step (rounded to 4 decimals).

    python benchmarks/families_llamacpp.py --write tests/data/llamacpp_families.json

``--check`` also checks the writers themselves where their tools are installed (both benchmark-only):
llama.cpp's own convert_hf_to_gguf.py (``--converter PATH``; it is in the llama-cpp-python sdist, vendor/
llama.cpp/) must turn write_family_hf's directory into write_family_gguf's file, key for key and byte for
byte (F32 and Q8_0), and transformers (with torch) on that directory must give llama.cpp's logits on the F32
file. Seen on 2026-12-01 with transformers 5.24.0: the converter's files identical for every family, both
config styles; logits within 1e-5 for qwen3, phi3 and smollm3 with an F32 KV cache, within 9e-3 for the
Gemmas (llama.cpp's CPU GELU reads an fp16 table; emulating it brings them within 2e-3).

llama-cpp-python is a benchmark tool here, never a perfx dependency:
CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36 (about ten minutes on two cores).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.family_models import (DEFAULT_PHI3_TYPES, DEFAULT_TYPES, F32_TYPES, FAMILIES,  # noqa: E402
                                   family_tokenizer, make_family_model, write_family_gguf, write_family_hf)
from helpers.llamacpp import import_llama_cpp  # noqa: E402

PROMPT_TEXT = "kato rimu senla dope quiban zorel nevo"
GREEDY = 8
MIN_MARGIN = 0.5
MIN_DISTINCT = 3
THREADS = 2
CONTEXTS = {"phi3": [256, 512]}     # others: 256 (llama.cpp pads n_ctx to a multiple of 256)


def open_llama(path: Path, n_ctx: int, f32_cache: bool = False):
    extra = {"type_k": 0, "type_v": 0} if f32_cache else {}     # GGML_TYPE_F32
    return import_llama_cpp().Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=THREADS,
                                    n_threads_batch=THREADS, logits_all=True, n_gpu_layers=0, verbose=False, **extra)


def greedy(llm, prompt: list[int], steps: int) -> dict:
    """The prompt, then ``steps`` greedy tokens; the top-1 margin of every step."""
    llm.reset()
    llm.eval(prompt)
    tokens, margins = [], []
    for step in range(steps):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        if step == 0:
            first = logits
        top = np.sort(logits)[::-1]
        tokens.append(int(logits.argmax()))
        margins.append(float(top[0] - top[1]))
        if step < steps - 1:
            llm.eval([tokens[-1]])
    return {"greedy": tokens, "margins": [round(m, 3) for m in margins],
            "logits_prompt_last": [round(float(x), 4) for x in first],
            "logits_last": [round(float(x), 4) for x in logits]}


def run_family(family: str, work: Path, max_seeds: int = 200) -> dict:
    spm = family_tokenizer(work, family)
    writer = {"types": DEFAULT_PHI3_TYPES if family == "phi3" else DEFAULT_TYPES, "embedding_type": "Q8_0",
              "output_type": "Q8_0"}
    for seed in range(max_seeds):
        model = make_family_model(family, spm, np.random.default_rng(seed), logit_std=4.0, embed_rms=0.05)
        path = write_family_gguf(work / f"{family}.gguf", model, **writer).path
        runs = []
        for n_ctx in CONTEXTS.get(family, [256]):
            llm = open_llama(path, n_ctx)
            prompt = llm.tokenize(PROMPT_TEXT.encode(), add_bos=True, special=True)   # BOS by the model's rule
            run = {"n_ctx": n_ctx}
            if family == "phi3":      # llama_model::get_rope_factors
                longer = n_ctx > model.config["original_max_position_embeddings"]
                run["rope_factors"] = "long" if longer else "short"
            runs.append({**run, **greedy(llm, prompt, GREEDY)})
            del llm
        margin = min(min(r["margins"]) for r in runs)
        distinct = min(len(set(r["greedy"])) for r in runs)
        if margin >= MIN_MARGIN and distinct >= MIN_DISTINCT:
            break
    else:
        raise SystemExit(f"{family}: no seed below {max_seeds} gives a clear greedy run")
    print(f"{family}: seed {seed} (the first clear one), prompt {prompt}", file=sys.stderr)
    for r in runs:
        print(f"  n_ctx {r['n_ctx']}: greedy {r['greedy']}\n    top-1 margins {r['margins']}", file=sys.stderr)
    return {"make_family_model": {"family": family, "seed": seed, "logit_std": 4.0,
                                                "embed_rms": 0.05},
            "write_family_gguf": writer,
            "prompt_text": PROMPT_TEXT, "prompt_ids": prompt, "runs": runs}


def check_writers(family: str, seed: int, work: Path, converter: Path | None):
    """The converter's file equals ours; transformers' logits equal llama.cpp's (module docstring)."""
    import gguf

    spm = family_tokenizer(work, family)
    model = make_family_model(family, spm, np.random.default_rng(seed))
    for kind in ("F32", "Q8_0"):
        ours = write_family_gguf(work / f"{family}-{kind}.gguf", model, [{k: kind for k in F32_TYPES[0]}],
                                 embedding_type=kind, output_type=kind).path
        for style in ("hub", "transformers5"):
            hf = write_family_hf(work / f"{family}-hf-{style}", model, dtype="F32", style=style)
            if converter is None:
                continue
            theirs = work / f"{family}-{kind}-converted.gguf"
            subprocess.run([sys.executable, str(converter), str(hf), "--outtype", kind.lower(), "--outfile",
                            str(theirs)], check=True, capture_output=True)
            a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
            same_keys, same_tensors = _keys(a) == _keys(b), _tensors(a) == _tensors(b)
            print(f"{family} {kind} {style}: converter's keys {'same' if same_keys else 'DIFFER'}, "
                  f"tensors {'same' if same_tensors else 'DIFFER'}", file=sys.stderr)
    try:
        import torch
        import transformers
    except ImportError:
        print("transformers / torch not installed: no logits check", file=sys.stderr)
        return
    llm = open_llama(work / f"{family}-F32.gguf", 256, f32_cache=True)
    prompt = llm.tokenize(PROMPT_TEXT.encode(), add_bos=True, special=True)
    llm.eval(prompt)
    got = np.array(llm.scores[:len(prompt)], dtype=np.float64)
    for style in ("hub", "transformers5"):
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(work / f"{family}-hf-{style}"),
                                                               dtype=torch.float64, attn_implementation="eager")
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].numpy()
        print(f"{family} {style}: transformers vs llama.cpp (F32 file, F32 KV cache) max |logit diff| "
              f"{np.abs(got - want).max():.2e}", file=sys.stderr)


def _keys(reader) -> dict:
    """Every key but the file's own and general.* naming (which the converter takes from the directory)."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.") and (
        not k.startswith("general.") or k in ("general.architecture", "general.file_type"))}


def _tensors(reader) -> dict:
    return {t.name: (t.tensor_type, bytes(np.asarray(t.data).data)) for t in reader.tensors}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="write the JSON here (else print it)")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--check", action="store_true", help="also check the writers (module docstring)")
    parser.add_argument("--converter", type=Path, help="llama.cpp's convert_hf_to_gguf.py, for --check")
    args = parser.parse_args(argv)

    import llama_cpp

    result = {"llama_cpp_python": llama_cpp.__version__,
              "llama_cpp": llama_cpp.llama_version().decode(),
              "cpu": llama_cpp.llama_print_system_info().decode().strip(),
              "threads": THREADS, "greedy_steps": GREEDY, "min_margin": MIN_MARGIN, "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for family in args.families.split(","):
            result["families"][family] = run_family(family, work)
            if args.check:
                seed = result["families"][family]["make_family_model"]["seed"]
                check_writers(family, seed, work, args.converter)
    text = json.dumps(result, separators=(",", ":"))
    if args.write:
        args.write.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
