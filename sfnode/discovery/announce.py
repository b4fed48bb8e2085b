"""The head's DNS-SD announcement (docs/protocol.md section 5.6): a service beside its fleet
listener.

:class:`AnnounceService` waits for the fleet listener (``--fleet-listen``) to be bound, then
announces ``_superfluid-fleet._tcp`` at the bound port and the machine's reachable addresses
through an :class:`~sfnode.discovery.dnssd.Announcer`, with a TXT record saying the protocol
version, the head's name and whether a fleet token is required.  Stopping the service withdraws the
announcement (goodbye records) before the head's other services stop, so nodes browsing for it
stop finding it first.  ``twistd sfhead`` adds it only when the fleet listener is off loopback
and ``--no-announce`` is not given.

A failed announcement is logged and never stops the head: nodes can still join it by address.
This module must never put the fleet token in a record, never block the reactor, and never
import zeroconf itself (the Announcer it is given does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.application import service
from twisted.internet import defer
from twisted.internet.interfaces import IListeningPort
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.discovery.dnssd import Announcer
from sfnode.discovery.rules import SERVICE_TYPE, HeadAnnouncement, announced_addresses, join_address
from sfnode.runtime.service import ListeningService

log = Logger(namespace="sfnode.discovery.announce")


@dataclass(eq=False)
class AnnounceService(service.Service):
    """Announces the head while its fleet listener listens; withdraws on stop."""

    listener: ListeningService
    announcement: HeadAnnouncement
    announcer: Announcer
    interface_addresses: Callable[[], list[str]]
    instance: str | None = field(default=None, init=False)
    """The instance name announced, once the announcement is up."""
    _announcing: defer.Deferred[None] | None = field(default=None, init=False)

    def startService(self) -> None:
        super().startService()  # type: ignore[no-untyped-call]
        bound = self.listener.bound
        if bound is None:
            return
        announcing: defer.Deferred[None] = defer.Deferred()
        self._announcing = announcing

        def listening(port: IListeningPort | None) -> IListeningPort | None:
            if port is None or not self.running:
                announcing.callback(None)
                return port
            self._announce(port).chainDeferred(announcing)
            return port

        bound.addCallback(listening)

    def _announce(self, port: IListeningPort) -> defer.Deferred[None]:
        where = port.getHost()
        host = getattr(where, "host", None)
        addresses = announced_addresses(host, self.interface_addresses())
        if not addresses:
            log.warn(
                "sfhead not announcing on {service}: the fleet listener at {host} has no "
                "address that other machines can reach",
                service=SERVICE_TYPE,
                host=host,
            )
            return defer.succeed(None)
        number = int(getattr(where, "port", 0))
        announced = self.announcer.announce(self.announcement, number, addresses)

        def done(instance: str) -> None:
            self.instance = instance
            log.info(
                "sfhead announcing {name!r} on {service} at {where} (token {token})",
                name=self.announcement.head_name,
                service=SERVICE_TYPE,
                where=", ".join(join_address(a, number) for a in addresses),
                token="required" if self.announcement.token_required else "not required",
            )

        def failed(failure: Failure) -> None:
            log.failure(
                "sfhead cannot announce itself on {service} (nodes can still join it by address)",
                failure,
                service=SERVICE_TYPE,
            )

        return announced.addCallbacks(done, failed)

    def stopService(self) -> defer.Deferred[Any]:
        super().stopService()  # type: ignore[no-untyped-call]
        announcing, self._announcing = self._announcing, None
        if announcing is None:
            return defer.succeed(None)

        def withdraw(_: object) -> defer.Deferred[None]:
            if self.instance is None:
                return defer.succeed(None)
            self.instance = None
            withdrawn = self.announcer.withdraw()
            withdrawn.addCallback(
                lambda _: log.info("sfhead stopped announcing on {service}", service=SERVICE_TYPE)
            )
            return withdrawn.addErrback(
                lambda f: log.failure("sfhead could not withdraw its announcement", f)
            )

        return announcing.addCallback(withdraw)
