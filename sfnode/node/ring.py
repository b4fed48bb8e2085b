"""Stage rings on the node (docs/protocol.md section 12.10, decision D29): which rings this node
is a stage of, and its peer links to the next stage of each.

- :class:`RingTable` is pure: each ring's stage (the connection that JOINed it, its layers and
  its ``next`` endpoint), kept until that connection closes.  A JOIN by the ring's owner
  replaces it; a JOIN of a ring another connection holds is refused.
- :class:`PeerLinks` is the thin Twisted shell: one outgoing **peer link** per ``next``
  endpoint, dialled on first use as a head dials a node (sections 5.1 and 5.2: the Noise
  initiator with the node's fleet token, HELLO with role HeadDaemon, the token as auth and a
  fresh ``head_id``), that carries STAGE_RING_ROWS only.  It reads nothing from the peer but the
  HELLO_ACK_F, keeps the link open with KEEPALIVE as a head does (the accepting node drops idle
  connections, section 7.1), and redials on the next use after a close.  Rows it cannot deliver
  (no link could be opened, its handshake failed, or it closed with them unsent) go back to
  the caller so that they can be reported to the ring's head.

Only ``tcp:`` endpoints are dialled, and without a fleet token only loopback ones (section
5.3).  Nothing here decides what a row means: :mod:`sfnode.node.responders` does.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IAddress, IDelayedCall, IReactorTime, ITCPTransport
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.linkf.handshake import dialed_host, is_loopback_head
from sfnode.linkf.noise import Role, secure_factory
from sfnode.linkf.wire import (
    PROTO_VERSION,
    FrameDecoder,
    Hello,
    Keepalive,
    LinkRole,
    Message,
    MsgType,
    StageRingRowsMsg,
    message_frame,
)

log = Logger()

PEER_KEEPALIVE_S = 15.0
"""A KEEPALIVE goes out on an open peer link this often, as a head's does (docs/protocol.md
section 8), well within the accepting node's idle timeout (section 7.1)."""


@dataclass(frozen=True)
class RingStage:
    """This node's stage of one ring: rows run against ``owner``'s stage sessions in
    ``[start_layer, end_layer)``, and what they give goes to ``next``."""

    owner: Hashable
    start_layer: int
    end_layer: int
    next: str


class RingTable:
    """The rings this node is a stage of, by ring id (docs/protocol.md section 12.10)."""

    def __init__(self) -> None:
        self._rings: dict[int, RingStage] = {}

    def join(
        self, owner: Hashable, ring: int, start_layer: int, end_layer: int, next: str
    ) -> str | None:
        """Record ``owner``'s JOIN of ``ring`` (replacing its own earlier one): None, or why it
        is refused (another connection holds the ring)."""
        held = self._rings.get(ring)
        if held is not None and held.owner is not owner:
            return f"ring {ring} is held by another connection"
        self._rings[ring] = RingStage(owner, start_layer, end_layer, next)
        return None

    def get(self, ring: int) -> RingStage | None:
        return self._rings.get(ring)

    def drop_owner(self, owner: Hashable) -> list[int]:
        """Forget every ring of ``owner`` (its connection closed); the rings forgotten."""
        dropped = [ring for ring, stage in self._rings.items() if stage.owner is owner]
        for ring in dropped:
            del self._rings[ring]
        return dropped

    def __len__(self) -> int:
        return len(self._rings)


RowsLost = Callable[[StageRingRowsMsg, str], None]
"""Told of a STAGE_RING_ROWS a peer link could not deliver, and why."""


def dial_refusal(endpoint: str, token: bytes) -> str | None:
    """Why a ring's ``next`` endpoint is not dialled (docs/protocol.md section 12.10), or None:
    only ``tcp:`` endpoints, and without a fleet token only loopback hosts (section 5.3)."""
    if not endpoint.lower().startswith("tcp:"):
        return f"a ring dials only tcp: endpoints, not {endpoint!r}"
    if dialed_host(endpoint) is None:
        return f"{endpoint!r} is not an endpoint Twisted can dial"
    if not token and not is_loopback_head(endpoint):
        return f"refusing to dial {endpoint} without a fleet token (only loopback hosts)"
    return None


