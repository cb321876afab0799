"""A GGUF file's header: its key/value metadata and its tensor table (names,
ggml types, shapes, where the data lies), read without touching the tensor
data. Values come back as plain Python objects; the long string arrays (a
tokenizer's tokens and merges) only when asked for, else as their length.

gguf's GGUFReader parses every field into numpy objects (for SmolLM2 about
160 MB while it lives); this reader keeps what the config, the tokenizer and
the weight loader use, in a few MB."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any, Collection

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 counted in 32 bits; llama.cpp has not written it since 2023
DEFAULT_ALIGNMENT = 32  # of the tensor data, unless general.alignment says otherwise

# Metadata value types (gguf_type in ggml's gguf.h) of a fixed size: struct format.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType's value
    shape: tuple[int, ...]  # torch order (GGUF lists the fastest dimension first)
    offset: int  # of its data, from the start of the file


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]


class _Cursor:
    def __init__(self, data, path: str):
        self.data, self.pos, self.path = data, 0, path

    def unpack(self, fmt: str) -> tuple:
        fmt = "<" + fmt
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise ValueError(f"{self.path}: the GGUF header ends early (truncated file?)")
        values = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (length,) = self.unpack("Q")
        end = self.pos + length
        if end > len(self.data):
            raise ValueError(f"{self.path}: the GGUF header ends early (truncated file?)")
        text = self.data[self.pos:end].decode("utf-8")
        self.pos = end
        return text

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            (length,) = self.unpack("Q")
            self.pos += length

    def value(self, kind: int, key: str, keep_strings: bool) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: GGUF metadata {key!r} has unknown value type {kind}")
        item_kind, count = self.unpack("IQ")
        if item_kind in _SCALARS:
            return list(self.unpack(f"{count}{_SCALARS[item_kind]}"))
        if item_kind == _STRING:
            if keep_strings:
                return [self.string() for _ in range(count)]
            self.skip_strings(count)
            return count
        raise ValueError(f"{self.path}: GGUF metadata {key!r} is an array of type {item_kind}, not supported")


def read_gguf_header(path: str, string_arrays: Collection[str] = ()) -> GGUFHeader:
    """The metadata and tensor table of the GGUF file at `path`; string arrays
    whose key is in `string_arrays` are read as lists, the others (and arrays
    of arrays, which no llama-family file holds) as their length. ValueError
    (naming the file) for a file that is not GGUF v2/v3 or ends early."""
    with open(path, "rb") as file:
        if file.read(4) != MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic at its start)")
        return _read(file, str(path), string_arrays)


def _read(file, path: str, string_arrays: Collection[str]) -> GGUFHeader:
    # Mapped, not read: the header's pages are touched once and unmapped on return.
    with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data, path)
        cursor.pos = 4
        version, tensor_count, kv_count = cursor.unpack("IQQ")
        if version not in VERSIONS:
            raise ValueError(f"{path} is GGUF version {version}; supported: {VERSIONS}")
        metadata = {}
        for _ in range(kv_count):
            key = cursor.string()
            (kind,) = cursor.unpack("I")
            metadata[key] = cursor.value(kind, key, key in string_arrays)
        if not isinstance(metadata.get("general.architecture"), str):
            raise ValueError(f"{path} has no general.architecture in its GGUF metadata")
        entries = []
        for _ in range(tensor_count):
            name = cursor.string()
            (dims,) = cursor.unpack("I")
            shape = cursor.unpack(f"{dims}Q")
            ggml_type, offset = cursor.unpack("IQ")
            entries.append((name, ggml_type, tuple(reversed(shape)), offset))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1:
            raise ValueError(f"{path}: general.alignment must be a positive int, got {alignment!r}")
        start = -(-cursor.pos // alignment) * alignment
    return GGUFHeader(path, metadata, [GGUFTensor(n, t, s, start + o) for n, t, s, o in entries])
