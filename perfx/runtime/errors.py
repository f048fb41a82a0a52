"""OpenCL's failures as perfx errors: error codes by their constant's name, build failures with the
compiler's log, and kernels whose parameters break the limits the driver reports for them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyopencl as cl

from perfx.errors import PerfxError

# What pyopencl raises for a failed call that does not go through the Device: a pyopencl Array's get, set or
# fill, which is also where a driver may report an earlier kernel's failure. The Device's calls raise
# OpenCLError instead.
DriverError = cl.Error


def cl_error_name(code: int) -> str:
    """``-46`` -> ``CL_INVALID_KERNEL_NAME``."""
    try:
        return "CL_" + cl.status_code.to_string(code)
    except Exception:  # an extension's code pyopencl does not know
        return f"CL_ERROR_{code}"


class OpenCLError(PerfxError):
    """An OpenCL call failed; the message names the error constant."""

    def __init__(self, what: str, code: int, detail: str = ""):
        self.code = code
        self.name = cl_error_name(code)
        super().__init__(f"OpenCL error {code}: {self.name} in {what}" + (f"\n{detail}" if detail else ""))


def define_flags(defines: dict) -> list[str]:
    """``{"WGS": 64, "HALF": True}`` -> ``["-DHALF=1", "-DWGS=64"]``: the build options of a kernel's defines."""
    flags = []
    for name in sorted(defines):
        value = defines[name]
        if isinstance(value, bool):
            value = int(value)
        flags.append(f"-D{name}={value}")
    return flags


class BuildError(PerfxError):
    """A kernel file failed to build on this driver; carries the file, the defines and the log."""

    def __init__(self, file: str, defines: dict, log: str, device_name: str):
        self.file, self.defines, self.log = file, dict(defines), log
        lines = [line.strip() for line in log.splitlines() if line.strip()]
        # One line for notes and tables: the compiler's first error, else the log's first line.
        self.summary = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "no log")
        flags = " ".join(define_flags(defines)) or "(no defines)"
        # The driver's compiler cannot target this CPU at all (a PoCL whose LLVM is older than the CPU does not
        # know it, asks for 'generic' instead and refuses that): no kernel of any parameters builds on this
        # device.
        self.compiler_lacks_cpu = "unknown target CPU" in log
        advice = ("This implementation's compiler does not know this CPU, so no kernel builds on it: choose another "
                  "OpenCL implementation with --device or PERFX_DEVICE (`perfx info` lists them; Intel's CPU runtime "
                  "is `pip install intel-opencl-rt`), or a PoCL built with an LLVM that knows this CPU."
                  if self.compiler_lacks_cpu else
                  "If this is a tuned parameter set, run `perfx selftest` and report the log; "
                  "perfx falls back to the defaults when a tuned kernel does not build.")
        super().__init__(
            f"kernels/{file} failed to build on {device_name} with {flags}.\n"
            f"Build log:\n{log.strip()}\n{advice}"
        )


@dataclass(frozen=True)
class KernelInfo:
    """What the driver says of one built kernel (clGetKernelWorkGroupInfo)."""

    name: str
    work_group: int                 # the most work-items it runs in one work-group here
    required: tuple[int, ...]       # its reqd_work_group_size, () if it has none
    local_mem: int                  # bytes of local memory it uses
    private_mem: int                # bytes of private memory per work-item: above 0, registers spilled

    @property
    def required_size(self) -> int:
        return int(np.prod(self.required)) if self.required else 0


class KernelLimitError(PerfxError):
    """A kernel built, but its parameters break the limits the driver reports for it (its work-group, or
    the local or private memory it needs): on this driver those parameters cannot run."""


def raise_as_perfx(what: str, error: cl.Error):
    """Raise ``error`` again as an OpenCLError about ``what``; running out of memory says what to do."""
    code = getattr(error, "code", 0)
    if code in (-4, -5, -6, -61):  # MEM_OBJECT_ALLOCATION_FAILURE, OUT_OF_RESOURCES, OUT_OF_HOST_MEMORY, INVALID_BUFFER_SIZE
        raise OpenCLError(what, code, "The device ran out of memory: use a smaller --ctx, a smaller model, "
                          "or free other GPU work.") from error
    raise OpenCLError(what, code) from error
