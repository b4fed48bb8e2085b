"""The one build step of sfnode besides copying files (everything else is in pyproject.toml): the
wheel carries sfnode's native kernels compiled, so that a machine without a C compiler (the
slim container image) still gets them (docs/engine.md section 5.1).

The compile is :mod:`sfnode.engines.kernels.native_build`'s, the node's own, loaded here by its
path (neither sfnode nor torch is importable while a wheel builds).  Only on x86-64, and only
where a C compiler is found: elsewhere the wheel is built without it and a node there compiles
at its first start, or logs a WARNING that it cannot.  An editable install builds nothing (the
checkout compiles at first use).  This file must never import sfnode or decide anything from the
building machine's CPU.
"""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path
from types import ModuleType

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
KERNELS = Path("sfnode", "engines", "kernels")


def _native_build() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "sfnode_native_build", ROOT / KERNELS / "native_build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _builds_native() -> bool:
    """Whether this build compiles the library: x86-64 with a C compiler."""
    return platform.machine().lower() in ("x86_64", "amd64") and (
        _native_build().compiler() is not None
    )


class BuildWithNative(build_py):
    """``build_py``, then the native library into the built package's ``prebuilt/`` folder."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        if not _builds_native():
            self.announce(
                "sfnode: no native library in this build (not x86-64, or no C compiler found); "
                "nodes installed from it compile it at first start or log why they cannot",
                level=3,
            )
            return
        build = _native_build()
        folder = Path(self.build_lib) / KERNELS / build.SHIPPED_FOLDER
        text = build.source()
        reason = build.compile_library(build.compiler(), text, folder / build.shipped_name(text))
        if reason is not None:
            raise RuntimeError(f"sfnode: the native library did not build: {reason}")


class PlatformDistribution(Distribution):
    """A wheel that carries a compiled library is tagged for this platform, not ``any``."""

    def has_ext_modules(self) -> bool:
        return _builds_native()


setup(cmdclass={"build_py": BuildWithNative}, distclass=PlatformDistribution)
