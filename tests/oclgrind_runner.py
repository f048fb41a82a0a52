"""Run kernel families under Oclgrind, the OpenCL simulator with memory, race and uninitialised-value checks.

tests/test_oclgrind.py starts this file as one subprocess per check, so that Oclgrind's reports (printed on
stderr) belong to one family and one parameter set. By hand, from the repository root:

    python tests/oclgrind_runner.py FAMILY [SAMPLE]     # SAMPLE: "default" (the default), 1, 2 or 3
    python tests/oclgrind_runner.py FAMILY '{"LANES": 4, "ROWS": 2, "READ": 0}'
    python tests/oclgrind_runner.py --device            # only open the device
    python tests/oclgrind_runner.py --samples           # per family, how many samples exist here
    python tests/oclgrind_runner.py --bad oob           # a deliberately wrong kernel: oob, race, uninit, api

It prints DEVICE_READY on stderr once the device is open (reports before it come from opening the device),
then one JSON line on stdout: the family, the parameters, and per shape each output's relative error
against the float64 reference. The environment (``oclgrind_env``) is set here before pyopencl loads,
unless the caller has set OCL_ICD_VENDORS already.

How pyopencl finds Oclgrind: the pyopencl wheel bundles ocl-icd, which reads ``OCL_ICD_VENDORS``; a path to
an ICD library there makes that library the only platform, so nothing (PoCL) can answer in its place.
Debian's package ships no /etc/OpenCL/vendors entry, so this is also the only way the simulator is found.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import zlib
from pathlib import Path

# Debian and Ubuntu (package oclgrind), then a source build's default prefix.
ICD_CANDIDATES = (
    "/usr/lib/oclgrind/liboclgrind-rt-icd.so",
    "/usr/lib/x86_64-linux-gnu/oclgrind/liboclgrind-rt-icd.so",
    "/usr/local/lib/liboclgrind-rt-icd.so",
)
INSTALL_HELP = ("Oclgrind is not installed: `apt-get install oclgrind` (Debian/Ubuntu; CI's .ci/run installs "
                "it), or point OCLGRIND_ICD at liboclgrind-rt-icd.so")

# Oclgrind's checks, as environment variables (`strings /usr/bin/oclgrind`; its man page lists them as
# --check-api, --data-races, --uninitialized). Out-of-bounds accesses are always checked.
CHECKS = {"OCLGRIND_CHECK_API": "1", "OCLGRIND_DATA_RACES": "1", "OCLGRIND_UNINITIALIZED": "1"}

DEVICE_READY = "oclgrind_runner: DEVICE_READY"

# Parameter sets drawn per family besides the defaults, with a fixed seed per family: CI is reproducible.
SAMPLES = 3

# The first line of each kind of Oclgrind report (its Context/Logger and plugins, runtime API checks),
# and the context lines every kernel report carries.
REPORT = re.compile(
    r"Oclgrind|Invalid (read|write)|data race|Uninitiali[sz]ed|divergence|Unaligned|out of bounds"
    r"|Arithmetic exception|^\s*(Kernel|Entity|Work-item|Work-group):", re.IGNORECASE)


def find_icd() -> str | None:
    """Oclgrind's ICD library (``OCLGRIND_ICD`` overrides the search), or None when it is not installed."""
    override = os.environ.get("OCLGRIND_ICD")
    if override:
        return override if Path(override).is_file() else None
    return next((path for path in ICD_CANDIDATES if Path(path).is_file()), None)


# Families whose kernels crash Oclgrind 21.10's uninitialised-value plugin itself (a SIGSEGV in the simulator, even
# at -O0): the int8-activation GEMMs (int16 vector products of bytes over several rows of X). They run with the
# bounds, race and API checks; without the plugin they report nothing and their outputs match the reference.
UNINITIALIZED_PLUGIN_CRASHES = ("gemm_q4_i8", "gemm_q8_i8")


