"""Kernels built many at once (``Device.build_many``): the same kernels as one at a time, on each implementation;
each program once however many threads ask; a build's failure reported with its log; a driver that fails under
concurrent builds falls back to one at a time, once, and says so; PERFX_BUILD_WORKERS; ``collecting``; and
`perfx warm`."""

import json
import threading
import time

import numpy as np
import pytest

from helpers.spec_checks import parameter_sets
from perfx import cli
from perfx.errors import PerfxError
from perfx.ops.rmsnorm import RMSNorm
from perfx.runtime import BUILD_WORKERS_ENV, BuildConcurrencyWarning, BuildError, Device, build_key
from perfx.tuning.rmsnorm import SPEC

SETS = 6   # parameter sets of one family, each a program of its own


def _outputs(device, shape, sets, seed=7):
    case = SPEC.make_case(device, shape, np.random.default_rng(seed))
    return [case.run(params) for params in sets]


def test_concurrent_builds_run_as_serial_ones(device, tmp_path, monkeypatch):
    # pyopencl's binary cache emptied, so that Intel's runtime compiles each program here (PoCL keeps its own
    # cache, which pyopencl leaves the builds to)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shape = SPEC.test_shapes[0]
    sets = parameter_sets(SPEC, shape, device.caps)[:SETS]
    serial = Device(device.entry.index)
    want = _outputs(serial, shape, sets)
    keys = list(serial._programs)
    assert len(keys) >= 2

    parallel = Device(device.entry.index)
    report = parallel.build_many(keys, workers=4)
    assert report.errors == {} and len(report.built) == len(keys) and report.workers >= 2
    got = _outputs(parallel, shape, sets)
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
def test_each_program_is_built_once_whatever_asks(device, monkeypatch):
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
def test_a_driver_failing_concurrent_builds_falls_back_to_one_at_a_time(device, monkeypatch):
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
