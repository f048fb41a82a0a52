"""The tuning database: fallback order, stale entries, corrupt files, atomic writes, export/import."""

import dataclasses
import importlib.util
import json
import os
import warnings
from pathlib import Path

import pytest

from perfx import resources
from perfx.errors import PerfxError
from perfx.ops.gemv_q8 import GemvQ8
from perfx.ops.params import Checked, ParamSpace, Rule
from perfx.tuning import SPECS
from perfx.tuning import database as dbmod
from perfx.tuning.database import (FORMAT, Database, TuningDatabaseWarning, default_database, fingerprint_slug, merge,
                                   result_record, results_json, source_hash)
from perfx.resources import write_json_atomic
from toy_tuning import Toy, quiet_tuner

pytestmark = pytest.mark.one_implementation  # model-level: the default device only

SHAPE = {"n": 1000}


class FakeDevice:
    """The real device's capabilities under another name, architecture and vendor."""

    def __init__(self, device, name="Phone GPU", driver="1.0", architecture="adreno-7xx", vendor="qualcomm"):
        self.caps = dataclasses.replace(device.caps, name=name, driver_version=driver,
                                        architecture=architecture, vendor_key=vendor)
        self.fingerprint = {"platform": "Test", "device": name, "opencl_c_version": "OpenCL C 3.0",
                            "driver_version": driver}


@pytest.fixture
def toy():
    return Toy()


@pytest.fixture
def db(tmp_path):
    return Database(tmp_path / "user", tmp_path / "shipped")


def write(path, match, records, **extra):
    write_json_atomic(path, {"perfx_tuning": FORMAT, "match": match, **extra, "records": records})


def record(spec, params, shape=SHAPE, hashed=True, time_s=None):
    return {"family": spec.params.family, "shape": shape, "params": params,
            "source_hash": source_hash(spec) if hashed else None, "time_s": time_s}


def test_fallback_order_device_architecture_vendor_default(device, db, toy):
    spec, phone = toy.spec(), FakeDevice(device)
    write(db.device_path(phone.fingerprint), {"device": phone.fingerprint}, [record(spec, {"WGS": 64})],
          architecture="adreno-7xx", vendor="qualcomm")
    write(db.shipped_dir / "adreno-7xx.json", {"architecture": "adreno-7xx"}, [record(spec, {"WGS": 32}, None, False)])
    write(db.shipped_dir / "qualcomm.json", {"vendor": "qualcomm"}, [record(spec, {"WGS": 16, "MODE": "good"},
                                                                          None, False)])
    write(db.shipped_dir / "other.json", {"architecture": "adreno-6xx"}, [record(spec, {"WGS": 99}, None, False)])
    seen = []
    for remove in (db.device_path(phone.fingerprint), db.shipped_dir / "adreno-7xx.json",
                   db.shipped_dir / "qualcomm.json", None):
        choice = db.choices(phone, spec, SHAPE)[0]
        seen.append((choice.source, choice.params["WGS"]))
        if remove is not None:
            remove.unlink()
    assert seen == [("device", 64), ("architecture", 32), ("vendor", 16), ("default", 16)]
    # The same device file, seen from another driver of the same architecture, is an architecture entry.
    write(db.device_path(phone.fingerprint), {"device": phone.fingerprint}, [record(spec, {"WGS": 64})],
          architecture="adreno-7xx", vendor="qualcomm")
    other = FakeDevice(device, driver="2.0")
    assert db.choices(other, spec, SHAPE)[0].source == "architecture"


