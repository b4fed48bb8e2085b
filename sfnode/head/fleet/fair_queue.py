"""The head's queue of requests waiting for a lane, served fairly across clients
(docs/protocol.md section 8.5).

One client's backlog must not decide when another client is served.  :class:`FairQueue` keeps
one FIFO per *share* (a client: its API key, else its address) and gives the next free lane to
the share that uses fewest lanes per unit of its weight (the fleet's
:class:`~sfnode.head.fleet.shares.ShareLedger` says, given as ``use``), ties to the share served
least recently, round robin: a second client waits for the next lane that frees, not for the
first client's backlog.  Failovers (``priority``) go ahead of every share:
their clients are mid-answer.  It also counts what each client address holds, for the head's
per-address bound (``--max-client-queued``).

This module is pure: no reactor, no clock, no I/O; it never decides placement (the fleet tries
the waiters in the order given here) and never drops an item it was not told to remove.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

_T = TypeVar("_T", bound=Hashable)

SERVED_MEMORY = 4096
"""How many shares' last service the queue remembers; a share forgotten counts as never
served (it was served longer ago than all the others remembered)."""


@dataclass(frozen=True, slots=True)
class _Place:
    share: Hashable | None
    """None: a priority item."""
    address: str


@dataclass(eq=False)
class FairQueue(Generic[_T]):
    """Items waiting, per share, with round robin across shares (least recently served
    first) and priority items ahead of all."""

    memory: int = SERVED_MEMORY
    use: Callable[[Hashable], float] | None = None
    """Lanes a share holds per unit of its weight (None: every share counts alike)."""
    _priority: deque[_T] = field(default_factory=deque, init=False)
    _shares: dict[Hashable, deque[_T]] = field(default_factory=dict, init=False)
    """Each share's waiting items, in arrival order; shares in the order they started
    waiting (the tie-break between shares never served)."""
    _places: dict[_T, _Place] = field(default_factory=dict, init=False)
    _addresses: Counter[str] = field(default_factory=Counter, init=False)
    _served: OrderedDict[Hashable, int] = field(default_factory=OrderedDict, init=False)
    _ticks: itertools.count[int] = field(default_factory=itertools.count, init=False)

    def __len__(self) -> int:
        return len(self._places)

    def __bool__(self) -> bool:
        return bool(self._places)

    def __contains__(self, item: object) -> bool:
        return item in self._places

    def __iter__(self) -> Iterator[_T]:
        return iter(self.order())

    def push(
        self,
        item: _T,
        share: Hashable,
        address: str = "",
        *,
        priority: bool = False,
        front: bool = False,
    ) -> None:
        """``item`` waits: at the end of ``share``'s line (at its front when ``front``: a
        generation that gave its lane back and resumes), or ahead of everything when
        ``priority`` (a failover; newest first, as the fleet always did)."""
        if item in self._places:
            raise ValueError(f"{item!r} is already waiting")
        if priority:
            self._priority.appendleft(item)
            self._places[item] = _Place(None, address)
        else:
            line = self._shares.setdefault(share, deque())
            if front:
                line.appendleft(item)
            else:
                line.append(item)
            self._places[item] = _Place(share, address)
        if address:
            self._addresses[address] += 1

    def remove(self, item: _T) -> bool:
        """Take ``item`` out (placed, refused, timed out or cancelled); False if it was not
        waiting."""
        place = self._places.pop(item, None)
        if place is None:
            return False
        if place.share is None:
            self._priority.remove(item)
        else:
            line = self._shares[place.share]
            line.remove(item)
            if not line:
                del self._shares[place.share]
        if place.address:
            self._addresses[place.address] -= 1
            if self._addresses[place.address] <= 0:
                del self._addresses[place.address]
        return True

    def served(self, share: Hashable) -> None:
        """``share`` was given a lane now (from the queue or at once): it goes to the back of
        the rotation."""
        self._served[share] = next(self._ticks)
        self._served.move_to_end(share)
        while len(self._served) > self.memory:
            self._served.popitem(last=False)

    def waiting_of(self, address: str) -> int:
        """How many items ``address`` has waiting (priority ones included)."""
        return self._addresses.get(address, 0)

    def order(self) -> list[_T]:
        """Every waiting item in the order lanes should go to them: priority items, then the
        shares by the lanes they use (fewest per unit of weight first), ties round robin,
        least recently served first (each share's first item, then each share's second,
        ...), each share in arrival order."""
        use = self.use

        def rank(share: Hashable) -> tuple[float, int]:
            return (use(share) if use is not None else 0.0, self._served.get(share, -1))

        shares = sorted(self._shares, key=rank)
        rounds = itertools.zip_longest(*(self._shares[share] for share in shares))
        fair = [item for round_ in rounds for item in round_ if item is not None]
        return [*self._priority, *fair]

    def clear(self) -> list[_T]:
        """Empty the queue; the items that waited, in order."""
        items = self.order()
        self._priority.clear()
        self._shares.clear()
        self._places.clear()
        self._addresses.clear()
        return items


__all__ = ["SERVED_MEMORY", "FairQueue"]
