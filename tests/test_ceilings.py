"""The device's memory ceilings: the read-only stream (kernels/stream_read.cl) sums what it reads, right, and
`perfx bench` reports it beside copy."""

import json

import numpy as np
import pytest

from perfx import cli
from perfx.commands import report
from perfx.timing import STREAM_WGS, read_bandwidth, stream_read, stream_read_groups, stream_read_width


def expected_sums(src: np.ndarray, groups: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The float64 sum of the floats each work-group reads (the kernel's shape contract), and the sum of their
    magnitudes (for the tolerance)."""
    vectors = src.size // width
    items = groups * STREAM_WGS
    group_of = (np.arange(vectors) % items) // STREAM_WGS
    body = src[:vectors * width].astype(np.float64).reshape(vectors, width)
    sums, magnitudes = np.zeros(groups), np.zeros(groups)
    np.add.at(sums, group_of, body.sum(axis=1))
    np.add.at(magnitudes, group_of, np.abs(body).sum(axis=1))
    rest = src[vectors * width:].astype(np.float64)   # read by work-items 0.. of work-group 0
    sums[0] += rest.sum()
    magnitudes[0] += np.abs(rest).sum()
    return sums, magnitudes


def test_stream_read_sums_what_each_work_group_reads(device, rng):
    """At a count off every vector and work-group multiple, several vectors a work-item: each work-group's sum within
    1e-5 of the sum of its floats' magnitudes. fp32 adds a work-item's vectors in a chain of at most a few dozen
    terms and a work-group's 64 partials in a tree of 6 levels: at most (chain + 6 + width)·2⁻²⁴ of the magnitudes'
    sum, below 1e-5 with room, where one float missed or read twice (~1 against a group's magnitudes of ~1e3) is
    far above it."""
    width = stream_read_width(device)
    groups_cap = stream_read_groups(device, 1 << 30)
    count = groups_cap * STREAM_WGS * width * 3 + 7 * width + 3
    src = rng.standard_normal(count).astype(np.float32)
    src[count // width * width:] = rng.uniform(2, 3, count % width)   # the floats past the last whole vector
    groups = stream_read_groups(device, count)
    sums = device.poisoned(groups, np.float32)
    stream_read(device, device.upload(src), sums, count).wait()
    want, magnitudes = expected_sums(src, groups, width)
    got = sums.get().astype(np.float64)
    assert np.all(np.isfinite(got)), "a work-group wrote no sum"
    assert np.all(np.abs(got - want) <= 1e-5 * magnitudes), np.max(np.abs(got - want) / magnitudes)
    # the check fails a sum that misses the floats past the last whole vector
    missing = want.copy()
    missing[0] -= src[count // width * width:].sum()
    assert np.any(np.abs(missing - want) > 1e-5 * magnitudes)


def test_read_bandwidth_is_a_positive_figure(device):
    gbps, timing = read_bandwidth(device, nbytes=8 << 20, repeat=3)
    assert np.isfinite(gbps) and gbps > 0
    assert len(timing.samples) == 3 and timing.median_s > 0


def test_bench_reports_the_read_ceiling_beside_copy(device, capsys):
    """`perfx bench --json`: ceilings.read_gb_per_s, and each kernel's percent of it beside its percent of copy; the
    table prints both."""
    argv = ["bench", "--device", device.entry.index, "--model", "synthetic:tiny", "--kernels", "rmsnorm",
            "--max-m", "1"]
    assert cli.main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    ceilings = data["ceilings"]
    assert ceilings["read_gb_per_s"] > 0 and ceilings["copy_gb_per_s"] > 0
    rows = [r for r in data["kernels"] if "time_s" in r]
    assert rows
    for r in rows:
        assert r["percent_of_read"] == pytest.approx(100 * r["gb_per_s"] / ceilings["read_gb_per_s"])
        assert r["bound"] == "compute" or r["percent_of_ceiling"] == pytest.approx(100 * r["gb_per_s"]
                                                                                   / ceilings["copy_gb_per_s"])
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "GB/s (read alone)" in out and "% read" in out


def test_report_summary_prints_the_read_ceiling_where_the_bench_measured_one():
    """`perfx report`'s summary: the read-only stream beside copy, each kernel's percent of both; a report written
    before the read ceiling existed still renders, with its percent of copy."""
    kernel = {"family": "gemv_q4", "label": "qkv", "description": "960x576 G=32", "time_s": 20e-6, "gb_per_s": 9.0,
              "source": "device"}
    caps = {"name": "a GPU", "platform": "a platform", "opencl_c_version": "OpenCL C 3.0", "driver_version": "1",
            "architecture": "gpu"}

    def summary(ceilings):
        sections = {"device": {"capabilities": caps, "limits": "device"},
                    "selftest": {"passed": 1, "failed": 0, "quick": True, "failures": []},
                    "bench": {"model": "default", "ceilings": ceilings, "kernels": [kernel]},
                    "tuning": {"results": {"records": []}}}
        return report.markdown({"perfx": "0", "sections": sections}, None)

    text = summary({"copy_gb_per_s": 12.0, "read_gb_per_s": 15.0, "peak_gflop_per_s": 100.0})
    assert "read-only stream 15.0 GB/s" in text
    assert " 75% " in text and " 60% " in text   # 9 GB/s of copy's 12 and of the read stream's 15
    old = summary({"copy_gb_per_s": 12.0, "peak_gflop_per_s": 100.0})
    assert "read-only stream" not in old and " 75% " in old


def test_tune_reports_the_read_ceiling_beside_copy(device, tmp_path, monkeypatch, capsys):
    """`perfx tune --json` measures both memory ceilings (`--plot`'s ceilings.png draws both)."""
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path / "cache"))
    argv = ["tune", "--device", device.entry.index, "--model", "synthetic:tiny", "--kernels", "argmax",
            "--budget", "3", "--json"]
    assert cli.main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["read_gb_per_s"] > 0 and data["copy_gb_per_s"] > 0
