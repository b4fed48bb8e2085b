"""The starting thread's OpenMP team is given back (sfnode/engines/kernels/openmp.py, docs/engine.md
section 6): its helper threads end, work on the thread goes on, and an engine does it when it
starts."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
from twisted.internet import reactor
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial import unittest

from sfnode.engines.config import EngineConfig
from sfnode.engines.kernels import openmp
from sfnode.engines.transformers_engine import TransformersEngine
from tests.tinymodel import tiny_llama

TASKS = Path("/proc/self/task")


def thread_count() -> int:
    return len(os.listdir(TASKS))


class MapsTests(unittest.SynchronousTestCase):
    def test_runtimes_are_read_from_the_mapped_files(self) -> None:
        maps = Path(self.mktemp())
        maps.write_text(
            "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n"
            "7f10-7f20 r-xp 00000000 08:01 2 /site/torch/lib/libgomp.so.1\n"
            "7f20-7f30 r--p 00001000 08:01 2 /site/torch/lib/libgomp.so.1\n"
            "7f30-7f40 rw-p 00000000 00:00 0\n"
            "7f40-7f50 r-xp 00000000 08:01 3 /opt/intel/libiomp5.so\n"
            "7f50-7f60 r-xp 00000000 08:01 4 /opt/my libs/libomp.so\n"
        )
        self.assertEqual(
            openmp.loaded_runtimes(maps),
            ["/site/torch/lib/libgomp.so.1", "/opt/intel/libiomp5.so", "/opt/my libs/libomp.so"],
        )

    def test_no_maps_file_means_none(self) -> None:
        self.assertEqual(openmp.loaded_runtimes(Path(self.mktemp())), [])


class ReleaseTests(unittest.SynchronousTestCase):
    def setUp(self) -> None:
        if not TASKS.is_dir() or not openmp.loaded_runtimes():
            raise unittest.SkipTest("needs Linux and torch built with OpenMP")

    def test_the_team_ends_and_the_thread_works_on(self) -> None:
        """A thread that ran a parallel region on 2 threads has a helper; releasing its team
        ends the helper, and the next parallel result is the same."""
        seen: dict[str, object] = {}
        data = torch.arange(4_000_000, dtype=torch.float64)

        def work() -> None:
            torch.set_num_threads(2)
            seen["first"] = float(data.sum())
            seen["with team"] = thread_count()
            seen["said"] = openmp.release_team()
            deadline = time.monotonic() + 10
            while thread_count() >= seen["with team"] and time.monotonic() < deadline:  # type: ignore[operator]
                time.sleep(0.01)
            seen["released"] = thread_count()
            seen["again"] = float(data.sum())

        before = thread_count()
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        self.assertIn("released", str(seen["said"]))
        self.assertGreater(seen["with team"], before + 1)  # the worker and at least one helper
        self.assertLess(seen["released"], seen["with team"])  # type: ignore[operator]
        self.assertEqual(seen["again"], seen["first"])


class EngineTests(unittest.TestCase):
    def test_an_engine_releases_its_starting_threads_team(self) -> None:
        said: list[str] = []

        def keep(event: dict[str, object]) -> None:
            said.append(formatEvent(event))

        globalLogPublisher.addObserver(keep)
        self.addCleanup(globalLogPublisher.removeObserver, keep)
        engine = TransformersEngine(tiny_llama(), reactor, EngineConfig(max_lanes=1))
        engine.start()
        self.addCleanup(engine.stop)
        lines = [line for line in said if line.startswith("OpenMP threads of the starting thread")]
        self.assertEqual(len(lines), 1, said)
        if openmp.loaded_runtimes():
            self.assertIn("released", lines[0])
