"""What a driver we have never seen may refuse: a tuned or shipped choice that does not build, or that
breaks the limits the driver reports for the built kernel, gives way to the next choice with one line, is
remembered, and `perfx info` shows it; the tuner records such a candidate as invalid, and the private
memory (spills) of the ones it times."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from perfx import cli
from perfx.errors import PerfxError
from perfx.model import load_model
from perfx.ops.gemv_q4 import GemvQ4
from perfx.ops.small_ops import Argmax
from perfx.ops.params import LOCAL_MEM_RESERVE
from perfx.runtime import BuildError, Device, KernelLimitError, Limits
from perfx.tuning import SPECS
from perfx.tuning.database import Database, default_database, result_record
from perfx.tuning.problems import problems_for
from toy_tuning import quiet_tuner

pytestmark = pytest.mark.one_implementation  # model-level: the default device only


def qkv_shape() -> dict:
    problems, _ = problems_for("synthetic:tiny", SPECS, max_m=1)
    return next(p.shape for p in problems if p.family == "gemv_q4" and "qkv" in p.label.split("+"))


def test_a_choice_that_does_not_build_gives_way_at_load_and_is_remembered(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path))
    device = Device()
    shape, spec = qkv_shape(), SPECS["gemv_q4"]
    refused = {**spec.params.defaults(), "LANES": 64}
    default_database().save_result(device, result_record(spec, shape, refused, 1e-6, 2e-6, device.fingerprint))
    tried = []
    real_build = Device.build

    def driver(self, file, defines=None, newest_c=False):   # a driver whose compiler gives up on 64 lanes of gemv_q4
        if file == "gemv_q4_rows.cl" and (defines or {}).get("LANES") == 64:
            tried.append(defines)
            raise BuildError(file, defines, "error: too many registers", self.caps.name)
        return real_build(self, file, defines, newest_c)

    monkeypatch.setattr(Device, "build", driver)
    lines = []
    model, _ = load_model("synthetic:tiny", device, ctx=16, progress=False, log=lines.append)
    choice = model.plan.tuned["gemv_q4 (qkv)"]
    assert choice.source == "default" and model.plan.gemv["qkv"].params == spec.params.defaults()
    assert any("refused by this driver" in why for why in choice.skipped)
    refusals = [line for line in lines if "were refused by this driver" in line]
    assert len(refusals) == 1 and "gemv_q4 (qkv)" in refusals[0] and "too many registers" in refusals[0]
    model.prefill([1, 2, 3], 0)
    assert np.isfinite(model.logits()).all()

    # The next load does not try it again, and says nothing.
    tried.clear()
    lines.clear()
    load_model("synthetic:tiny", Device(), ctx=16, progress=False, log=lines.append)
    assert not tried and not [line for line in lines if "refused" in line]
    # perfx info shows the entry with the refusal.
    assert cli.main(["info", "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["tuning"]
    (entry,) = [e for e in entries if e["family"] == "gemv_q4" and e["params"].get("LANES") == 64
                and e.get("shape") == json.loads(json.dumps(shape))]
    assert "refused by this driver" in entry["note"]


def test_a_compiler_that_cannot_target_this_cpu_is_one_clear_error_and_no_refusal(tmp_path, monkeypatch):
    """PoCL 3.0's LLVM 14 on a CPU newer than it (AMD Zen 5) refuses every kernel ("unknown target CPU
    'generic'"): the load stops at the first kernel with what to do instead, and records no refusal (a later
    PoCL that knows the CPU must find no parameter set marked as refused)."""
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path))
    log = "error: unknown target CPU 'generic'\nDevice pthread-AMD EPYC failed to build the program"
    assert BuildError("copy.cl", {}, log, "cpu").compiler_lacks_cpu
    assert not BuildError("copy.cl", {}, "error: too many registers", "cpu").compiler_lacks_cpu

    def driver(self, file, defines=None, newest_c=False):
        raise BuildError(file, defines or {}, log, self.caps.name)

    monkeypatch.setattr(Device, "build", driver)
    device = Device()
    with pytest.raises(PerfxError, match="does not know this CPU.*PERFX_DEVICE") as raised:
        load_model("synthetic:tiny", device, ctx=16, progress=False, log=lambda line: None)
    assert "unknown target CPU" in str(raised.value)
    assert not default_database().device_file(device).records


def test_kernel_limits_the_driver_reports_are_checked(monkeypatch):
    """A reqd_work_group_size larger than the driver runs the built kernel in is refused when built; a
    launch larger than the kernel's limit is refused before it reaches the driver."""
    device = Device()
    real_info = Device.kernel_info

    def small_groups(self, kernel):
        return dataclasses.replace(real_info(self, kernel), work_group=32)

    monkeypatch.setattr(Device, "kernel_info", small_groups)
    with pytest.raises(KernelLimitError, match=r"requires work-groups of 64, but this driver runs it in groups "
                                               r"of at most 32"):
        GemvQ4(device, {"LANES": 64, "ROWS": 1, "READ": 0}).kernel(32, "none")
    assert GemvQ4(device, {"LANES": 16, "ROWS": 1, "READ": 0}).kernel(32, "none")
    kernel = device.kernel("copy.cl", "copy_vectors", {"VWC": 4})   # no reqd_work_group_size: checked at launch
    buffer = device.empty(1024, np.float32)
    with pytest.raises(KernelLimitError, match="a work-group of 64 work-items, but this driver runs this kernel "
                                               "in groups of at most 32"):
        device.launch(kernel, (64,), (64,), np.int32(16), buffer.data, buffer.data)


