"""The device: one OpenCL device with its context and queue (no profiling events, a second queue with them while
measuring: ``Device.profiling``), the kernels built on it (with
``-D`` defines, built programs and ``Kernel`` objects kept), the device memory perfx allocates (counted),
every copy to, from and within it, and the recording of launches that the decode step replays."""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import pyopencl as cl
import pyopencl.array as cla
from pyopencl.characterize import has_src_build_cache

from perfx.errors import PerfxError
from perfx.resources import kernel_path
from perfx.runtime.capabilities import Capabilities, Limits, parse_limits, read_capabilities
from perfx.runtime.errors import BuildError, KernelInfo, KernelLimitError, define_flags, raise_as_perfx
from perfx.runtime.implementations import one_library_environ
from perfx.runtime.replay import (BoundCopy, BoundLaunch, CommandBuffer, QcomRecording, ReplayChoice, Sequence,
                                  asked_replay)
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


BUILD_WORKERS_ENV = "PERFX_BUILD_WORKERS"
MAX_BUILD_WORKERS = 8
BUILD_PROCESSES_ENV = "PERFX_BUILD_PROCESSES"
# Implementations whose compiler builds one program at a time within a process, however many threads ask (a lock
# around their compiler; measured, benchmarks/NOTES.md "builds at once"): their builds at once run in worker
# processes, which hand the binaries back.
SERIAL_IN_PROCESS = frozenset({"intel", "pocl"})
# Build worker processes unless PERFX_BUILD_WORKERS asks for more: each holds its own Python and driver compiler
# (about a third of a selftest's resident memory each, benchmarks/NOTES.md), and the selftest's budget is for all.
MAX_BUILD_PROCESSES = 2
# Fewer programs than this are not worth starting worker processes for (a Python process and a context each):
# built here, one at a time.
MIN_FOR_NEW_PROCESSES = 4


class BuildConcurrencyWarning(UserWarning):
    """The driver failed a build made while others ran, and built it alone: it builds one at a time from now."""


def build_key(file: str, defines: dict | tuple | None = None, newest_c: bool = False) -> tuple:
    """One build request, as ``Device`` keeps its programs: ``(file, sorted define items, newest_c)``."""
    items = defines if isinstance(defines, tuple) else tuple(sorted((defines or {}).items()))
    return (file, items, bool(newest_c))


@dataclass
class BuildReport:
    """What ``Device.build_many`` did: ``requested`` distinct programs, of which ``built`` were not yet in
    this process (``from_cache`` of those came from pyopencl's binary cache, where it says so: not on PoCL,
    whose own cache pyopencl leaves the builds to), ``errors`` (key -> BuildError), in ``seconds`` on
    ``workers`` threads, or worker processes where ``processes``; ``serial_reason``: why this device builds one
    at a time, if it does."""

    requested: int
    built: list
    errors: dict = field(default_factory=dict)
    from_cache: int = 0
    seconds: float = 0.0
    workers: int = 1
    serial_reason: str | None = None
    processes: bool = False

    def as_dict(self) -> dict:
        return {"requested": self.requested, "built": len(self.built), "from_cache": self.from_cache,
                "failed": len(self.errors), "seconds": round(self.seconds, 3), "workers": self.workers,
                "processes": self.processes, "serial_reason": self.serial_reason,
                "errors": [{"file": k[0], "defines": dict(k[1]), "error": e.summary} for k, e in self.errors.items()]}


_NOT_BEGUN = object()   # a build_many request left unbuilt, once asked to stop


class BackgroundBuilds:
    """``build_many`` running on a thread of its own (``Device.build_in_background``): ``wait()`` returns its
    BuildReport once every request is settled, and raises what the thread raised, if anything."""

    def __init__(self, device: Device, requests, workers: int | None, on_done):
        self._report: BuildReport | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(device, list(requests), workers, on_done),
                                        name="perfx-build-background", daemon=True)
        self._thread.start()

    def _run(self, device, requests, workers, on_done):
        try:
            self._report = device.build_many(requests, workers, on_done, self._stop)
        except BaseException as error:   # noqa: BLE001 - handed to the waiting thread, raised there
            self._error = error

    def wait(self) -> BuildReport:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._report

    def cancel(self) -> None:
        """No more builds start; returns once those under way are done (the others are left for a later build)."""
        self._stop.set()
        self._thread.join()


class _PendingProgram:
    """What ``build`` returns while collecting: the request, unbuilt."""

    def __init__(self, key: tuple):
        self.key = key


class _PendingKernel:
    """What ``kernel`` returns while collecting: a name, nothing to launch."""

    def __init__(self, program: _PendingProgram, name: str):
        self.program, self.function_name = program, name
        self.int_ptr = id(self)


