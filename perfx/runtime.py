"""The device runtime: the one module that talks to OpenCL.

Registering the OpenCL implementations installed from PyPI that the ICD loader cannot find by itself
(Intel's CPU runtime), choosing a device (``PERFX_DEVICE`` or ``--device``), reading its capabilities,
capping them with phone limits (``PERFX_LIMITS``), building kernel files with ``-D`` defines (built
programs and ``Kernel`` objects are kept), turning OpenCL errors into messages that name the constant,
and counting the device memory perfx allocates.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import glob
import hashlib
import importlib.metadata
import json
import os
import re
import sys
import tempfile
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

from perfx.errors import PerfxError
from perfx.resources import cache_dir, kernel_path

# Intel's compiler logs every successful build ("Kernel was 16-way vectorized"), which pyopencl turns into a
# CompilerWarning on each new program (ours and pyopencl.array's); a failed build raises with its log anyway.
# PYOPENCL_COMPILER_OUTPUT=1 asks for the logs: then they show.
if not os.environ.get("PYOPENCL_COMPILER_OUTPUT"):
    warnings.filterwarnings("ignore", category=cl.CompilerWarning)


# pyopencl's binary cache reads os.environ["PYOPENCL_CACHE_FAILURE_FATAL"] without a default when a build
# fails for another reason than the source (CL_INVALID_BUILD_OPTIONS, say): a KeyError instead of the
# OpenCL error. With it set (empty: not fatal), the build is retried uncached and the real error surfaces,
# after a UserWarning with pyopencl's traceback: BuildError carries the same log, so that warning is noise.
os.environ.setdefault("PYOPENCL_CACHE_FAILURE_FATAL", "")
warnings.filterwarnings("ignore", message="PyOpenCL compiler caching failed", category=UserWarning)


def show_build_logs() -> None:
    """Print the compiler's output of every kernel built from now on (`--verbose`); by default only a failed
    build shows its log, in the error."""
    os.environ["PYOPENCL_COMPILER_OUTPUT"] = "1"
    warnings.filterwarnings("always", category=cl.CompilerWarning)

# ----------------------------------------------------------------------------------------------
# Errors


def cl_error_name(code: int) -> str:
    """``-46`` -> ``CL_INVALID_KERNEL_NAME``."""
    try:
        return "CL_" + cl.status_code.to_string(code)
    except Exception:  # an extension's code pyopencl does not know
        return f"CL_ERROR_{code}"


class OpenCLError(PerfxError):
    """An OpenCL call failed; the message names the error constant."""

    def __init__(self, what: str, code: int, detail: str = ""):
        self.code = code
        self.name = cl_error_name(code)
        super().__init__(f"OpenCL error {code}: {self.name} in {what}" + (f"\n{detail}" if detail else ""))


class BuildError(PerfxError):
    """A kernel file failed to build on this driver; carries the file, the defines and the log."""

    def __init__(self, file: str, defines: dict, log: str, device_name: str):
        self.file, self.defines, self.log = file, dict(defines), log
        lines = [line.strip() for line in log.splitlines() if line.strip()]
        # One line for notes and tables: the compiler's first error, else the log's first line.
        self.summary = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "no log")
        flags = " ".join(_define_flags(defines)) or "(no defines)"
        super().__init__(
            f"kernels/{file} failed to build on {device_name} with {flags}.\n"
            f"Build log:\n{log.strip()}\n"
            "If this is a tuned parameter set, run `perfx selftest` and report the log; "
            "perfx falls back to the defaults when a tuned kernel does not build."
        )


@dataclass(frozen=True)
class KernelInfo:
    """What the driver says of one built kernel (clGetKernelWorkGroupInfo)."""

    name: str
    work_group: int                 # the most work-items it runs in one work-group here
    required: tuple[int, ...]       # its reqd_work_group_size, () if it has none
    local_mem: int                  # bytes of local memory it uses
    private_mem: int                # bytes of private memory per work-item: above 0, registers spilled

    @property
    def required_size(self) -> int:
        return int(np.prod(self.required)) if self.required else 0


class KernelLimitError(PerfxError):
    """A kernel built, but its parameters break the limits the driver reports for it (its work-group, or
    the local or private memory it needs): on this driver those parameters cannot run."""


def raise_as_perfx(what: str, error: cl.Error):
    code = getattr(error, "code", 0)
    if code in (-4, -5, -6, -61):  # MEM_OBJECT_ALLOCATION_FAILURE, OUT_OF_RESOURCES, OUT_OF_HOST_MEMORY, INVALID_BUFFER_SIZE
        raise OpenCLError(what, code, "The device ran out of memory: use a smaller --ctx, a smaller model, "
                          "or free other GPU work.") from error
    raise OpenCLError(what, code) from error


# ----------------------------------------------------------------------------------------------
# Phone limits


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


# ----------------------------------------------------------------------------------------------
# Capabilities


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


def capabilities(device: cl.Device, limits: Limits = Limits()) -> Capabilities:
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
        extensions=extensions, limits=limits.name,
    )


# ----------------------------------------------------------------------------------------------
# OpenCL implementations installed from PyPI
#
# pyopencl's wheel bundles ocl-icd, which loads the libraries named by the .icd files of one folder
# (OCL_ICD_VENDORS if it is a folder, else OPENCL_VENDOR_PATH, else /etc/OpenCL/vendors), plus the PoCL
# shipped beside pyopencl itself. The intel-opencl-rt wheel's own .icd file holds a build-time placeholder
# path, so perfx writes a folder holding what the loader would read anyway plus an .icd file with the
# absolute path of the installed libintelocl.so, and points OCL_ICD_VENDORS at it before the first
# enumeration of platforms. OCL_ICD_VENDORS naming one library is left alone: that asks for that platform
# alone (the Oclgrind tier does this).

INTEL_ICD = "perfx-intel-opencl-rt.icd"
DEFAULT_VENDORS_FOLDER = "/etc/OpenCL/vendors"

_registered = False


def intel_opencl_library() -> Path | None:
    """libintelocl.so of the installed ``intel-opencl-rt`` wheel, or None (not installed, not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        dist = importlib.metadata.distribution("intel-opencl-rt")
    except importlib.metadata.PackageNotFoundError:
        return None
    candidates = [Path(dist.locate_file(f)) for f in dist.files or () if f.name == "libintelocl.so"]
    candidates.append(Path(sys.prefix, "lib", "libintelocl.so"))
    return next((c.resolve() for c in candidates if c.is_file()), None)


def read_vendor_folder(folder: str | os.PathLike) -> dict[str, str]:
    """The ``.icd`` files of an ICD folder, as file name -> the library each names (as written)."""
    entries = {}
    with contextlib.suppress(OSError):
        for path in sorted(Path(folder).glob("*.icd")):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                library = path.read_text().strip()
                if library:
                    entries[path.name] = library
    return entries


def merged_vendor_entries(environ, libraries: dict[str, Path]) -> dict[str, str] | None:
    """The ``.icd`` entries of a folder for OCL_ICD_VENDORS: what the loader reads under ``environ`` plus
    ``libraries`` (file name -> library); None where nothing should change (OCL_ICD_VENDORS names one
    library, or every library is listed already)."""
    chosen = environ.get("OCL_ICD_VENDORS") or None
    if chosen is not None and not os.path.isdir(chosen):
        return None
    entries = read_vendor_folder(chosen or environ.get("OPENCL_VENDOR_PATH") or DEFAULT_VENDORS_FOLDER)

    def listed(library: Path) -> bool:
        return any(os.path.isfile(named) and os.path.samefile(named, library) for named in entries.values())

    missing = {name: str(library) for name, library in libraries.items() if not listed(library)}
    return {**entries, **missing} if missing else None


def _write_vendor_folder(entries: dict[str, str]) -> Path:
    """A folder holding ``entries`` as .icd files: in perfx's cache, named by its content (processes
    and their children share it), else a new temporary folder."""
    digest = hashlib.sha256(json.dumps(sorted(entries.items())).encode()).hexdigest()[:16]
    try:
        folder = cache_dir() / "opencl-vendors" / digest
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="perfx-opencl-vendors-"))
    for name, library in entries.items():
        path = folder / name
        with contextlib.suppress(OSError):
            if path.read_text() == library + "\n":
                continue
        part = folder / f".{name}.{os.getpid()}"  # written whole, then renamed: never read half-written
        part.write_text(library + "\n")
        os.replace(part, path)
    return folder


