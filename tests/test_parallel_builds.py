"""Kernels built many at once (``Device.build_many``), on threads and in worker processes: the same kernels as one
at a time, on each implementation; each program once however many threads ask; a build's failure reported with its
log; a driver that fails under concurrent builds (a fake, or a worker process that dies) falls back to one at a
time, once, and says so; PERFX_BUILD_WORKERS, PERFX_BUILD_PROCESSES; ``collecting``; and `perfx warm`."""

import json
import os
import sys
import threading
import time

import numpy as np
import pytest

from helpers.spec_checks import parameter_sets
from perfx import cli
from perfx.errors import PerfxError
from perfx.ops.rmsnorm import RMSNorm
from perfx.runtime import (BUILD_PROCESSES_ENV, BUILD_WORKERS_ENV, BuildConcurrencyWarning, BuildError, Device,
                           build_key, shutdown_build_workers)
from perfx.runtime import device as device_module
from perfx.tuning.rmsnorm import SPEC

SETS = 6   # parameter sets of one family, each a program of its own


def _outputs(device, shape, sets, seed=7):
    case = SPEC.make_case(device, shape, np.random.default_rng(seed))
    return [case.run(params) for params in sets]


@pytest.fixture
def threads(monkeypatch):
    """Builds at once on threads of this process, whatever the implementation."""
    monkeypatch.setenv(BUILD_PROCESSES_ENV, "0")


@pytest.mark.parametrize("processes", ["0", "1"], ids=["threads", "processes"])
def test_concurrent_builds_run_as_serial_ones(device, tmp_path, monkeypatch, processes):
    # pyopencl's binary cache and PoCL's emptied, so that each program is compiled here or in the workers
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("POCL_CACHE_DIR", str(tmp_path / "pocl"))
    monkeypatch.setenv(BUILD_PROCESSES_ENV, processes)
    shutdown_build_workers()   # workers started now, into these caches
    shape = SPEC.test_shapes[0]
    sets = parameter_sets(SPEC, shape, device.caps)[:SETS]
    serial = Device(device.entry.index)
    want = _outputs(serial, shape, sets)
    keys = list(serial._programs)
    assert len(keys) >= 2

    parallel = Device(device.entry.index)
    report = parallel.build_many(keys, workers=4)
    assert report.errors == {} and len(report.built) == len(keys) and report.workers >= 2
    assert report.processes == (processes == "1") and report.serial_reason is None
    if processes == "1" and sys.platform.startswith("linux"):   # each worker's peak, as selftest --json gives it
        assert 2**20 < device_module.build_workers_peak_bytes() < 4 * 2**30
    compiled = parallel.compile_seconds()
    got = _outputs(parallel, shape, sets)
    assert parallel.compile_seconds() == compiled, "running them built nothing more"
    assert set(parallel._programs) == set(keys)   # running them built nothing more
    for a, b in zip(want, got):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
    # built already: a second call builds none
    again = parallel.build_many(keys, workers=4)
    assert again.built == [] and again.requested == len(keys)


def _keys(device, count=SETS):
    shape = SPEC.test_shapes[0]
    with device.collecting() as requests:
        for params in parameter_sets(SPEC, shape, device.caps)[:count]:
            RMSNorm(device, params)
    return list(dict.fromkeys(requests))


@pytest.mark.one_implementation
def test_collecting_builds_nothing(device):
    fresh = Device(device.entry.index)
    keys = _keys(fresh)
    assert keys and fresh._programs == {}
    assert all(key == build_key(*key) for key in keys)


@pytest.mark.one_implementation
def test_each_program_is_built_once_whatever_asks(device, monkeypatch, threads):
    fresh = Device(device.entry.index)
    keys = _keys(fresh, 2)
    compiled = []
    real = fresh._compile

    def counting(key):
        compiled.append(key)
        time.sleep(0.05)
        return real(key)
    monkeypatch.setattr(fresh, "_compile", counting)
    threads = [threading.Thread(target=fresh.build, args=(keys[0][0], dict(keys[0][1]), keys[0][2]))
               for _ in range(4)]
    for t in threads:
        t.start()
    report = fresh.build_many(keys + keys, workers=3)
    for t in threads:
        t.join()
    assert sorted(compiled) == sorted(keys)
    assert report.requested == len(keys)


