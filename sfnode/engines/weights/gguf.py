"""The tensor table of a GGUF file, read without trusting it, and the check that every tensor
it describes can exist.

A GGUF file starts with its metadata (key/value pairs) and a table of tensors (name,
dimensions, type, offset into the data section).  :func:`read_tensor_table` walks the metadata
without keeping it and returns the table; :func:`impossible_tensor` says what is wrong with the
first tensor that cannot exist: no dimension or more than four, a dimension of 0, more elements
than any model has, rows that are not whole blocks of its type, or data that runs past the end
of the file.  The node runs it before it converts a GGUF file (``sfnode.engines.weights.loading``),
so such a file is refused with a message naming the tensor rather than failing deep in the
conversion.

This module reads the file through a read-only memory map and never trusts a length it reads:
every count and size is checked against what is left of the file before it is used.  It never
imports torch or transformers.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
MAX_DIMS = 4
"""GGML_MAX_DIMS."""
MAX_ELEMENTS = 1 << 40
"""More elements than any tensor of a model a node could hold."""
DEFAULT_ALIGNMENT = 32
_MAX_ENTRIES = 1 << 24
"""More metadata entries or tensors than any real file has: a count beyond it is corruption."""

# Metadata value types and their sizes (strings and arrays are walked).
_STRING = 8
_ARRAY = 9
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UNSIGNED = {0: "<B", 2: "<H", 4: "<I", 10: "<Q"}
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
KEPT_ARRAY = 4096
"""Arrays of at most this many items are read into the metadata; longer ones (a vocabulary)
are described by :class:`LongArray` and left in the file."""


class GgufFormatError(ValueError):
    """The bytes are not a GGUF file this reader can walk."""


@dataclass(frozen=True)
class TensorEntry:
    """One row of the tensor table."""

    name: str
    shape: tuple[int, ...]
    """The dimensions as stored: the first is the length of a row."""
    type: int
    """The ggml type number."""
    offset: int
    """Where its data starts in the file (the data section's start plus its own offset)."""


@dataclass(frozen=True)
class LongArray:
    """A metadata array too long to read with the header (a vocabulary, its merges)."""

    item_type: int
    length: int


class _Cursor:
    def __init__(self, data: mmap.mmap | bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise GgufFormatError(f"the file ends inside its header (at byte {self.at})")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return int(value)

    def skip(self, size: int) -> None:
        if size < 0 or self.at + size > len(self.data):
            raise GgufFormatError(f"a length of {size} at byte {self.at} runs past the file")
        self.at += size

    def string(self) -> bytes:
        length = self.take("<Q")
        start = self.at
        self.skip(length)
        return bytes(self.data[start : self.at])

    def count(self, what: str) -> int:
        value = self.take("<Q")
        if value > _MAX_ENTRIES:
            raise GgufFormatError(f"{value} {what} cannot be right")
        return value

    def decode(self, kind: int) -> Any:
        """One metadata value, decoded (a long array described, not read)."""
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            size = struct.calcsize(fmt)
            if self.at + size > len(self.data):
                raise GgufFormatError(f"the file ends inside its header (at byte {self.at})")
            (value,) = struct.unpack_from(fmt, self.data, self.at)
            self.at += size
            return value
        if kind == _STRING:
            return self.string().decode("utf-8", "replace")
        if kind == _ARRAY:
            start = self.at
            item = self.take("<I")
            length = self.take("<Q")
            if length > KEPT_ARRAY:
                self.at = start
                self.value(_ARRAY)
                return LongArray(item, length)
            return [self.decode(item) for _ in range(length)]
        raise GgufFormatError(f"unknown metadata value type {kind} at byte {self.at}")

    def value(self, kind: int) -> int | None:
        """Skip one metadata value; its value when it is an unsigned integer."""
        if kind in _UNSIGNED:
            return self.take(_UNSIGNED[kind])
        if kind in _FIXED:
            self.skip(_FIXED[kind])
            return None
        if kind == _STRING:
            self.string()
            return None
        if kind == _ARRAY:
            item = self.take("<I")
            length = self.take("<Q")
            if item in _FIXED:
                self.skip(length * _FIXED[item])
            elif item == _STRING:
                for _ in range(length):
                    self.skip(self.take("<Q"))
            else:
                # Nested arrays exist in the format but in no model file: walk them too.
                if length > _MAX_ENTRIES:
                    raise GgufFormatError(f"an array of {length} arrays cannot be right")
                for _ in range(length):
                    self.value(item)
            return None
        raise GgufFormatError(f"unknown metadata value type {kind} at byte {self.at}")


def read_tensor_table(path: Path) -> list[TensorEntry]:
    """The tensors a GGUF file describes, with their absolute data offsets (the metadata is
    walked, not decoded).

    :raises GgufFormatError: the file is not GGUF, or its header contradicts itself.
    """
    return _walk(path, decode=False)[1]


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorEntry]]:
    """A GGUF file's metadata (values decoded; arrays longer than :data:`KEPT_ARRAY` as
    :class:`LongArray`) and its tensor table.

    :raises GgufFormatError: the file is not GGUF, or its header contradicts itself.
    """
    return _walk(path, decode=True)


