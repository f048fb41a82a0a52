"""The `perfx` command line: info, selftest (and, as they land, generate, chat, tune, bench)."""

from __future__ import annotations

import argparse
import json
import sys

from perfx.errors import PerfxError
from perfx.runtime import DEVICE_HELP



def cmd_info(args) -> int:
    from perfx.runtime import Device, capabilities_dict, list_devices

    from perfx.tuning.database import entries_in_force

    entries = list_devices()
    device = Device(args.device)
    caps = capabilities_dict(device.caps)
    tuned = entries_in_force(device)
    if args.json:
        print(json.dumps({
            "devices": [{"index": f"{e.platform_index}:{e.device_index}", "platform": e.platform, "name": e.name,
                         "type": e.device_type, "simulator": e.simulator} for e in entries],
            "chosen": {"index": f"{device.entry.platform_index}:{device.entry.device_index}",
                       "name": device.caps.name, "reason": device.reason},
            "capabilities": caps,
            "tuning": tuned,
        }, indent=1, default=str))
        return 0
    print("OpenCL devices:")
    for e in entries:
        mark = "*" if e == device.entry else " "
        print(f" {mark} {e.label}{'  [simulator: used only when named]' if e.simulator else ''}")
    print(f"\nperfx uses {device.entry.platform_index}:{device.entry.device_index} "
          f"{device.caps.name}: {device.reason}")
    print(f"limits in force: {device.caps.limits}" + ("" if device.caps.limits != "device" else
                                                      " (set PERFX_LIMITS=adreno740 to act like a phone)"))
    print("\ncapabilities:")
    for key, value in caps.items():
        if key == "extensions":
            value = " ".join(value)
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 20 and "texels" not in key:
            value = f"{value} ({value / 2**20:.0f} MiB)"
        print(f"  {key:22} {value}")
    print("\ntuned parameters in force (device → architecture → vendor → built-in defaults):")
    if not tuned:
        print("  none: every kernel runs its built-in defaults (run `perfx tune`)")
    for entry in tuned:
        params = " ".join(f"{k}={v}" for k, v in entry["params"].items())
        note = f"  [{entry['note']}]" if entry.get("note") else ""
        print(f"  {entry['family']:18} {entry['shape_text']:40} {params}  ({entry['level']}: "
              f"{entry['file']}){note}")
    print("\nprefill GEMM, the kernel the model runs per prompt length (M bucket):")
    for line in gemm_choice_lines(tuned):
        print(f"  {line}")
    return 0


def gemm_choice_lines(entries: list[dict]) -> list[str]:
    """Which of the tall-skinny and tiled GEMMs wins per M bucket, from the tuned times in force.

    The model makes the same comparison per matrix (``Llama._prefill_kernels``); where either time is
    missing it uses the built-in crossover.
    """
    from collections import Counter

    from perfx.ops.gemm_q4 import DEFAULT_CROSSOVER

    times: dict[tuple, dict] = {}
    for e in entries:
        if e["family"] in ("gemm_q4_skinny", "gemm_q4_tiled") and e.get("time_s") and isinstance(e["shape"], dict):
            shape = dict(e["shape"])
            m = shape.pop("m", None)
            times.setdefault((m, json.dumps(shape, sort_keys=True)), {})[e["family"].rsplit("_", 1)[1]] = e["time_s"]
    wins: dict[int, Counter] = {}
    for (m, _), pair in times.items():
        if len(pair) == 2:
            wins.setdefault(m, Counter())[min(pair, key=pair.get)] += 1
    lines = [f"M ≈ {m:4}: " + ", ".join(f"{kind} fastest for {n} matri{'x' if n == 1 else 'ces'}"
                                        for kind, n in counts.most_common())
             for m, counts in sorted(wins.items())]
    lines.append(f"elsewhere: tall-skinny up to M = {DEFAULT_CROSSOVER}, tiled above (built-in crossover; "
                 "`perfx tune --kernels gemm_q4` measures it on this device)")
    return lines