class _PeerProtocol(Protocol):
    """Link F framing of one peer link: HELLO out, HELLO_ACK_F in, then rows and KEEPALIVE
    out and everything the peer sends dropped undecoded."""

    def __init__(self, link: _PeerLink) -> None:
        self._link = link
        self._decoder = FrameDecoder()
        self._seq = 0
        self.acked = False

    def connectionMade(self) -> None:
        if ITCPTransport.providedBy(self.transport):
            self.transport.setTcpNoDelay(True)
        self._link.made(self)
        self.send(Hello((PROTO_VERSION, PROTO_VERSION), LinkRole.HEAD_DAEMON, *self._link.auth))

    def send(self, message: Message) -> None:
        if self.transport is not None:
            self._seq += 1
            self.transport.write(message_frame(message, self._seq))

    def dataReceived(self, data: bytes) -> None:
        if self.acked:
            return  # NODE_STATUS, TELEMETRY...: a peer link reads nothing but the handshake
        frames, error = self._decoder.feed_whole(data)
        if frames:
            if frames[0].msg_type != MsgType.HELLO_ACK_F:
                self.abort(f"expected HelloAckF, got frame type 0x{frames[0].msg_type:04x}")
                return
            self.acked = True
            self._link.acked()
        elif error is not None:
            self.abort(f"bad frame: {error}")

    def abort(self, reason: str) -> None:
        self._link.why = reason
        if self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._link.lost(reason)


class _PeerFactory(Factory):
    noisy = False

    def __init__(self, link: _PeerLink) -> None:
        self._link = link

    def buildProtocol(self, addr: IAddress | None) -> _PeerProtocol:
        return _PeerProtocol(self._link)


