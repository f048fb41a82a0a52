"""Constrained decoding (perfx/constrain.py through llguidance, the mask on the device): llguidance's tokenizer
spells every id as perfx does (SentencePiece and byte-level BPE vocabularies), a tiny random-weight model's
replies parse and validate against varied schemas greedy and sampled (its unconstrained replies are noise, so a
valid one is the constraint's work), the device's masked choice is the host's, and the errors say what to do."""

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from helpers.family_models import family_tokenizer, make_family_model, write_family_gguf
from helpers.schemas import random_schema
from helpers.tiny_models import make_tiny_model, tiny_tokenizer, write_gguf
from perfx import cli, reference
from perfx.constrain import Constraint, ll_tokenizer
from perfx.errors import PerfxError
from perfx.generate import PositionalState, SamplingConfig, generate
from perfx.model import load_model
from perfx.sources.default import default_model_path
from perfx.tokenizer import Tokenizer

pytestmark = pytest.mark.one_implementation  # generation over a model: the default device only

DATA = Path(__file__).parent / "data"

SCHEMAS = {
    "required properties": {
        "type": "object", "additionalProperties": False, "required": ["name", "age"],
        "properties": {"name": {"type": "string", "maxLength": 8},
                       "age": {"type": "integer", "minimum": 0, "maximum": 150}}},
    "enums and booleans": {
        "type": "object", "additionalProperties": False, "required": ["color", "ok", "size"],
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                       "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}},
    "array of integers": {"type": "array", "minItems": 1, "maxItems": 4,
                          "items": {"type": "integer", "minimum": -5, "maximum": 5}},
    "nested": {
        "type": "object", "additionalProperties": False, "required": ["point", "tags"],
        "properties": {
            "point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                      "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                     "y": {"type": "boolean"}}},
            "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 4}}}},
    "pattern": {"type": "object", "additionalProperties": False, "required": ["code"],
                "properties": {"code": {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{2}$"}}},
    "anyOf and null": {"type": "object", "additionalProperties": False, "required": ["v"],
                       "properties": {"v": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}]}}},
}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("constrain")
    path = directory / "tiny.gguf"
    write_gguf(path, make_tiny_model("gqa3", tiny_tokenizer(directory), np.random.default_rng(11)))
    return str(path)


@pytest.fixture(scope="module")
def tiny(tiny_path, opencl_device):
    model, source = load_model(tiny_path, opencl_device, progress=False)
    return model, source.tokenizer


def chat_prompt(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(rendered, add_bos=tokenizer.add_bos_token)


# -- llguidance's tokenizer ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spm(tiny_path):
    """The tiny model's SentencePiece tokenizer (byte fallback, a prefix space before the first word)."""
    return Tokenizer.from_gguf(tiny_path)


def named_tokenizer(name: str, spm, directory) -> Tokenizer:
    if name == "tiny SentencePiece":
        return spm
    if name == "Hugging Face tokenizer.json":   # the default model's, as a Hugging Face directory holds it
        Tokenizer.from_gguf(default_model_path())._encoder.backend.save(str(directory / "tokenizer.json"))
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
        return Tokenizer.from_hf_dir(directory)
    if name == "default (byte-level BPE)":
        return Tokenizer.from_gguf(default_model_path())
    return Tokenizer.from_gguf(DATA / "vocab" / f"{name}.gguf")


@pytest.mark.parametrize("name", ["default (byte-level BPE)", "gemma3", "llama-bpe", "phi3", "qwen3",
                                  "tiny SentencePiece", "Hugging Face tokenizer.json"])
def test_llguidance_spells_every_id_as_perfx_decodes_it(name, spm, rng, tmp_path):
    tokenizer = named_tokenizer(name, spm, tmp_path)
    ll = ll_tokenizer(tokenizer)
    assert ll.vocab_size == tokenizer.vocab_size
    assert sorted(ll.eos_tokens) == sorted(tokenizer.eos_ids)
    special = tokenizer.special_ids | tokenizer.eos_ids
    # (a byte piece <0xFF> starts with llguidance's mark of a special token; no UTF-8 text holds that byte)
    text_ids = [i for i, b in enumerate(tokenizer.token_bytes()) if i not in special and not b.startswith(b"\xff")]
    ids = [int(i) for i in rng.choice(text_ids, 400)]
    assert ll.decode_bytes(ids) == b"".join(tokenizer.token_bytes()[i] for i in ids)
    for i in special:
        assert ll.is_special_token(i), (name, i, tokenizer.token_text(i))
    for text in ("Café naïve {\"a\": [1, 2.5, true]} 日本", "{", " x", "\n\n}"):
        # forced text as it continues a reply: exactly its bytes (no SentencePiece prefix space)
        assert ll.decode_bytes(ll.tokenize_str(text)) == text.encode()


def test_every_json_reply_a_grammar_walks_is_valid(spm, rng):
    """Random walks through the allowed tokens (no model): each ends complete, and parses and validates."""
    for schema in SCHEMAS.values():
        for _ in range(5):
            constraint, ids = Constraint.from_json_schema(schema, spm), []
            while not constraint.done:
                allowed = np.flatnonzero(reference.allowed_tokens(constraint.allowed(), spm.vocab_size))
                token = int(rng.choice(allowed))
                if token in spm.eos_ids:
                    assert constraint.accepting
                    break
                constraint.advance(token)
                ids.append(token)
                assert len(ids) < 400, spm.decode(ids)
            jsonschema.validate(json.loads(spm.decode(ids)), schema)


def test_eos_is_allowed_exactly_where_the_grammar_accepts(spm):
    constraint = Constraint.from_json_schema({"type": "integer"}, spm)
    eos = sorted(spm.eos_ids)
    allowed = reference.allowed_tokens(constraint.allowed(), spm.vocab_size)
    assert not allowed[eos].any() and not constraint.accepting   # nothing yet: not an integer
    for token in ll_tokenizer(spm).tokenize_str("12"):
        constraint.advance(token)
    allowed = reference.allowed_tokens(constraint.allowed(), spm.vocab_size)
    assert constraint.accepting and not constraint.done and allowed[eos].all()
    assert not allowed[sorted(spm.special_ids - spm.eos_ids)].any()   # control tokens are never text


def test_a_token_the_grammar_forbids_is_refused(spm):
    constraint = Constraint.json_object(spm)
    with pytest.raises(PerfxError, match="is not allowed here"):
        constraint.advance(spm.encode("x", parse_special=False)[-1])


@pytest.mark.parametrize("schema, named", [
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, r'"if", "then"'),
    ({"type": "string", "format": "weird"}, "Unknown format: weird"),
    ({"$ref": "http://example.com/schema.json"}, "http://example.com/schema.json"),
    ("{not json", "not valid JSON"),
])
def test_unsupported_schemas_are_named(spm, schema, named):
    with pytest.raises(PerfxError, match=named):
        Constraint.from_json_schema(schema, spm)


def test_without_llguidance_the_error_says_how_to_install_it(spm, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)   # import llguidance raises ImportError
    with pytest.raises(PerfxError, match=r"pip install 'perfx\[structured\]'"):
        Constraint.json_object(spm)


def test_a_lark_grammar_puts_text_around_json(spm):
    constraint = Constraint.from_lark('start: "CALL " %json {"type": "object", "properties": {"n": {"type": '
                                      '"integer", "minimum": 0, "maximum": 9}}, "required": ["n"], '
                                      '"additionalProperties": false}', spm)
    for token in ll_tokenizer(spm).tokenize_str('CALL {"n": 7}'):
        constraint.advance(token)
    assert constraint.done


def test_a_tool_call_grammar_names_special_tokens(rng):
    """What a tool call constrained by its function's schema looks like (Qwen3's format): the special tokens
    <tool_call> and </tool_call> by name around the call's JSON; random walks end there, and decode to it."""
    qwen3 = Tokenizer.from_gguf(DATA / "vocab" / "qwen3.gguf")
    arguments = {"type": "object", "additionalProperties": False, "required": ["city"],
                 "properties": {"city": {"type": "string", "maxLength": 12}}}
    call = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": "get_weather"}, "arguments": arguments}}
    grammar = f"start: <tool_call> \"\\n\" %json {json.dumps(call)} \"\\n\" </tool_call>"
    opening, closing = (qwen3.encode(t, parse_special=True) for t in ("<tool_call>", "</tool_call>"))
    assert len(opening) == len(closing) == 1 and opening[0] in qwen3.special_ids
    for _ in range(3):
        constraint, ids = Constraint.from_lark(grammar, qwen3), []
        while not constraint.done:
            allowed = np.flatnonzero(reference.allowed_tokens(constraint.allowed(), qwen3.vocab_size))
            token = int(rng.choice(allowed))
            constraint.advance(token)
            ids.append(token)
        assert ids[0] == opening[0] and ids[-1] == closing[0]
        text = qwen3.decode(ids[1:-1])
        assert text.startswith("\n") and text.endswith("\n")
        jsonschema.validate(json.loads(text), call)


# -- replies of a tiny random model -------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=1.0, seed=3),
                                      SamplingConfig(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0, seed=5,
                                                     repetition_penalty=1.3)],
                         ids=["greedy", "sampled on the device", "sampled on the host"])
