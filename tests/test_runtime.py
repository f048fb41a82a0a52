"""The device runtime: device choice, phone limits, build errors with their log, error names, memory."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from perfx.errors import PerfxError
from perfx.runtime import (LIMIT_PRESETS, BuildError, Device, Limits, OpenCLError, capabilities,
                           choose_device, cl_error_name, has_subgroups, intel_opencl_library, list_devices,
                           merged_vendor_entries, parse_adreno_model, parse_limits)


def test_lists_at_least_one_device():
    entries = list_devices()
    assert entries and all(e.label for e in entries)


def test_default_choice_prefers_gpu_then_intel_then_pocl_and_never_a_simulator(monkeypatch):
    monkeypatch.delenv("PERFX_DEVICE", raising=False)
    entry, reason = choose_device()
    assert not entry.simulator
    real = [e for e in list_devices() if not e.simulator]
    gpus = [e for e in real if e.device_type == "GPU"]
    cpus = {e.implementation: e for e in reversed(real) if e.device_type == "CPU"}
    assert entry == (gpus[0] if gpus else cpus.get("intel") or cpus.get("pocl") or next(iter(cpus.values())))
    assert "set PERFX_DEVICE" in reason
    if not gpus and {"intel", "pocl"} <= set(cpus):
        assert reason.startswith("CPU, intel preferred over pocl")


def test_choice_by_substring_and_indices(monkeypatch):
    first = list_devices()[0]
    monkeypatch.setenv("PERFX_DEVICE", first.name.upper()[:6])
    entry, reason = choose_device()
    assert first.name.upper()[:6] in f"{entry.platform} / {entry.name}".upper()
    assert "PERFX_DEVICE" in reason
    entry, _ = choose_device(f"{first.platform_index}:{first.device_index}")
    assert entry == first
    for entry in list_devices():  # the short names: PERFX_DEVICE=pocl, PERFX_DEVICE=intel
        assert choose_device(entry.implementation)[0].implementation == entry.implementation


def test_unknown_device_lists_what_is_there(monkeypatch):
    monkeypatch.setenv("PERFX_DEVICE", "no-such-gpu-xyz")
    with pytest.raises(PerfxError, match=r"PERFX_DEVICE='no-such-gpu-xyz' matches no OpenCL device") as info:
        choose_device()
    assert list_devices()[0].name in str(info.value)
    with pytest.raises(PerfxError, match="--device='9:9' matches no OpenCL device"):
        choose_device("9:9")


def test_adreno_model_comes_from_the_opencl_c_version():
    assert parse_adreno_model("OpenCL C 3.0 Adreno(TM) 740") == 740
    assert parse_adreno_model("QUALCOMM Adreno(TM)", "OpenCL C 2.0 Adreno(TM) 830") == 830
    assert parse_adreno_model("OpenCL C 1.2 pocl") is None


def test_adreno740_limits_cap_the_device(device):
    limited = Device(limits=LIMIT_PRESETS["adreno740"])
    real = device.cl_device
    caps = limited.caps
    assert caps.image2d_max_height == min(real.image2d_max_height, 16384)
    assert caps.max_alloc == min(real.max_mem_alloc_size, 1 << 30)
    assert caps.local_mem == min(real.local_mem_size, 32 << 10)
    assert caps.max_work_group == min(real.max_work_group_size, 1024)
    assert caps.limits == "adreno740"


def test_limits_from_env_and_json(tmp_path, monkeypatch):
    path = tmp_path / "phone.json"
    path.write_text(json.dumps({"max_alloc": 4096, "image2d_max_height": 64}))
    monkeypatch.setenv("PERFX_LIMITS", str(path))
    caps = Device().caps
    assert caps.max_alloc == 4096 and caps.image2d_max_height == 64 and caps.limits == "phone"
    monkeypatch.setenv("PERFX_LIMITS", "ADRENO740")
    assert Device().caps.limits == "adreno740"


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"max_alloc": -1}', "max_alloc must be a positive integer"),
    ('{"image_height": 5}', "unknown keys"),
])
def test_malformed_limits_file(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(PerfxError, match=message):
        parse_limits(str(path))


def test_unknown_limits_preset():
    with pytest.raises(PerfxError, match=r"PERFX_LIMITS='adreno999' is neither a preset \(adreno740"):
        parse_limits("adreno999")


def test_capabilities_are_complete(device):
    caps = capabilities(device.cl_device)
    assert caps.name and caps.platform and caps.driver_version and caps.opencl_c_version
    assert caps.max_alloc > 0 and caps.local_mem > 0 and caps.max_work_group > 0 and caps.compute_units > 0
    assert isinstance(caps.fp16, bool) and isinstance(caps.qcom_extensions, tuple)
    assert caps.opencl_c >= (1, 2) and caps.image1d_buffer_texels > 0  # image1d_buffer_t is OpenCL 1.2 core
    assert all(isinstance(size, int) and size > 0 for size in caps.subgroup_sizes)
    if caps.platform == "Intel(R) OpenCL":  # what DESIGN.md says the GPU-class kernels may use there
        assert caps.fp16 and caps.subgroups and caps.image2d_from_buffer and caps.integer_dot_product
        assert caps.opencl_c >= (3, 0) and caps.reqd_subgroup_size == "intel" and 8 in caps.subgroup_sizes
        assert caps.image2d_max_width == 16384 and caps.image_pitch_alignment > 0


def test_subgroups_from_any_of_their_three_names():
    assert has_subgroups(("cl_khr_subgroups",)) and has_subgroups(("cl_intel_subgroups", "cl_khr_fp16"))
    assert has_subgroups((), ("__opencl_c_subgroups",))  # OpenCL C 3.0, as Intel's CPU runtime has them
    assert not has_subgroups(("cl_khr_subgroup_shuffle",), ("__opencl_c_images",))


def test_pypi_implementations_join_what_the_icd_loader_reads(tmp_path):
    system, user = tmp_path / "system", tmp_path / "user"
    system.mkdir(), user.mkdir()
    (system / "gpu.icd").write_text("libgpu.so\n")
    (user / "mine.icd").write_text("/opt/mine/libmine.so\n")
    (user / "notes.txt").write_text("not an icd file")
    library = tmp_path / "libintelocl.so"
    library.write_bytes(b"")
    ours = {"intel.icd": library}
    assert merged_vendor_entries({"OPENCL_VENDOR_PATH": str(system)}, ours) == {
        "gpu.icd": "libgpu.so", "intel.icd": str(library)}
    # a user's own folder is kept (the loader would have read it instead of the system's)
    assert merged_vendor_entries({"OCL_ICD_VENDORS": str(user), "OPENCL_VENDOR_PATH": str(system)}, ours) == {
        "mine.icd": "/opt/mine/libmine.so", "intel.icd": str(library)}
    # one library named asks for that platform alone (the Oclgrind tier); a folder listing ours needs nothing
    assert merged_vendor_entries({"OCL_ICD_VENDORS": str(library)}, ours) is None
    (user / "intel-by-hand.icd").write_text(str(library))
    assert merged_vendor_entries({"OCL_ICD_VENDORS": str(user)}, ours) is None


def _platforms_in_a_new_process(**env) -> list[str]:
    code = "from perfx.runtime import list_devices; print('\\n'.join(sorted({e.platform for e in list_devices()})))"
    environ = {k: v for k, v in os.environ.items() if k not in ("OCL_ICD_VENDORS", "PERFX_DEVICE")}
    out = subprocess.run([sys.executable, "-c", code], env={**environ, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return out.stdout.split("\n")[:-1]


def test_intel_runtime_is_listed_beside_pocl_without_any_setting():
    library = intel_opencl_library()
    if library is None:
        message = "intel-opencl-rt is not installed (the dev extra brings it on x86-64 Linux)"
        if os.environ.get("PERFX_REQUIRE_INTEL") == "1":
            pytest.fail(message + "; PERFX_REQUIRE_INTEL=1 requires it")
        pytest.skip(message)
    assert _platforms_in_a_new_process() == ["Intel(R) OpenCL", "Portable Computing Language"]
    assert _platforms_in_a_new_process(OCL_ICD_VENDORS=str(library)) == ["Intel(R) OpenCL"]


def test_build_error_names_file_defines_and_shows_the_log(device):
    # copy.cl with a vector width the file does not know still builds; a define that breaks the
    # source must show the compiler's own words.
    with pytest.raises(BuildError) as info:
        device.build("copy.cl", {"VWC": "4+("})
    message = str(info.value)
    assert "kernels/copy.cl failed to build" in message
    assert "-DVWC=4+(" in message
    assert "Build log:" in message and "error" in message.lower()


def test_kernels_are_built_once_and_kept(device):
    a = device.kernel("copy.cl", "copy_vectors", {"VWC": 4})
    b = device.kernel("copy.cl", "copy_vectors", {"VWC": 4})
    assert a is b
    assert device.kernel("copy.cl", "copy_vectors", {"VWC": 8}) is not a


def test_opencl_errors_are_named(device):
    assert cl_error_name(-46) == "CL_INVALID_KERNEL_NAME"
    with pytest.raises(OpenCLError, match="CL_INVALID_KERNEL_NAME"):
        device.kernel("copy.cl", "no_such_kernel", {"VWC": 4})


def test_memory_is_counted_and_released(device):
    import gc
    gc.collect()
    before = device.allocated_bytes
    array = device.upload(np.ones(1000, np.float32))
    image = device.image_rgba_u32(np.ones((2, 3, 4), np.uint32))
    assert device.allocated_bytes == before + 4000 + 96
    del array, image
    gc.collect()
    assert device.allocated_bytes == before


def test_allocation_beyond_the_limit_is_a_clear_error():
    small = Device(limits=Limits(name="tiny", max_alloc=1024))
    with pytest.raises(PerfxError, match=r"needs one allocation of .* more than this device allows .*limits: tiny"):
        small.alloc(4096, what="a test buffer")


def test_image_beyond_the_height_limit_is_refused():
    small = Device(limits=Limits(name="short", image2d_max_height=4))
    with pytest.raises(PerfxError, match="exceeds the image2d limit"):
        small.image_rgba_u32(np.zeros((5, 2, 4), np.uint32))


def test_no_platform_message_says_how_to_get_one(monkeypatch):
    import pyopencl as cl

    def no_platforms():
        raise cl.LogicError("clGetPlatformIDs", -1001, "PLATFORM_NOT_FOUND_KHR")

    monkeypatch.setattr(cl, "get_platforms", no_platforms)
    with pytest.raises(PerfxError, match=r"No OpenCL platform found.*pip install -e.*opencl-vendor-driver"):
        list_devices()