class _PeerLink:
    """One peer link: dialling (rows queue), open (rows go out at once), then closed."""

    def __init__(self, links: PeerLinks, endpoint: str) -> None:
        self._links = links
        self.endpoint = endpoint
        self.auth = (links.token, secrets.randbits(64))
        """The HELLO's auth and ``head_id``: the fleet token and a fresh identity."""
        self._queue: list[StageRingRowsMsg] = []
        self._protocol: _PeerProtocol | None = None
        self._open = False
        self._closed = False
        self.why = ""
        """Why the link failed, when this side knows."""
        self.done: defer.Deferred[None] = defer.Deferred()
        """Fires once the link is closed (or never opened)."""
        self._deadline: IDelayedCall | None = None
        self._keepalive: IDelayedCall | None = None
        self._connecting: defer.Deferred[Any] | None = None

    def dial(self) -> None:
        """Dial the endpoint, the whole handshake bounded by the handshake timeout (a dial
        that fails at once ends the link at once)."""
        from twisted.internet.endpoints import clientFromString

        links = self._links
        self._deadline = links.clock.callLater(links.handshake_timeout_s, self._late)
        factory = secure_factory(
            _PeerFactory(self),
            links.token,
            role=Role.INITIATOR,
            clock=links.clock,
            handshake_timeout_s=links.handshake_timeout_s,
        )
        endpoint = clientFromString(links.reactor, self.endpoint)  # type: ignore[no-untyped-call]
        connecting: defer.Deferred[Any] = endpoint.connect(factory)
        if not connecting.called:
            self._connecting = connecting
        connecting.addCallbacks(self._connected, self._not_connected)

    def send(self, message: StageRingRowsMsg) -> None:
        if self._open and self._protocol is not None:
            self._protocol.send(message)
        else:
            self._queue.append(message)

    def made(self, protocol: _PeerProtocol) -> None:
        self._protocol = protocol

    def acked(self) -> None:
        self._stop_deadline()
        self._open = True
        log.info("peer link to {endpoint} open", endpoint=self.endpoint)
        queued, self._queue = self._queue, []
        for message in queued:
            self.send(message)
        self._keepalive = self._links.clock.callLater(PEER_KEEPALIVE_S, self._keep_alive)

    def _keep_alive(self) -> None:
        if self._protocol is not None:
            self._protocol.send(Keepalive())
        self._keepalive = self._links.clock.callLater(PEER_KEEPALIVE_S, self._keep_alive)

    def _connected(self, protocol: Any) -> None:
        self._connecting = None

    def _not_connected(self, failure: Failure) -> None:
        self._connecting = None
        self.why = self.why or f"could not connect: {failure.getErrorMessage()}"
        self._ended()

    def _late(self) -> None:
        self._deadline = None
        self.close(f"no handshake within {self._links.handshake_timeout_s:g} s")

    def _stop_deadline(self) -> None:
        deadline, self._deadline = self._deadline, None
        if deadline is not None and deadline.active():
            deadline.cancel()

    def close(self, reason: str) -> None:
        """Close the link (a dial in progress is cancelled)."""
        self.why = self.why or reason
        if self._connecting is not None:
            self._connecting.cancel()
        elif self._protocol is not None:
            self._protocol.abort(self.why)

    def lost(self, reason: Failure) -> None:
        self.why = self.why or (
            "closed by the peer"
            if self._open
            else "closed at the handshake (another fleet token, or not a node)"
        )
        self._ended()

    def _ended(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop_deadline()
        keepalive, self._keepalive = self._keepalive, None
        if keepalive is not None and keepalive.active():
            keepalive.cancel()
        self._links.ended(self)
        log.info("peer link to {endpoint} closed: {why}", endpoint=self.endpoint, why=self.why)
        queued, self._queue = self._queue, []
        for message in queued:
            self._links.on_lost(message, f"the peer link to {self.endpoint}: {self.why}")
        self.done.callback(None)


class PeerLinks:
    """This node's peer links, one per ``next`` endpoint (see the module).

    ``reactor`` dials (Twisted's ``clientFromString``) and, as :attr:`clock`, times the
    handshake, which ``handshake_timeout_s`` bounds from the dial to the HELLO_ACK_F, and the
    KEEPALIVEs; ``token`` is the node's fleet token (empty: plaintext, loopback only);
    ``on_lost`` is told of every STAGE_RING_ROWS not delivered.
    """

    def __init__(
        self,
        reactor: IReactorTime,
        *,
        token: bytes,
        handshake_timeout_s: float,
        on_lost: RowsLost,
    ) -> None:
        self.reactor = reactor
        self.clock: IReactorTime = reactor
        """What times the handshake and the KEEPALIVEs (the reactor, unless a test says)."""
        self.token = token
        self.handshake_timeout_s = handshake_timeout_s
        self.on_lost = on_lost
        self._links: dict[str, _PeerLink] = {}
        self._stopped = False

    def send(self, endpoint: str, message: StageRingRowsMsg) -> None:
        """Send ``message`` to the node at ``endpoint``, dialling it first when no link is
        open or opening; a message that cannot go is given to ``on_lost``."""
        link = self._links.get(endpoint)
        if link is None:
            refusal = dial_refusal(endpoint, self.token)
            if self._stopped:
                refusal = "the node is stopping"
            if refusal is not None:
                log.info("rows of ring {ring} lost: {why}", ring=message.ring, why=refusal)
                self.on_lost(message, refusal)
                return
            link = self._links[endpoint] = _PeerLink(self, endpoint)
            link.send(message)
            link.dial()
            return
        link.send(message)

    def ended(self, link: _PeerLink) -> None:
        if self._links.get(link.endpoint) is link:
            del self._links[link.endpoint]

    def __len__(self) -> int:
        """Peer links open or opening."""
        return len(self._links)

    def close(self) -> defer.Deferred[None]:
        """Close every peer link (the node stops); fires once all are closed."""
        self._stopped = True
        links = list(self._links.values())
        for link in links:
            link.close("the node is stopping")
        return defer.gatherResults([link.done for link in links]).addCallback(lambda _: None)