@pytest.mark.one_implementation
def test_a_failed_build_is_reported_with_its_log_and_not_retried(device):
    fresh = Device(device.entry.index)
    good = _keys(fresh, 2)
    bad = build_key("rmsnorm.cl", {**dict(good[0][1]), "WGS": "not_a_number"})
    report = fresh.build_many(good + [bad], workers=2)
    assert set(report.errors) == {bad}
    error = report.errors[bad]
    assert isinstance(error, BuildError) and "not_a_number" in str(error) and error.log
    assert report.serial_reason is None and fresh.build_workers(2) == 2   # a real failure is no concurrency's
    with pytest.raises(BuildError) as again:
        fresh.build(bad[0], dict(bad[1]))
    assert again.value is error
    assert all(key in fresh._programs for key in good)


@pytest.mark.one_implementation
def test_a_driver_failing_concurrent_builds_falls_back_to_one_at_a_time(device, monkeypatch, threads):
    fresh = Device(device.entry.index)
    keys = _keys(fresh, 4)
    real = fresh._compile
    active, lock, failed = [0], threading.Lock(), []

    def fragile(key):   # as a driver that does not bear two builds at once
        with lock:
            active[0] += 1
            crowded = active[0] > 1
        try:
            time.sleep(0.1)
            if crowded:
                failed.append(key)
                raise BuildError(key[0], dict(key[1]), "CL_OUT_OF_HOST_MEMORY (two builds at once)", "fake")
            return real(key)
        finally:
            with lock:
                active[0] -= 1
    monkeypatch.setattr(fresh, "_compile", fragile)
    with pytest.warns(BuildConcurrencyWarning, match="one kernel at a time") as caught:
        report = fresh.build_many(keys, workers=4)
    assert failed, "the fake driver saw builds at once"
    assert report.errors == {} and all(key in fresh._programs for key in keys)
    assert report.serial_reason and fresh.serial_reason == report.serial_reason
    assert len([w for w in caught if w.category is BuildConcurrencyWarning]) == 1   # said once
    assert fresh.build_workers() == 1 and fresh.build_workers(8) == 1


@pytest.mark.one_implementation
def test_perfx_build_workers_setting(device, monkeypatch):
    fresh = Device(device.entry.index)
    monkeypatch.setenv(BUILD_WORKERS_ENV, "1")
    assert fresh.build_workers() == 1
    keys = _keys(fresh, 3)
    names = []
    real = fresh._compile
    monkeypatch.setattr(fresh, "_compile", lambda key: (names.append(threading.current_thread().name), real(key))[1])
    report = fresh.build_many(keys)
    assert report.workers == 1 and set(names) == {threading.current_thread().name}
    monkeypatch.setenv(BUILD_WORKERS_ENV, "3")
    assert fresh.build_workers() == 3 and fresh.build_workers(2) == 2
    monkeypatch.setenv(BUILD_WORKERS_ENV, "many")
    with pytest.raises(PerfxError, match=BUILD_WORKERS_ENV):
        fresh.build_workers()
    monkeypatch.delenv(BUILD_WORKERS_ENV)
    assert 1 <= fresh.build_workers() <= 8


@pytest.mark.one_implementation
def test_perfx_warm_builds_a_models_kernels_then_finds_them_cached(device, capsys):
    def warm():
        code = cli.main(["warm", "--model", "synthetic:tiny", "--json"])
        out, _ = capsys.readouterr()
        assert code == 0
        return json.loads(out)
    first = warm()
    assert first["kernels"] > 0 and first["plan"]["requested"] > 0 and first["plan"]["failed"] == 0
    second = warm()
    assert second["kernels"] == first["kernels"]
    if second["compiled"] is not None:   # pyopencl knows what came from its cache (not on PoCL)
        assert second["compiled"] == 0 and second["from_cache"] == second["kernels"]


@pytest.mark.one_implementation
def test_another_exception_is_reported_but_not_kept(device, monkeypatch):
    fresh = Device(device.entry.index)
    keys = _keys(fresh, 2)
    real = fresh._compile

    def locked_out(key):   # pyopencl's cache lock held too long by another process, say
        raise RuntimeError("waited more than one minute on the lock file")
    monkeypatch.setattr(fresh, "_compile", locked_out)
    report = fresh.build_many(keys[:1], workers=1)
    assert "RuntimeError" in report.errors[keys[0]].log
    monkeypatch.setattr(fresh, "_compile", real)
    assert fresh.build(keys[0][0], dict(keys[0][1]), keys[0][2]) is fresh._programs[keys[0]]


def _fresh_keys(device, count):
    """``count`` programs of ``device``'s implementation that no cache holds: defines no other test builds."""
    keys = _keys(device, count)
    return [build_key(k[0], {**dict(k[1]), "PERFX_TEST_NONCE": str(time.time_ns() + i)}, k[2])
            for i, k in enumerate(keys)]


