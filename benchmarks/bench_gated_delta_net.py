"""Gated DeltaNet at a Qwen3.5-0.8B linear-attention layer (16 q/k and 16 v heads of 128, config.json's
linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim): a decode step
(T = 1) and a prompt (T = 128), the recurrent and chunked kernels at their defaults and a few other parameter
sets, interleaved round by round so the machine's load falls on all alike.

Reports the median device time over the rounds, its spread, GB/s of the state (read and written once) and
inputs, and GFLOP/s of the algorithm's own work (``tuning/gated_delta_net.py``).
Run: python -m pytest benchmarks/bench_gated_delta_net.py --benchmark-only -q -s
"""

import numpy as np
import pytest

from perfx.ops.gated_delta_net import GatedDeltaNetChunked, GatedDeltaNetRecurrent
from perfx.timing import copy_bandwidth, time_launches
from perfx.tuning import gated_delta_net as spec

QWEN35_08B = {"n_k_heads": 16, "n_v_heads": 16, "d_k": 128, "d_v": 128}
VARIANTS = {
    1: [(GatedDeltaNetRecurrent, None), (GatedDeltaNetRecurrent, {"LANES1": 1, "ROWS1": 4}),
        (GatedDeltaNetRecurrent, {"LANES1": 4, "ROWS1": 16}), (GatedDeltaNetChunked, None)],
    128: [(GatedDeltaNetRecurrent, None), (GatedDeltaNetRecurrent, {"LANES1": 1, "ROWS1": 4}),
          (GatedDeltaNetChunked, None), (GatedDeltaNetChunked, {"CHUNK2": 32, "ROWS2": 32, "WGS2": 128}),
          (GatedDeltaNetChunked, {"CHUNK2": 64, "ROWS2": 32, "WGS2": 64})],
}
ROUNDS = 5


@pytest.mark.parametrize("tokens", list(VARIANTS))
def test_gated_delta_net(benchmark, device, tokens):
    shape = {**QWEN35_08B, "tokens": tokens}
    rng = np.random.default_rng(0)
    hv, dk, dv = shape["n_v_heads"], shape["d_k"], shape["d_v"]
    gates, _ = spec.random_gates(rng, tokens, hv, raw=False)
    qkv = device.upload(rng.standard_normal((tokens, spec.qkv_size(shape))).astype(np.float32))
    gates = device.upload(gates)
    state = device.upload((rng.standard_normal((hv, dv, dk)) * 0.3).astype(np.float32))
    out = device.empty((tokens, hv * dv), np.float32)
    ops = [cls(device, params, shape) for cls, params in VARIANTS[tokens]]
    copy_gbs = copy_bandwidth(device)[0]

    def rounds():
        samples = [[] for _ in ops]
        for _ in range(ROUNDS):
            for i, op in enumerate(ops):
                timing = time_launches(lambda: [op(qkv, gates, state, out, tokens)], warmup=1, repeat=5)
                samples[i].append(timing.median_s)
        return samples

    samples = benchmark.pedantic(rounds, rounds=1, iterations=1)
    print(f"\ngated_delta_net Qwen3.5-0.8B layer T={tokens} on {device.caps.name} (copy {copy_gbs:.1f} GB/s):")
    for op, times in zip(ops, samples):
        median = float(np.median(times))
        flops = (spec.recurrent_flops(shape) if isinstance(op, GatedDeltaNetRecurrent)
                 else spec.chunked_flops(shape, op.params["CHUNK2"]))
        gbs = spec.bytes_moved(shape) / median / 1e9
        spread = (max(times) - min(times)) / median
        print(f"  {op.space.family} {op.params}: {median * 1e6:.0f} µs (spread {spread:.2f}), "
              f"{gbs:.2f} GB/s ({100 * gbs / copy_gbs:.0f}% of copy), {flops / median / 1e9:.2f} GFLOP/s")
        benchmark.extra_info[f"{op.space.family} {op.params}"] = {"median_s": median, "samples_s": times}