def test_invalid_params_fall_through_to_the_next_level(device, db, toy):
    spec, phone = toy.spec(), FakeDevice(device)
    write(db.shipped_dir / "adreno-7xx.json", {"architecture": "adreno-7xx"},
          [record(spec, {"WGS": 48}, None, False)])  # not in the space
    write(db.shipped_dir / "qualcomm.json", {"vendor": "qualcomm"}, [record(spec, {"WGS": 32}, None, False)])
    choice = db.choices(phone, spec, SHAPE)[0]
    assert (choice.source, choice.params["WGS"]) == ("vendor", 32)
    small = dataclasses.replace(spec.params, space={"WGS": (16, 32), "MODE": ("good",)},
                                rules=(Rule("at most 16 work-items", lambda p, s: p["WGS"] <= 16),))
    choice = db.choices(phone, dataclasses.replace(spec, params=small), SHAPE)[0]
    assert choice.source == "default" and choice.params == {"WGS": 16, "MODE": "good"}
    assert any("at most 16 work-items" in why for why in choice.skipped), choice.skipped


def test_stale_entry_is_ignored_and_retuned(device, db, toy):
    spec = toy.spec()
    stale = {**record(spec, {"WGS": 64}), "source_hash": "0" * 64}
    write(db.device_path(device.fingerprint), {"device": device.fingerprint}, [stale],
          architecture=device.caps.architecture, vendor=device.caps.vendor_key)
    assert db.choices(device, spec, SHAPE)[0].source == "default"
    result = quiet_tuner(device, db, budget_s=60).tune_problem(spec, SHAPE)
    assert result.resumed == 0 and len(result.outcomes) == 9
    saved = json.loads(db.device_path(device.fingerprint).read_text())["records"]
    assert len(saved) == 1 and saved[0]["source_hash"] == source_hash(spec)
    assert db.choices(device, spec, SHAPE)[0].source == "device"


KERNEL = """#include "head.h"
// Why the loop is 8 wide.
__kernel void k(__global float *y) {   /* one item a row */
    y[get_global_id(0)] = ONE; // "a comment"
    if (y[0] < 0.0f) printf("quoted // not a comment");
}
"""
HEADER = "#define ONE 1.0f  // the constant\n"


def hashes_of(monkeypatch, kernel, header=HEADER):
    """(code-only hash, legacy full-text hash) of a family of one kernel file that includes one header."""
    files = {"k.cl": kernel, "head.h": header}
    monkeypatch.setattr(dbmod, "kernel_source", files.__getitem__)
    monkeypatch.setattr(dbmod, "_code", lambda name: dbmod.code_only(files[name]))   # not the cached real files
    return dbmod._source_hash.__wrapped__(("k.cl",)), dbmod.legacy_source_hash.__wrapped__(("k.cl",))


def test_the_source_hash_covers_the_code_only(monkeypatch):
    """A comment or whitespace edit, in the kernel or a header it includes, keeps the hash (and no tuning record
    goes stale); a code edit changes it. The legacy full-text hash changed with every edit."""
    new, legacy = hashes_of(monkeypatch, KERNEL)
    comment_edits = [KERNEL.replace("Why the loop is 8 wide.", "Why the loop is eight wide:\n// a second line."),
                     KERNEL.replace("/* one item a row */", "/* one item\n   a row, said again */"),
                     KERNEL.replace("    y[", "\t  y[").replace("{   ", "{").replace(";", ";   ") + "\n\n/* the end */\n"]
    for edited in comment_edits:
        assert hashes_of(monkeypatch, edited)[0] == new, edited
        assert hashes_of(monkeypatch, edited)[1] != legacy
    assert hashes_of(monkeypatch, KERNEL, "// a new comment\n" + HEADER)[0] == new
    code_edits = [KERNEL.replace("get_global_id(0)", "get_global_id(1)"), KERNEL.replace("not a comment", "code"),
                  KERNEL.replace("// Why", "#define TWO 2\n// Why")]
    for edited in code_edits:
        assert hashes_of(monkeypatch, edited)[0] != new, edited
    assert hashes_of(monkeypatch, KERNEL, HEADER.replace("1.0f", "2.0f"))[0] != new
    # A commented-out include is no include.
    assert hashes_of(monkeypatch, KERNEL.replace('#include "head.h"', '// #include "head.h"'))[0] == \
        hashes_of(monkeypatch, KERNEL.replace('#include "head.h"', ""))[0]


