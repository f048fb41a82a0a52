"""`perfx info`: OpenCL platforms and devices, the one perfx chooses and why, its capabilities and limits,
and the tuned parameters in force; with ``--model``, the device forms of that model's weights (the int4 form's
bytes a group)."""

from __future__ import annotations

import json
from collections import Counter

from perfx.formats import Q4Matrix, Q8Matrix
from perfx.ops.gemm_q4 import DEFAULT_CROSSOVER, FAMILIES as GEMM_FAMILIES
from perfx.ops.gemm_q8 import FAMILIES as Q8_GEMM_FAMILIES
from perfx.plan import one_run_costs
from perfx.runtime import DEVICE_HELP, Device, capabilities_dict, list_devices
from perfx.sources import open_named
from perfx.tuning import SPECS
from perfx.tuning.database import Choice, default_database


def add_arguments(parser):
    parser.add_argument("--device", help=DEVICE_HELP)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--model", help="also the device form of each weight of this model (read from its "
                                        "first layer and its tables, nothing uploaded): 'default', a path or "
                                        "synthetic:<name>")
    parser.add_argument("--embedding", choices=["head", "q4"], default="head",
                        help="the untied token embedding's form, as the model commands take it (default: head)")


def main(args) -> int:
    entries = list_devices()
    device = Device(args.device)
    caps = capabilities_dict(device.caps)
    tuned = default_database().entries_in_force(device, SPECS)
    forms = model_forms(args.model, args.embedding) if getattr(args, "model", None) else None
    if args.json:
        print(json.dumps({
            "devices": [{"index": f"{e.platform_index}:{e.device_index}", "platform": e.platform, "name": e.name,
                         "type": e.device_type, "simulator": e.simulator} for e in entries],
            "chosen": {"index": f"{device.entry.platform_index}:{device.entry.device_index}",
                       "name": device.caps.name, "reason": device.reason},
            "capabilities": caps,
            "decode_step": device.replay_mode,
            "replay": device.replay_choice.as_dict(),
            "tuning": tuned,
            **({"model_forms": forms} if forms is not None else {}),
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
    print(f"decode step: {device.replay_mode}")
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
    if forms is not None:
        print(f"\nweights of {args.model}:")
        for role, form in forms.items():
            print(f"  {role:12} {form}")
    return 0


def describe_weight(w) -> str:
    """One weight's device form: "int4 g128, 2.5 bytes a group (fp16 scale + 4-bit zero)", "int8 g32, ..."."""
    if isinstance(w, Q4Matrix):
        return w.describe_form()
    if isinstance(w, Q8Matrix):
        what = ("float32" if w.f32 else "fp16") + (" scale" if w.symmetric else " scale + offset")
        return f"int8 g{w.group}, {w.group_bytes} bytes a group ({what})"
    return "fp16"


def model_forms(name: str, embedding: str = "head") -> dict[str, str]:
    """Each matrix role of layer 0, the token embedding and the lm_head, by its device form."""
    source = open_named(name, embedding=embedding)
    layer = source.layer(0)
    forms = {role: describe_weight(layer.linears()[role]) for role in source.layer_linears(0)}
    forms["embedding"] = describe_weight(source.embedding())
    head = source.lm_head()
    forms["lm_head"] = "the embedding (tied)" if head is None else describe_weight(head)
    return forms


def gemm_choice_lines(entries: list[dict]) -> list[str]:
    """Which of the tall-skinny, tiled and fp16 GEMMs wins per M bucket, from the tuned times in force, and which
    int8 GEMM.

    The model makes the same comparison per matrix (``Llama._prefill_kernels``); where either time is
    missing it uses the built-in crossover.
    """
    times: dict[tuple, dict] = {}
    for e in entries:
        if e["family"] in GEMM_FAMILIES and e.get("time_s") \
                and isinstance(e["shape"], dict):
            shape = dict(e["shape"])
            m = shape.pop("m", None)
            times.setdefault((m, json.dumps(shape, sort_keys=True)), {})[e["family"].rsplit("_", 1)[1]] = e["time_s"]
    wins: dict[int, Counter] = {}
    for (m, _), pair in times.items():
        if "skinny" in pair and "tiled" in pair:
            wins.setdefault(m, Counter())[min(pair, key=pair.get)] += 1
    lines = [f"M ≈ {m:4}: " + ", ".join(f"{kind} fastest for {n} matri{'x' if n == 1 else 'ces'}"
                                        for kind, n in counts.most_common())
             for m, counts in sorted(wins.items())]
    lines.append(f"elsewhere: tall-skinny up to M = {DEFAULT_CROSSOVER}, tiled above (built-in crossover; "
                 "`perfx tune --kernels gemm_q4` measures it on this device)")
    # int8 matrices: another kind where one file timed it with gemm_q8 at a shape and it won, over the Ms the
    # bucket serves (perfx.plan, _faster_q8_gemm)
    int8: dict[int, Counter] = {}
    pairs: dict[tuple, dict] = {}
    for e in entries:
        if e["family"] in Q8_GEMM_FAMILIES and e.get("time_s") and isinstance(e["shape"], dict) and not e.get("note"):
            pairs.setdefault((e["file"], json.dumps(e["shape"], sort_keys=True)), {})[e["family"]] = Choice(
                {}, "", "", e["time_s"], exact=True, file=e["file"], served=e.get("served") or {})
    for (_, shape), choices in pairs.items():
        if "gemm_q8" in choices and len(choices) > 1:
            costs = one_run_costs(choices, "gemm_q8")
            best = min(costs, key=costs.get)
            kind = "skinny" if best == "gemm_q8" else best.rsplit("_", 1)[1]
            int8.setdefault(json.loads(shape)["m"], Counter())[kind] += 1
    lines += [f"M ≈ {m:4}: int8 " + ", ".join(f"{kind} fastest for {n} matri{'x' if n == 1 else 'ces'}"
                                             for kind, n in counts.most_common())
              for m, counts in sorted(int8.items())]
    lines.append("int8 elsewhere: gemm_q8 (gemm_q8_lanes, or gemm_q8_i8 at a batched step's few rows, runs where one "
                 "tuning file timed it with gemm_q8 and it won; `perfx tune --kernels gemm_q8` measures them)")
    return lines
