"""What each API key may have (docs/api.md "API keys"): its weight in the fleet's shares, its
own caps (generations open at once, tokens per minute) and its default request class, as the
key file gives them, and the per-key token meter that answers 429 with ``Retry-After``.

A key file line is the key, then optional ``name=value`` fields::

    sk-team-a  weight=3  concurrency=32  tokens-per-minute=200000  class=interactive
    sk-batch   weight=1  class=batch
    sk-ops     admin=yes

This module is pure: it reads no file (the tap hands it the lines), reads no clock (times are
passed in) and never logs a key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from sfnode.head.api.request_class import HeadClass, parse_header
from sfnode.runtime.http_guard import HttpError

WINDOW_S = 60.0
"""The meter's period: ``tokens-per-minute`` refill over one minute."""


class KeyFileError(ValueError):
    """A key file line that cannot be read (its message never repeats the key)."""


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """One API key's share and caps."""

    weight: float = 1.0
    """Its weight in the fleet's shares of lanes (docs/protocol.md section 8.5)."""
    concurrency: int = 0
    """Generations it may have open at once (0: ``--max-key-requests``)."""
    tokens_per_minute: int = 0
    """Prompt and generated tokens it may spend per minute (0: no cap)."""
    request_class: HeadClass | None = None
    """The class of its requests that name none (None: ``--default-request-class``)."""
    admin: bool = False
    """It may drain a node (``POST /console/drain?node=NAME``, docs/api.md "The
    console")."""


DEFAULT_POLICY = KeyPolicy()


def _positive_int(name: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise KeyFileError(f"{name} must be a whole number of 0 or more, not {value!r}")
    return number


def _field(policy: dict[str, object], name: str, value: str) -> None:
    if name == "weight":
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and weight > 0):
            raise KeyFileError(f"weight must be a number above 0, not {value!r}")
        policy["weight"] = weight
    elif name == "concurrency":
        policy["concurrency"] = _positive_int(name, value)
    elif name == "tokens-per-minute":
        policy["tokens_per_minute"] = _positive_int(name, value)
    elif name == "class":
        try:
            policy["request_class"] = parse_header(value.encode())
        except HttpError as e:
            raise KeyFileError(
                f"class must be interactive, batch or background, not {value!r}"
            ) from e
    elif name == "admin":
        if value.lower() not in ("yes", "no"):
            raise KeyFileError(f"admin must be yes or no, not {value!r}")
        policy["admin"] = value.lower() == "yes"
    else:
        raise KeyFileError(
            f"unknown field {name!r} (weight, concurrency, tokens-per-minute, class, admin)"
        )


def parse_key_line(line: bytes) -> tuple[bytes, KeyPolicy]:
    """The key of one key file line and its policy (fields after the key, ``name=value``).

    :raises KeyFileError: a field that is not ``name=value``, unknown, or out of range.
    """
    key, *fields = line.split()
    policy: dict[str, object] = {}
    for raw in fields:
        name, equals, value = raw.decode("ascii", "replace").partition("=")
        if not equals:
            raise KeyFileError(f"a field after the key must be name=value, not {name!r}")
        _field(policy, name.lower(), value)
    return key, KeyPolicy(**policy)  # type: ignore[arg-type]


class TokenMeter:
    """Tokens spent per key against its ``tokens-per-minute``: a bucket of one minute's
    tokens that refills continuously; a request is refused while the bucket is empty (a
    request may overdraw it, as its answer's length is not known before it runs)."""

    def __init__(self, policies: Mapping[bytes, KeyPolicy]) -> None:
        self._policies = policies
        self._levels: dict[bytes, tuple[float, float]] = {}
        """Per key: the tokens left in its bucket, and when that was computed."""

    def _level(self, key: bytes, rate: int, now: float) -> float:
        left, then = self._levels.get(key, (float(rate), now))
        return min(float(rate), left + (now - then) * rate / WINDOW_S)

    def wait_s(self, key: bytes | None, now: float) -> float:
        """Seconds until ``key`` may start another request (0: now)."""
        rate = self._rate(key)
        if key is None or not rate:
            return 0.0
        level = self._level(key, rate, now)
        return 0.0 if level > 0 else (1 - level) * WINDOW_S / rate

    def spend(self, key: bytes | None, tokens: int, now: float) -> None:
        """``key`` spent ``tokens`` (a prompt, or generated tokens)."""
        rate = self._rate(key)
        if key is None or not rate or tokens <= 0:
            return
        self._levels[key] = (self._level(key, rate, now) - tokens, now)

    def _rate(self, key: bytes | None) -> int:
        if key is None:
            return 0
        return self._policies.get(key, DEFAULT_POLICY).tokens_per_minute


__all__ = [
    "DEFAULT_POLICY",
    "KeyFileError",
    "KeyPolicy",
    "TokenMeter",
    "parse_key_line",
]