def _walk(path: Path, *, decode: bool) -> tuple[dict[str, Any], list[TensorEntry]]:
    """The metadata (empty unless ``decode``) and the tensor table of a GGUF file."""
    with open(path, "rb") as file:
        size = file.seek(0, 2)
        if size < 24:
            raise GgufFormatError("the file is too short to be GGUF")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data)
            if bytes(data[:4]) != MAGIC:
                raise GgufFormatError("the file does not start with GGUF")
            cursor.skip(4)
            version = cursor.take("<I")
            if version not in (2, 3):
                raise GgufFormatError(f"GGUF version {version} is not 2 or 3")
            tensors = cursor.count("tensors")
            metadata, alignment = _metadata(cursor, cursor.count("metadata entries"), decode)
            if alignment < 1:
                raise GgufFormatError(f"an alignment of {alignment} cannot be right")
            table: list[tuple[str, tuple[int, ...], int, int]] = []
            for _ in range(tensors):
                name = cursor.string().decode("utf-8", "replace")
                dims = cursor.take("<I")
                if dims > MAX_DIMS:
                    # Reported by impossible_tensor; the rest of the table cannot be read.
                    table.append((name, (0,) * dims, -1, 0))
                    break
                shape = tuple(cursor.take("<Q") for _ in range(dims))
                table.append((name, shape, cursor.take("<I"), cursor.take("<Q")))
            start = -(-cursor.at // alignment) * alignment
    entries = [
        TensorEntry(name, shape, kind, start + offset) for name, shape, kind, offset in table
    ]
    return metadata, entries


def _metadata(cursor: _Cursor, entries: int, decode: bool) -> tuple[dict[str, Any], int]:
    """The metadata entries (decoded, or only walked) and the data alignment they set."""
    metadata: dict[str, Any] = {}
    alignment = DEFAULT_ALIGNMENT
    for _ in range(entries):
        key = cursor.string()
        kind = cursor.take("<I")
        value = cursor.decode(kind) if decode else cursor.value(kind)
        if decode:
            metadata[key.decode("utf-8", "replace")] = value
        if key == b"general.alignment" and isinstance(value, int):
            alignment = value
    return metadata, alignment


def impossible_tensor(entries: list[TensorEntry], file_size: int) -> str | None:
    """What is wrong with the first tensor that cannot exist, or None when all can."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for entry in entries:
        shape = list(entry.shape)
        where = f"tensor {entry.name!r} has an impossible shape {shape}"
        if not 1 <= len(shape) <= MAX_DIMS:
            return f"{where} ({len(shape)} dimensions; 1 to {MAX_DIMS})"
        if min(shape) < 1:
            return f"{where} (a dimension of 0)"
        elements = 1
        for dim in shape:
            elements *= dim
        if elements > MAX_ELEMENTS:
            return f"{where} ({elements} elements)"
        try:
            kind = GGMLQuantizationType(entry.type)
        except ValueError:
            return f"tensor {entry.name!r} has an unknown type {entry.type}"
        block, type_size = GGML_QUANT_SIZES[kind]
        if shape[0] % block:
            return (
                f"{where} (rows of {shape[0]} values are not whole {block}-value blocks of "
                f"{kind.name})"
            )
        needed = elements // block * type_size
        if entry.offset + needed > file_size:
            return (
                f"{where} (it needs {needed} bytes of {kind.name} data; the file holds "
                f"{max(0, file_size - entry.offset)} from its offset)"
            )
    return None


__all__ = [
    "KEPT_ARRAY",
    "GgufFormatError",
    "LongArray",
    "TensorEntry",
    "impossible_tensor",
    "read_header",
    "read_tensor_table",
]