@pytest.mark.one_implementation
def test_a_driver_failing_builds_in_worker_processes_falls_back_to_one_at_a_time(device, monkeypatch):
    """A driver whose builds fail while others run, in the workers (a fake: every worker's answer is a failure), is
    built alone here, falls back to one at a time, and says so once."""
    monkeypatch.setenv(BUILD_PROCESSES_ENV, "1")
    fresh = Device(device.entry.index)
    keys = _keys(fresh, 5)
    asked = []

    def refusing(todo, workers, stop=None):
        for key in todo:
            asked.append(key)
            yield key, "CL_OUT_OF_HOST_MEMORY (two builds at once)"   # a build's log
    monkeypatch.setattr(fresh, "_remote_compile", refusing)
    with pytest.warns(BuildConcurrencyWarning, match="one kernel at a time") as caught:
        report = fresh.build_many(keys, workers=2)
    assert sorted(asked) == sorted(keys) and report.processes
    assert report.errors == {} and all(key in fresh._programs for key in keys)
    assert "CL_OUT_OF_HOST_MEMORY" in report.serial_reason and fresh.serial_reason == report.serial_reason
    assert len([w for w in caught if w.category is BuildConcurrencyWarning]) == 1
    assert fresh.build_workers(8) == 1 and not fresh.build_many(_keys(fresh, 6), workers=4).processes


@pytest.mark.one_implementation
def test_a_build_worker_that_dies_is_reported_and_the_device_builds_alone(device, monkeypatch):
    """A real worker process killed while it builds (as a driver that crashes under concurrent builds): its program
    is built here alone, the device falls back to one at a time and says so; the next device starts new workers."""
    monkeypatch.setenv(BUILD_PROCESSES_ENV, "1")
    shutdown_build_workers()
    fresh = Device(device.entry.index)
    keys = _fresh_keys(fresh, 4)
    dead = device_module._workers_for(fresh, 2)[0]
    dead.process.kill()
    dead.process.wait()
    started = device_module._workers_for   # the dead one among those handed out, as if it died just after
    monkeypatch.setattr(device_module, "_workers_for", lambda device, count: [dead] + started(device, count)[1:])
    with pytest.warns(BuildConcurrencyWarning, match="build worker process died"):
        report = fresh.build_many(keys, workers=2)
    assert report.errors == {} and all(key in fresh._programs for key in keys)
    assert "died" in fresh.serial_reason
    monkeypatch.setattr(device_module, "_workers_for", started)
    other = Device(device.entry.index)
    again = other.build_many(_fresh_keys(other, 4), workers=2)
    assert again.processes and again.errors == {} and again.serial_reason is None
    assert all(w.alive for w in device_module._workers_for(other, 2))
    shutdown_build_workers()


def test_build_workers_load_only_the_devices_own_opencl_library_or_else_all(device, monkeypatch, tmp_path):
    """Each build worker maps one of the loader's libraries, the device's (``one_library_environ``); where the one
    chosen does not give the same device (here a library that is none), a worker that loads them all replaces it,
    and the builds are the same."""
    from perfx.runtime.implementations import DEFAULT_VENDORS_FOLDER, read_vendor_folder
    monkeypatch.setenv(BUILD_PROCESSES_ENV, "1")
    monkeypatch.setattr(device_module._Worker, "one_library", True)
    shutdown_build_workers()
    fresh = Device(device.entry.index)
    report = fresh.build_many(_fresh_keys(fresh, 4), workers=2)
    assert report.processes and report.errors == {} and report.serial_reason is None
    folder = os.environ.get("OCL_ICD_VENDORS") or DEFAULT_VENDORS_FOLDER
    if os.path.isdir(folder) and device_module.one_library_environ(device.entry.implementation) is not None:
        libraries = {os.path.basename(os.path.realpath(lib)) for lib in read_vendor_folder(folder).values()}
        for worker in device_module._workers_for(fresh, 2):
            with open(f"/proc/{worker.process.pid}/maps") as maps:
                names = {os.path.basename(line.split()[-1]) for line in maps if "/" in line}
            assert len(names & libraries) == 1, names & libraries
        assert device_module._Worker.one_library
    shutdown_build_workers()
    nothing = tmp_path / "nothing.icd"
    nothing.write_text(str(tmp_path / "libnothing.so") + "\n")
    monkeypatch.setattr(device_module, "one_library_environ", lambda implementation: {"OCL_ICD_VENDORS": str(nothing)})
    other = Device(device.entry.index)
    keys = _fresh_keys(other, 4)
    again = other.build_many(keys, workers=2)
    assert again.processes and again.errors == {} and again.serial_reason is None
    assert all(key in other._programs for key in keys) and not device_module._Worker.one_library
    shutdown_build_workers()


