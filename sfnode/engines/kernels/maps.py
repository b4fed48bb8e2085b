"""The process's pages of a file's map, one tensor's range at a time: giving them back to the
system (``madvise(MADV_DONTNEED)``: the file's pages stay in the page cache, the next read maps
them again) and counting those resident (``/proc/self/pagemap``); and a table's rows read from
its file with ``pread`` instead of through the map (:class:`RowFile`).  The kernels give back
what laying out tiles read; the tables read a row at a time (the embedding, the head's float
rows) are read with ``pread``, and the weights give back, when the engine rests, what was read
through the map (docs/engine.md section 5.3).

Why ``pread``: a read through the map maps the pages around the one read with it (the
kernel's fault-around, and a whole large folio of the page cache: on ext4 under Linux 6.18 up to
1 MB for one row, whatever ``madvise(MADV_RANDOM)`` says), so a few scattered rows a token map
the whole table into the resident set within a few hundred tokens.  ``pread`` copies only the
row's bytes into a small buffer; the file's pages stay in the page cache, which is not the
process's resident memory.

Pure NumPy and the standard library: this module never imports torch, never writes into a map
or a file, and never touches pages outside the tensor's own range rounded out to whole pages.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np


def _mapped_pages(data: np.ndarray[Any, Any]) -> tuple[mmap.mmap, int, int] | None:
    """The map ``data`` views, and the page-aligned offset and length in it of ``data``'s
    pages; None for an array that is not a view of a file's map."""
    mapped = getattr(data, "_mmap", None) if isinstance(data, np.memmap) else None
    if not isinstance(mapped, mmap.mmap) or not data.nbytes:
        return None
    start = data.ctypes.data - np.frombuffer(mapped, dtype=np.uint8).ctypes.data
    first = start - start % mmap.PAGESIZE
    return mapped, first, start + data.nbytes - first


def give_back(data: np.ndarray[Any, Any]) -> None:
    """Drop the process's pages of ``data``'s part of its file's map, rounded out to whole
    pages (so a page it shares with a neighbouring tensor goes too; the rest of the map stays):
    they leave the resident set, the file's pages stay in the page cache, and the next read of
    a row maps its page again.  Nothing for an array that is not a file's map.  The maps are
    copy-on-write and sfnode never writes into them, so nothing written is lost."""
    found = _mapped_pages(data)
    if found is not None:
        mapped, first, length = found
        mapped.madvise(mmap.MADV_DONTNEED, first, length)


def resident_bytes(data: np.ndarray[Any, Any], pagemap: str = "/proc/self/pagemap") -> int:
    """The bytes of ``data``'s pages in the process's resident set (``pagemap``'s present
    bit: ``mincore`` would answer for the page cache instead): all of them for an array that
    is not a file's map, or where the system has no ``pagemap``."""
    found = _mapped_pages(data)
    if found is None:
        return int(data.nbytes)
    mapped, first, length = found
    address = np.frombuffer(mapped, dtype=np.uint8).ctypes.data + first
    pages = -(-length // mmap.PAGESIZE)
    try:
        with open(pagemap, "rb") as entries:
            entries.seek(address // mmap.PAGESIZE * 8)
            raw = entries.read(pages * 8)
    except OSError:
        return int(data.nbytes)
    raw = raw[: len(raw) // 8 * 8]  # whole entries only, should the read come back short
    present = np.frombuffer(raw, dtype=np.uint64) >> np.uint64(63)
    return int(np.count_nonzero(present)) * mmap.PAGESIZE


def _file_range(data: np.ndarray[Any, Any]) -> tuple[str, int] | None:
    """The file ``data`` (rows of bytes, C-contiguous) is a view of, and the offset in it of
    ``data``'s first byte; None for an array that is not a view of a file's map."""
    found = _mapped_pages(data)
    name = getattr(data, "filename", None)
    offset = getattr(data, "offset", None)
    if found is None or not isinstance(name, str | os.PathLike) or not isinstance(offset, int):
        return None
    if data.ndim != 2 or not data.flags.c_contiguous or data.dtype != np.uint8:
        return None
    mapped = found[0]
    # np.memmap maps from the allocation granularity below the offset it was given; a view keeps
    # its parent's filename, offset and map.
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    base = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
    return os.fspath(name), start + data.ctypes.data - base


class RowFile:
    """The rows of a table (``[rows, bytes a row]`` of ``uint8``, a view of a file's map) read
    from the file with ``pread``: :attr:`fd` and :attr:`offset` (of row 0) for the native step,
    :meth:`read` for the rest.  The descriptor is closed when this object goes."""

    def __init__(self, path: str, offset: int, rows: int, row_bytes: int) -> None:
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        weakref.finalize(self, os.close, self.fd)
        self.offset = offset
        self.rows = rows
        self.row_bytes = row_bytes

    def read(self, indices: Sequence[int] | np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """Rows ``indices`` (``[len(indices), bytes a row]``), each read by itself."""
        picked = np.asarray(indices, dtype=np.int64).reshape(-1)
        out = np.empty((len(picked), self.row_bytes), dtype=np.uint8)
        for at, index in enumerate(picked.tolist()):
            if not 0 <= index < self.rows:
                raise IndexError(f"row {index} of a table of {self.rows}")
            read = os.preadv(self.fd, [out[at]], self.offset + index * self.row_bytes)
            if read != self.row_bytes:
                raise OSError(f"row {index}: {read} of {self.row_bytes} bytes read")
        return out


def row_file(data: np.ndarray[Any, Any], maps: str = "/proc/self/maps") -> RowFile | None:
    """``data``'s rows read from its file (:class:`RowFile`), or None: an array that is not a
    view of a file's map, or a file at the map's path that is not the mapped one (replaced
    since, or gone: the map still reads the old file).  The mapped file is named by the inode
    ``maps`` gives the map (``/proc/self/maps``; without it, the file at the path is taken as
    the mapped one).  The inode alone, not the device: under overlayfs (a container's files)
    the map names the real file's device, the opened file the overlay's.  Never reads through
    the map, which would map its pages."""
    found = _file_range(data)
    if found is None or not len(data):
        return None
    path, offset = found
    mapped = _mapped_inode(data.ctypes.data, maps)
    try:
        rows = RowFile(path, offset, int(data.shape[0]), int(data.shape[1]))
    except FileNotFoundError:
        return None
    opened = os.fstat(rows.fd)
    if (mapped is not None and mapped != opened.st_ino) or opened.st_size < offset + data.nbytes:
        return None
    return rows


def _mapped_inode(address: int, maps: str) -> int | None:
    """The inode of the file mapped at ``address`` as ``maps`` lists it; None where the
    system has no such list."""
    try:
        with open(maps) as lines:
            for line in lines:
                fields = line.split(maxsplit=5)
                first, _, last = fields[0].partition("-")
                if int(first, 16) <= address < int(last, 16):
                    return int(fields[4])
    except FileNotFoundError:
        return None
    return None


__all__ = ["RowFile", "give_back", "resident_bytes", "row_file"]
