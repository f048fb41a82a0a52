"""The autotuner: verified candidates only, reasons recorded, resumable sweeps, budget, model problems."""

import argparse
import builtins
import copy
import dataclasses
import json

import numpy as np
import pytest

from perfx import cli, plots
from perfx.commands import tune
from perfx.errors import PerfxError
from perfx.ops.params import ParamSpace
from perfx.resources import write_json_atomic
from perfx.runtime import Device, get_device
from perfx.timing import Timing
from perfx.sources.synthetic import SYNTHETIC_MODELS
from perfx.tuning import SPECS, select_specs
from perfx.model import load_model
from perfx.tuning.database import (FORMAT, M_BUCKETS, Database, bucket_representative, default_database, m_bucket,
                                   params_key, result_record, source_hash)
from perfx.tuning.problems import _fits, model_problems
from perfx.tuning.spec import Case, Spec, time_case
from perfx.tuning.tuner import Tuner, neighbours
from toy_tuning import Toy, quiet_tuner

pytestmark = pytest.mark.one_implementation  # model-level: the default device only

SHAPE = {"n": 1000}


@pytest.fixture
def db(tmp_path):
    return Database(tmp_path / "user", tmp_path / "shipped")


def test_never_selects_wrong_or_broken_and_records_why(device, db):
    toy = Toy()
    spec = toy.spec()
    result = quiet_tuner(device, db, budget_s=60).tune_problem(spec, SHAPE)
    assert result.complete and len(result.outcomes) == 9
    assert result.best.params["MODE"] == "good" and result.best.status == "ok"
    by_mode = {}
    for outcome in result.outcomes:
        by_mode.setdefault(outcome.params["MODE"], set()).add(outcome.status)
    assert by_mode["good"] <= {"ok", "slow"} and by_mode["wrong"] == {"wrong"} and by_mode["broken"] == {"build"}
    wrong = [o for o in result.outcomes if o.status == "wrong"]
    assert all("tolerance" in o.reason and o.time_s is None for o in wrong)
    broken = [o for o in result.outcomes if o.status == "build"]
    assert all("failed to build" in o.reason for o in broken)
    # The resume log holds every candidate with its outcome; the results file the verified best alone.
    logged = json.loads(db.log_path(device.fingerprint).read_text())["problems"][0]
    assert {c["status"] for c in logged["candidates"]} >= {"ok", "wrong", "build"} and logged["complete"]
    (saved,) = json.loads(db.device_path(device.fingerprint).read_text())["records"]
    assert saved["params"]["MODE"] == "good" and "candidates" not in saved
    assert saved["time_s"] == result.time_s and saved["gb_per_s"] > 0 and saved["rounds"] == 7
    lo, hi = saved["gain_interval"]
    assert lo <= saved["gain"] <= hi
    choice = db.choices(device, spec, SHAPE)[0]
    assert choice.source == "device" and choice.params == result.chosen


def test_a_wrong_answer_is_caught_even_when_it_is_the_only_candidate(device, db):
    toy = Toy()
    spec = toy.spec(space={"WGS": (16,), "MODE": ("wrong",)})
    result = quiet_tuner(device, db, budget_s=30).tune_problem(spec, SHAPE)
    assert result.best is None and not result.complete
    assert db.choices(device, spec, SHAPE)[0].source == "default"


def test_interrupted_sweep_resumes_without_retiming(device, db):
    toy = Toy()
    spec = toy.spec()
    toy.interrupt_at = 5  # Ctrl-C during the fifth candidate's verification
    with pytest.raises(KeyboardInterrupt):
        quiet_tuner(device, db, budget_s=60).tune_problem(spec, SHAPE)
    logged = json.loads(db.log_path(device.fingerprint).read_text())["problems"][0]
    done = {params_key(c["params"]) for c in logged["candidates"]}
    assert len(done) == 4 and not logged["complete"]
    assert not db.device_path(device.fingerprint).exists(), "an interrupted problem has no result yet"

    toy.interrupt_at, toy.runs, toy.launches = None, {}, {}
    result = quiet_tuner(device, db, budget_s=60).tune_problem(spec, SHAPE)
    assert result.resumed == 4 and result.complete and len(result.outcomes) == 9
    again = {params_key(dict(k)) for k in toy.runs}
    assert not done & again, "a finished candidate was verified again"
    assert len(toy.runs) == 5
    # Only the confirmation launches a finished candidate again: the contenders, never a rejected one.
    relaunched = {params_key(dict(k)) for k in toy.launches} & done
    assert relaunched <= {params_key(c) for c in result.confirmation.contenders}
    # A third run finds the record complete and runs nothing at all.
    toy.runs, toy.launches = {}, {}
    result = quiet_tuner(device, db, budget_s=60).tune_problem(spec, SHAPE)
    assert result.complete and not toy.runs and not toy.launches


CRASHING_SWEEP = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from toy_tuning import Toy, quiet_tuner
from perfx.runtime import Device, get_device
from perfx.tuning.database import Database
toy = Toy()
toy.crash_at = 5
quiet_tuner(get_device({device!r}), Database(Path({user!r}), Path({shipped!r})), budget_s=60).tune_problem(
    toy.spec(), {shape!r})