def register_pypi_implementations() -> None:
    """Make the OpenCL implementations installed from PyPI visible to the ICD loader (Intel's CPU runtime,
    from ``intel-opencl-rt``); once per process, before the first enumeration of platforms. Without them
    nothing happens; a failure to write the folder only leaves them out."""
    global _registered
    if _registered:
        return
    _registered = True
    library = intel_opencl_library()
    if library is None:
        return
    entries = merged_vendor_entries(os.environ, {INTEL_ICD: library})
    if entries is None:
        return
    with contextlib.suppress(OSError):
        os.environ["OCL_ICD_VENDORS"] = str(_write_vendor_folder(entries))


# ----------------------------------------------------------------------------------------------
# Choosing a device


DEVICE_HELP = ("OpenCL device: P:D indices from `perfx info`, or part of a platform/device name, or pocl / intel "
               "(default: $PERFX_DEVICE, else the first GPU, else Intel's CPU runtime, else PoCL or another CPU)")

# Among CPU implementations, Intel's runtime first: it has what the phone GPUs have and PoCL lacks (fp16,
# subgroups, image1d_buffer, 16384² images) and runs work-items as SIMD lanes as a GPU runs waves, and its
# decode was as fast or faster at built-in defaults than PoCL with its tuned entries (README, "Use").
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
    register_pypi_implementations()
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


