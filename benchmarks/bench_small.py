"""Microbenchmarks of the lm_head (gemv_f16), rmsnorm and the small ops at decode shapes of
Llama-2-7B (hidden 4096, intermediate 11008, vocab 32000) and SmolLM2-135M (hidden 576,
intermediate 1536, vocab 49152), each against the copy bandwidth measured in the same run.

    python -m pytest benchmarks/bench_small.py --benchmark-only -q -s
"""

import pytest

from perfx.timing import copy_bandwidth, device_time, time_launches
from perfx.tuning.gemv_f16 import SPEC as GEMV_F16
from perfx.tuning.rmsnorm import SPEC as RMSNORM
from perfx.tuning.small_ops import ARGMAX, EMBEDDING_F16, SWIGLU

# A row per work-item, no local reduction: what PoCL on a CPU prefers (measured, see the report);
# the defaults are shaped for GPUs (16 lanes a row).
GEMV_ONE_LANE = {"WGS": 256, "LANES": 1, "VW": 8}

CASES = [
    ("lm_head llama2-7b", GEMV_F16, {"n": 32000, "k": 4096}, None),
    ("lm_head llama2-7b", GEMV_F16, {"n": 32000, "k": 4096}, GEMV_ONE_LANE),
    ("lm_head smollm2", GEMV_F16, {"n": 49152, "k": 576}, None),
    ("lm_head smollm2", GEMV_F16, {"n": 49152, "k": 576}, GEMV_ONE_LANE),
    ("rmsnorm+residual llama2-7b", RMSNORM, {"m": 1, "k": 4096, "residual": True}, None),
    ("rmsnorm+residual smollm2", RMSNORM, {"m": 1, "k": 576, "residual": True}, None),
    ("argmax llama2-7b", ARGMAX, {"n": 32000}, None),
    ("argmax smollm2", ARGMAX, {"n": 49152}, None),
    ("swiglu llama2-7b", SWIGLU, {"count": 11008}, None),
    ("swiglu smollm2", SWIGLU, {"count": 1536}, None),
    ("embedding_f16 llama2-7b", EMBEDDING_F16, {"n": 1024, "k": 4096, "m": 1}, None),
]


@pytest.mark.parametrize("label, spec, shape, params", CASES,
                         ids=[f"{c[0]}-{'defaults' if c[3] is None else 'one-lane'}" for c in CASES])
def test_bench(benchmark, device, label, spec, shape, params):
    import numpy as np

    params = params or spec.params.defaults()
    case = spec.make_case(device, shape, np.random.default_rng(0))
    errors = case.errors(params)  # never time a wrong answer
    assert max(errors.values()) <= spec.tolerance, errors
    # The copy ceiling is measured right before each kernel: the shared CPUs here make it drift within a run.
    copy_gbs = copy_bandwidth(device, repeat=5)[0]
    timing = time_launches(lambda: case.launch(params), warmup=2, repeat=10, rotate=case.rotate)
    gbs = spec.bytes_moved(shape) / timing.median_s / 1e9
    gflops = spec.flops(shape) / timing.median_s / 1e9
    benchmark.extra_info.update({"kernel": spec.params.family, "shape": shape, "params": params,
                                 "device": f"{device.caps.platform} / {device.caps.name}",
                                 "median_us": timing.median_s * 1e6, "spread": timing.spread, "GB/s": gbs,
                                 "GFLOP/s": gflops, "copy GB/s": copy_gbs, "% of copy": 100 * gbs / copy_gbs})
    print(f"\n{label:28s} {spec.describe(shape):34s} {timing.median_s * 1e6:9.1f} us  {gbs:6.2f} GB/s "
          f"({100 * gbs / copy_gbs:5.1f}% of copy {copy_gbs:.2f})  {gflops:6.2f} GFLOP/s  "
          f"{' '.join(f'{k}={v}' for k, v in params.items())}")
    with device.profiling():
        benchmark.pedantic(lambda: device_time(case.launch(params)), rounds=3, iterations=1, warmup_rounds=1)
