"""What the head's HTTP layer runs off the reactor, shared fairly between clients, and how long
the reactor itself stalls.

:class:`Workers` is a small thread pool of the HTTP layer's own (never the reactor's shared one)
for the work whose cost grows with a request's content: parsing and translating a large body,
rendering a chat template, tokenizing, compiling a grammar.  Each job belongs to a client (its
API key, else its address) and waits in that client's queue; the queues are served round robin,
so one client's backlog never delays another's next job by more than one job.  At most
``size`` jobs run at once within their budget, but a client with nothing running may always
start one (up to ``max_threads`` threads in all), and no client runs more than ``size`` jobs
at once, those past their budget included: one client's queue cannot starve another's.

A job may have a time budget: when it passes, its caller gets the refusal it named (a 400 that
names the limit) at once, on the reactor.  Its thread cannot be stopped (a grammar library's
compile is one native call): it runs on, still counted against its client, and its result is
dropped.  The worker threads run at a lower scheduling priority than the reactor's.

:class:`StallProbe` measures the reactor's own stalls: a timer every 20 ms notes how late it
fires; the longest stall since start and the count of those over 50 ms are in ``/metrics``
(``sfhead_reactor_stall_seconds_max``, ``sfhead_reactor_stalls_total``).

This module must never run a job on the reactor's thread (except through an injected
``start``, in tests), never block the reactor, and never deliver a job's result after its
refusal.
"""

from __future__ import annotations

import gc
import os
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from twisted.application import service
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.python.threadpool import ThreadPool

from sfnode.linkf.heap import trim_heap
from sfnode.runtime.http_guard import HttpError

WORKER_THREADS = 2
"""Jobs that run at once within their budget (and the most one client runs at once)."""
MAX_WORKER_THREADS = 8
"""Threads in all: those of jobs past their budget, and one for each client that had none."""
WORKER_NICE = 10
"""The scheduling priority of the worker threads (the reactor's thread keeps its own)."""
PROBE_INTERVAL_S = 0.02
STALL_S = 0.05
"""A stall of the reactor counted in ``sfhead_reactor_stalls_total``."""

_log = Logger(namespace="sfnode.head.api.http")
_T = TypeVar("_T")
Start = Callable[[Callable[[], Any]], "Deferred[Any]"]
"""Runs a callable on a thread and fires with its result, on the reactor."""