"""


def test_a_candidate_that_kills_the_process_is_skipped_on_resume(device, db, tmp_path):
    """A driver that segfaults while it builds or runs a candidate (Intel's compiler did on an AVX-512 CPU) ends
    the sweep with nothing unwound; the candidate it ran is on disk, so the next run records it as crashed, never
    runs it again, and finishes the sweep."""
    import subprocess
    import sys
    from pathlib import Path
    script = CRASHING_SWEEP.format(tests=str(Path(__file__).parent), device=device.entry.index,
                                   user=str(db.user_dir), shipped=str(db.shipped_dir), shape=SHAPE)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 139, done.stderr[-2000:]
    logged = json.loads(db.log_path(device.fingerprint).read_text())["problems"][0]
    assert len(logged["candidates"]) == 4 and logged.get("running") is not None
    crashed = logged["running"]

    toy = Toy()
    result = quiet_tuner(device, db, budget_s=60).tune_problem(toy.spec(), SHAPE)
    assert result.complete and len(result.outcomes) == 9
    assert [o.params for o in result.outcomes if o.status == "crashed"] == [crashed]
    assert params_key(crashed) not in {params_key(dict(k)) for k in toy.runs}, "the crashed set ran again"
    assert result.best.params != crashed


def test_the_log_is_written_once_a_candidate_and_holds_every_outcome(device, db):
    """The resume log is written whole, so a save costs more as a sweep goes on: each outcome goes to disk with the
    next candidate's mark, not in a save of its own, and the last one when the search ends."""
    toy = Toy()
    tuner = quiet_tuner(device, db, budget_s=60)
    saves = []
    save = tuner.log.save
    tuner.log.save = lambda: (saves.append(1), save())
    result = tuner.tune_problem(toy.spec(), SHAPE)
    assert result.complete and result.evaluated == 9
    assert len(saves) <= result.evaluated + 2, len(saves)   # a mark each, the search's end, the confirmation
    logged = json.loads(db.log_path(device.fingerprint).read_text())["problems"][0]
    assert len(logged["candidates"]) == 9 and "running" not in logged and logged["complete"]


def test_a_shape_no_parameter_set_fits_is_a_note_not_an_error(device, db):
    """Where no set may run a shape here (the defaults included), the problem ends with that note: what runs
    untuned is asked for only once a set fits."""
    from perfx.ops.params import Rule
    spec = Toy().spec()
    none_fit = dataclasses.replace(spec.params, rules=(Rule("no set fits this shape", lambda p, s: False),))
    result = quiet_tuner(device, db, budget_s=60).tune_problem(dataclasses.replace(spec, params=none_fit), SHAPE)
    assert result.note == "no parameter set is valid for this shape on this device" and not result.outcomes


def test_budget_spent_times_the_defaults_then_the_next_sweep_goes_on(device, db):
    toy = Toy()
    spec = toy.spec()
    first = quiet_tuner(device, db, budget_s=0).tune_problem(spec, SHAPE)
    assert [o.params for o in first.outcomes] == [spec.params.defaults()] and not first.complete
    assert first.best.params == spec.params.defaults() and first.speedup == 1.0
    second = quiet_tuner(device, db, budget_s=60).tune_problem(spec, SHAPE)
    assert second.complete and second.resumed == 1 and len(second.outcomes) == 9


def test_random_sampling_then_local_refinement_on_a_large_space(device, db):
    toy = Toy()
    space = {"WGS": (16, 32, 64, 128), "MODE": ("good", "wrong", "broken"), "PAD": (0, 1, 2, 3, 4)}
    spec = toy.spec(space=space)
    tuner = quiet_tuner(device, db, budget_s=60, exhaustive_limit=8, random_samples=4, sample_share=0.0, repeat=3)
    result = tuner.tune_problem(spec, SHAPE)
    assert result.complete and result.best.params["MODE"] == "good"
    assert 5 <= len(result.outcomes) < 60
    # Converged: no neighbour of the best is untried.
    tried = {params_key(o.params) for o in result.outcomes}
    assert all(params_key(p) in tried for p in neighbours(space, result.best.params))


def test_sampling_goes_on_while_its_share_of_the_budget_lasts(device, db):
    """A budget the user gave is spent sampling (coupled variants are not reached by one-step moves): with
    time to spare, every candidate of this small toy space is tried, then confirmed."""
    toy = Toy()
    space = {"WGS": (16, 32, 64, 128), "MODE": ("good", "wrong", "broken"), "PAD": (0, 1, 2)}
    spec = toy.spec(space=space)
    tuner = quiet_tuner(device, db, budget_s=600, exhaustive_limit=8, random_samples=4, repeat=3)
    result = tuner.tune_problem(spec, SHAPE)
    assert result.complete and len(result.outcomes) == 4 * 3 * 3 and result.confirmation is not None


def test_neighbours_move_one_parameter_to_each_other_value():
    space = {"A": (1, 2, 3, 4), "B": ("x", "y")}
    assert neighbours(space, {"A": 2, "B": "x"}) == [{"A": 1, "B": "x"}, {"A": 3, "B": "x"}, {"A": 4, "B": "x"},
                                                     {"A": 2, "B": "y"}]


def test_m_buckets_and_their_representatives():
    assert [m_bucket(m) for m in (1, 2, 4, 5, 16, 17, 64, 65, 256, 257, 5000)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    for i in range(len(M_BUCKETS)):
        assert m_bucket(bucket_representative(i)) == i


@pytest.mark.parametrize("name", sorted(SYNTHETIC_MODELS))
def test_problems_of_a_model_fit_the_specs(name):
    config = SYNTHETIC_MODELS[name][0]
    families = SPECS
    problems, notes = model_problems(config, families)
    assert problems
    for problem in problems:
        assert _fits(families[problem.family], problem.shape) is None
        families[problem.family].bytes_moved(problem.shape)
    if "gemm_q4_skinny" in families:
        ms = {p.shape["m"] for p in problems if p.family == "gemm_q4_skinny"}
        assert len(ms) == len(M_BUCKETS)
    if "gemv_q4" in families:
        # one qkv problem of all the attention layers; with layers of their own shapes (Gemma 4, Gemma 3n) each
        # layer's width is measured (a q-only layer's may be o's very shape, and one problem with it)
        qkv = [p for p in problems if p.family == "gemv_q4" and p.label == "qkv"]
        layers = config.layers_of("attention")
        if not config.shaped_layers:
            assert [(p.shape["n"], p.per_token) for p in qkv] == [(config.qkv_dim, len(layers))]
        widths = {config.at(i).q_dim + (0 if config.at(i).kv_shared else 2 * config.at(i).kv_dim) for i in layers}
        assert widths <= {p.shape["n"] for p in problems if p.family == "gemv_q4" and p.shape["k"] == config.hidden_size}
    assert all(isinstance(note, str) for note in notes)


def test_a_gelu_mlp_tunes_the_geglu_epilogue_and_op():
    """A config whose ffn_activation is "gelu_tanh" (Gemma) runs its gate-up with gelu_mul, on every path, and
    the unfused GeGLU; "silu" is SwiGLU; an activation perfx has not is an error."""
    config = copy.copy(SYNTHETIC_MODELS["smollm2-135m"][0])
    assert config.ffn_activation == "silu"
    silu, _ = model_problems(config, SPECS)
    config.ffn_activation = "gelu_tanh"
    gelu, _ = model_problems(config, SPECS)
    for problems, epilogue, glu in ((silu, "silu_mul", "swiglu"), (gelu, "gelu_mul", "geglu")):
        gate_up = [p for p in problems if p.label == "gate_up"]
        assert gate_up and {p.shape["epilogue"] for p in gate_up} == {epilogue}
        assert {p.family for p in gate_up} >= {"gemv_q4", "gemm_q4_skinny", "gemm_q4_tiled"}
        assert {p.family for p in problems} & {"swiglu", "geglu"} == {glu}
        for problem in problems:
            assert _fits(SPECS[problem.family], problem.shape) is None
    config.ffn_activation = "relu2"
    with pytest.raises(PerfxError, match="FFN activation 'relu2' has no fused gate-up epilogue"):
        model_problems(config, SPECS)


def test_problems_skip_a_family_whose_shapes_have_other_keys():
    toy = Toy()
    config = SYNTHETIC_MODELS["smollm2-135m"][0]
    problems, notes = model_problems(config, {"rmsnorm": toy.spec(family="rmsnorm")})
    assert not problems and "rmsnorm: skipped" in notes[0]


def _parse(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_kernel_selection_by_name_and_prefix():
    assert set(select_specs("gemm_q4")) == {"gemm_q4_skinny", "gemm_q4_tiled", "gemm_q4_f16", "gemm_q4_lanes",
                                              "gemm_q4_i8"}
    assert set(select_specs("argmax, rmsnorm")) == {"argmax", "rmsnorm"}
    # gemm_q8 is a family and the anchor of the kinds the plan compares with it, so it names them all
    assert set(select_specs("gemm_q8")) == {"gemm_q8", "gemm_q8_lanes", "gemm_q8_i8"}
    assert set(select_specs("gemv_q4")) == {"gemv_q4"}   # not gemv_q4_split or _tail, which are no kinds of it
    assert select_specs(None) == SPECS
    with pytest.raises(PerfxError, match="unknown kernel family 'nope'"):
        select_specs("nope")


def test_tune_command_sweeps_exports_and_imports(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path / "cache"))
    args = _parse(tune, ["--model", "synthetic:smollm2-135m", "--kernels", "argmax", "--budget", "4",
                         "--json", "--export", str(tmp_path / "out.json")])
    assert tune.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    (problem,) = report["problems"]
    assert problem["family"] == "argmax" and problem["best"]["status"] == "ok"
    sweep = report["sweep"]   # where the time went, and candidates a minute
    assert sweep["candidates"] == problem["evaluated"] > 0 and sweep["candidates_per_minute"] > 0
    assert set(sweep["seconds"]) == {"setup", "build", "verify", "time", "drift", "confirm"}
    assert sweep["seconds"]["verify"] > 0 and sweep["seconds"]["time"] > 0
    assert tune.split_line(sweep).startswith(f"sweep: {sweep['candidates']} candidates in ")
    # Import into another cache: nothing is tuned, the entry is in force there.
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path / "other"))
    assert tune.main(_parse(tune, ["--import", str(tmp_path / "out.json")])) == 0
    assert "imported 1 tuning records" in capsys.readouterr().out
    assert default_database().choices(get_device(), SPECS["argmax"], problem["shape"])[0].source == "device"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(PerfxError, match=r"pip install \"perfx\[plot\]\""):
        plots.write_tuning_plots([], "/nonexistent", 1.0)


