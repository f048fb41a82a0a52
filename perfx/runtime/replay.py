"""The decode step recorded and replayed: launches with their arguments bound once (``BoundLaunch``), copies
(``BoundCopy``), and their replay in one call where the driver can: ``cl_khr_command_buffer``
(``CommandBuffer``) or Adreno's ``cl_qcom_recordable_queues`` (``QcomRecording``).

A decode step is a few hundred launches whose arguments never change (the token and the position are read
from a device buffer), and the host enqueues them every token. One by one each costs an API call and an
event: on a CPU, where the kernels run on the same cores, several times more beside the kernels than with
the cores idle (a tenth of the default model's decode, benchmarks/NOTES.md); a phone's driver spends more a
launch than a CPU's. A command buffer records the launches and copies once, with their arguments, and
``clEnqueueCommandBufferKHR`` replays them; an Adreno recording does the same with a recordable queue and
``clEnqueueRecordingQCOM`` (MNN replays its steps so). Whether that is faster is the driver's doing: Intel's
CPU runtime spends longer on the host enqueueing a command buffer than the launches one by one, and its
decode step ran slower, so either is used only where asked for (``PERFX_REPLAY=command-buffer``, or its older
spelling ``PERFX_COMMAND_BUFFER=on``; ``PERFX_REPLAY=qcom``), for a phone's driver to be measured with
(``perfx report``, ``benchmarks/decode_host.py``). ``ReplayChoice`` holds a device's choice and says why.

pyopencl wraps neither extension, so they are reached with ctypes through the ICD loader pyopencl loaded
(``clGetExtensionFunctionAddressForPlatform``), on the handles pyopencl holds. A device without them, or a
version of the command buffer this module does not use, replays the step one enqueue a launch
(``Sequence``); ``Device.replay`` picks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
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


def _own_kernel(kernel: cl.Kernel) -> cl.Kernel:
    """A Kernel object of its own for ``kernel``'s function: a clone (clCloneKernel, OpenCL 2.1+: a few µs)
    where the driver has one, else made again from the program (clCreateKernel: tens of µs on the CPU
    runtimes, and a sweep's recordings make hundreds of thousands)."""
    try:
        return kernel.clone()
    except (AttributeError, cl.Error):
        return cl.Kernel(kernel.program, kernel.function_name)


class BoundLaunch:
    """A launch with its own Kernel object and its arguments bound once (see ``Device.record``)."""

    __slots__ = ("kernel", "global_size", "local_size")

    def __init__(self, kernel: cl.Kernel, global_size, local_size, args):
        # a clone carries the arguments its source was last launched with: only one whose every argument is set
        # here may be one (a launch given none keeps a fresh kernel, which the driver refuses, as it should)
        self.kernel = _own_kernel(kernel) if args and len(args) == kernel.num_args else \
            cl.Kernel(kernel.program, kernel.function_name)
        if args:
            self.kernel.set_args(*args)
        self.global_size = tuple(global_size)
        self.local_size = tuple(local_size) if local_size else None

    def enqueue(self, queue: cl.CommandQueue) -> cl.Event:
        try:
            return cl.enqueue_nd_range_kernel(queue, self.kernel, self.global_size, self.local_size)
        except cl.Error as e:
            raise_as_perfx(self.describe(), e)

    def call(self) -> tuple:
        """(function, its arguments after the queue): the enqueue with nothing left to look up."""
        return cl.enqueue_nd_range_kernel, (self.kernel, self.global_size, self.local_size)

    def describe(self) -> str:
        return f"launching {self.kernel.function_name} global={self.global_size}"


class BoundCopy:
    """A device-to-device copy recorded like a ``BoundLaunch``."""

    __slots__ = ("dst", "src", "nbytes", "src_offset", "dst_offset")

    def __init__(self, dst, src, nbytes: int, src_offset: int, dst_offset: int):
        self.dst, self.src, self.nbytes = dst, src, nbytes
        self.src_offset, self.dst_offset = src_offset, dst_offset

    def enqueue(self, queue: cl.CommandQueue) -> cl.Event:
        return cl.enqueue_copy(queue, self.dst, self.src, byte_count=self.nbytes, src_offset=self.src_offset,
                               dst_offset=self.dst_offset)

    def call(self) -> tuple:
        """As ``BoundLaunch.call`` (a step has few copies: its own enqueue, through pyopencl's keywords)."""
        return self.enqueue, ()

    def describe(self) -> str:
        return f"copying {self.nbytes} bytes"


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


def _extension_functions(platform_ptr: int, extension: str, signatures: dict) -> dict:
    """An extension's functions, by name, from the platform's driver (through the ICD loader)."""
    lib = _loader()
    lookup = lib.clGetExtensionFunctionAddressForPlatform
    lookup.restype, lookup.argtypes = _p, [_p, ctypes.c_char_p]
    found = {}
    for name, (restype, argtypes) in signatures.items():
        address = lookup(platform_ptr, name.encode())
        if not address:
            raise PerfxError(f"the driver lists {extension} but gives no {name}")
        found[name] = ctypes.CFUNCTYPE(restype, *argtypes)(address)
    return found


@functools.lru_cache(maxsize=None)
def _functions(platform_ptr: int) -> dict:
    return _extension_functions(platform_ptr, EXTENSION, _SIGNATURES)


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
    """The step replayed one enqueue a launch: pyopencl's enqueue called straight on arguments made once (no
    method of ours between, no argument set, no event kept), the fewest Python operations a launch pyopencl
    allows; its enqueue still returns an event, which is dropped."""

    def __init__(self, steps: list):
        self.steps = steps
        self._calls = [step.call() for step in steps]

    def enqueue(self, queue: cl.CommandQueue) -> None:
        i = 0
        try:
            for i, (function, arguments) in enumerate(self._calls):
                function(queue, *arguments)
        except cl.Error as e:
            raise_as_perfx(self.steps[i].describe(), e)


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


# -- Adreno's cl_qcom_recordable_queues -----------------------------------------------------------------
# Qualcomm's CL/cl_ext_qcom.h (the copy MNN ships in 3rd_party/OpenCLHeaders, "Copyright (c) 2009-2022
# Qualcomm Technologies"), and the recordable_queues sample of Qualcomm's Adreno OpenCL SDK: a queue made with
# CL_QUEUE_RECORDABLE_QCOM does not run what is enqueued on it between clNewRecordingQCOM and
# clEndRecordingQCOM but records it; clEnqueueRecordingQCOM runs the recording on an ordinary queue, with
# optional updates of recorded arguments, global offsets and global and local sizes by dispatch index (perfx
# updates none: the token and the position are read from a device buffer). No phone has run this yet.

QCOM_EXTENSION = "cl_qcom_recordable_queues"
QUEUE_RECORDABLE_QCOM = 1 << 30          # CL_QUEUE_RECORDABLE_QCOM, a cl_command_queue_properties bit
RECORDABLE_QUEUE_MAX_SIZE = 0x41DE       # CL_DEVICE_RECORDABLE_QUEUE_MAX_SIZE (cl_uint): commands a recording

_QCOM_SIGNATURES = {
    # cl_recording_qcom clNewRecordingQCOM(cl_command_queue, cl_int *errcode_ret)
    "clNewRecordingQCOM": (_p, [_p, ctypes.POINTER(ctypes.c_int32)]),
    # cl_int clEndRecordingQCOM(cl_recording_qcom), clReleaseRecordingQCOM(cl_recording_qcom)
    "clEndRecordingQCOM": (ctypes.c_int32, [_p]),
    "clReleaseRecordingQCOM": (ctypes.c_int32, [_p]),
    # cl_int clEnqueueRecordingQCOM(cl_command_queue, cl_recording_qcom,
    #     size_t n_args, const cl_array_arg_qcom *args, size_t n_offsets, const cl_offset_qcom *offsets,
    #     size_t n_global, const cl_workgroup_qcom *global, size_t n_local, const cl_workgroup_qcom *local,
    #     cl_uint num_events_in_wait_list, const cl_event *event_wait_list, cl_event *event)
    "clEnqueueRecordingQCOM": (ctypes.c_int32, [_p, _p, _size, _p, _size, _p, _size, _p, _size, _p, _u32, _p, _p]),
}

# The core calls the recording makes: the recordable queue, made as Qualcomm's sample makes it
# (clCreateCommandQueue with the property bit) and released after its recordings, and the step's launches and
# copies enqueued on it (pyopencl does not wrap a queue it did not make).
_QUEUE = {
    "clCreateCommandQueue": (_p, [_p, _p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int32)]),
    "clReleaseCommandQueue": (ctypes.c_int32, [_p]),
}
_ENQUEUE = {
    "clEnqueueNDRangeKernel": (ctypes.c_int32, [_p, _p, _u32, _p, _p, _p, _u32, _p, _p]),
    "clEnqueueCopyBuffer": (ctypes.c_int32, [_p, _p, _p, _size, _size, _size, _u32, _p, _p]),
}


