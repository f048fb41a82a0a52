"""The tuning database: fallback order, stale entries, corrupt files, atomic writes, export/import."""

import dataclasses
import json
import os
import warnings

import pytest

from perfx.errors import PerfxError
from perfx.tuning import database as dbmod
from perfx.tuning.database import FORMAT, Database, TuningDatabaseWarning, source_hash, write_json_atomic
from perfx.tuning.tuner import Tuner
from toy_tuning import Toy

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


def record(spec, params, shape=SHAPE, hashed=True):
    return {"family": spec.family, "shape": shape, "params": params,
            "source_hash": source_hash(spec) if hashed else None}


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
        choice = db.lookup(phone, spec, SHAPE)
        seen.append((choice.source, choice.params["WGS"]))
        if remove is not None:
            remove.unlink()
    assert seen == [("device", 64), ("architecture", 32), ("vendor", 16), ("default", 16)]
    # The same device file, seen from another driver of the same architecture, is an architecture entry.
    write(db.device_path(phone.fingerprint), {"device": phone.fingerprint}, [record(spec, {"WGS": 64})],
          architecture="adreno-7xx", vendor="qualcomm")
    other = FakeDevice(device, driver="2.0")
    assert db.lookup(other, spec, SHAPE).source == "architecture"


def test_invalid_params_fall_through_to_the_next_level(device, db, toy):
    spec, phone = toy.spec(), FakeDevice(device)
    write(db.shipped_dir / "adreno-7xx.json", {"architecture": "adreno-7xx"},
          [record(spec, {"WGS": 48}, None, False)])  # not in the space
    write(db.shipped_dir / "qualcomm.json", {"vendor": "qualcomm"}, [record(spec, {"WGS": 32}, None, False)])
    choice = db.lookup(phone, spec, SHAPE)
    assert (choice.source, choice.params["WGS"]) == ("vendor", 32)
    spec_small = dataclasses.replace(spec, space={"WGS": (16, 32), "MODE": ("good",)},
                                     restrictions=(lambda p, s: p["WGS"] <= 16,))
    choice = db.lookup(phone, spec_small, SHAPE)
    assert choice.source == "default" and "restriction" in choice.detail


def test_stale_entry_is_ignored_and_retuned(device, db, toy):
    spec = toy.spec()
    stale = {**record(spec, {"WGS": 64}), "source_hash": "0" * 64, "complete": True,
             "candidates": [{"params": {"WGS": 64, "MODE": "good"}, "status": "ok", "time_s": 1e-9}]}
    write(db.device_path(device.fingerprint), {"device": device.fingerprint}, [stale],
          architecture=device.caps.architecture, vendor=device.caps.vendor_key)
    assert db.lookup(device, spec, SHAPE).source == "default"
    result = Tuner(device, db, budget_s=60).tune_problem(spec, SHAPE)
    assert result.resumed == 0 and len(result.outcomes) == 9
    saved = json.loads(db.device_path(device.fingerprint).read_text())["records"]
    assert len(saved) == 1 and saved[0]["source_hash"] == source_hash(spec)
    assert db.lookup(device, spec, SHAPE).source == "device"


def test_m_is_matched_by_nearest_bucket(device, db, toy):
    spec = toy.spec()
    records = [record(spec, {"WGS": w}, {"n": 1000, "m": m}) for w, m in ((16, 1), (32, 3), (64, 130))]
    write(db.device_path(device.fingerprint), {"device": device.fingerprint}, records,
          architecture=device.caps.architecture, vendor=device.caps.vendor_key)
    picks = {m: db.lookup(device, spec, {"n": 1000, "m": m}).params["WGS"] for m in (1, 2, 4, 9, 40, 100, 5000)}
    assert picks == {1: 16, 2: 32, 4: 32, 9: 32, 40: 64, 100: 64, 5000: 64}
    assert db.lookup(device, spec, {"n": 999, "m": 3}).source == "default"  # other keys match exactly