def _from_binary_cache(program: cl.Program) -> bool:
    """Whether pyopencl took the program from its binary cache (it records how it built each)."""
    info = getattr(program, "_build_duration_info", None)
    return bool(info and info[1])


def _first_line(error: Exception) -> str:
    return getattr(error, "summary", None) or (str(error).splitlines() or [""])[0][:200]


# -- builds in worker processes --------------------------------------------------------------------------------
# Each worker is a fresh Python process (not multiprocessing's spawn, which runs the parent's main script again
# in each worker, and not a fork, which would copy the parent's OpenCL driver threads half way) that opens the same
# device, builds a program from source as ``Device.build`` does and hands its binary back over a pipe, keeping
# nothing; the parent makes its program from that binary. The workers of one device, limits and build options
# serve every Device of the process, and stop when it exits.

# A worker needs only this layer: it enters the package as a bare one, without the package's __init__ (the public
# API, which imports every layer: most of a worker's start, which each load that starts workers waits for before
# its first build).
_WORKER_MAIN = ("import importlib.util, sys, types\n"
                "spec = importlib.util.find_spec('perfx')\n"
                "package = sys.modules['perfx'] = types.ModuleType('perfx')\n"
                "package.__path__, package.__spec__ = list(spec.submodule_search_locations), spec\n"
                "import perfx.runtime.device as d; d._worker_main()")


def _send(stream, message) -> None:
    data = pickle.dumps(message)
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _receive(stream):
    """The next message, or EOFError where the other side is gone."""
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError
    data = stream.read(int.from_bytes(head, "little"))
    if len(data) < int.from_bytes(head, "little"):
        raise EOFError
    return pickle.loads(data)


def _worker_main() -> None:
    """A build worker: (selector, limits, options, binaries), answered with the fingerprint of the device it opened;
    then keys, each answered with (key, outcome): the build's log where it failed, else (binary, whether pyopencl
    took it from its binary cache); without ``binaries``, b"" for the binary: the driver's own cache of builds from
    source now holds the program."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr   # anything printed by the way goes to stderr, not into the answers
    selector, limits, options, binaries = _receive(stdin)
    device = Device(selector, limits)
    device.build_options = list(options)
    _send(stdout, device.fingerprint)
    while True:
        try:
            key = _receive(stdin)
        except EOFError:
            return
        try:
            program = device.build(key[0], dict(key[1]), key[2])
            binary = program.get_info(cl.program_info.BINARIES)[0] if binaries else b""
            outcome = (binary, _from_binary_cache(program))
        except BuildError as error:
            outcome = error.log
        except Exception as error:   # noqa: BLE001 - handed back as the request's failure, with what raised it
            outcome = f"{type(error).__name__} in a build worker: {error}"
        finally:
            device.forget_programs()
        _send(stdout, (key, outcome))


def resident_peak_bytes(pid: int | str = "self") -> int | None:
    """A process's peak resident memory from Linux's (and Android's) VmHWM, else None. Not ru_maxrss: Linux
    carries a parent's peak into a child across fork and exec, so a selftest started from a large process (a test
    runner, an app) would report its parent's memory as its own."""
    return _status_bytes(pid, "VmHWM")


def resident_bytes(pid: int | str = "self") -> int | None:
    """A process's resident memory now (Linux's and Android's VmRSS), else None."""
    return _status_bytes(pid, "VmRSS")


