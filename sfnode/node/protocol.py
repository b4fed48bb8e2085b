"""The node's Twisted protocol: Link F bytes in, frames to the connection machine; messages out.

:class:`NodeProtocol` only frames: it feeds bytes to a :class:`~sfnode.linkf.wire.FrameDecoder`,
hands every frame (HELLO frames marked as such, none of them decoded) to its
:class:`NodeConnection`, and writes framed messages with a per-connection ``seq``.  A bad frame
closes this one connection with a logged reason; it never raises out of ``dataReceived`` and never
touches another connection or the shared node state.

Back-pressure: each :class:`NodeProtocol` is the streaming producer of its own transport.  When
the head stops reading and the transport's write buffer passes its limit, the protocol is
paused: it stops reading from that head (so nothing the head sends can make more output) and
tells the node, whose generations on that connection then hold their tokens (bounded) instead
of writing them.  A connection closed while paused is aborted, not drained, so a head that
never reads cannot keep it open.

Admission: :class:`NodeFactory` refuses (closes at once) a connection when ``max_handshakes``
connections of its listener are still in their handshake, or ``max_address_handshakes`` of them
come from the peer's address (docs/protocol.md section 5.3: 64 and 8 by default).  Until the
HELLO has arrived, no frame may be larger than a HELLO can be (the decoder's handshake cap,
decision D14).  The tap builds the factories (and their Noise wrapper):
``sfnode.node.tap.node_factory``.

:class:`NodeConnection` is the per-connection owner of the connection machine
(``sfnode.node.machines``); what a frame *means* is decided by the node (:class:`ConnectionHost`,
implemented by ``sfnode.node.agent.NodeAgent``), which all connections of one node share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol as TypingProtocol

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IAddress, IReactorTime, ITCPTransport
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.linkf.handshake import address_key, handshake_slot_refusal
from sfnode.linkf.wire import Frame, FrameDecoder, Hello, Message, MsgType, WireError, message_frame
from sfnode.node.config import DEFAULT_MAX_ADDRESS_HANDSHAKES, DEFAULT_MAX_HANDSHAKES, NodeConfig
from sfnode.node.machines import ConnectionCore, ConnectionInputs, ConnectionMachine
from sfnode.node.reports import NodeReports

log = Logger()


class ConnectionHost(TypingProtocol):
    """What a connection needs from the node it belongs to."""

    clock: IReactorTime
    config: NodeConfig
    """Its handshake, idle and status timings."""

    def read_hello(self, frame: Frame) -> Hello | str:
        """Decode and check a HELLO frame: the HELLO when accepted, else why not."""

    def hello_ack(self) -> Message: ...

    reports: NodeReports
    """Its reports: the TELEMETRY that follows HELLO_ACK_F (docs/protocol.md section 12.9)."""

    def status(self) -> Message: ...

    def serve(self, connection: NodeConnection, frame: Frame) -> None:
        """Handle one frame; may raise :class:`WireError` for a malformed payload."""

    def protocol_opened(self, protocol: NodeProtocol) -> None:
        """A transport is up (handshake not done yet): the node can close it when it stops."""

    def protocol_closed(self, protocol: NodeProtocol) -> None:
        """That transport is gone."""

    def connection_ready(self, connection: NodeConnection) -> None: ...

    def connection_ended(self, connection: NodeConnection) -> None: ...

    def connection_writable(self, connection: NodeConnection, writable: bool) -> None:
        """The head stopped (False) or resumed (True) reading what this connection sends."""


class NodeConnection:
    """One head connection of a node: the owner of its connection machine."""

    def __init__(self, host: ConnectionHost, protocol: NodeProtocol) -> None:
        self._host = host
        self._protocol = protocol
        self.ready = False
        self.handshaken = False
        """True once the HELLO was accepted (stays True after the connection ends)."""
        self.head_id: int | None = None
        """The identity the head gave in its HELLO (None: none, section 12.4): the sessions
        this connection may touch are that head's."""
        self.machine: ConnectionInputs = ConnectionMachine(
            ConnectionCore(
                clock=host.clock,
                owner=self,
                handshake_timeout_ms=host.config.handshake_timeout_ms,
                idle_timeout_ms=host.config.idle_timeout_ms,
                status_interval_ms=host.config.status_interval_ms,
            )
        )

    @property
    def peer(self) -> str:
        return self._protocol.peer_name()

    @property
    def open(self) -> bool:
        """True while messages sent here can still reach the head."""
        return self.ready and self._protocol.is_open

    @property
    def writable(self) -> bool:
        """False while the head does not read what this connection already sent."""
        return not self._protocol.paused

    def send(self, message: Message) -> bool:
        """Send one message; False when the connection is no longer open."""
        return self._protocol.send_message(message)

    # ConnectionOwner

    def check_hello(self, frame: Frame) -> str | None:
        hello = self._host.read_hello(frame)
        if isinstance(hello, str):
            return hello
        self.head_id = hello.head_id
        return None

    def send_hello_ack(self) -> None:
        self.ready = True
        self.handshaken = True
        self.send(self._host.hello_ack())
        self.send(self._host.reports.platform())
        log.info("handshake with {peer} done", peer=self.peer)
        self._host.connection_ready(self)

    def send_status(self) -> None:
        self.send(self._host.status())

    def serve(self, frame: Frame) -> None:
        try:
            self._host.serve(self, frame)
        except WireError as e:
            self.close(f"malformed {_type_name(frame.msg_type)} payload: {e}")

    def close(self, reason: str) -> None:
        self._protocol.close(reason)

    def ended(self) -> None:
        was_ready, self.ready = self.ready, False
        if was_ready:
            self._host.connection_ended(self)


