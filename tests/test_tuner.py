"""The autotuner: verified candidates only, reasons recorded, resumable sweeps, budget, model problems."""

import json

import pytest

from perfx.config import ModelConfig
from perfx.tuning import specs
from perfx.tuning.database import M_BUCKETS, Database, bucket_representative, m_bucket, params_key
from perfx.tuning.problems import KNOWN_CONFIGS, _fits, model_problems
from perfx.tuning.tuner import Tuner, neighbours
from toy_tuning import Toy

pytestmark = pytest.mark.one_implementation  # model-level: the default device only

SHAPE = {"n": 1000}


@pytest.fixture
def db(tmp_path):
    return Database(tmp_path / "user", tmp_path / "shipped")


def test_never_selects_wrong_or_broken_and_records_why(device, db):
    toy = Toy()
    spec = toy.spec()
    result = Tuner(device, db, budget_s=60).tune_problem(spec, SHAPE)
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
    # What the database holds says the same, and the look-up returns the verified best.
    saved = json.loads(db.device_path(device.fingerprint).read_text())["records"][0]
    assert {c["status"] for c in saved["candidates"]} >= {"ok", "wrong", "build"}
    assert saved["params"]["MODE"] == "good" and saved["complete"]
    choice = db.lookup(device, spec, SHAPE)
    assert choice.source == "device" and choice.params == result.best.params


def test_a_wrong_answer_is_caught_even_when_it_is_the_only_candidate(device, db):
    toy = Toy()
    spec = toy.spec(space={"WGS": (16,), "MODE": ("wrong",)})
    result = Tuner(device, db, budget_s=30).tune_problem(spec, SHAPE)
    assert result.best is None and not result.complete
    assert db.lookup(device, spec, SHAPE).source == "default"


def test_interrupted_sweep_resumes_without_retiming(device, db):
    toy = Toy()
    spec = toy.spec()
    toy.interrupt_at = 5  # Ctrl-C during the fifth candidate's verification
    with pytest.raises(KeyboardInterrupt):
        Tuner(device, db, budget_s=60).tune_problem(spec, SHAPE)
    saved = json.loads(db.device_path(device.fingerprint).read_text())["records"][0]
    done = {params_key(c["params"]) for c in saved["candidates"]}
    assert len(done) == 4 and not saved["complete"]

    toy.interrupt_at, toy.runs, toy.launches = None, {}, {}
    result = Tuner(device, db, budget_s=60).tune_problem(spec, SHAPE)
    assert result.resumed == 4 and result.complete and len(result.outcomes) == 9
    again = {params_key(dict(k)) for k in list(toy.runs) + list(toy.launches)}
    assert not done & again, "a finished candidate was run again"
    assert len(toy.runs) == 5
    # A third run finds the record complete and runs nothing at all.
    toy.runs, toy.launches = {}, {}
    result = Tuner(device, db, budget_s=60).tune_problem(spec, SHAPE)
    assert result.complete and not toy.runs and not toy.launches


def test_budget_spent_times_the_defaults_then_the_next_sweep_goes_on(device, db):
    toy = Toy()
    spec = toy.spec()
    first = Tuner(device, db, budget_s=0).tune_problem(spec, SHAPE)
    assert [o.params for o in first.outcomes] == [spec.defaults()] and not first.complete
    assert first.best.params == spec.defaults() and first.speedup == 1.0
    second = Tuner(device, db, budget_s=60).tune_problem(spec, SHAPE)
    assert second.complete and second.resumed == 1 and len(second.outcomes) == 9


def test_random_sampling_then_local_refinement_on_a_large_space(device, db):
    toy = Toy()
    space = {"WGS": (16, 32, 64, 128), "MODE": ("good", "wrong", "broken"), "PAD": (0, 1, 2, 3, 4)}
    spec = toy.spec(space=space)
    tuner = Tuner(device, db, budget_s=60, exhaustive_limit=8, random_samples=4, repeat=3)
    result = tuner.tune_problem(spec, SHAPE)
    assert result.complete and result.best.params["MODE"] == "good"
    assert 5 <= len(result.outcomes) < 60
    # Converged: no neighbour of the best is untried.
    tried = {params_key(o.params) for o in result.outcomes}
    assert all(params_key(p) in tried for p in neighbours(space, result.best.params))


