"""The machine a node runs on, as its reports describe it (docs/protocol.md section 12.9): the
CPU's model name and vector extensions, and the process's resident memory.

Reads ``/proc`` only; never imports torch (a mock node has none), never fails a
report: what cannot be read is said as such.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

VECTOR_EXTENSIONS = ("avx512f", "avx512_bf16", "avx2", "fma", "f16c", "neon", "asimd")
"""The CPU flags worth naming (what the kernels choose by), in the order they are named."""


def cpu_description(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """``AMD EPYC 7B13 (avx2 fma f16c)``: the first CPU's model name and its vector extensions;
    the machine's architecture where ``/proc/cpuinfo`` cannot be read."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return platform.machine() or "unknown"
    name, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and not name:
            name = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    name = name or platform.machine() or "unknown"
    have = [flag for flag in VECTOR_EXTENSIONS if flag in flags]
    return f"{name} ({' '.join(have)})" if have else name


def resident_bytes(statm: str = "/proc/self/statm") -> int | None:
    """The node process's resident set, in bytes (None where the system does not say)."""
    try:
        with open(statm) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


__all__ = ["VECTOR_EXTENSIONS", "cpu_description", "resident_bytes"]
