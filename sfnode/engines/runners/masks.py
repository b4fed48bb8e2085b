"""The grammar masks of a step's constrained lanes, computed while the step's forward pass runs
(docs/engine.md section 2.4).

A runner calls :meth:`MaskWorker.start` with the stages of the rows it will sample before it
starts the forward pass, and :meth:`MaskPending.wait` once the logits are there.  The masks are
computed on one thread of this worker's own, by the grammar library's parallel call, which
releases the GIL: the forward pass (torch releases it too) and the masks share the step's time
instead of adding up.  Every matcher is touched by one thread at a time: the mask thread reads
it between ``start`` and ``wait``, the runner's thread advances it after ``wait``.

A row that verifies a draft (docs/engine.md section 3.1) needs the mask of its grammar after
the drafted tokens fed before it: the mask thread consumes those tokens in order, filling each
depth's rows of all lanes in one call, stops a lane's chain at the first drafted token its mask
forbids (or an EOS id, after which the lane ends), and takes every consumed token back before
the masks are handed over, so the matcher is where the lane stands when the runner samples.
Rows past a broken chain are left all ones: the sampler never reaches them, since the token
drawn before them cannot be the forbidden one.

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

from sfnode.decoding.constraint import LaneStage, MaskFiller, Matcher, Vocabulary


def _allows(masks: NDArray[np.int32], row: int, token: int) -> bool:
    """Whether bit ``token`` of mask row ``row`` is set."""
    return bool((int(masks[row, token // 32]) >> (token % 32)) & 1)


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

    def start(
        self,
        stages: Sequence[LaneStage | None],
        drafts: Sequence[tuple[int, ...]] | None = None,
    ) -> MaskPending:
        """Start computing the masks of the rows whose stages have a grammar; ``drafts`` gives
        per row the drafted tokens fed before it (a lane's rows in order, the first with
        none; see the module docstring)."""
        prefixes = drafts if drafts is not None else [()] * len(stages)
        rows: list[tuple[Matcher, int, tuple[int, ...]]] = [
            (stage.matcher, row, prefix)
            for row, (stage, prefix) in enumerate(zip(stages, prefixes, strict=True))
            if stage is not None and stage.matcher is not None
        ]
        if not rows:
            return MaskPending(self, None)
        return MaskPending(self, self._pool.submit(self._fill, rows, len(stages)))

    def _fill(
        self, rows: list[tuple[Matcher, int, tuple[int, ...]]], count: int
    ) -> NDArray[np.int32]:
        started = time.perf_counter()
        masks = self.vocabulary.new_masks(count)
        by_depth: dict[int, list[tuple[Matcher, int, tuple[int, ...]]]] = {}
        for entry in rows:
            by_depth.setdefault(len(entry[2]), []).append(entry)
        eos = self.vocabulary.eos_ids
        consumed: dict[int, tuple[Matcher, int]] = {}
        """Per matcher (by id): the matcher and the drafted tokens it consumed here."""
        last_row: dict[int, tuple[int, int]] = {}
        """Per matcher: the depth and row of its deepest mask filled so far."""
        filled = 0
        try:
            for depth in sorted(by_depth):
                batch: list[tuple[Matcher, int]] = []
                for matcher, row, prefix in by_depth[depth]:
                    key = id(matcher)
                    if depth:
                        before = last_row.get(key)
                        token = prefix[-1]
                        # The chain holds while each drafted token is allowed where it is fed.
                        if (
                            before is None
                            or before[0] != depth - 1
                            or token in eos
                            or not _allows(masks, before[1], token)
                        ):
                            continue
                        matcher.consume(token)
                        consumed[key] = (matcher, consumed.get(key, (matcher, 0))[1] + 1)
                    batch.append((matcher, row))
                    last_row[key] = (depth, row)
                self._filler.fill(batch, count, into=masks)
                filled += len(batch)
        finally:
            for matcher, tokens in consumed.values():
                matcher.rollback(tokens)
        with self._lock:
            self._computing += time.perf_counter() - started
            self._masks += filled
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
