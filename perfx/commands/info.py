"""`perfx info`: OpenCL platforms and devices, the one perfx chooses and why, its capabilities and limits,
and the tuned parameters in force."""

from __future__ import annotations

import json
from collections import Counter

from perfx.ops.gemm_q4 import DEFAULT_CROSSOVER
from perfx.runtime import DEVICE_HELP, Device, capabilities_dict, list_devices
from perfx.tuning import SPECS
from perfx.tuning.database import default_database


def add_arguments(parser):
    parser.add_argument("--device", help=DEVICE_HELP)
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def main(args) -> int:
    entries = list_devices()
    device = Device(args.device)
    caps = capabilities_dict(device.caps)
    tuned = default_database().entries_in_force(device, SPECS)
    if args.json:
        print(json.dumps({
            "devices": [{"index": f"{e.platform_index}:{e.device_index}", "platform": e.platform, "name": e.name,
                         "type": e.device_type, "simulator": e.simulator} for e in entries],
            "chosen": {"index": f"{device.entry.platform_index}:{device.entry.device_index}",
                       "name": device.caps.name, "reason": device.reason},
            "capabilities": caps,
            "tuning": tuned,
        }, indent=1, default=str))
        return 0
    print("OpenCL devices:")
    for e in entries:
        mark = "*" if e == device.entry else " "
        print(f" {mark} {e.label}{'  [simulator: used only when named]' if e.simulator else ''}")
    print(f"\nperfx uses {device.entry.platform_index}:{device.entry.device_index} "
          f"{device.caps.name}: {device.reason}")
    print(f"limits in force: {device.caps.limits}" + ("" if device.caps.limits != "device" else
                                                      " (set PERFX_LIMITS=adreno740 to act like a phone)"))
    print("\ncapabilities:")
    for key, value in caps.items():
        if key == "extensions":
            value = " ".join(value)
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and "texels" not in key:
            value = f"{value} ({value / 2**20:.0f} MiB)"
        print(f"  {key:22} {value}")
    print("\ntuned parameters in force (device → architecture → vendor → built-in defaults):")
    if not tuned:
        print("  none: every kernel runs its built-in defaults (run `perfx tune`)")
    for entry in tuned:
        params = " ".join(f"{k}={v}" for k, v in entry["params"].items())
        note = f"  [{entry['note']}]" if entry.get("note") else ""
        print(f"  {entry['family']:18} {entry['shape_text']:40} {params}  ({entry['level']}: "
              f"{entry['file']}){note}")
    print("\nprefill GEMM, the kernel the model runs per prompt length (M bucket):")
    for line in gemm_choice_lines(tuned):
        print(f"  {line}")
    return 0


def gemm_choice_lines(entries: list[dict]) -> list[str]:
    """Which of the tall-skinny and tiled GEMMs wins per M bucket, from the tuned times in force.

    The model makes the same comparison per matrix (``Llama._prefill_kernels``); where either time is
    missing it uses the built-in crossover.
    """
    times: dict[tuple, dict] = {}
    for e in entries:
        if e["family"] in ("gemm_q4_skinny", "gemm_q4_tiled") and e.get("time_s") and isinstance(e["shape"], dict):
            shape = dict(e["shape"])
            m = shape.pop("m", None)
            times.setdefault((m, json.dumps(shape, sort_keys=True)), {})[e["family"].rsplit("_", 1)[1]] = e["time_s"]
    wins: dict[int, Counter] = {}
    for (m, _), pair in times.items():
        if len(pair) == 2:
            wins.setdefault(m, Counter())[min(pair, key=pair.get)] += 1
    lines = [f"M ≈ {m:4}: " + ", ".join(f"{kind} fastest for {n} matri{'x' if n == 1 else 'ces'}"
                                        for kind, n in counts.most_common())
             for m, counts in sorted(wins.items())]
    lines.append(f"elsewhere: tall-skinny up to M = {DEFAULT_CROSSOVER}, tiled above (built-in crossover; "
                 "`perfx tune --kernels gemm_q4` measures it on this device)")
    return lines
