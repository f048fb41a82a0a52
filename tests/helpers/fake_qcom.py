"""A fake driver of Adreno's ``cl_qcom_recordable_queues``, for a machine without a phone.

Each call ``QcomRecording`` makes is logged with its arguments (ctypes arrays as tuples, an errcode pointer as
"errcode*"). What is enqueued on the recordable queue between ``clNewRecordingQCOM`` and ``clEndRecordingQCOM``
is kept, by value, and not run; ``clEnqueueRecordingQCOM`` runs it on the queue it names, through the real
OpenCL library, so what a recording computes is checked against the same launches one by one. ``fail``
names a call that returns ``code`` instead (through its errcode pointer where it has one).
"""

from __future__ import annotations

import ctypes
import itertools

from perfx.runtime import replay

RECORDABLE_QUEUE = 0x5A5A0   # the handle of the recordable queue the fake makes


def _value(arg):
    if arg is None or isinstance(arg, int):
        return arg
    if isinstance(arg, ctypes.Array):
        return tuple(arg)
    if type(arg).__name__ == "CArgObject":   # ctypes.byref(...)
        return "errcode*"
    return arg


class FakeQcomDriver:
    def __init__(self, fail: str | None = None, code: int = -30, max_size: int | None = None):
        self.fail, self.code, self.max_size = fail, code, max_size
        self.calls: list[tuple] = []
        self.recorded: dict[int, list] = {}
        self._open: int | None = None
        self._handles = itertools.count(0x7000)
        self._real = dict(replay._enqueue_functions())   # the real library, before anything is faked

    def install(self, monkeypatch) -> "FakeQcomDriver":
        """The extension listed by the device and its calls answered by this driver (``PERFX_REPLAY=qcom`` still
        asks for it)."""
        monkeypatch.setattr(replay, "_extensions", lambda device: device.extensions.split() + [replay.QCOM_EXTENSION])
        monkeypatch.setattr(replay, "_qcom_functions", lambda platform_ptr: self.functions())
        monkeypatch.setattr(replay, "recordable_queue_max_size", lambda device: self.max_size)
        return self

    def functions(self) -> dict:
        return {name: (lambda *args, name=name: self._call(name, args)) for name in (
            "clCreateCommandQueue", "clReleaseCommandQueue", "clNewRecordingQCOM", "clEndRecordingQCOM",
            "clReleaseRecordingQCOM", "clEnqueueRecordingQCOM", "clEnqueueNDRangeKernel", "clEnqueueCopyBuffer")}

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def _call(self, name: str, args: tuple):
        self.calls.append((name, tuple(_value(a) for a in args)))
        failing = name == self.fail
        if name in ("clCreateCommandQueue", "clNewRecordingQCOM"):
            errcode = args[-1]._obj
            errcode.value = self.code if failing else 0
            if failing:
                return None
            if name == "clCreateCommandQueue":
                return RECORDABLE_QUEUE
            handle = self._open = next(self._handles)
            self.recorded[handle] = []
            return handle
        if failing:
            return self.code
        if name in ("clEnqueueNDRangeKernel", "clEnqueueCopyBuffer"):
            assert args[0] == RECORDABLE_QUEUE and self._open is not None, "enqueued outside a recording"
            self.recorded[self._open].append((name, tuple(_value(a) for a in args[1:])))
        elif name == "clEndRecordingQCOM":
            self._open = None
        elif name == "clEnqueueRecordingQCOM":
            queue, recording = args[0], args[1]
            for call, recorded in self.recorded[recording]:
                self._run(call, queue, recorded)
        return 0

    def _run(self, call: str, queue: int, args: tuple) -> None:
        if call == "clEnqueueNDRangeKernel":
            kernel, dims, offset, global_size, local_size = args[:5]
            local = (ctypes.c_size_t * dims)(*local_size) if local_size else None
            status = self._real[call](queue, kernel, dims, offset, (ctypes.c_size_t * dims)(*global_size), local,
                                      0, None, None)
        else:
            status = self._real[call](queue, *args[:5], 0, None, None)
        assert status == 0, (call, status)