@pytest.mark.one_implementation
def test_perfx_build_processes_setting(device, monkeypatch):
    fresh = Device(device.entry.index)
    monkeypatch.delenv(BUILD_PROCESSES_ENV, raising=False)
    assert fresh.builds_in_processes() == (fresh.entry.implementation in device_module.SERIAL_IN_PROCESS)
    monkeypatch.setenv(BUILD_PROCESSES_ENV, "0")
    assert not fresh.builds_in_processes()
    monkeypatch.setenv(BUILD_PROCESSES_ENV, "1")
    assert fresh.builds_in_processes()
    few = fresh.build_many(_keys(fresh, device_module.MIN_FOR_NEW_PROCESSES - 1), workers=2)
    assert not few.processes or device_module._workers_running(fresh, 2), "too few to wait for workers to start"
    monkeypatch.setenv(BUILD_PROCESSES_ENV, "yes")
    with pytest.raises(PerfxError, match=BUILD_PROCESSES_ENV):
        fresh.builds_in_processes()


@pytest.mark.one_implementation
def test_a_model_load_builds_a_first_prompts_kernels_with_the_decode_steps(device, monkeypatch):
    """The load asks in one ``build_many`` for the decode step's kernels and the prefill kernels of prompts up to
    BUILT_AT_LOAD_M tokens (``kernel_requests``, as `perfx warm` with that many); once a first prompt ran, prompts
    of other lengths up to it build nothing."""
    from perfx.model import BUILT_AT_LOAD_M, kernel_requests, load_model
    from perfx.sources import open_model
    fresh = Device(device.entry.index)
    batches = []
    build_many = fresh.build_many
    monkeypatch.setattr(fresh, "build_many", lambda requests, *a, **k: (batches.append(list(requests)),
                                                                         build_many(requests, *a, **k))[1])
    model, _ = load_model("synthetic:tiny", device=fresh, progress=False)
    decode_only = kernel_requests(open_model("synthetic:tiny"), fresh, max_m=1)
    want = kernel_requests(open_model("synthetic:tiny"), fresh, max_m=BUILT_AT_LOAD_M)
    assert len(batches) == 1 and set(batches[0]) == set(want) and len(want) > len(decode_only)
    rng = np.random.default_rng(3)
    model.prefill(rng.integers(0, model.config.vocab_size, 5).tolist(), 0)
    compiled = fresh.compile_seconds()
    for length in (2, 12, BUILT_AT_LOAD_M - 1, BUILT_AT_LOAD_M):
        model.prefill(rng.integers(0, model.config.vocab_size, length).tolist(), 0)
    assert fresh.compile_seconds() == compiled


@pytest.mark.one_implementation
def test_a_model_load_uploads_its_weights_while_its_kernels_build(device, monkeypatch, threads):
    """The load's builds run on a thread of their own (``Device.build_in_background``) while the weights upload: the
    plan waits only for the kernels it makes (the decode step's), the prompts' GEMMs (made slow here) build on
    meanwhile, and the load returns once every program it asked for is built: a first prompt builds nothing."""
    from perfx.model import BUILT_AT_LOAD_M, Model, kernel_requests, load_model
    from perfx.sources import open_model
    fresh = Device(device.entry.index)
    events = []
    real_compile, real_upload = fresh._compile, Model.upload

    def slow_gemms(key):
        if key[0].startswith("gemm_"):
            time.sleep(0.3)
        program = real_compile(key)
        events.append(("built", time.perf_counter()))
        return program

    def upload(self, *args, **kwargs):
        events.append(("upload", time.perf_counter()))
        return real_upload(self, *args, **kwargs)
    monkeypatch.setattr(fresh, "_compile", slow_gemms)
    monkeypatch.setattr(Model, "upload", upload)
    model, _ = load_model("synthetic:tiny", device=fresh, progress=False)
    first_upload = min(t for what, t in events if what == "upload")
    assert first_upload < max(t for what, t in events if what == "built"), "the upload waited for every build"
    want = set(kernel_requests(open_model("synthetic:tiny"), fresh, max_m=BUILT_AT_LOAD_M))
    assert want <= fresh.program_keys
    held = fresh.program_keys
    model.prefill(np.random.default_rng(3).integers(0, model.config.vocab_size, 9).tolist(), 0)
    assert fresh.program_keys == held and np.isfinite(model.logits()).all()


