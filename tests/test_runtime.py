"""The device runtime: the process's OpenCL set-up (at first use, never at import), device choice, phone
limits, capabilities, build errors with their log, error names, memory, the copies, and the recorded steps
replayed (in one command buffer where the driver has them)."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyopencl as cl
import pytest

from perfx.errors import PerfxError
from perfx.runtime import (LIMIT_PRESETS, BuildError, Device, Limits, OpenCLError, choose_device, cl_error_name,
                           has_subgroups, intel_opencl_library, list_devices, merged_vendor_entries,
                           one_library_environ, parse_adreno_model, parse_limits, read_capabilities)
from perfx.runtime.replay import BoundLaunch, CommandBuffer, Sequence, unavailable

ROOT = Path(__file__).resolve().parent.parent


def test_each_listed_device_is_named_by_its_index_and_label():
    entries = list_devices()
    assert entries and len({e.index for e in entries}) == len(entries)
    for entry in entries:
        assert (entry.platform, entry.name) == (entry.device.platform.name.strip(), entry.device.name.strip())
        assert entry.label == f"{entry.index} {entry.platform} / {entry.name} ({entry.device_type})"
        assert entry.device_type == read_capabilities(entry.device).device_type
        assert choose_device(entry.index)[0] == entry  # the P:D that `perfx info` shows selects it
    short = {"Portable Computing Language": "pocl", "Intel(R) OpenCL": "intel"}  # PERFX_DEVICE=pocl, =intel
    assert all(e.implementation == short[e.platform] for e in entries if e.platform in short)


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


def test_capabilities_are_the_drivers_answers_and_its_image_views_work(device):
    real = device.cl_device
    caps = read_capabilities(real)
    assert (caps.name, caps.platform, caps.limits) == (real.name.strip(), real.platform.name.strip(), "device")
    assert (caps.max_alloc, caps.local_mem, caps.max_work_group, caps.compute_units, caps.global_mem) == (
        real.max_mem_alloc_size, real.local_mem_size, real.max_work_group_size, real.max_compute_units,
        real.global_mem_size)
    assert caps.extensions == tuple(sorted(real.extensions.split()))
    assert caps.fp16 == caps.has("cl_khr_fp16")
    assert caps.integer_dot_product == caps.has("cl_khr_integer_dot_product")
    assert caps.opencl_c >= (1, 2) and all(isinstance(size, int) and size > 0 for size in caps.subgroup_sizes)
    # image1d_buffer_t is OpenCL 1.2 core: a view of a buffer, up to the limit the driver gives
    buffer = device.alloc(8 * 16)
    view = device.image1d_view(buffer, 8)
    assert view.get_image_info(cl.image_info.WIDTH) == 8 and view.get_image_info(cl.image_info.BUFFER) == buffer
    with pytest.raises(PerfxError, match="exceed this device's image1d_buffer limit"):
        device.image1d_view(buffer, caps.image1d_buffer_texels + 1)
    # an image2d view of a buffer's rows reads those rows, no copy
    if caps.image2d_from_buffer and caps.image_pitch_alignment:
        width = caps.image_pitch_alignment
        rows = np.random.default_rng(1).integers(0, 2**32, (3, width, 4), dtype=np.uint32)
        seen = np.zeros((2, width, 4), np.uint32)
        view = device.image2d_view(device.alloc(rows.nbytes, rows), width, 2, row_offset=1)
        cl.enqueue_copy(device.queue, seen, view, origin=(0, 0), region=(width, 2))
        assert np.array_equal(seen, rows[1:])
    if caps.platform == "Intel(R) OpenCL":  # what DESIGN.md says the GPU-class kernels may use there
        assert caps.fp16 and caps.subgroups and caps.image2d_from_buffer and caps.integer_dot_product
        assert caps.opencl_c >= (3, 0) and caps.reqd_subgroup_size == "intel" and 8 in caps.subgroup_sizes
        assert caps.image2d_max_width == 16384 and caps.image_pitch_alignment > 0


def test_subgroups_from_any_of_their_three_names():
    assert has_subgroups(("cl_khr_subgroups",)) and has_subgroups(("cl_intel_subgroups", "cl_khr_fp16"))
    assert has_subgroups((), ("__opencl_c_subgroups",))  # OpenCL C 3.0, as Intel's CPU runtime has them
    assert not has_subgroups(("cl_khr_subgroup_shuffle",), ("__opencl_c_images",))


def test_a_gpus_cache_is_taken_as_at_least_its_last_level():
    """NVIDIA's driver reports 4 MiB of global memory cache on an H200, whose L2 holds 50 MB: a GPU is taken to
    have at least GPU_CACHE_FLOOR, so timings rotate a decode GEMV's weight past the L2; a CPU adds the host's
    largest cache; another device keeps what it reports."""
    from types import SimpleNamespace

    from perfx.runtime.capabilities import GPU_CACHE_FLOOR, _cache_bytes, _host_cache_bytes
    h200 = SimpleNamespace(global_mem_cache_size=4325376)
    assert _cache_bytes(h200, "GPU") == GPU_CACHE_FLOOR >= 50_000_000
    assert _cache_bytes(SimpleNamespace(global_mem_cache_size=96 << 20), "GPU") == 96 << 20
    assert _cache_bytes(SimpleNamespace(global_mem_cache_size=512 << 10), "CPU") == max(512 << 10, _host_cache_bytes())
    assert _cache_bytes(h200, "ACCELERATOR") == 4325376


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


def _clean_environment(tmp_path, **extra) -> dict:
    """An environment without any OpenCL, pyopencl or perfx setting, with its own perfx cache."""
    keep = {k: os.environ[k] for k in ("PATH", "HOME", "LD_LIBRARY_PATH") if k in os.environ}
    return {**keep, "PERFX_CACHE": str(tmp_path / "cache"), **extra}


def _top_level_imports_outside_perfx() -> list[str]:
    """What perfx's modules import from other packages when they are imported (numpy, pyopencl, ...)."""
    names = set()
    for folder in ("perfx", "tuning", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Import):
                    names |= {alias.name for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names.add(node.module)
    return sorted(name for name in names if name.split(".")[0] not in ("perfx", "__future__"))


# Imports the other packages first (numpy and pyopencl change os.environ and the warning filters when
# imported: that is theirs), then every perfx module, and says what perfx changed; then lists the devices.
IMPORT_ALL = """
import importlib, json, os, pkgutil, sys, warnings
for name in sys.argv[1:]:
    importlib.import_module(name)
environ, filters = dict(os.environ), list(warnings.filters)
import perfx
for module in pkgutil.walk_packages(perfx.__path__, "perfx."):
    if module.name != "perfx.__main__":
        importlib.import_module(module.name)
seen = {"changed": sorted(k for k in environ.keys() | os.environ.keys() if environ.get(k) != os.environ.get(k)),
        "same_filters": list(warnings.filters) == filters,
        "icd_written": os.path.exists(os.path.join(os.environ["PERFX_CACHE"], "opencl-vendors"))}
from perfx.runtime import list_devices, prepare
seen["platforms"] = sorted({entry.platform for entry in list_devices()})
seen["vendors"] = os.environ.get("OCL_ICD_VENDORS")
prepared = dict(os.environ), list(warnings.filters)
prepare()
seen["again"] = prepared == (dict(os.environ), list(warnings.filters))
print(json.dumps(seen))
"""


def test_importing_perfx_changes_nothing_and_the_first_listing_prepares_opencl(tmp_path):
    run = subprocess.run([sys.executable, "-c", IMPORT_ALL, *_top_level_imports_outside_perfx()], cwd=ROOT,
                         env=_clean_environment(tmp_path), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout)
    assert seen["changed"] == [] and seen["same_filters"] and not seen["icd_written"], "importing perfx acted"
    assert seen["again"], "prepare() a second time changed the process again"
    assert seen["platforms"]
    if intel_opencl_library() is not None:  # registered at the first listing: the .icd folder in perfx's cache
        assert "Intel(R) OpenCL" in seen["platforms"]
        assert Path(seen["vendors"]).parent == tmp_path / "cache" / "opencl-vendors"


def _platforms_listed_by_perfx_info(tmp_path, **env) -> list[str]:
    run = subprocess.run([sys.executable, "-m", "perfx", "info", "--json"], cwd=ROOT, capture_output=True,
                         text=True, env=_clean_environment(tmp_path, **env), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return sorted({entry["platform"] for entry in json.loads(run.stdout)["devices"]})


def test_intel_runtime_is_listed_beside_pocl_without_any_setting(tmp_path):
    library = intel_opencl_library()
    if library is None:
        message = "intel-opencl-rt is not installed (the dev extra brings it on x86-64 Linux)"
        if os.environ.get("PERFX_REQUIRE_INTEL") == "1":
            pytest.fail(message + "; PERFX_REQUIRE_INTEL=1 requires it")
        pytest.skip(message)
    assert _platforms_listed_by_perfx_info(tmp_path) == ["Intel(R) OpenCL", "Portable Computing Language"]
    assert _platforms_listed_by_perfx_info(tmp_path, OCL_ICD_VENDORS=str(library)) == ["Intel(R) OpenCL"]


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
    """On a Device of its own: the shared one's count also falls when another test's buffers are collected."""
    import gc
    own = Device(device.entry.index)
    array = own.upload(np.ones(1000, np.float32))
    image = own.image_rgba_u32(np.ones((2, 3, 4), np.uint32))
    assert own.allocated_bytes == 4000 + 96
    del array, image
    gc.collect()
    assert own.allocated_bytes == 0


def test_allocation_beyond_the_limit_is_a_clear_error():
    small = Device(limits=Limits(name="tiny", max_alloc=1024))
    with pytest.raises(PerfxError, match=r"needs one allocation of .* more than this device allows .*limits: tiny"):
        small.alloc(4096, what="a test buffer")


def test_image_beyond_the_height_limit_is_refused():
    small = Device(limits=Limits(name="short", image2d_max_height=4))
    with pytest.raises(PerfxError, match="exceeds the image2d limit"):
        small.image_rgba_u32(np.zeros((5, 2, 4), np.uint32))


def test_no_platform_message_says_how_to_get_one(monkeypatch):
    def no_platforms():
        raise cl.LogicError("clGetPlatformIDs", -1001, "PLATFORM_NOT_FOUND_KHR")

    monkeypatch.setattr(cl, "get_platforms", no_platforms)
    with pytest.raises(PerfxError, match=r"No OpenCL platform found.*pip install -e.*opencl-vendor-driver"):
        list_devices()


def test_copies_write_read_fill_and_copy_at_byte_offsets(device, rng):
    x = rng.standard_normal(100).astype(np.float32)
    buffer = device.alloc(x.nbytes)
    device.fill(buffer, np.float32(np.nan))
    device.write(buffer, x[:60], dst_offset=4 * 40)
    seen = device.read(np.empty(100, np.float32), buffer)
    assert np.isnan(seen[:40]).all() and np.array_equal(seen[40:], x[:60])
    assert np.array_equal(device.read(np.empty(10, np.float32), buffer, src_offset=4 * 50), x[10:20])
    array = device.upload(x)  # a pyopencl Array is taken as its buffer
    device.fill(array, np.float32(7), nbytes=4 * 10, offset=4 * 5)
    device.copy(buffer, array, 4 * 20, src_offset=4 * 2, dst_offset=4 * 1)
    expected = x.copy()
    expected[5:15] = 7
    assert np.array_equal(device.read(np.empty(20, np.float32), buffer)[1:], expected[2:21])
    host = -x
    device.write(array, host, wait=False).wait()  # not waiting: the host array is read when the copy runs
    assert np.array_equal(array.get(), -x)
    half = device.alloc(64)
    device.fill(half, np.uint16(0x3C00))  # 1.0 in fp16, as the KV cache is zeroed by two-byte patterns
    assert np.array_equal(device.read(np.empty(32, np.float16), half), np.ones(32, np.float16))


def test_copies_outside_the_buffer_or_with_a_bad_pattern_are_clear_errors(device):
    buffer = device.alloc(64)
    with pytest.raises(PerfxError, match="write: bytes 32 to 96 lie outside a buffer of 64 bytes"):
        device.write(buffer, np.zeros(16, np.float32), dst_offset=32)
    with pytest.raises(PerfxError, match="read: bytes 0 to 68 lie outside a buffer of 64 bytes"):
        device.read(np.empty(17, np.float32), buffer)
    with pytest.raises(PerfxError, match="C-contiguous"):
        device.read(np.empty((4, 4), np.float32)[:, ::2], buffer)
    with pytest.raises(PerfxError, match="fill takes a numpy scalar"):
        device.fill(buffer, 0.0)
    with pytest.raises(PerfxError, match="multiples of the 4-byte pattern"):
        device.fill(buffer, np.float32(0), nbytes=6)
    with pytest.raises(PerfxError, match="fill: bytes 60 to 68"):
        device.fill(buffer, np.float32(0), nbytes=8, offset=60)


@pytest.mark.parametrize("setting", ["", "on"])
def test_recorded_steps_replay_in_order_on_fresh_inputs(device, rng, monkeypatch, setting):
    """A chain a → b (kernel) → c (copy, at byte offsets) → d (kernel), recorded once and replayed on new
    contents of a each time: d must show this replay's a, so every step ran, after the one before it. By default
    the replay is one enqueue a launch; with PERFX_COMMAND_BUFFER=on, where the driver has
    cl_khr_command_buffer (Intel's CPU runtime does), one command buffer; ``replay_mode`` says which and why."""
    monkeypatch.setenv("PERFX_COMMAND_BUFFER", setting)
    device = Device(device.entry.index)
    n = 256
    a, b, c, d = (device.alloc(4 * n) for _ in range(4))
    kernel = device.kernel("copy.cl", "copy_vectors", {"VWC": 4})
    with device.record() as steps:
        device.launch(kernel, (16,), (16,), np.int32(n // 4), a, b)
        device.copy(c, b, 4 * (n - 8), src_offset=4 * 8, dst_offset=0)
        device.launch(kernel, (16,), (16,), np.int32(n // 4), c, d)
    replay = device.replay(steps)
    why = unavailable(device.cl_device, device.queue.properties)
    if why is not None:
        assert isinstance(replay, Sequence) and device.replay_mode == f"one enqueue a launch: {why}"
    elif setting == "on":
        assert isinstance(replay, CommandBuffer) and device.replay_mode.startswith("one command buffer")
        with pytest.raises(PerfxError, match="records launches and copies, not str"):
            CommandBuffer(device.cl_device, device.queue, ["a host callback"])
        with pytest.raises(PerfxError, match="replays on the queue it was recorded for"):
            replay.enqueue(cl.CommandQueue(device.context))
        # A launch the driver refuses to record (its arguments never set): the error names it, and the
        # device falls back to launches one by one, saying why.
        bad = [BoundLaunch(kernel, (10,), None, ())]
        with pytest.raises(OpenCLError, match=r"recording copy_vectors global=\(10,\)"):
            CommandBuffer(device.cl_device, device.queue, bad)
        assert isinstance(device.replay(bad), Sequence)
        assert device.replay_mode.startswith("one enqueue a launch: the driver refused a command buffer (")
        replay = device.replay(steps)   # from then on every step, launch by launch
        assert isinstance(replay, Sequence)
    else:
        assert isinstance(replay, Sequence) and "PERFX_COMMAND_BUFFER=on" in device.replay_mode
    for _ in range(3):
        x = rng.standard_normal(n).astype(np.float32)
        device.write(a, x)
        device.fill(d, np.float32(np.nan))
        replay.enqueue(device.queue)
        replay.enqueue(device.queue)   # again while the first may still be pending
        seen = device.read(np.empty(n, np.float32), d)
        assert np.array_equal(seen[:n - 8], x[8:])



def test_the_devices_queue_records_no_profiling_events_and_timing_profiles_on_its_own(device):
    """Every launch and copy runs on a queue without profiling events (the decode step's); ``time_launches``
    times on the device's profiling queue, entered and left by itself, in order with the lean queue's work both
    ways; events of the lean queue cannot be timed, with a message that says what to do."""
    from perfx.timing import device_time, time_launches

    lean = device.queue
    assert not lean.properties & cl.command_queue_properties.PROFILING_ENABLE
    kernel = device.kernel("copy.cl", "copy_vectors", {"VWC": 4})
    n = 1 << 12
    src = device.upload(np.arange(4 * n, dtype=np.float32))
    dst = device.poisoned(4 * n, np.float32)

    def launch():
        return [device.launch(kernel, (n,), None, np.int32(n), src.data, dst.data)]
    with pytest.raises(PerfxError, match="without profiling events"):
        device_time(launch())
    src.set(np.full(4 * n, 7.0, np.float32))   # on the lean queue, before the timed launches read it
    for timing in (time_launches(launch, warmup=1, repeat=3), time_launches(launch, repeat=2, device=device)):
        assert len(timing.samples) in (2, 3) and all(t > 0 for t in timing.samples)
    assert device.queue is lean
    np.testing.assert_array_equal(dst.get(), 7.0)   # the profiling queue's writes, read on the lean queue
    with device.profiling() as queue:
        assert device.queue is queue is not lean and queue.properties & cl.command_queue_properties.PROFILING_ENABLE
        with device.profiling() as inner:
            assert inner is queue
        assert device.queue is queue
        assert device_time(launch()) > 0
    assert device.queue is lean


def test_a_replayed_step_enqueues_each_recorded_launch_and_copy_in_order(device):
    """``Sequence`` calls pyopencl's enqueue straight on the recorded arguments: a launch, a copy and a launch run
    in their order, each reading what the one before wrote (a → b by a launch, b → c by a copy, c → e by a
    launch), every time the step is replayed."""
    kernel = device.kernel("copy.cl", "copy_vectors", {"VWC": 4})
    a = device.empty(4, np.float32)
    b, c, e = (device.poisoned(4, np.float32) for _ in range(3))
    with device.record() as steps:
        device.launch(kernel, (1,), (1,), np.int32(1), a.data, b.data)
        device.copy(c, b, 16)
        device.launch(kernel, (1,), (1,), np.int32(1), c.data, e.data)
    assert [type(step).__name__ for step in steps] == ["BoundLaunch", "BoundCopy", "BoundLaunch"]
    assert np.isnan(e.get()).all()   # recorded, not run
    replay = Sequence(list(steps))
    for value in (3.0, -1.5):
        a.set(np.full(4, value, np.float32))
        replay.enqueue(device.queue)
        np.testing.assert_array_equal(e.get(), value)


def test_recorded_launches_look_up_pyopencl_s_invoker_once_a_signature_and_each_keeps_its_arguments(device,
                                                                                                     monkeypatch):
    """A recording makes a Kernel a launch: pyopencl's argument-setting code for it comes from memory after the
    first of its signature (not from pyopencl's on-disk cache each time), and each launch keeps the arguments it
    was recorded with although they come from one kernel (clones where the driver has clCloneKernel)."""
    from pyopencl import invoker

    from perfx.runtime import implementations
    original = invoker.generate_enqueue_and_set_args.__wrapped__
    looked_up = []

    def counting(*args, **kwargs):
        looked_up.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(invoker, "generate_enqueue_and_set_args", counting)
    implementations._memoize_kernel_invokers()
    kernel = device.kernel("copy.cl", "copy_vectors", {"VWC": 4})
    n = 64
    sources = [device.upload(np.full(n, i, np.float32)) for i in range(6)]
    outputs = [device.poisoned(n, np.float32) for _ in range(6)]
    with device.record() as steps:
        for src, out in zip(sources, outputs):
            device.launch(kernel, (n // 4,), None, np.int32(n // 4), src.data, out.data)
    assert looked_up.count("copy_vectors") <= 1, looked_up
    for step in reversed(steps):   # in reverse: each launch's arguments are its own, not the last one set
        step.enqueue(device.queue)
    for i, out in enumerate(outputs):
        assert np.array_equal(out.get(), np.full(n, i, np.float32))


def test_a_kernel_reading_only_some_defines_is_one_for_the_programs_that_agree_on_them(device):
    """``reads``: copy_vectors reads VWC, not the other define: programs that differ only there share one Kernel
    (one compiled copy), those that differ in VWC do not, and none is shared once the programs are forgotten."""
    own = Device(device.entry.index)   # kernels kept by this test alone
    shared = own.kernel("copy.cl", "copy_vectors", {"VWC": 4, "UNREAD": 1}, reads=("VWC",))
    assert own.kernel("copy.cl", "copy_vectors", {"VWC": 4, "UNREAD": 2}, reads=("VWC",)) is shared
    assert own.programs_kept == 1   # the second program was never built
    assert own.kernel("copy.cl", "copy_vectors", {"VWC": 8, "UNREAD": 1}, reads=("VWC",)) is not shared
    assert own.kernel("copy.cl", "copy_vectors", {"VWC": 4, "UNREAD": 2}) is not shared   # asked for its own
    own.forget_programs()
    assert own.kernel("copy.cl", "copy_vectors", {"VWC": 4, "UNREAD": 1}, reads=("VWC",)) is not shared


def test_a_process_can_be_told_to_load_one_implementations_library_alone(tmp_path):
    folder = tmp_path / "vendors"
    folder.mkdir()
    (folder / "pocl.icd").write_text("libpocl.so.2\n")
    (folder / "perfx-intel-opencl-rt.icd").write_text("/site/lib/libintelocl.so\n")
    environ = {"OCL_ICD_VENDORS": str(folder)}
    assert one_library_environ("pocl", environ) == {"OCL_ICD_VENDORS": str(folder / "pocl.icd")}
    assert one_library_environ("intel", environ) == {"OCL_ICD_VENDORS": str(folder / "perfx-intel-opencl-rt.icd")}
    assert one_library_environ("nvidia", environ) is None   # no file names it
    (folder / "pocl-patched.icd").write_text("/opt/pocl/libpocl.so\n")
    assert one_library_environ("pocl", environ) is None     # two do: which is the device's is not known
    # the choice made already: one file, or the loader's list of libraries
    assert one_library_environ("intel", {"OCL_ICD_VENDORS": str(folder / "pocl.icd")}) is None
    assert one_library_environ("intel", {**environ, "OCL_ICD_FILENAMES": "/x/libintelocl.so"}) is None