# ----------------------------------------------------------------------------------------------
# The device


class BoundLaunch:
    """A launch with its own Kernel object and its arguments bound once (see ``Device.record``)."""

    __slots__ = ("kernel", "global_size", "local_size")

    def __init__(self, kernel: cl.Kernel, global_size, local_size, args):
        self.kernel = cl.Kernel(kernel.program, kernel.function_name)
        if args:
            self.kernel.set_args(*args)
        self.global_size = tuple(global_size)
        self.local_size = tuple(local_size) if local_size else None

    def enqueue(self, queue: cl.CommandQueue) -> cl.Event:
        try:
            return cl.enqueue_nd_range_kernel(queue, self.kernel, self.global_size, self.local_size)
        except cl.Error as e:
            raise_as_perfx(f"launching {self.kernel.function_name} global={self.global_size}", e)


class BoundCopy:
    """A device-to-device copy recorded like a ``BoundLaunch``."""

    __slots__ = ("dst", "src", "nbytes", "src_offset", "dst_offset")

    def __init__(self, dst, src, nbytes: int, src_offset: int, dst_offset: int):
        self.dst, self.src, self.nbytes = dst, src, nbytes
        self.src_offset, self.dst_offset = src_offset, dst_offset

    def enqueue(self, queue: cl.CommandQueue) -> cl.Event:
        return cl.enqueue_copy(queue, self.dst, self.src, byte_count=self.nbytes, src_offset=self.src_offset,
                               dst_offset=self.dst_offset)


class _CountedBuffer(cl.Buffer):
    """A Buffer that can carry a weakref finalizer (pyopencl's own cannot), for memory accounting."""


class _CountedImage(cl.Image):
    pass


