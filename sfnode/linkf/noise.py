"""The encrypted transport of keyed Link F connections (docs/protocol.md section 5.1, decision D10).

Noise ``NNpsk0_25519_ChaChaPoly_BLAKE2s``, no prologue, empty handshake payloads, PSK =
SHA-256 of the trimmed token text.  The head is always the initiator and the node always the
responder, whoever opened the socket.  Every Noise message, handshake or transport, travels
behind a big-endian u16 length; an application write is cut into chunks of at most 65 519
plaintext bytes, one Noise message each.

Two layers, like the rest of sfnode:

- :class:`NoiseSession` is pure: bytes in, bytes out, no reactor, no socket.  It keeps at most
  one incomplete Noise message (65 537 bytes) buffered, whatever the peer sends.
- :class:`NoiseProtocol` / :class:`NoiseFactory` wrap any Twisted protocol factory (the node's
  :class:`~sfnode.node.protocol.NodeFactory`, the head's link factories).  The wrapped protocol is
  connected at once and may write at once: its plaintext waits, never sent in clear, until the
  handshake is done.  The handshake is bounded by a timeout on the clock it is given.

A responder that cannot read message 1 (another PSK) reports the peer to ``on_refused`` and
closes; any other Noise failure closes the connection with a logged reason, kept in
:attr:`NoiseProtocol.failure` for the owner (a dialing node logs it with its redial).  Nothing
here decides what a refusal means for the process: that is the owner's business.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Callable
from typing import Any

from cryptography.exceptions import InvalidTag
from noise.connection import NoiseConnection
from noise.exceptions import NoiseHandshakeError, NoiseInvalidMessage, NoiseValueError
from twisted.internet.interfaces import (
    IAddress,
    IDelayedCall,
    IProtocol,
    IProtocolFactory,
    IReactorTime,
)
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure

from sfnode.linkf.handshake import describe_address

log = Logger()

NOISE_PROTOCOL_NAME = b"Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s"
MAX_NOISE_MESSAGE = 65_535
TAG_LEN = 16
MAX_CHUNK = MAX_NOISE_MESSAGE - TAG_LEN
"""At most 65 519 plaintext bytes per transport message."""
HANDSHAKE_MESSAGE_LEN = 48
"""Both handshake messages: a 32-byte ephemeral key and the 16-byte tag of an empty payload."""
_LENGTH = struct.Struct(">H")


class Role(enum.Enum):
    INITIATOR = "initiator"
    """The head, always."""
    RESPONDER = "responder"
    """The node, always."""


class NoiseError(Exception):
    """The peer's bytes are not a Noise conversation we can continue; the link must close."""


class NoiseUnauthorized(NoiseError):
    """The responder could not read message 1: the peer holds another fleet token."""


def psk_of(token: bytes) -> bytes:
    """PSK = SHA-256 of the token text (already trimmed, docs/protocol.md section 5.4)."""
    return hashlib.sha256(token).digest()


def frame_message(message: bytes) -> bytes:
    """One Noise message behind its big-endian u16 length."""
    return _LENGTH.pack(len(message)) + message