def test_neighbours_move_one_parameter_one_step():
    space = {"A": (1, 2, 3), "B": ("x", "y")}
    assert neighbours(space, {"A": 2, "B": "x"}) == [{"A": 1, "B": "x"}, {"A": 3, "B": "x"}, {"A": 2, "B": "y"}]


def test_m_buckets_and_their_representatives():
    assert [m_bucket(m) for m in (1, 2, 4, 5, 16, 17, 64, 65, 256, 257, 5000)] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    for i in range(len(M_BUCKETS)):
        assert m_bucket(bucket_representative(i)) == i


@pytest.mark.parametrize("name", sorted(KNOWN_CONFIGS))
def test_problems_of_a_hand_made_config_fit_the_specs(name):
    config = ModelConfig(**KNOWN_CONFIGS[name])
    families = specs()
    problems, notes = model_problems(config, families)
    assert problems
    for problem in problems:
        assert _fits(families[problem.family], problem.shape) is None
        families[problem.family].bytes_moved(problem.shape)
    if "gemm_q4_skinny" in families:
        ms = {p.shape["m"] for p in problems if p.family == "gemm_q4_skinny"}
        assert len(ms) == len(M_BUCKETS)
    if "gemv_q4" in families:
        qkv = next(p for p in problems if p.family == "gemv_q4" and p.label == "qkv")
        assert qkv.shape["n"] == config.qkv_dim and qkv.per_token == config.n_layers
    assert all(isinstance(note, str) for note in notes)


def test_problems_skip_a_family_whose_shapes_have_other_keys():
    toy = Toy()
    config = ModelConfig(**KNOWN_CONFIGS["smollm2-135m"])
    problems, notes = model_problems(config, {"rmsnorm": toy.spec(family="rmsnorm")})
    assert not problems and "rmsnorm: skipped" in notes[0]


def _parse(module, argv):
    import argparse
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_kernel_selection_by_name_and_prefix():
    from perfx.errors import PerfxError
    from perfx.tune import select_families

    families = specs()
    if {"gemm_q4_skinny", "gemm_q4_tiled"} <= set(families):
        assert set(select_families("gemm_q4")) == {"gemm_q4_skinny", "gemm_q4_tiled"}
    with pytest.raises(PerfxError, match="unknown kernel family 'nope'"):
        select_families("nope")


def test_tune_command_sweeps_exports_and_imports(tmp_path, monkeypatch, capsys):
    import perfx.tune as tune

    monkeypatch.setenv("PERFX_CACHE", str(tmp_path / "cache"))
    args = _parse(tune, ["--model", "synthetic:smollm2-135m", "--kernels", "argmax", "--budget", "4",
                         "--json", "--export", str(tmp_path / "out.json")])
    assert tune.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    (problem,) = report["problems"]
    assert problem["family"] == "argmax" and problem["best"]["status"] == "ok"
    # Import into another cache: nothing is tuned, the entry is in force there.
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path / "other"))
    assert tune.main(_parse(tune, ["--import", str(tmp_path / "out.json")])) == 0
    assert "imported 1 tuning records" in capsys.readouterr().out
    from perfx.runtime import get_device
    from perfx.tuning.database import lookup
    assert lookup(get_device(), "argmax", problem["shape"]).source == "device"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    import builtins

    from perfx import plots
    from perfx.errors import PerfxError

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(PerfxError, match=r"pip install \"perfx\[plot\]\""):
        plots.write_tuning_plots([], "/nonexistent", 1.0)


def test_bench_e2e_reports_end_to_end_figures(capsys):
    from perfx import cli

    code = cli.main(["bench", "--model", "synthetic:tiny", "--kernels", "argmax", "--e2e", "--json"])
    data = json.loads(capsys.readouterr().out)
    e2e = data["e2e"]
    assert code == 0 and e2e["model"] == "synthetic:tiny"
    assert e2e["decode_tok_s"] > 0 and e2e["prefill_tok_s"] > 0 and e2e["device_bytes"] > e2e["weight_bytes"] > 0
