"""llama.cpp (llama-cpp-python) as the tests and benchmarks open it: the one place that knows how it must be
set up on our machines. It is a benchmark and comparison tool, never a perfx dependency."""

from __future__ import annotations

from pathlib import Path

INSTALL = ("llama-cpp-python is not installed (benchmark-only: CMAKE_ARGS=\"-DGGML_NATIVE=ON\" "
           "pip install llama-cpp-python==0.3.36 builds it in about ten minutes)")


def cpu_has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def import_llama_cpp():
    """The llama_cpp module, set up so that models load without llama.cpp's extra weight buffers where the CPU
    reports AMX: on a 2-core Xeon VM (KVM, `amx_int8` in /proc/cpuinfo) llama-cpp-python 0.3.36's AMX matrix
    product (ggml_backend_amx_mul_mat) dies with a segfault on the first prompt batch, taking the whole
    process with it. Without them llama.cpp runs its AVX-512 VNNI kernels, as on any other x86 machine.
    Elsewhere nothing changes (the extra buffers also hold the weights repacked for other CPUs' kernels)."""
    import llama_cpp
    import llama_cpp.llama_cpp as api

    defaults = api.llama_model_default_params
    if cpu_has_amx() and not getattr(defaults, "perfx_without_extra_buffers", False):
        def without_extra_buffers():
            params = defaults()
            params.use_extra_bufts = False
            return params
        without_extra_buffers.perfx_without_extra_buffers = True
        api.llama_model_default_params = without_extra_buffers
    return llama_cpp
