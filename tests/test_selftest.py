"""`perfx selftest`: what it plans (every set once; the defaults and the tuned sets at every shape) and, over long
runs, memory bounded (one case at a time, programs forgotten per family; the peak, its own and its build workers',
reported and under a budget whatever the number of families), progress saved and resumed (after Ctrl-C, a spent
budget, or a kill), shards that split the checks exactly, a time budget that stops cleanly (exit status 3)."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from perfx import cli
from perfx.commands import selftest
from perfx.tuning import SPECS, Case
from perfx.tuning.database import default_database, params_key, result_record
from perfx.tuning.spec import cached_per_params

SMALL = "geglu,embedding_q8"       # --exhaustive: 30 checks over 6 cases, two families
RESUMED = "softcap,geglu"          # --exhaustive: 36 checks over 4 cases
ERRORS = Case.errors               # as the module found it: each test's wrapper replaces, never wraps, another


@pytest.fixture(autouse=True)
def in_this_process(monkeypatch):
    """The checks in the test's own process, where its patches reach them; the tests of checks in worker processes
    ask for them (``--processes``)."""
    monkeypatch.setenv(selftest.PROCESSES_ENV, "1")


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The selftest's progress files in a folder of the test's own."""
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path))
    return tmp_path


def outcomes(data) -> list[tuple]:
    return [(c["kernel"], c["shape"], json.dumps(c["params"], sort_keys=True), c["passed"], c["refused"], c["error"])
            for c in data["checks"]]


def count_checks(monkeypatch, interrupt_at: int | None = None) -> list:
    """Count the checks run (``Case.errors``); with ``interrupt_at``, that check raises KeyboardInterrupt, as Ctrl-C."""
    calls = []

    def counted(self, params):
        calls.append(params)
        if len(calls) == interrupt_at:
            raise KeyboardInterrupt
        return ERRORS(self, params)
    monkeypatch.setattr(Case, "errors", counted)
    return calls


@pytest.mark.parametrize("kept", [selftest.PROGRAMS_KEPT, 1])
def test_each_case_is_released_before_the_next_and_each_familys_programs_after_it(device, kept, monkeypatch):
    """Programs are forgotten after each family, and before the next checks' builds would pass PROGRAMS_KEPT.
    On a Device of its own: the shared one's count also moves when another test's buffers are released."""
    monkeypatch.setattr(selftest, "PROGRAMS_KEPT", kept)
    device = selftest.Device(device.entry.index)
    before_builds = []
    build_many = device.build_many
    monkeypatch.setattr(device, "build_many", lambda requests, *a, **k: (before_builds.append(device.programs_kept),
                                                                          build_many(requests, *a, **k))[1])
    specs = {name: SPECS[name] for name in SMALL.split(",")}
    baseline = device.allocated_bytes
    seen = []   # (family, the device's counted bytes when a case is made, programs kept)

    def watched(spec):
        make = spec.make_case

        def make_case(dev, shape, rng):
            seen.append((spec.params.family, dev.allocated_bytes, dev.programs_kept))
            return make(dev, shape, rng)
        return make_case
    specs = {name: dataclasses.replace(spec, make_case=watched(spec)) for name, spec in specs.items()}
    checks = selftest.run_checks(device, specs, "exhaustive", show_progress=False)
    assert len(checks) == len(selftest.plan(specs, device, "exhaustive")) and not any(c.failed for c in checks)
    assert [family for family, _, _ in seen] == ["geglu"] * 2 + ["embedding_q8"] * 4
    assert all(allocated == baseline for _, allocated, _ in seen), seen
    assert device.allocated_bytes == baseline
    first_of_family = [programs for i, (family, _, programs) in enumerate(seen) if i == 0 or seen[i - 1][0] != family]
    assert first_of_family[1] == 0 and device.programs_kept == 0, seen
    if kept == 1:
        assert before_builds and set(before_builds) == {0}, before_builds
    else:
        assert seen[1][2] > 0, "within a family, under PROGRAMS_KEPT, a case finds the programs of the one before"


