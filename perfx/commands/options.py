"""What several commands share: the model, device and sampling options, the default system prompt, and
one-line notes on stderr (stdout carries only the output a script reads)."""

from __future__ import annotations

import sys
from pathlib import Path

from perfx.constrain import Constraint
from perfx.errors import PerfxError
from perfx.generate import SamplingConfig
from perfx.model import load_model
from perfx.runtime import DEVICE_HELP, show_build_logs
from perfx.speculative import MAX_DRAFT, MODES, DraftModel, Speculator, check_same_vocabulary

# One default for `perfx generate` and `perfx chat`: small models (the default one has 135M parameters)
# ramble under greedy decoding unless asked to be brief (the float64 reference forward gives the same
# rambling text). `--system ''` uses the model's own template default instead.
DEFAULT_SYSTEM = "You are a helpful assistant. Answer briefly."
SYSTEM_HELP = ("system prompt (default: %(default)r: a small model stays on topic when asked to be brief); "
               "--system '' uses the model's own chat template default")


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
    add_lm_head_option(parser)
    add_kv_option(parser)
    add_no_tuning_option(parser)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also print the compiler's output for every kernel built (by default only a build "
                             "that fails shows its log); `perfx serve` also logs prompts and replies")


LM_HEAD_HELP = ("the output projection (and a tied embedding): q8 keeps a quantized file's own form (Q8_0, Q6_K "
                "... as int8) and quantizes an fp16 head to int8 on load, the fewest bytes a token; fp16 holds it "
                "as fp16 (a 4-bit head stays 4-bit). Default: %(default)s")


EMBEDDING_HELP = ("the untied token embedding: head gives it the --lm-head form; q4 holds it in 4 bits with an fp16 "
                  "scale and a 4-bit zero point per 128 (AWQ's int4 form, round to nearest: 2.5 bytes a group, about "
                  "half the int8 table's memory; a decode step reads one row of it). A tied embedding is the lm_head "
                  "and keeps the head's form; a file's own 4-bit table is kept. Default: %(default)s")


def add_lm_head_option(parser):
    parser.add_argument("--lm-head", choices=["q8", "fp16"], default="q8", help=LM_HEAD_HELP)
    parser.add_argument("--embedding", choices=["head", "q4"], default="head", help=EMBEDDING_HELP)


KV_HELP = ("the KV cache's form: f16 (fp16 keys and values) or q8 (llama.cpp's q8_0: int8 codes with an fp16 "
           "scale per 32, 1.06 bytes a value: about half the memory, and half the bytes a decode step reads at long "
           "contexts, for a small loss of accuracy; needs head_dim a multiple of 32). Default: %(default)s")


def add_kv_option(parser):
    parser.add_argument("--kv", choices=["f16", "q8"], default="f16", help=KV_HELP)


def add_no_tuning_option(parser):
    parser.add_argument("--no-tuning", action="store_true",
                        help="ignore every tuning database: the kernels run their built-in defaults (as "
                             "PERFX_TUNING=off does); compare with and without to see what tuning gives you")


def load_model_from_args(args, **kwargs):
    """``perfx.model.load_model`` with the model options of ``add_model_options``."""
    if args.verbose:
        show_build_logs()
    return load_model(args.model, args.device, args.ctx, args.quantize, tuning=not args.no_tuning,
                      lm_head=args.lm_head, kv=args.kv, embedding=args.embedding, **kwargs)


SPECULATE_HELP = ("speculative decoding: draft tokens cheaply and verify them in one batched step of the model. "
                  "lookup drafts from the text so far (prompt and reply: rewrites, code edits, summaries "
                  "gain most), draft from --draft MODEL; auto (the default) uses --draft where given, else "
                  "lookup, and drafts only as long as this device's measured step costs and the acceptance "
                  "seen so far make it faster; off decodes one token a step. The text is the same at "
                  "temperature 0 (up to near-ties) and has the same distribution when sampling")


def add_speculation_options(parser):
    parser.add_argument("--speculate", choices=MODES, default="auto", help=SPECULATE_HELP)
    parser.add_argument("--draft", metavar="MODEL",
                        help="a draft model for speculative decoding: any model perfx loads with the target's "
                             "vocabulary, smaller and so faster (e.g. the 135M model of the family)")
    parser.add_argument("--draft-max", type=int, default=MAX_DRAFT, metavar="N",
                        help="draft at most N tokens a step (default %(default)s)")


