"""The decode step recorded and replayed: launches with their arguments bound once (``BoundLaunch``), copies
(``BoundCopy``), and their replay in one call where the driver has ``cl_khr_command_buffer``.

A decode step is a few hundred launches whose arguments never change (the token and the position are read
from a device buffer), and the host enqueues them every token. One by one each costs an API call and an
event: on a CPU, where the kernels run on the same cores, several times more beside the kernels than with
the cores idle (a tenth of the default model's decode, benchmarks/NOTES.md); a phone's driver spends more a
launch than a CPU's. A command buffer records the launches and copies once, with their arguments, and
``clEnqueueCommandBufferKHR`` replays them. Whether that is faster is the driver's doing: Intel's CPU runtime
spends longer on the host enqueueing one than the launches one by one, and its decode step ran slower, so a
command buffer is used only where asked for (``PERFX_COMMAND_BUFFER=on``), for a phone's driver to be measured
with (``benchmarks/decode_host.py``).

pyopencl does not wrap the extension, so it is reached with ctypes through the ICD loader pyopencl loaded
(``clGetExtensionFunctionAddressForPlatform``), on the handles pyopencl holds. A device without the
extension, or a version of it this module does not use, replays the step one enqueue a launch
(``Sequence``); ``Device.replay`` picks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import weakref

import pyopencl as cl

from perfx.errors import PerfxError
from perfx.runtime.errors import OpenCLError, raise_as_perfx

EXTENSION = "cl_khr_command_buffer"

# From the Khronos headers (CL/cl_ext.h).
_CAPABILITIES = 0x12A9                # CL_DEVICE_COMMAND_BUFFER_CAPABILITIES_KHR
_REQUIRED_QUEUE_PROPERTIES = 0x12AA   # CL_DEVICE_COMMAND_BUFFER_REQUIRED_QUEUE_PROPERTIES_KHR
_SUPPORTED_QUEUE_PROPERTIES = 0x129A  # CL_DEVICE_COMMAND_BUFFER_SUPPORTED_QUEUE_PROPERTIES_KHR (0.9.5 on)
_SIMULTANEOUS_USE = 1 << 2            # CL_COMMAND_BUFFER_CAPABILITY_SIMULTANEOUS_USE_KHR


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


def _make_version(major: int, minor: int, patch: int) -> int:
    return (major << 22) | (minor << 12) | patch


def _version_text(version: int) -> str:
    return f"{version >> 22}.{(version >> 12) & 0x3FF}.{version & 0xFFF}"


# 0.9.5 added a properties argument to the copy commands (clCommandNDRangeKernelKHR always had one); the
# versions before it are provisional and are not used.
_FIRST_VERSION = _make_version(0, 9, 5)

_p, _u32, _size = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_size_t
_SIGNATURES = {
    "clCreateCommandBufferKHR": (_p, [_u32, ctypes.POINTER(_p), _p, ctypes.POINTER(ctypes.c_int32)]),
    "clCommandNDRangeKernelKHR": (ctypes.c_int32, [_p, _p, _p, _p, _u32, _p, ctypes.POINTER(_size),
                                                   ctypes.POINTER(_size), _u32, _p, _p, _p]),
    "clCommandCopyBufferKHR": (ctypes.c_int32, [_p, _p, _p, _p, _p, _size, _size, _size, _u32, _p, _p, _p]),
    "clFinalizeCommandBufferKHR": (ctypes.c_int32, [_p]),
    "clEnqueueCommandBufferKHR": (ctypes.c_int32, [_u32, _p, _p, _u32, _p, ctypes.POINTER(_p)]),
    "clReleaseCommandBufferKHR": (ctypes.c_int32, [_p]),
}


@functools.lru_cache(maxsize=1)
def _loader() -> ctypes.CDLL:
    """The ICD loader this process uses: the one pyopencl loaded (its wheel bundles one), else the system's."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libOpenCL" in path:
                    return ctypes.CDLL(path)
    except OSError:
        pass
    name = ctypes.util.find_library("OpenCL")
    if name is None:
        raise PerfxError("cannot find the OpenCL ICD loader (libOpenCL) to reach cl_khr_command_buffer")
    return ctypes.CDLL(name)


@functools.lru_cache(maxsize=None)
def _functions(platform_ptr: int) -> dict:
    lib = _loader()
    lookup = lib.clGetExtensionFunctionAddressForPlatform
    lookup.restype, lookup.argtypes = _p, [_p, ctypes.c_char_p]
    found = {}
    for name, (restype, argtypes) in _SIGNATURES.items():
        address = lookup(platform_ptr, name.encode())
        if not address:
            raise PerfxError(f"the driver lists {EXTENSION} but gives no {name}")
        found[name] = ctypes.CFUNCTYPE(restype, *argtypes)(address)
    return found


def _device_u64(device: cl.Device, param: int) -> int | None:
    lib = _loader()
    value, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    lib.clGetDeviceInfo.restype = ctypes.c_int32
    lib.clGetDeviceInfo.argtypes = [_p, _u32, _size, _p, ctypes.POINTER(_size)]
    status = lib.clGetDeviceInfo(device.int_ptr, param, ctypes.sizeof(value), ctypes.byref(value),
                                 ctypes.byref(size))
    return value.value if status == 0 else None


