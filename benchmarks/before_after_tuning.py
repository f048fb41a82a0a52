"""Decode and prefill tok/s of a model with the built-in defaults (every tuning database ignored), then
with the tuning database in force: the figure behind "speed-up from tuning" in NOTES.md.

Run: python benchmarks/before_after_tuning.py [MODEL ...]   (default: default synthetic:llama-2-7b)
"""

import sys
import tempfile

from perfx.commands.bench import measure_e2e as measure
from perfx.resources import cache_dir
from perfx.model import load_model
from perfx.runtime import Device
from perfx.tuning import database


def main(names: list[str]):
    device = Device()
    empty = tempfile.mkdtemp()
    for name in names:
        for label in ("defaults", "tuned"):
            database._default.clear()
            if label == "defaults":
                database._default[str(cache_dir())] = database.Database(user_dir=empty, shipped_dir=empty)
            model, _ = load_model(name, device, progress=False, default_ctx=512)
            sources = sorted({choice.source for choice in model.tuned.values()})
            r = measure(model, 32, 16 if "7b" in name else 48)
            print(f"{name} {label}: decode {r['decode_tok_s']:.2f} tok/s ({r['decode_gb_s']:.2f} GB/s), prefill "
                  f"{r['prefill_tok_s']:.1f} tok/s, host {r['host_ms_per_token']:.2f} ms/token; parameters from "
                  f"{sources}", flush=True)
            del model
    database._default.clear()


if __name__ == "__main__":
    main(sys.argv[1:] or ["default", "synthetic:llama-2-7b"])
