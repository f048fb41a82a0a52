"""Which device: the OpenCL devices installed here, and the one perfx takes (``PERFX_DEVICE`` or
``--device``, else the first GPU, else a CPU implementation in order of preference)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pyopencl as cl

from perfx.errors import PerfxError
from perfx.runtime.capabilities import _vendor_key, device_type_name
from perfx.runtime.implementations import prepare

DEVICE_HELP = ("OpenCL device: P:D indices from `perfx info`, or part of a platform/device name, or pocl / intel "
               "(default: $PERFX_DEVICE, else the first GPU, else Intel's CPU runtime, else PoCL or another CPU)")

# Among CPU implementations, Intel's runtime first: it has what the phone GPUs have and PoCL lacks (fp16,
# subgroups, image1d_buffer, 16384² images) and runs work-items as SIMD lanes as a GPU runs waves, and its
# decode was as fast or faster at built-in defaults than PoCL with its tuned entries (benchmarks/NOTES.md).
CPU_PREFERENCE = ("intel", "pocl")

NO_PLATFORM_HELP = (
    "No OpenCL platform found. On a PC or in CI, install the dev extra, which brings PoCL, an OpenCL "
    "CPU driver: pip install -e \".[dev]\". On a Snapdragon phone (Termux): pkg install ocl-icd "
    "opencl-vendor-driver clinfo, then export LD_LIBRARY_PATH=/vendor/lib64:$PREFIX/lib and check "
    "that `clinfo` lists \"QUALCOMM Snapdragon(TM)\"."
)


@dataclass(frozen=True)
class DeviceEntry:
    platform_index: int
    device_index: int
    platform: str
    name: str
    device_type: str
    simulator: bool
    device: cl.Device

    @property
    def index(self) -> str:
        """``P:D``, the selector that names this device in this process."""
        return f"{self.platform_index}:{self.device_index}"

    @property
    def implementation(self) -> str:
        """Which OpenCL implementation, in short: "pocl", "intel", "qualcomm", "nvidia", ..."""
        return _vendor_key("", self.platform)

    @property
    def label(self) -> str:
        return f"{self.index} {self.platform} / {self.name} ({self.device_type})"


def list_devices() -> list[DeviceEntry]:
    """Every OpenCL device of every platform here, in the order `perfx info` lists them (the process
    prepared first: see ``prepare``)."""
    prepare()
    try:
        platforms = cl.get_platforms()
    except cl.Error as e:
        raise PerfxError(NO_PLATFORM_HELP) from e
    entries = []
    for p, platform in enumerate(platforms):
        try:
            devices = platform.get_devices()
        except cl.Error:  # a platform with no devices (e.g. a GPU ICD with the GPU absent)
            continue
        for d, device in enumerate(devices):
            entries.append(DeviceEntry(
                p, d, platform.name.strip(), device.name.strip(),
                device_type_name(device),
                "oclgrind" in platform.name.lower() or "oclgrind" in device.name.lower(), device))
    if not entries:
        raise PerfxError(NO_PLATFORM_HELP)
    return entries


def choose_device(selector: str | None = None) -> tuple[DeviceEntry, str]:
    """Pick a device: the selector (or ``PERFX_DEVICE``), else the first GPU, else a CPU in the order of
    ``CPU_PREFERENCE`` (Intel's runtime, then PoCL, then any other).

    The selector is ``P:D`` (platform and device indices as `perfx info` lists them) or a
    case-insensitive substring of "platform / device name / implementation" (``pocl``, ``intel``). A
    simulator (Oclgrind) is chosen only when the selector names it. Returns the entry and the reason,
    for `perfx info`.
    """
    entries = list_devices()
    source = "--device"
    if selector is None:
        selector, source = os.environ.get("PERFX_DEVICE") or None, "PERFX_DEVICE"
    if selector:
        match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", selector)
        if match:
            p, d = int(match.group(1)), int(match.group(2))
            found = [e for e in entries if (e.platform_index, e.device_index) == (p, d)]
        else:
            needle = selector.strip().lower()
            found = [e for e in entries if needle in f"{e.platform} / {e.name} / {e.implementation}".lower()]
        if not found:
            listing = "\n  ".join(e.label for e in entries)
            raise PerfxError(f"{source}={selector!r} matches no OpenCL device. Devices here:\n  {listing}\n"
                             "Give P:D indices or part of a platform or device name.")
        return found[0], f"{source}={selector!r}"
    real = [e for e in entries if not e.simulator]
    for entry in real:
        if entry.device_type == "GPU":
            return entry, "first GPU (set PERFX_DEVICE to choose another)"

    def rank(entry: DeviceEntry) -> int:
        key = entry.implementation
        return CPU_PREFERENCE.index(key) if key in CPU_PREFERENCE else len(CPU_PREFERENCE)

    cpus = sorted((e for e in real if e.device_type == "CPU"), key=rank)  # stable: platform order within a rank
    if cpus:
        others = sorted({e.implementation for e in cpus} - {cpus[0].implementation})
        return cpus[0], (f"CPU, {cpus[0].implementation}" + (f" preferred over {', '.join(others)}" if others else "")
                         + " (set PERFX_DEVICE to choose another)")
    if real:
        return real[0], "first device (set PERFX_DEVICE to choose another)"
    raise PerfxError("Only a simulator (Oclgrind) is installed; name it with PERFX_DEVICE=oclgrind to use it, "
                     "or install a real driver. " + NO_PLATFORM_HELP)