def oclgrind_env(icd: str, base: dict | None = None, family: str | None = None) -> dict:
    """The environment of a run under Oclgrind: its ICD as the only platform, its checks on (for ``family``, where
    given, less the plugin that crashes on it: ``UNINITIALIZED_PLUGIN_CRASHES``)."""
    env = dict(os.environ if base is None else base)
    env.update(CHECKS)
    if family in UNINITIALIZED_PLUGIN_CRASHES:
        env.pop("OCLGRIND_UNINITIALIZED")
    # Past 1000 reports Oclgrind stops reporting ("suppressing further errors"): a real finding could hide
    # behind a false positive repeated per work-item, so it reports every one.
    env["OCLGRIND_MAX_ERRORS"] = "10000000"
    env["OCL_ICD_VENDORS"] = icd
    env["PERFX_DEVICE"] = "oclgrind"
    env.pop("PERFX_LIMITS", None)  # the simulator's own limits decide which parameter sets may run
    env.pop("OCLGRIND_LOG", None)  # reports must reach stderr, where the test reads them
    # Oclgrind's "binaries" are not worth caching, and the uncached build skips one unknown-info probe.
    env["PYOPENCL_NO_CACHE"] = "1"
    # Oclgrind 21.10's uninitialised-value plugin fails on optimised code: a SIGSEGV in
    # Uninitialized::instructionExecuted on vector integer operations such as `uint4 & uint4` (the int4
    # kernels, rmsnorm, gemv_f16) and "OCLGRIND FATAL ERROR (Uninitialized.cpp:1805)" on others (attention,
    # gemm_q4_tiled). At -O0 every family runs; -O0 also keeps every access the source makes, so none is
    # optimised out of the bounds check. Its one flaw there: see IMAGE_READ_FALSE_POSITIVE.
    env["OCLGRIND_BUILD_OPTIONS"] = "-O0"
    return env


# The one report that is not a finding: a device-info query for a name the device does not know, which is how
# a vendor extension is probed. pyopencl asks every device for NVIDIA's compute capability each time it
# creates a Kernel (invoker._check_arg_size) and takes the error as "not NVIDIA".
UNKNOWN_INFO_PROBE = re.compile(r"Function: clGetDeviceInfo\s+Error:\s+CL_INVALID_VALUE\s+"
                                r"For argument 'param_name'\s*$")


# At -O0, Oclgrind 21.10 marks the texel that read_imageui returns as uninitialised in the int4 kernels
# (gemv_q4, gemm_q4_skinny and gemm_q4_tiled with READ from an image) whenever the coordinate is not a
# constant, though the image is written whole at creation. A false positive: the same kernels at -O1 and
# -O2 report nothing (where the plugin runs at all), a constant coordinate reports nothing, and the outputs
# match the reference. So for parameter sets that read an image, uninitialised-value reports are set aside;
# bounds, races and API reports still count.
IMAGE_READ_FALSE_POSITIVE = re.compile(r"^(Uninitialized value|Controlflow depends on uninitialized)",
                                       re.IGNORECASE)


def reads_images(params: dict) -> bool:
    """Whether a parameter set meets the uninitialised-value false positives: it reads through an image
    (every family's READ parameter: 1 image2d, 2 an image1d_buffer view), or forms int16 products of
    reinterpreted byte vectors (gemv_q4's I8), which the plugin marks uninitialised at -O0 as well (the same
    run without it reports no bounds, race or API finding, and the outputs match the reference)."""
    # perfx.ops.params READ_IMAGE2D, READ_IMAGE1D (not imported: pyopencl must load later)
    return params.get("READ") in (1, 2) or bool(params.get("I8"))


def reports(stderr: str, image_reads: bool = False) -> list[str]:
    """Oclgrind's reports in a run's stderr (blank-line separated blocks), less unknown-info probes and,
    where the kernel reads images, the uninitialised-value false positive."""
    found = []
    for block in re.split(r"\n\s*\n", stderr.replace(DEVICE_READY, "\n")):
        block = block.strip("\n")
        if not any(REPORT.search(line) for line in block.splitlines()) or UNKNOWN_INFO_PROBE.search(block):
            continue
        if image_reads and IMAGE_READ_FALSE_POSITIVE.search(block):
            continue
        found.append(block)
    return found


def split_at_ready(stderr: str) -> tuple[str, str]:
    """(what came before the device was open, what came after)."""
    before, marker, after = stderr.partition(DEVICE_READY)
    return (before, after) if marker else (stderr, "")


# Sets the simulator itself crashes on (a segmentation fault, no report), per family: gemv_q4_rows.cl's int16-pair
# int8 products (I8 1), which gemv_q4_tail includes whole (gemv_q4's own samples do not draw that set; run at it
# through this runner, the plain gemv_q4 crashes Oclgrind the same way). PoCL and Intel's runtime check them.
SIMULATOR_CRASHES = {"gemv_q4_tail": lambda p: p["I8"] == 1}


def samples(spec, caps) -> list[dict]:
    """SAMPLES parameter sets (fewer where the family has fewer) drawn, defaults excluded, from those the
    tuner may choose for the family's first Oclgrind shape on this device (less ``SIMULATOR_CRASHES``)."""
    defaults = spec.params.defaults()
    crashes = SIMULATOR_CRASHES.get(spec.params.family, lambda p: False)
    others = [p for p in spec.params.candidates(spec.oclgrind_shapes[0], caps) if p != defaults and not crashes(p)]
    return random.Random(zlib.crc32(spec.params.family.encode())).sample(others, min(SAMPLES, len(others)))


