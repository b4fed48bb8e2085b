"""How sfnode's native library is compiled: its C source (``native.c`` beside this module), the
flags, the C compiler looked for, the compile itself, and the name of the build a wheel ships
(docs/engine.md section 5.1).

Two builders use it, so that they cannot drift apart: the node, which compiles the library at
its first start into a cache folder (:mod:`sfnode.engines.kernels.native`), and the wheel build
(``setup.py``), which compiles it once into the wheel for machines that have no C compiler (a
slim container image).  The flags do not depend on the machine that builds: a baseline x86-64
with AVX2, FMA and F16C, so one build runs on every CPU that has those three, and the loader
checks them before it loads anything.

Imports only the standard library: ``setup.py`` loads this file by its path, where neither torch
nor sfnode is installed.  It must never load the library, never decide from the building
machine's CPU, and never leave a half-written library where a loader would find it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

NEEDED_FLAGS = frozenset({"avx2", "fma", "f16c"})
"""CPU flags (as /proc/cpuinfo spells them) the kernel's instructions need."""

COMPILE_FLAGS = (
    "-O3",
    "-march=x86-64",
    "-mavx2",
    "-mfma",
    "-mf16c",
    "-fopenmp",
    "-shared",
    "-fPIC",
)
"""The same on every machine: the baseline x86-64 (whatever the compiler's own default) plus the
three extensions of :data:`NEEDED_FLAGS`, never ``-march=native``."""

SOURCE_FILE = Path(__file__).with_name("native.c")
SHIPPED_FOLDER = "prebuilt"
"""The folder beside this module where a wheel carries its build (no ``__init__.py``: data)."""


def source() -> str:
    """The library's C source."""
    return SOURCE_FILE.read_text()


def compiler() -> str | None:
    """The C compiler to build with: ``$CC``, Python's own, ``cc``, ``gcc`` or ``clang``."""
    candidates = [os.environ.get("CC", ""), str(sysconfig.get_config_var("CC") or "")]
    candidates += ["cc", "gcc", "clang"]
    for candidate in candidates:
        name = candidate.split()[0] if candidate.strip() else ""
        if name and shutil.which(name):
            return name
    return None


def shipped_name(text: str) -> str:
    """The file name of the build of source ``text`` that a wheel ships: a hash of the source and
    the flags, so that a loader never takes a build of another source."""
    key = "\n".join([text, " ".join(COMPILE_FLAGS)])
    return f"sfnode-native-avx2-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def compile_library(cc: str, text: str, path: Path, link_flags: Sequence[str] = ()) -> str | None:
    """Compiles source ``text`` with ``cc`` into ``path`` (atomically: built beside it under
    another name, then renamed, so two processes may race); None, or why it failed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".sfnode-q4-", dir=path.parent))
    try:
        source_file = work / "native.c"
        source_file.write_text(text)
        output = work / path.name
        command = [cc, *COMPILE_FLAGS, str(source_file), "-o", str(output), "-lm", *link_flags]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            return f"{cc} failed to run: {e}"
        if done.returncode != 0 or not output.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return f"{cc} could not build the kernel: {last}"
        os.replace(output, path)
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)


__all__ = [
    "COMPILE_FLAGS",
    "NEEDED_FLAGS",
    "SHIPPED_FOLDER",
    "SOURCE_FILE",
    "compile_library",
    "compiler",
    "shipped_name",
    "source",
]