class NoiseSession:
    """One side of a Noise link as pure logic: feed received bytes, get bytes to send.

    :meth:`start` gives the initiator's message 1 (the responder sends nothing first);
    :meth:`receive` takes any slice of the peer's bytes and returns (handshake bytes to send,
    decrypted plaintext); :meth:`encrypt` frames outgoing plaintext once :attr:`ready`.
    """

    def __init__(self, role: Role, token: bytes) -> None:
        if not token:
            raise ValueError("a Noise link needs a non-empty fleet token")
        self.role = role
        self._noise = NoiseConnection.from_name(NOISE_PROTOCOL_NAME)
        self._noise.set_psks(psk=psk_of(token))
        if role is Role.INITIATOR:
            self._noise.set_as_initiator()
        else:
            self._noise.set_as_responder()
        self._noise.start_handshake()
        self._buffer = bytearray()
        self._started = False
        self.ready = False
        """True once the handshake is done and transport messages flow."""

    def start(self) -> bytes:
        """The first bytes this side sends: message 1 for the initiator, nothing otherwise."""
        if self._started:
            raise NoiseError("the Noise handshake was already started")
        self._started = True
        if self.role is Role.RESPONDER:
            return b""
        return frame_message(bytes(self._noise.write_message(b"")))

    def encrypt(self, plaintext: bytes) -> bytes:
        """``plaintext`` as framed transport messages of at most :data:`MAX_CHUNK` bytes each."""
        if not self.ready:
            raise NoiseError("the Noise handshake is not done yet")
        out = bytearray()
        view = memoryview(plaintext)
        for at in range(0, len(view), MAX_CHUNK):
            out += frame_message(self._noise.encrypt(bytes(view[at : at + MAX_CHUNK])))
        return bytes(out)

    def receive(self, data: bytes) -> tuple[bytes, bytes]:
        """Take the peer's bytes; return (bytes to send back, plaintext now readable).

        :raises NoiseUnauthorized: (responder) message 1 was made with another PSK.
        :raises NoiseError: anything else that is not this Noise conversation.
        """
        self._buffer += data
        reply = bytearray()
        plaintext = bytearray()
        while len(self._buffer) >= 2:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if not self.ready and length != HANDSHAKE_MESSAGE_LEN:
                raise NoiseError(
                    f"expected a {HANDSHAKE_MESSAGE_LEN}-byte Noise handshake message, the peer "
                    f"announced {length} bytes (a plaintext peer, or no fleet token there?)"
                )
            if self.ready and length < TAG_LEN:
                raise NoiseError(f"a {length}-byte Noise transport message is shorter than a tag")
            if len(self._buffer) < 2 + length:
                break
            message = bytes(self._buffer[2 : 2 + length])
            del self._buffer[: 2 + length]
            if self.ready:
                plaintext += self._decrypt(message)
            else:
                reply += self._handshake(message)
        return bytes(reply), bytes(plaintext)

    def _handshake(self, message: bytes) -> bytes:
        try:
            self._noise.read_message(message)
        except (InvalidTag, NoiseInvalidMessage) as e:
            if self.role is Role.RESPONDER:
                raise NoiseUnauthorized("message 1 does not decrypt: another fleet token") from e
            raise NoiseError(f"Noise handshake message 2 does not decrypt: {e!r}") from e
        except (NoiseHandshakeError, NoiseValueError, ValueError) as e:
            raise NoiseError(f"bad Noise handshake message: {e}") from e
        reply = b""
        if self.role is Role.RESPONDER:
            reply = frame_message(bytes(self._noise.write_message(b"")))
        self.ready = bool(self._noise.handshake_finished)
        if not self.ready:
            raise NoiseError("the Noise handshake did not finish after two messages")
        return reply

    def _decrypt(self, message: bytes) -> bytes:
        try:
            return bytes(self._noise.decrypt(message))
        except (InvalidTag, NoiseInvalidMessage) as e:
            raise NoiseError("a Noise transport message does not decrypt") from e