def test_replies_parse_and_validate(tiny, name, sampling):
    model, tokenizer = tiny
    schema = SCHEMAS[name]
    unconstrained = generate(model, tokenizer, chat_prompt(tokenizer, "Give me JSON."), 40, sampling)
    with pytest.raises(ValueError):   # the model alone writes noise
        jsonschema.validate(json.loads(unconstrained.text), schema)
    result = generate(model, tokenizer, chat_prompt(tokenizer, "Give me JSON."), 300, sampling,
                      constraint=Constraint.from_json_schema(schema, tokenizer))
    assert result.stats.stop_reason in ("grammar complete", "eos"), result.text
    jsonschema.validate(json.loads(result.text), schema)


def test_json_object_mode_and_stop_strings_and_max_tokens(tiny):
    model, tokenizer = tiny
    prompt = chat_prompt(tokenizer, "JSON please")
    sampling = SamplingConfig(temperature=1.0, seed=8)
    anything = generate(model, tokenizer, prompt, 400, sampling, constraint=Constraint.json_object(tokenizer))
    assert isinstance(json.loads(anything.text), dict)
    schema = SCHEMAS["required properties"]
    whole = generate(model, tokenizer, prompt, 400, sampling, constraint=Constraint.from_json_schema(schema, tokenizer))
    assert whole.text.startswith('{"name": "') and len(whole.ids) > 8
    cut = generate(model, tokenizer, prompt, 3, sampling, constraint=Constraint.from_json_schema(schema, tokenizer))
    assert cut.stats.stop_reason == "max tokens" and len(cut.ids) == 3 and whole.text.startswith(cut.text)
    stopped = generate(model, tokenizer, prompt, 400, sampling, stop_strings=['"age"'],
                       constraint=Constraint.from_json_schema(schema, tokenizer))
    assert stopped.stats.stop_reason == "stop string" and whole.text.startswith(stopped.text + '"age"')