def sample_counts() -> dict[str, int]:
    """Per family, how many samples exist on this device: what tests/test_oclgrind.py parametrizes."""
    from perfx.tuning import SPECS

    device = _open_device()
    return {family: len(samples(spec, device.caps)) for family, spec in SPECS.items()}


def _open_device():
    from perfx.runtime import Device

    device = Device()
    if "oclgrind" not in device.caps.platform.lower():
        raise SystemExit(f"expected the Oclgrind platform, got {device.caps.platform!r}: "
                         "is OCL_ICD_VENDORS set?")
    print(DEVICE_READY, file=sys.stderr, flush=True)
    return device


def run_family(family: str, which: str = "default") -> dict:
    """One family at one parameter set ("default", a sample number or a JSON object): the defaults and a JSON
    object's set on every one of its spec's oclgrind_shapes, a sample on the first."""
    import numpy as np

    from perfx.tuning import SPECS, relative_error

    spec = SPECS[family]
    device = _open_device()
    shapes = spec.oclgrind_shapes
    if which == "default":
        params = spec.params.defaults()
    elif which.lstrip().startswith("{"):
        requested = json.loads(which)
        params = {**spec.params.defaults(requested), **requested}
    else:
        drawn, sample = samples(spec, device.caps), int(which)
        if not 1 <= sample <= len(drawn):
            raise SystemExit(f"{family} has {len(drawn)} sample(s) on this device, not a sample {which}")
        params, shapes = drawn[sample - 1], shapes[:1]
    results = []
    # Every case is kept until the end: Oclgrind 21.10's uninitialised-value plugin keeps a shadow per buffer index
    # and never drops it when the buffer is released, and Oclgrind gives a released buffer's index to the next
    # allocation. A case's buffer that took an earlier case's index inherited that buffer's shadow: reads past its
    # size read as uninitialised whatever the kernels wrote (sample at V = 16 384 after V = 203), and a stale clean
    # shadow could hide a read of what nothing wrote. Alive, each buffer has a fresh index, its shadow poisoned whole
    # until written.
    cases = []
    for index, shape in enumerate(shapes):
        reason = spec.params.why_invalid(params, shape, device.caps)
        if reason:
            results.append({"shape": shape, "skipped": reason})
            continue
        rng = np.random.default_rng(zlib.crc32(f"{family} {index}".encode()))
        case = spec.make_case(device, shape, rng)
        cases.append(case)
        outputs = case.run(params)
        errors = {name: relative_error(outputs[name], want) for name, want in case.expected.items()}
        results.append({"shape": shape, "describe": spec.describe(shape), "errors": errors})
    return {"family": family, "params": params, "image_reads": reads_images(params),
            "tolerance": spec.tolerance_for(params), "results": results}


# Deliberately wrong kernels: each must draw a report, or the tier could pass by seeing nothing.
BAD_KERNELS = {
    "oob": "__kernel void bad(__global float *y) { y[get_global_id(0) + 1] = 1.0f; }",
    "race": ("__kernel void bad(__global float *y) { __local float t[1]; t[0] = (float)get_local_id(0); "
             "y[get_global_id(0)] = t[0]; }"),
    "uninit": ("__kernel void bad(__global float *y) { float t[4]; t[0] = 1.0f; "
               "if (t[get_global_id(0) + 1] > 0.0f) y[get_global_id(0)] = 2.0f; }"),
}


def run_bad(kind: str) -> dict:
    import numpy as np
    import pyopencl as cl

    device = _open_device()
    y = device.upload(np.zeros(4, np.float32))
    if kind == "api":  # a work-group size that does not divide the global size
        kernel = cl.Program(device.context, BAD_KERNELS["race"]).build().bad
        try:
            cl.enqueue_nd_range_kernel(device.queue, kernel.set_args(y.data) or kernel, (3,), (2,))
        except cl.Error:
            pass
    else:
        kernel = cl.Program(device.context, BAD_KERNELS[kind]).build().bad
        kernel.set_args(y.data)
        cl.enqueue_nd_range_kernel(device.queue, kernel, (4,), (4,)).wait()
    return {"bad": kind}


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    if "OCL_ICD_VENDORS" not in os.environ:
        icd = find_icd()
        if icd is None:
            print(INSTALL_HELP, file=sys.stderr)
            return 3
        os.environ.update(oclgrind_env(icd, family=argv[1]))
    if argv[1] == "--device":
        _open_device()
        result = {"device": "ready"}
    elif argv[1] == "--samples":
        result = sample_counts()
    elif argv[1] == "--bad":
        result = run_bad(argv[2])
    else:
        result = run_family(argv[1], argv[2] if len(argv) == 3 else "default")
    print(json.dumps(result, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
