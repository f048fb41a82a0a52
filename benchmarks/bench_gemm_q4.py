"""gemm_q4, the prefill int4 GEMM: PerfXLLM's sweep (W 12288×4096, a 7B model's fused QKV, G = 128) over M,
for the tall-skinny kernel, the tiled kernel and the dispatcher's pick, beside numpy on the dequantized
weights (CPU) and CLBlast's SGEMM on the same OpenCL device (when pyclblast is importable); then the
dispatcher at Llama-2-7B and SmolLM2-135M prefill shapes.

Reports device time (profiling events, median), GFLOP/s, GB/s (weights once, X and Y once) and % of the
copy bandwidth measured in the same run; prints the measured skinny/tiled crossover at the end.

    python -m pytest benchmarks/bench_gemm_q4.py --benchmark-only -q -s

PERFX_BENCH_MAX_M caps the sweep's M (default 1024; 64 on PoCL, where one launch at M = 256 takes ~3 s and the
whole file must stay under 2 minutes: PERFX_BENCH_MAX_M=256 for the crossover there).
"""

import os
import time

import numpy as np
import pytest

from perfx.formats import Q4Matrix
from perfx.ops.gemm_q4 import GemmQ4
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.timing import copy_bandwidth, time_launches
from perfx.tuning.gemm_q4 import bytes_moved, flops

SWEEP_N, SWEEP_K, SWEEP_G = 12288, 4096, 128
SWEEP_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SKINNY_MAX_M = 128  # past 4× the crossover the tall-skinny kernel only shows it is the wrong choice
IMPLS = ("skinny", "tiled", "dispatch", "numpy", "clblast")
# Prefill shapes (M = prompt tokens): fused QKV, gate-up with SiLU·mul, down.
MODEL_SHAPES = {
    "7b-gate-up": {"m": 16, "n": 2 * 11008, "k": 4096, "group": 128, "epilogue": "silu_mul"},
    "7b-down": {"m": 16, "n": 4096, "k": 11008, "group": 128, "epilogue": "none"},
    "smol-qkv": {"m": 64, "n": 576 + 2 * 192, "k": 576, "group": 32, "epilogue": "none"},
    "smol-gate-up": {"m": 64, "n": 2 * 1536, "k": 576, "group": 32, "epilogue": "silu_mul"},
    "smol-down": {"m": 64, "n": 576, "k": 1536, "group": 32, "epilogue": "none"},
}


def _max_m(device) -> int:
    default = 64 if device.caps.vendor_key == "pocl" else 1024
    return int(os.environ.get("PERFX_BENCH_MAX_M", default))


@pytest.fixture(scope="module")
def copy_gbs(device):
    gbs, _ = copy_bandwidth(device, 32 << 20, repeat=5)
    return gbs


@pytest.fixture(scope="module")
def sweep(device, copy_gbs):
    """The 12288×4096 weights (two copies, rotated), the host reference weights, and the results table."""
    rng = np.random.default_rng(0)
    q4s = [Q4Matrix.random(SWEEP_N, SWEEP_K, SWEEP_G, rng) for _ in range(2)]
    state = {
        "weights": [Q4DeviceWeight.upload(device, q4, what="qkv 12288x4096") for q4 in q4s],
        "w_host": q4s[0].dequantize().astype(np.float32),
        "gemm": GemmQ4(device), "i": 0, "results": {},
    }
    yield state
    results, gemm = state["results"], state["gemm"]
    print(f"\ngemm_q4 sweep W {SWEEP_N}x{SWEEP_K} G={SWEEP_G} on {device.caps.name} "
          f"(copy {copy_gbs:.1f} GB/s); GFLOP/s:")
    print("     M  " + "".join(f"{impl:>10s}" for impl in IMPLS) + "   pick")
    for m in sorted({m for m, _ in results}):
        row = "".join(f"{results[m, impl]['gflops']:10.2f}" if (m, impl) in results else f"{'-':>10s}"
                      for impl in IMPLS)
        print(f"  {m:4d}  {row}   {gemm.choose(m)}")
    both = sorted(m for m, impl in results if impl == "skinny" and (m, "tiled") in results)
    faster = [m for m in both if results[m, "tiled"]["seconds"] < results[m, "skinny"]["seconds"]]
    measured = max([m for m in both if m < min(faster)], default=0) if faster else (both[-1] if both else None)
    print(f"  dispatcher crossover {gemm.crossover}; measured here: skinny up to M = {measured}")


def _record(benchmark, state, m, impl, seconds, extra, copy_gbs):
    shape = {"m": m, "n": SWEEP_N, "k": SWEEP_K, "group": SWEEP_G, "epilogue": "none"}
    gflops = flops(shape) / seconds / 1e9
    gbs = bytes_moved(shape) / seconds / 1e9
    info = {"M": m, "impl": impl, "median_s": seconds, "GFLOP_per_s": gflops, "GB_per_s": gbs,
            "copy_GB_per_s": copy_gbs, "percent_of_copy": 100 * gbs / copy_gbs, **extra}
    benchmark.extra_info.update(info)
    state["results"][m, impl] = {"seconds": seconds, "gflops": gflops}
    print(f"\ngemm_q4 M={m:<5d} {impl:9s} {seconds * 1e3:9.2f} ms {gflops:7.2f} GFLOP/s {gbs:7.2f} GB/s "
          f"{100 * gbs / copy_gbs:5.1f}% of copy  {extra.get('note', '')}")


def _sweep_cases():
    for m in SWEEP_M:
        for impl in IMPLS:
            if impl != "skinny" or m <= SKINNY_MAX_M:
                yield pytest.param(m, impl, id=f"M{m}-{impl}")