@functools.lru_cache(maxsize=1)
def _enqueue_functions() -> dict:
    """The ICD loader's clEnqueueNDRangeKernel and clEnqueueCopyBuffer, called directly."""
    lib = _loader()
    found = {}
    for name, (restype, argtypes) in _ENQUEUE.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
        found[name] = function
    return found


@functools.lru_cache(maxsize=None)
def _qcom_functions(platform_ptr: int) -> dict:
    """Every call ``QcomRecording`` makes, by name: the extension's from the driver, the core ones from the
    ICD loader. A fake driver replaces this (tests/helpers/fake_qcom.py)."""
    found = _extension_functions(platform_ptr, QCOM_EXTENSION, _QCOM_SIGNATURES)
    lib = _loader()
    for name, (restype, argtypes) in _QUEUE.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
        found[name] = function
    found.update(_enqueue_functions())
    return found


def _extensions(device: cl.Device) -> list[str]:
    return device.extensions.split()


def qcom_unavailable(device: cl.Device) -> str | None:
    """Why a step cannot be replayed as a recording of ``cl_qcom_recordable_queues`` here; None when it can."""
    if QCOM_EXTENSION not in _extensions(device):
        return f"the driver has no {QCOM_EXTENSION}"
    try:
        _qcom_functions(device.platform.int_ptr)
    except (PerfxError, AttributeError, OSError) as e:
        return str(e)
    return None


