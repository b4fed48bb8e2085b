"""One OpenMP team that spins: the reactor thread's threads are given back when an engine starts.

torch runs the parallel parts of its CPU kernels on OpenMP (GNU libgomp in the PyPI wheels).
Every thread that starts a parallel region gets a team of helper threads of its own, and the team
stays after the region ends. A node loads its model on the reactor thread, which leaves that
thread a team; the engine's worker thread then makes a second one for the steps. libgomp counts
the threads of all teams, and when they outnumber the CPUs it lets an idle helper spin only 100
times (instead of 300,000) before it sleeps in the kernel, so every parallel region of a step
has to wake its helpers with a system call. Measured on the 2-core machines this project runs
on: the int4 product of one decode row takes 28 us on a thread whose team is alone and 80 us on
the worker beside the loader's team, and a whole SmolLM2 decode step 11 ms against 25 ms.

:func:`release_team` asks the OpenMP runtime to let go of the calling thread's team (OpenMP 5.0's
``omp_pause_resource_all`` with ``omp_pause_soft``); the thread keeps working, and a later
parallel region on it makes a new team. The engine calls it on the thread that starts it, before
its worker runs a step. It changes no result, only which threads exist; where the runtime cannot
be found (another platform, a torch built without OpenMP) nothing happens and the reason is
returned for the log.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

# OpenMP runtimes torch builds link, by file name prefix: GNU, Intel, LLVM.
_RUNTIMES = ("libgomp", "libiomp5", "libomp")
_OMP_PAUSE_SOFT = 1


def loaded_runtimes(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    found: list[str] = []
    for line in lines:
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if os.path.basename(path).startswith(_RUNTIMES) and path not in found:
            found.append(path)
    return found


def release_team() -> str:
    """Release the calling thread's OpenMP team in every runtime loaded; say what was done."""
    runtimes = loaded_runtimes()
    if not runtimes:
        return "no OpenMP runtime found in this process"
    done: list[str] = []
    for path in runtimes:
        try:
            library = ctypes.CDLL(path)
        except OSError as e:
            done.append(f"{os.path.basename(path)}: cannot open ({e})")
            continue
        pause = getattr(library, "omp_pause_resource_all", None)
        if pause is None:
            done.append(f"{os.path.basename(path)}: no omp_pause_resource_all")
            continue
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        status = pause(_OMP_PAUSE_SOFT)
        done.append(
            f"{os.path.basename(path)}: released"
            if status == 0
            else f"{os.path.basename(path)}: refused (status {status})"
        )
    return "; ".join(done)


__all__ = ["loaded_runtimes", "release_team"]
