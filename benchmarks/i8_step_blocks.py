"""The int4 decode GEMV's int8-activation (I8) sets timed two ways, interleaved in one run: with x's quantizing
launch before each product (how the tuner timed them before) and on x's Q8_1 blocks written once (as the decode
step runs them, where the norm, the attention or gate-up's tail has written the blocks), at the default model's
qkv, o, gate-up and down shapes.

    python benchmarks/i8_step_blocks.py --device intel [--rounds 7] [--repeat 5] [--json]

Each shape runs the I8 set the tuning database has in force there, else that entry with I8 = 1 where the rows
layout allows it, else the rows layout's defaults with I8 = 1. Both ways read the same weight copies past the cache
and are replayed back to back as the tuner times (``perfx.tuning.spec.time_case``); both are checked first against
the float64 product at the I8 tolerance. Prints each way's median time over the rounds and the ratio of medians
(own launch / blocks given) with its 95% bootstrap interval, and the quantizing launch's own device time.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from perfx import reference
from perfx.commands.bench import interleaved
from perfx.errors import PerfxError
from perfx.formats import Q4Matrix
from perfx.ops.gemv_q4 import GemvQ4
from perfx.ops.q4_weight import LAYOUT_ROWS, Q4DeviceWeight
from perfx.runtime import Device, get_device
from perfx.timing import bootstrap_ratio
from perfx.tuning.database import default_database
from perfx.tuning.gemv_q4 import SPEC, _weight_bytes, activations, read_paths, step_blocks
from perfx.tuning.spec import copies_past_cache, epilogue_reference, relative_error, rotating_case, time_case

SHAPES = {   # the default model's (SmolLM2-135M) decode GEMVs, as `perfx tune` keys them
    "qkv": {"n": 960, "k": 576, "group": 32, "epilogue": "none", "bias": False, "parts": [576, 192, 192]},
    "o": {"n": 576, "k": 576, "group": 32, "epilogue": "none", "bias": False},
    "gate-up": {"n": 3072, "k": 576, "group": 32, "epilogue": "silu_mul", "bias": False},
    "down": {"n": 576, "k": 1536, "group": 32, "epilogue": "none", "bias": False},
}


def i8_set(device, shape) -> tuple[dict, str]:
    """The I8 set to time at ``shape`` and where it came from."""
    choice = default_database().choices(device, SPEC, shape)[0]
    entry = dict(choice.params)
    if entry["LAYOUT"] == LAYOUT_ROWS and entry["I8"]:
        return entry, f"the {choice.source} entry"
    for params, source in (({**entry, "I8": 1}, f"the {choice.source} entry with I8 = 1"),
                           ({"LAYOUT": LAYOUT_ROWS, "I8": 1}, "the rows layout's defaults with I8 = 1")):
        try:
            return dict(GemvQ4(device, params, shape).params), source
        except PerfxError:
            continue
    raise PerfxError(f"no I8 set of the rows layout runs {shape} here")


def measure(device, label: str, shape: dict, rounds: int, repeat: int, rng) -> dict:
    n, k, epilogue = shape["n"], shape["k"], shape["epilogue"]
    params, source = i8_set(device, shape)
    q4 = Q4Matrix.concat([Q4Matrix.random(p, k, shape["group"], rng) for p in shape.get("parts") or (n,)])
    x = device.upload(activations(rng, k))
    y = device.poisoned(n // 2 if epilogue != "none" else n, np.float32)
    expected = epilogue_reference(epilogue, reference.gemv(q4.dequantize(), x.get()))
    copies = copies_past_cache(device, _weight_bytes(shape))
    weights = [Q4DeviceWeight.upload(device, q4, None, read_paths(device, n, k, LAYOUT_ROWS), layout=LAYOUT_ROWS)
               for _ in range(copies)]
    wrapper = GemvQ4(device, params, shape)
    blocks = step_blocks(device, x, k, lambda p: wrapper)
    ways = {
        "own launch": rotating_case(expected, y, copies, lambda i, p: wrapper.events(weights[i], x, y, epilogue),
                                    device=device),
        "blocks given": rotating_case(expected, y, copies,
                                      lambda i, p: wrapper.events(weights[i], x, y, epilogue, quantized=blocks(p)),
                                      device=device, prepare=blocks),
    }
    tolerance = SPEC.tolerance_for(params)
    for way, case in ways.items():
        error = relative_error(case.run(params)["y"], expected)
        if error > tolerance:
            raise PerfxError(f"{label} {way}: relative error {error:.2e} above {tolerance:.0e}")
    names = list(ways)
    timed = interleaved(lambda way: time_case(ways[way], params, warmup=1, repeat=repeat, device=device).median_s, names,
                        rounds)
    own, given = ([r[i] for r in timed] for i in range(2))
    ratio, low, high = bootstrap_ratio(own, given, np.random.default_rng(0))
    return {"label": label, "shape": shape, "params": params, "source": source, "copies": copies,
            "own_launch_us": float(np.median(own)) * 1e6, "blocks_given_us": float(np.median(given)) * 1e6,
            "ratio": ratio, "interval": [low, high], "rounds_own_us": [t * 1e6 for t in own],
            "rounds_given_us": [t * 1e6 for t in given],
            "quantize_launch_us": quantize_share(device, ways["own launch"], params, rounds) * 1e6}


def quantize_share(device, case, params, rounds: int) -> float:
    """The quantizing launch's own device time a product where the product launches it (each launch's event, start
    to end; median over ``rounds`` replays of every copy)."""
    shares = []
    with device.profiling():
        for _ in range(rounds):
            events = case.steady(params, case.steady_count)
            if len(events) != 2 * case.steady_count:
                raise PerfxError(f"{len(events)} launches for {case.steady_count} products: not the quantizing and "
                                 "the GEMV alone")
            for event in events:
                event.wait()
            shares.append(sum(Device.event_seconds(e) for e in events[0::2]) / case.steady_count)
    return float(np.median(shares))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=os.environ.get("PERFX_DEVICE"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=5, help="replays of every copy a way's figure takes in a round "
                                                             "(their median)")
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    args = parser.parse_args(argv)
    device = get_device(args.device)
    rng = np.random.default_rng(0)
    rows = [measure(device, label, shape, args.rounds, args.repeat, rng) for label, shape in SHAPES.items()]
    if args.json:
        print(json.dumps({"device": device.caps.name, "platform": device.caps.platform, "rounds": args.rounds,
                          "repeat": args.repeat, "shapes": rows}, indent=1))
        return
    print(f"{device.caps.platform} / {device.caps.name}, {args.rounds} interleaved rounds")
    for r in rows:
        params = " ".join(f"{a}={b}" for a, b in r["params"].items())
        low, high = r["interval"]
        print(f"{r['label']:8s} {params} ({r['source']}): own launch {r['own_launch_us']:.1f} us, blocks given "
              f"{r['blocks_given_us']:.1f} us, ratio {r['ratio']:.2f} [{low:.2f}, {high:.2f}]; the quantizing launch "
              f"alone {r['quantize_launch_us']:.1f} us")


if __name__ == "__main__":
    main()
