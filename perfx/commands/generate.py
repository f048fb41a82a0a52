"""`perfx generate`: continue or answer one prompt, the text streamed to stdout."""

from __future__ import annotations

import json
import sys

from perfx.commands.options import (add_constraint_options, add_model_options, add_sampling_options,
                                    add_speculation_options, add_system_option, add_thinking_option,
                                    constraint_from_args, load_model_from_args, log, no_thinking_switch_note,
                                    sampling_config, speculator_from_args, system_prompt, thinking_kwargs)
from perfx.errors import PerfxError
from perfx.generate import generate


def add_arguments(parser):
    parser.add_argument("prompt", help="the prompt text")
    add_model_options(parser)
    add_sampling_options(parser)
    add_speculation_options(parser)
    parser.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    add_system_option(parser)
    add_thinking_option(parser)
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop when this text appears (repeatable); it is not printed")
    add_constraint_options(parser)
    parser.add_argument("--json", action="store_true", help="print text, token ids and stats as JSON")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress or stats on stderr")


def main(args) -> int:
    sampling = sampling_config(args)
    model, source = load_model_from_args(args, log=log if not args.quiet else None)
    tokenizer = source.tokenizer
    if tokenizer is None:
        raise PerfxError(f"{args.model} has no tokenizer: `perfx generate` needs one (synthetic models are for "
                         "`perfx bench`)")
    if args.raw:
        text = args.prompt
    else:
        system = system_prompt(args)
        messages = [{"role": "system", "content": system}] if system else []
        if args.no_think and not tokenizer.has_thinking_switch:
            log(no_thinking_switch_note(args.model))
        text = tokenizer.apply_chat_template(messages + [{"role": "user", "content": args.prompt}],
                                             **thinking_kwargs(tokenizer, think=not args.no_think))
    constraint = constraint_from_args(args, tokenizer)   # before the speculator: a bad schema fails first
    speculator = speculator_from_args(args, model, source.tokenizer, log=log if not args.quiet else None)
    prompt_ids = tokenizer.encode(text, add_bos=tokenizer.add_bos_token)
    stream = None if args.json else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
    result = generate(model, tokenizer, prompt_ids, args.max_tokens, sampling, stop_strings=args.stop,
                      on_text=stream, speculator=speculator, constraint=constraint)
    if args.json:
        print(json.dumps({"text": result.text, "prompt_ids": prompt_ids, "ids": result.ids,
                          "stats": result.stats.as_dict(), "load": model.load_report}, indent=1))
    else:
        sys.stdout.write("\n")
        if not args.quiet:
            log(f"perfx: {result.stats.line()}, host {1e3 * result.stats.host_s_per_token:.2f} ms/token, "
                f"stopped by {result.stats.stop_reason}")
    return 130 if result.interrupted else 0