def test_sixty_random_schemas_at_temperature_one(tiny):
    model, tokenizer = tiny
    rng = np.random.default_rng(43)
    prompt = chat_prompt(tokenizer, "JSON")
    for i in range(60):
        schema = random_schema(rng, kind="object" if i % 2 else None)   # half of them an object, as apps ask
        result = generate(model, tokenizer, prompt, 250, SamplingConfig(temperature=1.0, seed=i),
                          constraint=Constraint.from_json_schema(schema, tokenizer))
        assert result.stats.stop_reason in ("grammar complete", "eos"), (schema, result.text)
        jsonschema.validate(json.loads(result.text), schema)


@pytest.mark.parametrize("family", ["qwen35", "gemma2"])
def test_a_recurrent_family_and_a_soft_capped_one_keep_to_the_schema(tmp_path, opencl_device, family):
    """Qwen3.5 (Gated DeltaNet state that cannot roll back: every step is decode_one) and Gemma 2 (the logits
    soft-capped before the mask), with their own chat templates."""
    written = write_family_gguf(tmp_path / "m.gguf", make_family_model(family, family_tokenizer(tmp_path, family),
                                                                        np.random.default_rng(1)))
    model, source = load_model(str(written.path), opencl_device, progress=False)
    tokenizer = source.tokenizer
    schema = SCHEMAS["nested"]
    for seed in range(2):
        result = generate(model, tokenizer, chat_prompt(tokenizer, "JSON"), 200,
                          SamplingConfig(temperature=1.0, seed=seed),
                          constraint=Constraint.from_json_schema(schema, tokenizer))
        assert result.stats.stop_reason == "grammar complete", result.text
        jsonschema.validate(json.loads(result.text), schema)


