"""Who holds the lanes, per client, and whose lane goes back when another client waits
(docs/protocol.md section 8.5, "Shares").

The queue (:mod:`sfnode.head.fleet.fair_queue`) decides who gets a lane that frees; this
ledger decides when a lane must be *taken back*.  Every generation that holds a lane is
recorded under its share (a client: its API key, else its address) with the share's weight.
A share's *use* is the lanes it holds over its weight.  When a client waits for a lane,
:meth:`ShareLedger.victim` names the newest generation of the share that uses most, if that
share would still use more than the waiting one after giving that lane up
(``held_v / w_v > (held_w + 1) / w_w``): weighted max-min fairness, reached one lane at a
time, and never a lane taken back only to be taken back again.  Lanes already on their way
(a generation told to yield whose node has not finished it yet) count for the share they go
to and no longer for the share that gives them, so one waiting client takes back one lane,
not one per dispatch.  Classes come first: a waiter takes the lane of the newest holder of a
later class (:meth:`ShareLedger.below`: interactive, batch, background) whatever the shares, and
never one of an earlier class; the share rule works within a class.

This module is pure: no reactor, no clock, no I/O.  It never cancels anything itself (the
fleet carries out what it names) and never chooses a node.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

_G = TypeVar("_G", bound=Hashable)

Claim = tuple[Hashable, float, Callable[[_G], bool], int]
"""A waiter's claim on a lane: its share, the share's weight, which running generations may
give it theirs, and its class's rank (0 interactive, 1 batch, 2 background)."""


@dataclass(slots=True)
class _Share(Generic[_G]):
    weight: float
    holding: dict[_G, None] = field(default_factory=dict)
    """The generations holding a lane, oldest first (a dict keeps insertion order)."""
    giving: int = 0
    """Of those, how many were told to yield and have not given their lane back yet."""
    coming: int = 0
    """Lanes other shares are giving back for this one."""

    @property
    def held(self) -> int:
        """Lanes held, counting those on their way in and not those on their way out."""
        return len(self.holding) - self.giving + self.coming


class ShareLedger(Generic[_G]):
    """The lanes each share holds, and the rule that takes one back."""

    def __init__(self) -> None:
        self._shares: dict[Hashable, _Share[_G]] = {}
        self._owner: dict[_G, Hashable] = {}
        self._yielding: dict[_G, Hashable | None] = {}
        """A generation told to yield, and the share its lane goes to."""
        self.reclaimed = 0
        """Lanes taken back (by :meth:`reclaim`) since the start."""
        self._ranks: dict[_G, tuple[int, int]] = {}
        """Each holder's class rank (0 interactive, higher later) and when it took its lane."""
        self._ticks = itertools.count()

    def hold(self, share: Hashable, weight: float, item: _G, rank: int = 0) -> None:
        """``item`` of ``share`` (whose weight is ``weight``; its class's rank ``rank``) took a
        lane."""
        entry = self._shares.get(share)
        if entry is None:
            entry = self._shares[share] = _Share(weight)
        entry.weight = weight
        entry.holding[item] = None
        self._owner[item] = share
        self._ranks[item] = (rank, next(self._ticks))

    def drop(self, item: _G) -> None:
        """``item`` gave its lane back (it ended, failed over or yielded)."""
        share = self._owner.pop(item, None)
        if share is None:
            return
        del self._ranks[item]
        entry = self._shares[share]
        del entry.holding[item]
        if item in self._yielding:
            entry.giving -= 1
            beneficiary = self._yielding.pop(item)
            if beneficiary is not None and beneficiary in self._shares:
                self._shares[beneficiary].coming -= 1
                self._forget(beneficiary)
        self._forget(share)

    def held(self, share: Hashable) -> int:
        """Lanes ``share`` holds (those on their way in counted, those leaving not)."""
        entry = self._shares.get(share)
        return entry.held if entry is not None else 0

    def use(self, share: Hashable) -> float:
        """Lanes held per unit of weight: who is served next when a lane frees (the least
        used share first).  Lanes on their way count for nobody here: one leaving is no
        longer its share's, and one coming is not the other's until it takes it (else a
        share waiting for a lane would come after the one giving it)."""
        entry = self._shares.get(share)
        if entry is None:
            return 0.0
        return (len(entry.holding) - entry.giving) / entry.weight

    def holding(self, share: Hashable) -> list[_G]:
        """The generations of ``share`` holding a lane, oldest first."""
        entry = self._shares.get(share)
        return list(entry.holding) if entry is not None else []

    def yielding(self, item: _G) -> bool:
        return item in self._yielding

    def below(self, rank: int, eligible: Callable[[_G], bool]) -> _G | None:
        """The ``eligible`` holder of a class ranked after ``rank`` that gives way first: of
        the last class, the newest (it delivered least: the least to compute again)."""
        found: _G | None = None
        best = (rank, -1)
        for item, ranked in self._ranks.items():
            if ranked > best and ranked[0] > rank and item not in self._yielding:
                if eligible(item):
                    found, best = item, ranked
        return found

    def victim(
        self, share: Hashable, weight: float, eligible: Callable[[_G], bool], rank: int = 0
    ) -> _G | None:
        """The generation that should give its lane to a waiter of ``share`` (weight
        ``weight``, class rank ``rank``): one of a later class (:meth:`below`), else the
        newest ``eligible`` one of its own class of the most used other share, when that
        share uses more than ``share`` would with one lane more; None: no lane is taken
        back."""
        lower = self.below(rank, eligible)
        if lower is not None:
            return lower
        wanted = (self.held(share) + 1) / weight
        for use, key in self._ranked(share):
            if use <= wanted:
                break
            entry = self._shares[key]
            for item in reversed(entry.holding):
                if item not in self._yielding and self._ranks[item][0] == rank and eligible(item):
                    return item
        return None

    def reclaim(self, claims: Iterable[Claim[_G]]) -> list[_G]:
        """For each waiter's claim, in the order lanes go to them, the generation that gives
        it a lane (:meth:`victim`), each marked as giving (:meth:`give`); a share for which
        none gives is not asked again in this pass."""
        refused: set[tuple[Hashable, int]] = set()
        victims: list[_G] = []
        for share, weight, eligible, rank in claims:
            if (share, rank) in refused:
                continue
            victim = self.victim(share, weight, eligible, rank)
            if victim is None:
                refused.add((share, rank))
                continue
            self.give(victim, share, weight)
            self.reclaimed += 1
            victims.append(victim)
        return victims

    def _ranked(self, share: Hashable) -> list[tuple[float, Hashable]]:
        ranked = [
            (entry.held / entry.weight, key)
            for key, entry in self._shares.items()
            if key != share and entry.held > 0
        ]
        ranked.sort(key=lambda pair: pair[0], reverse=True)
        return ranked

    def give(self, item: _G, to: Hashable | None = None, weight: float = 1.0) -> None:
        """``item`` was told to yield its lane, to a waiter of ``to`` (whose weight is
        ``weight``; None: to nobody in particular, a parked stream)."""
        share = self._owner.get(item)
        if share is None or item in self._yielding:
            return
        self._yielding[item] = to
        self._shares[share].giving += 1
        if to is not None:
            entry = self._shares.get(to)
            if entry is None:
                entry = self._shares[to] = _Share(weight)
            entry.coming += 1

    def shares(self) -> Iterable[Hashable]:
        return self._shares.keys()

    def _forget(self, share: Hashable) -> None:
        entry = self._shares.get(share)
        if entry is not None and not entry.holding and not entry.coming:
            del self._shares[share]


__all__ = ["Claim", "ShareLedger"]
