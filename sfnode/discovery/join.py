"""The endpoint a ``--join auto`` node dials: whichever head DNS-SD finds (docs/protocol.md
section 5.6).

:class:`DiscoveringEndpoint` is an ``IStreamClientEndpoint`` for the node's redialling
connection (the same ``ClientService`` and backoff as ``--head``): each ``connect`` dials the head
its :class:`~sfnode.discovery.rules.HeadFinder` holds, and when it holds none (at start, or after
the head stayed unreachable) it browses first through a :class:`~sfnode.discovery.dnssd.Browser`.  A
browse that finds no head, or several, fails that attempt with the reason, and the next attempt
browses again after the usual backoff.

This module must never talk multicast itself (only through the Browser it is given), never use
the global reactor, and never decide what a refused token means: the dial service does.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from twisted.internet import defer
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IProtocolFactory, IStreamClientEndpoint
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from sfnode.discovery.dnssd import BROWSE_S, Browser
from sfnode.discovery.rules import SERVICE_TYPE, HeadAnswer, HeadFinder, join_address

log = Logger(namespace="sfnode.discovery.join")


@implementer(IStreamClientEndpoint)
@dataclass(eq=False)
class DiscoveringEndpoint:
    """Dials the head that DNS-SD finds; browses again when it stays unreachable."""

    reactor: Any
    browser: Browser
    finder: HeadFinder
    _: KW_ONLY
    browse_s: float = BROWSE_S
    has_token: bool = True
    _announced: HeadAnswer | None = field(default=None, init=False)
    _dialled: str | None = field(default=None, init=False)

    def describe(self) -> str:
        """The head the last attempt dialled, or the one looked for, as log lines name it."""
        if self._dialled is not None:
            return self._dialled
        wanted = "" if self.finder.head_name is None else f" {self.finder.head_name!r}"
        return f"the head{wanted} on {SERVICE_TYPE}"

    def connect(self, factory: IProtocolFactory) -> defer.Deferred[Any]:
        self._dialled = None
        if self.finder.needs_browse():
            found: defer.Deferred[Any] = self.browser.browse(self.browse_s)
            found.addCallback(self._browsed)
        else:
            found = defer.succeed(None)
        found.addCallback(lambda _: self._dial(factory))
        return found

    def _browsed(self, answers: list[HeadAnswer]) -> None:
        head = self.finder.browsed(answers)
        if head != self._announced:
            self._announced = head
            log.info(
                "sfnode found the head {head} on {service} ({count} answered)",
                head=head.describe(),
                service=SERVICE_TYPE,
                count=len(answers),
            )
            if head.announcement.token_required != self.has_token:
                log.warn(
                    "the head {head} says it {has} a fleet token and this node {ours}: the "
                    "handshake will fail until both hold the same token (--auth-file)",
                    head=head.describe(),
                    has="requires" if head.announcement.token_required else "has no",
                    ours="has one" if self.has_token else "has none",
                )

    def _dial(self, factory: IProtocolFactory) -> defer.Deferred[Any]:
        host, port = self.finder.address()
        head = self.finder.head
        assert head is not None
        self._dialled = f"the head {head.head_name!r} at {join_address(host, port)}"
        attempt: defer.Deferred[Any] = HostnameEndpoint(self.reactor, host, port).connect(factory)

        def connected(protocol: Any) -> Any:
            self.finder.connected()
            return protocol

        def failed(failure: Failure) -> Failure:
            if self.finder.dial_failed():
                log.info(
                    "the head at {address} stayed unreachable: browsing {service} again",
                    address=join_address(host, port),
                    service=SERVICE_TYPE,
                )
            return failure

        return attempt.addCallbacks(connected, failed)

    def __repr__(self) -> str:
        return self.describe()
