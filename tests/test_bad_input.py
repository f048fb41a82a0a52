"""Bad input, one suite: every input a user can get wrong gets a clear PerfxError that names
what is wrong, or a documented recovery, and leaves the process able to load and run a good model.

Corrupt files are made from a tiny random model (tests/helpers/tiny_models.py) by cutting, overwriting or
re-writing its bytes. Cases already tested elsewhere are not repeated here; docs/reliability.md lists them
(truncated safetensors/GGUF data, missing tensors, shapes against the config, unsupported GGUF types and
architectures, empty prompt and prompt past the context through the Python API, bad limits files, an unknown
device, a build error in copy.cl, corrupt tuning files through the Database API, bad chat flags).
"""

import gc
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import warnings

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

from helpers.tiny_models import (TinyModel, make_tiny_model, quantize_gguf, tiny_tokenizer, write_awq,
                                 write_gguf, write_hf)
from perfx import forward64
from perfx import cli, reference
from perfx.errors import PerfxError
from perfx.model import Model, load_model
from perfx.ops.gemv_q4 import GemvQ4
from perfx.ops.kv_cache import KVCache
from perfx.runtime import BuildError, Device, parse_limits
from perfx.sources import open_model
from perfx.tokenizer import Tokenizer
from perfx.tuning.database import Database, TuningDatabaseWarning
from perfx.tuning.spec import relative_error

pytestmark = pytest.mark.one_implementation  # model-level: the default device only

TOLERANCE = 2e-3  # logits against the float64 reference forward: as tests/test_model.py, and why it says so
NAN16 = np.array([np.nan], np.float16).view(np.uint8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer GQA-3 model: its weights, a good GGUF and a good fp16 safetensors directory."""
    root = tmp_path_factory.mktemp("bad-input")
    model = make_tiny_model("gqa3", tiny_tokenizer(root), np.random.default_rng(8))
    return model, write_gguf(root / "good.gguf", model).path, write_hf(root / "good-hf", model)


def with_weights(model: TinyModel, **changes) -> TinyModel:
    """A copy of the model with tensors changed: name (dots as __) -> a function of a copy of the tensor."""
    weights = dict(model.weights)
    for key, change in changes.items():
        name = key.replace("__", ".")
        weights[name] = change(weights[name].copy())
    return TinyModel(model.config, weights, model.tokenizer_model)


def set_at(index, value):
    def change(a):
        a[index] = value
        return a
    return change


def copy_hf(good, target, safetensors: bytes | None = None):
    shutil.copytree(good, target)
    if safetensors is not None:
        (target / "model.safetensors").write_bytes(safetensors)
    return target


def safetensors_parts(path):
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def lie(tensor: str, **fields):
    """The good file with one tensor's header entry changed (dtype, shape or data_offsets)."""
    def make(good):
        header, data = safetensors_parts(good / "model.safetensors")
        header[tensor].update(fields)
        return safetensors_bytes(header, data)
    return make


UP1 = "model.layers.1.mlp.up_proj.weight"

# (id, the good file's bytes -> the bad file's, what the error must say). Each is opened and loaded.
SAFETENSORS_CASES = [
    ("empty file", lambda good: b"", r"model.safetensors is not a readable safetensors file.*too small"),
    ("cut inside the header size", lambda good: (good / "model.safetensors").read_bytes()[:5],
     "not a readable safetensors file"),
    ("header size larger than the file", lambda good: struct.pack("<Q", 1 << 40)
     + (good / "model.safetensors").read_bytes()[8:], "not a readable safetensors file.*fetch it again"),
    ("header is not JSON", lambda good: (good / "model.safetensors").read_bytes()[:8] + b"{not json"
     + (good / "model.safetensors").read_bytes()[17:], "not a readable safetensors file.*invalid JSON"),
    ("data offsets past the end", lambda good: lie(UP1, data_offsets=[0, 1 << 30])(good),
     "not a readable safetensors file.*offset"),
    ("dtype F32 over F16 bytes", lie(UP1, dtype="F32"), "not a readable safetensors file"),
    ("shape lies about the bytes", lie(UP1, shape=[384, 96]), "not a readable safetensors file"),
]


@pytest.mark.parametrize("corrupt, message", [c[1:] for c in SAFETENSORS_CASES],
                         ids=[c[0] for c in SAFETENSORS_CASES])
def test_corrupt_safetensors_is_named(tiny, tmp_path, corrupt, message):
    _, _, good = tiny
    bad = copy_hf(good, tmp_path / "bad", corrupt(good))
    with pytest.raises(PerfxError, match=message):
        open_model(bad)
    assert sorted(os.listdir(bad)) == sorted(os.listdir(good))  # nothing written beside the model


def test_unsupported_tensor_dtype_is_named(tiny, tmp_path, device):
    model, _, good = tiny
    bad = copy_hf(good, tmp_path / "bad")
    tensors = {name: w.astype(np.float16) for name, w in model.weights.items()}
    tensors[UP1] = np.ones(model.weights[UP1].shape, np.int64)
    save_file(tensors, str(bad / "model.safetensors"))
    source = open_model(bad)  # the header is valid: the dtype is met when the layer is read
    with pytest.raises(PerfxError, match=rf"tensor {UP1} has dtype I64; perfx reads F16, BF16, F32"):
        Model.load(source, device, ctx=16, progress=False)


@pytest.mark.parametrize("what, corrupt, message", [
    ("config.json", lambda d: (d / "config.json").write_text('{"model_type": "llama", '),
     r"config.json is not valid JSON.*fetch it again"),
    ("index", lambda d: ((d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors"),
                         (d / "model.safetensors.index.json").write_text("[1, 2")),
     r"model.safetensors.index.json is not valid JSON"),
    ("index without weight_map", lambda d: ((d / "model.safetensors").unlink(),
                                            (d / "model.safetensors.index.json").write_text("{}")),
     "has no weight_map; the index is corrupt"),
    ("index naming a missing shard", lambda d: (
        (d / "model.safetensors").unlink(),
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {UP1: "model-2.safetensors"}}))),
     "shard model-2.safetensors listed in the index is missing"),
])
def test_corrupt_side_files_are_named(tiny, tmp_path, what, corrupt, message):
    bad = copy_hf(tiny[2], tmp_path / "bad")
    corrupt(bad)
    with pytest.raises(PerfxError, match=message):
        open_model(bad)