def test_a_cases_checks_run_on_programs_built_ahead_together(device, monkeypatch):
    """Where a spec names its programs, they are built by ``build_many`` before the checks: none in a check."""
    fresh = selftest.Device(device.entry.index)   # nothing built in this process yet
    specs = {name: SPECS[name] for name in SMALL.split(",") if SPECS[name].programs is not None}
    assert specs, "a family of SMALL names its programs"
    built_in_checks, batches = [], []

    def timed(self, params):
        compiled = fresh.compile_seconds()
        errors = ERRORS(self, params)
        built_in_checks.append(fresh.compile_seconds() - compiled)
        return errors
    monkeypatch.setattr(Case, "errors", timed)
    build_many = fresh.build_many
    monkeypatch.setattr(fresh, "build_many", lambda requests, *a, **k: (batches.append(len(requests)),
                                                                         build_many(requests, *a, **k))[1])
    checks = selftest.run_checks(fresh, specs, show_progress=False)
    assert checks and not any(c.failed for c in checks)
    assert len(built_in_checks) == len(checks) and set(built_in_checks) == {0.0}, built_in_checks
    assert batches and all(batches), batches


def test_an_interrupted_selftest_resumes_where_it_stopped(capsys, device, cache, monkeypatch):
    code, out, _ = run_cli(capsys, "selftest", "--exhaustive", "--kernels", RESUMED, "--json")
    whole = json.loads(out)
    assert code == 0 and whole["complete"] and whole["planned"] == len(whole["checks"]) == 36
    assert whole["peak_rss_bytes"] > 2**20 and not list(cache.glob("selftest/*.json")), "a finished run clears it"

    calls = count_checks(monkeypatch, interrupt_at=21)
    code, out, err = run_cli(capsys, "selftest", "--exhaustive", "--kernels", RESUMED, "--json")
    first = json.loads(out)
    assert code == 130 and first["interrupted"] and len(first["checks"]) == 20 and "interrupted after 20" in err
    assert len(list(cache.glob("selftest/*.json"))) == 1

    monkeypatch.undo()
    monkeypatch.setenv("PERFX_CACHE", str(cache))
    monkeypatch.setenv("PERFX_DEVICE", device.entry.index)
    monkeypatch.setenv(selftest.PROCESSES_ENV, "1")
    calls = count_checks(monkeypatch)
    code, out, err = run_cli(capsys, "selftest", "--exhaustive", "--kernels", RESUMED, "--json")
    second = json.loads(out)
    assert code == 0 and "resuming: 20 checks done before" in err
    assert len(calls) == 16 and second["resumed"] == 20 and second["complete"]
    assert outcomes(second) == outcomes(whole), "the resumed run's checks are the uninterrupted run's"
    assert not list(cache.glob("selftest/*.json"))


def test_restart_and_changed_kernels_run_the_checks_again(capsys, device, cache, monkeypatch):
    calls = count_checks(monkeypatch, interrupt_at=30)
    assert run_cli(capsys, "selftest", "--exhaustive", "--kernels", RESUMED)[0] == 130
    calls.clear()
    # softcap's kernel source changed since: its 18 checks run again, geglu's 11 done are kept
    hashes = {"softcap": "changed"}
    source_hash = selftest.source_hash
    monkeypatch.setattr(selftest, "source_hash", lambda spec: hashes.get(spec.params.family) or source_hash(spec))
    code, out, err = run_cli(capsys, "selftest", "--exhaustive", "--kernels", RESUMED, "--json")
    assert code == 0 and "the kernels of softcap changed since" in err and len(calls) == 36 - 11
    assert json.loads(out)["resumed"] == 11

    count_checks(monkeypatch, interrupt_at=5)
    assert run_cli(capsys, "selftest", "--exhaustive", "--kernels", RESUMED)[0] == 130
    count_checks(monkeypatch)
    code, out, err = run_cli(capsys, "selftest", "--exhaustive", "--kernels", RESUMED, "--restart", "--json")
    assert code == 0 and "resuming" not in err and json.loads(out)["resumed"] == 0


def plan_keys(jobs) -> list[tuple[str, str, str]]:
    return [(spec.params.family, spec.describe(shape), params_key(params)) for spec, shape, params in jobs]