def test_a_set_using_all_of_the_local_memory_is_no_candidate():
    """NVIDIA's driver keeps 4 bytes of a work-group's local memory for itself, so a set sized to exactly the
    device's local memory built there and was then refused: such a set is not offered, one with room is."""
    spec = SPECS["gemm_q4_tiled"]
    shape = spec.test_shapes[0]
    params = {**spec.params.defaults(), "MWG": 64, "NWG": 64, "KWG": 64, "MDIMC": 8, "NDIMC": 8, "VWN": 8}
    need = spec.params.local_memory(params, shape)
    exact = Device(limits=Limits(name="exact-local", local_mem=need))
    assert "the 64 a driver may keep for itself" in spec.params.why_invalid(params, shape, exact.caps)
    roomy = Device(limits=Limits(name="roomy-local", local_mem=need + LOCAL_MEM_RESERVE))
    assert spec.params.why_invalid(params, shape, roomy.caps) is None


def test_the_tuner_marks_limits_and_records_private_memory(tmp_path, monkeypatch):
    device = Device()
    real_info = Device.kernel_info

    def limited(self, kernel):
        info = real_info(self, kernel)
        return dataclasses.replace(info, work_group=64) if info.name.startswith("argmax") else info

    monkeypatch.setattr(Device, "kernel_info", limited)
    result = quiet_tuner(device, Database(tmp_path / "u", tmp_path / "s"), budget_s=60).tune_problem(
        SPECS["argmax"], {"n": 5000})
    statuses = {o.params["WGS3"]: o.status for o in result.outcomes if o.status in ("limit", "ok", "slow")}
    assert statuses.get(128) == "limit" and statuses.get(256) == "limit"
    assert all(o.params["WGS3"] == 64 for o in result.outcomes if o.status == "ok")
    assert all(o.private_bytes is not None for o in result.outcomes if o.status == "ok")
    with pytest.raises(KernelLimitError):
        Argmax(device, {"WGS3": 128, "GROUPS3": 64, "VW3": 4})


@pytest.mark.parametrize("name, c_version, version, driver, model, architecture", [
    ("QUALCOMM Adreno(TM)", "OpenCL C 3.0 Adreno(TM) 740", "OpenCL 3.0 Adreno(TM) 740", "", 740, "adreno-7xx"),
    ("QUALCOMM Adreno(TM) 830", "OpenCL C 3.0", "OpenCL 3.0", "", 830, "adreno-8xx"),
    ("QUALCOMM Adreno(TM)", "OpenCL C 2.0", "OpenCL 2.0", "OpenCL 2.0 Adreno 650 build", 650, "adreno-6xx"),
    ("QUALCOMM", "OpenCL C 3.0", "OpenCL 3.0", "OpenCL 3.0 QUALCOMM build: commit #1", None, "adreno"),
], ids=["opencl-c-version", "device-name", "driver-version", "no-model-number"])
def test_adreno_identified_from_whatever_the_driver_reports(name, c_version, version, driver, model, architecture):
    from perfx.runtime import identify
    key, found, arch, how = identify("qualcomm", name, c_version, version, driver)
    assert (key, found, arch) == ("qualcomm", model, architecture)
    assert ("vendor-level Qualcomm entries apply" in how) == (model is None)


def test_a_qualcomm_gpu_runs_the_defaults_until_a_phone_reports(device, tmp_path):
    phone = Device()
    phone.caps = dataclasses.replace(device.caps, vendor_key="qualcomm", architecture="adreno",
                                     name="QUALCOMM", image_support=True, local_mem=32 << 10, max_work_group=1024)
    shipped = Database(tmp_path / "user")   # the shipped files only
    choice = shipped.choices(phone, SPECS["gemv_q4"], qkv_shape())[0]
    assert choice.source == "default" and choice.params == SPECS["gemv_q4"].params.defaults()


def test_build_options_per_device(monkeypatch):
    """Every kernel is built with the safe part of fast math, never -cl-fast-relaxed-math (attention relies on
    −INFINITY); PERFX_BUILD_OPTIONS adds a driver's own, and a bad one is a build error naming the file."""
    device = Device()
    assert device.build_options[:2] == ["-cl-mad-enable", "-cl-no-signed-zeros"]
    assert not any("fast-relaxed" in option or "finite-math" in option for option in device.build_options)
    monkeypatch.setenv("PERFX_BUILD_OPTIONS", "-cl-no-such-option")
    odd = Device()
    assert odd.build_options[-1] == "-cl-no-such-option"
    with pytest.raises(BuildError, match="kernels/copy.cl failed to build"):
        odd.build("copy.cl", {"VWC": 4})


def test_a_bad_build_option_is_one_error_with_the_log_and_no_traceback(tmp_path):
    """As a user sees it (pytest's own warning capture would hide what perfx's filters do): the driver's log in
    perfx's error, and not pyopencl's cache traceback printed as a warning beside it."""
    env = dict(os.environ, PERFX_BUILD_OPTIONS="-cl-no-such-option", PERFX_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "perfx", "bench", "--model", "synthetic:tiny", "--kernels", "rmsnorm",
                          "--max-m", "1"], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 2 and "failed to build" in out.stderr and "-cl-no-such-option" in out.stderr
    assert "caching failed" not in out.stderr and "Traceback" not in out.stderr, out.stderr