def _status_bytes(pid: int | str, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class _Worker:
    """One build worker process and its pipes: one build at a time, whichever thread asks."""

    # Whether workers start with the ICD loader reading only the device's own library (``one_library_environ``, as
    # the selftest's check workers do): the other implementations' libraries, loaded for nothing, are much of a
    # worker's memory (Intel's CPU runtime: about 115 MiB in a PoCL process; benchmarks/NOTES.md). Off for the
    # rest of the process once a worker so started opens another device.
    one_library = True

    def __init__(self, device: Device, options: list[str], binaries: bool):
        self.lock = threading.Lock()
        self._fingerprint, self._selector, self._settings = device.fingerprint, device.entry.index, (
            device.limits, options, binaries)
        alone = one_library_environ(device.entry.implementation) if _Worker.one_library else None
        self._alone, self._confirmed = alone is not None, False
        if alone is not None:
            # the only platform the loader then lists: the device's index within it
            self._start({**os.environ, **alone}, f"0:{device.entry.device_index}")
        else:
            self._start(None, self._selector)

    def _start(self, env: dict | None, selector: str) -> None:
        # a session of its own: a terminal's Ctrl-C (SIGINT to the foreground group) is the parent's to handle
        # (`perfx chat` stops a reply with it); the worker ends when its pipe closes
        self.process = subprocess.Popen([sys.executable, "-c", _WORKER_MAIN], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True, env=env)
        _send(self.process.stdin, (selector, *self._settings))

    def _confirm(self) -> None:
        """Before the first build (with ``lock`` held; the workers start at once, and each opens its device while
        the others do): a worker of one library that opened another device, or found none and ended, is replaced
        by one that sees them all. One killed (a signal: a driver's crash) is left dead: its first build says so."""
        if self._confirmed:
            return
        self._confirmed = True
        try:
            opened = _receive(self.process.stdout)
        except (EOFError, OSError, ValueError, pickle.UnpicklingError):
            opened = None
            if self.process.wait() < 0:
                return
        if self._alone and opened != self._fingerprint:
            _Worker.one_library = False
            self.stop()
            self._start(None, self._selector)
            with contextlib.suppress(EOFError, OSError, ValueError, pickle.UnpicklingError):
                _receive(self.process.stdout)

    def build(self, key: tuple) -> tuple | str:
        """(the binary of ``key`` built in this worker, whether from pyopencl's cache), or the build's log; a worker
        that died says so (and is left dead: ``alive``)."""
        try:
            with self.lock:
                self._confirm()
                _send(self.process.stdin, key)
                answered, outcome = _receive(self.process.stdout)
        except (EOFError, OSError, ValueError):   # its pipe closed: the worker died or was stopped
            status = self.process.wait()
            return f"a build worker process died (exit status {status}) building it"
        assert answered == key, (answered, key)
        return outcome

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def ask_to_stop(self) -> None:
        """Its peak memory noted, its pipe closed: it ends after the build it is making (``stop`` waits for that)."""
        if self.process.stdin.closed:
            return
        peak = self.peak_bytes() if self.alive else None
        if peak is not None:
            _stopped_peaks.append(peak)
        with contextlib.suppress(OSError):
            self.process.stdin.close()

    def peak_bytes(self) -> int | None:
        """This worker's peak resident memory while it runs, else None."""
        return resident_peak_bytes(self.process.pid)

    def stop(self) -> None:
        self.ask_to_stop()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_workers: dict[tuple, list[_Worker]] = {}
_workers_lock = threading.Lock()
_stopped_peaks: list[int] = []   # the peak resident bytes of each worker stopped, where the system tells


def running_build_workers() -> int:
    """How many build worker processes this process has running."""
    with _workers_lock:
        return sum(w.alive for group in _workers.values() for w in group)


def build_workers_peak_bytes() -> int:
    """The largest peak resident memory of a build worker this process started, running or stopped (0: none, or
    a system that does not tell). Not the children's ru_maxrss: a driver that forks (PoCL, to link a kernel)
    shows a child as large as this process there."""
    with _workers_lock:
        running = [w.peak_bytes() for group in _workers.values() for w in group if w.alive]
    return max([p for p in running if p is not None] + _stopped_peaks, default=0)


def _workers_for(device: Device, count: int) -> list[_Worker]:
    """``count`` live build workers for ``device`` (its selector, limits and options), started where missing."""
    key = (device.entry.index, device.limits, tuple(device.build_options))
    with _workers_lock:
        # one set of settings' workers at a time: a selftest's families ask for many (limits, options), and
        # workers kept for each would hold ~300 MiB apiece for the whole run; an idle one of other settings stops
        for other in [k for k in _workers if k != key]:
            busy = []
            for worker in _workers.pop(other):
                if worker.lock.acquire(blocking=False):
                    try:
                        worker.stop()
                    finally:
                        worker.lock.release()
                else:
                    busy.append(worker)
            if busy:
                _workers[other] = busy
        live = [w for w in _workers.get(key, []) if w.alive]
        while len(live) < count:
            live.append(_Worker(device, list(device.build_options), not device.workers_fill_driver_cache))
        _workers[key] = live
        return live[:count]


def _workers_running(device: Device, count: int) -> bool:
    with _workers_lock:
        key = (device.entry.index, device.limits, tuple(device.build_options))
        return sum(w.alive for w in _workers.get(key, [])) >= count


def shutdown_build_workers() -> None:
    """Stop every build worker process this process started (they stop at its exit anyway)."""
    with _workers_lock:
        workers = [w for group in _workers.values() for w in group]
        _workers.clear()
    for worker in workers:   # all asked first: they end at once, not one after another
        worker.ask_to_stop()
    for worker in workers:
        worker.stop()


atexit.register(shutdown_build_workers)


class Device:
    """One OpenCL device with its context, its queue, built kernels, memory accounting and the copies.

    ``queue`` records no profiling events: every launch, copy and decode step runs on it, and an event a launch
    does not need costs the host time a launch (``benchmarks/launch_cost.py``). Inside ``profiling()`` the device
    runs on a second queue that records them, for the measurements that read them (``perfx.timing``)."""

    _of_queue: weakref.WeakValueDictionary = weakref.WeakValueDictionary()   # queue handle -> its Device

    def __init__(self, selector: str | None = None, limits: Limits | None = None):
        self.entry, self.reason = choose_device(selector)
        self.cl_device = self.entry.device
        self.limits = limits if limits is not None else parse_limits(os.environ.get("PERFX_LIMITS"))
        self.caps = read_capabilities(self.cl_device, self.limits)
        try:
            self.context = cl.Context([self.cl_device])
            self.queue = self._lean_queue = cl.CommandQueue(self.context)
        except cl.Error as e:
            raise_as_perfx(f"creating a context on {self.caps.name}", e)
        self._profiling_queue: cl.CommandQueue | None = None   # made at the first profiling()
        self._profiling_depth = 0
        Device._of_queue[self.queue.int_ptr] = self
        self.build_options = build_options(self.caps)
        self._programs: dict[tuple, cl.Program] = {}
        self._kernels: dict[tuple, cl.Kernel] = {}
        self._shared_kernels: dict[tuple, cl.Kernel] = {}   # ``kernel``'s ``reads``: one of each kind
        self._infos: dict[int, KernelInfo] = {}     # by int_ptr, for the kernels kept in _kernels
        self._watching: list[set] = []
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()           # guards _programs, _building and _build_errors
        self._building: dict[tuple, threading.Event] = {}   # being built by some thread: set when done
        self._build_errors: dict[tuple, BuildError] = {}
        self._serial_reason: str | None = None       # set when the driver failed under concurrent builds
        self._worker_cached: dict[tuple, bool] = {}  # programs made from a worker's binary: whether from its cache
        self._compiling = threading.local()          # seconds each thread spent in the compiler (compile_seconds)
        self._collect = threading.local()             # the calling thread's list while it collects (collecting)
        self.allocated_bytes = 0
        self.peak_allocated_bytes = 0
        self._recording: list | None = None
        self.replay_choice = ReplayChoice(self.cl_device, self.queue.properties, asked_replay())

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
        default, OpenCL C 1.2 on most.

        Thread-safe: each program is built once; a thread asking for one that another thread (``build_many``)
        is building waits for it. A build that failed raises its BuildError again without building again.
        Inside ``collecting()`` nothing is built: the request is recorded."""
        key = build_key(file, defines, newest_c)
        if self._collecting is not None:
            self._collecting.append(key)
            return _PendingProgram(key)
        while True:
            with self._build_lock:
                program = self._programs.get(key)
                if program is not None:
                    return program
                if key in self._build_errors:
                    raise self._build_errors[key]
                waiting = self._building.get(key)
                if waiting is None:
                    done = self._building[key] = threading.Event()
            if waiting is None:
                break
            waiting.wait()   # another thread builds it: take its program (or its error) on the next turn
        try:
            program = self._compile(key)
        except BuildError as error:
            with self._build_lock:
                self._build_errors[key] = error
            raise
        else:
            with self._build_lock:
                self._programs[key] = program
            return program
        finally:
            with self._build_lock:
                del self._building[key]
            done.set()

    def _compile(self, key: tuple) -> cl.Program:
        """One program built from source (or pyopencl's binary cache); a failure as a BuildError with the log."""
        file, define_items, newest_c = key
        defines = dict(define_items)
        path = kernel_path(file)
        program = cl.Program(self.context, path.read_text())
        options = self._options(key)
        started = time.perf_counter()
        try:
            program.build(options=options, devices=[self.cl_device])
        except cl.Error as e:
            raise BuildError(file, defines, str(e), self.caps.name) from e
        finally:
            self._compiling.seconds = self.compile_seconds() + time.perf_counter() - started
        return program

    def _options(self, key: tuple) -> list[str]:
        file, define_items, newest_c = key
        options = define_flags(dict(define_items)) + ["-I", str(kernel_path(file).parent), *self.build_options]
        if newest_c and self.caps.opencl_c >= (2, 0):
            options.append("-cl-std=CL{}.{}".format(*self.caps.opencl_c))
        return options

    def _from_binary(self, key: tuple, binary: bytes) -> cl.Program:
        """The program of ``key`` made from a binary a build worker compiled (``build_many`` in processes)."""
        program = cl.Program(self.context, [self.cl_device], [binary])
        try:
            program.build(options=self._options(key), devices=[self.cl_device])
        except cl.Error as e:
            raise BuildError(key[0], dict(key[1]), f"loading the binary a build worker made: {e}",
                             self.caps.name) from e
        return program

    def _cached(self, key: tuple) -> bool:
        """Whether pyopencl took the program of ``key`` from its binary cache, here or in the build worker."""
        if key in self._worker_cached:
            return self._worker_cached[key]
        program = self._programs.get(key)
        return program is not None and _from_binary_cache(program)

    def compile_seconds(self) -> float:
        """Seconds the calling thread has spent building programs on this device (from source or pyopencl's
        binary cache): what a caller timing its own work takes to tell the builds it waited for from the rest."""
        return getattr(self._compiling, "seconds", 0.0)

    def build_many(self, requests, workers: int | None = None, on_done=None, stop=None) -> BuildReport:
        """Build many programs at once, each ``(file, defines, newest_c)`` (``newest_c`` may be left out), with
        ``workers`` builds at a time (default: ``build_workers()``: PERFX_BUILD_WORKERS, else the CPU count, at most
        8), into the programs ``build`` keeps: a later ``build`` or ``kernel`` of one of them builds nothing.

        Where the implementation's compiler builds one program at a time within a process (``SERIAL_IN_PROCESS``:
        PoCL and Intel's CPU runtime; PERFX_BUILD_PROCESSES=1 or 0 asks for or against it elsewhere), the builds run
        in worker processes that hand back each program's binary (``builds_in_processes``); else on threads, where
        pyopencl lets go of the GIL while the driver compiles and its binary cache serves as with ``build``.
        Nothing raises: each failure is in the report's ``errors`` as the BuildError ``build`` raises (with the
        log), and ``build`` raises it again. A request that failed while others were building is built again
        alone; where it then builds, the driver is taken not to bear concurrent builds: the rest of this
        device's builds run one at a time, and a warning says so once (``serial_reason``).
        ``on_done(key, error)`` is called in this thread as each finishes (a progress bar). Once ``stop`` (a
        ``threading.Event``) is set, no more builds start: those not begun are left unbuilt, for a later ``build``.
        Inside ``collecting()`` the requests are recorded instead."""
        started = time.perf_counter()
        keys = list(dict.fromkeys(build_key(*request) for request in requests))
        if self._collecting is not None:
            self._collecting.extend(keys)
            return BuildReport(len(keys), [], {}, 0, 0.0, 0)
        with self._build_lock:
            todo = [k for k in keys if k not in self._programs and k not in self._build_errors]
        asked = workers is not None or bool(os.environ.get(BUILD_WORKERS_ENV, "").strip())
        workers = self.build_workers(workers)
        if self.builds_in_processes() and not asked:   # each worker holds its own Python and compiler
            workers = min(workers, MAX_BUILD_PROCESSES)
        processes = (workers > 1 and self.builds_in_processes()
                     and (len(todo) >= MIN_FOR_NEW_PROCESSES or len(todo) > 1 and _workers_running(self, workers)))
        report = BuildReport(len(keys), todo, {}, 0, 0.0, min(workers, max(len(todo), 1)), processes=processes)
        failed: list[tuple] = []

        def stopped() -> bool:
            return stop is not None and stop.is_set()

        def attempt(key):
            return _NOT_BEGUN if stopped() else self._try_build(key)

        def finished(key, error):
            if error is not None:
                report.errors[key] = error
            elif self._cached(key):
                report.from_cache += 1
            if on_done is not None:
                on_done(key, error)

        if workers <= 1 or len(todo) <= 1 or (self.builds_in_processes() and not processes):
            for key in todo:
                if stopped():
                    break
                finished(key, self._try_build(key))
        elif processes:
            self._build_in_processes(todo, workers, finished, failed, stop)
        else:
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="perfx-build") as pool:
                futures = {pool.submit(attempt, key): key for key in todo}
                for future in concurrent.futures.as_completed(futures):
                    key, error = futures[future], future.result()
                    if error is _NOT_BEGUN:
                        continue
                    if error is None:
                        finished(key, None)
                    else:
                        failed.append((key, error))
        # Failures while building concurrently: built again alone. One that builds alone shows a driver that
        # does not bear concurrent builds.
        for key, error in failed:
            if stopped():
                break
            with self._build_lock:
                self._build_errors.pop(key, None)
            again = self._try_build(key)
            if again is None and self._serial_reason is None:
                self._serial_reason = (f"kernels/{key[0]} failed to build while other builds ran ("
                                       f"{_first_line(error)}) and built alone")
                warnings.warn(f"perfx: {self.caps.name} ({self.caps.platform}): {self._serial_reason}; this "
                              "device builds one kernel at a time from now on (PERFX_BUILD_WORKERS=1 asks for "
                              "that from the start)", BuildConcurrencyWarning, stacklevel=2)
            finished(key, again)
        report.seconds = time.perf_counter() - started
        report.serial_reason = self._serial_reason
        return report

    def build_in_background(self, requests, workers: int | None = None, on_done=None) -> BackgroundBuilds:
        """``build_many(requests, workers, on_done)`` on a thread of its own, returned at once (``on_done`` is called
        on that thread): the caller goes on with other work (a model's weights uploaded) and a ``build`` or
        ``kernel`` of a request waits only for that program, where the thread builds it, or builds it at once, where
        the thread has not come to it. ``wait()`` on what this returns gives the BuildReport. Inside
        ``collecting()`` the requests are recorded here, as ``build_many`` records them."""
        if self._collecting is not None:
            self._collecting.extend(build_key(*request) for request in requests)
            requests = []
        return BackgroundBuilds(self, requests, workers, on_done)

    @property
    def workers_fill_driver_cache(self) -> bool:
        """Whether a build worker leaves its program in the driver's own cache of builds from source, for this
        process's build from source to find, instead of handing a binary back: on PoCL, whose binaries, asked for,
        compile every kernel of the file again for any work-group size, costing more than the build (measured,
        benchmarks/NOTES.md "builds at once")."""
        return (self.entry.implementation == "pocl" and bool(has_src_build_cache(self.cl_device))
                and not self._pocl_cache_off)

    @property
    def _pocl_cache_off(self) -> bool:
        return self.entry.implementation == "pocl" and os.environ.get("POCL_KERNEL_CACHE", "1") == "0"

    def builds_in_processes(self) -> bool:
        """Whether ``build_many`` builds in worker processes: PERFX_BUILD_PROCESSES (1 or 0) where set, else where
        this implementation builds one program at a time within a process (``SERIAL_IN_PROCESS``), PoCL only with
        its cache of builds on (POCL_KERNEL_CACHE)."""
        setting = os.environ.get(BUILD_PROCESSES_ENV, "").strip()
        if setting not in ("", "0", "1"):
            raise PerfxError(f"{BUILD_PROCESSES_ENV}={setting!r}: give 1 (build in worker processes) or 0 (on "
                             "threads of this process)")
        if setting:
            return setting == "1"
        # PoCL with its cache off would compile each program twice, in the worker and here
        return self.entry.implementation in SERIAL_IN_PROCESS and not self._pocl_cache_off

    def _claim(self, keys: list[tuple]) -> tuple[dict, list]:
        """Of ``keys``, those no thread builds yet, marked as built here (their events), and the others."""
        claimed, others = {}, []
        with self._build_lock:
            for key in keys:
                if key in self._programs or key in self._build_errors or key in self._building:
                    others.append(key)
                else:
                    claimed[key] = self._building[key] = threading.Event()
        return claimed, others

    def _settle(self, key: tuple, event: threading.Event, program: cl.Program | None) -> None:
        with self._build_lock:
            if program is not None:
                self._programs[key] = program
            del self._building[key]
        event.set()

    def _remote_compile(self, keys: list[tuple], workers: int, stop=None):
        """(key, (binary, from pyopencl's cache), or the build's log or what failed, as text) for each key, as the
        workers finish, each fed by a thread of this process that waits on it. A worker that dies fails the build
        it was making and takes no more; the others build the rest."""
        todo: queue.Queue = queue.Queue()
        for key in keys:
            todo.put(key)
        done: queue.Queue = queue.Queue()
        finished = object()

        def feed(worker):
            try:
                while stop is None or not stop.is_set():
                    try:
                        key = todo.get_nowait()
                    except queue.Empty:
                        return
                    done.put((key, worker.build(key)))
                    if not worker.alive:
                        return
            finally:
                done.put(finished)
        feeders = [threading.Thread(target=feed, args=(w,), name="perfx-build-worker", daemon=True)
                   for w in _workers_for(self, min(workers, len(keys)))]
        for thread in feeders:
            thread.start()
        answered, running = 0, len(feeders)
        while answered < len(keys):
            if running == 0 and stop is not None and stop.is_set():   # what is left stays unbuilt
                break
            if running == 0:   # every worker died: what is left fails here, to be built alone
                key = todo.get_nowait()
                answered += 1
                yield key, "no build worker process is left (each died)"
                continue
            item = done.get()
            if item is finished:
                running -= 1
                continue
            answered += 1
            yield item
        for thread in feeders:
            thread.join()

    def _build_in_processes(self, todo: list[tuple], workers: int, finished, failed: list, stop=None) -> None:
        """``build_many``'s builds in worker processes; failures into ``failed``, to be built again alone."""
        claimed, others = self._claim(todo)
        started = time.perf_counter()
        try:
            for key, outcome in self._remote_compile(list(claimed), workers, stop=stop):
                program = error = None
                if isinstance(outcome, tuple):
                    binary, cached = outcome
                    try:
                        program = self._from_binary(key, binary) if binary else self._compile(key)
                    except BuildError as e:
                        error = e
                    else:
                        if binary:
                            self._worker_cached[key] = cached
                else:
                    error = BuildError(key[0], dict(key[1]), outcome, self.caps.name)
                self._settle(key, claimed.pop(key), program)
                if error is None:
                    finished(key, None)
                else:
                    failed.append((key, error))
        finally:
            for key, event in claimed.items():   # not handed back (an exception here): left for ``build``
                self._settle(key, event, None)
            self._compiling.seconds = self.compile_seconds() + time.perf_counter() - started
        for key in others:   # built by another thread meanwhile: waited for
            if stop is not None and stop.is_set():
                break
            finished(key, self._try_build(key))

    def _try_build(self, key: tuple) -> Exception | None:
        """``build`` of one request; its error returned, not raised. Any exception counts (a driver may fail
        otherwise than with a build log when builds run at once), reported as a BuildError; only a BuildError
        is kept for ``build`` to raise again: another exception (pyopencl's cache lock, a missing file) is no
        verdict on the kernel, and a later ``build`` tries again and raises it as it is."""
        try:
            self.build(key[0], dict(key[1]), key[2])
        except BuildError as error:
            return error
        except Exception as error:   # noqa: BLE001 - reported as the request's failure, with what raised it
            return BuildError(key[0], dict(key[1]), f"{type(error).__name__}: {error}", self.caps.name)
        return None

    def build_workers(self, workers: int | None = None) -> int:
        """How many builds ``build_many`` runs at once (threads, or worker processes: ``builds_in_processes``):
        ``workers`` where given, else PERFX_BUILD_WORKERS, else the CPU count (at most 8); 1 once this device's
        driver failed under concurrent builds."""
        if self._serial_reason is not None:
            return 1
        if workers is None:
            setting = os.environ.get(BUILD_WORKERS_ENV, "").strip()
            if setting:
                try:
                    workers = int(setting)
                except ValueError:
                    raise PerfxError(f"{BUILD_WORKERS_ENV}={setting!r}: give a whole number of builds to run "
                                     "at once (1: one at a time)") from None
            else:
                workers = min(os.cpu_count() or 1, MAX_BUILD_WORKERS)
        return max(1, int(workers))

    def build_counts(self) -> dict:
        """The programs this device holds: how many, how many pyopencl took from its binary cache, and how many it
        compiled; on a driver whose own cache pyopencl leaves the builds to (PoCL) it cannot tell, and
        ``compiled`` is None."""
        with self._build_lock:
            programs = list(self._programs.items())
        infos = [("a build worker's binary", self._worker_cached[key]) if key in self._worker_cached
                 else getattr(program, "_build_duration_info", None) for key, program in programs]
        known = [info for info in infos if info is not None and "assuming cached by ICD" not in info[0]]
        cached = sum(1 for info in known if info[1])
        return {"programs": len(programs), "from_cache": cached,
                "compiled": len(known) - cached if len(known) == len(programs) else None}

    @property
    def serial_reason(self) -> str | None:
        """Why this device builds one kernel at a time (its driver failed under concurrent builds), or None."""
        return self._serial_reason

    @contextlib.contextmanager
    def collecting(self):
        """Record the builds asked for inside the block instead of making them: yields the list of
        ``(file, defines, newest_c)`` keys (``build_many`` takes them). ``build`` returns a stand-in and
        ``kernel`` one that only names itself, so wrappers can be made to learn which kernels they build;
        nothing made inside the block may be launched. Only the calling thread's requests are recorded: builds
        other threads make meanwhile (``build_many``'s, ahead of a sweep) go on."""
        requests: list[tuple] = []
        outer, self._collect.requests = self._collecting, requests
        try:
            yield requests
        finally:
            self._collect.requests = outer

    @property
    def _collecting(self) -> list | None:
        return getattr(self._collect, "requests", None)

    def kernel(self, file: str, name: str, defines: dict | None = None, newest_c: bool = False,
               reads: tuple[str, ...] | None = None) -> cl.Kernel:
        """A ``Kernel`` object, created once per (file, defines, name): each ``program.name`` makes a new one
        (``newest_c``: see ``build``).

        ``reads``: where the kernel's code reads only these of the program's defines (a helper built beside the
        program's main kernel, as the quantizing of X beside an int8 product), a kernel of that name this device
        made already from a program of ``file`` whose defines agree on those (and ``newest_c``) is returned
        instead: its code is the same in every such program, and a driver compiles a kernel's machine code per
        program (PoCL at its first launch), so the wrappers, checks and candidates that share it compile it once.

        A kernel whose required work-group (``reqd_work_group_size``) or local memory exceeds what the driver
        reports it can run raises KernelLimitError here: those parameters cannot run on this driver.
        """
        if self._collecting is not None:
            return _PendingKernel(self.build(file, defines, newest_c), name)
        shared = None
        if reads is not None:
            shared = (file, name, newest_c, tuple((read, (defines or {}).get(read)) for read in sorted(reads)))
            kernel = self._shared_kernels.get(shared)
            if kernel is not None:
                return kernel
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
        if shared is not None:
            self._shared_kernels[shared] = kernel
        return kernel

    @property
    def programs_kept(self) -> int:
        """How many built programs this device keeps (``build``), each holding its machine code."""
        return len(self._programs)

    @property
    def program_keys(self) -> frozenset:
        """The ``(file, defines, newest_c)`` keys of the programs this device keeps (``build_many`` takes them):
        what a caller compares with the builds it asked for, to see which were made one at a time."""
        with self._build_lock:
            return frozenset(self._programs)

    def forget_programs(self) -> None:
        """Drop the built programs and ``Kernel`` objects this device keeps (``build``, ``kernel``): their memory
        goes once nothing else holds them, and a later build of the same kernel comes from pyopencl's binary
        cache. For runs over many parameter sets each used for a while and then never again (`perfx selftest`
        calls it after each family, and where many are kept); kernels held elsewhere (a model's wrappers,
        recorded steps) stay valid."""
        self._programs.clear()
        self._worker_cached.clear()
        self._kernels.clear()
        self._shared_kernels.clear()
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

    @contextlib.contextmanager
    def profiling(self):
        """Run the block's launches and copies on a queue that records profiling events (yielded, and
        ``self.queue`` meanwhile), for timing with them; the work queued before waits done first, the block's
        done when it ends, so each queue sees the other's results. Inside it, enqueue through the device (its
        ``launch``, copies and ``queue``), not through a pyopencl Array's own queue, which stays the lean one.
        Nests."""
        if self._profiling_depth == 0:
            if self._profiling_queue is None:
                try:
                    self._profiling_queue = cl.CommandQueue(
                        self.context, properties=cl.command_queue_properties.PROFILING_ENABLE)
                except cl.Error as e:
                    raise_as_perfx(f"creating a profiling queue on {self.caps.name}", e)
                Device._of_queue[self._profiling_queue.int_ptr] = self
            self._lean_queue.finish()
            self.queue = self._profiling_queue
        self._profiling_depth += 1
        try:
            yield self.queue
        finally:
            self._profiling_depth -= 1
            if self._profiling_depth == 0:
                self._profiling_queue.finish()
                self.queue = self._lean_queue

    @classmethod
    def of_events(cls, events) -> Device | None:
        """The Device whose queue (lean or profiling) the first of ``events`` that has one ran on, else None."""
        for event in events or ():
            if event is not None:
                device = cls._of_queue.get(event.get_info(cl.event_info.COMMAND_QUEUE).int_ptr)
                if device is not None:
                    return device
        return None

    @staticmethod
    def event_seconds(event) -> float:
        """Seconds from a finished event's start to its end, from its profiling events."""
        try:
            return (event.profile.end - event.profile.start) * 1e-9
        except cl.Error as e:
            raise PerfxError("these launches ran on a queue without profiling events: time them inside "
                             "`with device.profiling():` (perfx.timing.time_launches does so itself)") from e

    def replay(self, steps: list) -> CommandBuffer | QcomRecording | Sequence:
        """Recorded steps as one step to enqueue again and again: one enqueue a launch, or, where asked for
        (PERFX_REPLAY, perfx.runtime.replay.asked_replay) and the driver has it, one command buffer
        (``cl_khr_command_buffer``) or one recording (``cl_qcom_recordable_queues``); ``replay_mode`` says which,
        and why."""
        return self.replay_choice.replay(self.cl_device, self.queue, steps)

    @property
    def replay_mode(self) -> str:
        """How a recorded decode step is enqueued on this device."""
        return self.replay_choice.mode

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

    def read_later(self, host: np.ndarray, src, src_offset: int = 0) -> cl.Event:
        """``read`` without waiting: the copy runs in queue order and ``host`` holds the bytes once the returned
        event completes (``event.wait()``); ``host`` must stay alive until then."""
        if not (host.flags.c_contiguous and host.flags.writeable):
            raise PerfxError("read_later: the host array must be C-contiguous and writeable (np.empty makes one)")
        buffer, _ = _region(src, src_offset, host.nbytes, "read")
        try:
            return cl.enqueue_copy(self.queue, host, buffer, src_offset=src_offset, is_blocking=False)
        except cl.Error as e:
            raise_as_perfx(f"reading {host.nbytes} bytes from the device", e)

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
        """Count ``nbytes`` for ``obj`` until it is freed: ``allocated_bytes`` falls in the thread that drops the
        last reference to it, or, for an object in a reference cycle (a Model and its layers are one), in the
        collection that frees it, whichever thread starts that. So a count is exact once ``gc.collect()`` has run
        and no other thread holds what was dropped: an owner's stop joins its threads (``Server.stop``)."""
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
        return cla.empty(self._lean_queue, shape, np.dtype(dtype), allocator=self._allocator)

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