def cmd_tune(args) -> int:
    from perfx import tune
    return tune.main(args)


def cmd_bench(args) -> int:
    from perfx import bench
    return bench.main(args)


def cmd_chat(args) -> int:
    from perfx import chat
    return chat.main(args)


def cmd_quantize(args) -> int:
    from perfx import quantize
    return quantize.main(args)


def cmd_selftest(args) -> int:
    from perfx import selftest
    return selftest.main(args)


# `perfx generate` answers one question: small models (the default one has 135M parameters) ramble under
# greedy decoding unless asked to be brief (the float64 reference forward gives the same rambling text).
GENERATE_SYSTEM = "You are a helpful assistant. Answer briefly."


def log(text: str):
    print(text, file=sys.stderr, flush=True)


def add_model_options(parser, ctx: bool = True):
    parser.add_argument("--model", default="default",
                        help="a Hugging Face directory (AWQ or fp16 safetensors), a .gguf file, synthetic:<name>, "
                             "or 'default' (SmolLM2-135M-Instruct Q4_1, fetched once into the cache)")
    parser.add_argument("--device", help=DEVICE_HELP)
    if ctx:
        parser.add_argument("--ctx", type=int, help="KV cache positions (default: min(model limit, 4096))")
    parser.add_argument("--quantize", choices=["q4"], help="quantize fp16 weights to 4 bits on load (round to "
                                                           "nearest, group 128): a quick try of an fp16 checkpoint")


def add_sampling_options(parser, temperature: float = 0.7):
    parser.add_argument("--temperature", type=float, default=temperature, help="0 = greedy (default %(default)s)")
    parser.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens; 0 = off")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus: keep the smallest set with this mass")
    parser.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min-p × the top probability")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--seed", type=int, help="same seed, same text")
    parser.add_argument("--max-tokens", type=int, default=256, help="stop after this many new tokens")


def sampling_config(args):
    from perfx.generate import SamplingConfig
    return SamplingConfig(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty, args.seed)


