"""A probe of a layout for the batched decode step's int4 products: weight rows in the lanes of the vector (a
work-item owns 8 neighbouring weight rows, one an int lane) instead of K, against gemm_q4_i8 (K in the lanes) and
the decode GEMV, on the default model's shapes, device time in interleaved rounds. Not a perfx kernel: it exists
to measure whether the layout cuts what each row past the first costs (benchmarks/NOTES.md, issue 43's CPU goal).

Per pair of k, one vpmaddwd's pattern serves the 8 weight rows against X's pair broadcast (the pair's int16 codes
in one int), so the products need no conversion per texel and row: the 8 rows' int sums of a texel (a Q4_1
block of 32) are converted and scaled once, by the 8 rows' scales in one vector. The weight's nibbles are
unpacked once per texel for the MT rows of X. The probe's X is the rounded int8 codes as int16 pairs, its
scales (s, m) float32 per row and block, rows contiguous along K (perfx's LAYOUT 0 texels); N a multiple of 8.
Its outputs are checked against the float64 product of the same codes and scales (fp32 sums of exact integer
block sums: 1e-5 relative to max|y|, checked before anything is timed).

    python benchmarks/rows_in_lanes.py --device intel --m 4 8
"""

from __future__ import annotations

import argparse
import random
import statistics

import numpy as np
import pyopencl as cl

from perfx.runtime import get_device
from perfx.timing import time_launches
from perfx.tuning import SPECS

SOURCE = r"""
#define EVEN16(v) ((int8)((v).s0, (v).s2, (v).s4, (v).s6, (v).s8, (v).sa, (v).sc, (v).se))
#define ODD16(v) ((int8)((v).s1, (v).s3, (v).s5, (v).s7, (v).s9, (v).sb, (v).sd, (v).sf))
// y (MT, n) = x (MT, k) · wᵀ: w's texel t of row r at codes[r·T + t] (byte i: w_2i low nibble, w_2i+1 high),
// (s, m) of its block at sm[r·T + t]; x as int16 pairs xp[row][k/2] and (d, Σ d·q) per block xds[row][T].
__kernel void rows_in_lanes(const int n, const int k, __global const uint4* restrict codes,
                            __global const float2* restrict sm, __global const int* restrict xp,
                            __global const float2* restrict xds, __global float* restrict y)
{
    const int r0 = get_global_id(0) * 8;
    const int texels = k / 32;
    float8 acc[MT], off[MT];
    for (int mm = 0; mm < MT; mm++) { acc[mm] = (float8)0.0f; off[mm] = (float8)0.0f; }
    for (int t = 0; t < texels; t++) {
        uint4 tx[8];
        float8 s8, m8;
        for (int j = 0; j < 8; j++) {
            tx[j] = codes[(size_t)(r0 + j) * texels + t];
            const float2 v = sm[(size_t)(r0 + j) * texels + t];
            s8[j] = v.x;
            m8[j] = v.y;
        }
        int8 dot[MT];
        for (int mm = 0; mm < MT; mm++) dot[mm] = (int8)0;
        for (int w = 0; w < 4; w++) {
            const uint8 wv = (uint8)(tx[0][w], tx[1][w], tx[2][w], tx[3][w], tx[4][w], tx[5][w], tx[6][w], tx[7][w]);
            for (int i = 0; i < 4; i++) {
                const uint8 b = wv >> (8 * i);
                const short16 ws = as_short16((b & 0xFu) | ((b & 0xF0u) << 12));   // (w_2i, w_2i+1) a lane
                for (int mm = 0; mm < MT; mm++) {
                    const short16 xs = as_short16((int8)xp[(size_t)mm * (k / 2) + t * 16 + w * 4 + i]);
                    const int16 p = convert_int16(ws) * convert_int16(xs);
                    dot[mm] += EVEN16(p) + ODD16(p);
                }
            }
        }
        for (int mm = 0; mm < MT; mm++) {
            const float2 d = xds[(size_t)mm * texels + t];
            acc[mm] = convert_float8(dot[mm]) * (s8 * d.x) + acc[mm];
            off[mm] = m8 * d.y + off[mm];
        }
    }
    for (int mm = 0; mm < MT; mm++) vstore8(acc[mm] + off[mm], 0, y + (size_t)mm * n + r0);
}
"""

# (label, N, K): the default model's (SmolLM2-135M) int4 matrices; gate-up without its epilogue (the probe has none)
SHAPES = (("qkv", 960, 576), ("o", 576, 576), ("gate-up", 3072, 576), ("down", 576, 1536))
TOLERANCE = 1e-5
# Work-groups of 8: Intel's CPU runtime then runs each work-item's own vector code; at a multiple of 16 it may
# vectorize across work-items instead (16 a 512-bit register), where each int8 of a work-item becomes 8 registers
# and spills (benchmarks/NOTES.md, issue 43's CPU goal). The default model's N/8 are multiples of 8.
LOCAL = (8,)


