"""perfx's GGUF reader (perfx.gguf_file) against gguf-py's GGUFReader, the format's own reader in Python.

Every GGUF the test suite writes (tiny_models.write_gguf in each variant the tests use, family_models'
write_family_gguf for each family, the tokenizer-only file, tests/data/vocab/*.gguf, the default model)
and a file holding every value type and many tensor types must give gguf-py's value for every key, and
gguf-py's name, type, dimensions, offset and data (dtype, shape, bytes) for every tensor. Bad files: one cut
anywhere before its last tensor's end is refused with a PerfxError, and so are big-endian files, arrays of
arrays and a bad alignment; bytes changed in a header give a file that opens or a PerfxError, nothing else.
"""

import json
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from helpers.family_models import F32_TYPES, FAMILIES, family_tokenizer, make_family_model, write_family_gguf
from helpers.tiny_models import (MIXED_32, Q4_K_M, Q5_K_M, make_tiny_model, quantize_gguf, tiny_tokenizer,
                                 write_gguf)
from helpers.tiny_tokenizer import write_tokenizer_only_gguf
from perfx.errors import PerfxError
from perfx.gguf_file import GGUFFile
from perfx.sources.default import default_model_path

DATA = Path(__file__).parent / "data"
RECORDED = json.loads((DATA / "llamacpp_families.json").read_text())["families"]
V, Q = gguf.GGUFValueType, gguf.GGMLQuantizationType
SCALARS = {V.UINT8: 200, V.INT8: -100, V.UINT16: 60000, V.INT16: -30000, V.UINT32: 4_000_000_000,
           V.INT32: -2_000_000_000, V.FLOAT32: 0.1, V.BOOL: True, V.UINT64: 2**63 + 5, V.INT64: -2**62,
           V.FLOAT64: 1e-300}