def gguf_tensor_info_at(raw: bytes, name: str) -> int:
    """Offset of n_dims in the GGUF tensor-info entry of ``name`` (after its u64 length and its bytes)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = raw.index(key)
    assert raw.find(key, at + 1) < 0
    return at + len(key)


def gguf_dims_lie(raw: bytes, k: int = 384 * 1000, name: str = "blk.1.ffn_down.weight") -> bytes:
    at = gguf_tensor_info_at(raw, name) + 4                        # first dim: K = 384
    return raw[:at] + struct.pack("<Q", k) + raw[at + 8:]


def gguf_type_at(raw: bytes) -> int:
    at = gguf_tensor_info_at(raw, "blk.1.ffn_down.weight")
    return at + 4 + 8 * struct.unpack("<I", raw[at:at + 4])[0]    # past n_dims and the dims: the type


def gguf_offset_lies(raw: bytes) -> bytes:
    at = gguf_type_at(raw) + 4                                     # past the type: the offset
    return raw[:at] + struct.pack("<Q", 1 << 40) + raw[at + 8:]


def gguf_string_too_long(raw: bytes) -> bytes:
    key = struct.pack("<Q", 3) + b"zor"                            # a token of tokenizer.ggml.tokens
    assert raw.count(key) == 1
    return raw.replace(key, struct.pack("<Q", 1 << 40) + b"zor")


PAST_END = r"runs past the end of the file \(\d+ bytes\); it is truncated or corrupt, fetch it again"
FFN_DOWN_PAST_END = r"tensor blk.1.ffn_down.weight's data, \d+ bytes at offset \d+, " + PAST_END
GGUF_CASES = [
    ("magic only", lambda raw: raw[:4], "not a readable GGUF file: it has 4 bytes, fewer than GGUF's 24-byte "
     "header; it is truncated or corrupt"),
    ("unknown version", lambda raw: raw[:4] + struct.pack("<I", 99) + raw[8:], "GGUF version 99; perfx reads "
     "versions 2 and 3"),
    ("big-endian", lambda raw: raw[:4] + struct.pack(">I", 3) + raw[8:], "is a big-endian GGUF .*without "
     "--bigendian"),
    ("tensor count lies", lambda raw: raw[:8] + struct.pack("<Q", 10**6) + raw[16:], "not a readable GGUF"),
    ("key count lies", lambda raw: raw[:16] + struct.pack("<Q", 10**6) + raw[24:], "not a readable GGUF"),
    ("random bytes after the header", lambda raw: raw[:24] + np.random.default_rng(1).bytes(len(raw) - 24),
     "not a readable GGUF file"),
    ("string length past the end", gguf_string_too_long, "not a readable GGUF file: key tokenizer.ggml.tokens "
     + PAST_END),
    ("tensor dims lie", gguf_dims_lie, "not a readable GGUF file: " + FFN_DOWN_PAST_END),
    ("tensor offset past the end", gguf_offset_lies, "not a readable GGUF file: " + FFN_DOWN_PAST_END),
    ("tensor data cut short", lambda raw: raw[:-1000], r"not a readable GGUF file: tensor \S+'s data, "
     r"\d+ bytes at offset \d+, " + PAST_END),
    ("tensor rows not whole blocks", lambda raw: gguf_dims_lie(raw, 100, "blk.0.ffn_down.weight"),
     "tensor blk.0.ffn_down.weight has rows of 100 values, not a multiple of Q4_0's blocks of 32"),
    ("unknown tensor type", lambda raw: raw[:gguf_type_at(raw)] + struct.pack("<I", 99)
     + raw[gguf_type_at(raw) + 4:], "tensor blk.1.ffn_down.weight has ggml type 99, which gguf-py does not know"),
]


@pytest.mark.parametrize("corrupt, message", [c[1:] for c in GGUF_CASES], ids=[c[0] for c in GGUF_CASES])
def test_corrupt_gguf_is_named(tiny, tmp_path, corrupt, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(corrupt(tiny[1].read_bytes()))
    with pytest.raises(PerfxError, match=message):
        open_model(bad)
    assert os.listdir(tmp_path) == ["bad.gguf"]


# -- NaN and Inf in weights: refused at load, naming the tensor -----------------------------------------


def nan_q4_scale_gguf(model, path):
    w = model.weights["model.layers.0.mlp.down_proj.weight"]
    raw, _ = quantize_gguf(w, "Q4_0")
    blocks = raw.reshape(w.shape[0], -1, 18)
    blocks[2, 1, :2] = NAN16                                      # the fp16 scale d of one block
    return write_gguf(path, model, tokenizer=False, raw_override={
        "blk.0.ffn_down.weight": (blocks.reshape(raw.shape), gguf.GGMLQuantizationType.Q4_0)}).path


NONFINITE_CASES = [
    ("fp16 weight NaN", lambda m, p: write_hf(p, with_weights(
        m, model__layers__1__self_attn__o_proj__weight=set_at((5, 7), np.nan))),
     r"tensor model.layers.1.self_attn.o_proj.weight has 1 NaN or Inf values \(the first at index \(5, 7\)"),
    ("bf16 embedding Inf", lambda m, p: write_hf(p, with_weights(
        m, model__embed_tokens__weight=set_at((9, 0), np.inf)), dtype="BF16"),
     r"tensor model.embed_tokens.weight has 1 NaN or Inf values \(the first at index \(9, 0\), inf\)"),
    ("f32 norm NaN", lambda m, p: write_hf(p, with_weights(m, model__norm__weight=set_at(3, np.nan)),
                                           dtype="F32"),
     r"tensor model.norm.weight has 1 NaN or Inf values"),
    ("gguf Q4_0 scale NaN", nan_q4_scale_gguf, r"tensor blk.0.ffn_down.weight has 1 NaN or Inf scales"),
    ("gguf F32 norm Inf", lambda m, p: write_gguf(p, with_weights(
        m, model__layers__1__input_layernorm__weight=set_at(0, -np.inf))).path,
     r"tensor blk.1.attn_norm.weight has 1 NaN or Inf values"),
]


@pytest.mark.parametrize("write, message", [c[1:] for c in NONFINITE_CASES],
                         ids=[c[0] for c in NONFINITE_CASES])
def test_nan_or_inf_weights_are_refused_at_load_naming_the_tensor(tiny, tmp_path, device, write, message):
    path = write(tiny[0], tmp_path / ("bad.gguf" if "gguf" in message or "blk" in message else "bad"))
    with pytest.raises(PerfxError, match=message):
        Model.load(open_model(path), device, ctx=16, progress=False)


def test_nan_awq_scale_is_refused(tiny, tmp_path, device):
    directory, _ = write_awq(tmp_path / "awq", tiny[0], np.random.default_rng(2), group=64)
    header, data = safetensors_parts(directory / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.scales"
    start = header[name]["data_offsets"][0] + 2 * 3               # the fourth fp16 scale
    data = data[:start] + NAN16.tobytes() + data[start + 2:]
    (directory / "model.safetensors").write_bytes(safetensors_bytes(header, data))
    with pytest.raises(PerfxError, match=rf"tensor {name} has 1 NaN or Inf values"):
        Model.load(open_model(directory), device, ctx=16, progress=False)


# -- prompts and text ---------------------------------------------------------------------------------------


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_prompt_not_utf8_is_a_clear_error(tiny):
    tokenizer = Tokenizer.from_gguf(tiny[1])
    # What Python makes of the bytes "caf\xe9" (Latin-1) on a command line or a surrogateescape pipe
    with pytest.raises(PerfxError, match=r"not valid UTF-8: '\\udce9' in 'caf\\udce9 au lait'"):
        tokenizer.encode("caf\udce9 au lait", add_bos=True)
    assert tokenizer.encode("café au lait") == tokenizer.encode("café au lait")  # good text still encodes


def test_cli_prompt_past_the_context_and_bad_text_are_one_line(tiny, capsys):
    path = tiny[1]
    long = "ka to ri " * 20
    code, out, err = run_cli(capsys, "generate", "--model", path, "--ctx", "16", "-q", "--raw", long)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("perfx: error: the prompt needs") and "context holds 16: shorten it or raise" in err
    code, out, err = run_cli(capsys, "generate", "--model", path, "-q", "caf\udce9")
    assert code == 2 and out == "" and err.startswith("perfx: error: the text is not valid UTF-8")
    code, out, err = run_cli(capsys, "generate", "--model", path, "--device", "no-such-gpu", "-q", "hi")
    assert code == 2 and err.startswith("perfx: error: --device='no-such-gpu' matches no OpenCL device")


def test_empty_raw_prompt_continues_from_bos(tiny, capsys):
    # Documented: with --raw, "" is the BOS alone (the model's unconditioned start); through the chat template
    # it is an empty user message. Only no ids at all is an error (tests/test_model.py, via the API).
    code, out, err = run_cli(capsys, "generate", "--model", tiny[1], "--raw", "--temperature", "0",
                             "--max-tokens", "3", "--json", "-q", "")
    data = json.loads(out)
    assert code == 0 and len(data["prompt_ids"]) == 1 and len(data["ids"]) == 3


def test_chat_line_not_utf8_is_one_error_and_the_chat_goes_on(tiny, device, capsys):
    # Piped stdin under a UTF-8 locale reads bad bytes as surrogates; the turn is refused, the next one runs.
    from perfx.commands.chat import Chat
    from perfx.generate import SamplingConfig
    model, source = load_model(str(tiny[1]), device, ctx=64)
    chat = Chat(model, source, SamplingConfig(temperature=0), 4, None, interactive=False)
    notes = []
    chat.note = lambda text, dim=False: notes.append(text)
    chat.turn("caf\udce9 cr\udce8me")
    assert notes[0].startswith("perfx: error: the text is not valid UTF-8") and chat.messages == []
    chat.turn("ka to ri")
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]
    assert not notes[1].startswith("perfx: error")
    capsys.readouterr()


def test_tokenizer_piece_not_utf8_decodes_as_replacement_character(tiny, tmp_path):
    # Documented recovery: a vocabulary entry that is not UTF-8 is read with U+FFFD in place of its bad bytes;
    # encoding and decoding of everything else is unchanged.
    good = Tokenizer.from_gguf(tiny[1])
    piece = next(i for i in range(good.vocab_size) if good.token_text(i) == "zor")
    raw = tiny[1].read_bytes()
    key = struct.pack("<Q", 3) + b"zor"
    assert raw.count(key) == 1
    path = tmp_path / "bad-piece.gguf"
    path.write_bytes(raw.replace(key, struct.pack("<Q", 3) + b"z\xffr"))
    bad = Tokenizer.from_gguf(path)
    assert bad.token_text(piece) == "z\ufffdr" and bad.decode([piece]) == "z\ufffdr"
    stream = bad.stream_decoder()
    assert stream.add(piece) + stream.flush() == "z\ufffdr"
    text = "the kato ringer sen, la doperi."
    assert bad.encode(text) == good.encode(text) and bad.decode(good.encode(text)) == text


def test_model_path_not_utf8_loads_and_a_missing_one_is_named(tiny, tmp_path):
    # Linux paths are bytes: Python hands them over with surrogates, and perfx passes them through.
    path = os.fsdecode(os.fsencode(str(tmp_path)) + b"/mod\xe8le.gguf")
    shutil.copy(tiny[1], path)
    assert open_model(path).config.n_layers == 2
    with pytest.raises(PerfxError, match=r"Model not found: .*\\udce8le-2.gguf|Model not found: .*le-2.gguf"):
        open_model(path.replace(".gguf", "-2.gguf"))


# -- the CLI as a user runs it: one line, exit status 2, no traceback ---------------------------------------


def perfx_subprocess(*argv, stdin: bytes | None = None, env=None):
    return subprocess.run([sys.executable, "-m", "perfx", *argv], input=stdin, capture_output=True,
                          timeout=120, env=dict(os.environ, **(env or {})))


@pytest.mark.parametrize("case", ["corrupt gguf", "prompt bytes not utf-8", "tiny allocation limit"])
def test_cli_errors_are_one_line_exit_2(tiny, tmp_path, case):
    env = {}
    if case == "corrupt gguf":
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(tiny[1].read_bytes()[:300])
        argv = ["generate", "--model", bad, "hi"]
        message = rf"perfx: error: {bad} is not a readable GGUF file"
    elif case == "prompt bytes not utf-8":
        argv = ["generate", "--model", tiny[1], b"caf\xe9 cr\xe8me"]
        message = r"perfx: error: the text is not valid UTF-8: '\\udce9' in '.*caf\\udce9 cr\\udce8me"
    else:
        limits = tmp_path / "phone.json"
        limits.write_text(json.dumps({"name": "tiny-phone", "max_alloc": 2048}))
        env = {"PERFX_LIMITS": str(limits)}
        argv = ["generate", "--model", tiny[1], "hi"]
        message = (r"perfx: error: .* needs one allocation of [\d.]+ KiB, more than this device allows "
                   r"\(2.0 KiB, limits: tiny-phone\)")
    done = perfx_subprocess(*[os.fsencode(str(a)) if not isinstance(a, bytes) else a for a in argv], env=env)
    err = done.stderr.decode("utf-8", "backslashreplace")
    assert done.returncode == 2, err
    assert "Traceback" not in err and done.stdout == b""
    errors = [line for line in err.splitlines() if line.startswith("perfx: error:")]
    assert len(errors) == 1 and errors[0] == err.splitlines()[-1], err   # notes first, the error last
    assert re.match(message, errors[0]), err


# -- devices, kernels, memory ---------------------------------------------------------------------------


GEMV_DEFINES = {"LANES": 4, "ROWS": 4, "READ": 0, "GROUP": 64, "EPILOGUE": 0}


def test_kernel_that_fails_to_build_carries_the_log_and_the_device_goes_on(device):
    with pytest.raises(BuildError) as info:
        device.kernel("gemv_q4_rows.cl", "gemv_q4", dict(GEMV_DEFINES, LANES="4+("))
    message = str(info.value)
    assert "kernels/gemv_q4_rows.cl failed to build" in message and "-DLANES=4+(" in message
    assert "Build log:" in message and "error" in info.value.log.lower()
    # A wrapper never gets that far: parameters outside the tuning space are refused before building
    # (LANES=3 used to build and give a wrong answer).
    with pytest.raises(PerfxError, match=r"gemv_q4: parameters .* cannot run on .*: LANES=3 is not one of "):
        GemvQ4(device, {"LANES": 3})
    assert device.kernel("gemv_q4_rows.cl", "gemv_q4", GEMV_DEFINES)


def test_allocation_beyond_the_limit_from_a_limits_file(tiny, tmp_path):
    limits = tmp_path / "phone.json"
    limits.write_text(json.dumps({"name": "small-phone", "max_alloc": 16 << 10}))
    small = Device(limits=parse_limits(str(limits)))
    with pytest.raises(PerfxError, match=r"needs one allocation of [\d.]+ KiB, more than this device allows "
                                         r"\(16.0 KiB, limits: small-phone\).*larger allocation limit"):
        load_model(str(tiny[1]), small, ctx=16)
    gc.collect()
    assert small.allocated_bytes == 0   # what the failed load had allocated is released
    # The KV cache: a context too long for one allocation names --ctx.
    with pytest.raises(PerfxError, match=r"KV cache of 4096 positions .* use a smaller --ctx"):
        KVCache.allocate(small, 2, 1, 4096, 64)


def test_corrupt_tuning_database_is_set_aside_and_the_model_runs(tiny, tmp_path, device, monkeypatch):
    monkeypatch.setenv("PERFX_CACHE", str(tmp_path / "cache"))
    mine = Database().device_path(device.fingerprint)
    mine.parent.mkdir(parents=True)
    mine.write_text('{"perfx_tuning": 2, "match": {"device": ')   # cut mid-write (a disk full, an old writer)
    with pytest.warns(TuningDatabaseWarning, match="set aside"):
        model, source = load_model(str(tiny[1]), device, ctx=16)
    model.prefill([5, 9, 11], 0)
    want, _ = forward64.model_forward(source, [5, 9, 11])
    assert relative_error(model.logits(), want[-1]) <= TOLERANCE
    assert [p.name.split(".corrupt-")[0] for p in mine.parent.iterdir()] == [mine.name]  # set aside, no temp


def test_after_every_error_the_same_process_loads_and_runs_a_good_model(tiny, tmp_path, device):
    # The errors above ran in this process on this device; one more of each kind, then the good model.
    for bad in (tmp_path / "cut.gguf", tmp_path / "nan-hf"):
        if bad.suffix:
            bad.write_bytes(tiny[1].read_bytes()[: len(tiny[1].read_bytes()) // 2])
        else:
            write_hf(bad, with_weights(tiny[0], model__norm__weight=set_at(0, np.nan)))
        with pytest.raises(PerfxError):
            Model.load(open_model(bad), device, ctx=16, progress=False)
    with pytest.raises(BuildError):
        device.build("copy.cl", {"VWC": "8)"})
    model, source = load_model(str(tiny[1]), device, ctx=32)
    prompt = source.tokenizer.encode("la doperi ka", add_bos=True)
    model.prefill(prompt, 0)
    want, _ = forward64.model_forward(source, prompt)
    assert relative_error(model.logits(), want[-1]) <= TOLERANCE


def test_the_checks_can_fail(tiny, device):
    # The good model passes the load-time checks, and the comparison that proves "the session still works"
    # tells a wrong reference (another position's logits) and a NaN output apart from the right one.
    source = open_model(tiny[1])
    model = Model.load(source, device, ctx=16, progress=False)
    model.prefill([5, 9, 11], 0)
    want, _ = forward64.model_forward(source, [5, 9, 11])
    assert relative_error(model.logits(), want[-1]) <= TOLERANCE
    assert relative_error(model.logits(), want[-2]) > TOLERANCE      # a wrong reference is told apart
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert relative_error(np.full_like(want[-1], np.nan), want[-1]) == np.inf
