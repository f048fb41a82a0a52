"""Does a decode GEMV from memory get faster with the second core? One work-group (one core) against two, four
and a model's row count, weights rotated past the last-level cache, beside the copy kernel on the same bytes.

An int4 GEMV of K = 4608 (18 KB of codes a row), 64 rows a work-group (gemv_q4's rows kernel, LANES 1, ROWS 1,
WGR 64, fp32 and I8), timed cold (copies rotated past 60 MB, as a decode step reads its weights) and warm (one
copy, in the cache): GB/s of weights. The copy kernel moves the same bytes (read + write, `perfx bench`'s
ceiling) with one work-group per 64 rows' worth. Where the warm GEMV scales with the work-groups and the cold one
does not while the copy does, the cores share what keeps a GEMV's loads in flight (on a 2-vCPU VM often the two
hyperthreads of one physical core), and fewer instructions per byte, not more threads, is what speeds it up.

    PERFX_DEVICE=intel python benchmarks/gemv_cores.py [--json]
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from perfx.formats import Q4Matrix
from perfx.ops.gemv_q4 import GemvQ4
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.runtime import get_device
from perfx.timing import time_launches

K = 4608
ROWS_SET = {"LAYOUT": 0, "LANES": 1, "ROWS": 1, "WGR": 64, "READ": 0, "SG": 0, "HALF": 0, "SUBGROUP": 0}
ROTATED = 60 << 20


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=os.environ.get("PERFX_DEVICE", "intel"))
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    device = get_device(args.device)
    rng = np.random.default_rng(0)
    x = device.upload(rng.standard_normal(K).astype(np.float32))
    copy = device.kernel("copy.cl", "copy_vectors", {"VWC": 8 if device.caps.vendor_key == "pocl" else 4})
    out = []
    for n in (64, 128, 256, 1024):
        matrix = Q4Matrix.random(n, K, 32, rng)
        nbytes = n * K // 2 + 4 * n * K // 32
        copies = max(2, ROTATED // nbytes)
        weights = [Q4DeviceWeight.upload(device, matrix, None, ("buffer",), layout=0, what="gemv_cores weight")
                   for _ in range(copies)]
        y = device.empty(n, np.float32)
        sources = [device.alloc(nbytes, what="gemv_cores copy source") for _ in range(copies)]
        target = device.alloc(nbytes, what="gemv_cores copy target")
        state = {"i": 0}

        def rotate():
            state["i"] = (state["i"] + 1) % copies
        row = {"rows": n, "work_groups": n // 64, "bytes": nbytes}
        for i8 in (0, 1):
            op = GemvQ4(device, {**ROWS_SET, "I8": i8}, {"epilogue": "none"})
            # the product's own launch (I8 quantizes x in a launch before it, which would carry the runtime's
            # wake-up after the host's wait: the rows' scaling is what this measures)
            cold = time_launches(lambda: op.events(weights[state["i"]], x, y)[-1:], warmup=3, repeat=40,
                                 rotate=rotate).median_s
            warm = time_launches(lambda: op.events(weights[0], x, y)[-1:], warmup=3, repeat=40).median_s
            row[f"gemv_i8{i8}_cold_gb_s"] = round(nbytes / cold / 1e9, 2)
            row[f"gemv_i8{i8}_warm_gb_s"] = round(nbytes / warm / 1e9, 2)
        floats = nbytes // 4
        groups = max(1, n // 64)
        cold = time_launches(lambda: [device.launch(copy, (64 * groups,), (64,), np.int32(floats // (
            4 if device.caps.vendor_key != "pocl" else 8)), sources[state["i"]], target)], warmup=3, repeat=40,
            rotate=rotate).median_s
        row["copy_cold_gb_s"] = round(2 * nbytes / cold / 1e9, 2)
        out.append(row)
        if not args.json:
            print(f"{n:5d} rows ({n // 64:2d} work-groups): GEMV fp32 cold {row['gemv_i80_cold_gb_s']:5.2f} warm "
                  f"{row['gemv_i80_warm_gb_s']:5.2f} | I8 cold {row['gemv_i81_cold_gb_s']:5.2f} warm "
                  f"{row['gemv_i81_warm_gb_s']:5.2f} | copy cold {row['copy_cold_gb_s']:5.2f} GB/s")
    if args.json:
        print(json.dumps({"device": device.caps.name, "k": K, "results": out}))


if __name__ == "__main__":
    main()