def _size(nbytes: int) -> str:
    """Bytes for a message: MiB, or KiB below one MiB (a tight PERFX_LIMITS would read "0 MiB")."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def build_options(caps: Capabilities) -> list[str]:
    """The compiler options perfx builds every kernel with on this device.

    The part of fast math that keeps every kernel within its tolerance: ``-cl-mad-enable`` (a GPU may
    fuse a multiply and an add, as Adreno's ALUs do) and ``-cl-no-signed-zeros``. Not
    ``-cl-fast-relaxed-math``: attention's online softmax starts from −INFINITY, which its
    ``-cl-finite-math-only`` lets a compiler assume away, and on Intel's CPU runtime its approximate exp
    took the SiLU epilogues and gemv_q8 past their tolerances in 33 of 657 selftest checks (2026-11-30);
    with the two options here all 657 pass on PoCL and Intel. ``PERFX_BUILD_OPTIONS`` adds options of
    your own (a driver's, to try), still checked by `perfx selftest`.
    """
    extra = os.environ.get("PERFX_BUILD_OPTIONS", "").split()
    return ["-cl-mad-enable", "-cl-no-signed-zeros", *extra]


def _define_flags(defines: dict) -> list[str]:
    flags = []
    for name in sorted(defines):
        value = defines[name]
        if isinstance(value, bool):
            value = int(value)
        flags.append(f"-D{name}={value}")
    return flags


class Device:
    """One OpenCL device with its context, a profiling queue, built kernels and memory accounting."""

    def __init__(self, selector: str | None = None, limits: Limits | None = None):
        self.entry, self.reason = choose_device(selector)
        self.cl_device = self.entry.device
        self.limits = limits if limits is not None else parse_limits(os.environ.get("PERFX_LIMITS"))
        self.caps = capabilities(self.cl_device, self.limits)
        try:
            self.context = cl.Context([self.cl_device])
            self.queue = cl.CommandQueue(self.context, properties=cl.command_queue_properties.PROFILING_ENABLE)
        except cl.Error as e:
            raise_as_perfx(f"creating a context on {self.caps.name}", e)
        self.build_options = build_options(self.caps)
        self._programs: dict[tuple, cl.Program] = {}
        self._kernels: dict[tuple, cl.Kernel] = {}
        self._infos: dict[int, KernelInfo] = {}     # by int_ptr, for the kernels kept in _kernels
        self._watching: list[set] = []
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        self.peak_allocated_bytes = 0
        self._recording: list | None = None

    def __repr__(self) -> str:
        return f"<perfx.Device {self.caps.platform} / {self.caps.name}, limits={self.caps.limits}>"

    @property
    def fingerprint(self) -> dict:
        """What identifies this device and driver in the tuning database."""
        c = self.caps
        return {"platform": c.platform, "device": c.name, "opencl_c_version": c.opencl_c_version,
                "driver_version": c.driver_version}

    # -- building ------------------------------------------------------------------------------

    def build(self, file: str, defines: dict | None = None) -> cl.Program:
        """Build ``kernels/<file>`` with ``-DNAME=value`` per define; built programs are kept."""
        defines = dict(defines or {})
        key = (file, tuple(sorted(defines.items())))
        program = self._programs.get(key)
        if program is not None:
            return program
        path = kernel_path(file)
        options = _define_flags(defines) + ["-I", str(path.parent), *self.build_options]
        program = cl.Program(self.context, path.read_text())
        try:
            program.build(options=options, devices=[self.cl_device])
        except cl.Error as e:
            raise BuildError(file, defines, str(e), self.caps.name) from e
        self._programs[key] = program
        return program

    def kernel(self, file: str, name: str, defines: dict | None = None) -> cl.Kernel:
        """A ``Kernel`` object, created once per (file, defines, name): each ``program.name`` makes a new one.

        A kernel whose required work-group (``reqd_work_group_size``) or local memory exceeds what the driver
        reports it can run raises KernelLimitError here: those parameters cannot run on this driver.
        """
        key = (file, tuple(sorted((defines or {}).items())), name)
        kernel = self._kernels.get(key)
        if kernel is None:
            program = self.build(file, defines)
            try:
                kernel = cl.Kernel(program, name)
            except cl.Error as e:
                raise_as_perfx(f"creating kernel {name!r} from kernels/{file}", e)
            info = self.kernel_info(kernel)
            flags = " ".join(_define_flags(defines or {}))
            if info.required_size > info.work_group:
                raise KernelLimitError(f"kernels/{file} {name} ({flags}) requires work-groups of "
                                       f"{info.required_size}, but this driver runs it in groups of at most "
                                       f"{info.work_group} (registers or local memory it needs)")
            if info.local_mem > self.caps.local_mem:
                raise KernelLimitError(f"kernels/{file} {name} ({flags}) needs {info.local_mem} bytes of local "
                                       f"memory, more than the {self.caps.local_mem} in force")
            self._kernels[key] = kernel
            self._infos[kernel.int_ptr] = info
        return kernel

    def kernel_info(self, kernel: cl.Kernel) -> KernelInfo:
        """The driver's figures for a kernel: its work-group limit, required size, local and private memory.

        Kept for the kernels this device built and keeps (their handles stay valid); another kernel is asked
        each time.
        """
        info = self._infos.get(kernel.int_ptr)
        if info is None:
            def query(what, default=0):
                try:
                    return kernel.get_work_group_info(what, self.cl_device)
                except cl.Error:  # a query this driver does not answer
                    return default
            w = cl.kernel_work_group_info
            required = tuple(int(v) for v in query(w.COMPILE_WORK_GROUP_SIZE, ()) or ())
            info = KernelInfo(kernel.function_name, int(query(w.WORK_GROUP_SIZE, self.caps.max_work_group)),
                              required if any(required) else (), int(query(w.LOCAL_MEM_SIZE)),
                              int(query(w.PRIVATE_MEM_SIZE)))
        return info

    @contextlib.contextmanager
    def watch_kernels(self):
        """Collect the KernelInfo of every kernel launched (or recorded) inside the block, by name."""
        seen: set = set()
        self._watching.append(seen)
        found: dict[str, KernelInfo] = {}
        try:
            yield found
        finally:
            self._watching.remove(seen)
            for info in seen:
                found[info.name] = info

    def _check_launch(self, kernel: cl.Kernel, local_size):
        """A work-group larger than the driver runs this kernel in: a KernelLimitError, not a bare OpenCL error."""
        info = self.kernel_info(kernel)
        for seen in self._watching:
            seen.add(info)
        if local_size:
            size = int(np.prod(local_size))
            if size > info.work_group:
                raise KernelLimitError(f"{kernel.function_name}: a work-group of {size} work-items, but this driver "
                                       f"runs this kernel in groups of at most {info.work_group}")

    def launch(self, kernel: cl.Kernel, global_size, local_size, *args, wait_for=None) -> cl.Event | None:
        """Set the arguments and enqueue; while recording (``record()``), only record the launch."""
        self._check_launch(kernel, local_size)
        if self._recording is not None:
            self._recording.append(BoundLaunch(kernel, global_size, local_size, args))
            return None
        try:
            if args:
                kernel.set_args(*args)
            return cl.enqueue_nd_range_kernel(self.queue, kernel, tuple(global_size),
                                              tuple(local_size) if local_size else None, wait_for=wait_for)
        except cl.Error as e:
            raise_as_perfx(f"launching {kernel.function_name} global={tuple(global_size)} "
                           f"local={tuple(local_size) if local_size else None}", e)

    def copy(self, dst, src, nbytes: int, src_offset: int = 0, dst_offset: int = 0) -> cl.Event | None:
        """Device-to-device copy of ``nbytes`` between buffers (or Arrays); recorded while recording."""
        step = BoundCopy(getattr(dst, "data", dst), getattr(src, "data", src), nbytes, src_offset, dst_offset)
        if self._recording is not None:
            self._recording.append(step)
            return None
        return step.enqueue(self.queue)

    @contextlib.contextmanager
    def record(self):
        """Record the launches made inside the block instead of running them, as ``BoundLaunch``es.

        The decode step replays them every token: each has its own Kernel object with its arguments
        bound once, so a token costs one enqueue per launch and no argument setting in Python.
        """
        launches: list = []
        self._recording = launches
        try:
            yield launches
        finally:
            self._recording = None

    # -- memory --------------------------------------------------------------------------------

    def _account(self, obj, nbytes: int):
        with self._lock:
            self.allocated_bytes += nbytes
            self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        weakref.finalize(obj, self._release, nbytes)
        return obj

    def _release(self, nbytes: int):
        with self._lock:
            self.allocated_bytes -= nbytes

    def _check_alloc(self, nbytes: int, what: str):
        if nbytes > self.caps.max_alloc:
            raise PerfxError(f"{what} needs one allocation of {_size(nbytes)}, more than this device allows "
                             f"({_size(self.caps.max_alloc)}, limits: {self.caps.limits}). perfx splits large "
                             "weights into blocks that fit, but not this piece: it needs a larger allocation "
                             "limit (PERFX_LIMITS), or a smaller model or --ctx. If the limit is a real "
                             "device's (hundreds of MiB), please report it.")

    def alloc(self, nbytes: int, hostbuf: np.ndarray | None = None, what: str = "a buffer") -> cl.Buffer:
        """A counted device buffer; ``hostbuf`` is copied in."""
        nbytes = max(int(nbytes), 1)
        self._check_alloc(nbytes, what)
        flags = cl.mem_flags.READ_WRITE
        if hostbuf is not None:
            flags |= cl.mem_flags.COPY_HOST_PTR
            hostbuf = np.ascontiguousarray(hostbuf)
        try:
            buffer = _CountedBuffer(self.context, flags, size=nbytes, hostbuf=hostbuf)
        except cl.Error as e:
            raise_as_perfx(f"allocating {nbytes} bytes for {what}", e)
        return self._account(buffer, nbytes)

    def _allocator(self, nbytes: int) -> cl.Buffer:
        return self.alloc(nbytes)

    def empty(self, shape, dtype) -> cla.Array:
        return cla.empty(self.queue, shape, np.dtype(dtype), allocator=self._allocator)

    def upload(self, array: np.ndarray) -> cla.Array:
        array = np.ascontiguousarray(array)
        out = self.empty(array.shape, array.dtype)
        out.set(array)
        return out

    def poisoned(self, shape, dtype) -> cla.Array:
        """An output buffer filled with NaN (or 0xFF.. for integers) so unwritten elements show in tests."""
        dtype = np.dtype(dtype)
        fill = np.full(shape, np.nan, dtype) if dtype.kind == "f" else np.full(shape, -1, dtype)
        return self.upload(fill)

    def image_rgba_u32(self, texels: np.ndarray, what: str = "an image") -> cl.Image:
        """A read-only image2d of RGBA/UINT32 texels from a (height, width, 4) uint32 array."""
        texels = np.ascontiguousarray(texels, dtype=np.uint32)
        height, width, channels = texels.shape
        if channels != 4:
            raise ValueError("image_rgba_u32 takes (height, width, 4) uint32 texels")
        c = self.caps
        if not c.image_support:
            raise PerfxError(f"{c.name} has no image support; use the buffer read path")
        if width > c.image2d_max_width or height > c.image2d_max_height:
            raise PerfxError(f"{what} of {width}x{height} texels exceeds the image2d limit "
                             f"{c.image2d_max_width}x{c.image2d_max_height} (limits: {c.limits}); split it")
        self._check_alloc(texels.nbytes, what)
        fmt = cl.ImageFormat(cl.channel_order.RGBA, cl.channel_type.UNSIGNED_INT32)
        try:
            # _through_create_image: what pyopencl's create_image passes (our subclass can carry a finalizer)
            image = _CountedImage(self.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, fmt,
                                  shape=(width, height), hostbuf=texels, _through_create_image=True)
        except cl.Error as e:
            raise_as_perfx(f"creating {what} of {width}x{height} texels", e)
        return self._account(image, texels.nbytes)


    # -- views: images over a buffer, sharing its memory (counted once, with the buffer) -------------

    def image1d_view(self, buffer: cl.Buffer, texels: int, what: str = "an image1d_buffer view") -> cl.Image:
        """An image1d_buffer_t of RGBA/UINT32 texels over the first ``texels`` uint4 of ``buffer`` (no copy)."""
        c = self.caps
        if texels > c.image1d_buffer_texels:
            raise PerfxError(f"{what}: {texels} texels exceed this device's image1d_buffer limit "
                             f"({c.image1d_buffer_texels}); read the buffer instead")
        fmt = cl.ImageFormat(cl.channel_order.RGBA, cl.channel_type.UNSIGNED_INT32)
        try:
            return cl.create_image(self.context, cl.mem_flags.READ_ONLY, fmt, shape=(texels,), buffer=buffer)
        except cl.Error as e:
            raise_as_perfx(f"creating {what} of {texels} texels", e)

    def image2d_view(self, buffer: cl.Buffer, width: int, height: int, row_offset: int = 0,
                     what: str = "an image2d view") -> cl.Image:
        """An image2d_t of RGBA/UINT32 texels over rows [row_offset, row_offset + height) of a buffer of
        ``width`` uint4 a row (cl_khr_image2d_from_buffer; the width a multiple of the pitch alignment)."""
        c = self.caps
        if not c.image2d_from_buffer or not c.image_pitch_alignment or width % c.image_pitch_alignment:
            raise PerfxError(f"{what}: {c.name} cannot view a buffer of {width} texels a row as an image2d "
                             f"(cl_khr_image2d_from_buffer: {c.image2d_from_buffer}, pitch alignment "
                             f"{c.image_pitch_alignment} texels)")
        if width > c.image2d_max_width or height > c.image2d_max_height:
            raise PerfxError(f"{what} of {width}x{height} texels exceeds the image2d limit "
                             f"{c.image2d_max_width}x{c.image2d_max_height} (limits: {c.limits}); split it")
        try:
            if row_offset:
                buffer = buffer.get_sub_region(row_offset * width * 16, height * width * 16)
            desc = cl.ImageDescriptor()
            desc.image_type = cl.mem_object_type.IMAGE2D
            desc.shape = (width, height)
            desc.pitches = (width * 16, 0)
            desc.buffer = buffer
            fmt = cl.ImageFormat(cl.channel_order.RGBA, cl.channel_type.UNSIGNED_INT32)
            return cl.Image(self.context, cl.mem_flags.READ_ONLY, fmt, desc=desc)
        except cl.Error as e:
            raise_as_perfx(f"creating {what} of {width}x{height} texels over a buffer", e)


_default_device: Device | None = None


def get_device(selector: str | None = None) -> Device:
    """The process-wide device (chosen once); a selector other than the first builds a new one."""
    global _default_device
    if selector is not None:
        return Device(selector)
    if _default_device is None:
        _default_device = Device()
    return _default_device


def capabilities_dict(caps: Capabilities) -> dict:
    return dataclasses.asdict(caps)