@pytest.mark.one_implementation
@pytest.mark.parametrize("processes", ["0", "1"], ids=["threads", "processes"])
def test_a_load_that_fails_waits_only_for_the_builds_under_way(device, monkeypatch, processes):
    """An error (or Ctrl-C) while the weights upload stops the load's builds in the background: the load raises
    once the builds under way are done, the others are left unbuilt, and a later load builds them. The prompts'
    builds wait until the upload has failed, so what is under way then is at most one a worker (2), whatever the
    machine's speed: fewer than the prompts' programs."""
    from perfx.model import BUILT_AT_LOAD_M, Model, kernel_requests, load_model
    from perfx.sources import open_model
    monkeypatch.setenv(BUILD_PROCESSES_ENV, processes)
    monkeypatch.setenv(BUILD_WORKERS_ENV, "2")
    fresh = Device(device.entry.index)
    want = set(kernel_requests(open_model("synthetic:tiny"), fresh, max_m=BUILT_AT_LOAD_M))
    prompt_only = ("gemm_", "attention_prefill")   # kernels of prompts alone: the plan waits for none of them
    prompts = [key for key in want if key[0].startswith(prompt_only)]
    assert len(prompts) >= 3
    # those programs as none a cache holds, so each is a build of some length; the decode step's come first
    nonce = str(time.time_ns())
    real_build_many = fresh.build_many

    def uncached(requests, *args, **kwargs):
        keys = [build_key(*r) for r in requests]
        keys = [build_key(k[0], {**dict(k[1]), "PERFX_TEST_NONCE": nonce}, k[2]) if k[0].startswith(prompt_only)
                else k for k in keys]
        return real_build_many(keys, *args, **kwargs)
    monkeypatch.setattr(fresh, "build_many", uncached)
    upload_failed, held_builds = threading.Event(), []

    def held(build):
        def build_after_the_upload(self, key, *args, **kwargs):
            if dict(key[1]).get("PERFX_TEST_NONCE") == nonce:
                held_builds.append(key)
                upload_failed.wait(timeout=60)   # (the load waits for no prompt kernel: never for this long)
            return build(self, key, *args, **kwargs)
        return build_after_the_upload
    monkeypatch.setattr(device_module._Worker, "build", held(device_module._Worker.build))
    monkeypatch.setattr(Device, "_try_build", held(Device._try_build))

    def interrupted(self, *args, **kwargs):
        # a prompt's build under way as the upload fails, which is the case here (a worker may not yet have taken
        # one up when the upload starts: then the load would stop before any, and nothing would test the wait)
        deadline = time.perf_counter() + 30
        while not held_builds and time.perf_counter() < deadline:
            time.sleep(0.01)
        upload_failed.set()
        raise KeyboardInterrupt
    monkeypatch.setattr(Model, "upload", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_model("synthetic:tiny", device=fresh, progress=False)
    left = [key for key in fresh.program_keys if dict(key[1]).get("PERFX_TEST_NONCE") == nonce]
    assert len(left) < len(prompts), "the failed load built every prompt's kernels first"
    assert 0 < len(held_builds) <= 2, held_builds   # under way when the upload failed: one a worker at most
    monkeypatch.undo()
    model, _ = load_model("synthetic:tiny", device=fresh, progress=False)
    model.prefill([1, 2, 3], 0)
    assert np.isfinite(model.logits()).all()


def test_build_workers_of_one_set_of_settings_run_at_a_time(monkeypatch):
    """A selftest's families ask for workers under many (limits, build options): an idle worker of other settings
    stops when new ones start, so the live workers stay those of one set (each holds ~300 MiB)."""
    import threading

    import perfx.runtime.device as device_module

    class FakeWorker:   # what _workers_for keeps and stops, without a process
        started = 0

        def __init__(self, *args):
            FakeWorker.started += 1
            self.alive, self.lock = True, threading.Lock()

        def stop(self):
            self.alive = False

    monkeypatch.setattr(device_module, "_Worker", FakeWorker)
    monkeypatch.setattr(device_module, "_workers", {})
    device = device_module.Device("pocl")
    for options in (["-DA=1"], ["-DA=2"], ["-DA=3"]):
        device.build_options = options
        device_module._workers_for(device, 2)
    assert FakeWorker.started == 6 and device_module.running_build_workers() == 2
