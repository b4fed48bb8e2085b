"""The head's queue of generations waiting for a node: its bounds, its timeout and its
dispatch loop (docs/protocol.md section 8.5), apart from the fleet that places them.

:class:`WaitQueue` admits a waiter or refuses it (the queue's bound, a client address's
bound), starts its timeout on the clock it is given (held past it while ``hold()`` says a node
may still be starting), hands the waiters to the fleet's
``place`` in fair order (:class:`~sfnode.head.fleet.fair_queue.FairQueue`) whenever the fleet asks
it to dispatch, and settles each waiter exactly once: placed, refused, timed out, cancelled or
dropped when the head stops.

This module must never decide placement (the fleet's ``place`` does), never touch a link,
and never use the global reactor: the clock is a parameter, so it is tested on a ``Clock``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime

from sfnode.head.fleet.backend import ClientQueueFull, NoNodeAvailable, QueueFull
from sfnode.head.fleet.fair_queue import FairQueue

_R = TypeVar("_R")


@dataclass(eq=False)
class Waiter(Generic[_R]):
    """One request waiting: what it is (``request``, for the fleet), whose share it takes,
    and the Deferred that settles it."""

    request: Any
    share: Hashable
    address: str = ""
    """The client's address ("" for a program's own generations: no per-address bound)."""
    placed: Deferred[_R] = field(default_factory=Deferred)
    timer: IDelayedCall | None = None
    reason: str = ""
    """Why it waits (the last decision), for the timeout's message."""
    settled: bool = False
    priority: bool = False
    """It waits ahead of every share (a failover)."""
    rank: int = 0
    """Its class's rank: waiters of a lower rank go first (0 interactive, 1 batch, 2
    background)."""
    held: bool = False
    """Its timeout came while a node was still starting, and it waited on for that node."""


