"""Adreno's recordable queues (``cl_qcom_recordable_queues``) as a replay of the decode step, against a fake
driver (tests/helpers/fake_qcom.py): the calls, their order and arguments; each call's error; the choice of
replay (only where asked for with PERFX_REPLAY=qcom and the driver has the extension); what `perfx info` says.
No phone has run this path: docs/phones.md says how one checks it (`perfx report`)."""

import gc
import json
import types

import numpy as np
import pytest

from helpers.fake_qcom import RECORDABLE_QUEUE, FakeQcomDriver
from perfx import cli
from perfx.commands import report
from perfx.errors import PerfxError
from perfx.runtime import Device, OpenCLError
from perfx.runtime import replay as replay_module
from perfx.runtime.replay import (QUEUE_RECORDABLE_QCOM, CommandBuffer, QcomRecording, Sequence, qcom_unavailable,
                                  unavailable)

N = 256


def chain(device):
    """a → b (kernel) → c (copy, at byte offsets) → d (kernel), recorded: (buffers, kernel, steps)."""
    a, b, c, d = (device.alloc(4 * N) for _ in range(4))
    kernel = device.kernel("copy.cl", "copy_vectors", {"VWC": 4})
    with device.record() as steps:
        device.launch(kernel, (16,), (16,), np.int32(N // 4), a, b)
        device.copy(c, b, 4 * (N - 8), src_offset=4 * 8, dst_offset=0)
        device.launch(kernel, (16,), (16,), np.int32(N // 4), c, d)
    return (a, b, c, d), kernel, steps


def check_runs(device, replay, buffers, rng):
    """Each replay on fresh contents of a: d shows this replay's a, so every step ran, in order."""
    a, _, _, d = buffers
    for _ in range(2):
        x = rng.standard_normal(N).astype(np.float32)
        device.write(a, x)
        device.fill(d, np.float32(np.nan))
        replay.enqueue(device.queue)
        replay.enqueue(device.queue)   # again while the first may still be pending
        seen = device.read(np.empty(N, np.float32), d)
        assert np.array_equal(seen[:N - 8], x[8:])


@pytest.fixture
def fresh(device):
    """A Device made the way ``perfx`` makes one, after the test has set PERFX_REPLAY and the fake driver."""
    return lambda: Device(device.entry.index)


@pytest.fixture
def clean_caches():
    yield
    replay_module._qcom_functions.cache_clear()


def test_a_step_is_recorded_once_on_a_recordable_queue_and_enqueued_per_replay(fresh, monkeypatch, rng):
    driver = FakeQcomDriver().install(monkeypatch)
    monkeypatch.setenv("PERFX_REPLAY", "qcom")
    device = fresh()
    buffers, kernel, steps = chain(device)
    assert device.replay_mode == "one recording a step (cl_qcom_recordable_queues, PERFX_REPLAY=qcom)"
    replay = device.replay(steps)
    assert isinstance(replay, QcomRecording)
    a, b, c, d = (x.int_ptr for x in buffers)
    first, last = steps[0].kernel.int_ptr, steps[2].kernel.int_ptr
    assert first != last   # each launch has its own Kernel, its arguments bound once
    recording = replay.recordings[0]
    assert driver.calls == [
        ("clCreateCommandQueue", (device.context.int_ptr, device.cl_device.int_ptr, QUEUE_RECORDABLE_QCOM,
                                  "errcode*")),
        ("clNewRecordingQCOM", (RECORDABLE_QUEUE, "errcode*")),
        ("clEnqueueNDRangeKernel", (RECORDABLE_QUEUE, first, 1, None, (16,), (16,), 0, None, None)),
        ("clEnqueueCopyBuffer", (RECORDABLE_QUEUE, b, c, 32, 0, 4 * (N - 8), 0, None, None)),
        ("clEnqueueNDRangeKernel", (RECORDABLE_QUEUE, last, 1, None, (16,), (16,), 0, None, None)),
        ("clEndRecordingQCOM", (recording,)),
    ]
    assert QUEUE_RECORDABLE_QCOM == 0x40000000 and replay.recordings == [recording]
    del driver.calls[:]
    check_runs(device, replay, buffers, rng)
    # one clEnqueueRecordingQCOM a replay, on perfx's queue, updating nothing, with no wait list and no event
    enqueue = ("clEnqueueRecordingQCOM", (device.queue.int_ptr, recording, 0, None, 0, None, 0, None, 0, None, 0,
                                          None, None))
    assert driver.calls == [enqueue] * 4
    del driver.calls[:]
    del replay
    gc.collect()
    assert driver.calls == [("clReleaseRecordingQCOM", (recording,)), ("clReleaseCommandQueue", (RECORDABLE_QUEUE,))]


def test_a_step_longer_than_a_recording_holds_is_recorded_in_several(fresh, monkeypatch, rng):
    driver = FakeQcomDriver(max_size=2).install(monkeypatch)
    monkeypatch.setenv("PERFX_REPLAY", "qcom")
    device = fresh()
    buffers, _, steps = chain(device)
    assert device.replay_mode.endswith("PERFX_REPLAY=qcom; at most 2 commands a recording)")
    replay = device.replay(steps)
    first, second = replay.recordings
    assert driver.names() == ["clCreateCommandQueue", "clNewRecordingQCOM", "clEnqueueNDRangeKernel",
                              "clEnqueueCopyBuffer", "clEndRecordingQCOM", "clNewRecordingQCOM",
                              "clEnqueueNDRangeKernel", "clEndRecordingQCOM"]
    assert [len(driver.recorded[r]) for r in (first, second)] == [2, 1]
    del driver.calls[:]
    check_runs(device, replay, buffers, rng)
    assert [args[1] for _, args in driver.calls] == [first, second] * 4
    del driver.calls[:]
    del replay
    gc.collect()
    assert driver.calls == [("clReleaseRecordingQCOM", (first,)), ("clReleaseRecordingQCOM", (second,)),
                            ("clReleaseCommandQueue", (RECORDABLE_QUEUE,))]


@pytest.mark.parametrize("call", ["clCreateCommandQueue", "clNewRecordingQCOM", "clEnqueueNDRangeKernel",
                                  "clEnqueueCopyBuffer", "clEndRecordingQCOM"])
def test_an_error_while_recording_names_the_call_and_the_constant_and_releases_what_was_made(fresh, monkeypatch,
                                                                                          call):
    driver = FakeQcomDriver(fail=call).install(monkeypatch)
    monkeypatch.setenv("PERFX_REPLAY", "qcom")
    device = fresh()
    _, _, steps = chain(device)
    with pytest.raises(OpenCLError, match=f"OpenCL error -30: CL_INVALID_VALUE in {call}") as caught:
        QcomRecording(device.cl_device, device.queue, steps)
    assert isinstance(caught.value, PerfxError) and caught.value.name == "CL_INVALID_VALUE"
    released = [args[0] for name, args in driver.calls if name == "clReleaseRecordingQCOM"]
    assert released == list(driver.recorded)   # every recording made, none when clNewRecordingQCOM failed
    made_queue = call != "clCreateCommandQueue"
    assert (("clReleaseCommandQueue", (RECORDABLE_QUEUE,)) in driver.calls) == made_queue
    # The device turns to launches one by one, saying why, from then on.
    replay = device.replay(steps)
    assert isinstance(replay, Sequence)
    assert device.replay_mode.startswith(f"one enqueue a launch: the driver refused a recording (OpenCL error -30: "
                                         f"CL_INVALID_VALUE in {call}")
    assert isinstance(device.replay(steps), Sequence)


def test_an_error_enqueueing_a_recording_names_the_call_and_the_constant(fresh, monkeypatch):
    FakeQcomDriver(fail="clEnqueueRecordingQCOM", code=-36).install(monkeypatch)
    monkeypatch.setenv("PERFX_REPLAY", "qcom")
    device = fresh()
    _, _, steps = chain(device)
    replay = device.replay(steps)
    with pytest.raises(OpenCLError, match="OpenCL error -36: CL_INVALID_COMMAND_QUEUE in clEnqueueRecordingQCOM "
                                          "replaying a step of 3 commands"):
        replay.enqueue(device.queue)


def test_a_recording_holds_launches_and_copies_only(fresh, monkeypatch):
    driver = FakeQcomDriver().install(monkeypatch)
    device = fresh()
    with pytest.raises(PerfxError, match="a recording holds launches and copies, not str"):
        QcomRecording(device.cl_device, device.queue, ["a host callback"])
    assert driver.names() == ["clCreateCommandQueue", "clNewRecordingQCOM", "clReleaseRecordingQCOM",
                              "clReleaseCommandQueue"]


class _Lookup:
    """clGetExtensionFunctionAddressForPlatform of a driver that gives every function but ``missing``."""

    def __init__(self, missing):
        self.missing = missing

    def __call__(self, platform, name):
        return 0 if name.decode() == self.missing else 0x1000


class _Loader:
    """The ICD loader with a driver behind it that lists the extension and gives every function but
    ``missing``; the core calls are the real loader's."""

    def __init__(self, missing, real):
        self.clGetExtensionFunctionAddressForPlatform = _Lookup(missing)
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.mark.parametrize("missing", ["clNewRecordingQCOM", "clEndRecordingQCOM", "clReleaseRecordingQCOM",
                                     "clEnqueueRecordingQCOM"])
def test_a_driver_that_lists_the_extension_and_lacks_a_function(fresh, monkeypatch, clean_caches, missing):
    listing = types.SimpleNamespace(extensions="cl_khr_fp16 cl_qcom_recordable_queues",
                                    platform=types.SimpleNamespace(int_ptr=0x1234), int_ptr=0x5678)
    real = replay_module._loader()
    replay_module._qcom_functions.cache_clear()
    monkeypatch.setattr(replay_module, "_loader", lambda: _Loader(missing, real))
    assert qcom_unavailable(listing) == f"the driver lists cl_qcom_recordable_queues but gives no {missing}"
    replay_module._qcom_functions.cache_clear()
    monkeypatch.setattr(replay_module, "_loader", lambda: _Loader(None, real))
    assert qcom_unavailable(listing) is None
    assert qcom_unavailable(types.SimpleNamespace(extensions="cl_khr_fp16")) == \
        "the driver has no cl_qcom_recordable_queues"
    # A device asked for it falls back to launches one by one, saying why.
    replay_module._qcom_functions.cache_clear()
    monkeypatch.setattr(replay_module, "_loader", lambda: _Loader(missing, real))
    monkeypatch.setattr(replay_module, "_extensions",
                        lambda device: device.extensions.split() + ["cl_qcom_recordable_queues"])
    monkeypatch.setenv("PERFX_REPLAY", "qcom")
    device = fresh()
    assert device.replay_mode == f"one enqueue a launch: the driver lists cl_qcom_recordable_queues but gives no " \
                                 f"{missing}"


def test_without_the_extension_or_without_asking_the_replay_is_the_existing_one(fresh, monkeypatch):
    # The extension listed, nothing asked for: launches one by one, and perfx info says how to ask.
    driver = FakeQcomDriver().install(monkeypatch)
    monkeypatch.delenv("PERFX_REPLAY", raising=False)
    monkeypatch.delenv("PERFX_COMMAND_BUFFER", raising=False)
    device = fresh()
    assert isinstance(device.replay(chain(device)[2]), Sequence)
    assert "cl_qcom_recordable_queues, used only with PERFX_REPLAY=qcom" in device.replay_mode
    assert device.replay_choice.as_dict()["kind"] == "sequence"
    # PERFX_COMMAND_BUFFER=on still asks for a command buffer, where the driver has one.
    monkeypatch.setenv("PERFX_COMMAND_BUFFER", "on")
    device = fresh()
    expected = CommandBuffer if unavailable(device.cl_device, device.queue.properties) is None else Sequence
    assert isinstance(device.replay(chain(device)[2]), expected)
    # PERFX_REPLAY wins over it.
    monkeypatch.setenv("PERFX_REPLAY", "sequence")
    device = fresh()
    assert isinstance(device.replay(chain(device)[2]), Sequence)
    assert device.replay_mode == "one enqueue a launch: asked for (PERFX_REPLAY=sequence)"
    monkeypatch.setenv("PERFX_REPLAY", "command-buffer")
    device = fresh()
    assert isinstance(device.replay(chain(device)[2]), expected)
    assert driver.calls == []
    monkeypatch.setenv("PERFX_REPLAY", "recordable")
    with pytest.raises(PerfxError, match="PERFX_REPLAY='recordable': it takes sequence, command-buffer, qcom"):
        fresh()
    # Asked for, on a driver without the extension (this machine's).
    monkeypatch.undo()
    monkeypatch.setenv("PERFX_REPLAY", "qcom")
    device = fresh()
    assert qcom_unavailable(device.cl_device) == "the driver has no cl_qcom_recordable_queues"
    assert isinstance(device.replay(chain(device)[2]), Sequence)
    assert device.replay_mode == "one enqueue a launch: the driver has no cl_qcom_recordable_queues"


def test_perfx_info_says_which_replay_the_device_uses(device, monkeypatch, capsys):
    FakeQcomDriver().install(monkeypatch)
    monkeypatch.setenv("PERFX_REPLAY", "qcom")
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["decode_step"] == "one recording a step (cl_qcom_recordable_queues, PERFX_REPLAY=qcom)"
    assert data["replay"] == {"kind": "qcom", "asked": "qcom", "why": None, "mode": data["decode_step"]}
    assert cli.main(["info"]) == 0
    assert "decode step: one recording a step (cl_qcom_recordable_queues, PERFX_REPLAY=qcom)" in \
        capsys.readouterr().out
    monkeypatch.delenv("PERFX_REPLAY")
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["replay"]["kind"] == "sequence" and "PERFX_REPLAY=qcom" in data["decode_step"]


def test_perfx_report_compares_a_recording_with_launches_one_by_one(device, monkeypatch):
    """`perfx report`'s replay section: the model's greedy tokens with an Adreno recording (the fake driver's)
    are those of launches one by one, and each has its decode tok/s."""
    driver = FakeQcomDriver().install(monkeypatch)
    result = report.compare_replays(device.entry.index, "synthetic:tiny", tuning=False, decode_tokens=8, rounds=1)
    qcom, sequence = result["replays"]["qcom"], result["replays"]["sequence"]
    assert qcom["available"] and qcom["same_tokens"] and qcom["first_difference"] is None
    assert qcom["mode"] == "one recording a step (cl_qcom_recordable_queues, PERFX_REPLAY=qcom)"
    assert qcom["decode_tok_s"] > 0 and sequence["decode_tok_s"] > 0
    assert "clEnqueueRecordingQCOM" in driver.names()
