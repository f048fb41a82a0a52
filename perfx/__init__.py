"""perfx: hand-written OpenCL kernels for Llama-family LLMs on phone GPUs, Adreno first."""

from perfx.errors import PerfxError

__version__ = "0.1.0"
__all__ = ["PerfxError", "__version__"]