def write_every_type(path: Path, alignment: int = 64) -> Path:
    """Every value type as a key and as an array, strings that are not UTF-8, and tensors of many types and
    ranks, data aligned to ``alignment``."""
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(alignment)
    for kind, value in SCALARS.items():
        writer.add_key_value(f"test.{kind.name.lower()}", value, kind)
        writer.add_key_value(f"test.{kind.name.lower()}s", [value] * 3, V.ARRAY, sub_type=kind)
    writer.add_key_value("test.string", "naïve \U0001F600", V.STRING)
    writer.add_key_value("test.not_utf8", b"z\xffr", V.STRING)
    writer.add_key_value("test.strings", ["a", b"\xc3", "", "é" * 300], V.ARRAY, sub_type=V.STRING)
    writer.add_tensor("f32.3d", rng.standard_normal((2, 3, 5)).astype(np.float32))
    writer.add_tensor("f16.1d", rng.standard_normal(7).astype(np.float16))
    writer.add_tensor("f64", rng.standard_normal((3, 4)))
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        writer.add_tensor(f"{np.dtype(dtype).name}", rng.integers(-100, 100, (3, 5)).astype(dtype))
    for kind, shape in (("Q4_0", (3, 64)), ("Q8_0", (2, 2, 32)), ("Q4_K", (2, 256)), ("Q6_K", (256,)),
                        ("BF16", (3, 6))):
        raw, _ = quantize_gguf(rng.standard_normal(shape).reshape(-1, shape[-1]), kind)
        block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
        writer.add_tensor(f"{kind}", raw.reshape(shape[:-1] + (shape[-1] // block * size,)), raw_dtype=Q[kind])
    iq4 = rng.integers(0, 256, (2, 64 // 32 * 18)).astype(np.uint8)   # a type perfx refuses, read as bytes
    writer.add_tensor("iq4_nl", iq4, raw_dtype=Q.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """Name -> path of every GGUF the suite writes, in each variant its tests use."""
    root = tmp_path_factory.mktemp("gguf-files")
    spm = tiny_tokenizer(root / "tokenizer")
    rng = np.random.default_rng(15)
    gqa3, gqa1, k256, tied = (make_tiny_model(kind, spm, rng) for kind in ("gqa3", "gqa1", "k256", "k256-tied"))
    tiny = {
        "default": dict(model=gqa3), "tied": dict(model=gqa1),
        "tied-q4": dict(model=gqa1, embedding_type="Q4_0"),
        "Q4_K_M": dict(model=k256, layer_types=Q4_K_M, embedding_type="Q4_K", output_type="Q6_K"),
        "Q5_K_M-tied": dict(model=tied, layer_types=Q5_K_M, embedding_type="Q6_K"),
        "MIXED_32": dict(model=gqa3, layer_types=MIXED_32, embedding_type="Q5_1", output_type="Q5_0"),
        "rope_freqs": dict(model=gqa3, embedding_type="F16",
                           rope_freqs=np.linspace(1, 8, 32, dtype=np.float32)),
        "window": dict(model=gqa3, sliding_window=5), "bos": dict(model=gqa3, add_bos=True),
        "no-bos": dict(model=gqa3, add_bos=False), "no-tokenizer": dict(model=gqa3, tokenizer=False),
        "unsupported": dict(model=gqa3, tokenizer=False, raw_override={
            "blk.1.ffn_up.weight": (np.zeros((384, 192 // 32 * 18), np.uint8), Q.IQ4_NL)}),
    }
    out = {name: write_gguf(root / f"{name}.gguf", **args).path for name, args in tiny.items()}
    out["tokenizer-only"] = write_tokenizer_only_gguf(root / "tokenizer-only.gguf", spm)
    for family in FAMILIES:
        model = make_family_model(family, family_tokenizer(root, family), np.random.default_rng(0))
        out[f"family-{family}"] = write_family_gguf(root / f"{family}.gguf", model).path
    for family, entry in RECORDED.items():
        settings = dict(entry["make_family_model"])
        model = make_family_model(settings.pop("family"), family_tokenizer(root, family),
                                  np.random.default_rng(settings.pop("seed")), **settings)
        out[f"recorded-{family}"] = write_family_gguf(root / f"recorded-{family}.gguf", model,
                                                      **entry["write_family_gguf"]).path
        out[f"f32-{family}"] = write_family_gguf(root / f"f32-{family}.gguf", model, types=F32_TYPES,
                                                 embedding_type="F32", output_type="F32").path
    out.update({f"vocab-{p.stem}": p for p in sorted((DATA / "vocab").glob("*.gguf"))})
    out["every-type"] = write_every_type(root / "every-type.gguf")
    out["every-type-align-8"] = write_every_type(root / "every-type-8.gguf", alignment=8)
    return out


def gguf_py_value(field):
    """A gguf-py field as plain Python, strings with U+FFFD for bytes that are not UTF-8 (how perfx read
    gguf-py's fields before it had its own reader)."""
    def text(part) -> str:
        return bytes(part).decode("utf-8", errors="replace")

    if field.types[0] == V.ARRAY:
        if field.types[-1] == V.STRING:
            return [text(field.parts[i]) for i in field.data]
        return [item for i in field.data for item in field.parts[i].tolist()]
    if field.types[0] == V.STRING:
        return text(field.parts[-1])
    return field.parts[-1].tolist()[0]


NAMES = (["default", "tied", "tied-q4", "Q4_K_M", "Q5_K_M-tied", "MIXED_32", "rope_freqs", "window", "bos",
          "no-bos", "no-tokenizer", "unsupported", "tokenizer-only", "every-type", "every-type-align-8"]
         + [f"family-{f}" for f in FAMILIES] + [f"{kind}-{f}" for f in RECORDED for kind in ("recorded", "f32")]
         + [f"vocab-{p.stem}" for p in sorted((DATA / "vocab").glob("*.gguf"))])


@pytest.mark.parametrize("name", NAMES)
def test_every_key_and_tensor_is_what_gguf_py_reads(written, name):
    check_against_gguf_py(written[name])


def test_the_default_model_is_what_gguf_py_reads():
    check_against_gguf_py(default_model_path())


def check_against_gguf_py(path: Path):
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    fields = {name: f for name, f in theirs.fields.items() if not name.startswith("GGUF.")}
    assert list(ours.fields) == list(fields)
    for name, f in fields.items():
        field = ours.fields[name]
        item_type = f.types[-1] if f.types[0] == V.ARRAY else None
        assert (field.type, field.item_type) == (f.types[0], item_type), name
        # repr: the same values of the same Python types (True is not 1, 1.0 is not 1)
        assert repr(ours.value(name)) == repr(gguf_py_value(f)), name
    assert ours.version == int(theirs.fields["GGUF.version"].parts[0][0])
    assert (ours.alignment, ours.data_start) == (theirs.alignment, theirs.data_offset)
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert (mine.tensor_type, mine.shape, mine.offset) == (t.tensor_type, tuple(t.shape.tolist()),
                                                               t.data_offset), t.name
        assert (mine.data.dtype, mine.data.shape) == (t.data.dtype, t.data.shape), t.name
        assert not mine.data.flags.writeable
        assert mine.data.tobytes() == np.asarray(t.data).tobytes(), t.name


def test_value_gives_plain_python_and_the_default(written):
    file = GGUFFile(written["every-type"])
    assert file.value("test.uint64") == 2**63 + 5 and file.value("test.float32") == float(np.float32(0.1))
    assert file.value("test.bools") == [True] * 3 and type(file.value("test.int16s")[0]) is int
    assert file.value("test.not_utf8") == "z\ufffdr" and file.value("test.strings")[1] == "\ufffd"
    assert file.value("no.such.key") is None and file.value("no.such.key", 7) == 7
    tokens = file.value("test.strings")
    tokens.append("x")   # the caller's own list
    assert len(file.value("test.strings")) == 4


# -- bad files ------------------------------------------------------------------------------------------


def test_a_file_cut_anywhere_is_refused(written, tmp_path):
    raw = written["every-type"].read_bytes()
    file = GGUFFile(written["every-type"])
    end = max(t.offset + t.data.nbytes for t in file.tensors.values())   # the writer pads after the last tensor
    cut = tmp_path / "cut.gguf"
    for size in [*range(0, end, 7), end - 1]:   # every seventh byte: into each key, tensor info and tensor
        cut.write_bytes(raw[:size])
        with pytest.raises(PerfxError, match=r"cut.gguf is not a readable GGUF file: .*; it is truncated or "
                                             r"corrupt, fetch it again"):
            GGUFFile(cut)
    cut.write_bytes(raw[:end])
    assert GGUFFile(cut).tensors.keys() == file.tensors.keys()


def test_a_changed_byte_in_the_header_opens_or_is_a_perfx_error(written, tmp_path):
    raw = bytearray(written["every-type"].read_bytes())
    header = GGUFFile(written["every-type"]).data_start
    rng, bad = np.random.default_rng(7), tmp_path / "bad.gguf"
    refused = 0
    for _ in range(400):
        changed = bytearray(raw)
        changed[int(rng.integers(8, header))] = int(rng.integers(0, 256))
        bad.write_bytes(changed)
        try:
            GGUFFile(bad)
        except PerfxError as error:
            refused += 1
            assert str(error).startswith(str(bad)), error
    assert refused > 100    # most changes hit a length, a type or a name


def test_big_endian_files_are_refused_and_say_why(tmp_path):
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_tensor("x", np.ones(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(PerfxError, match=r"big.gguf is a big-endian GGUF .*convert the model again without "
                                         r"--bigendian"):
        GGUFFile(path)


def header_only(path: Path, keys: dict) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (value, kind, sub) in keys.items():
        writer.add_key_value(name, value, kind, sub_type=sub)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("keys, message", [
    ({"test.nested": ([[1, 2], [3]], V.ARRAY, V.ARRAY)}, "key test.nested is an array of arrays"),
    ({"general.alignment": (48, V.UINT32, None)}, "general.alignment is 48, which is not a power of two"),
    ({"general.alignment": (64, V.UINT64, None)}, "general.alignment is a UINT64, where GGUF has a UINT32"),
])
def test_keys_llama_cpp_refuses_are_refused(tmp_path, keys, message):
    with pytest.raises(PerfxError, match=rf"bad.gguf is not a readable GGUF file: {message}"):
        GGUFFile(header_only(tmp_path / "bad.gguf", keys))


def test_what_is_not_a_gguf_is_named(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(PerfxError, match=r"notes.gguf is not a readable GGUF file: it begins with "
                                         r"b'PK\\x03\\x04'"):
        GGUFFile(path)
    with pytest.raises(PerfxError, match=r"missing.gguf could not be read: No such file"):
        GGUFFile(tmp_path / "missing.gguf")
    raw = header_only(tmp_path / "v.gguf", {}).read_bytes()
    path.write_bytes(raw[:4] + struct.pack("<I", 1) + raw[8:])
    with pytest.raises(PerfxError, match=r"notes.gguf is GGUF version 1; perfx reads versions 2 and 3"):
        GGUFFile(path)