def test_corrupt_file_is_set_aside_with_a_warning_and_nothing_else_is_lost(device, db, toy):
    spec, phone = toy.spec(), FakeDevice(device)
    good = db.user_dir / "level-architecture.json"
    write(good, {"architecture": "adreno-7xx"}, [record(spec, {"WGS": 32}, None, False)])
    broken = db.device_path(phone.fingerprint)
    broken.write_text('{"perfx_tuning": 1, "match": {"device": {}}, "records": [')  # cut off mid-write
    with pytest.warns(TuningDatabaseWarning, match=broken.name) as caught:
        choice = db.lookup(phone, spec, SHAPE)
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
    monkeypatch.setattr(dbmod.json, "dump", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        write_json_atomic(path, {"a": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["db.json"]


def test_sweep_leaves_only_json_files(device, db, toy):
    Tuner(device, db, budget_s=60).tune_problem(toy.spec(), SHAPE)
    assert [p.suffix for p in db.user_dir.iterdir()] == [".json"]


def test_export_import_round_trip(device, tmp_path, toy):
    spec = toy.spec()
    first = Database(tmp_path / "a", tmp_path / "none")
    result = Tuner(device, first, budget_s=60).tune_problem(spec, SHAPE)
    exported = tmp_path / "shared.json"
    assert first.export(device, exported) == 1
    second = Database(tmp_path / "b", tmp_path / "none")
    assert second.lookup(device, spec, SHAPE).source == "default"
    target, count = second.import_file(exported)
    assert count == 1 and target.parent == tmp_path / "b"
    choice = second.lookup(device, spec, SHAPE)
    assert choice.source == "device" and choice.params == result.best.params
    # Importing twice replaces rather than duplicates.
    second.import_file(exported)
    assert len(json.loads(target.read_text())["records"]) == 1
    (tmp_path / "junk.json").write_text('{"hello": 1}')
    with pytest.raises(PerfxError, match="not a perfx tuning file"):
        second.import_file(tmp_path / "junk.json")


def test_entries_in_force_mark_stale_records(device, db, toy, monkeypatch):
    spec = toy.spec()
    monkeypatch.setattr(dbmod, "_specs", lambda: {"toy": spec})
    stale = {**record(spec, {"WGS": 64}, {"n": 5}), "source_hash": "0" * 64}
    write(db.device_path(device.fingerprint), {"device": device.fingerprint}, [record(spec, {"WGS": 32}), stale],
          architecture=device.caps.architecture, vendor=device.caps.vendor_key)
    rows = db.entries_in_force(device)
    assert [(r["level"], r["note"][:5]) for r in rows] == [("device", ""), ("device", "stale")]
    assert dbmod.lookup  # the module-level API exists for the model
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        db.files()  # a healthy database warns about nothing


def test_shipped_files_are_valid_and_adreno_entries_fit_an_adreno_740(device, tmp_path):
    from perfx.runtime import LIMIT_PRESETS
    from perfx.tuning import specs

    shipped = Database(tmp_path / "user")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        files = shipped.files()
    assert {f.path.name for f in files} >= {"adreno-6xx.json", "adreno-7xx.json", "adreno-8xx.json"}
    all_specs = specs()
    limits = LIMIT_PRESETS["adreno740"]
    for file in files:
        arch = file.data["match"].get("architecture") or file.data.get("architecture")
        phone = FakeDevice(device, architecture=arch)
        phone.caps = dataclasses.replace(phone.caps, image_support=True, local_mem=limits.local_mem,
                                         max_work_group=limits.max_work_group)
        for rec in file.records:
            spec = all_specs.get(rec["family"])
            if spec is None or not rec.get("params") or rec.get("source_hash") not in (None, source_hash(spec)):
                continue  # a family this build lacks, a record where nothing verified, or a stale one
            assert rec.get("comment") or file.level == "device", f"{file.path.name}: say why {rec['family']}"
            params = {**spec.defaults(), **rec["params"]}
            if file.level == "device":
                continue  # measured: the look-up skips a set the spec no longer allows
            assert dbmod._outside_space(spec, params) is None, (file.path.name, rec)
            shapes = [rec["shape"]] if rec.get("shape") else spec.test_shapes
            assert any(spec.why_invalid(params, s, phone.caps) is None for s in shapes), (file.path.name, rec)
            if file.level == "architecture":
                choice = shipped.lookup(phone, spec, next(s for s in shapes
                                                          if spec.why_invalid(params, s, phone.caps) is None))
                assert choice.source == "architecture" and choice.params == params
