"""The device: one OpenCL device with its context and profiling queue, the kernels built on it (with
``-D`` defines, built programs and ``Kernel`` objects kept), the device memory perfx allocates (counted),
every copy to, from and within it, and the recording of launches that the decode step replays."""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

import numpy as np
import pyopencl as cl
import pyopencl.array as cla

from perfx.errors import PerfxError
from perfx.resources import kernel_path
from perfx.runtime.capabilities import Capabilities, Limits, parse_limits, read_capabilities
from perfx.runtime.errors import BuildError, KernelInfo, KernelLimitError, define_flags, raise_as_perfx
from perfx.runtime.replay import BoundCopy, BoundLaunch, CommandBuffer, Sequence, unavailable
from perfx.runtime.selection import choose_device


class _CountedBuffer(cl.Buffer):
    """A Buffer that can carry a weakref finalizer (pyopencl's own cannot), for memory accounting."""


class _CountedImage(cl.Image):
    pass


def _region(target, offset: int, nbytes: int | None, what: str) -> tuple[cl.Buffer, int]:
    """(the buffer behind ``target``, a cl.Buffer or a pyopencl Array; ``nbytes``, by default to its end),
    checked to hold bytes [offset, offset + nbytes): a clear error instead of OpenCL's CL_INVALID_VALUE."""
    if isinstance(target, cla.Array):
        buffer, size = target.data, target.nbytes
    else:
        buffer, size = target, target.size
    nbytes = size - offset if nbytes is None else nbytes
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise PerfxError(f"{what}: bytes {offset} to {offset + nbytes} lie outside a buffer of {size} bytes")
    return buffer, nbytes