@pytest.mark.parametrize("m,impl", list(_sweep_cases()))
def test_sweep(benchmark, device, copy_gbs, sweep, m, impl):
    if m > _max_m(device):
        pytest.skip(f"M = {m} > PERFX_BENCH_MAX_M = {_max_m(device)}")
    rng = np.random.default_rng(m)
    x_host = rng.standard_normal((m, SWEEP_K)).astype(np.float32)
    big = m * SWEEP_N * SWEEP_K >= 1 << 33
    warmup, repeat = (1, 2) if big else (1, 3)

    if impl == "numpy":
        w = sweep["w_host"]
        x_host @ w.T
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            x_host @ w.T
            samples.append(time.perf_counter() - start)
        benchmark.pedantic(lambda: x_host @ w.T, rounds=1, warmup_rounds=0)
        _record(benchmark, sweep, m, impl, float(np.median(samples)), {"note": "CPU, dequantized fp32"},
                copy_gbs)
        return

    x = device.upload(x_host)
    if impl == "clblast":
        try:
            import pyclblast
        except ImportError:
            pytest.skip("CLBlast: pyclblast is not importable here (not installed on purpose); no SGEMM figure")
        w = device.upload(sweep["w_host"])
        y = device.empty((m, SWEEP_N), np.float32)

        def launch():
            # Y (M, N) = X (M, K) · Wᵀ, row-major: CLBlast's default layout is row-major.
            pyclblast.gemm(device.queue, m, SWEEP_N, SWEEP_K, x, w, y, a_ld=SWEEP_K, b_ld=SWEEP_K,
                           c_ld=SWEEP_N, b_transp=True)
            device.queue.finish()

        launch()
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            launch()
            samples.append(time.perf_counter() - start)
        benchmark.pedantic(launch, rounds=1, warmup_rounds=0)
        _record(benchmark, sweep, m, impl, float(np.median(samples)), {"note": "SGEMM on fp32 weights"},
                copy_gbs)
        return

    gemm = sweep["gemm"]
    kind = gemm.choose(m) if impl == "dispatch" else impl
    y = device.empty((m, SWEEP_N), np.float32)
    weights = sweep["weights"]

    def launch():
        sweep["i"] += 1
        return [gemm.run(kind, weights[sweep["i"] % 2], x, y, m)]

    if impl == "dispatch" and (m, kind) in sweep["results"]:
        # The same launches, already checked and timed.
        benchmark.pedantic(lambda: None, rounds=1, warmup_rounds=0)
        _record(benchmark, sweep, m, impl, sweep["results"][m, kind]["seconds"], {"kernel": kind,
                "note": f"-> {kind}", "device": device.caps.name}, copy_gbs)
        return

    # A check on copy 0 (two rows against float64) before any figure counts.
    gemm.run(kind, weights[0], x, y, m).wait()
    want = x_host[:2].astype(np.float64) @ sweep["w_host"].T.astype(np.float64)
    error = float(np.max(np.abs(y.get()[:2] - want)) / np.max(np.abs(want)))
    assert error <= 1e-4, f"{kind} M={m}: relative error {error:.3g}"
    # One pytest-benchmark round is the whole timing; the figure is its device-time median.
    # max_seconds: the tiled kernel at M = 1 still computes a whole MWG-row tile (~1 s on PoCL).
    timing = benchmark.pedantic(lambda: time_launches(launch, warmup=warmup, repeat=repeat, max_seconds=1.5),
                                rounds=1, warmup_rounds=0)
    seconds = timing.median_s
    extra = {"kernel": kind, "note": f"-> {kind}" if impl == "dispatch" else "", "relative_error": error,
             "device": device.caps.name}
    _record(benchmark, sweep, m, impl, seconds, extra, copy_gbs)


@pytest.mark.parametrize("name", list(MODEL_SHAPES))
def test_model_shapes(benchmark, device, copy_gbs, name):
    shape = MODEL_SHAPES[name]
    m, n, k, group, epilogue = shape["m"], shape["n"], shape["k"], shape["group"], shape["epilogue"]
    rng = np.random.default_rng(1)
    weight = Q4DeviceWeight.upload(device, Q4Matrix.random(n, k, group, rng), what=name)
    x = device.upload(rng.standard_normal((m, k)).astype(np.float32))
    y = device.empty((m, n // 2 if epilogue == "silu_mul" else n), np.float32)
    gemm = GemmQ4(device)
    timing = benchmark.pedantic(lambda: time_launches(lambda: [gemm(weight, x, y, m, epilogue)], warmup=1,
                                                      repeat=5, max_seconds=1.5), rounds=1, warmup_rounds=0)
    gflops = flops(shape) / timing.median_s / 1e9
    gbs = bytes_moved(shape) / timing.median_s / 1e9
    benchmark.extra_info.update({"shape": shape, "kernel": gemm.choose(m), "median_s": timing.median_s,
                                 "spread": timing.spread, "GFLOP_per_s": gflops, "GB_per_s": gbs,
                                 "copy_GB_per_s": copy_gbs, "percent_of_copy": 100 * gbs / copy_gbs})
    print(f"\ngemm_q4 {name:13s} M={m:<3d} {gemm.choose(m):6s} {timing.median_s * 1e3:8.2f} ms {gflops:7.2f} "
          f"GFLOP/s {gbs:6.2f} GB/s {100 * gbs / copy_gbs:5.1f}% of copy ({copy_gbs:.1f} GB/s)")