def probe(device, n: int, k: int, m: int, rng):
    """(launch, worst relative error) of the probe at (m, n, k) on fresh random codes, scales and X."""
    ctx, texels = device.context, k // 32
    kernel = cl.Program(ctx, SOURCE).build(options=[f"-DMT={m}"]).rows_in_lanes
    codes = rng.integers(0, 2**32, (n, texels, 4), dtype=np.uint32)
    sm = (rng.standard_normal((n, texels, 2)) * 0.01).astype(np.float32)
    xq = rng.integers(-127, 128, (m, k)).astype(np.int16)
    xds = np.abs(rng.standard_normal((m, texels, 2))).astype(np.float32)
    pairs = np.ascontiguousarray((xq[:, 0::2].astype(np.int32) & 0xFFFF) | (xq[:, 1::2].astype(np.int32) << 16))
    flags = cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR
    buffers = [cl.Buffer(ctx, flags, hostbuf=a) for a in (codes, sm, pairs, xds)]
    y = np.full((m, n), np.nan, np.float32)   # poisoned: an output not written stays NaN
    out = cl.Buffer(ctx, cl.mem_flags.READ_WRITE | cl.mem_flags.COPY_HOST_PTR, hostbuf=y)
    kernel.set_args(np.int32(n), np.int32(k), *buffers, out)
    cl.enqueue_nd_range_kernel(device.queue, kernel, (n // 8,), LOCAL)
    cl.enqueue_copy(device.queue, y, out)
    device.queue.finish()
    nibbles = codes.view(np.uint8).reshape(n, texels, 16)
    w = np.empty((n, texels, 32)); w[:, :, 0::2], w[:, :, 1::2] = nibbles & 0xF, nibbles >> 4
    dots = np.einsum("ntk,mtk->mnt", w, xq.reshape(m, texels, 32).astype(np.float64))
    want = (dots * sm[None, :, :, 0] * xds[:, None, :, 0] + sm[None, :, :, 1] * xds[:, None, :, 1]).sum(-1)
    error = float(np.nanmax(np.abs(y - want)) / np.abs(want).max()) if np.isfinite(y).all() else float("inf")

    def launch(queue, held=(buffers, out)):   # the kernel's arguments live as long as the launch does
        return [cl.enqueue_nd_range_kernel(queue, kernel, (n // 8,), LOCAL)]
    return launch, error


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="intel", help="PERFX_DEVICE's forms: pocl, intel, P:D")
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8], help="rows of X (sequences in the step)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    args = parser.parse_args(argv)
    device, rng, shuffle = get_device(args.device), np.random.default_rng(0), random.Random(0)
    print(f"{device.caps.name} / {device.caps.driver_version}: device µs (median of rounds); each row past the "
          "first over the GEMV of one")
    i8, gemv = SPECS["gemm_q4_i8"], SPECS["gemv_q4"]
    for label, n, k in SHAPES:
        gemv_case = gemv.make_case(device, {"n": n, "k": k, "group": 32, "epilogue": "none", "bias": False}, rng)
        gemv_set = {**gemv.params.defaults(), "LAYOUT": 0, "LANES": 1, "ROWS": 2, "WGR": 16, "I8": 1}
        for m in args.m:
            launch, error = probe(device, n, k, m, rng)
            if error > TOLERANCE:
                raise SystemExit(f"{label} M = {m}: the probe is wrong (relative error {error:.2e})")
            i8_case = i8.make_case(device, {"m": m, "n": n, "k": k, "group": 32, "epilogue": "none"}, rng)
            i8_set = {**i8.params.defaults(), "WGS": 16, "ROWS": 4, "MT": 4}
            runs = {"GEMV": lambda: gemv_case.launch(gemv_set), "gemm_q4_i8": lambda: i8_case.launch(i8_set),
                    "rows in lanes": launch}
            times = {name: [] for name in runs}
            for _ in range(args.rounds):
                names = list(runs)
                shuffle.shuffle(names)
                for name in names:
                    with device.profiling() as queue:   # the queue the probe's own launches go to
                        run = runs[name] if name != "rows in lanes" else lambda: launch(queue)
                        times[name].append(time_launches(run, warmup=1, repeat=5, device=device).median_s)
            t = {name: statistics.median(v) for name, v in times.items()}
            per_row = {name: (t[name] - t["GEMV"]) / (m - 1) / t["GEMV"] for name in ("gemm_q4_i8", "rows in lanes")}
            print(f"{label} {n}x{k} M = {m}: GEMV {t['GEMV'] * 1e6:.1f}, gemm_q4_i8 {t['gemm_q4_i8'] * 1e6:.1f} "
                  f"({per_row['gemm_q4_i8']:.2f} a row), rows in lanes {t['rows in lanes'] * 1e6:.1f} "
                  f"({per_row['rows in lanes']:.2f} a row; error {error:.1e})", flush=True)


if __name__ == "__main__":
    main()