def _size(nbytes: int) -> str:
    """Bytes for a message: MiB, or KiB below one MiB (a tight PERFX_LIMITS would read "0 MiB")."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def build_options(caps: Capabilities) -> list[str]:
    """The compiler options perfx builds every kernel with on this device.

    The part of fast math that keeps every kernel within its tolerance: ``-cl-mad-enable`` (a GPU may
    fuse a multiply and an add, as Adreno's ALUs do) and ``-cl-no-signed-zeros``. Not
    ``-cl-fast-relaxed-math``: attention's online softmax starts from −INFINITY, which its
    ``-cl-finite-math-only`` lets a compiler assume away, and on Intel's CPU runtime its approximate exp
    took the SiLU epilogues and gemv_q8 past their tolerances in some selftest checks (benchmarks/NOTES.md);
    with the two options here they all pass on PoCL and Intel. ``PERFX_BUILD_OPTIONS`` adds options of
    your own (a driver's, to try), still checked by `perfx selftest`.
    """
    extra = os.environ.get("PERFX_BUILD_OPTIONS", "").split()
    return ["-cl-mad-enable", "-cl-no-signed-zeros", *extra]


class Device:
    """One OpenCL device with its context, a profiling queue, built kernels, memory accounting and the copies."""

    def __init__(self, selector: str | None = None, limits: Limits | None = None):
        self.entry, self.reason = choose_device(selector)
        self.cl_device = self.entry.device
        self.limits = limits if limits is not None else parse_limits(os.environ.get("PERFX_LIMITS"))
        self.caps = read_capabilities(self.cl_device, self.limits)
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
        self._no_command_buffer = unavailable(self.cl_device, self.queue.properties)
        if self._no_command_buffer is None and os.environ.get("PERFX_COMMAND_BUFFER", "").lower() != "on":
            # Intel's CPU runtime replays a command buffer slower than the launches one by one (its decode step
            # in benchmarks/NOTES.md); no driver has yet been measured faster with them.
            self._no_command_buffer = ("the driver has cl_khr_command_buffer, used only with "
                                       "PERFX_COMMAND_BUFFER=on (benchmarks/decode_host.py --replay both "
                                       "measures both here)")

    def __repr__(self) -> str:
        return f"<perfx.Device {self.caps.platform} / {self.caps.name}, limits={self.caps.limits}>"

    @property
    def fingerprint(self) -> dict:
        """What identifies this device and driver in the tuning database."""
        c = self.caps
        return {"platform": c.platform, "device": c.name, "opencl_c_version": c.opencl_c_version,
                "driver_version": c.driver_version}

    # -- building ------------------------------------------------------------------------------

    def build(self, file: str, defines: dict | None = None, newest_c: bool = False) -> cl.Program:
        """Build ``kernels/<file>`` with ``-DNAME=value`` per define; built programs are kept.

        ``newest_c``: as the newest OpenCL C the compiler takes (``-cl-std``, from 2.0 up), for built-ins that a
        compiler declares only there (cl_khr_integer_dot_product's on Intel's CPU runtime); else the compiler's
        default, OpenCL C 1.2 on most."""
        defines = dict(defines or {})
        key = (file, tuple(sorted(defines.items())), newest_c)
        program = self._programs.get(key)
        if program is not None:
            return program
        path = kernel_path(file)
        options = define_flags(defines) + ["-I", str(path.parent), *self.build_options]
        if newest_c and self.caps.opencl_c >= (2, 0):
            options.append("-cl-std=CL{}.{}".format(*self.caps.opencl_c))
        program = cl.Program(self.context, path.read_text())
        try:
            program.build(options=options, devices=[self.cl_device])
        except cl.Error as e:
            raise BuildError(file, defines, str(e), self.caps.name) from e
        self._programs[key] = program
        return program

    def kernel(self, file: str, name: str, defines: dict | None = None, newest_c: bool = False) -> cl.Kernel:
        """A ``Kernel`` object, created once per (file, defines, name): each ``program.name`` makes a new one
        (``newest_c``: see ``build``).

        A kernel whose required work-group (``reqd_work_group_size``) or local memory exceeds what the driver
        reports it can run raises KernelLimitError here: those parameters cannot run on this driver.
        """
        key = (file, tuple(sorted((defines or {}).items())), name, newest_c)
        kernel = self._kernels.get(key)
        if kernel is None:
            program = self.build(file, defines, newest_c)
            try:
                kernel = cl.Kernel(program, name)
            except cl.Error as e:
                raise_as_perfx(f"creating kernel {name!r} from kernels/{file}", e)
            info = self.kernel_info(kernel)
            flags = " ".join(define_flags(defines or {}))
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

    @property
    def programs_kept(self) -> int:
        """How many built programs this device keeps (``build``), each holding its machine code."""
        return len(self._programs)

    def forget_programs(self) -> None:
        """Drop the built programs and ``Kernel`` objects this device keeps (``build``, ``kernel``): their memory
        goes once nothing else holds them, and a later build of the same kernel comes from pyopencl's binary
        cache. For runs over many parameter sets each used for a while and then never again (`perfx selftest`
        calls it after each family, and where many are kept); kernels held elsewhere (a model's wrappers,
        recorded steps) stay valid."""
        self._programs.clear()
        self._kernels.clear()
        self._infos.clear()

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

    @contextlib.contextmanager
    def record(self):
        """Record the launches and copies made inside the block instead of running them, as ``BoundLaunch``es
        and ``BoundCopy``s.

        The decode step replays them every token: each has its own Kernel object with its arguments
        bound once, so a token costs one enqueue per launch and no argument setting in Python.
        """
        launches: list = []
        self._recording = launches
        try:
            yield launches
        finally:
            self._recording = None

    def replay(self, steps: list) -> CommandBuffer | Sequence:
        """Recorded steps as one step to enqueue again and again: a command buffer where asked for
        (PERFX_COMMAND_BUFFER=on) and the driver has ``cl_khr_command_buffer``, else one enqueue a launch
        (``replay_mode`` says which, and why)."""
        if self._no_command_buffer is None:
            try:
                return CommandBuffer(self.cl_device, self.queue, steps)
            except PerfxError as e:   # a driver that lists the extension and refuses this step: keep going
                self._no_command_buffer = f"the driver refused a command buffer ({e})"
        return Sequence(steps)

    @property
    def replay_mode(self) -> str:
        """How a recorded decode step is enqueued on this device."""
        return ("one command buffer a step (cl_khr_command_buffer)" if self._no_command_buffer is None
                else f"one enqueue a launch: {self._no_command_buffer}")

    # -- copies: between buffers, and between the host and a buffer -----------------------------------
    # Each takes a cl.Buffer or a pyopencl Array (at no offset) and offsets in bytes; the queue runs them in
    # order with the launches. Only ``copy`` is recorded while recording; the others run at once.

    def copy(self, dst, src, nbytes: int, src_offset: int = 0, dst_offset: int = 0) -> cl.Event | None:
        """Device-to-device copy of ``nbytes`` between buffers (or Arrays); recorded while recording."""
        step = BoundCopy(getattr(dst, "data", dst), getattr(src, "data", src), nbytes, src_offset, dst_offset)
        if self._recording is not None:
            self._recording.append(step)
            return None
        return step.enqueue(self.queue)

    def write(self, dst, host: np.ndarray, dst_offset: int = 0, wait: bool = True) -> cl.Event:
        """Copy the host array ``host`` into ``dst`` from ``dst_offset`` on. With ``wait`` False it returns at
        once and the copy runs in queue order: ``host`` must stay unchanged until its event completes."""
        host = np.ascontiguousarray(host)
        buffer, _ = _region(dst, dst_offset, host.nbytes, "write")
        try:
            return cl.enqueue_copy(self.queue, buffer, host, dst_offset=dst_offset, is_blocking=wait)
        except cl.Error as e:
            raise_as_perfx(f"writing {host.nbytes} bytes to the device", e)

    def read(self, host: np.ndarray, src, src_offset: int = 0) -> np.ndarray:
        """Copy ``host.nbytes`` bytes of ``src`` from ``src_offset`` on into the host array ``host`` (in place,
        after the work queued before it) and return ``host``."""
        if not (host.flags.c_contiguous and host.flags.writeable):
            raise PerfxError("read: the host array must be C-contiguous and writeable (np.empty makes one)")
        buffer, _ = _region(src, src_offset, host.nbytes, "read")
        try:
            cl.enqueue_copy(self.queue, host, buffer, src_offset=src_offset)
        except cl.Error as e:
            raise_as_perfx(f"reading {host.nbytes} bytes from the device", e)
        return host

    def fill(self, dst, value: np.generic, nbytes: int | None = None, offset: int = 0) -> cl.Event:
        """Fill ``nbytes`` bytes of ``dst`` from ``offset`` on (by default: to its end) with the numpy scalar
        ``value`` repeated (``np.uint16(0)``, ``np.float32(np.nan)``): its dtype sets the pattern's size."""
        if not isinstance(value, np.generic):
            raise PerfxError(f"fill takes a numpy scalar such as np.float32(0), not {type(value).__name__}: "
                             "its dtype sets the size of the pattern")
        buffer, nbytes = _region(dst, offset, nbytes, "fill")
        if offset % value.itemsize or nbytes % value.itemsize:
            raise PerfxError(f"fill: offset {offset} and size {nbytes} must be multiples of the "
                             f"{value.itemsize}-byte pattern ({value.dtype})")
        try:
            return cl.enqueue_fill_buffer(self.queue, buffer, value, offset, nbytes)
        except cl.Error as e:
            raise_as_perfx(f"filling {nbytes} bytes with {value!r}", e)

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

