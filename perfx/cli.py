"""The `perfx` command line: info, selftest (and, as they land, generate, chat, tune, bench)."""

from __future__ import annotations

import argparse
import json
import sys

from perfx.errors import PerfxError

DEVICE_HELP = ("OpenCL device: P:D indices from `perfx info`, or part of a platform/device name "
               "(default: $PERFX_DEVICE, else the first GPU, else the first CPU)")


def cmd_info(args) -> int:
    from perfx.runtime import Device, capabilities_dict, list_devices

    entries = list_devices()
    device = Device(args.device)
    caps = capabilities_dict(device.caps)
    if args.json:
        print(json.dumps({
            "devices": [{"index": f"{e.platform_index}:{e.device_index}", "platform": e.platform, "name": e.name,
                         "type": e.device_type, "simulator": e.simulator} for e in entries],
            "chosen": {"index": f"{device.entry.platform_index}:{device.entry.device_index}",
                       "name": device.caps.name, "reason": device.reason},
            "capabilities": caps,
        }, indent=1))
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
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20:
            value = f"{value} ({value / 2**20:.0f} MiB)"
        print(f"  {key:22} {value}")
    return 0


def cmd_selftest(args) -> int:
    from perfx import selftest
    return selftest.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="perfx",
        description="Run Llama-family LLMs on phone GPUs through hand-written, autotuned OpenCL kernels.",
        epilog="Environment: PERFX_DEVICE chooses the device, PERFX_LIMITS=adreno740 caps what perfx believes "
               "the device allows (phone limits on any machine), PERFX_CACHE is where models are cached.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser("info", help="OpenCL platforms, devices, capabilities and which device perfx chooses",
                          description="List OpenCL platforms and devices, the capabilities perfx reads, the "
                                      "limits in force and which device perfx chooses and why.")
    info.add_argument("--device", help=DEVICE_HELP)
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)

    test = sub.add_parser("selftest", help="check every kernel on this device against float64 references",
                          description="Run every kernel family on this device at its test shapes, at the "
                                      "defaults and at every parameter set the tuner may choose, against the "
                                      "float64 numpy references. Exit status 1 if any check fails.")
    test.add_argument("--device", help=DEVICE_HELP)
    test.add_argument("--quick", action="store_true", help="defaults only, one shape per family (about a minute)")
    test.add_argument("--kernels", help="comma-separated kernel families (default: all)")
    test.add_argument("--json", action="store_true", help="machine-readable output")
    test.add_argument("-v", "--verbose", action="store_true", help="show every check, not only failures")
    test.set_defaults(func=cmd_selftest)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except PerfxError as e:
        print(f"perfx: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("perfx: interrupted", file=sys.stderr)
        return 130
