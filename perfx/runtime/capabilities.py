"""What a device can do: its capabilities as perfx reads them (features, limits, how it was identified),
capped by phone limits (``PERFX_LIMITS``) so that the code for a phone's limits runs on any machine."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pyopencl as cl

from perfx.errors import PerfxError


@dataclass(frozen=True)
class Limits:
    """Caps on what perfx believes the device allows; ``None`` leaves the device's own value."""

    name: str = "device"
    image2d_max_width: int | None = None
    image2d_max_height: int | None = None
    max_alloc: int | None = None
    local_mem: int | None = None
    max_work_group: int | None = None

    FIELDS = ("image2d_max_width", "image2d_max_height", "max_alloc", "local_mem", "max_work_group")


# Adreno 740 (Snapdragon 8 Gen 2), from device dumps and llama.cpp's Adreno backend notes.
LIMIT_PRESETS = {
    "adreno740": Limits("adreno740", 16384, 16384, 1 << 30, 32 << 10, 1024),
    # Some QCS parts cap a single allocation at 256 MiB.
    "adreno-qcs": Limits("adreno-qcs", 16384, 16384, 256 << 20, 32 << 10, 1024),
}


def parse_limits(value: str | None) -> Limits:
    """``PERFX_LIMITS``: a preset name or a path to a JSON object with any of ``Limits.FIELDS``."""
    if not value:
        return Limits()
    if value.lower() in LIMIT_PRESETS:
        return LIMIT_PRESETS[value.lower()]
    path = Path(value)
    if not path.is_file():
        raise PerfxError(f"PERFX_LIMITS={value!r} is neither a preset ({', '.join(LIMIT_PRESETS)}) "
                         "nor a JSON file. Unset it, name a preset, or give the path of a JSON object "
                         f"with keys {', '.join(Limits.FIELDS)}.")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PerfxError(f"PERFX_LIMITS file {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise PerfxError(f"PERFX_LIMITS file {path} must hold a JSON object, not {type(data).__name__}")
    unknown = set(data) - set(Limits.FIELDS) - {"name"}
    if unknown:
        raise PerfxError(f"PERFX_LIMITS file {path}: unknown keys {sorted(unknown)}; "
                         f"allowed: {', '.join(Limits.FIELDS)}")
    for key in Limits.FIELDS:
        if key in data and (not isinstance(data[key], int) or isinstance(data[key], bool) or data[key] <= 0):
            raise PerfxError(f"PERFX_LIMITS file {path}: {key} must be a positive integer, got {data[key]!r}")
    return Limits(name=str(data.get("name", path.stem)), **{k: data[k] for k in Limits.FIELDS if k in data})


@dataclass(frozen=True)
class Capabilities:
    platform: str
    name: str
    vendor: str
    vendor_key: str           # normalised: qualcomm, nvidia, amd, intel, arm, pocl, ...
    device_type: str          # GPU, CPU, ACCELERATOR
    opencl_c_version: str
    opencl_c: tuple[int, int]  # the newest OpenCL C the compiler takes (-cl-std), e.g. (3, 0)
    driver_version: str
    adreno_model: int | None  # 740 from "OpenCL C 3.0 Adreno(TM) 740"
    architecture: str         # "adreno-7xx" ("adreno" without a model number), else vendor_key plus device name
    identified: str           # how: "Adreno 740, from the OpenCL C version", or why only the vendor is known
    compute_units: int
    global_mem: int
    cache_bytes: int          # the largest cache a kernel's inputs can stay in between launches (see _cache_bytes)
    fp16: bool
    integer_dot_product: bool  # cl_khr_integer_dot_product (dot(uchar4, uchar4), dot_4x8packed_*)
    subgroups: bool            # sub_group_reduce_add, sub_group_broadcast, ... (see has_subgroups)
    subgroup_sizes: tuple[int, ...]  # those the device offers, where it says (Intel); else ()
    reqd_subgroup_size: str    # how a kernel fixes its subgroup size: "qcom" ("half"/"full"), "intel" (N), ""
    qcom_extensions: tuple[str, ...]
    image_support: bool
    image2d_max_width: int
    image2d_max_height: int
    image2d_from_buffer: bool
    image_pitch_alignment: int  # in pixels; 0 where the device does not say
    image1d_buffer_texels: int  # most texels of an image1d_buffer_t view of a buffer (OpenCL 1.2 core); 0: none
    local_mem: int
    max_alloc: int
    max_work_group: int
    extensions: tuple[str, ...]
    limits: str                # which Limits capped the values above
    c_features: tuple[str, ...] = ()  # the OpenCL C 3.0 optional features the compiler declares (__opencl_c_...)

    def has(self, extension: str) -> bool:
        return extension in self.extensions


_ADRENO = re.compile(r"Adreno\s*(?:\(TM\))?\s*(\d{3,4})", re.IGNORECASE)


def parse_adreno_model(*texts: str) -> int | None:
    """Adreno's device name is a generic "QUALCOMM Adreno(TM)"; the model number is in the OpenCL C version."""
    for text in texts:
        match = _ADRENO.search(text or "")
        if match:
            return int(match.group(1))
    return None


def identify(vendor_key: str, name: str, opencl_c_version: str, version: str, driver_version: str
             ) -> tuple[str, int | None, str, str]:
    """(vendor key, Adreno model, architecture, how it was identified) of a device, from whatever it reports.

    Adreno's model number is usually in the OpenCL C version ("OpenCL C 3.0 Adreno(TM) 740"), on some
    drivers in the device name, version or driver version; some Qualcomm drivers report none (a bare
    "QUALCOMM" and "OpenCL 3.0"): then only the vendor is known, and the vendor-level Qualcomm entries apply.
    """
    sources = (("the OpenCL C version", opencl_c_version), ("the device name", name),
               ("the device version", version), ("the driver version", driver_version))
    for where, text in sources:
        model = parse_adreno_model(text)
        if model is not None:
            return "qualcomm", model, f"adreno-{str(model)[0]}xx", f"Adreno {model}, from {where}"
    if vendor_key == "qualcomm" or "qualcomm" in name.lower() or "adreno" in name.lower():
        return ("qualcomm", None, "adreno",
                "a Qualcomm GPU that reports no Adreno model number: the vendor-level Qualcomm entries apply "
                "until you tune (please send `perfx report`)")
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return vendor_key, None, f"{vendor_key}-{slug}", f"{name} (vendor {vendor_key})"


def _vendor_key(vendor: str, platform: str) -> str:
    text = f"{vendor} {platform}".lower()
    for key in ("qualcomm", "nvidia", "intel", "arm", "apple", "oclgrind"):
        if key in text:
            return key
    if "advanced micro devices" in text or "amd" in text.split():
        return "amd"
    if "portable computing language" in text or "pocl" in text:
        return "pocl"
    return re.sub(r"[^a-z0-9]+", "-", vendor.lower()).strip("-") or "unknown"


def device_type_name(device: cl.Device) -> str:
    # pyopencl's to_string renders CPU (2) as "ALL | CPU": read the bits ourselves.
    for bit, name in ((cl.device_type.GPU, "GPU"), (cl.device_type.CPU, "CPU"),
                      (cl.device_type.ACCELERATOR, "ACCELERATOR")):
        if device.type & bit:
            return name
    return "OTHER"


def _device_int(device: cl.Device, name: str, code: int | None = None) -> int:
    """A ``cl_uint``/``size_t`` device query by pyopencl's name, else by its code; 0 where unanswered."""
    try:
        return int(getattr(device, name))
    except Exception:
        if code is None:
            return 0
        values = _raw_device_info(device, code, ctypes.c_uint)
        return values[0] if values else 0


# cl_intel_subgroups; no pyopencl name for it. Adreno has no such query: its waves are "half" or "full".
CL_DEVICE_SUB_GROUP_SIZES_INTEL = 0x4108


@functools.lru_cache(maxsize=1)
def _opencl_library():
    """The ICD loader pyopencl uses (its wheel's own, else the system's), for queries pyopencl lacks."""
    bundled = sorted(glob.glob(os.path.join(os.path.dirname(cl.__file__), ".libs", "libOpenCL*.so*")))
    return ctypes.CDLL(bundled[0] if bundled else "libOpenCL.so.1")


def _raw_device_info(device: cl.Device, code: int, item=ctypes.c_size_t) -> tuple[int, ...]:
    """A device query pyopencl does not know (it answers CL_INVALID_VALUE for codes it lacks, such as
    CL_DEVICE_IMAGE_PITCH_ALIGNMENT), read as an array of ``item``; () where the device does not answer."""
    try:
        get_info = _opencl_library().clGetDeviceInfo
        handle, size = ctypes.c_void_p(device.int_ptr), ctypes.c_size_t(0)
        if get_info(handle, ctypes.c_uint(code), ctypes.c_size_t(0), None, ctypes.byref(size)) or not size.value:
            return ()
        values = (item * (size.value // ctypes.sizeof(item)))()
        if get_info(handle, ctypes.c_uint(code), size, values, None):
            return ()
        return tuple(int(v) for v in values)
    except Exception:  # no loader library to open, or an old driver
        return ()


def _opencl_c(device: cl.Device) -> tuple[int, int]:
    """The newest OpenCL C version: OpenCL 3.0 lists them all (its CL_DEVICE_OPENCL_C_VERSION may stay at
    1.2, as PoCL's does); older devices name one in the version string."""
    try:
        versions = [v.version for v in device.opencl_c_all_versions]
        if versions:
            newest = max(versions)
            return newest >> 22, (newest >> 12) & 0x3FF  # CL_VERSION_MAJOR / CL_VERSION_MINOR
    except Exception:  # before OpenCL 3.0
        pass
    match = re.search(r"OpenCL C (\d+)\.(\d+)", device.opencl_c_version)
    return (int(match.group(1)), int(match.group(2))) if match else (1, 0)


def has_subgroups(extensions, c_features=()) -> bool:
    """Whether the subgroup built-ins exist: cl_khr_subgroups or cl_intel_subgroups (at any -cl-std), or
    the OpenCL C 3.0 feature __opencl_c_subgroups (kernels built with -cl-std=CL3.0). Intel's CPU runtime
    has only the last two, so a kernel tests all three macros."""
    return ("cl_khr_subgroups" in extensions or "cl_intel_subgroups" in extensions
            or "__opencl_c_subgroups" in c_features)


def _opencl_c_features(device: cl.Device) -> tuple[str, ...]:
    try:
        return tuple(f.name for f in device.opencl_c_features)
    except Exception:  # before OpenCL 3.0
        return ()


def _host_cache_bytes() -> int:
    """The host CPU's largest cache (Linux sysfs; 0 where it cannot be read)."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = Path(path).read_text().strip().upper()
        except OSError:
            continue
        match = re.fullmatch(r"(\d+)([KMG]?)", text)
        if match:
            sizes.append(int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[match.group(2)])
    return max(sizes, default=0)


# A GPU's last-level cache as large as any seen (a data-centre GPU's L2 of tens of MB; a Snapdragon's
# system-level cache, shared with the CPU, a few MB): timings rotate inputs past it, so too large a figure costs
# only memory.
GPU_CACHE_FLOOR = 64 << 20


def _cache_bytes(device: cl.Device, device_type: str) -> int:
    """The largest cache a kernel's inputs can stay in between launches. CPU runtimes report the L2 (Intel's
    and PoCL's: 512 KiB on a CPU with 32 MiB of L3), so the host's largest cache counts too; GPU drivers report
    a cache closer to the cores than the last level, so a GPU is taken to have at least ``GPU_CACHE_FLOOR``."""
    reported = int(device.global_mem_cache_size or 0)
    if device_type == "CPU":
        return max(reported, _host_cache_bytes())
    return max(reported, GPU_CACHE_FLOOR) if device_type == "GPU" else reported


def read_capabilities(device: cl.Device, limits: Limits = Limits()) -> Capabilities:
    """What perfx reads of ``device``, each limit capped by ``limits``."""
    extensions = tuple(sorted(device.extensions.split()))
    platform = device.platform.name.strip()
    vendor = device.vendor.strip()
    key, model, architecture, identified = identify(_vendor_key(vendor, platform), device.name.strip(),
                                                    device.opencl_c_version, device.version, device.driver_version)

    def capped(value: int, cap: int | None) -> int:
        return min(value, cap) if cap else value

    image = bool(device.image_support)
    return Capabilities(
        platform=platform, name=device.name.strip(), vendor=vendor, vendor_key=key,
        device_type=device_type_name(device),
        opencl_c_version=device.opencl_c_version.strip(), opencl_c=_opencl_c(device),
        driver_version=device.driver_version.strip(),
        adreno_model=model, architecture=architecture, identified=identified,
        compute_units=device.max_compute_units, global_mem=device.global_mem_size,
        cache_bytes=_cache_bytes(device, device_type_name(device)),
        fp16="cl_khr_fp16" in extensions,
        integer_dot_product="cl_khr_integer_dot_product" in extensions,
        subgroups=has_subgroups(extensions, _opencl_c_features(device)),
        subgroup_sizes=tuple(sorted(_raw_device_info(device, CL_DEVICE_SUB_GROUP_SIZES_INTEL)))
        if "cl_intel_subgroups" in extensions else (),
        reqd_subgroup_size=("qcom" if "cl_qcom_reqd_sub_group_size" in extensions else
                            "intel" if "cl_intel_required_subgroup_size" in extensions else ""),
        qcom_extensions=tuple(e for e in extensions if e.startswith("cl_qcom_")),
        image_support=image,
        image2d_max_width=capped(device.image2d_max_width, limits.image2d_max_width) if image else 0,
        image2d_max_height=capped(device.image2d_max_height, limits.image2d_max_height) if image else 0,
        image2d_from_buffer="cl_khr_image2d_from_buffer" in extensions,
        image_pitch_alignment=_device_int(device, "image_pitch_alignment", 0x104A),
        image1d_buffer_texels=_device_int(device, "image_max_buffer_size") if image else 0,
        local_mem=capped(device.local_mem_size, limits.local_mem),
        max_alloc=capped(device.max_mem_alloc_size, limits.max_alloc),
        max_work_group=capped(device.max_work_group_size, limits.max_work_group),
        extensions=extensions, limits=limits.name, c_features=_opencl_c_features(device),
    )


def capabilities_dict(caps: Capabilities) -> dict:
    return dataclasses.asdict(caps)
