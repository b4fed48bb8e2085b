"""How the head runs its links: the constants of Link F on the head's side, the one frozen
:class:`LinkSettings` value every link is built with, the process-wide :class:`HeadIds`, and how
an endpoint is named (docs/protocol.md sections 5, 8, 12.4).

This module must never hold a reactor, open a connection or keep mutable state but the id
counters of :class:`HeadIds`.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, cast

from twisted.internet.endpoints import clientFromString
from twisted.internet.interfaces import IStreamClientEndpoint

from sfnode.head.link.machine import (
    DEFAULT_KEEPALIVE_INTERVAL_S,
    DEFAULT_SILENCE_TIMEOUT_S,
)
from sfnode.linkf.wire import (
    GenParams,
    Lease,
)

PROTO_RANGE = (2, 2)
DEFAULT_LEASE = Lease(duration_ms=60_000, renew_by_ms=45_000)
DEFAULT_PARAMS = GenParams()
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
DEFAULT_JOIN_HANDSHAKES = 8
"""Nodes dialing a head that may be in their handshake at once (section 5.3)."""
DEFAULT_JOIN_ADDRESS_HANDSHAKES = 4
"""Of those, how many may come from one address (section 5.3): a few silent connections from
one address cannot keep the nodes of others from joining."""
COMMAND_SPACE = 1 << 32
"""Command ids each connection's HeadSession may use before the next connection's base."""


@dataclass(frozen=True, slots=True)
class LinkSettings:
    """How the head runs every link to a node, dialed or dialed in: built once from the
    options and handed to both paths (:func:`connect_node` and the fleet's dials, and
    :class:`HeadLinkFactory`), so that neither can drop a setting on the way."""

    token: bytes = b""
    """The fleet token: with one, every connection is Noise (docs/protocol.md section 5)."""
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    """The most a connection may take to finish its handshake (and a reconcile to end)."""
    keepalive_interval_s: float = DEFAULT_KEEPALIVE_INTERVAL_S
    """A KEEPALIVE goes out on an open link this often (docs/protocol.md section 8)."""
    silence_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S
    """The keepalive window: a node silent this long is given up (0: never)."""
    keep_wal: bool = True
    """False forgets a generation's committed events once its call completed (what a fleet
    wants); True keeps them (tests inspect them)."""


DEFAULT_LINK_SETTINGS = LinkSettings()


class HeadIds:
    """The head's identity and process-wide id spaces (section 8, "Id spaces").

    ``head_id`` is drawn at random once per head (a restarted head is another head): every
    HELLO carries it, and a node with ``FEATURE_HEAD_IDENTITY`` keeps this head's sessions
    under it (section 12.4, decision D13).  Epochs come from one counter starting at 1, one per
    assign (any session, any link).  Each link's HeadSession starts its command ids at a base
    that advances by 2^32 per link (1, 2^32+1, ...), so a node never sees one command id twice.
    """

    def __init__(self, head_id: int | None = None) -> None:
        self.head_id = secrets.randbits(64) if head_id is None else head_id
        self._last_epoch = 0
        self._links = 0

    def next_epoch(self) -> int:
        self._last_epoch += 1
        return self._last_epoch

    def next_command_base(self) -> int:
        base = self._links * COMMAND_SPACE + 1
        self._links += 1
        return base


def parse_endpoint(
    reactor: Any, endpoint: str | IStreamClientEndpoint
) -> tuple[IStreamClientEndpoint, str]:
    """The endpoint to dial for a Twisted endpoint string (or an endpoint as it is), and how
    logs name it: the string as given, or :func:`describe_endpoint`."""
    if isinstance(endpoint, str):
        parsed = clientFromString(reactor, endpoint)  # type: ignore[no-untyped-call]
        return cast(IStreamClientEndpoint, parsed), endpoint
    return endpoint, describe_endpoint(endpoint)


def describe_endpoint(endpoint: object) -> str:
    """An endpoint in the words of its endpoint string, as far as it can be told."""
    host = getattr(endpoint, "_host", None)
    port = getattr(endpoint, "_port", None)
    if host is not None and port is not None:
        return f"tcp:{host}:{port}"
    path = getattr(endpoint, "_path", None)
    if path is not None:
        return f"unix:{path}"
    return type(endpoint).__name__
