"""attention_prefill (RoPE + KV append + causal attention) at SmolLM2-135M and Llama-2-7B prompt shapes.

Reports the time of both launches, GFLOP/s over the causal work (4·D·H per visible (query, key) pair),
GB/s (qkv in, K/V appended, K/V read once, out) and that as % of the copy bandwidth of the same run.
Run: python -m pytest benchmarks/bench_attention_prefill.py --benchmark-only -q -s
"""

import numpy as np
import pytest

from perfx.ops.attention_prefill import AttentionPrefill
from perfx.ops.kv_cache import KVCache, RopeTable
from perfx.timing import copy_bandwidth, time_launches
from perfx.tuning.attention_prefill import SPEC

MODELS = {
    "smollm2-135m": dict(n_heads=9, n_kv_heads=3, head_dim=64, theta=100000.0),
    "llama2-7b": dict(n_heads=32, n_kv_heads=32, head_dim=128, theta=10000.0),
}
CONTEXT = 1024


@pytest.fixture(scope="module")
def copy_gbs(device):
    return copy_bandwidth(device)[0]


@pytest.mark.parametrize("m", [128, 512])
@pytest.mark.parametrize("model", list(MODELS))
def test_attention_prefill(benchmark, device, copy_gbs, model, m):
    cfg = MODELS[model]
    h, hkv, d = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
    shape = dict(n_heads=h, n_kv_heads=hkv, head_dim=d, m=m, p0=0)
    rng = np.random.default_rng(0)
    attention = AttentionPrefill(device, None, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d})
    cache = KVCache.allocate(device, 1, hkv, CONTEXT, d)
    rope = RopeTable.upload(device, d, CONTEXT, cfg["theta"])
    qkv = device.upload(rng.standard_normal((m, (h + 2 * hkv) * d)).astype(np.float32))
    out = device.empty((m, h * d), np.float32)

    def launch():
        return attention.enqueue(qkv, out, cache, rope, 0, 0, m)

    repeat = 3 if model == "llama2-7b" and m == 512 else 5
    timing = benchmark.pedantic(lambda: time_launches(launch, warmup=1, repeat=repeat), rounds=1, iterations=1)
    seconds = timing.median_s
    gflops = SPEC.flops(shape) / seconds / 1e9
    gbs = SPEC.bytes_moved(shape) / seconds / 1e9
    benchmark.extra_info.update({
        "device": device.caps.name, "params": attention.params, "median_ms": seconds * 1e3,
        "spread": timing.spread, "GFLOP/s": gflops, "GB/s": gbs, "copy_GB/s": copy_gbs,
        "pct_of_copy": 100 * gbs / copy_gbs,
    })
    print(f"\nattention_prefill {model} m={m} p0=0 {attention.params}: {seconds * 1e3:.1f} ms, "
          f"{gflops:.2f} GFLOP/s, {gbs:.2f} GB/s ({100 * gbs / copy_gbs:.0f}% of copy {copy_gbs:.1f} GB/s)")