def unavailable(device: cl.Device, queue_properties: int) -> str | None:
    """Why a step cannot be replayed as a command buffer on this device and queue; None when it can."""
    if EXTENSION not in device.extensions.split():
        return f"the driver has no {EXTENSION}"
    try:
        version = next(e.version for e in device.extensions_with_version if e.name == EXTENSION)
    except (cl.Error, AttributeError, StopIteration):   # an OpenCL 1.2 / 2.x driver cannot say
        return f"the driver does not say which version of {EXTENSION} it has"
    if version < _FIRST_VERSION:
        return f"{EXTENSION} {_version_text(version)} is provisional (perfx uses 0.9.5 and later)"
    try:
        required = _device_u64(device, _REQUIRED_QUEUE_PROPERTIES) or 0
        supported = _device_u64(device, _SUPPORTED_QUEUE_PROPERTIES)
    except PerfxError as e:   # no ICD loader to reach it through: launches one by one still work
        return str(e)
    if required & ~queue_properties or (supported is not None and queue_properties & ~supported):
        return (f"{EXTENSION} takes queues with properties {required:#x} to {supported:#x}, "
                f"perfx's queue has {queue_properties:#x}")
    return None


def simultaneous_use(device: cl.Device) -> bool:
    """Whether the device may start a command buffer again while it is still pending."""
    return bool((_device_u64(device, _CAPABILITIES) or 0) & _SIMULTANEOUS_USE)


def _check(status: int, what: str) -> None:
    if status != 0:
        raise OpenCLError(what, status)


class Sequence:
    """The step replayed one enqueue a launch."""

    def __init__(self, steps: list):
        self.steps = steps

    def enqueue(self, queue: cl.CommandQueue) -> None:
        for step in self.steps:
            step.enqueue(queue)


class CommandBuffer:
    """The step recorded once into a command buffer on ``queue``; ``enqueue`` replays it in one call.

    ``steps`` are ``BoundLaunch``es and ``BoundCopy``s (``Device.record``). Each command waits on the one
    before it (a chain of sync points), as the in-order queue ran them. The steps are kept: their kernels
    and buffers must live as long as the recording.
    """

    def __init__(self, device: cl.Device, queue: cl.CommandQueue, steps: list):
        self.steps = steps
        self._functions = f = _functions(device.platform.int_ptr)
        self._simultaneous = simultaneous_use(device)
        self._queue = queue
        self._last: cl.Event | None = None
        status = ctypes.c_int32(0)
        queue_ptr = _p(queue.int_ptr)
        handle = f["clCreateCommandBufferKHR"](1, ctypes.byref(queue_ptr), None, ctypes.byref(status))
        _check(status.value, "creating a command buffer")
        self._handle = handle
        self._finalizer = weakref.finalize(self, f["clReleaseCommandBufferKHR"], handle)
        self._finalizer.atexit = False   # the process's end frees it; a release then may outlive the driver
        previous, point = _u32(0), _u32(0)
        for i, step in enumerate(steps):
            wait = (1, ctypes.byref(previous)) if i else (0, None)
            if isinstance(step, BoundLaunch):
                dims = len(step.global_size)
                global_size = (_size * dims)(*step.global_size)
                local_size = (_size * dims)(*step.local_size) if step.local_size else None
                code = f["clCommandNDRangeKernelKHR"](handle, None, None, step.kernel.int_ptr, dims, None,
                                                      global_size, local_size, *wait, ctypes.byref(point), None)
                what = f"recording {step.kernel.function_name} global={step.global_size}"
            elif isinstance(step, BoundCopy):
                code = f["clCommandCopyBufferKHR"](handle, None, None, step.src.int_ptr, step.dst.int_ptr,
                                                   step.src_offset, step.dst_offset, step.nbytes, *wait,
                                                   ctypes.byref(point), None)
                what = f"recording a copy of {step.nbytes} bytes"
            else:
                raise PerfxError(f"a command buffer records launches and copies, not {type(step).__name__}")
            _check(code, what)
            previous.value = point.value
        _check(f["clFinalizeCommandBufferKHR"](handle), "finalizing a command buffer")

    def enqueue(self, queue: cl.CommandQueue) -> None:
        if queue.int_ptr != self._queue.int_ptr:
            raise PerfxError("a command buffer replays on the queue it was recorded for, not another")
        # Without simultaneous use the buffer must have finished before it starts again. Decoding reads each
        # token's result before the next step, so this wait is almost never a real one.
        if self._last is not None and not self._simultaneous:
            self._last.wait()
        event = _p()
        _check(self._functions["clEnqueueCommandBufferKHR"](0, None, self._handle, 0, None, ctypes.byref(event)),
               f"enqueueing a command buffer of {len(self.steps)} commands")
        self._last = cl.Event.from_int_ptr(event.value, retain=False)
