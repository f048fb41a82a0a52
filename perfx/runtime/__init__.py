"""The device layer: the one package that talks to OpenCL (with the kernel wrappers of ``perfx.ops``).

- ``implementations``: ``prepare()``, the process's OpenCL set-up, run once when perfx first needs a
  device, never at import: Intel's CPU runtime from PyPI registered with the ICD loader, pyopencl's
  build warnings quieted (``show_build_logs`` shows them).
- ``capabilities``: what a device can do (``Capabilities``), how it is identified (Adreno's model), and the
  phone limits that cap it (``Limits``, ``PERFX_LIMITS``).
- ``selection``: the devices installed here (``list_devices``) and the one perfx takes (``choose_device``,
  ``PERFX_DEVICE``).
- ``device``: ``Device``, its builds with ``-D`` defines (programs and ``Kernel`` objects kept; many at once
  with ``build_many``, or on a thread of their own while the caller goes on with ``build_in_background``, in
  worker processes where a driver builds one at a time within a process, else on threads,
  PERFX_BUILD_WORKERS, PERFX_BUILD_PROCESSES; requests collected unbuilt with ``collecting``), launches
  and their recording, counted memory, and every copy (``copy``, ``write``, ``read``, ``fill``).
- ``replay``: the decode step's recorded launches and copies, replayed each token one by one, or in one
  command buffer (``cl_khr_command_buffer``) or Adreno recording (``cl_qcom_recordable_queues``) where asked
  for (``PERFX_REPLAY``) and the driver has it.
- ``errors``: OpenCL errors by name, build failures with their log, kernels beyond the driver's limits.
"""

from perfx.runtime.capabilities import (LIMIT_PRESETS, Capabilities, Limits, capabilities_dict, has_subgroups,
                                        identify, parse_adreno_model, parse_limits, read_capabilities)
from perfx.runtime.device import (BUILD_PROCESSES_ENV, BUILD_WORKERS_ENV, BuildConcurrencyWarning, BuildReport,
                                  Device, build_key, build_options, build_workers_peak_bytes, get_device,
                                  resident_bytes, resident_peak_bytes, running_build_workers, shutdown_build_workers)
from perfx.runtime.errors import (BuildError, DriverError, KernelInfo, KernelLimitError, OpenCLError,
                                  cl_error_name)
from perfx.runtime.implementations import (intel_opencl_library, merged_vendor_entries, one_library_environ, prepare,
                                          show_build_logs)
from perfx.runtime.replay import BoundCopy, BoundLaunch
from perfx.runtime.selection import DEVICE_HELP, DeviceEntry, choose_device, list_devices

__all__ = [
    "BUILD_PROCESSES_ENV", "BUILD_WORKERS_ENV", "BuildConcurrencyWarning", "BuildReport", "build_key",
    "build_workers_peak_bytes", "resident_bytes", "resident_peak_bytes", "running_build_workers", "BoundCopy", "BoundLaunch", "BuildError", "Capabilities", "DEVICE_HELP", "Device", "DeviceEntry",
    "DriverError", "KernelInfo", "KernelLimitError", "LIMIT_PRESETS", "Limits", "OpenCLError", "build_options",
    "capabilities_dict", "choose_device", "cl_error_name", "get_device", "has_subgroups", "identify",
    "intel_opencl_library", "list_devices", "merged_vendor_entries", "parse_adreno_model", "parse_limits",
    "prepare", "read_capabilities", "show_build_logs", "shutdown_build_workers",
]
