"""The console's small time series, per model: tokens per second and the first-token time's
median and 95th percentile, one point per :data:`SAMPLE_EVERY_S` seconds over the last
:data:`POINTS` points, and the percentiles over the last :data:`WINDOW_S` seconds.

Points are taken when a snapshot is built (a viewer asks), never by a timer: a head nobody
watches computes nothing, and the first point after a quiet spell spans the whole gap (its
rate is the gap's average).  This module must never read a clock (times are given), do I/O, or
keep more than :data:`POINTS` points per model.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

SAMPLE_EVERY_S = 5.0
"""The shortest time between two points of a series."""
POINTS = 60
"""The points kept per model (5 minutes at one point per 5 s)."""
WINDOW_S = 300.0
"""The first-token percentiles of the model table are over this many seconds."""


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """The nearest-rank percentile of ``values`` (None: no value)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True, slots=True)
class Point:
    at: float
    tokens_per_s: float
    first_token_p50: float | None
    first_token_p95: float | None

    def as_json(self) -> list[float | None]:
        return [
            round(self.at, 1),
            round(self.tokens_per_s, 1),
            _ms(self.first_token_p50),
            _ms(self.first_token_p95),
        ]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


class Series:
    """Each model's points (``[at, tokens/s, first-token p50 ms, p95 ms]``)."""

    def __init__(self) -> None:
        self._points: dict[str, deque[Point]] = {}
        self._last_at: float | None = None
        self._last_delivered: dict[str, int] = {}

    def sample(
        self,
        now: float,
        models: Sequence[str],
        delivered: Mapping[str, int],
        first_tokens: Iterable[tuple[float, str, float]],
    ) -> None:
        """Take a point for each of ``models`` when :data:`SAMPLE_EVERY_S` passed since the
        last: the tokens ``delivered`` since then per second, and the percentiles of the
        ``first_tokens`` (when, model, seconds) that came since then."""
        since = self._last_at
        if since is not None and now - since < SAMPLE_EVERY_S:
            return
        recent: dict[str, list[float]] = {}
        for at, model, seconds in first_tokens:
            if since is None or at > since:
                recent.setdefault(model, []).append(seconds)
        for gone in set(self._points) - set(models):
            del self._points[gone]
        for model in models:
            total = delivered.get(model, 0)
            rate = 0.0
            if since is not None and now > since:
                rate = max(0, total - self._last_delivered.get(model, 0)) / (now - since)
            times = recent.get(model, [])
            points = self._points.setdefault(model, deque(maxlen=POINTS))
            points.append(Point(now, rate, percentile(times, 0.5), percentile(times, 0.95)))
        self._last_at = now
        self._last_delivered = {m: delivered.get(m, 0) for m in models}

    def points(self, model: str) -> list[list[float | None]]:
        return [p.as_json() for p in self._points.get(model, ())]

    def latest_rate(self, model: str) -> float:
        """The newest point's tokens per second (0: none yet)."""
        points = self._points.get(model)
        return points[-1].tokens_per_s if points else 0.0


def window_percentiles(
    now: float, model: str, first_tokens: Iterable[tuple[float, str, float]]
) -> tuple[float | None, float | None]:
    """The first-token p50 and p95 of ``model`` over the last :data:`WINDOW_S` seconds, in
    milliseconds."""
    times = [s for at, m, s in first_tokens if m == model and now - at <= WINDOW_S]
    return _ms(percentile(times, 0.5)), _ms(percentile(times, 0.95))


__all__ = ["POINTS", "SAMPLE_EVERY_S", "WINDOW_S", "Series", "percentile", "window_percentiles"]
