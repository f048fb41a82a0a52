"""The `perfx` command line: one subcommand per module of ``perfx.commands``."""

from __future__ import annotations

import argparse
import os
import sys

from perfx.commands import (bench, chat, generate, info, perplexity, quantize, report, selftest, serve, tune,
                            warm)
from perfx.errors import PerfxError
from perfx.runtime import prepare

# (name, module, one-line help, description shown by `perfx NAME --help`)
COMMANDS = (
    ("info", info, "OpenCL platforms, devices, capabilities and which device perfx chooses",
     "List OpenCL platforms and devices, the capabilities perfx reads, the limits in force, which device "
     "perfx chooses and why, and the tuned parameters in force."),
    ("selftest", selftest, "check every kernel on this device against float64 references",
     "Run every kernel family on this device at its test shapes, at the defaults and at every parameter set "
     "the tuner may choose, against the float64 numpy references. Exit status 1 if any check fails."),
    ("generate", generate, "continue or answer one prompt, streaming the text to stdout",
     "Generate text for one prompt. The prompt goes through the model's chat template unless --raw. Only the "
     "text goes to stdout; progress and speed go to stderr. Example: perfx generate --temperature 0 \"How "
     "many legs does a spider have?\""),
    ("chat", chat, "a streaming, multi-turn chat REPL that continues on the KV cache",
     "Chat with a model. Replies stream as they are made; each turn prefills only its own tokens. Commands: "
     "/help /reset /system TEXT /stats /save FILE /quit. Ctrl-C stops a reply; Ctrl-C at the prompt or "
     "Ctrl-D exits. With piped stdin, one turn per line."),
    ("serve", serve, "an OpenAI-compatible HTTP server (chat and text completions, streamed or not)",
     serve.DESCRIPTION),
    ("tune", tune, "find each kernel's fastest verified parameters on this device, for a model's shapes",
     "Autotune every kernel family at the shapes a model runs (decode GEMV at M = 1, prefill GEMM per M "
     "bucket). Every candidate is checked against the float64 reference before it is timed; results are "
     "written as they come, so an interrupted sweep resumes, and one ended by a driver crash resumes past the "
     "parameter set that crashed it (recorded as such). perfx uses the results from then on (see `perfx info`)."),
    ("warm", warm, "build every kernel a model runs, on every core: the first generate then waits for none",
     "Build every kernel a model will run (the decode step's, every prompt size's, the int8 ones of each weight "
     "form, the lm_head over many rows that perplexity, speculation and `serve --parallel` run, constrained "
     "decoding's mask), many at once (PERFX_BUILD_WORKERS, else every core), into the kernel cache, with a "
     "progress bar; then load the model and run each kind of step once, which reports any kernel the plan "
     "missed. Give the --ctx, --kv and --lm-head you will run with. Run it once after installing or upgrading "
     "perfx or a driver: the first `perfx generate` then starts without compiling. "
     "Example: perfx warm --model synthetic:tiny"),
    ("bench", bench, "the device's ceilings and each kernel at a model's shapes, with tuned parameters",
     "Measure copy bandwidth and peak FLOP/s, then each kernel family at the model's shapes with the "
     "parameters perfx would use, as time, GB/s or GFLOP/s and percent of the ceiling."),
    ("perplexity", perplexity, "a model's perplexity on a text file, by llama-perplexity's method",
     "Tokenize the file (BOS only where the model adds one), cut it into chunks of --ctx tokens, run each from an "
     "empty cache and average the negative log-likelihood over the second half of each chunk, as llama.cpp's "
     "llama-perplexity does: how to compare quantizations, and perfx against llama.cpp, on the same file. "
     "Example: perfx perplexity wiki.test.raw --ctx 512 --chunks 20"),
    ("report", report, "one file to send back: device, selftest, kernel figures and tuning results",
     "Write a report of this device (capabilities and limits, selftest, each kernel's speed at a model's shapes "
     "and optionally Llama-2-7B's, and this device's tuning results) to one JSON file, with a Markdown summary "
     "beside it. Interrupted, it resumes where it stopped. Example: perfx report --tune 900 --7b"),
    ("quantize", quantize, "4-bit AWQ quantization of a Hugging Face checkpoint (wraps AutoAWQ)",
     "Quantize an fp16/bf16 Hugging Face checkpoint to 4-bit AWQ with activation-aware scales (AutoAWQ, "
     "from the `quantize` extra). perfx then loads the result with --model DST."),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="perfx",
        description="Run Llama-family LLMs on phone GPUs through hand-written, autotuned OpenCL kernels.",
        epilog="Environment: PERFX_DEVICE chooses the device, PERFX_LIMITS=adreno740 caps what perfx believes "
               "the device allows (phone limits on any machine), PERFX_CACHE is where models and tuning "
               "results are kept.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, summary, description in COMMANDS:
        # Descriptions with examples keep their line breaks.
        formatter = argparse.RawDescriptionHelpFormatter if "\n" in description else argparse.HelpFormatter
        command = sub.add_parser(name, help=summary, description=description, formatter_class=formatter)
        module.add_arguments(command)
        command.set_defaults(func=module.main)
    return parser


def main(argv=None) -> int:
    prepare()  # the process's OpenCL set-up, before any command queries platforms
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except PerfxError as e:
        print(f"perfx: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("perfx: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader stopped early (`perfx info | head`): end quietly, and keep Python's flush at exit from
        # raising again on the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