def recordable_queue_max_size(device: cl.Device) -> int | None:
    """The most commands one recording holds on this device (CL_DEVICE_RECORDABLE_QUEUE_MAX_SIZE); None
    where the driver does not say."""
    try:
        return _device_u64(device, RECORDABLE_QUEUE_MAX_SIZE) or None
    except PerfxError:
        return None


def _release_recordings(functions: dict, queue, recordings: list) -> None:
    for recording in recordings:
        functions["clReleaseRecordingQCOM"](recording)
    recordings.clear()
    functions["clReleaseCommandQueue"](queue)


class QcomRecording:
    """The step recorded once on a recordable queue (``cl_qcom_recordable_queues``); ``enqueue`` replays it
    with one ``clEnqueueRecordingQCOM`` a recording, on any queue of the device's context.

    A recording holds at most CL_DEVICE_RECORDABLE_QUEUE_MAX_SIZE commands, so a longer step is recorded
    as several, enqueued in order (the queue is in order, as the step's launches were). The steps are kept:
    their kernels and buffers must live as long as the recordings. The recordings, then the recordable
    queue, are released when this is dropped, or at once when recording fails.
    """

    def __init__(self, device: cl.Device, queue: cl.CommandQueue, steps: list):
        self.steps = steps
        f = _qcom_functions(device.platform.int_ptr)
        status = ctypes.c_int32(0)
        recordable = f["clCreateCommandQueue"](queue.context.int_ptr, device.int_ptr, QUEUE_RECORDABLE_QCOM,
                                               ctypes.byref(status))
        _check(status.value, "clCreateCommandQueue (a queue with CL_QUEUE_RECORDABLE_QCOM)")
        if not recordable:
            raise PerfxError("clCreateCommandQueue gave no recordable queue (CL_QUEUE_RECORDABLE_QCOM)")
        self.recordings: list = []
        self._finalizer = weakref.finalize(self, _release_recordings, f, recordable, self.recordings)
        self._finalizer.atexit = False   # the process's end frees them; a release then may outlive the driver
        self.chunk = recordable_queue_max_size(device) or max(1, len(steps))
        try:
            for start in range(0, len(steps), self.chunk):
                self._record(f, recordable, steps[start:start + self.chunk], status)
        except BaseException:
            self._finalizer()
            raise
        self._enqueue = f["clEnqueueRecordingQCOM"]

    def _record(self, f: dict, recordable, steps: list, status: ctypes.c_int32) -> None:
        recording = f["clNewRecordingQCOM"](recordable, ctypes.byref(status))
        _check(status.value, "clNewRecordingQCOM")
        if not recording:
            raise PerfxError("clNewRecordingQCOM gave no recording")
        self.recordings.append(recording)
        for step in steps:
            if isinstance(step, BoundLaunch):
                dims = len(step.global_size)
                global_size = (_size * dims)(*step.global_size)
                local_size = (_size * dims)(*step.local_size) if step.local_size else None
                code = f["clEnqueueNDRangeKernel"](recordable, step.kernel.int_ptr, dims, None, global_size,
                                                   local_size, 0, None, None)
                what = f"clEnqueueNDRangeKernel recording {step.kernel.function_name} global={step.global_size}"
            elif isinstance(step, BoundCopy):
                code = f["clEnqueueCopyBuffer"](recordable, step.src.int_ptr, step.dst.int_ptr, step.src_offset,
                                                step.dst_offset, step.nbytes, 0, None, None)
                what = f"clEnqueueCopyBuffer recording a copy of {step.nbytes} bytes"
            else:
                raise PerfxError(f"a recording holds launches and copies, not {type(step).__name__}")
            _check(code, what)
        _check(f["clEndRecordingQCOM"](recording), "clEndRecordingQCOM")

    def enqueue(self, queue: cl.CommandQueue) -> None:
        handle = queue.int_ptr
        for recording in self.recordings:
            # No argument, offset or work-size update; no wait list (the queue is in order); no event.
            status = self._enqueue(handle, recording, 0, None, 0, None, 0, None, 0, None, 0, None, None)
            if status:
                raise OpenCLError(f"clEnqueueRecordingQCOM replaying a step of {len(self.steps)} commands", status)


