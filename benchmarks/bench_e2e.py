"""End-to-end figures: the default model and synthetic models, prefill/decode tok/s, TTFT, GB/s, memory.

Run: python -m pytest benchmarks/bench_e2e.py --benchmark-only -q -s
(PERFX_E2E_MODELS=default,synthetic:smollm2-135m,synthetic:llama-2-7b chooses the models; the 7B one
needs ~4 GB of device memory and minutes on a CPU.)
"""

import os

import pytest

from perfx.commands.bench import e2e_lines, measure_e2e
from perfx.model import load_model
from perfx.timing import copy_bandwidth

MODELS = os.environ.get("PERFX_E2E_MODELS", "default,synthetic:smollm2-135m").split(",")


@pytest.mark.parametrize("name", MODELS)
def test_e2e(benchmark, device, name):
    copy_gb_s, _ = copy_bandwidth(device)
    model, _ = load_model(name, device, progress=False, default_ctx=512)
    figures = benchmark.pedantic(measure_e2e, args=(model, 64, 32), rounds=1, iterations=1)
    figures["copy_gb_s"] = copy_gb_s
    benchmark.extra_info.update(figures)
    print(f"\n{name} on {device.caps.name}:\n" + "\n".join(e2e_lines({"model": name, **figures}, copy_gb_s)))
