"""perfx: hand-written OpenCL kernels for the small LLMs people run on phone GPUs, Adreno first.

What a user of the library needs is here: the device, the weight forms and their upload, one wrapper
per kernel family, the float64 references, the timing helpers, model loading and generation.
The layers, bottom to top (each imports only from those below it):

    errors, resources, recipe, families, config,        plain Python and numpy; one file an architecture
      reference, progress
    runtime, timing                                      OpenCL: the device, builds, memory, timing
    formats, tokenizer, constrain                        host forms of 4- and 8-bit weights; tokenizers;
                                                         grammars (JSON schemas) for constrained decoding
    ops                                                  one wrapper per kernel family + its parameter space
    op, linear, mixers, forward64                        an op of a step; a matrix and its kernels; one mixer
                                                         a layer kind; the float64 whole-model forward
    sources                                              model files -> host weights, one module per format
    tuning, step                                         specs (verification, metrics), tuner, database,
                                                         problems; the step as data
    model, generate, speculative                         the decoder forward; sampling; speculative decoding
    commands, cli                                        `perfx info / selftest / generate / chat / tune / bench`
"""

from perfx import forward64, reference
from perfx.constrain import Constraint
from perfx.errors import PerfxError
from perfx.formats import Q4Matrix, Q8Matrix
from perfx.generate import Conversation, SamplingConfig, generate
from perfx.model import Model, load_model
from perfx.ops.attention_decode import AttentionDecode
from perfx.ops.attention_prefill import AttentionPrefill
from perfx.ops.embedding_q8 import EmbeddingQ8
from perfx.ops.gemm_q4 import GemmQ4
from perfx.ops.gemm_q8 import GemmQ8
from perfx.ops.gemv_f16 import F16DeviceWeight, GemvF16
from perfx.ops.gemv_q4 import GemvQ4
from perfx.ops.gemv_q8 import GemvQ8
from perfx.ops.kv_cache import KVCache, RopeTable
from perfx.ops.logit_mask import LogitMask
from perfx.ops.q4_weight import Q4DeviceWeight
from perfx.ops.q8_weight import Q8DeviceWeight
from perfx.ops.rmsnorm import RMSNorm
from perfx.ops.small_ops import Argmax, Embedding, GeGLU, Softcap, SwiGLU
from perfx.runtime import Device, Limits
from perfx.sources import open_model
from perfx.speculative import DraftModel, Speculator
from perfx.timing import copy_bandwidth, time_launches
from perfx.tuning.spec import relative_error

__version__ = "0.1.0"
__all__ = [
    "Argmax", "AttentionDecode", "AttentionPrefill", "Constraint", "Conversation", "Device", "DraftModel", "Embedding",
    "EmbeddingQ8",
    "F16DeviceWeight", "GeGLU", "GemmQ4", "GemmQ8", "GemvF16", "GemvQ4", "GemvQ8", "KVCache", "Limits", "LogitMask",
    "Model", "PerfxError", "Q4DeviceWeight", "Q4Matrix", "Q8DeviceWeight", "Q8Matrix", "RMSNorm", "RopeTable",
    "SamplingConfig", "Softcap", "Speculator", "SwiGLU", "__version__", "copy_bandwidth", "generate", "load_model",
    "forward64", "open_model", "reference", "relative_error", "time_launches",
]
