"""The head's Link F protocol: framing only (docs/protocol.md sections 3 and 4).

:class:`HeadLinkProtocol` turns bytes into typed messages (``wire.FrameDecoder`` and
``wire.decode_message``) and messages into frames (its own send seq, from 1), and forwards
everything to its :class:`LinkOwner`.  It must never decide anything about the link, and never
let an exception escape ``dataReceived``.
"""

from __future__ import annotations

from typing import Protocol as TypingProtocol

from twisted.internet.protocol import Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.head.link.machine import (
    HandshakeError,
    NodeRefusedError,
)
from sfnode.linkf.wire import (
    FrameDecoder,
    Message,
    MsgType,
    WireError,
    decode_message,
    message_frame,
)
from sfnode.runtime.service import describe_failure

_log = Logger(namespace="sfnode.head.link")


class LinkOwner(TypingProtocol):
    """What :class:`HeadLinkProtocol` tells its owner; every call names the connection."""

    def link_made(self, protocol: HeadLinkProtocol) -> None: ...

    def message_received(self, protocol: HeadLinkProtocol, message: Message) -> None: ...

    def link_broken(self, protocol: HeadLinkProtocol, error: Exception) -> None: ...

    def link_lost(self, protocol: HeadLinkProtocol, reason: Failure) -> None: ...


class HeadLinkProtocol(Protocol):
    """Frames in, typed messages out, and back; every decision belongs to the owner.

    Bad bytes (a :class:`~sfnode.linkf.wire.WireError`) or an owner that raises are reported once
    through ``link_broken``; after that the connection's input is ignored and the owner is
    expected to close it.  Nothing ever escapes ``dataReceived``.
    """

    def __init__(self, owner: LinkOwner) -> None:
        self.owner = owner
        self._decoder = FrameDecoder(handshake=MsgType.HELLO_ACK_F)
        self._send_seq = 1
        self._broken = False

    def connectionMade(self) -> None:
        # Frames are small and answered (a stage forward, a renewal): without TCP_NODELAY,
        # Nagle's algorithm holds a frame until the node acknowledges the one before it, which
        # is after its answer has been computed, as the node's own protocol avoids too.
        no_delay = getattr(self.transport, "setTcpNoDelay", None)
        if no_delay is not None:
            no_delay(True)
        self.owner.link_made(self)

    def dataReceived(self, data: bytes) -> None:
        if self._broken:
            return
        frames, error = self._decoder.feed_whole(data)
        for frame in frames:
            if self._broken:
                return
            try:
                message = decode_message(frame.msg_type, frame.payload)
            except WireError as e:
                self._break(e)
                return
            try:
                self.owner.message_received(self, message)
            except Exception as e:
                _log.failure("the owner of a head link failed on {message!r}", message=message)
                self._break(e)
                return
        if error is not None and not self._broken:
            self._break(error)

    def fail(self, error: Exception) -> None:
        """The owner found the peer's messages unacceptable: report it as broken input."""
        if not self._broken:
            self._break(error)

    def _break(self, error: Exception) -> None:
        self._broken = True
        try:
            self.owner.link_broken(self, error)
        except Exception:
            _log.failure("the owner of a head link failed on a broken link")
            self.abort()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        if not self._broken:
            try:
                self._decoder.finish()
            except WireError as e:
                _log.info("a node link ended mid-frame: {error}", error=str(e))
        self.owner.link_lost(self, reason)

    def send(self, message: Message) -> None:
        """Write one message as the next frame of this connection."""
        if self.transport is None:
            return
        self.transport.write(message_frame(message, self._send_seq))
        self._send_seq += 1

    def close(self) -> None:
        if self.transport is not None:
            self.transport.loseConnection()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]


def _noise_unfinished(protocol: HeadLinkProtocol) -> bool:
    """Whether the connection ran over Noise and its handshake never finished."""
    session = getattr(protocol.transport, "session", None)
    return session is not None and not getattr(session, "ready", True)


def handshake_loss(reason: Failure, protocol: HeadLinkProtocol) -> HandshakeError:
    """Why a connection that ended before HELLO_ACK_F failed, in the operator's words."""
    if type(reason.value).__module__.startswith("OpenSSL"):
        return HandshakeError(f"the TLS handshake with the node failed: {reason.value}")
    if _noise_unfinished(protocol):
        return NodeRefusedError(
            "the node closed the connection during the encrypted handshake (if this repeats, "
            "check that it holds the same fleet token)"
        )
    return NodeRefusedError(
        f"the node closed the connection during the handshake ({describe_failure(reason)})"
    )