def test_the_default_plan_checks_every_set_once_and_at_every_shape_the_defaults_and_what_the_device_runs(device):
    """``covering``: every parameter set the tuner may choose is checked at a test shape where it can run; each
    shape at the defaults and at the sets the tuning entries in force choose; nothing twice. ``exhaustive`` is every
    set at every shape, ``quick`` the defaults at one shape. The sets "in force" here are each family's last
    candidate at its first shape, as a tuning entry would name one."""
    ruling = {name: (spec.params.candidates(spec.test_shapes[0], device.caps) or [spec.params.defaults()])[-1]
              for name, spec in SPECS.items()}     # (a family this device cannot run has no candidates)
    covering = plan_keys(selftest.plan(SPECS, device, "covering", in_force=lambda spec: [ruling[spec.params.family]]))
    exhaustive = plan_keys(selftest.plan(SPECS, device, "exhaustive"))
    assert len(set(covering)) == len(covering) and set(covering) < set(exhaustive)
    assert len(covering) < len(exhaustive) / 2, "the default builds a fraction of the exhaustive programs"
    for name, spec in SPECS.items():
        every = {key for family, _, key in exhaustive if family == name}
        checked = [key for family, _, key in covering if family == name]
        assert set(checked) == every, f"{name}: a set the tuner may choose is never checked"
        defaults, chosen = params_key(spec.params.defaults()), params_key(ruling[name])
        at_every_shape = {chosen}
        for shape in spec.test_shapes:
            described = spec.describe(shape)
            here = [params_key(p) for p in spec.params.candidates(shape, device.caps)]
            at = {key for family, shape_, key in covering if family == name and shape_ == described}
            if not here:
                assert not at
                continue
            first = defaults if defaults in here else here[0]   # where a capability rules the defaults out
            at_every_shape.add(first)
            assert first in at, f"{name} {described}: not at its defaults"
            assert chosen not in here or chosen in at, f"{name} {described}: the set in force is not checked"
        once = [key for key in checked if key not in at_every_shape]
        assert len(once) == len(set(once)), f"{name}: a set checked at two shapes"
    again = selftest.plan(SPECS, device, "covering", in_force=lambda spec: [ruling[spec.params.family]])
    assert covering == plan_keys(again), "the plan is the same from run to run (a resumed run checks the same)"
    quick = plan_keys(selftest.plan(SPECS, device, "quick"))
    runnable = [name for name, spec in SPECS.items() if spec.params.candidates(spec.test_shapes[0], device.caps)]
    assert sorted(family for family, _, _ in quick) == sorted(runnable)
    with pytest.raises(ValueError, match="unknown selftest scope"):
        selftest.plan(SPECS, device, "most")


def test_the_sets_a_devices_tuning_entries_choose_are_checked_at_every_shape_and_stale_ones_not(capsys, device, cache):
    spec = SPECS["softcap"]
    defaults = spec.params.defaults()
    tuned, stale = [p for p in spec.params.candidates(spec.test_shapes[0], device.caps) if p != defaults][:2]
    database = default_database()
    database.save_result(device, result_record(spec, spec.test_shapes[0], tuned, 1e-5, 2e-5, device.fingerprint))
    old = result_record(spec, spec.test_shapes[1], stale, 1e-5, 2e-5, device.fingerprint)
    database.save_result(device, {**old, "source_hash": "measured-with-other-code"})
    assert database.sets_in_force(device, spec) == [tuned]
    code, out, _ = run_cli(capsys, "selftest", "--kernels", "softcap", "--json")
    data = json.loads(out)
    assert code == 0 and data["scope"] == "covering" and data["planned"] == len(data["checks"])
    where = {}
    for check in data["checks"]:
        where.setdefault(params_key(check["params"]), []).append(check["shape"])
    shapes = [spec.describe(shape) for shape in spec.test_shapes]
    assert sorted(where[params_key(tuned)]) == sorted(where[params_key(defaults)]) == sorted(shapes)
    assert len(where[params_key(stale)]) == 1, "a stale entry's set is checked once, as any other"
    with pytest.raises(SystemExit):
        cli.main(["selftest", "--quick", "--exhaustive"])
    capsys.readouterr()


