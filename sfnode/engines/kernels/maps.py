"""The process's pages of a file's map, one tensor's range at a time: giving them back to the
system (``madvise(MADV_DONTNEED)``: the file's pages stay in the page cache, the next read maps
them again) and counting those resident (``/proc/self/pagemap``).  The kernels give back what
laying out tiles read; the weights give back, when the engine rests, the tables read a row at a
time (docs/engine.md section 5.3).

Pure NumPy and the standard library: this module never imports torch, never writes into a map
and never touches pages outside the tensor's own range rounded out to whole pages.
"""

from __future__ import annotations

import mmap
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


__all__ = ["give_back", "resident_bytes"]