def lower_priority() -> None:
    """Give this thread (a worker) a lower scheduling priority than the reactor's (Linux: a
    thread's nice value is its own).  A grammar's compile runs in native code without the
    interpreter's lock: at the same priority, two of them on two cores delay the reactor's
    thread by whole time slices."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICE)
    except (AttributeError, OSError):
        pass  # another system, or not permitted: the same priority as the reactor's


@dataclass(eq=False)
class _Job:
    work: Callable[[], Any]
    client: Hashable
    budget_s: float | None
    refusal: Callable[[], HttpError] | None
    done: Deferred[Any] = field(default_factory=Deferred)
    timer: IDelayedCall | None = None
    over: bool = False
    """Past its budget: refused, its thread still running."""


class Workers:
    """The HTTP layer's worker threads, shared fairly between clients (see the module)."""

    def __init__(
        self,
        reactor: Any,
        size: int = WORKER_THREADS,
        *,
        max_threads: int = MAX_WORKER_THREADS,
        start: Start | None = None,
    ) -> None:
        self._reactor = reactor
        self.size = size
        self.max_threads = max(max_threads, size)
        self._start = start if start is not None else self._on_a_thread
        self._pool: ThreadPool | None = None
        self._queues: OrderedDict[Hashable, deque[_Job]] = OrderedDict()
        self.running: Counter[Hashable] = Counter()
        """Jobs running per client, those past their budget included."""
        self.busy = 0
        """Threads running a job."""
        self.within = 0
        """Jobs running within their budget."""

    def run(
        self,
        work: Callable[[], _T],
        client: Hashable = "",
        *,
        budget_s: float | None = None,
        refusal: Callable[[], HttpError] | None = None,
    ) -> Deferred[_T]:
        """``work()`` on a worker thread, in ``client``'s turn; past ``budget_s`` seconds of
        running, the Deferred fails with ``refusal()`` (and the result is dropped)."""
        job = _Job(work, client, budget_s, refusal)
        self._queues.setdefault(client, deque()).append(job)
        self._dispatch()
        return job.done

    def queued(self) -> int:
        """Jobs waiting for a thread."""
        return sum(len(q) for q in self._queues.values())

    def _may_start(self, client: Hashable) -> bool:
        running = self.running[client]
        return (
            self.busy < self.max_threads
            and running < self.size
            and (self.within < self.size or running == 0)
        )

    def _dispatch(self) -> None:
        """Start every job that may start now, one per client per round, round robin."""
        started = True
        while started:
            started = False
            for client in list(self._queues):
                if not self._may_start(client):
                    continue
                queue = self._queues.pop(client)
                job = queue.popleft()
                if queue:
                    self._queues[client] = queue  # to the end of the round
                self._begin(job)
                started = True

    def _begin(self, job: _Job) -> None:
        self.running[job.client] += 1
        self.busy += 1
        self.within += 1
        if job.budget_s is not None:
            job.timer = self._reactor.callLater(job.budget_s, self._over, job)
        self._start(job.work).addBoth(self._ended, job)

    def _over(self, job: _Job) -> None:
        job.timer = None
        job.over = True
        self.within -= 1
        refusal = job.refusal() if job.refusal is not None else HttpError(400, "over budget")
        job.done.errback(refusal)
        self._dispatch()

    def _ended(self, result: object, job: _Job) -> None:
        self.running[job.client] -= 1
        if not self.running[job.client]:
            del self.running[job.client]
        self.busy -= 1
        if job.over:
            if isinstance(result, Failure):
                _log.info(
                    "a job past its budget failed on its own: {error}",
                    error=result.getErrorMessage(),
                )
        else:
            self.within -= 1
            if job.timer is not None and job.timer.active():
                job.timer.cancel()
            if isinstance(result, Failure):
                job.done.errback(result)
            else:
                job.done.callback(result)
        self._dispatch()

    def _on_a_thread(self, work: Callable[[], _T]) -> Deferred[_T]:
        """``work()`` on this pool's threads; the C heap is trimmed after it."""
        from twisted.internet.threads import deferToThreadPool

        if self._pool is None:
            self._pool = ThreadPool(minthreads=0, maxthreads=self.max_threads, name="sfhead-text")
            self._pool.start()

        def run_then_trim() -> _T:
            lower_priority()
            try:
                return work()
            finally:
                trim_heap()

        return deferToThreadPool(self._reactor, self._pool, run_then_trim)

    def stop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()


class StallProbe(service.Service):
    """How late the reactor runs a timer due every :data:`PROBE_INTERVAL_S` (see the
    module); a service, started with the head."""

    def __init__(self, clock: IReactorTime, interval_s: float = PROBE_INTERVAL_S) -> None:
        self._clock = clock
        self._interval_s = interval_s
        self._call: LoopingCall | None = None
        self._last: float | None = None
        self.longest = 0.0
        """The longest stall since start, in seconds."""
        self.stalls = 0
        """Stalls of more than :data:`STALL_S`."""

    def startService(self) -> None:
        """Start probing; the objects alive now (the head as it started: its modules, its
        tokenizers) are left out of the garbage collector's full passes from now on, each of
        which otherwise holds every thread, the reactor's included, for tens of ms."""
        super().startService()  # type: ignore[no-untyped-call]
        gc.freeze()
        call = self._call = LoopingCall(self._tick)
        call.clock = self._clock
        self._last = self._clock.seconds()
        call.start(self._interval_s, now=False)

    def stopService(self) -> Deferred[None] | None:
        call, self._call = self._call, None
        if call is not None and call.running:
            call.stop()
        return super().stopService()  # type: ignore[no-untyped-call,no-any-return]

    def _tick(self) -> None:
        now = self._clock.seconds()
        if self._last is not None:
            late = now - self._last - self._interval_s
            self.longest = max(self.longest, late)
            if late > STALL_S:
                self.stalls += 1
        self._last = now

    def families(self) -> list[Metric]:
        """The probe's figures for ``/metrics``."""
        return [
            GaugeMetricFamily(
                "sfhead_reactor_stall_seconds_max",
                "The longest time the head's reactor ran late since start (one turn that "
                "blocked it).",
                value=self.longest,
            ),
            CounterMetricFamily(
                "sfhead_reactor_stalls",
                f"Times the head's reactor ran more than {STALL_S:g} s late.",
                value=self.stalls,
            ),
        ]


__all__ = [
    "MAX_WORKER_THREADS",
    "WORKER_THREADS",
    "StallProbe",
    "Workers",
]