def test_a_legacy_record_of_the_current_code_is_upgraded_and_saved_with_the_new_hash(device, db, toy, monkeypatch):
    """A user's own database written before the code-only hash: a record pinned to the full-text hash of the
    current sources, or to a full-text hash the shipped table maps to the current code, is in force, and the
    next save writes the new hash; a legacy record of other code stays stale."""
    spec = toy.spec()
    current, legacy = source_hash(spec), dbmod.legacy_source_hash(spec.params.sources)
    monkeypatch.setattr(dbmod, "_legacy_hashes", lambda: {"a" * 64: current, "b" * 64: "c" * 64})
    records = [{**record(spec, {"WGS": 64}, {"n": 1}), "source_hash": legacy},
               {**record(spec, {"WGS": 32}, {"n": 2}), "source_hash": "a" * 64},
               {**record(spec, {"WGS": 16}, {"n": 3}), "source_hash": "b" * 64},   # measured on other code
               {**record(spec, {"WGS": 16}, {"n": 4}), "source_hash": "0" * 64}]
    write(db.device_path(device.fingerprint), {"device": device.fingerprint}, records,
          architecture=device.caps.architecture, vendor=device.caps.vendor_key)
    picks = [db.choices(device, spec, {"n": n})[0] for n in (1, 2, 3, 4)]
    assert [(c.source, c.params["WGS"]) for c in picks[:2]] == [("device", 64), ("device", 32)]
    assert [c.source for c in picks[2:]] == ["default", "default"]
    notes = [r["note"][:5] for r in db.entries_in_force(device, {"toy": spec})]
    assert notes == ["", "", "stale", "stale"]
    assert [r["shape"]["n"] for _, r in db.stale_records(device, {"toy": spec})] == [3, 4]
    db.save_result(device, record(spec, {"WGS": 16}, {"n": 5}))
    saved = {r["shape"]["n"]: r["source_hash"] for r in json.loads(db.device_path(device.fingerprint).read_text())
             ["records"]}
    assert saved == {1: current, 2: current, 3: "b" * 64, 4: "0" * 64, 5: current}


def test_the_legacy_table_maps_to_code_only_hashes():
    """tuning/legacy_hashes.json maps full-text hashes to code-only ones, one each."""
    table = dbmod._legacy_hashes()
    assert table and all(len(k) == len(v) == 64 and k != v for k, v in table.items())


def test_m_is_matched_by_nearest_bucket(device, db, toy):
    spec = toy.spec()
    records = [record(spec, {"WGS": w}, {"n": 1000, "m": m}) for w, m in ((16, 1), (32, 3), (64, 130))]
    write(db.device_path(device.fingerprint), {"device": device.fingerprint}, records,
          architecture=device.caps.architecture, vendor=device.caps.vendor_key)
    picks = {m: db.choices(device, spec, {"n": 1000, "m": m})[0].params["WGS"]
             for m in (1, 2, 4, 9, 40, 100, 5000)}
    assert picks == {1: 16, 2: 32, 4: 32, 9: 32, 40: 64, 100: 64, 5000: 64}
    assert db.choices(device, spec, {"n": 999, "m": 3})[0].source == "default"  # other keys match exactly