def test_bench_e2e_reports_end_to_end_figures(capsys):
    code = cli.main(["bench", "--model", "synthetic:tiny", "--kernels", "argmax", "--e2e", "--json"])
    data = json.loads(capsys.readouterr().out)
    e2e = data["e2e"]
    assert code == 0 and e2e["model"] == "synthetic:tiny"
    assert e2e["decode_tok_s"] > 0 and e2e["prefill_tok_s"] > 0 and e2e["device_bytes"] > e2e["weight_bytes"] > 0


def test_bench_e2e_at_a_context_sizes_the_cache_and_runs_at_its_end(capsys):
    """--ctx N: the memory figures of a cache of N positions (synthetic models too), the prompt and decode at
    its end; without --e2e it says what is missing."""
    code = cli.main(["bench", "--model", "synthetic:tiny", "--kernels", "argmax", "--e2e", "--ctx", "200", "--json"])
    e2e = json.loads(capsys.readouterr().out)["e2e"]
    c = SYNTHETIC_MODELS["tiny"][0]
    assert code == 0 and e2e["ctx"] == 200 and e2e["depth"] == 200 - 64 - 32 - 1
    assert e2e["kv_cache_bytes"] == 2 * 2 * c.n_layers * c.n_kv_heads * 200 * c.head_dim   # fp16 K and V
    assert e2e["decode_tok_s"] > 0 and e2e["device_bytes"] > e2e["kv_cache_bytes"]
    assert e2e["ttft_cold_s"] > 0   # the first prompt's, kernels built during it; the figures above time none
    # --kv q8: int8 codes and an fp16 scale per 32 of them
    code = cli.main(["bench", "--model", "synthetic:tiny", "--kernels", "argmax", "--e2e", "--ctx", "200", "--kv", "q8",
                     "--json"])
    q8 = json.loads(capsys.readouterr().out)["e2e"]
    assert code == 0 and q8["kv"] == "q8" and q8["kv_cache_bytes"] == e2e["kv_cache_bytes"] // 2 * 17 // 16
    assert q8["decode_tok_s"] > 0
    assert cli.main(["bench", "--model", "synthetic:tiny", "--ctx", "200"]) == 2
    assert "--ctx sizes the end-to-end run's cache: add --e2e" in capsys.readouterr().err


