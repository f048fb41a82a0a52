"""End-to-end figures for `perfx bench --e2e` and benchmarks/bench_e2e.py: a prompt prefilled and a run of
greedy decode steps on a loaded model, reported as prefill and decode tok/s, TTFT, achieved GB/s (model
bytes read per token × decode tok/s), host time per token, and peak host and device memory."""

from __future__ import annotations

import numpy as np

from perfx.generate import SamplingConfig, generate
from perfx.model import load_model
from perfx.runtime import Device


def measure(model, prompt_tokens: int = 64, decode_tokens: int = 32, seed: int = 0) -> dict:
    """Prefill ``prompt_tokens`` random ids, then decode ``decode_tokens`` greedily (EOS ignored)."""
    c = model.config
    prompt_tokens = max(1, min(prompt_tokens, model.max_positions - decode_tokens - 1))
    prompt = [int(t) for t in np.random.default_rng(seed).integers(3, c.vocab_size, prompt_tokens)]
    result = generate(model, None, prompt, decode_tokens, SamplingConfig(temperature=0))
    s = result.stats
    report = model.load_report
    return {"prompt_tokens": s.prompt_tokens, "decode_tokens": s.generated_tokens,
            "ttft_s": s.ttft_s, "prefill_tok_s": s.prefill_tok_s, "decode_tok_s": s.decode_tok_s,
            "decode_gb_s": s.decode_gb_s, "host_ms_per_token": 1e3 * s.host_s_per_token,
            "weight_bytes": model.weight_bytes, "device_bytes": report["device_bytes"],
            "device_peak_bytes": model.device.peak_allocated_bytes, "host_peak_bytes": report["host_peak_bytes"],
            "load_s": report["load_s"], "ctx": report["ctx"]}


def run(device: Device, model_name: str, args=None) -> dict:
    """Load ``model_name`` on ``device`` and measure it (the hook `perfx bench --e2e` calls)."""
    prompt = getattr(args, "prompt_tokens", None) or 64
    steps = getattr(args, "decode_tokens", None) or 32
    device.peak_allocated_bytes = device.allocated_bytes  # the model's peak, not earlier benchmarks'
    model, _ = load_model(model_name, device, ctx=getattr(args, "ctx", None), progress=None, default_ctx=1024)
    return {"model": model_name, **measure(model, prompt, steps)}