def test_shards_split_every_check_exactly_once_by_family_and_parameter_set(device):
    jobs = selftest.plan(SPECS, device, "exhaustive")
    key = selftest.check_key
    whole = [key(spec.params.family, spec.describe(shape), params) for spec, shape, params in jobs]
    assert len(set(whole)) == len(whole)
    for count in (1, 2, 3, 7):
        parts = [[key(s.params.family, s.describe(shape), p) for s, shape, p in selftest.shard(jobs, i, count)]
                 for i in range(1, count + 1)]
        assert sorted(k for part in parts for k in part) == sorted(whole)      # the union is the whole, and
        assert sum(map(len, parts)) == len(whole)                               # no check is in two parts
        # each (family, parameter set) in one part only: its kernels are built once across the parts
        owners = [{k.rsplit("|", 2)[0] + "|" + k.rsplit("|", 1)[1] for k in part} for part in parts]
        assert sum(map(len, owners)) == len(set().union(*owners))
        sizes = sorted(map(len, parts))
        assert sizes[-1] <= 2 * sizes[0] + 50, sizes


def test_shards_run_from_the_command_line_cover_the_whole(capsys, device, cache):
    code, out, _ = run_cli(capsys, "selftest", "--kernels", SMALL, "--json")
    whole = outcomes(json.loads(out))
    parts = []
    for i in (1, 2, 3):
        code, out, err = run_cli(capsys, "selftest", "--kernels", SMALL, "--shard", f"{i}/3", "--json")
        data = json.loads(out)
        assert code == 0 and data["shard"] == f"{i}/3" and data["complete"] and f"part {i} of 3" in err
        parts += outcomes(data)
    assert sorted(parts) == sorted(whole)
    for bad in ("0/3", "4/3", "x"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["selftest", "--shard", bad])
        assert exit_.value.code == 2
    capsys.readouterr()


def test_a_spent_budget_stops_cleanly_with_status_3_and_the_next_run_goes_on(capsys, device, cache, monkeypatch):
    code, out, err = run_cli(capsys, "selftest", "--exhaustive", "--kernels", SMALL, "--budget", "0", "--json")
    data = json.loads(out)
    assert code == selftest.EXIT_INCOMPLETE == 3 and data["stopped"] == "budget" and not data["complete"]
    assert data["checks"] == [] and data["planned"] == 30 and "run the same command again" in err

    def slow(self, params):   # each check takes 0.1 s more: a budget of 0.45 s stops after a few
        time.sleep(0.1)
        return ERRORS(self, params)
    monkeypatch.setattr(Case, "errors", slow)
    code, out, err = run_cli(capsys, "selftest", "--exhaustive", "--kernels", SMALL, "--budget", "0.45", "--json")
    data = json.loads(out)
    done = len(data["checks"])
    assert code == 3 and 1 <= done < 30 and data["peak_rss_bytes"] > 0
    monkeypatch.setattr(Case, "errors", ERRORS)
    code, out, err = run_cli(capsys, "selftest", "--exhaustive", "--kernels", SMALL)
    assert code == 0 and f"resuming: {done} checks done before" in err and "30 passed" in out
    assert f"{done} resumed" in out


def test_an_unreadable_progress_file_starts_afresh(capsys, device, cache):
    count = run_cli(capsys, "selftest", "--exhaustive", "--kernels", "softcap", "--budget", "0")[0]
    [path] = cache.glob("selftest/*.json")
    path.write_text('{"perfx_selftest_progress": 1, "identity"')
    code, out, err = run_cli(capsys, "selftest", "--exhaustive", "--kernels", "softcap")
    assert count == 3 and code == 0 and "unreadable" in err and "18 passed" in out


def test_a_case_keeps_the_wrappers_of_its_last_few_parameter_sets():
    made = []
    get = cached_per_params(lambda params: made.append(params) or len(made), keep=2)
    assert [get({"A": 1}), get({"A": 2}), get({"A": 1}), get({"A": 3})] == [1, 2, 1, 3]
    assert get({"A": 1}) == 1 and get({"A": 2}) == 4, "{A: 2} was used least recently: made again"


