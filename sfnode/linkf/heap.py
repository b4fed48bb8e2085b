"""The C heap's controls (glibc's ``malloc_trim`` and ``mallopt``), shared by the node's engine
and the head's worker threads: both free large native allocations (a step's temporaries, a
tokenized megabyte prompt) that glibc would otherwise keep resident.

This module must never import anything but the standard library (the head imports it), and
never fail where the C library is not glibc: there every call does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

__all__ = ["libc_function", "trim_heap"]


@functools.cache
def libc_function(name: str) -> Any:
    """glibc's function ``name`` (ctypes), or None where the C library has none (not glibc);
    looked up once per name."""
    library = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(library), name) if library else None
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Return the heap's free pages to the system (``malloc_trim(0)``; nothing elsewhere)."""
    trim = libc_function("malloc_trim")
    if trim is not None:
        trim(0)