class WaitQueue(Generic[_R]):
    """Waiters in fair order with their bounds and timeouts; settles each exactly once.

    ``place(waiter)`` is the fleet's placement: it settles the waiter (through :meth:`settle`)
    and returns True, or records why it waits in ``waiter.reason`` and returns False.
    ``why(waiter)`` says why a waiter cannot be placed now, for a refusal's message.
    """

    def __init__(
        self,
        clock: IReactorTime,
        place: Callable[[Waiter[_R]], bool],
        why: Callable[[Waiter[_R]], str],
        *,
        max_queued: int,
        max_client_queued: int,
        timeout_s: float,
        use: Callable[[Hashable], float] | None = None,
        still_waiting: Callable[[list[Waiter[_R]]], None] | None = None,
        hold: Callable[[], float] | None = None,
    ) -> None:
        self.clock = clock
        self.max_queued = max_queued
        """Waiters that may wait at once (failovers go past it)."""
        self.max_client_queued = max_client_queued
        """Waiters one client address may have (0: no bound but ``max_queued``)."""
        self.timeout_s = timeout_s
        """How long a waiter waits before it fails (0: as long as it takes)."""
        self.rejected = 0
        """Waiters refused at once because a bound was reached."""
        self.timeouts = 0
        """Waiters that waited ``timeout_s`` in vain."""
        self._place = place
        self._why = why
        self._fair: FairQueue[Waiter[_R]] = FairQueue(use=use)
        self._hold = hold
        """Seconds a waiter whose timeout is due waits on: the fleet's nodes that have not
        answered yet may still be starting (0: none is)."""
        self._still_waiting = still_waiting
        """Told, after each dispatch, who still waits (in fair order, failovers left out):
        the fleet takes lanes back for them (:mod:`sfnode.head.fleet.shares`)."""
        self._dispatching = False
        self._again = False

    def __len__(self) -> int:
        return len(self._fair)

    def __bool__(self) -> bool:
        return bool(self._fair)

    def __iter__(self) -> Iterator[Waiter[_R]]:
        """The waiters, in no particular order (for counts by model)."""
        return iter(self._fair)

    def waiter(self, request: Any, share: Hashable, address: str = "") -> Waiter[_R]:
        """A new waiter whose ``placed`` Deferred, when cancelled, takes it out of the
        queue."""
        waiter: Waiter[_R] = Waiter(request, share, address)
        waiter.placed = Deferred(lambda _: self._leave(waiter))
        return waiter

    def refusal(self, waiter: Waiter[_R]) -> QueueFull | None:
        """Why ``waiter`` may not wait (the queue is full, or its address holds its share),
        counted as a rejection; None: it may."""
        if len(self._fair) >= self.max_queued:
            self.rejected += 1
            return QueueFull(
                f"no node can take the request now ({self._why(waiter)}) and "
                f"the queue is full ({self.max_queued} generations may wait)"
            )
        limit = self.max_client_queued
        if waiter.address and limit and self._fair.waiting_of(waiter.address) >= limit:
            self.rejected += 1
            return ClientQueueFull(waiter.address, limit)
        return None

    def wait(self, waiter: Waiter[_R], *, priority: bool = False, front: bool = False) -> None:
        """Queue ``waiter`` (a ``priority`` one ahead of every share; a ``front`` one ahead
        of its own share's line) with its timeout, and dispatch."""
        if self.timeout_s > 0:
            waiter.timer = self.clock.callLater(self.timeout_s, self._expire, waiter)
        waiter.priority = priority
        self._fair.push(waiter, waiter.share, waiter.address, priority=priority, front=front)
        self.dispatch()

    def served(self, waiter: Waiter[_R]) -> None:
        """``waiter`` got a lane: its share goes to the back of the round robin."""
        self._fair.served(waiter.share)

    def dispatch(self) -> None:
        """Offer every waiter to ``place``, in fair order: failovers first, then the clients
        by class and fair share (:meth:`order`); then tell ``still_waiting`` who waits."""
        if self._dispatching:
            # Settling a waiter runs its generation, which may free a lane right here: go
            # round once more when this pass is done.
            self._again = True
            return
        self._dispatching = True
        try:
            self._again = True
            while self._again:
                self._again = False
                for waiter in self.order():
                    if not waiter.settled:
                        self._place(waiter)
                if not self._again and self._still_waiting is not None and self._fair:
                    waiting = [w for w in self.order() if not w.priority]
                    if waiting:
                        self._still_waiting(waiting)
        finally:
            self._dispatching = False

    def order(self) -> list[Waiter[_R]]:
        """The waiters in the order lanes go to them: failovers, then by class (interactive,
        batch, background), each class in the fair order of :meth:`FairQueue.order`."""
        return sorted(self._fair.order(), key=lambda w: -1 if w.priority else w.rank)

    def settle(self, waiter: Waiter[_R], result: _R | Exception) -> None:
        """Fire ``waiter.placed`` with ``result`` (an exception fails it); once only."""
        if waiter.settled:
            return
        self._leave(waiter)
        if isinstance(result, Exception):
            waiter.placed.errback(result)
        else:
            waiter.placed.callback(result)

    def clear(self, error: Exception) -> None:
        """Fail every waiter with ``error`` (the head is stopping)."""
        for waiter in self._fair.clear():
            self.settle(waiter, error)

    def _leave(self, waiter: Waiter[_R]) -> None:
        waiter.settled = True
        self._fair.remove(waiter)
        if waiter.timer is not None and waiter.timer.active():
            waiter.timer.cancel()
        waiter.timer = None

    def _expire(self, waiter: Waiter[_R]) -> None:
        waiter.timer = None
        held = self._hold() if self._hold is not None else 0.0
        if held > 0:
            waiter.held = True
            waiter.timer = self.clock.callLater(held, self._expire, waiter)
            return
        self.timeouts += 1
        starting = ", nor while a node it dials was starting" if waiter.held else ""
        self.settle(
            waiter,
            NoNodeAvailable(
                f"no node could take the request within {self.timeout_s:g} s{starting} "
                f"({self._why(waiter)})"
            ),
        )


__all__ = ["WaitQueue", "Waiter"]
