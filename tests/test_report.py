"""`perfx report`: one file that resumes where it stopped, and that becomes shipped tuning entries through
`perfx tune --merge` (report, then merge, then `perfx info` shows the merged entry in force)."""

from __future__ import annotations

import json

import pytest

from perfx import cli
from perfx.commands import report


def run(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_report_resumes_then_merges_into_an_entry_in_force(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path / "phone-cache"))
    out = tmp_path / "report.json"
    argv = ["report", "--quick", "--model", "synthetic:tiny", "--max-m", "1", "--tune", "3", "--out", str(out)]

    # Interrupted during the benchmark: what ran before it is kept.
    real = report.run_section
    ran, interrupt = [], {"bench"}

    def interrupted(name, *args):
        ran.append(name)
        if name in interrupt:   # Ctrl-C, the first time only
            interrupt.discard(name)
            raise KeyboardInterrupt
        return real(name, *args)

    monkeypatch.setattr(report, "run_section", interrupted)
    assert cli.main(argv) == 130
    capsys.readouterr()
    assert ran == ["device", "tune", "selftest", "bench"]
    assert set(json.loads(out.read_text())["sections"]) == {"device", "tune", "selftest"}

    ran.clear()
    code, _, err = run(capsys, *argv)
    assert code == 0 and "resuming: device, tune, selftest already done" in err
    assert ran == ["bench", "replay", "tuning"]
    data = json.loads(out.read_text())
    assert data["sections"]["selftest"]["failed"] == 0, data["sections"]["selftest"]["failures"]
    assert data["sections"]["selftest"]["passed"] >= 11
    # each family's seconds: what a slow device splits off
    assert all(family["seconds"] > 0 for family in data["sections"]["selftest"]["families"].values())
    assert data["sections"]["tune"]["sweep"]["candidates"] > 0   # where the phone's tuning time went
    assert data["sections"]["bench"]["kernels"] and data["sections"]["tuning"]["results"]["records"]
    # Each replay of the decode step this driver has, against launches one by one (tests/test_replay_qcom.py
    # has an Adreno recording's, on a fake driver).
    replays = data["sections"]["replay"]["replays"]
    assert replays["qcom"] == {"available": False, "mode": "one enqueue a launch: the driver has no "
                                                            "cl_qcom_recordable_queues"}
    assert all(r["same_tokens"] and r["decode_tok_s"] > 0 for r in replays.values() if "decode_tok_s" in r)
    summary = out.with_suffix(".md").read_text()
    assert "**selftest**" in summary and "copy bandwidth" in summary and "tuning results" in summary
    assert "**decode step replays**" in summary and "- qcom: not here" in summary

    # Received reports become vendor- and architecture-level entries (one device here: --min-devices 1).
    merged = tmp_path / "merged"
    code, stdout, _ = run(capsys, "tune", "--merge", str(out), "--out", str(merged), "--min-devices", "1")
    assert code == 0 and "merged" in stdout
    vendor = next(merged.glob("vendor-*.json"))
    # Another device of the same vendor, with nothing of its own, takes the merged entries.
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path / "other-cache"))
    assert run(capsys, "tune", "--import", str(vendor))[0] == 0
    code, stdout, _ = run(capsys, "info", "--json")
    levels = {entry["level"] for entry in json.loads(stdout)["tuning"] if entry["file"].endswith(vendor.name)}
    assert code == 0 and levels == {"vendor"}


def test_merge_without_enough_devices_says_so(tmp_path, capsys):
    empty = tmp_path / "r.json"
    empty.write_text(json.dumps({"perfx_tuning": 2, "match": {"device": {"platform": "x", "device": "y"}},
                                 "architecture": "a", "vendor": "v", "records": []}))
    code, stdout, _ = run(capsys, "tune", "--merge", str(empty), "--out", str(tmp_path))
    assert code == 0 and "nothing merged" in stdout
    with pytest.raises(SystemExit):
        cli.main(["report", "--tune"])   # argparse: --tune needs SECONDS