def speculator_from_args(args, model, tokenizer, log=None) -> Speculator | None:
    """The Speculator of --speculate / --draft / --draft-max beside ``model`` (None for off); loads the draft
    model on the same device with the same context, refusing one with another vocabulary."""
    if args.draft and args.speculate in ("off", "lookup"):
        raise PerfxError(f"--draft {args.draft} is unused with --speculate {args.speculate}: drop one of them")
    if args.speculate == "off":
        return None
    draft = None
    if args.draft:
        # Its context: the target's, or its own where that is shorter (it then drafts only that far).
        draft_model, draft_source = load_model(args.draft, model.device, None, args.quantize, log=log,
                                               default_ctx=model.max_positions, tuning=not args.no_tuning,
                                               lm_head=args.lm_head, embedding=args.embedding)
        check_same_vocabulary(tokenizer, draft_source.tokenizer, args.model, args.draft)
        draft = DraftModel(draft_model, args.draft)
    return Speculator(args.speculate, draft, args.draft_max, log=log)


def add_constraint_options(parser, what: str = "the reply"):
    """--json-object, --json-schema FILE, --grammar FILE: constrained decoding (perfx.constrain)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json-object", action="store_true",
                       help=f"{what} is a JSON object, always (JSON mode; needs llguidance: pip install "
                            "'perfx[structured]')")
    group.add_argument("--json-schema", metavar="FILE",
                       help=f"{what} is JSON valid against the JSON schema in FILE, always (constrained decoding "
                            "through llguidance; a schema feature it lacks is named). Speculation is off for it")
    group.add_argument("--grammar", metavar="FILE",
                       help=f"{what} follows the Lark grammar in FILE (llguidance's dialect: %%json {{...}} embeds "
                            "a JSON schema)")


def constraint_from_args(args, tokenizer) -> Constraint | None:
    """The Constraint the options ask for, made afresh (one per reply), or None."""
    if args.json_object:
        return Constraint.json_object(tokenizer)
    for name, make in (("json_schema", Constraint.from_json_schema), ("grammar", Constraint.from_lark)):
        path = getattr(args, name)
        if path:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise PerfxError(f"--{name.replace('_', '-')} {path}: cannot read it ({error})") from None
            return make(text, tokenizer)
    return None


def add_sampling_options(parser, temperature: float = 0.7):
    parser.add_argument("--temperature", type=float, default=temperature, help="0 = greedy (default %(default)s)")
    parser.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens; 0 = off")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus: keep the smallest set with this mass")
    parser.add_argument("--min-p", type=float, default=0.05, help="drop tokens below min-p × the top probability")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--seed", type=int, help="same seed, same text")
    parser.add_argument("--max-tokens", type=int, default=256, help="stop after this many new tokens")


def add_system_option(parser):
    parser.add_argument("--system", default=DEFAULT_SYSTEM, metavar="TEXT", help=SYSTEM_HELP)


NO_THINK_HELP = ("answer without thinking first: the chat template is rendered with enable_thinking=false, so "
                 "Qwen3 and SmolLM3 skip their <think> block (as `enable_thinking` in Hugging Face's "
                 "apply_chat_template and `chat_template_kwargs` in llama-server); a model whose template has no "
                 "such switch answers as usual, and a note says so")


def add_thinking_option(parser):
    parser.add_argument("--no-think", action="store_true", help=NO_THINK_HELP)


def thinking_kwargs(tokenizer, think: bool) -> dict:
    """The chat template's variables for thinking on or off: {"enable_thinking": False} to turn it off where the
    template reads that switch, else nothing (thinking on is every template's default)."""
    return {} if think or not tokenizer.has_thinking_switch else {"enable_thinking": False}


def no_thinking_switch_note(model_name: str) -> str:
    return (f"perfx: note: {model_name} has no thinking switch (its chat template does not read enable_thinking); "
            "it answers as usual")


def system_prompt(args) -> str | None:
    """The system prompt of --system, None for '' (the chat template's own default)."""
    return args.system or None


def sampling_config(args) -> SamplingConfig:
    if args.max_tokens < 1:
        raise PerfxError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    return SamplingConfig(args.temperature, args.top_k, args.top_p, args.min_p, args.repetition_penalty, args.seed)


def add_kernel_options(parser, what: str = "tune"):
    parser.add_argument("--model", default="default",
                        help=f"model whose shapes to {what}: 'default', a .gguf file or model directory, or "
                             "synthetic:llama-2-7b / synthetic:smollm2-135m (default: default)")
    parser.add_argument("--kernels", help="comma-separated kernel families; a prefix names a group "
                                          "(gemm_q4 = gemm_q4_skinny, _tiled, _f16, _lanes and _i8; gemm_q8 = "
                                          "gemm_q8, _lanes and _i8; default: all)")
    parser.add_argument("--max-m", type=int, default=None,
                        help=f"{what} the prefill (GEMM, attention) path only up to this prompt length")
    parser.add_argument("--device", help=DEVICE_HELP)
    add_lm_head_option(parser)
    add_kv_option(parser)
