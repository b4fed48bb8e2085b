"""What a fleet generation does after each attempt on a node: the failover decision as a pure
step, ``decide(attempt, outcome)`` (docs/protocol.md section 8, "Failover").

A fleet generation places itself, sends one GENERATE_REQ, and on what came back either ends
(a finish the caller sees), fails (an error the caller sees), or moves on to another node with
what was delivered.  :func:`decide` is that choice, given the facts of the attempt
(:class:`Attempt`) and how it went (:data:`Outcome`); the fleet carries it out.

This module must never touch a link, a node, a clock or a Deferred: it is values and one
function, tested alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from sfnode.generation import StreamTooLong
from sfnode.head.fleet.backend import ConstraintRefused, FleetError, NodeDeclined, NoNodeAvailable
from sfnode.linkf.wire import FINISH_DECLINED, FINISH_REFUSED

MAX_FAILOVERS = 16
"""Moves one generation may make before the fleet gives up on it (a request that kills every
node it reaches must not go round for ever)."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """The facts of one attempt that the decision reads."""

    node: str
    """The node it ran on."""
    context_length: int
    """Prompt and delivered tokens: what the node held when it answered."""
    fits: bool
    """Whether that context fits the node's window."""
    constrained: bool = False
    """The generation has a constraint (docs/protocol.md section 12.3)."""
    failovers: int = 0
    """Moves made so far."""
    cancelled: bool = False
    """The caller (or the wall budget) cancelled the generation meanwhile."""
    window: int = 0
    """The node's window (0: unknown), for a StreamTooLong."""


@dataclass(frozen=True, slots=True)
class Finished:
    """The node sent its Finish with ``reason`` (and ``detail``, protocol.md section 12.6)."""

    reason: int
    detail: int = 0


@dataclass(frozen=True, slots=True)
class Lost:
    """The node (or the path to it) failed: the link lost the call, or the node is down."""

    error: Exception


@dataclass(frozen=True, slots=True)
class NotSent:
    """The generation was cancelled before its GENERATE_REQ could go out."""


Outcome = Finished | Lost | NotSent


@dataclass(frozen=True, slots=True)
class End:
    """The generation ends with ``finish``; ``restore`` says the session's own context must be
    put back on the node (a session's generation that failed over there left the node with
    prompt + delivered tokens)."""

    finish: int
    restore: bool = False
    detail: int = 0
    """The Finish's ``detail`` bits."""


@dataclass(frozen=True, slots=True)
class Cancelled:
    """The generation was cancelled and no Finish will tell how it ended: it ends CANCELLED
    with what was delivered."""


@dataclass(frozen=True, slots=True)
class Fail:
    """The generation fails with ``error``."""

    error: Exception


@dataclass(frozen=True, slots=True)
class MoveOn:
    """Fail over: place the session on another node (not this one) with what was
    delivered."""

    error: Exception


Decision = End | Cancelled | Fail | MoveOn


def decide(attempt: Attempt, outcome: Outcome) -> Decision:
    """What follows one attempt.

    A Finish ends the generation, but for REFUSED (a constraint the node cannot honour when the
    context fits, else a context too long: both fail) and DECLINED (the node is full, draining,
    or saw a stale epoch: move on).  A lost node moves on.  A cancelled generation ends
    (:class:`Cancelled`) instead of moving on, and after :data:`MAX_FAILOVERS` moves the
    generation fails (with the node's refusal when it declined, else
    :class:`NoNodeAvailable`).
    """
    if isinstance(outcome, NotSent):
        return Cancelled()
    error: Exception
    if isinstance(outcome, Finished):
        if outcome.reason == FINISH_REFUSED:
            if attempt.constrained and attempt.fits:
                refused = f"{attempt.node} refused the generation's constraint"
                return Fail(ConstraintRefused(refused))
            return Fail(StreamTooLong(attempt.context_length, attempt.window))
        if outcome.reason != FINISH_DECLINED:
            return End(outcome.reason, restore=attempt.failovers > 0, detail=outcome.detail)
        error = NodeDeclined(
            f"{attempt.node} declined the generation (it is full or draining, or a stale "
            "epoch or replayed command)"
        )
    else:
        error = outcome.error
    if attempt.cancelled:
        return Cancelled()
    if attempt.failovers >= MAX_FAILOVERS:
        if isinstance(error, NodeDeclined):
            return Fail(error)
        given_up: FleetError = NoNodeAvailable(
            f"gave up after {attempt.failovers} failovers; the last: {error}"
        )
        given_up.__cause__ = error
        return Fail(given_up)
    return MoveOn(error)


def declined(outcome: Outcome) -> bool:
    """The node declined the generation: whatever follows, it takes no new work until it
    reports again."""
    return isinstance(outcome, Finished) and outcome.reason == FINISH_DECLINED


__all__ = [
    "MAX_FAILOVERS",
    "Attempt",
    "Cancelled",
    "Decision",
    "End",
    "Fail",
    "Finished",
    "Lost",
    "MoveOn",
    "NotSent",
    "Outcome",
    "decide",
    "declined",
]
