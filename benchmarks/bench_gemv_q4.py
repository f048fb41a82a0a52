"""gemv_q4 at decode shapes: Llama-2-7B (G = 128) and SmolLM2-135M (G = 32, as in its GGUF).

Reports device time (profiling events, median), GB/s of weight bytes (codes + scales/offsets),
G weights/s and % of the copy bandwidth measured in the same run, at the spec defaults and at the
parameter set that is fastest on PoCL here (one work-item per row block, whole rows in registers).

    python -m pytest benchmarks/bench_gemv_q4.py --benchmark-only -q -s
"""

import numpy as np
import pytest

from perfx.timing import copy_bandwidth, device_time, time_launches
from perfx.tuning.gemv_q4 import SPEC

SHAPES = {
    "7b-qkv": {"n": 12288, "k": 4096, "group": 128},
    "7b-o": {"n": 4096, "k": 4096, "group": 128},
    "7b-gate-up": {"n": 22016, "k": 4096, "group": 128, "epilogue": "silu_mul"},
    "7b-down": {"n": 4096, "k": 11008, "group": 128},
    "smol-qkv": {"n": 960, "k": 576, "group": 32, "parts": (576, 192, 192)},
    "smol-o": {"n": 576, "k": 576, "group": 32},
    "smol-gate-up": {"n": 3072, "k": 576, "group": 32, "epilogue": "silu_mul"},
    "smol-down": {"n": 576, "k": 1536, "group": 32},
}
PARAMS = {"defaults": SPEC.params.defaults(), "rows-in-registers": {"LANES": 1, "ROWS": 4, "READ": "buffer"}}


@pytest.fixture(scope="module")
def copy_gbs(device):
    gbs, _ = copy_bandwidth(device, 32 << 20, repeat=5)
    return gbs


@pytest.mark.parametrize("params_name", list(PARAMS))
@pytest.mark.parametrize("name", list(SHAPES))
def test_gemv_q4(benchmark, device, copy_gbs, name, params_name):
    shape = {"epilogue": "none", "bias": False, **SHAPES[name]}
    n, k, group = shape["n"], shape["k"], shape["group"]
    weight_bytes = n * k // 2 + 4 * n * (k // group)
    big = n * k >= 1 << 24
    case = SPEC.make_case(device, shape, np.random.default_rng(0))
    params = PARAMS[params_name]
    error = case.errors(params)["y"]
    assert error <= SPEC.tolerance, f"{name} {params}: relative error {error:.3g}"

    timing = time_launches(lambda: case.launch(params), warmup=1 if big else 3, repeat=5 if big else 20,
                           rotate=case.rotate)
    with device.profiling():
        benchmark.pedantic(lambda: device_time(case.launch(params)), rounds=3 if big else 10, warmup_rounds=1)
    gbs = weight_bytes / timing.median_s / 1e9
    gws = n * k / timing.median_s / 1e9
    benchmark.extra_info.update({
        "device": device.caps.name, "params": params, "shape": SPEC.describe(shape),
        "median_s": timing.median_s, "spread": timing.spread, "weight_GB_per_s": gbs,
        "G_weights_per_s": gws, "copy_GB_per_s": copy_gbs, "percent_of_copy": 100 * gbs / copy_gbs,
        "GFLOP_per_s": 2 * n * k / timing.median_s / 1e9, "relative_error": error,
    })
    print(f"\ngemv_q4 {name:13s} {params_name:17s} {timing.median_s * 1e3:8.3f} ms  {gbs:6.2f} GB/s  "
          f"{gws:6.2f} Gw/s  {100 * gbs / copy_gbs:5.1f}% of copy ({copy_gbs:.1f} GB/s)  "
          f"spread {timing.spread:.2f}  err {error:.1e}")
