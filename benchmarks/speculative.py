"""Speculative decoding on this device: acceptance and decode tok/s with and without it, interleaved.

    python benchmarks/speculative.py --rounds 3                  # prompt lookup on the default model
    python benchmarks/speculative.py --rounds 3 --draft          # a deeper target drafted by the default model
    python benchmarks/speculative.py --costs                     # a verification step of M tokens vs a decode step

Tasks: (a) repetition-heavy (rewrite a paragraph, edit a function), (b) open chat. Modes off, auto and the
forced drafter (lookup, or draft) run interleaved in a shuffled order each round, greedy, each from an empty
cache; the figure is the median decode tok/s over rounds with its min-max, and auto's over off's per round.

The draft-model target (``--draft``) is synthetic: the default model (SmolLM2-135M-Instruct Q4_1) deepened
to ``DEPTH`` times its layers, each layer followed by copies of itself whose attention and FFN outputs are
scaled by ``SCALE`` (the Q4_1 blocks' scale and offset multiplied), so its layers read ``DEPTH`` times the
bytes per token, it speaks nearly as the default model does, and the default model drafts for it with its
vocabulary.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

from perfx.generate import SamplingConfig, generate
from perfx.model import load_model
from perfx.sources.default import default_model_path
from perfx.speculative import DraftModel, Speculator

SCALE = 0.05
DEPTH = 4

TASKS = {
    "rewrite": "Rewrite this paragraph in the past tense, changing nothing else: The city council meets every "
               "Tuesday in the old town hall. The members discuss the budget, the roads and the schools. After "
               "the meeting, the mayor speaks to the press and answers their questions about the new bridge. "
               "Many residents attend the meetings because they care about the future of their town.",
    "code": "Rename the variable `total` to `acc` in this function and show the whole function:\n\n"
            "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
            "    if not values:\n        return 0\n    return total / len(values)\n",
    "chat": "What should I see on a first trip to Japan?",
}


def deepened_gguf(src: Path, dst: Path, depth: int = DEPTH, scale: float = SCALE) -> Path:
    """``src`` with each layer followed by depth − 1 copies whose attn_output and ffn_down (Q4_1) are scaled."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n = reader.fields[f"{arch}.block_count"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = depth * n if field.name == f"{arch}.block_count" else field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    layers: dict[int, list] = {}
    rest = []
    for t in reader.tensors:
        if t.name.startswith("blk."):
            layers.setdefault(int(t.name.split(".")[1]), []).append(t)
        else:
            rest.append(t)
    for t in rest:
        writer.add_tensor(t.name, np.asarray(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    for i in range(n):
        for copy in range(depth):
            for t in layers[i]:
                data = np.array(t.data)
                name = t.name.replace(f"blk.{i}.", f"blk.{depth * i + copy}.", 1)
                if copy and name.endswith(("attn_output.weight", "ffn_down.weight")):
                    if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
                        raise SystemExit(f"{t.name} is {t.tensor_type.name}: only Q4_1 is scaled here")
                    blocks = data.reshape(data.shape[0], -1, 20)   # Q4_1: fp16 d, fp16 m, 16 bytes of codes
                    dm = blocks[:, :, :4].copy().view(np.float16)
                    blocks[:, :, :4] = (dm.astype(np.float32) * scale).astype(np.float16).view(np.uint8)
                writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def prompt_ids(tokenizer, text: str) -> list[int]:
    chat = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
            {"role": "user", "content": text}]
    return tokenizer.encode(tokenizer.apply_chat_template(chat), add_bos=tokenizer.add_bos_token)


def step_costs(model, reps: int = 5) -> dict[int, float]:
    """Every M timed (the speculator times a few and interpolates): a warm-up round, then ``reps`` rounds."""
    samples: dict[int, list[float]] = {m: [] for m in range(1, 10)}
    for round_ in range(reps + 1):
        for m in range(1, 10):
            started = time.perf_counter()
            if m == 1:
                model.decode_one(0, 64)
                model.argmax()
            else:
                model.prefill_logits([0] * m, 64)
            if round_:
                samples[m].append(time.perf_counter() - started)
    return {m: float(np.median(s)) for m, s in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--draft", action="store_true", help="the deepened target drafted by the default model")
    parser.add_argument("--costs", action="store_true", help="only time verification steps against decode")
    parser.add_argument("--tasks", default=",".join(TASKS))
    args = parser.parse_args()
    default = default_model_path()
    if args.draft:
        target_path = deepened_gguf(default, Path(tempfile.mkdtemp()) / "deepened.gguf")
    else:
        target_path = default
    model, source = load_model(str(target_path), None, 1024, progress=False)
    tokenizer = source.tokenizer
    name = f"{model.device.caps.name} ({model.device.caps.platform})"
    if args.costs:
        costs = step_costs(model)
        print(f"{name}: a step of M tokens over a decode step ({1e3 * costs[1]:.1f} ms): "
              + ", ".join(f"M={m} {costs[m] / costs[1]:.2f}" for m in range(2, 10)))
        return 0
    draft = DraftModel(load_model(str(default), model.device, 1024, progress=False)[0]) if args.draft else None
    forced = "draft" if args.draft else "lookup"
    # One speculator per mode for the whole run, as chat and serve keep one: costs measured once.
    speculators = {"off": None, "auto": Speculator("auto", draft), forced: Speculator(forced, draft)}
    rows = {}
    rng = random.Random(0)
    for task in args.tasks.split(","):
        ids = prompt_ids(tokenizer, TASKS[task])
        results: dict[str, list] = {mode: [] for mode in speculators}
        for _ in range(args.rounds + 1):   # the first round warms up (kernel builds, calibration)
            order = list(speculators)
            rng.shuffle(order)
            for mode in order:
                r = generate(model, tokenizer, ids, args.max_tokens, SamplingConfig(temperature=0),
                             speculator=speculators[mode])
                results[mode].append(r.stats)
        rows[task] = {mode: stats[1:] for mode, stats in results.items()}
    print(f"{name}, target {target_path.name}" + (" drafted by the default model" if args.draft else ""))
    for task, modes in rows.items():
        base = [s.decode_tok_s for s in modes["off"]]
        for mode, stats in modes.items():
            tok_s = [s.decode_tok_s for s in stats]
            ratio = [a / b for a, b in zip(tok_s, base)]
            drafted = sum(s.drafted for s in stats)
            accepted = sum(s.accepted for s in stats)
            lengths: dict[int, int] = {}
            for s in stats:
                for k, c in s.draft_lengths.items():
                    lengths[k] = lengths.get(k, 0) + c
            print(f"  {task:8} {mode:7} {statistics.median(tok_s):6.1f} tok/s [{min(tok_s):.1f}, {max(tok_s):.1f}]"
                  f"  vs off {statistics.median(ratio):.2f}x [{min(ratio):.2f}, {max(ratio):.2f}]"
                  f"  accepted {accepted}/{drafted}" + (f" ({100 * accepted / drafted:.0f}%)" if drafted else "")
                  + f"  draft lengths {dict(sorted(lengths.items()))}  tokens {stats[0].generated_tokens}")
    for mode, speculator in speculators.items():
        if speculator is not None:
            print(f"  step cost / decode ({mode}): " + json.dumps({m: round(r, 2) for m, r in
                                                                  speculator.costs.ratios().items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