MEMORY_BUDGET = 1.5 * 2**30   # issue 44: what a phone sharing 8–12 GB with Android can give a whole selftest
FAMILY_GROWTH = 256 * 2**20   # what running every family instead of one may add: their specs, not their cases


def wait_for_a_saved_case(process, cache) -> None:
    """Until the running selftest has saved its first case's progress (failing if it ends before)."""
    deadline = time.monotonic() + 600
    while not list(cache.glob("selftest/*.json")):
        assert process.poll() is None, "the run ended before its first case was saved"
        assert time.monotonic() < deadline
        time.sleep(0.01)


def selftest_process(cache, *argv, **popen):
    """`perfx selftest` in a process of its own (its peak resident memory is its own), progress under ``cache``."""
    env = {**os.environ, "PERFX_CACHE": str(cache)}
    return subprocess.Popen([sys.executable, "-m", "perfx", "selftest", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def test_a_process_started_from_a_large_one_reports_its_own_peak_memory():
    """Linux carries a parent's peak into ru_maxrss across fork and exec: a selftest started from a test runner or
    an app holding gigabytes read that as its own peak."""
    held = np.ones(512 * 2**20, dtype=np.uint8)   # touched: resident in this process
    child = subprocess.run([sys.executable, "-c", "from perfx.model import host_peak_bytes; print(host_peak_bytes())"],
                           capture_output=True, text=True, check=True)
    assert held.sum() == held.size
    assert 2**20 < int(child.stdout) < 256 * 2**20, f"{int(child.stdout) / 2**20:.0f} MiB"


@pytest.mark.slow
@pytest.mark.one_implementation
def test_peak_memory_is_reported_and_stays_under_the_budget_whatever_the_number_of_families(device, cache):
    """The first run may build every family's programs in its own process (a case's few programs are not worth
    starting build workers for), and a driver's compiler keeps some of what it allocated for each (benchmarks/NOTES.md):
    that run is held to the budget. The selftest's own memory is then compared with the kernels built, so what is compared is ours: every
    family's specs against one family's."""
    peaks, own, how = {}, {}, {}
    for kernels in (None, "geglu", None):
        name = "cold" if not peaks else kernels or "all"
        run = selftest_process(cache, "--quick", "--json", *(["--kernels", kernels] if kernels else []))
        out, err = run.communicate(timeout=1200)
        assert run.returncode == 0, err[-2000:]
        data = json.loads(out)
        assert data["complete"] and data["failed"] == 0
        own[name] = data["peak_rss_bytes"]
        how[name] = {key: data[key] for key in ("build_workers", "build_workers_peak_rss_bytes",
                                                "check_processes", "check_processes_peak_rss_bytes")}
        peaks[name] = data["peak_rss_bytes"] + data["build_workers"] * data["build_workers_peak_rss_bytes"]
        assert 2**20 < data["peak_rss_bytes"] and data["build_workers_peak_rss_bytes"] >= 0
    families = len(SPECS)
    for name in ("cold", "all"):
        assert peaks[name] <= MEMORY_BUDGET, f"{peaks[name] / 2**20:.0f} MiB over {families} families ({name})"
    # the selftest's own memory, not its build workers': whether workers start (each holding one program at a time)
    # depends on what the kernel cache lacks, not on the number of families
    assert own["all"] <= own["geglu"] + FAMILY_GROWTH, (
        f"{families} families took {own['all'] / 2**20:.0f} MiB, one {own['geglu'] / 2**20:.0f} MiB", how)


@pytest.mark.one_implementation
def test_a_selftest_killed_part_way_resumes_from_its_last_saved_case(device, cache):
    """SIGKILL (a phone's low-memory killer, a crash): no handler runs, and the progress written after each case
    is what the next run resumes from; its checks are those of an uninterrupted run."""
    kernels = "short_conv,moe_router,embedding_q8"
    whole = selftest_process(cache, "--kernels", kernels, "--json")
    out, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err[-2000:]
    want = json.loads(out)
    killed = selftest_process(cache, "--kernels", kernels, "--json")
    wait_for_a_saved_case(killed, cache)
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    again = selftest_process(cache, "--kernels", kernels, "--json")
    out, err = again.communicate(timeout=600)
    data = json.loads(out)
    assert again.returncode == 0 and "resuming:" in err and 0 < data["resumed"] < data["planned"], err[-2000:]
    assert outcomes(data) == outcomes(want)
    assert not list(cache.glob("selftest/*.json"))


# -- checks in worker processes (the default on a CPU device) ----------------------------------------------------

def test_on_a_cpu_device_the_checks_run_in_a_process_per_core_and_elsewhere_in_this_one(device, monkeypatch):
    monkeypatch.delenv(selftest.PROCESSES_ENV)
    cores = min(os.cpu_count() or 1, selftest.MAX_PROCESSES)
    assert device.caps.device_type == "CPU" and selftest.default_processes(device) == cores
    monkeypatch.setattr(device, "caps", dataclasses.replace(device.caps, device_type="GPU"))
    assert selftest.default_processes(device) == 1
    monkeypatch.setenv(selftest.PROCESSES_ENV, "3")
    assert selftest.default_processes(device) == 3
    monkeypatch.setenv(selftest.PROCESSES_ENV, "many")
    with pytest.raises(selftest.PerfxError, match="PERFX_SELFTEST_PROCESSES='many'"):
        selftest.default_processes(device)
    for bad in ("0", "x"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["selftest", "--processes", bad])
        assert exit_.value.code == 2


def test_checks_in_worker_processes_are_those_of_one_process_in_its_order(capsys, device, cache, monkeypatch):
    """The same checks, the same errors bit for bit (each case's inputs depend on the seed, family and shape
    alone, so a case checked in parts, each in whichever process is free, checks the same), in the plan's order;
    the processes' peak memory reported."""
    code, out, _ = run_cli(capsys, "selftest", "--exhaustive", "--kernels", RESUMED, "--json")
    alone = json.loads(out)
    monkeypatch.setattr(selftest, "CHECKER_PART", 4)   # the cases of 9 checks in parts of 4, 4 and 1
    code2, out, err = run_cli(capsys, "selftest", "--exhaustive", "--kernels", RESUMED, "--json", "--processes", "2")
    data = json.loads(out)
    assert code == code2 == 0 and data["complete"] and data["planned"] == len(data["checks"]) == 36
    assert outcomes(data) == outcomes(alone)
    assert data["check_processes"] == 2 and alone["check_processes"] == 0
    assert 2**20 < data["check_processes_peak_rss_bytes"] < MEMORY_BUDGET / 2
    assert not list(cache.glob("selftest/*.json")), "a finished run clears its progress"
    code, out, err = run_cli(capsys, "selftest", "--exhaustive", "--kernels", RESUMED, "--budget", "0", "--json",
                             "--processes", "2")
    data = json.loads(out)
    assert code == 3 and data["stopped"] == "budget" and data["checks"] == []


@pytest.mark.parametrize("processes", ["1", "2"])
def test_each_familys_checks_and_seconds_are_reported(capsys, device, cache, processes):
    """What a user on a slow device splits the selftest by: per family its checks and the seconds they took (the
    case's set-up and the builds made ahead for a check counted in it), in --json and in the summary."""
    started = time.perf_counter()
    code, out, _ = run_cli(capsys, "selftest", "--exhaustive", "--kernels", SMALL, "--json", "--processes", processes)
    wall = time.perf_counter() - started
    data = json.loads(out)
    assert code == 0 and list(data["families"]) == SMALL.split(",")
    for family, total in data["families"].items():
        mine = [c for c in data["checks"] if c["kernel"] == family]
        assert total["checks"] == len(mine) > 0
        assert all(c["seconds"] > 0 and c["cpu_seconds"] > 0 for c in mine), mine
        assert total["seconds"] == pytest.approx(sum(c["seconds"] for c in mine), abs=0.01)
        assert total["cpu_seconds"] == pytest.approx(sum(c["cpu_seconds"] for c in mine), abs=0.01)
    # each process's checks' seconds are disjoint spans of its time
    assert sum(t["seconds"] for t in data["families"].values()) < int(processes) * wall
    code, out, _ = run_cli(capsys, "selftest", "--exhaustive", "--kernels", SMALL, "--processes", processes,
                           "--restart")
    header, _, *rows = out.splitlines()[:4]   # the header, its rule, a row per family
    assert code == 0 and header.split()[-1] == "seconds"
    # a family of a few fast checks may round to 0.0 from warm caches: each is a number, not all of them zero
    seconds = [float(row.split()[-1]) for row in rows]
    assert len(seconds) == 2 and min(seconds) >= 0 and sum(seconds) > 0, out


def test_a_worker_process_grown_past_its_memory_bound_is_replaced_by_a_fresh_one(capsys, device, cache,
                                                                                monkeypatch):
    code, out, _ = run_cli(capsys, "selftest", "--kernels", "geglu", "--json")   # 10 checks, in cases of 8 and 2
    alone = json.loads(out)
    started = []
    init = selftest._Checker.__init__
    monkeypatch.setattr(selftest._Checker, "__init__", lambda self, *a: (started.append(1), init(self, *a))[1])
    monkeypatch.setattr(selftest, "RECYCLE_BYTES", 0)   # every process past it after its first check
    code, out, _ = run_cli(capsys, "selftest", "--kernels", "geglu", "--json", "--processes", "2")
    data = json.loads(out)
    assert code == 0 and outcomes(data) == outcomes(alone)
    # within a case too: a process past the bound hands the case's sets it has not checked to a fresh one
    assert len(started) == len(data["checks"]) > 2 and data["check_processes"] == 2, "a fresh process a check"


def test_a_check_failing_in_a_worker_process_is_reported_with_its_family_shape_and_set(capsys, device, cache,
                                                                                      monkeypatch):
    """A kernel built wrong in the worker processes (a define of the build options overriding the set's: a
    quarter of the floats a work-item should write) fails there as it does in one process."""
    monkeypatch.setenv("PERFX_BUILD_OPTIONS", "-DVW4=1")
    failed = {}
    for processes in ("1", "2"):
        code, out, _ = run_cli(capsys, "selftest", "--kernels", "softcap", "--json", "--processes", processes)
        data = json.loads(out)
        assert code == 1 and data["complete"]
        failed[processes] = [(c["kernel"], c["shape"], c["params"]) for c in data["checks"] if not c["passed"]]
        assert all(c["params"]["VW4"] != 1 for c in data["checks"] if not c["passed"])
    assert failed["1"] == failed["2"] and len(failed["2"]) >= 2
    code, out, _ = run_cli(capsys, "selftest", "--kernels", "softcap", "--processes", "2")
    kernel, shape, params = failed["2"][0]
    line = next(line for line in out.splitlines() if line.startswith("softcap ") and "FAIL" in line)
    assert code == 1 and shape in line and " ".join(f"{k}={v}" for k, v in params.items()) in line


def test_a_worker_process_that_dies_fails_the_check_it_was_making_and_another_checks_the_rest(capsys, device,
                                                                                              cache, monkeypatch):
    """A driver that crashes the process (Intel's CPU compiler has, on a gemv_q4 set): that check fails saying
    so, a new process takes the rest of its case, and every other check is made as in one process."""
    code, out, _ = run_cli(capsys, "selftest", "--exhaustive", "--kernels", RESUMED, "--json")
    alone = json.loads(out)
    check = selftest._Checker.check
    chosen, killed = [], []

    def crashing(self, spec, shape, params_list, seconds, on_check):
        if chosen or len(params_list) <= 2:
            return check(self, spec, shape, params_list, seconds, on_check)
        chosen.append(spec)   # the first long case: its process dies after its second check
        made = []

        def on_two(one):
            on_check(one)
            made.append(one)
            if len(made) == 2:
                killed.append(self.process.pid)
                self.process.kill()
        return check(self, spec, shape, params_list, seconds, on_two)
    monkeypatch.setattr(selftest._Checker, "check", crashing)
    code, out, _ = run_cli(capsys, "selftest", "--exhaustive", "--kernels", RESUMED, "--json", "--processes", "2")
    data = json.loads(out)
    assert killed and code == 1 and data["complete"] and data["failed"] == 1
    [dead] = [c for c in data["checks"] if not c["passed"]]
    assert "worker process died" in dead["failure"] and dead["error"] == float("inf")
    same = [o for o in outcomes(data) if o[:3] != (dead["kernel"], dead["shape"], json.dumps(dead["params"],
                                                                                              sort_keys=True))]
    assert len(same) == 35 and set(same) <= set(outcomes(alone))


def test_an_interrupted_run_in_worker_processes_resumes_where_it_stopped(device, cache):
    """Ctrl-C: the worker processes end at once, the checks they sent are kept, and the next run (in processes or
    not) makes only the rest."""
    kernels = "short_conv,moe_router,embedding_q8"
    whole = selftest_process(cache, "--kernels", kernels, "--json")
    out, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err[-2000:]
    want = json.loads(out)
    stopped = selftest_process(cache, "--kernels", kernels, "--json", "--processes", "2")
    wait_for_a_saved_case(stopped, cache)
    stopped.send_signal(signal.SIGINT)
    out, err = stopped.communicate(timeout=60)
    assert stopped.returncode == 130, err[-2000:]
    kept = json.loads(out)
    assert kept["interrupted"] and 0 < len(kept["checks"]) < kept["planned"]
    again = selftest_process(cache, "--kernels", kernels, "--json", "--processes", "2")
    out, err = again.communicate(timeout=600)
    data = json.loads(out)
    assert again.returncode == 0 and "resuming:" in err and data["resumed"] >= len(kept["checks"]), err[-2000:]
    assert outcomes(data) == outcomes(want)


def test_worker_processes_load_only_the_devices_own_opencl_library_or_else_all_as_before(capsys, device, cache,
                                                                                         monkeypatch, tmp_path):
    """Each worker maps one of the loader's libraries, the device's; where the one chosen does not give the same
    device (here a library that is none), the run goes on with workers that load them all, and checks the same."""
    from perfx.runtime.implementations import DEFAULT_VENDORS_FOLDER, read_vendor_folder
    monkeypatch.setattr(selftest._Checker, "one_library", True)
    code, out, _ = run_cli(capsys, "selftest", "--kernels", "geglu", "--json")
    alone = json.loads(out)
    folder = os.environ.get("OCL_ICD_VENDORS") or DEFAULT_VENDORS_FOLDER
    if not os.path.isdir(folder):
        # a run given one library (a PoCL selected by OCL_ICD_VENDORS=<its .icd>) has no other to leave out; the
        # outcome above was still checked
        pytest.skip("the loader's choice is made already (OCL_ICD_VENDORS names one library)")
    libraries = {os.path.basename(os.path.realpath(lib)) for lib in read_vendor_folder(folder).values()}
    mapped = []
    check = selftest._Checker.check

    def looking(self, *args):
        with open(f"/proc/{self.process.pid}/maps") as maps:
            names = {os.path.basename(line.split()[-1]) for line in maps if "/" in line}
        mapped.append(names & libraries)
        return check(self, *args)
    monkeypatch.setattr(selftest._Checker, "check", looking)
    code, out, _ = run_cli(capsys, "selftest", "--kernels", "geglu", "--json", "--processes", "2")
    assert code == 0 and outcomes(json.loads(out)) == outcomes(alone)
    if selftest.one_library_environ(device.entry.implementation) is not None:
        assert mapped and all(len(names) == 1 for names in mapped), mapped
        assert selftest._Checker.one_library
    nothing = tmp_path / "nothing.icd"
    nothing.write_text(str(tmp_path / "libnothing.so") + "\n")
    monkeypatch.setattr(selftest, "one_library_environ", lambda implementation: {"OCL_ICD_VENDORS": str(nothing)})
    code, out, _ = run_cli(capsys, "selftest", "--kernels", "geglu", "--json", "--processes", "2")
    assert code == 0 and outcomes(json.loads(out)) == outcomes(alone)
    assert not selftest._Checker.one_library
