"""Preparing the process for OpenCL, once, when perfx first needs a device (never at import): the
OpenCL implementations installed from PyPI made visible to the ICD loader, pyopencl's warnings and
build-log settings, and one look-up of pyopencl's argument-setting code per kernel signature.

pyopencl's wheel bundles ocl-icd, which loads the libraries named by the .icd files of one folder
(OCL_ICD_VENDORS if it is a folder, else OPENCL_VENDOR_PATH, else /etc/OpenCL/vendors), plus the PoCL
shipped beside pyopencl itself. The intel-opencl-rt wheel's own .icd file holds a build-time placeholder
path, so perfx writes a folder holding what the loader would read anyway plus an .icd file with the
absolute path of the installed libintelocl.so, and points OCL_ICD_VENDORS at it. ocl-icd reads that
variable at the process's first query of platforms, so ``prepare()`` must run before it: ``list_devices``
(and so ``choose_device`` and ``Device``) and the command line call it. OCL_ICD_VENDORS naming one library
is left alone: that asks for that platform alone (the Oclgrind tier does this).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import pyopencl as cl
from pyopencl import invoker as pyopencl_invoker

from perfx.resources import cache_dir

INTEL_ICD = "perfx-intel-opencl-rt.icd"
DEFAULT_VENDORS_FOLDER = "/etc/OpenCL/vendors"

_prepared = False
_prepare_lock = threading.Lock()


def prepare() -> None:
    """Set the process up for OpenCL; the first call does it, later ones return at once.

    - Registers the implementations installed from PyPI (Intel's CPU runtime) with the ICD loader, by
      setting OCL_ICD_VENDORS; this must come before the process's first query of platforms.
    - Silences Intel's compiler output, which it logs on every successful build ("Kernel was 16-way
      vectorized") and pyopencl turns into a CompilerWarning per new program (ours and pyopencl.array's); a
      failed build raises with its log anyway. PYOPENCL_COMPILER_OUTPUT=1 (or ``show_build_logs``) shows it.
    - Sets PYOPENCL_CACHE_FAILURE_FATAL (empty: not fatal) where unset: pyopencl's binary cache reads it
      without a default when a build fails for another reason than the source (CL_INVALID_BUILD_OPTIONS,
      say), a KeyError instead of the OpenCL error. Set, the build is retried uncached and the real error
      surfaces, after a UserWarning with pyopencl's traceback that is silenced: BuildError carries the log.
    - Keeps pyopencl's argument-setting code in memory per kernel signature (``_memoize_kernel_invokers``).

    Code that queries pyopencl's platforms itself, before any Device, calls this first.
    """
    global _prepared
    with _prepare_lock:
        if _prepared:
            return
        if not os.environ.get("PYOPENCL_COMPILER_OUTPUT"):
            warnings.filterwarnings("ignore", category=cl.CompilerWarning)
        os.environ.setdefault("PYOPENCL_CACHE_FAILURE_FATAL", "")
        warnings.filterwarnings("ignore", message="PyOpenCL compiler caching failed", category=UserWarning)
        _register_pypi_implementations()
        _memoize_kernel_invokers()
        _prepared = True


def _memoize_kernel_invokers() -> None:
    """Every pyopencl Kernel made looks up its argument-setting and enqueue code (Python generated per kernel
    name and argument signature, ``pyopencl.invoker``) in pyopencl's on-disk cache, which keeps no copy in
    memory: a SQLite read, an unpickle and a compile of the code for each Kernel. A recorded step makes a Kernel
    a launch (``BoundLaunch``), a tuning sweep's timing recordings hundreds of thousands, so the look-up cost
    more than the launches. The code is a pure function of that signature and takes the kernel as an argument,
    so one look-up a signature serves every kernel of the process. The device list only feeds a warning about
    argument sizes, given at the first look-up. A pyopencl without this function is left as it is."""
    generate = getattr(pyopencl_invoker, "generate_enqueue_and_set_args", None)
    if generate is None or getattr(generate, "perfx_memoized", False):
        return
    memo: dict = {}

    def memoized(*args, **kwargs):
        try:
            key = (args, tuple(sorted((k, v) for k, v in kwargs.items() if k != "devs")))
            hash(key)
        except TypeError:   # an argument type pyopencl may add that does not hash: no memo
            return generate(*args, **kwargs)
        found = memo.get(key)
        if found is None:
            found = memo.setdefault(key, generate(*args, **kwargs))
        return found

    memoized.perfx_memoized = True
    memoized.__wrapped__ = generate
    pyopencl_invoker.generate_enqueue_and_set_args = memoized


def show_build_logs() -> None:
    """Print the compiler's output of every kernel built from now on (`--verbose`); by default only a failed
    build shows its log, in the error."""
    os.environ["PYOPENCL_COMPILER_OUTPUT"] = "1"
    warnings.filterwarnings("always", category=cl.CompilerWarning)


def intel_opencl_library() -> Path | None:
    """libintelocl.so of the installed ``intel-opencl-rt`` wheel, or None (not installed, not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        dist = importlib.metadata.distribution("intel-opencl-rt")
    except importlib.metadata.PackageNotFoundError:
        return None
    candidates = [Path(dist.locate_file(f)) for f in dist.files or () if f.name == "libintelocl.so"]
    candidates.append(Path(sys.prefix, "lib", "libintelocl.so"))
    return next((c.resolve() for c in candidates if c.is_file()), None)


def read_vendor_folder(folder: str | os.PathLike) -> dict[str, str]:
    """The ``.icd`` files of an ICD folder, as file name -> the library each names (as written)."""
    entries = {}
    with contextlib.suppress(OSError):
        for path in sorted(Path(folder).glob("*.icd")):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                library = path.read_text().strip()
                if library:
                    entries[path.name] = library
    return entries


def merged_vendor_entries(environ, libraries: dict[str, Path]) -> dict[str, str] | None:
    """The ``.icd`` entries of a folder for OCL_ICD_VENDORS: what the loader reads under ``environ`` plus
    ``libraries`` (file name -> library); None where nothing should change (OCL_ICD_VENDORS names one
    library, or every library is listed already)."""
    chosen = environ.get("OCL_ICD_VENDORS") or None
    if chosen is not None and not os.path.isdir(chosen):
        return None
    entries = read_vendor_folder(chosen or environ.get("OPENCL_VENDOR_PATH") or DEFAULT_VENDORS_FOLDER)

    def listed(library: Path) -> bool:
        return any(os.path.isfile(named) and os.path.samefile(named, library) for named in entries.values())

    missing = {name: str(library) for name, library in libraries.items() if not listed(library)}
    return {**entries, **missing} if missing else None


def one_library_environ(implementation: str, environ=None) -> dict[str, str] | None:
    """The environment under which the ICD loader of a new process loads only the library of ``implementation``
    ("pocl", "intel": ``DeviceEntry.implementation``): OCL_ICD_VENDORS naming its one ``.icd`` file, from the
    folder this process reads (after ``prepare``). None where it cannot tell which file (none or several name the
    implementation) or the choice is made already (OCL_ICD_VENDORS names one file; OCL_ICD_FILENAMES). A worker
    checking on one device then does not load the others' libraries: Intel's CPU runtime holds about 115 MiB
    of a PoCL worker's memory (benchmarks/NOTES.md, the PoCL selftest's waste). The platform's index
    changes: the worker opens device ``0:D`` and checks that it is the same one."""
    environ = os.environ if environ is None else environ
    chosen = environ.get("OCL_ICD_VENDORS") or None
    if environ.get("OCL_ICD_FILENAMES") or (chosen is not None and not os.path.isdir(chosen)):
        return None
    folder = chosen or environ.get("OPENCL_VENDOR_PATH") or DEFAULT_VENDORS_FOLDER
    key = implementation.lower()
    named = [name for name, library in read_vendor_folder(folder).items()
             if key and (key in name.lower() or key in Path(library).name.lower())]
    if len(named) != 1:
        return None
    return {"OCL_ICD_VENDORS": str(Path(folder) / named[0])}


def _write_vendor_folder(entries: dict[str, str]) -> Path:
    """A folder holding ``entries`` as .icd files: in perfx's cache, named by its content (processes
    and their children share it), else a new temporary folder."""
    digest = hashlib.sha256(json.dumps(sorted(entries.items())).encode()).hexdigest()[:16]
    try:
        folder = cache_dir() / "opencl-vendors" / digest
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="perfx-opencl-vendors-"))
    for name, library in entries.items():
        path = folder / name
        with contextlib.suppress(OSError):
            if path.read_text() == library + "\n":
                continue
        part = folder / f".{name}.{os.getpid()}"  # written whole, then renamed: never read half-written
        part.write_text(library + "\n")
        os.replace(part, path)
    return folder


def _register_pypi_implementations() -> None:
    """Point OCL_ICD_VENDORS at a folder that adds Intel's CPU runtime (from ``intel-opencl-rt``) to what the
    loader reads. Without it nothing happens; a failure to write the folder only leaves it out."""
    library = intel_opencl_library()
    if library is None:
        return
    entries = merged_vendor_entries(os.environ, {INTEL_ICD: library})
    if entries is None:
        return
    with contextlib.suppress(OSError):
        os.environ["OCL_ICD_VENDORS"] = str(_write_vendor_folder(entries))