def test_corrupt_file_is_set_aside_with_a_warning_and_nothing_else_is_lost(device, db, toy):
    spec, phone = toy.spec(), FakeDevice(device)
    good = db.user_dir / "level-architecture.json"
    write(good, {"architecture": "adreno-7xx"}, [record(spec, {"WGS": 32}, None, False)])
    broken = db.device_path(phone.fingerprint)
    broken.write_text('{"perfx_tuning": 2, "match": {"device": {}}, "records": [')  # cut off mid-write
    with pytest.warns(TuningDatabaseWarning, match=broken.name) as caught:
        choice = db.choices(phone, spec, SHAPE)[0]
    assert "set aside" in str(caught[0].message)
    assert (choice.source, choice.params["WGS"]) == ("architecture", 32)
    assert not broken.exists() and good.exists()
    aside = [p.name for p in db.user_dir.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1 and aside[0].startswith(broken.name)
    # A shipped file that is corrupt is only ignored (it is read-only), with a warning naming it.
    db.shipped_dir.mkdir(parents=True, exist_ok=True)
    (db.shipped_dir / "bad.json").write_text("[]")
    with pytest.warns(TuningDatabaseWarning, match="bad.json.*reinstall"):
        db.files()
    assert (db.shipped_dir / "bad.json").exists()


def test_atomic_write_leaves_no_temp_files_even_when_it_fails(tmp_path, monkeypatch):
    path = tmp_path / "db.json"
    write_json_atomic(path, {"a": 1})
    monkeypatch.setattr(resources.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        write_json_atomic(path, {"a": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["db.json"]


def test_sweep_leaves_only_json_files(device, db, toy):
    quiet_tuner(device, db, budget_s=60).tune_problem(toy.spec(), SHAPE)
    slug = fingerprint_slug(device.fingerprint)
    files = {str(p.relative_to(db.user_dir)) for p in db.user_dir.rglob("*") if p.is_file()}
    assert files == {f"{slug}.json", f"log/{slug}.json"}


def test_export_import_round_trip(device, tmp_path, toy):
    spec = toy.spec()
    first = Database(tmp_path / "a", tmp_path / "none")
    result = quiet_tuner(device, first, budget_s=60).tune_problem(spec, SHAPE)
    exported = tmp_path / "shared.json"
    assert first.export(device, exported) == 1
    second = Database(tmp_path / "b", tmp_path / "none")
    assert second.choices(device, spec, SHAPE)[0].source == "default"
    target, count = second.import_file(exported)
    assert count == 1 and target.parent == tmp_path / "b"
    choice = second.choices(device, spec, SHAPE)[0]
    assert choice.source == "device" and choice.params == result.chosen
    # Importing twice replaces rather than duplicates.
    second.import_file(exported)
    assert len(json.loads(target.read_text())["records"]) == 1
    (tmp_path / "junk.json").write_text('{"hello": 1}')
    with pytest.raises(PerfxError, match="not a perfx tuning results file"):
        second.import_file(tmp_path / "junk.json")
    with pytest.raises(PerfxError, match="no such file"):
        second.import_file(tmp_path / "missing.json")


def test_entries_in_force_mark_stale_records(device, db, toy):
    spec = toy.spec()
    stale = {**record(spec, {"WGS": 64}, {"n": 5}), "source_hash": "0" * 64}
    write(db.device_path(device.fingerprint), {"device": device.fingerprint}, [record(spec, {"WGS": 32}), stale],
          architecture=device.caps.architecture, vendor=device.caps.vendor_key)
    rows = db.entries_in_force(device, {"toy": spec})
    assert [(r["level"], r["note"][:5]) for r in rows] == [("device", ""), ("device", "stale")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        db.files()  # a healthy database warns about nothing


def test_shipped_files_are_valid_and_measured(tmp_path):
    """Every shipped file loads without a warning, and every record in it was measured on a device (a source
    hash, a shape, a time): no reasoned guesses ship, so a phone runs the defaults until its own report is
    merged (docs/phones.md)."""
    shipped = Database(tmp_path / "user")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        files = shipped.files()
    assert files, "the CPU devices' measured files ship"
    for file in files:
        assert file.level == "device", f"{file.path.name}: only measured device files ship"
        for rec in file.records:
            assert rec.get("source_hash") and rec.get("shape") is not None and rec.get("time_s"), (file.path.name, rec)


def test_shipped_files_are_compact_results(tmp_path):
    """Results only (no per-candidate logs), each file at most 150 KB, records written one per line; a measured
    record that is not the defaults carries its gain over them (≥ 1) with its interval."""
    for file in Database(tmp_path / "user").files():
        text = file.path.read_text()
        assert len(text.encode()) <= 150_000, file.path.name
        assert text == results_json(file.data), f"{file.path.name}: not in the compact form"
        for rec in file.records:
            assert set(rec) <= set(dbmod.RECORD_FIELDS), (file.path.name, set(rec) - set(dbmod.RECORD_FIELDS))
            if rec.get("source_hash"):  # measured: time, rate and device are there
                assert rec["time_s"] > 0 and rec["gb_per_s"] > 0 and rec["device"], (file.path.name, rec)
                spec = SPECS[rec["family"]]
                defaults = spec.params.defaults()
                if {**defaults, **rec["params"]} != defaults:  # and its gain over the defaults
                    low, high = rec["gain_interval"]
                    assert low <= rec["gain"] <= high and rec["gain"] >= 1 and rec["rounds"] >= 4, (file.path.name,
                                                                                                   rec)


def _device_results(spec, device, name, time_by_wgs, log=False):
    """A device's results (or resume log, with every candidate's time) of the toy at SHAPE."""
    phone = FakeDevice(device, name=name)
    best = min(time_by_wgs, key=time_by_wgs.get)
    if log:
        candidates = [{"params": {"WGS": w, "MODE": "good"}, "status": "ok", "time_s": t}
                      for w, t in time_by_wgs.items()]
        return {"perfx_tuning_log": 1, "device": phone.fingerprint, "architecture": "adreno-7xx",
                "vendor": "qualcomm", "problems": [{"family": spec.params.family, "shape": SHAPE, "complete": True,
                                                    "source_hash": source_hash(spec), "candidates": candidates}]}
    return {"perfx_tuning": FORMAT, "match": {"device": phone.fingerprint}, "architecture": "adreno-7xx",
            "vendor": "qualcomm", "records": [record(spec, {"WGS": best, "MODE": "good"},
                                                     time_s=time_by_wgs[best])]}


def test_merge_picks_the_best_on_average_from_logs(device, toy):
    """CLBlast's rule: WGS 32 is nobody's best but the best on average (0.95 and 0.95 of each best)."""
    spec = toy.spec()
    logs = [_device_results(spec, device, "A", {16: 1.0, 32: 1.05, 64: 3.0}, log=True),
            _device_results(spec, device, "B", {16: 3.0, 32: 1.05, 64: 1.0}, log=True)]
    (merged,) = merge(logs, "architecture")
    assert merged["match"] == {"architecture": "adreno-7xx"}
    (rec,) = merged["records"]
    assert rec["params"] == {"WGS": 32, "MODE": "good"} and len(rec["devices"]) == 2
    assert merge(logs, "vendor")[0]["match"] == {"vendor": "qualcomm"}


def test_merge_of_results_only_votes_and_needs_enough_devices(device, toy, tmp_path):
    spec = toy.spec()
    files = [_device_results(spec, device, name, times) for name, times in
             (("A", {16: 1.0, 64: 2.0}), ("B", {16: 1.0, 64: 2.0}), ("C", {16: 2.0, 64: 1.0}))]
    (merged,) = merge(files, "vendor")
    assert merged["records"][0]["params"]["WGS"] == 16
    assert merge(files[:1], "vendor") == [], "one machine's results do not speak for its vendor"
    assert merge(files[:1], "vendor", min_devices=1)[0]["records"][0]["params"]["WGS"] == 16
    with pytest.raises(PerfxError, match="cannot merge"):
        merge([{"perfx_tuning": FORMAT, "match": {"vendor": "x"}, "records": []}], "vendor")
    # What --merge writes is a results file that --import takes and the look-up uses at vendor level.
    db = Database(tmp_path / "user", tmp_path / "none")
    path = tmp_path / "vendor-qualcomm.json"
    path.write_text(results_json(merged))
    db.import_file(path)
    choice = db.choices(FakeDevice(device, name="D"), spec, SHAPE)[0]
    assert (choice.source, choice.params["WGS"]) == ("vendor", 16)


def test_hold_or_drop_keeps_only_entries_that_beat_the_defaults(tmp_path, capsys):
    """benchmarks/hold_or_drop.py: the maintainer's step that curates a shipped file by a --vs-defaults bench."""
    path = Path(__file__).parent.parent / "benchmarks" / "hold_or_drop.py"
    module_spec = importlib.util.spec_from_file_location("hold_or_drop", path)
    hold_or_drop = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(hold_or_drop)

    defaults = SPECS["gemv_q4"].params.defaults()
    tuned = {**defaults, "ROWS": 2, "LANES": 1}
    shape = lambda n: {"n": n, "k": 576, "group": 32}  # noqa: E731
    header = {"perfx_tuning": FORMAT, "match": {"vendor": "pocl"}}
    old = dict(header, comment="old", records=[
        {"family": "gemv_q4", "shape": shape(1), "params": {"ROWS": 8}},   # replaced by the new file
        {"family": "gemv_q4", "shape": shape(5), "params": tuned},         # never benched
        {"family": "gemv_q4", "shape": shape(6), "params": tuned, "source_hash": "0ld"}])  # stale
    new = dict(header, records=[
        {"family": "gemv_q4", "shape": shape(1), "params": tuned},         # faster: kept
        {"family": "gemv_q4", "shape": shape(2), "params": tuned},         # slower on the median: dropped
        {"family": "gemv_q4", "shape": shape(3), "params": tuned},         # slower beyond the noise: dropped
        {"family": "gemv_q4", "shape": shape(4), "params": defaults},      # the defaults: kept
        {"family": "gemv_q4", "shape": shape(7), "params": tuned, "gain": 1.2, "gain_interval": [1.1, 1.3]},
        {"family": "gemv_q4", "shape": shape(8), "params": tuned, "gain": 0.9, "gain_interval": [0.8, 1.0]}])
    # not benched, judged by their own (refresh or confirmation) measurements: 7 kept, 8 dropped
    bench = {"kernels": [
        {"family": "gemv_q4", "shape": shape(1), "params": tuned, "gain": 1.3, "gain_interval": [0.98, 1.6],
         "rounds": 7},
        {"family": "gemv_q4", "shape": shape(2), "params": tuned, "gain": 0.97, "gain_interval": [0.9, 1.05]},
        {"family": "gemv_q4", "shape": shape(3), "params": tuned, "gain": 0.8, "gain_interval": [0.7, 0.9]},
        {"family": "gemv_q4", "shape": shape(6), "params": tuned, "gain": 1.5, "gain_interval": [1.4, 1.6]}]}
    for name, data in (("old.json", old), ("new.json", new), ("bench.json", bench)):
        (tmp_path / name).write_text(json.dumps(data))
    out = tmp_path / "kept.json"
    assert hold_or_drop.main([str(tmp_path / "old.json"), str(tmp_path / "new.json"),
                              "--bench", str(tmp_path / "bench.json"), "--out", str(out), "--comment", "re-measured"]) == 0
    kept = json.loads(out.read_text())
    assert kept["comment"] == "re-measured" and kept["match"] == {"vendor": "pocl"}
    assert [(r["shape"]["n"], r["params"]) for r in kept["records"]] == [(1, tuned), (4, defaults), (7, tuned)]
    assert (kept["records"][0]["gain"], kept["records"][0]["gain_interval"], kept["records"][0]["rounds"]) == (
        1.3, [0.98, 1.6], 7)
    printed = capsys.readouterr().out
    assert "not measured" in printed and "beyond the noise" in printed and "on the median" in printed
    assert "stale" in printed and "(its own measurement)" in printed

    # A GEMM kind the plan compares with the others of its product keeps a record within the noise of its
    # defaults (without one the plan never runs the kind at that shape); one slower beyond the noise goes, said so.
    i8 = {**SPECS["gemm_q4_i8"].params.defaults(), "MT": 2}
    gemm = lambda m: {"m": m, "n": 576, "k": 576, "group": 32, "epilogue": "none"}  # noqa: E731
    (tmp_path / "gemm.json").write_text(json.dumps(dict(header, records=[
        {"family": "gemm_q4_i8", "shape": gemm(3), "params": i8, "gain": 0.97, "gain_interval": [0.9, 1.05]},
        {"family": "gemm_q4_i8", "shape": gemm(9), "params": i8, "gain": 0.8, "gain_interval": [0.7, 0.9]}])))
    assert hold_or_drop.main([str(tmp_path / "gemm.json"), "--out", str(out)]) == 0
    assert [r["shape"]["m"] for r in json.loads(out.read_text())["records"]] == [3]
    printed = capsys.readouterr().out
    assert "kept for the plan's comparison of kinds" in printed
    assert "no longer compares this kind at this shape" in printed
    # ... and where the kept records compare fewer kinds at a shape than the file holds elsewhere, it says so
    assert [line for line in printed.splitlines() if line.startswith("note:")] == []
    skinny = SPECS["gemm_q4_skinny"].params.defaults()
    (tmp_path / "gemm.json").write_text(json.dumps(dict(header, records=[
        {"family": "gemm_q4_i8", "shape": gemm(3), "params": i8, "gain": 1.1, "gain_interval": [1.0, 1.2]},
        {"family": "gemm_q4_skinny", "shape": gemm(3), "params": skinny},
        {"family": "gemm_q4_skinny", "shape": gemm(9), "params": skinny}])))
    assert hold_or_drop.main([str(tmp_path / "gemm.json"), "--out", str(out)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and '"m": 9' in notes[0] and "no gemm_q4_i8 " in notes[0]


def test_a_set_is_checked_once_from_the_database_to_a_launch(device, db, monkeypatch):
    """The look-up hands out Checked sets; the wrapper made with one, and its kernel built for the shape's
    epilogue, check nothing again. A set checked for one shape is checked again for another."""
    spec = SPECS["gemv_q8"]
    shape = {"n": 2 * 24, "k": 64, "group": 32, "f32": False, "epilogue": "silu_mul", "bias": False}
    db.save_result(device, dbmod.result_record(spec, shape, {"LANES": 4, "ROWS": 2}, 1e-5, 2e-5,
                                               device.fingerprint))
    (choice, *_) = db.choices(device, spec, shape)
    assert isinstance(choice.params, Checked) and choice.source == "device"
    checks = []
    real = ParamSpace.why_invalid
    monkeypatch.setattr(ParamSpace, "why_invalid",
                        lambda self, *args: checks.append(self.family) or real(self, *args))
    gemv = GemvQ8(device, choice.params, shape)
    gemv.kernel(32, False, False, "silu_mul")
    assert gemv.params is choice.params and checks == []
    gemv.kernel(32, False, False, "none")   # another epilogue: checked for it, once
    assert checks == ["gemv_q8"]
    with pytest.raises(PerfxError, match=r"gemv_q8: parameters .* cannot run the gelu_mul epilogue on .*ROWS"):
        GemvQ8(device, {"LANES": 4, "ROWS": 8}, {}).kernel(32, False, False, "gelu_mul")
    checks.clear()
    other = spec.params.check(choice.params, {**shape, "k": 128}, device.caps)
    assert other == choice.params and other.shape["k"] == 128 and checks == ["gemv_q8"]


def test_a_record_of_another_variant_is_found_with_its_own_parameters(tmp_path, monkeypatch, device):
    """gemv_q4 has one kernel per weight layout, each with its own parameters: a tuned record of the
    interleaved layout is handed out as it was saved, never merged with the rows layout's defaults."""
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path))
    spec = SPECS["gemv_q4"]
    shape = {"n": 960, "k": 576, "group": 32, "epilogue": "none", "bias": False, "parts": [576, 192, 192]}
    interleaved = {"LAYOUT": 1, "SLICES": 4, "ROWS": 2, "READ": 0, "XS": 1, "HALF": 0, "I8": 0, "SUBGROUP": 0}
    assert spec.params.why_invalid(interleaved, shape, device.caps) is None
    default_database().save_result(device, result_record(spec, shape, interleaved, 1e-5, 2e-5, device.fingerprint))
    (choice, *_) = default_database().choices(device, spec, shape)
    assert choice.source == "device" and dict(choice.params) == interleaved, (choice, choice.skipped)