def _type_name(msg_type: int) -> str:
    try:
        return MsgType(msg_type).name
    except ValueError:
        return f"0x{msg_type:04x}"


class NodeProtocol(Protocol):
    """Frames Link F bytes for one connection of a node."""

    def __init__(self, host: ConnectionHost, address: str = "") -> None:
        self._host = host
        self._decoder = FrameDecoder(handshake=MsgType.HELLO)
        self._send_seq = 0
        self._closing = False
        self.address = address
        """The peer's host (its slot in the per-address handshake count), "" when unknown."""
        self.close_reason: str | None = None
        """Why this side closed the connection, when it did."""
        self.connection: NodeConnection | None = None
        self.lost: Deferred[None] = Deferred()
        """Fires once the transport is gone."""
        self.paused = False
        """True while the transport's write buffer is over its limit (the head is not reading)."""

    @property
    def is_open(self) -> bool:
        return bool(self.connected) and not self._closing

    def peer_name(self) -> str:
        if self.transport is None:
            return "a closed connection"
        peer: IAddress = self.transport.getPeer()
        host = getattr(peer, "host", None)
        port = getattr(peer, "port", None)
        return f"{host}:{port}" if host is not None else str(peer)

    def connectionMade(self) -> None:
        if ITCPTransport.providedBy(self.transport):
            self.transport.setTcpNoDelay(True)
        assert self.transport is not None
        self.transport.registerProducer(self, True)  # type: ignore[attr-defined]
        self.connection = NodeConnection(self._host, self)
        self._host.protocol_opened(self)
        self.connection.machine.connected()

    # IPushProducer: the transport says when the head stops and resumes reading.

    def pauseProducing(self) -> None:
        if self.paused or self._closing:
            return
        self.paused = True
        log.info("{peer} stopped reading: pausing this connection", peer=self.peer_name())
        assert self.transport is not None
        self.transport.pauseProducing()  # type: ignore[attr-defined]
        if self.connection is not None and self.connection.ready:
            self._host.connection_writable(self.connection, False)

    def resumeProducing(self) -> None:
        if not self.paused or self._closing:
            return
        self.paused = False
        assert self.transport is not None
        self.transport.resumeProducing()  # type: ignore[attr-defined]
        if self.connection is not None and self.connection.ready:
            self._host.connection_writable(self.connection, True)

    def stopProducing(self) -> None:
        """The transport is going away; ``connectionLost`` follows and does the cleanup."""

    def dataReceived(self, data: bytes) -> None:
        if self._closing or self.connection is None:
            return
        frames, error = self._decoder.feed_whole(data)
        machine = self.connection.machine
        for frame in frames:
            if self._closing:
                return
            if frame.msg_type == MsgType.HELLO:
                machine.hello(frame)
            else:
                machine.frame(frame)
        if error is not None:
            self.close(f"bad frame: {error}")

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._closing = True
        try:
            if self.connection is not None:
                self.connection.machine.lost()
        finally:
            if isinstance(self.factory, NodeFactory):
                self.factory.protocols.discard(self)
            if self.connection is not None:
                self._host.protocol_closed(self)
            self.lost.callback(None)

    def send_message(self, message: Message) -> bool:
        # The hot path of every token event: is_open spelled out, no extra calls.
        if self._closing or not self.connected or self.transport is None:
            return False
        self._send_seq += 1
        self.transport.write(message_frame(message, self._send_seq))
        return True

    def close(self, reason: str) -> None:
        """Close this connection, once, with a logged reason."""
        if self._closing:
            return
        self._closing = True
        self.close_reason = reason
        log.info(
            "closing the connection from {peer}: {reason}", peer=self.peer_name(), reason=reason
        )
        if self.transport is None:
            return
        if self.paused:
            # Its head is not reading: waiting for the buffer to drain could take forever.
            self.transport.abortConnection()  # type: ignore[attr-defined]
        else:
            self.transport.loseConnection()


@dataclass(eq=False)
class NodeFactory(Factory):
    """Builds a :class:`NodeProtocol` per connection, all sharing one node.

    A connection arriving while ``max_handshakes`` others of this factory are still in their
    handshake (Noise and HELLO), or ``max_address_handshakes`` others from the same address,
    gets no protocol: Twisted closes it at once (docs/protocol.md section 5.3).  0 means no
    limit.
    """

    noisy = False

    host: ConnectionHost
    max_handshakes: int = DEFAULT_MAX_HANDSHAKES
    max_address_handshakes: int = DEFAULT_MAX_ADDRESS_HANDSHAKES
    protocols: set[NodeProtocol] = field(default_factory=set, init=False)
    """Every connection of this factory not yet lost, handshaken or not."""

    def handshaking(self, address: str | None = None) -> int:
        """Connections not lost and not past their handshake (from ``address`` only, if
        given)."""
        return sum(
            1
            for p in self.protocols
            if (p.connection is None or not p.connection.ready)
            and (address is None or p.address == address)
        )

    def buildProtocol(self, addr: IAddress | None) -> NodeProtocol | None:
        address = address_key(addr)
        refusal = handshake_slot_refusal(
            (self.max_handshakes, self.max_address_handshakes),
            self.handshaking(),
            self.handshaking(address),
            address,
        )
        if refusal is not None:
            log.warn("closed a connection from {peer} at once: {why}", peer=addr, why=refusal)
            return None
        protocol = NodeProtocol(self.host, address)
        protocol.factory = self
        self.protocols.add(protocol)
        return protocol