def test_bench_vs_defaults_interleaves_and_reports_the_gain_with_its_interval(capsys):
    code = cli.main(["bench", "--model", "synthetic:tiny", "--kernels", "rmsnorm", "--max-m", "1",
                     "--vs-defaults", "--rounds", "4", "--json"])
    data = json.loads(capsys.readouterr().out)
    (row,) = data["kernels"]
    assert code == 0 and row["rounds"] == 4
    low, high = row["gain_interval"]
    assert low <= row["gain"] <= high and row["defaults_time_s"] > 0 and row["tuned_time_s"] > 0
    assert cli.main(["bench", "--vs-defaults", "--rounds", "2"]) == 2
    assert "--rounds must be at least 4" in capsys.readouterr().err


def test_bench_marks_a_family_this_device_cannot_run_and_goes_on(device, tmp_path, monkeypatch, capsys):
    """A family with no parameter set that fits here (the tiled GEMM's tiles need 12 KiB of local memory or
    more; these limits allow 4 KiB) is marked, the others run, and bench (and report) exit 0."""
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"name": "small-local", "local_mem": 4096}))
    monkeypatch.setenv("PERFX_LIMITS", str(limits))
    argv = ["bench", "--device", device.entry.index, "--model", "synthetic:tiny", "--max-m", "1"]
    code = cli.main(argv + ["--kernels", "gemm_q4_tiled,rmsnorm", "--json"])
    rows = json.loads(capsys.readouterr().out)["kernels"]
    assert code == 0 and {r["family"] for r in rows} == {"gemm_q4_tiled", "rmsnorm"}
    assert all("no parameter set fits" in r["unsupported"] for r in rows if r["family"] == "gemm_q4_tiled")
    assert all(r["verified"] for r in rows if r["family"] == "rmsnorm")
    assert cli.main(argv + ["--kernels", "gemm_q4_tiled"]) == 0
    assert "not on this device" in capsys.readouterr().out


def test_tuning_off_runs_every_kernel_at_its_defaults(tmp_path, monkeypatch):
    """PERFX_TUNING=off and --no-tuning (load_model(tuning=False)) ignore every database, shipped ones too."""
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path))
    device = get_device()
    shape = {"m": 1, "k": 576, "residual": True}
    shipped = Database(tmp_path / "user", tmp_path / "shipped")
    shipped.save_result(device, result_record(SPECS["rmsnorm"], shape, {"WGS": 64, "VW": 8}, 1e-5, 2e-5,
                                              device.fingerprint))
    assert shipped.choices(device, SPECS["rmsnorm"], shape)[0].source == "device"
    assert [c.source for c in Database(tmp_path / "user", tmp_path / "shipped", enabled=False).choices(
        device, SPECS["rmsnorm"], shape)] == ["default"]
    model, _ = load_model("synthetic:tiny", device, ctx=16, progress=False, tuning=False)
    assert {choice.source for choice in model.plan.tuned.values()} == {"default"}
    monkeypatch.setenv("PERFX_TUNING", "off")
    assert not default_database().enabled
    monkeypatch.setenv("PERFX_TUNING", "on")
    assert default_database().enabled


