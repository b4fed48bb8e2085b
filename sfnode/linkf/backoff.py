"""The one redial policy of sfnode: exponential backoff with jitter (docs/protocol.md decision
D9), for a node redialling its head and a head redialling its nodes alike.

A policy is a function from the number of failed attempts in a row (from 1) to the seconds to
wait before the next one; Twisted's ``ClientService`` takes one as its ``retryPolicy``, the
head's link machine as its ``retry``.  This module is pure: it must never hold a reactor or a
clock, and never sleep.
"""

from __future__ import annotations

import random
from collections.abc import Callable

RetryPolicy = Callable[[int], float]
"""Seconds to wait before the next attempt, given the failed attempts in a row (from 1)."""

INITIAL_S = 0.1
"""The first delay."""
FACTOR = 2.0
"""Each further failure multiplies the delay by this, up to the cap."""


def retry_policy(
    cap_s: float,
    *,
    initial_s: float = INITIAL_S,
    factor: float = FACTOR,
    jitter: Callable[[], float] = random.random,
    on_delay: Callable[[int, float], None] | None = None,
) -> RetryPolicy:
    """Exponential backoff from ``initial_s`` up to ``cap_s``, each delay shortened by up to a
    fifth at random (``jitter()`` in [0, 1)), so that a fleet does not redial in lockstep.
    ``on_delay(attempt, delay)`` is told every delay (for a log)."""

    def delay(failures: int) -> float:
        steps = min(max(failures, 1) - 1, 64)
        wait = min(initial_s * factor**steps, cap_s) * (1.0 - 0.2 * jitter())
        if on_delay is not None:
            on_delay(failures, wait)
        return wait

    return delay


__all__ = ["FACTOR", "INITIAL_S", "RetryPolicy", "retry_policy"]
