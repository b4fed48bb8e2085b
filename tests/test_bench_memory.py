"""The benches' reading of a process's resident memory (``bench/_fleetproc.py``'s ``memory_mb``).

The benches print these figures beside llama-server's; a process that has gone must not read as
0 MB in such a table.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from twisted.trial import unittest


def _fleetproc() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "bench" / "_fleetproc.py"
    spec = importlib.util.spec_from_file_location("_fleetproc_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class MemoryTests(unittest.TestCase):
    """``memory_mb`` reads VmRSS and VmHWM, and refuses to make up a figure."""

    def test_a_running_process_reads_its_resident_set_and_peak(self) -> None:
        """This process's figures are positive, and its peak is at least its resident set."""
        rss, peak = _fleetproc().memory_mb(os.getpid())
        self.assertGreater(rss, 1.0)
        self.assertGreaterEqual(peak, rss)

    def test_a_process_that_has_gone_raises(self) -> None:
        """A child that has exited and been reaped has no figures: an error, not 0 MB."""
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        with self.assertRaises(OSError):
            _fleetproc().memory_mb(child.pid)