def cmd_generate(args) -> int:
    from perfx.generate import generate
    from perfx.model import load_model

    sampling = sampling_config(args)
    if args.max_tokens < 1:
        raise PerfxError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    model, source = load_model(args.model, args.device, args.ctx, args.quantize, log=log if not args.quiet else None)
    tokenizer = source.tokenizer
    if tokenizer is None:
        raise PerfxError(f"{args.model} has no tokenizer: `perfx generate` needs one (synthetic models are for "
                         "`perfx bench`)")
    if args.raw:
        prompt_ids = tokenizer.encode(args.prompt, add_bos=True)
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages), add_bos=True)
    stream = None if args.json else (lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    result = generate(model, tokenizer, prompt_ids, args.max_tokens, sampling, stop_strings=args.stop,
                      on_text=stream)
    if args.json:
        print(json.dumps({"text": result.text, "prompt_ids": prompt_ids, "ids": result.ids,
                          "stats": result.stats.as_dict(), "load": model.load_report}, indent=1))
    else:
        sys.stdout.write("\n")
        if not args.quiet:
            log(f"perfx: {result.stats.line()}, host {1e3 * result.stats.host_s_per_token:.2f} ms/token, "
                f"stopped by {result.stats.stop_reason}")
    return 130 if result.interrupted else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="perfx",
        description="Run Llama-family LLMs on phone GPUs through hand-written, autotuned OpenCL kernels.",
        epilog="Environment: PERFX_DEVICE chooses the device, PERFX_LIMITS=adreno740 caps what perfx believes "
               "the device allows (phone limits on any machine), PERFX_CACHE is where models are cached.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser("info", help="OpenCL platforms, devices, capabilities and which device perfx chooses",
                          description="List OpenCL platforms and devices, the capabilities perfx reads, the "
                                      "limits in force and which device perfx chooses and why.")
    info.add_argument("--device", help=DEVICE_HELP)
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)

    test = sub.add_parser("selftest", help="check every kernel on this device against float64 references",
                          description="Run every kernel family on this device at its test shapes, at the "
                                      "defaults and at every parameter set the tuner may choose, against the "
                                      "float64 numpy references. Exit status 1 if any check fails.")
    test.add_argument("--device", help=DEVICE_HELP)
    test.add_argument("--quick", action="store_true", help="defaults only, one shape per family (about a minute)")
    test.add_argument("--kernels", help="comma-separated kernel families (default: all)")
    test.add_argument("--json", action="store_true", help="machine-readable output")
    test.add_argument("-v", "--verbose", action="store_true", help="show every check, not only failures")
    test.set_defaults(func=cmd_selftest)

    gen = sub.add_parser("generate", help="continue or answer one prompt, streaming the text to stdout",
                         description="Generate text for one prompt. The prompt goes through the model's chat "
                                     "template unless --raw. Only the text goes to stdout; progress and speed "
                                     "go to stderr. Example: perfx generate --temperature 0 \"How many legs "
                                     "does a spider have?\"")
    gen.add_argument("prompt", help="the prompt text")
    add_model_options(gen)
    add_sampling_options(gen)
    gen.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    gen.add_argument("--system", default=GENERATE_SYSTEM,
                     help="system prompt for the chat template (default: %(default)r; one-shot answers from a "
                          "small model stay on topic when asked to be brief); --system '' uses the model's own")
    gen.add_argument("--stop", action="append", default=[], metavar="TEXT",
                     help="stop when this text appears (repeatable); it is not printed")
    gen.add_argument("--json", action="store_true", help="print text, token ids and stats as JSON")
    gen.add_argument("-q", "--quiet", action="store_true", help="no progress or stats on stderr")
    gen.set_defaults(func=cmd_generate)

    from perfx import bench, chat, quantize, tune
    quantize_parser = sub.add_parser(
        "quantize", help="4-bit AWQ quantization of a Hugging Face checkpoint (wraps AutoAWQ)",
        description="Quantize an fp16/bf16 Hugging Face checkpoint to 4-bit AWQ with activation-aware scales "
                    "(AutoAWQ, from the `quantize` extra). perfx then loads the result with --model DST.")
    quantize.add_arguments(quantize_parser)
    quantize_parser.set_defaults(func=cmd_quantize)
    chat_parser = sub.add_parser(
        "chat", help="a streaming, multi-turn chat REPL that continues on the KV cache",
        description="Chat with a model. Replies stream as they are made; each turn prefills only its own "
                    "tokens. Commands: /help /reset /system TEXT /stats /save FILE /quit. Ctrl-C stops a reply; "
                    "Ctrl-C at the prompt or Ctrl-D exits. With piped stdin, one turn per line.")
    chat.add_arguments(chat_parser)
    chat_parser.set_defaults(func=cmd_chat)
    tune_parser = sub.add_parser(
        "tune", help="find each kernel's fastest verified parameters on this device, for a model's shapes",
        description="Autotune every kernel family at the shapes a model runs (decode GEMV at M = 1, prefill "
                    "GEMM per M bucket). Every candidate is checked against the float64 reference before it is "
                    "timed; results are written as they come, so an interrupted sweep resumes. perfx uses the "
                    "results from then on (see `perfx info`).")
    tune.add_arguments(tune_parser)
    tune_parser.set_defaults(func=cmd_tune)
    bench_parser = sub.add_parser(
        "bench", help="the device's ceilings and each kernel at a model's shapes, with tuned parameters",
        description="Measure copy bandwidth and peak FLOP/s, then each kernel family at the model's shapes with "
                    "the parameters perfx would use, as time, GB/s or GFLOP/s and percent of the ceiling.")
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=cmd_bench)
    return parser


def main(argv=None) -> int:
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