# -- which replay a device uses ----------------------------------------------------------------------------

REPLAYS = ("sequence", "command-buffer", "qcom")


def asked_replay(environ=None) -> str | None:
    """The replay asked for: PERFX_REPLAY (sequence, command-buffer or qcom), else command-buffer where
    PERFX_COMMAND_BUFFER=on (its older spelling), else None (perfx's default, one enqueue a launch)."""
    environ = os.environ if environ is None else environ
    value = environ.get("PERFX_REPLAY", "").strip().lower()
    if value:
        if value not in REPLAYS:
            raise PerfxError(f"PERFX_REPLAY={value!r}: it takes {', '.join(REPLAYS)}")
        return value
    return "command-buffer" if environ.get("PERFX_COMMAND_BUFFER", "").lower() == "on" else None


class ReplayChoice:
    """Which replay a device's recorded steps get (``kind``: one of ``REPLAYS``), and why (``mode``).

    A command buffer or a recording is used only where asked for (``asked_replay``) and the driver has it;
    neither has yet been measured faster than launches one by one on a driver. A driver that refuses one
    turns the device to launches one by one from then on, saying why.
    """

    def __init__(self, device: cl.Device, queue_properties: int, asked: str | None):
        self.asked, self.kind, self.why, self.max_size = asked, "sequence", None, None
        no_buffer = unavailable(device, queue_properties)
        no_qcom = qcom_unavailable(device)
        if asked == "command-buffer":
            self.kind, self.why = ("command-buffer", None) if no_buffer is None else ("sequence", no_buffer)
        elif asked == "qcom":
            self.kind, self.why = ("qcom", None) if no_qcom is None else ("sequence", no_qcom)
            self.max_size = recordable_queue_max_size(device) if no_qcom is None else None
        elif asked == "sequence":
            self.why = "asked for (PERFX_REPLAY=sequence)"
        else:
            offers = []
            if no_buffer is None:
                # Intel's CPU runtime replays a command buffer slower than the launches one by one (its decode
                # step in benchmarks/NOTES.md).
                offers.append(f"{EXTENSION}, used only with PERFX_COMMAND_BUFFER=on (benchmarks/decode_host.py "
                              "--replay both measures both here)")
            if no_qcom is None:
                offers.append(f"{QCOM_EXTENSION}, used only with PERFX_REPLAY=qcom (`perfx report` compares it "
                              "with launches one by one)")
            self.why = "the driver has " + " and ".join(offers) if offers else no_buffer

    @property
    def mode(self) -> str:
        if self.kind == "command-buffer":
            return f"one command buffer a step ({EXTENSION})"
        if self.kind == "qcom":
            return (f"one recording a step ({QCOM_EXTENSION}, PERFX_REPLAY=qcom"
                    + (f"; at most {self.max_size} commands a recording" if self.max_size else "") + ")")
        return f"one enqueue a launch: {self.why}"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "asked": self.asked, "why": self.why, "mode": self.mode}

    def replay(self, device: cl.Device, queue: cl.CommandQueue, steps: list):
        """The steps as one replay of this kind; launches one by one where the driver refuses it."""
        if self.kind == "command-buffer":
            try:
                return CommandBuffer(device, queue, steps)
            except PerfxError as e:   # a driver that lists the extension and refuses this step: keep going
                self.kind, self.why = "sequence", f"the driver refused a command buffer ({e})"
        elif self.kind == "qcom":
            try:
                return QcomRecording(device, queue, steps)
            except PerfxError as e:
                self.kind, self.why = "sequence", f"the driver refused a recording ({e})"
        return Sequence(steps)
