"""`perfx quantize SRC DST`: activation-aware 4-bit quantization of a Hugging Face checkpoint with AutoAWQ.

perfx reads AWQ checkpoints directly (GEMM and GEMV packings); this command only wraps AutoAWQ, which
needs PyTorch and the `quantize` extra. Without it, it says how to install it. For a quick try without
AutoAWQ, `--quantize q4` on any perfx command rounds an fp16 checkpoint to 4 bits on load instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

from perfx.errors import PerfxError
from perfx.formats import GROUP_SIZES
from perfx.sources import open_model

INSTALL_HELP = ('AutoAWQ is not installed: pip install -e ".[quantize]" (it brings PyTorch; quantizing a 7B model '
                "wants a CUDA GPU). Without it, `--quantize q4` on perfx generate/chat/bench rounds fp16 weights "
                "to 4 bits on load.")


def add_arguments(parser):
    parser.add_argument("source", help="a Hugging Face model directory with fp16/bf16 safetensors")
    parser.add_argument("destination", help="where to write the AWQ checkpoint (a new directory)")
    parser.add_argument("--group", type=int, default=128, choices=GROUP_SIZES, help="quantization group size")
    parser.add_argument("--version", default="gemm", choices=("gemm", "gemv"), help="AWQ packing to write")


def main(args) -> int:
    source, destination = Path(args.source).expanduser(), Path(args.destination).expanduser()
    if not (source / "config.json").is_file():
        raise PerfxError(f"{source} is not a Hugging Face model directory (no config.json)")
    if destination.exists() and any(destination.iterdir()):
        raise PerfxError(f"{destination} exists and is not empty: choose a new directory")
    try:
        from awq import AutoAWQForCausalLM
        from transformers import AutoTokenizer
    except ImportError:
        raise PerfxError(INSTALL_HELP) from None
    print(f"perfx: quantizing {source} with AutoAWQ (group {args.group}, {args.version.upper()}) ...",
          file=sys.stderr)
    model = AutoAWQForCausalLM.from_pretrained(str(source))
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    model.quantize(tokenizer, quant_config={"zero_point": True, "q_group_size": args.group, "w_bit": 4,
                                            "version": args.version.upper()})
    model.save_quantized(str(destination))
    tokenizer.save_pretrained(str(destination))
    open_model(destination)  # what perfx cannot read is an error now, not at the user's next command
    print(f"perfx: wrote {destination}; run it with: perfx chat --model {destination}", file=sys.stderr)
    return 0