class NoiseProtocol(ProtocolWrapper):
    """Noise around one wrapped protocol; it is the wrapped protocol's transport."""

    factory: NoiseFactory

    def __init__(self, factory: NoiseFactory, wrapped: IProtocol) -> None:
        super().__init__(factory, wrapped)
        self.session = NoiseSession(factory.role, factory.token)
        self._pending: list[bytes] = []
        self._deadline: IDelayedCall | None = None
        self._failed = False
        self.failure: str | None = None
        """Why this side gave up on the Noise conversation, when it did."""

    def peer_name(self) -> str:
        return describe_address(self.transport.getPeer() if self.transport is not None else None)

    def connectionMade(self) -> None:
        timeout = self.factory.handshake_timeout_s
        if timeout > 0:
            self._deadline = self.factory.clock.callLater(timeout, self._timed_out)
        first = self.session.start()
        if first:
            assert self.transport is not None
            self.transport.write(first)

    # Transport, as the wrapped protocol sees it.

    def write(self, data: bytes) -> None:
        if not data or self._failed:
            return
        if not self.session.ready:
            self._pending.append(bytes(data))
            return
        assert self.transport is not None
        self.transport.write(self.session.encrypt(bytes(data)))

    def writeSequence(self, data: Any) -> None:
        self.write(b"".join(data))

    # Protocol, as the real transport sees it.

    def dataReceived(self, data: bytes) -> None:
        if self._failed:
            return
        was_ready = self.session.ready
        try:
            reply, plaintext = self.session.receive(data)
        except NoiseUnauthorized:
            peer = self.peer_name()
            log.warn("refused {peer}: its fleet token differs", peer=peer)
            self._fail(
                "Noise message 1 does not decrypt: the peer holds another fleet token, or is "
                "not a head"
            )
            if self.factory.on_refused is not None:
                self.factory.on_refused(peer)
            return
        except NoiseError as e:
            log.info(
                "closing the Noise link with {peer}: {error}", peer=self.peer_name(), error=str(e)
            )
            self._fail(str(e))
            return
        assert self.transport is not None
        if reply:
            self.transport.write(reply)
        if self.session.ready and not was_ready:
            self._stop_deadline()
            pending, self._pending = self._pending, []
            if pending:
                self.transport.write(self.session.encrypt(b"".join(pending)))
        if plaintext and self.wrappedProtocol is not None:
            self.wrappedProtocol.dataReceived(plaintext)

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        self._stop_deadline()
        self._pending = []
        super().connectionLost(reason)  # type: ignore[no-untyped-call]

    def _timed_out(self) -> None:
        self._deadline = None
        if not self.session.ready:
            log.info(
                "dropped a silent connection from {peer}: no Noise handshake within {timeout} s",
                peer=self.peer_name(),
                timeout=self.factory.handshake_timeout_s,
            )
            self._fail(f"no Noise handshake within {self.factory.handshake_timeout_s:g} s")

    def _stop_deadline(self) -> None:
        deadline, self._deadline = self._deadline, None
        if deadline is not None and deadline.active():
            deadline.cancel()

    def _fail(self, reason: str) -> None:
        self._failed = True
        self.failure = reason
        self._pending = []
        self._stop_deadline()
        if self.transport is not None:
            abort = getattr(self.transport, "abortConnection", None)
            if abort is not None:
                abort()
            else:
                self.transport.loseConnection()


class NoiseFactory(WrappingFactory[NoiseProtocol]):
    """Wraps every protocol of ``wrapped`` in Noise; a None from ``wrapped`` stays None."""

    protocol = NoiseProtocol
    noisy = False

    def __init__(
        self,
        wrapped: IProtocolFactory,
        *,
        token: bytes,
        role: Role,
        clock: IReactorTime,
        handshake_timeout_s: float,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(wrapped)  # type: ignore[no-untyped-call]
        if not token:
            raise ValueError("a Noise link needs a non-empty fleet token")
        self.token = token
        self.role = role
        self.clock = clock
        self.handshake_timeout_s = handshake_timeout_s
        """0 waits forever."""
        self.on_refused = on_refused
        """Called with the peer's name when it holds another token (responder only)."""

    def buildProtocol(self, addr: IAddress | None) -> NoiseProtocol | None:  # type: ignore[override]
        inner = self.wrappedFactory.buildProtocol(addr)
        if inner is None:
            return None
        return self.protocol(self, inner)


def secure_factory(
    factory: IProtocolFactory,
    token: bytes,
    *,
    role: Role,
    clock: IReactorTime,
    handshake_timeout_s: float,
    on_refused: Callable[[str], None] | None = None,
) -> IProtocolFactory:
    """``factory`` behind Noise when ``token`` is non-empty, else ``factory`` itself (D10).

    The one call both sides use: the node as responder (listening or dialing a head), the
    head as initiator (dialing a node, or accepting nodes that dial it).
    """
    if not token:
        return factory
    return NoiseFactory(
        factory,
        token=token,
        role=role,
        clock=clock,
        handshake_timeout_s=handshake_timeout_s,
        on_refused=on_refused,
    )
