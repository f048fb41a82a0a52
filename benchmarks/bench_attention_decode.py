"""attention_decode (RoPE + KV append + flash-decoding attention, one token) at SmolLM2-135M and Llama-2-7B.

Reports the time of the token's launches, GB/s of K/V read (fp16, every position 0..p of every kv head)
and that as % of the copy bandwidth of the same run. Launches alternate between two layers of the
cache so the K/V of one call is not still in the caches for the next.
Run: python -m pytest benchmarks/bench_attention_decode.py --benchmark-only -q -s
"""

import numpy as np
import pyopencl as cl
import pytest

from perfx.ops.attention_decode import AttentionDecode
from perfx.ops.kv_cache import KVCache, RopeTable
from perfx.timing import copy_bandwidth, time_launches
from perfx.tuning.attention_decode import SPEC, kv_bytes

MODELS = {
    "smollm2-135m": dict(n_heads=9, n_kv_heads=3, head_dim=64, theta=100000.0),
    "llama2-7b": dict(n_heads=32, n_kv_heads=32, head_dim=128, theta=10000.0),
}
MAX_CONTEXT = 4096
LAYERS = 2


@pytest.fixture(scope="module")
def copy_gbs(device):
    return copy_bandwidth(device)[0]


@pytest.fixture(scope="module")
def setups(device):
    """Per model: the op, a two-layer cache of MAX_CONTEXT random fp16 positions, RoPE table, qkv, out."""
    rng = np.random.default_rng(0)
    made = {}
    for model, cfg in MODELS.items():
        h, hkv, d = cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"]
        cache = KVCache.allocate(device, LAYERS, hkv, MAX_CONTEXT, d)
        for buffer in (cache.keys, cache.values):
            host = rng.standard_normal(LAYERS * hkv * MAX_CONTEXT * d, dtype=np.float32).astype(np.float16)
            cl.enqueue_copy(device.queue, buffer, host)
        made[model] = dict(
            op=AttentionDecode(device, None, {"n_heads": h, "n_kv_heads": hkv, "head_dim": d, "positions": MAX_CONTEXT}), cache=cache,
            rope=RopeTable.upload(device, d, MAX_CONTEXT, cfg["theta"]),
            qkv=device.upload(rng.standard_normal((h + 2 * hkv) * d, dtype=np.float32)),
            out=device.empty(h * d, np.float32))
    return made


@pytest.mark.parametrize("context", [512, 2048, 4096])
@pytest.mark.parametrize("model", list(MODELS))
def test_attention_decode(benchmark, device, copy_gbs, setups, model, context):
    cfg, s = MODELS[model], setups[model]
    op = s["op"]
    shape = dict(n_heads=cfg["n_heads"], n_kv_heads=cfg["n_kv_heads"], head_dim=cfg["head_dim"],
                 positions=context)
    state = {"layer": 0}

    def launch():
        return op.enqueue(s["qkv"], s["out"], s["cache"], s["rope"], state["layer"], context - 1)

    def rotate():
        state["layer"] = 1 - state["layer"]

    timing = benchmark.pedantic(lambda: time_launches(launch, warmup=2, repeat=10, rotate=rotate),
                                rounds=1, iterations=1)
    seconds = timing.median_s
    kv_gbs = kv_bytes(shape) / seconds / 1e9
    benchmark.extra_info.update({
        "device": device.caps.name, "params": op.params, "launches": len(op.last_events),
        "median_us": seconds * 1e6, "spread": timing.spread, "kv_GB/s": kv_gbs,
        "GB/s": SPEC.bytes_moved(shape) / seconds / 1e9, "GFLOP/s": SPEC.flops(shape) / seconds / 1e9,
        "copy_GB/s": copy_gbs, "pct_of_copy": 100 * kv_gbs / copy_gbs,
    })
    print(f"\nattention_decode {model} T={context} {op.params}: {seconds * 1e6:.0f} us, K/V read "
          f"{kv_gbs:.2f} GB/s ({100 * kv_gbs / copy_gbs:.0f}% of copy {copy_gbs:.1f} GB/s), "
          f"{op.partitions(context - 1)} partitions/kv head")