class HostLogits(PositionalState):
    def __init__(self, logits):
        self.saved = logits

    def logits(self):
        return self.saved.copy()


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0), SamplingConfig(temperature=0.8),
                                      SamplingConfig(temperature=0.8, repetition_penalty=1.5),
                                      SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)],
                         ids=["greedy", "on the device", "penalised", "host sampler"])
def test_the_device_chooses_as_the_host_does(tiny, rng, sampling):
    """Model.masked_token (the mask and the choice on the device) against PositionalState.masked_token (the
    float64 reference's mask and draw) on the same logits and random masks; the token is exact or wrong."""
    model, tokenizer = tiny
    prompt = chat_prompt(tokenizer, "hello")
    v = model.config.vocab_size
    for seed in range(6):
        model.prefill(prompt, 0)
        logits = model.logits()
        allowed = np.zeros(32 * ((v + 31) // 32), bool)
        allowed[rng.choice(v, [1, 3, 40, v // 2, v - 1, 7][seed], replace=False)] = True
        mask = np.packbits(allowed.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32).ravel()
        seen = prompt[-20:]
        expected = HostLogits(logits).masked_token(mask, sampling, seed, seen, len(prompt) - 1)
        assert allowed[expected]
        assert model.masked_token(mask, sampling, seed, seen, len(prompt) - 1) == expected


# -- the commands --------------------------------------------------------------------------------------------

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "legs"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "legs": {"type": "integer", "minimum": 0}}}


def test_generate_with_a_json_schema_on_the_default_model(capsys, tmp_path):
    """The README's model (byte-level BPE, a real chat model) answers in the schema, greedy and sampled."""
    schema = tmp_path / "animal.json"
    schema.write_text(json.dumps(PERSON))
    for flags in (["--temperature", "0"], ["--temperature", "1.0", "--seed", "4"]):
        code = cli.main(["generate", *flags, "--json-schema", str(schema), "--json", "--max-tokens", "60",
                         "--ctx", "512", "Describe a spider as JSON with its name and number of legs."])
        out, err = capsys.readouterr()
        data = json.loads(out)
        assert code == 0 and data["stats"]["stop_reason"] == "grammar complete", err
        jsonschema.validate(json.loads(data["text"]), PERSON)


def test_generate_refuses_an_unsupported_schema_in_one_line(capsys, tmp_path, tiny_path):
    schema = tmp_path / "bad.json"
    schema.write_text(json.dumps({"type": "object", "if": {}, "then": {}}))
    code = cli.main(["generate", "--model", tiny_path, "--json-schema", str(schema), "hi"])
    out, err = capsys.readouterr()
    assert code == 2 and 'Unimplemented keys: ["if", "then"]' in err and out == ""
    code = cli.main(["generate", "--model", tiny_path, "--json-schema", str(tmp_path / "none.json"), "hi"])
    assert code == 2 and "cannot read it" in capsys.readouterr().err


def test_generate_with_a_lark_grammar(capsys, tmp_path, tiny_path):
    grammar = tmp_path / "answer.lark"
    grammar.write_text('start: ("yes" | "no") ", because " /[a-z ]{3,12}/ "."\n')
    code = cli.main(["generate", "--model", tiny_path, "--grammar", str(grammar), "--json", "--temperature", "1",
                     "--seed", "2", "Is it?"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["stats"]["stop_reason"] == "grammar complete"
    assert re.fullmatch(r"(yes|no), because [a-z ]{3,12}\.", data["text"]), data["text"]


def test_chat_keeps_every_reply_a_json_object(tiny_path):
    run = subprocess.run([sys.executable, "-m", "perfx", "chat", "--model", tiny_path, "--json-object",
                          "--max-tokens", "100", "--temperature", "0"],
                         input="one\ntwo\n", capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    replies = [line for line in run.stdout.splitlines() if line.strip()]
    assert len(replies) == 2, run.stdout
    assert all(isinstance(json.loads(reply), dict) for reply in replies)
