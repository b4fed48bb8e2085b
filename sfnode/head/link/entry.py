"""The two ways a head link begins: the head dials (:func:`connect_node`) or a node dials the
head (:class:`HeadLinkFactory`, with its admission checks, docs/protocol.md section 5.3).

This module must never use the global reactor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.head.link.machine import (
    RetryPolicy,
)
from sfnode.head.link.node_link import NodeLink
from sfnode.head.link.protocol import HeadLinkProtocol
from sfnode.head.link.settings import (
    DEFAULT_JOIN_ADDRESS_HANDSHAKES,
    DEFAULT_JOIN_HANDSHAKES,
    DEFAULT_LINK_SETTINGS,
    HeadIds,
    LinkSettings,
    parse_endpoint,
)
from sfnode.linkf.handshake import (
    address_key,
    describe_address,
    handshake_slot_refusal,
    is_loopback_address,
)
from sfnode.linkf.noise import NoiseFactory, NoiseProtocol, Role

_log = Logger(namespace="sfnode.head.link")


def connect_node(
    reactor: Any,
    endpoint: str | IStreamClientEndpoint,
    *,
    ids: HeadIds,
    settings: LinkSettings = DEFAULT_LINK_SETTINGS,
    clock: IReactorTime | None = None,
    retry: RetryPolicy | None = None,
) -> Deferred[NodeLink]:
    """Dial a node (a Twisted endpoint string or endpoint) and handshake.

    Fires with the open :class:`NodeLink` (which then redials on its own whenever its
    connection drops, until it is closed), or fails with the reason of the first attempt:
    :class:`~sfnode.head.link.machine.ConnectError`, :class:`HandshakeTimeoutError`,
    :class:`NodeRefusedError` (the node closed the connection during the handshake),
    :class:`MalformedFrameError` or :class:`HandshakeError`; the link is then closed.
    """
    dialer, description = parse_endpoint(reactor, endpoint)
    link = NodeLink(
        reactor,
        ids,
        settings=settings,
        endpoint=dialer,
        description=description,
        clock=clock,
        retry=retry,
    )
    link.start()
    opened = link.when_open()

    def failed(failure: Failure) -> Failure:
        link.close()
        return failure

    return opened.addCallbacks(lambda _: link, failed)


class HeadLinkFactory(Factory):
    """Accepts nodes that dial the head; each handshaken link goes to ``on_node``.

    The head still speaks first (HELLO, section 5.2).  A connection whose handshake fails is
    logged and closed; ``on_node`` never sees it.

    Admission: with a token every connection is Noise (the head the initiator).  Without one,
    ``loopback_only=True`` (what ``sfhead`` passes unless --insecure-no-auth) accepts only
    loopback or Unix-socket peers.  A connection arriving while ``max_handshakes`` others are
    in their handshake, or ``max_address_handshakes`` others from its address, is closed at
    once (0 = no limit; docs/protocol.md section 5.3).
    """

    noisy = False

    def __init__(
        self,
        on_node: Callable[[NodeLink], None],
        *,
        reactor: Any,
        ids: HeadIds,
        settings: LinkSettings = DEFAULT_LINK_SETTINGS,
        clock: IReactorTime | None = None,
        max_handshakes: int = DEFAULT_JOIN_HANDSHAKES,
        max_address_handshakes: int = DEFAULT_JOIN_ADDRESS_HANDSHAKES,
        loopback_only: bool = False,
    ) -> None:
        self._on_node = on_node
        self.max_handshakes = max_handshakes
        self.max_address_handshakes = max_address_handshakes
        self.loopback_only = loopback_only
        self.handshaking = 0
        """Links built and not yet past (or failed in) their handshake."""
        self.handshaking_from: Counter[str] = Counter()
        """The same, by the peer's host."""
        self._reactor = reactor
        self._ids = ids
        self.settings = settings
        self._clock = clock
        self._noise = (
            NoiseFactory(
                self,
                token=settings.token,
                role=Role.INITIATOR,
                clock=clock if clock is not None else reactor,
                handshake_timeout_s=settings.handshake_timeout_s,
            )
            if settings.token
            else None
        )

    def buildProtocol(self, addr: Any) -> HeadLinkProtocol | NoiseProtocol | None:
        """The link's protocol, behind Noise (head = initiator) when there is a token; None
        (the connection is closed at once) for a refused peer."""
        if not self.settings.token and self.loopback_only and not is_loopback_address(addr):
            _log.warn(
                "refused a node dialing in from {peer}: no fleet token, so only loopback "
                "peers are accepted (--insecure-no-auth overrides)",
                peer=describe_address(addr),
            )
            return None
        address = address_key(addr)
        refusal = handshake_slot_refusal(
            (self.max_handshakes, self.max_address_handshakes),
            self.handshaking,
            self.handshaking_from[address],
            address,
        )
        if refusal is not None:
            _log.warn(
                "closed a node connection from {peer} at once: {why}",
                peer=describe_address(addr),
                why=refusal,
            )
            return None
        protocol = self._link_protocol(addr)
        if self._noise is None:
            return protocol
        return NoiseProtocol(self._noise, protocol)

    def _link_protocol(self, addr: Any) -> HeadLinkProtocol:
        peer = describe_address(addr)
        address = address_key(addr)
        link = NodeLink(
            self._reactor, self._ids, settings=self.settings, description=peer, clock=self._clock
        )
        link.start()
        self.handshaking += 1
        self.handshaking_from[address] += 1

        def handshake_over() -> None:
            self.handshaking -= 1
            self.handshaking_from[address] -= 1
            if not self.handshaking_from[address]:
                del self.handshaking_from[address]

        def adopted(_: None) -> None:
            handshake_over()
            self._on_node(link)

        def refused(failure: Failure) -> None:
            handshake_over()
            _log.info(
                "a node that dialed in from {peer} failed the handshake: {reason}",
                peer=peer,
                reason=failure.getErrorMessage(),
            )

        link.when_open().addCallbacks(adopted, refused)
        return HeadLinkProtocol(link.owner)
