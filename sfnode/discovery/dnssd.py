"""Multicast DNS service discovery (docs/protocol.md section 5.6) behind two small interfaces.

:class:`Browser` (the node's ``--join auto``) asks who offers ``_superfluid-fleet._tcp`` now;
:class:`Announcer` (the head's fleet listener) offers it.  The rest of sfnode sees only these two
interfaces, so its tests use recording fakes and need no multicast; :class:`ZeroconfBrowser` and
:class:`ZeroconfAnnouncer` are the real ones, on the ``zeroconf`` package.

zeroconf is blocking and runs its own thread, so every call into it here runs on the reactor's
thread pool and its result comes back as a Deferred on the reactor thread.  Each browse uses a
fresh ``Zeroconf`` instance: its cache starts empty, so a browse hears only who answers now, never
a head that went away.  IPv4 only (section 5.6).

This module must never be imported while options are parsed (zeroconf is imported only here, and
only when a browser or an announcer is built), never block the reactor, and never put the fleet
token in a record.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from twisted.internet import defer, threads
from twisted.logger import Logger

from sfnode.discovery.rules import SERVICE_TYPE, AnnouncementError, HeadAnnouncement, HeadAnswer

log = Logger(namespace="sfnode.discovery.dnssd")

BROWSE_S = 1.5
"""How long a browse listens for answers.  Heads answer a query within about 120 ms (RFC 6762
section 6); the rest leaves room for a lost packet and zeroconf's second query."""
RESOLVE_MS = 1000
"""How long a browse waits for one head's SRV, TXT and address records when the answer to the
query did not carry them."""


class Browser(Protocol):
    """Asks the local network which heads offer their fleet listener."""

    def browse(self, duration_s: float) -> defer.Deferred[list[HeadAnswer]]:
        """The heads that answered within ``duration_s`` seconds (malformed ones are logged
        and left out)."""


class Announcer(Protocol):
    """Offers one head's fleet listener on the local network while it runs."""

    def announce(
        self, announcement: HeadAnnouncement, port: int, addresses: Sequence[str]
    ) -> defer.Deferred[str]:
        """Start answering for this head; fires with the instance name registered (a name
        another head already holds gets a suffix)."""

    def withdraw(self) -> defer.Deferred[None]:
        """Stop answering, telling the network the head is gone (goodbye records)."""


def _zeroconf_v4(interfaces: Any) -> Any:
    from zeroconf import IPVersion, Zeroconf

    return Zeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)


class ZeroconfBrowser:
    """:class:`Browser` on the ``zeroconf`` package, every interface, IPv4."""

    def __init__(self, reactor: Any) -> None:
        self._reactor = reactor

    def browse(self, duration_s: float) -> defer.Deferred[list[HeadAnswer]]:
        pool = self._reactor.getThreadPool()
        found = threads.deferToThreadPool(self._reactor, pool, _browse, duration_s)
        return found.addCallback(self._report)

    @staticmethod
    def _report(result: tuple[list[HeadAnswer], list[str]]) -> list[HeadAnswer]:
        answers, problems = result
        for problem in problems:
            log.warn(
                "ignoring an answer on {service}: {problem}",
                service=SERVICE_TYPE,
                problem=problem,
            )
        return answers


def _browse(duration_s: float) -> tuple[list[HeadAnswer], list[str]]:
    """(answers, problems) of one browse; runs on a worker thread."""
    from zeroconf import InterfaceChoice, IPVersion, ServiceBrowser, ServiceStateChange

    names: set[str] = set()
    lock = threading.Lock()

    def on_change(
        zeroconf: Any, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        with lock:
            if state_change is ServiceStateChange.Removed:
                names.discard(name)
            else:
                names.add(name)

    zeroconf = _zeroconf_v4(InterfaceChoice.All)
    try:
        browser = ServiceBrowser(zeroconf, SERVICE_TYPE, handlers=[on_change])
        threading.Event().wait(duration_s)
        browser.cancel()
        with lock:
            instances = sorted(names)
        answers: list[HeadAnswer] = []
        problems: list[str] = []
        for instance in instances:
            info = zeroconf.get_service_info(SERVICE_TYPE, instance, timeout=RESOLVE_MS)
            if info is None:
                problems.append(f"{instance}: no SRV or TXT record within {RESOLVE_MS} ms")
                continue
            try:
                announcement = HeadAnnouncement.from_txt(info.properties or {})
            except AnnouncementError as e:
                problems.append(f"{instance}: {e}")
                continue
            addresses = tuple(info.parsed_addresses(IPVersion.V4Only))
            answers.append(HeadAnswer(instance, addresses, int(info.port or 0), announcement))
        return answers, problems
    finally:
        zeroconf.close()


class ZeroconfAnnouncer:
    """:class:`Announcer` on the ``zeroconf`` package, on the announced addresses' interfaces."""

    def __init__(self, reactor: Any) -> None:
        self._reactor = reactor
        self._zeroconf: Any = None
        self._info: Any = None

    def announce(
        self, announcement: HeadAnnouncement, port: int, addresses: Sequence[str]
    ) -> defer.Deferred[str]:
        pool = self._reactor.getThreadPool()
        return threads.deferToThreadPool(
            self._reactor, pool, self._register, announcement, port, list(addresses)
        )

    def _register(self, announcement: HeadAnnouncement, port: int, addresses: list[str]) -> str:
        from zeroconf import ServiceInfo

        zeroconf = _zeroconf_v4(addresses)
        info = ServiceInfo(
            SERVICE_TYPE,
            f"{announcement.head_name}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(a) for a in addresses],
            port=port,
            properties=announcement.txt(),
            server=f"{_host_label()}.local.",
        )
        try:
            # "superfluid-fleet" is 16 bytes, one more than RFC 6335 allows a service name:
            # the upstream name is kept (section 5.6), so zeroconf's length check is relaxed.
            zeroconf.register_service(info, allow_name_change=True, strict=False)
        except BaseException:
            zeroconf.close()
            raise
        self._zeroconf, self._info = zeroconf, info
        return str(info.name)

    def withdraw(self) -> defer.Deferred[None]:
        zeroconf, info = self._zeroconf, self._info
        self._zeroconf = self._info = None
        if zeroconf is None:
            return defer.succeed(None)

        def unregister() -> None:
            try:
                zeroconf.unregister_service(info)
            finally:
                zeroconf.close()

        pool = self._reactor.getThreadPool()
        return threads.deferToThreadPool(self._reactor, pool, unregister)


def _host_label() -> str:
    """This host's name as one DNS label (for the SRV target ``label.local.``)."""
    name = socket.gethostname().split(".")[0]
    label = "".join(c if c.isalnum() or c == "-" else "-" for c in name).strip("-")
    return label[:63] or "sfhead"


def interface_addresses() -> list[str]:
    """This machine's IPv4 addresses, every interface (loopback included: the caller filters)."""
    import ifaddr

    found: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):
                found.append(ip.ip)
    return found
