"""End-to-end figures: the default model and synthetic models, prefill/decode tok/s, TTFT, GB/s, memory.

Run: python -m pytest benchmarks/bench_e2e.py --benchmark-only -q -s
(PERFX_E2E_MODELS=default,synthetic:smollm2-135m,synthetic:llama-2-7b chooses the models; the 7B one
needs ~4 GB of device memory and minutes on a CPU.)
"""

import os

import pytest

from perfx.bench_e2e import measure
from perfx.model import load_model
from perfx.timing import copy_bandwidth

MODELS = os.environ.get("PERFX_E2E_MODELS", "default,synthetic:smollm2-135m").split(",")


@pytest.mark.parametrize("name", MODELS)
def test_e2e(benchmark, device, name):
    copy_gb_s, _ = copy_bandwidth(device)
    model, _ = load_model(name, device, progress=False, default_ctx=512)
    figures = benchmark.pedantic(measure, args=(model, 64, 32), rounds=1, iterations=1)
    figures["copy_gb_s"] = copy_gb_s
    benchmark.extra_info.update(figures)
    print(f"\n{name} on {device.caps.name}: prefill {figures['prefill_tok_s']:.1f} tok/s, TTFT "
          f"{1e3 * figures['ttft_s']:.0f} ms, decode {figures['decode_tok_s']:.2f} tok/s = "
          f"{figures['decode_gb_s']:.2f} GB/s ({100 * figures['decode_gb_s'] / copy_gb_s:.0f}% of copy "
          f"{copy_gb_s:.1f} GB/s), host {figures['host_ms_per_token']:.2f} ms/token, device "
          f"{figures['device_bytes'] / 2**20:.0f} MiB, host peak {figures['host_peak_bytes'] / 2**20:.0f} MiB")
