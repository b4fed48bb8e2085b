"""The grammar masks of a step's constrained lanes, computed while the step's forward pass runs
(docs/engine.md section 2.4).

A runner calls :meth:`MaskWorker.start` with the stages of the rows it will sample before it
starts the forward pass, and :meth:`MaskPending.wait` once the logits are there.  The masks are
computed on one thread of this worker's own, by the grammar library's parallel call, which
releases the GIL: the forward pass (torch releases it too) and the masks share the step's time
instead of adding up.  Every matcher is touched by one thread at a time: the mask thread reads
it between ``start`` and ``wait``, the runner's thread advances it after ``wait``.

The worker keeps two cumulative figures for the metrics and benchmarks: the seconds spent
computing masks, and the seconds steps waited for them after their forward pass.

This module must never import torch, touch a model, or call the reactor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from numpy.typing import NDArray

from sfnode.constraint import LaneStage, MaskFiller, Matcher, Vocabulary


class MaskPending:
    """The masks of one step, being computed (or None to wait for: no row is constrained)."""

    def __init__(self, worker: MaskWorker, future: Future[NDArray[np.int32]] | None) -> None:
        self._worker = worker
        self._future = future

    def wait(self) -> NDArray[np.int32] | None:
        """The bitmask, one row per sampled row (every token allowed in unconstrained rows),
        or None when no row is constrained.  Raises what computing it raised."""
        if self._future is None:
            return None
        started = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self._worker.add_wait(time.perf_counter() - started)


class MaskWorker:
    """One thread that computes steps' masks for a vocabulary (see the module)."""

    def __init__(self, vocabulary: Vocabulary, *, threads: int = 1) -> None:
        self.vocabulary = vocabulary
        self._filler = MaskFiller(vocabulary, threads=threads)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sfnode-masks")
        self._lock = threading.Lock()
        self._computing = 0.0
        self._waiting = 0.0
        self._masks = 0

    def start(self, stages: Sequence[LaneStage | None]) -> MaskPending:
        """Start computing the masks of the rows whose stages have a grammar."""
        matchers: list[tuple[Matcher, int]] = [
            (stage.matcher, row)
            for row, stage in enumerate(stages)
            if stage is not None and stage.matcher is not None
        ]
        if not matchers:
            return MaskPending(self, None)
        return MaskPending(self, self._pool.submit(self._fill, matchers, len(stages)))

    def _fill(self, matchers: list[tuple[Matcher, int]], rows: int) -> NDArray[np.int32]:
        started = time.perf_counter()
        masks = self._filler.fill(matchers, rows)
        with self._lock:
            self._computing += time.perf_counter() - started
            self._masks += len(matchers)
        return masks

    def add_wait(self, seconds: float) -> None:
        with self._lock:
            self._waiting += seconds

    def figures(self) -> tuple[int, float, float]:
        """(masks computed, seconds computing them, seconds steps waited for them)."""
        with self._lock:
            return self._masks, self._computing, self._waiting

    def stop(self) -> None:
        """Let the thread go once the masks under way are done."""
        self._pool.shutdown(wait=False)