def test_gemv_timings_rotate_copies_past_the_cache_and_verification_uploads_one(device, monkeypatch):
    """A decode step streams every weight from memory, so a GEMV timed on one weight in a loop (served from the
    cache) measures another kernel: the cases rotate through copies that together exceed twice the device's
    largest cache, uploaded only when the rotation reaches them."""
    from perfx.ops.q4_weight import Q4DeviceWeight
    from perfx.tuning.spec import copies_past_cache

    assert device.caps.cache_bytes > 0
    nbytes = 96 * 576 // 2 + 4 * 96 * (576 // 32)
    copies = copies_past_cache(device, nbytes)
    assert copies == min(256, -(-2 * device.caps.cache_bytes // nbytes)), copies
    assert copies_past_cache(device, 4 * device.caps.cache_bytes) == 1

    uploads = []
    real = Q4DeviceWeight.upload
    monkeypatch.setattr(Q4DeviceWeight, "upload", lambda *a, **k: uploads.append(1) or real(*a, **k))
    shape = {"n": 96, "k": 576, "group": 32, "epilogue": "none", "bias": False}
    case = SPECS["gemv_q4"].make_case(device, shape, __import__("numpy").random.default_rng(0))
    params = SPECS["gemv_q4"].params.defaults()
    assert case.errors(params)["y"] <= SPECS["gemv_q4"].tolerance
    assert len(uploads) == 1, "verification reads copy 0 only"
    for _ in range(5):
        case.rotate()
        for event in case.launch(params):
            event.wait()
    assert len(uploads) == 6, "each step of the rotation reaches a copy of its own"


def test_short_replays_go_on_round_the_copies_so_every_read_is_from_memory():
    """A screen replays a share of a case's copies: each replay, short or whole, starts where the last stopped,
    so no copy is read again before all the others were (the rotation a whole replay makes), and the time is
    per product, with every launch of a product (x's quantization first) kept together."""
    import contextlib

    from perfx.tuning.spec import rotating_case

    class Recorder:   # a device that records launches as the decode step's replay does
        queue = None

        @contextlib.contextmanager
        def record(self):
            self.recording = []
            yield self.recording

    class Step:
        def __init__(self, copy, kind):
            self.copy, self.kind = copy, kind

        def enqueue(self, queue):
            return (self.copy, self.kind)

    recorder, copies = Recorder(), 8

    def launch_copy(i, params):
        recorder.recording += [Step(i, "quantize"), Step(i, "gemv")]

    case = rotating_case(np.zeros(1), None, copies, launch_copy, device=recorder)
    read = []
    for products in (2, 2, 8, 3, 1, 8):
        events = case.steady({"X": 0}, products)
        assert [kind for _, kind in events] == ["quantize", "gemv"] * products
        read += [copy for copy, kind in events if kind == "gemv"]
    assert read == [i % copies for i in range(len(read))]

    timed = []

    def timer(launch, **kwargs):
        timed.append(len(launch()) // 2)
        return Timing(8e-6, [8e-6])
    assert time_case(case, {"X": 0}, timer, share=0.25).median_s == pytest.approx(4e-6) and timed == [2]
    assert time_case(case, {"X": 0}, timer).median_s == pytest.approx(1e-6) and timed == [2, 8]


class Timed:
    """Kernels with given times (a little noise) for ``--refresh``: X = 1 is faster than the defaults (X = 0),
    X = 2 slower, X = 3 fastest but wrong on the current source."""

    TIMES = {0: 100e-6, 1: 70e-6, 2: 130e-6, 3: 50e-6}

    def __init__(self):
        self.rng, self.current = np.random.default_rng(0), None

    def spec(self) -> Spec:
        space = ParamSpace(family="timed", source="copy.cl", space={"X": tuple(self.TIMES)})
        return Spec(params=space, make_case=self.make_case, tolerance=1e-6, tolerance_why="exact or off by 1",
                    test_shapes=({"n": 1},), bytes_moved=lambda s: 1000, reference=np.ones_like,
                    fuzz_shapes=lambda st: st.just({"n": 1}), oclgrind_shapes=({"n": 1},))

    def make_case(self, device, shape, rng) -> Case:
        def launch(params):
            self.current = params["X"]
            return []
        return Case(expected={"y": np.ones(1)}, run=lambda params: {"y": np.ones(1) + (params["X"] == 3)},
                    launch=launch)

    def timer(self, launch, warmup=2, repeat=10, rotate=None, max_seconds=None) -> Timing:
        launch()
        samples = self.TIMES[self.current] * np.exp(0.03 * self.rng.standard_normal(repeat))
        return Timing(float(np.median(samples)), [float(v) for v in samples])


def test_refresh_keeps_stale_entries_that_still_verify_and_win_and_resumes(device, db):
    bench = Timed()
    spec = bench.spec()
    stale = [{"family": "timed", "shape": {"n": n}, "params": {"X": x}, "source_hash": "0" * 64}
             for n, x in ((1, 1), (2, 2), (3, 3), (4, 9), (5, 0))]
    current = {"family": "timed", "shape": {"n": 6}, "params": {"X": 1}, "source_hash": source_hash(spec)}
    db.shipped_dir.mkdir(parents=True)
    write_json_atomic(db.shipped_dir / "this.json", {"perfx_tuning": FORMAT, "match": {"device": device.fingerprint},
                                                     "records": stale + [current]})
    entries = db.stale_records(device, {"timed": spec})
    assert [r["shape"]["n"] for _, r in entries] == [1, 2, 3, 4, 5]   # the current record is not stale
    tuner = Tuner(device, db, timer=bench.timer, reference=lambda: 1e-3, cool_down_s=0)
    results = {r.shape["n"]: r for r in tuner.refresh(entries)}
    assert [n for n, r in results.items() if r.kept] == [1, 5]
    assert 1.3 < results[1].gain < 1.5 and results[1].rounds == tuner.confirm_rounds
    assert results[2].reason.startswith("slower than the defaults")
    # an entry the defaults beat gives way to them, timed: the kernel keeps a time for this shape
    replaced = db.device_file(device).find("timed", {"n": 2})
    assert replaced["params"] == {"X": 0} and replaced["source_hash"] == source_hash(spec)
    assert 90e-6 < replaced["time_s"] < 110e-6
    assert "failed on the current source: wrong" in results[3].reason
    assert results[4].reason.startswith("no longer valid")
    assert results[5].kept and results[5].reason == "the defaults, timed again"   # its time picks kernels
    assert 90e-6 < results[5].time_s < 110e-6 and results[5].gain == 1.0
    # The kept entry is this device's own, pinned to the current source, and in force again.
    saved = db.device_file(device).find("timed", {"n": 1})
    assert saved["source_hash"] == source_hash(spec) and saved["params"] == {"X": 1} and "refreshed" in saved["comment"]
    choice = db.choices(device, spec, {"n": 1})[0]
    assert choice.source == "device" and choice.params == {"X": 1}
    # Run again: what was kept is not checked again (an interrupted refresh resumes); the rest are.
    assert [r["shape"]["n"] for _, r in db.stale_records(device, {"timed": spec})] == [3, 4]


def test_tune_refresh_command_checks_a_stale_entry_on_the_device(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path / "cache"))
    device, spec = get_device(), SPECS["argmax"]
    database = default_database()
    shape = {"n": 1003}
    database.save_result(device, {**result_record(spec, shape, {"WGS3": 64, "GROUPS3": 16}, 1e-5, 1e-5,
                                                  device.fingerprint), "source_hash": "0" * 64})
    assert tune.main(_parse(tune, ["--refresh", "--kernels", "argmax", "--json"])) == 0
    report = json.loads(capsys.readouterr().out)
    (entry,) = [e for e in report["entries"] if e["shape"] == shape]
    assert entry["params"]["WGS3"] == 64 and entry["rounds"] == 7 and entry["gain"] > 0
    saved = default_database().device_file(device).find("argmax", shape)
    assert (saved["source_hash"] == source_hash(spec)) == entry["kept"]
    with pytest.raises(PerfxError, match="drop --model"):
        tune.main(_parse(tune, ["--refresh", "--model", "default"]))


def test_the_sweep_summary_says_which_prompt_gemm_the_model_runs_per_bucket():
    """`perfx tune` ends with the GEMM kind the model runs per matrix and bucket by the sweep's times: int4 (the
    fastest of the kinds timed beside skinny) and int8 (the fastest of skinny, lanes and, at a batched step's few
    rows, i8), apart where one matrix role has layers of both forms; at a batched step's bucket, by the worst ratio
    over the Ms it serves, as the model chooses (``perfx.plan.one_run_costs``), not by the middle M alone."""
    from types import SimpleNamespace

    from perfx.commands.tune import crossover_lines

    def result(family, label, m, time_s, served=None):
        return SimpleNamespace(family=family, label=label, shape={"m": m}, time_s=time_s,
                               confirmation=SimpleNamespace(served=served) if served else None)
    lines = crossover_lines([
        result("gemm_q4_skinny", "down", 33, 2e-4), result("gemm_q4_tiled", "down", 33, 3e-4),
        result("gemm_q4_lanes", "down", 33, 1e-4), result("gemm_q8", "down", 33, 1e-3),
        result("gemm_q8_lanes", "down", 33, 5e-4), result("gemm_q8", "qkv", 9, 1e-4),
        result("gemm_q8_lanes", "qkv", 9, 2e-4), result("gemm_q8", "qkv", 33, 1e-4),
        result("gemm_q8", "lm_head", 3, 2e-3), result("gemm_q8_lanes", "lm_head", 3, 3e-3),
        result("gemm_q8_i8", "lm_head", 3, 1e-3)])
    assert lines == ["  down: M=33: lanes, M=33: int8 lanes", "  lm_head: M=3: int8 i8", "  qkv: M=9: int8 skinny"]
    # i8 twice as fast at M = 3 but 2.5 times as slow at M = 2: skinny runs (worst 2x against 2.5x), tiled untimed
    lines = crossover_lines([
        result("gemm_q4_skinny", "o", 3, 2e-4, served={2: 1e-4, 3: 2e-4, 4: 2e-4}),
        result("gemm_q4_i8", "o", 3, 1e-4, served={2: 2.5e-4, 3: 1e-4, 4: 1.5e-4}),
        result("gemm_q4_skinny", "o", 9, 4e-4, served={9: 4e-4}), result("gemm_q4_i8", "o", 9, 3e-4, served={9: 3e-4})])
    assert lines == ["  o: M=3: skinny, M=9: i8"]


def test_info_says_which_int8_prompt_gemm_the_model_runs():
    """`perfx info` counts an int8 matrix for lanes only where one file timed both kinds at its shape, as the
    model decides (a lanes time of another file, or a stale one, does not count)."""
    from perfx.commands.info import gemm_choice_lines

    def entry(family, m, time_s, file="a.json", note="", served=None, n=64):
        return {"family": family, "shape": {"m": m, "n": n, "k": 64, "group": 32, "f32": False, "epilogue": "none"},
                "time_s": time_s, "file": file, "note": note, "served": served or {}}
    lines = gemm_choice_lines([entry("gemm_q8", 33, 2e-4), entry("gemm_q8_lanes", 33, 1e-4),
                               entry("gemm_q8", 9, 2e-4), entry("gemm_q8_lanes", 9, 1e-4, file="b.json"),
                               entry("gemm_q8", 3, 2e-4), entry("gemm_q8_lanes", 3, 1e-4, note="stale: ...")])
    assert [line for line in lines if "int8" in line][:-1] == ["M ≈   33: int8 lanes fastest for 1 matrix"]
    # lanes faster at M = 3 but twice as slow at M = 2: gemm_q8 runs, as the model decides (perfx.plan.one_run_costs)
    lines = gemm_choice_lines([entry("gemm_q8", 3, 2e-4, served={2: 1e-4, 3: 2e-4, 4: 2e-4}),
                               entry("gemm_q8_lanes", 3, 1e-4, served={2: 2e-4, 3: 1e-4, 4: 1.5e-4})])
    assert [line for line in lines if "int8" in line][:-1] == ["M ≈    3: int8 skinny fastest for 1 matrix"]


# -- sweeps that find more in the same time: builds ahead, pruning, order, where the time goes -------------------

def test_candidates_are_built_ahead_together_and_still_each_verified_before_timed(device, db, monkeypatch):
    """With the spec naming its programs, no candidate's build waits in its own run: batches of them are built by
    ``build_many`` (here on 2 threads) ahead; a broken one is still reported as a build failure, a wrong one as
    wrong, and only verified ones are timed."""
    monkeypatch.setenv("PERFX_BUILD_WORKERS", "2")
    fresh = Device(device.entry.index)    # nothing built in this process
    toy = Toy(through_device=True)
    batches, in_batches = [], []
    build_many = fresh.build_many

    def counted(requests, *args, **kwargs):
        batches.append(len(requests))
        compiled = fresh.compile_seconds()   # a failed build is built again alone, in this thread
        report = build_many(requests, *args, **kwargs)
        in_batches.append(fresh.compile_seconds() - compiled)
        return report
    monkeypatch.setattr(fresh, "build_many", counted)
    tuner = quiet_tuner(fresh, db, budget_s=60, background_builds=False)
    result = tuner.tune_problem(toy.spec(), SHAPE)
    assert result.complete and result.best.params["MODE"] == "good"
    statuses = {o.params["MODE"]: o.status for o in result.outcomes}
    assert statuses["wrong"] == "wrong" and statuses["broken"] == "build"
    # the toy's nine sets, each built once: as many as build at once for the first, then the rest together
    assert sum(batches) == 9 and batches[0] == 2 and len(batches) == 2, batches
    assert fresh.compile_seconds() == pytest.approx(sum(in_batches)), "a build ran in a candidate's run: not ahead"
    launches = {params_key(dict(k)): count for k, count in toy.launches.items()}
    for outcome in result.outcomes:   # a rejected set launched once, by its verification, and never timed
        assert (launches[params_key(outcome.params)] > 1) == (outcome.status in ("ok", "slow")), outcome
    report = tuner.report([result])
    assert report["candidates"] == 9 and report["candidates_per_minute"] > 0
    assert report["seconds"]["build"] > 0 and report["seconds"]["verify"] > 0 and report["seconds"]["time"] > 0
    assert report["seconds"]["confirm"] > 0
    assert abs(sum(report["seconds"].values()) + report["other_s"] - report["wall_s"]) < 1e-2
    assert result.seconds["build"] == pytest.approx(report["seconds"]["build"], abs=1e-3)


def test_no_more_is_built_ahead_than_the_budget_is_likely_to_run(device, db, monkeypatch):
    monkeypatch.setenv("PERFX_BUILD_WORKERS", "2")
    fresh = Device(device.entry.index)
    batches = []
    build_many = fresh.build_many
    monkeypatch.setattr(fresh, "build_many", lambda requests, *a, **k: (batches.append(len(requests)),
                                                                         build_many(requests, *a, **k))[1])
    result = quiet_tuner(fresh, db, budget_s=0).tune_problem(Toy(through_device=True).spec(), SHAPE)
    assert len(result.outcomes) == 1 and batches == [2], batches   # the defaults, and one more at once


def test_a_sweeps_programs_are_forgotten_past_the_bound(device, db, monkeypatch):
    """Memory stays bounded: before a batch is built the device forgets its programs once it keeps PROGRAMS_KEPT,
    and after a problem; the candidates still verify and time from pyopencl's cache."""
    from perfx.tuning import tuner as tuner_module
    monkeypatch.setattr(tuner_module, "PROGRAMS_KEPT", 2)
    fresh = Device(device.entry.index)
    kept_at_builds = []
    build_many = fresh.build_many
    monkeypatch.setattr(fresh, "build_many", lambda requests, *a, **k: (kept_at_builds.append(fresh.programs_kept),
                                                                         build_many(requests, *a, **k))[1])
    space = {"WGS": (16, 32, 64), "MODE": ("good", "wrong"), "PAD": (0, 1, 2)}
    tuner = quiet_tuner(fresh, db, budget_s=60, repeat=2)
    result = tuner.tune_problem(Toy(through_device=True).spec(space=space), SHAPE)
    assert result.complete and result.chosen["MODE"] == "good" and len(result.outcomes) == 18
    assert len(kept_at_builds) > 1 and max(kept_at_builds) < 2 and fresh.programs_kept == 0, kept_at_builds


def test_builds_in_a_thread_beside_the_runs_as_on_a_gpu(device, db, monkeypatch):
    """On a GPU-class device the next batch builds while the one before runs; the sweep is the same, and an
    interrupted one resumes without running a finished candidate again."""
    monkeypatch.setenv("PERFX_BUILD_WORKERS", "1")
    fresh = Device(device.entry.index)
    toy = Toy(through_device=True)
    space = {"WGS": (16, 32, 64), "MODE": ("good", "wrong", "broken"), "PAD": tuple(range(8))}
    spec = toy.spec(space=space)
    toy.interrupt_at = 30
    first = quiet_tuner(fresh, db, budget_s=60, background_builds=True, repeat=2)
    with pytest.raises(KeyboardInterrupt):
        first.tune_problem(spec, SHAPE)
    assert first.background_build_s > 0   # the thread's builds, waited for when interrupted
    done = {params_key(c["params"]) for c in
            json.loads(db.log_path(fresh.fingerprint).read_text())["problems"][0]["candidates"]}
    assert len(done) == 29
    toy.interrupt_at, toy.runs = None, {}
    tuner = quiet_tuner(fresh, db, budget_s=120, background_builds=True, repeat=2)
    result = tuner.tune_problem(spec, SHAPE)
    assert result.complete and result.resumed == 29 and len(result.outcomes) == 72
    assert not done & {params_key(dict(k)) for k in toy.runs}
    assert {o.status for o in result.outcomes if o.params["MODE"] == "broken"} == {"build"}


def test_sets_the_device_cannot_run_or_its_driver_refused_are_pruned_unbuilt(device, db):
    toy = Toy()
    space = {"WGS": (16, 32, 64, 1 << 20), "MODE": ("good", "wrong")}   # no device runs 2^20 work-items a group
    spec = toy.spec(space=space)
    db.refuse(device, spec, {"WGS": 32, "MODE": "good"}, "failed to build (a driver's bug)")
    result = quiet_tuner(device, db, budget_s=60).tune_problem(spec, SHAPE)
    assert result.pruned == 3 and len(result.outcomes) == 5
    never = {params_key(p) for p in ({"WGS": 1 << 20, "MODE": "good"}, {"WGS": 1 << 20, "MODE": "wrong"},
                                      {"WGS": 32, "MODE": "good"})}
    assert not never & {params_key(dict(k)) for k in toy.runs} and not never & {params_key(dict(k)) for k in toy.built}


def test_likely_winners_run_first_the_entries_in_force_then_other_devices(device, db):
    """After the defaults: this device's entry, then any device's entry for the most alike shape, then the
    rest at random."""
    toy = Toy()
    spec = toy.spec(space={"WGS": (16, 32, 64, 128), "MODE": ("good", "wrong"), "PAD": (0, 1, 2)})
    mine = {"WGS": 128, "MODE": "good", "PAD": 2}
    near, far = {"WGS": 64, "MODE": "good", "PAD": 1}, {"WGS": 32, "MODE": "good", "PAD": 0}
    db.save_result(device, result_record(spec, SHAPE, mine, 1e-5, 2e-5, device.fingerprint))
    other = {"platform": "Other", "device": "A phone GPU", "opencl_c_version": "OpenCL C 3.0",
             "driver_version": "1"}
    records = [result_record(spec, {"n": 4000}, far, 1e-5, 2e-5, other),
               result_record(spec, {"n": 1100}, near, 1e-5, 2e-5, other)]
    write_json_atomic(db.shipped_dir / "a-phone.json", {"perfx_tuning": FORMAT, "match": {"device": other},
                                                        "records": records})
    db = Database(db.user_dir, db.shipped_dir)
    quiet_tuner(device, db, budget_s=60, repeat=2).tune_problem(spec, SHAPE)
    ran = [dict(k) for k in toy.runs]
    assert ran[:4] == [spec.params.defaults(), mine, near, far], ran[:4]


def test_a_buckets_gemm_kind_is_chosen_by_its_worst_m_not_the_representative_alone():
    """The plan compares a bucket's GEMM kinds at each M the bucket serves (M = 2, 3, 4 for M ≤ 4, the batched decode
    steps of 2 to 4 sequences), by each kind's worst ratio to the fastest: a kind faster at the representative
    M = 3 but slower at M = 2 (the masked passes' lanes GEMM against the int8 one) loses, where the representative's
    time alone chose it. A record without those times has all compared at the representative, as before; so are
    times of another file or another M."""
    from perfx.plan import one_run_costs
    from perfx.tuning.database import Choice, served_ms

    assert served_ms(3) == (2, 3, 4) and served_ms(9) == (5, 9, 16) and served_ms(1) == (1,) and served_ms(33) == (33,)

    def choice(time_s, served=None, file="a.json", exact=True):
        return Choice({}, "device", "", time_s, exact=exact, file=file, served=served or {})
    lanes = choice(0.8e-3, {2: 1.6e-3, 3: 0.8e-3, 4: 1.1e-3})
    i8 = choice(1.0e-3, {2: 0.9e-3, 3: 1.0e-3, 4: 1.2e-3})
    skinny = choice(1.5e-3, {2: 1.2e-3, 3: 1.5e-3, 4: 2.0e-3})
    costs = one_run_costs({"skinny": skinny, "lanes": lanes, "i8": i8}, "skinny")
    assert min(costs, key=costs.get) == "i8"
    assert costs["i8"] == pytest.approx(1.25) and costs["lanes"] == pytest.approx(1.6 / 0.9)
    # the representative alone (a record without its bucket's times among them): lanes, as the old rule chose
    old = one_run_costs({"skinny": skinny, "lanes": lanes, "i8": choice(1.0e-3)}, "skinny")
    assert min(old, key=old.get) == "lanes" and old["lanes"] == 1.0
    # times of another file, or of the nearest M rather than this one, are not compared
    assert set(one_run_costs({"skinny": skinny, "lanes": choice(1e-4, file="b.json"),
                              "i8": choice(1e-4, exact=False)}, "skinny")) == {"skinny"}
    assert one_run_costs({"skinny": choice(1e-3, exact=False), "i8": i8}, "skinny") == {}


class Served(Timed):
    """``Timed`` with a shape of rows: a launch takes its set's time once a row, so each M has its own."""

    def spec(self) -> Spec:
        return dataclasses.replace(super().spec(), compared_kind=True)

    def make_case(self, device, shape, rng) -> Case:
        def launch(params):
            self.current = (params["X"], shape["m"])
            return []
        return Case(expected={"y": np.ones(1)}, run=lambda params: {"y": np.ones(1) + (params["X"] == 3)},
                    launch=launch)

    def timer(self, launch, warmup=2, repeat=10, rotate=None, max_seconds=None) -> Timing:
        launch()
        x, m = self.current
        samples = m * self.TIMES[x] * np.exp(0.03 * self.rng.standard_normal(repeat))
        return Timing(float(np.median(samples)), [float(v) for v in samples])


def test_refresh_times_a_gemm_kinds_entry_at_each_m_its_bucket_serves(device, db):
    """A family compared by kind (``Spec.compared_kind``) is refreshed with its times at each M its bucket serves,
    each of one run: a current entry of the bucket M ≤ 4 timed at its representative alone is due for a refresh
    (the plan could not compare it at M = 2 and 4), one of a bucket timed at one M is not; once refreshed, nothing
    is due."""
    bench = Served()
    spec = bench.spec()
    current = source_hash(spec)
    records = [{"family": "timed", "shape": {"m": m, "n": 1}, "params": {"X": 1}, "source_hash": current,
                "time_s": 1e-4} for m in (3, 33)]
    db.shipped_dir.mkdir(parents=True)
    write_json_atomic(db.shipped_dir / "this.json", {"perfx_tuning": FORMAT, "match": {"device": device.fingerprint},
                                                     "records": records})
    entries = db.stale_records(device, {"timed": spec})
    assert [r["shape"]["m"] for _, r in entries] == [3]
    tuner = Tuner(device, db, timer=bench.timer, reference=lambda: 1e-3, cool_down_s=0)
    (result,) = tuner.refresh(entries)
    assert result.kept and sorted(result.served) == [2, 3, 4]
    for m, time_s in result.served.items():
        assert 0.9 * m * 70e-6 < time_s < 1.1 * m * 70e-6
    saved = db.device_file(device).find("timed", {"m": 3, "n": 1})
    assert {int(m) for m in saved["served_times_s"]} == {2, 3, 4}
    # a current entry keeps its parameters and time as its sweep measured them
    assert saved["params"] == {"X": 1} and saved["time_s"] == 1e-4 and saved["source_hash"] == current
    assert db.choices(device, spec, {"m": 3, "n": 1})[0].served == {m: t for m, t in result.served.items()}
    assert db.stale_records(device, {"timed": spec}) == []


def test_a_sweep_of_a_gemm_kind_records_its_times_at_each_m_its_bucket_serves(device, db):
    """A sweep's confirmation times the chosen set of a family compared by kind at each M of its bucket (M = 2, 3, 4
    for M ≤ 4), verified there first; a bucket above 16 rows keeps the representative's time alone."""
    bench = Served()
    spec = dataclasses.replace(bench.spec(), make_case=bench.make_case)
    tuner = Tuner(device, db, timer=bench.timer, reference=lambda: 1e-3, cool_down_s=0)
    result = tuner.tune_problem(spec, {"m": 3, "n": 1})
    assert result.chosen == {"X": 1} and sorted(result.confirmation.served) == [2, 3, 4]
    saved = db.device_file(device).find("timed", {"m": 3, "n": 1})
    assert {int(m): t for m, t in saved["served_times_s"].items()} == result.confirmation.served
    assert saved["served_times_s"]["2"] < saved["served_times_s"]["4"]   # each M's own case
    tuner.tune_problem(spec, {"m": 33, "n": 1})
    assert "served_times_s" not in db.device_file(device).find("timed", {"m": 33, "n": 1})
