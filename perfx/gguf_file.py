"""GGUF files: the header, the key-value metadata and the tensor infos, each tensor a numpy view of the file's
memory map.

The layout is ggml's ``docs/gguf.md``, versions 2 and 3, little-endian; the value and tensor type enums and
the block sizes are gguf-py's (``GGUFValueType``, ``GGMLQuantizationType``, ``GGML_QUANT_SIZES``). gguf-py's
own reader builds a numpy view per array element, which takes it tens of seconds to open a 262,144-token
vocabulary; here an array of strings is one pass over its lengths and an array of numbers one
``np.frombuffer``. A tensor's ``data`` has the shape and dtype gguf-py gives it: F16, F32, F64 and the
integer types as that numpy type, quantized types (and BF16) as uint8 rows of blocks, both in numpy's order
(the file's dimensions reversed). Every length and offset is checked against the file's size, so a
truncated or corrupt file is refused when it is opened, naming the key or tensor that runs past its end.
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np

from perfx.errors import PerfxError

VERSIONS = (2, 3)
HEADER_BYTES = 24   # magic, version, tensor count, key count
MAX_DIMS = 4        # ggml's GGML_MAX_DIMS

V = gguf.GGUFValueType
SCALAR_FORMATS = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
                  V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}
SCALAR_DTYPES = {kind: np.dtype("<" + code) for kind, code in SCALAR_FORMATS.items()}
Q = gguf.GGMLQuantizationType
# Tensor types gguf-py gives as numbers; every other type as its bytes
TENSOR_DTYPES = {Q.F16: np.dtype("<f2"), Q.F32: np.dtype("<f4"), Q.F64: np.dtype("<f8"), Q.I8: np.dtype("i1"),
                 Q.I16: np.dtype("<i2"), Q.I32: np.dtype("<i4"), Q.I64: np.dtype("<i8")}


class GGUFField(NamedTuple):
    type: gguf.GGUFValueType
    item_type: gguf.GGUFValueType | None   # an array's element type
    value: Any                             # str, int, float or bool; list[str]; numpy array of numbers


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]   # as the file lists them, ne[0] (the row length) first
    offset: int              # of its data, from the start of the file
    data: np.ndarray         # read-only, over the memory map (module docstring: gguf-py's shape and dtype)


class _PastTheEnd(Exception):
    """A length or offset that points past the end of the file."""


class GGUFFile:
    """An open GGUF file: ``fields`` (key -> GGUFField) and ``tensors`` (name -> GGUFTensor), in file order."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self.size = f.seek(0, 2)
                if self.size < HEADER_BYTES:
                    raise self._corrupt(f"it has {self.size} bytes, fewer than GGUF's {HEADER_BYTES}-byte "
                                        "header")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as error:
            raise PerfxError(f"{self.path} could not be read: {error.strerror or error}") from None
        magic, version, n_tensors, n_keys = struct.unpack_from("<4sIQQ", self._map, 0)
        if magic != b"GGUF":
            raise self._corrupt(f"it begins with {magic!r}, not b'GGUF'")
        if version & 0xFFFF == 0:   # llama.cpp's test: version 3 read in the other byte order is 0x03000000
            raise PerfxError(f"{self.path} is a big-endian GGUF (convert_hf_to_gguf.py --bigendian); perfx "
                             "reads little-endian GGUF files: convert the model again without --bigendian")
        if version not in VERSIONS:
            raise PerfxError(f"{self.path} is GGUF version {version}; perfx reads versions "
                             f"{' and '.join(map(str, VERSIONS))}, as llama.cpp does (its converters write 3)")
        self.version = version
        at = HEADER_BYTES
        self.fields: dict[str, GGUFField] = {}
        for index in range(n_keys):
            at = self._read_field(index, at)
        self.alignment = self._alignment()
        infos: dict[str, tuple] = {}
        for index in range(n_tensors):
            at = self._read_tensor_info(index, at, infos)
        self.data_start = at + (-at % self.alignment)
        self.tensors = {name: self._tensor(name, *info) for name, info in infos.items()}

    def value(self, name: str, default: Any = None) -> Any:
        """A field's value as plain Python (str, int, float, bool or a list of them), else ``default``.

        Strings hold U+FFFD for bytes that are not UTF-8: a vocabulary may have such tokens, and llama.cpp
        loads them.
        """
        field = self.fields.get(name)
        if field is None:
            return default
        if isinstance(field.value, np.ndarray):
            return field.value.tolist()
        return list(field.value) if isinstance(field.value, list) else field.value

    # -- parsing -------------------------------------------------------------------------------------

    def _corrupt(self, what: str) -> PerfxError:
        return PerfxError(f"{self.path} is not a readable GGUF file: {what}; it is truncated or corrupt, "
                          "fetch it again")

    def _past_the_end(self, what: str) -> PerfxError:
        return self._corrupt(f"{what} runs past the end of the file ({self.size} bytes)")

    def _string(self, at: int) -> tuple[bytes, int]:
        (length,) = struct.unpack_from("<Q", self._map, at)
        end = at + 8 + length
        if end > self.size:
            raise _PastTheEnd
        return self._map[at + 8:end], end

    def _name(self, raw: bytes, what: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self._corrupt(f"{what}'s name {raw[:40]!r} is not UTF-8") from None

    def _read_field(self, index: int, at: int) -> int:
        name = f"number {index}"
        try:
            raw, at = self._string(at)
            name = self._name(raw, f"key {name}")
            if name in self.fields:
                raise self._corrupt(f"key {name} appears twice")
            (kind,) = struct.unpack_from("<I", self._map, at)
            kind = self._value_type(kind, name)
            item_type = None
            if kind == V.ARRAY:
                item_type, count = struct.unpack_from("<IQ", self._map, at + 4)
                item_type = self._value_type(item_type, name)
                value, at = self._array(item_type, count, at + 16, name)
            elif kind == V.STRING:
                raw, at = self._string(at + 4)
                value = raw.decode("utf-8", errors="replace")
            else:
                (value,) = struct.unpack_from("<" + SCALAR_FORMATS[kind], self._map, at + 4)
                at += 4 + struct.calcsize(SCALAR_FORMATS[kind])
        except (_PastTheEnd, struct.error):
            raise self._past_the_end(f"key {name}") from None
        self.fields[name] = GGUFField(kind, item_type, value)
        return at

    def _value_type(self, raw: int, name: str) -> gguf.GGUFValueType:
        try:
            return V(raw)
        except ValueError:
            raise self._corrupt(f"key {name} has value type {raw}, which GGUF does not define") from None

    def _array(self, item_type: gguf.GGUFValueType, count: int, at: int, name: str) -> tuple[Any, int]:
        if item_type == V.STRING:
            strings = []
            unpack, buffer, size = struct.unpack_from, self._map, self.size
            for _ in range(count):   # one pass: each string's length says where the next one starts
                (length,) = unpack("<Q", buffer, at)
                end = at + 8 + length
                if end > size:
                    raise _PastTheEnd
                strings.append(buffer[at + 8:end].decode("utf-8", errors="replace"))
                at = end
            return strings, at
        if item_type == V.ARRAY:
            raise self._corrupt(f"key {name} is an array of arrays, which llama.cpp does not read either")
        dtype = SCALAR_DTYPES[item_type]
        end = at + count * dtype.itemsize
        if end > self.size:
            raise _PastTheEnd
        return np.frombuffer(self._map, dtype, count, at), end

    def _alignment(self) -> int:
        field = self.fields.get("general.alignment")
        if field is None:
            return gguf.GGUF_DEFAULT_ALIGNMENT
        if field.type != V.UINT32:
            raise self._corrupt(f"general.alignment is a {field.type.name}, where GGUF has a UINT32")
        if field.value <= 0 or field.value & (field.value - 1):
            raise self._corrupt(f"general.alignment is {field.value}, which is not a power of two")
        return field.value

    def _read_tensor_info(self, index: int, at: int, infos: dict) -> int:
        name = f"number {index}"
        try:
            raw, at = self._string(at)
            name = self._name(raw, f"tensor {name}")
            (n_dims,) = struct.unpack_from("<I", self._map, at)
            if n_dims > MAX_DIMS:
                raise self._corrupt(f"tensor {name} has {n_dims} dimensions; GGUF tensors have at most "
                                    f"{MAX_DIMS}")
            dims = struct.unpack_from(f"<{n_dims}Q", self._map, at + 4)
            at += 4 + 8 * n_dims
            kind, offset = struct.unpack_from("<IQ", self._map, at)
        except (_PastTheEnd, struct.error):
            raise self._past_the_end(f"the info of tensor {name}") from None
        if name in infos:
            raise self._corrupt(f"tensor {name} appears twice")
        try:
            kind = Q(kind)
        except ValueError:
            raise self._corrupt(f"tensor {name} has ggml type {kind}, which gguf-py does not know") from None
        infos[name] = (kind, dims, offset)
        return at + 12

    def _tensor(self, name: str, kind: gguf.GGMLQuantizationType, dims: tuple[int, ...],
                offset: int) -> GGUFTensor:
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        row = dims[0] if dims else 1
        if row % block:
            raise self._corrupt(f"tensor {name} has rows of {row} values, not a multiple of {kind.name}'s "
                                f"blocks of {block}")
        count = math.prod(dims)
        start, n_bytes = self.data_start + offset, count // block * type_size
        if start + n_bytes > self.size:
            raise self._past_the_end(f"tensor {name}'s data, {n_bytes} bytes at offset {start},")
        shape = tuple(reversed(dims))
        if kind in TENSOR_DTYPES:
            data = np.frombuffer(self._map, TENSOR_DTYPES[kind], count, start).reshape(shape)
        else:   # rows of blocks: the last (numpy) dimension counts bytes
            shape = shape[:-1] + (row // block * type_size,)
            data = np.frombuffer(self._map, np.uint8, n_bytes, start).reshape(shape)
        return GGUFTensor(name, kind, tuple(dims), start, data)
