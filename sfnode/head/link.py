"""The head's Link F connection to one node, on Twisted (LINKF 4.3, 7.2, 7.3).

Three pieces, layered like the node side:

- :class:`HeadLinkProtocol` only turns bytes into typed messages (``wire.FrameDecoder`` and
  ``wire.decode_message``) and messages into frames (its own send seq, from 1).  It decides
  nothing; it forwards everything to its owner.
- :class:`~sfnode.head.session.HeadSession` (pure) keeps the bookkeeping and builds messages.
- :class:`NodeLink` is the owner that wires them to the reactor: the handshake, the Deferred
  API (assign, append, generate, stage_forward, ...), lease grants, status, reconnect and
  reconcile.

:class:`HeadIds` holds the process-wide id spaces (LINKF 7.2); pass one instance around
explicitly.  With a fleet token every connection is Noise (``sfnode.noise``, D10) with the head
as the initiator, whichever side dialled; ``Hello.auth`` still carries the token inside it.
The reactor and the clock are always parameters: this module must never import the global
reactor, never block, and never let an exception escape ``dataReceived``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast
from typing import Protocol as TypingProtocol

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import clientFromString
from twisted.internet.interfaces import IDelayedCall, IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.admission import is_loopback_address
from sfnode.head.session import HeadSession
from sfnode.noise import NoiseFactory, NoiseProtocol, Role, secure_factory
from sfnode.wire import (
    CapacitySummary,
    Finish,
    FrameDecoder,
    GenerateCancelMsg,
    GenerationBudgetsMsg,
    GenParams,
    Hello,
    HelloAckF,
    Keepalive,
    Lease,
    LeaseRenewMsg,
    LinkRole,
    Message,
    NodeStatusMsg,
    PayloadError,
    ReconcileAckMsg,
    StageForwardReqMsg,
    StageForwardRespMsg,
    TokenEventsMsg,
    Tokens,
    WireError,
    decode_message,
    encode_params,
    message_frame,
)

PROTO_RANGE = (2, 2)
DEFAULT_LEASE = Lease(duration_ms=60_000, renew_by_ms=45_000)
DEFAULT_PARAMS = GenParams()
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
DEFAULT_JOIN_HANDSHAKES = 8
"""LINKF 4.6: nodes dialing a head that may be in their handshake at once."""
COMMAND_SPACE = 1 << 32
"""Command ids each connection's HeadSession may use before the next connection's base."""
MAX_RETRY_RANGE = 1 << 20
"""The most seqs one RetryRange may ask the head to wait for."""

_log = Logger(namespace="sfnode.head.link")


# --------------------------------------------------------------------------------------------
# Errors


class LinkError(Exception):
    """Something went wrong on a head's link to a node."""


class HandshakeError(LinkError):
    """The link never got past HELLO / HELLO_ACK_F."""


class HandshakeTimeoutError(HandshakeError):
    """No HELLO_ACK_F arrived within the handshake timeout."""


class NodeRefusedError(HandshakeError):
    """The node closed the connection during the handshake (it refused the head)."""


class LinkLostError(LinkError):
    """The connection is gone; calls that depended on it cannot complete on it."""


class MalformedFrameError(LinkError):
    """The node sent bytes that are not Link F; the connection was closed."""


class ReconcileError(LinkError):
    """A reconnect's RECONCILE did not complete."""


class UnknownSessionError(LinkError):
    """The head did not assign this session on this link."""


class SessionRevokedError(LinkError):
    """The head revoked the session while a call on it was pending."""


class SupersededError(LinkError):
    """The head re-assigned the session at a new epoch; the node drops older generations."""


LinkLost = LinkLostError
NodeRefused = NodeRefusedError


# --------------------------------------------------------------------------------------------
# Process-wide ids


def _handshake_loss(reason: Failure) -> HandshakeError:
    """Why a connection that ended before HELLO_ACK_F failed, in the operator's words."""
    if type(reason.value).__module__.startswith("OpenSSL"):
        return HandshakeError(f"the TLS handshake with the node failed: {reason.value}")
    return NodeRefusedError(
        "the node closed the connection at the handshake (likely a fleet token mismatch)"
    )


class HeadIds:
    """The head's process-wide id spaces (LINKF 7.2).

    Epochs come from one counter starting at 1, one per assign (any session, any link).  Each
    link's HeadSession starts its command ids at a base that advances by 2^32 per link (1,
    2^32+1, ...), so a node never sees one command id twice.
    """

    def __init__(self) -> None:
        self._last_epoch = 0
        self._links = 0

    def next_epoch(self) -> int:
        self._last_epoch += 1
        return self._last_epoch

    def next_command_base(self) -> int:
        base = self._links * COMMAND_SPACE + 1
        self._links += 1
        return base


# --------------------------------------------------------------------------------------------
# The protocol: framing only


class LinkOwner(TypingProtocol):
    """What :class:`HeadLinkProtocol` tells its owner; every call names the connection."""

    def link_made(self, protocol: HeadLinkProtocol) -> None: ...

    def message_received(self, protocol: HeadLinkProtocol, message: Message) -> None: ...

    def link_broken(self, protocol: HeadLinkProtocol, error: Exception) -> None: ...

    def link_lost(self, protocol: HeadLinkProtocol, reason: Failure) -> None: ...


class HeadLinkProtocol(Protocol):
    """Frames in, typed messages out, and back; every decision belongs to the owner.

    Bad bytes (a :class:`~sfnode.wire.WireError`) or an owner that raises are reported once
    through ``link_broken``; after that the connection's input is ignored and the owner is
    expected to close it.  Nothing ever escapes ``dataReceived``.
    """

    def __init__(self, owner: LinkOwner) -> None:
        self.owner = owner
        self._decoder = FrameDecoder()
        self._send_seq = 1
        self._broken = False

    def connectionMade(self) -> None:
        self.owner.link_made(self)

    def dataReceived(self, data: bytes) -> None:
        if self._broken:
            return
        error: WireError | None = None
        try:
            frames = self._decoder.feed(data)
        except WireError as e:
            # The frames ahead of the bad bytes are whole: they are handled first.
            frames, error = e.frames_before, e
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


class _DialFactory(Factory):
    """Builds the one protocol of a dial, owned by its link."""

    def __init__(self, link: NodeLink) -> None:
        self._link = link

    def buildProtocol(self, addr: Any) -> HeadLinkProtocol:
        return HeadLinkProtocol(self._link)


# --------------------------------------------------------------------------------------------
# Generations


@dataclass(frozen=True, slots=True)
class GenerationOutcome:
    """The tokens a generation committed, in order, and its finish reason."""

    tokens: list[int]
    finish: int


class GenerationCall:
    """One GENERATE_REQ in flight: its result and a way to cancel it.

    ``result`` fires with a :class:`GenerationOutcome` when the node's Finish arrives (any
    finish, DECLINED and REFUSED included), or fails with a :class:`LinkError` when the link
    loses it.  Cancelling ``result`` itself also sends GENERATE_CANCEL and forgets the call.
    """

    def __init__(
        self,
        link: NodeLink,
        session_id: int,
        generation_id: int,
        epoch: int,
        on_tokens: Callable[[Sequence[int]], None] | None,
    ) -> None:
        self.session_id = session_id
        self.generation_id = generation_id
        self.epoch = epoch
        self.tokens: list[int] = []
        """Tokens delivered so far (committed events only, each once)."""
        self.finish: int | None = None
        self.result: Deferred[GenerationOutcome] = Deferred(self._cancel_result)
        self._link = link
        self._on_tokens = on_tokens
        self._cancel_sent = False

    @property
    def done(self) -> bool:
        return self.result.called

    def cancel(self) -> None:
        """Ask the node to stop (GENERATE_CANCEL, sent at most once); the Finish still comes."""
        if self._cancel_sent or self.done:
            return
        if self._link.send_now(GenerateCancelMsg(self.session_id, self.generation_id)):
            self._cancel_sent = True

    def _cancel_result(self, _: Deferred[GenerationOutcome]) -> None:
        self.cancel()
        self._link._forget_generation(self)

    def _deliver(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        if self._on_tokens is not None:
            try:
                self._on_tokens(tokens)
            except Exception:
                _log.failure("an on_tokens callback failed")

    def _complete(self) -> None:
        assert self.finish is not None
        if not self.result.called:
            self.result.callback(GenerationOutcome(list(self.tokens), self.finish))

    def _fail(self, error: Exception) -> None:
        if not self.result.called:
            self.result.errback(error)


# --------------------------------------------------------------------------------------------
# The owner


class _Phase(enum.Enum):
    HANDSHAKING = "handshaking"
    OPEN = "open"
    RECONCILING = "reconciling"
    DOWN = "down"
    CLOSED = "closed"


class _Reconcile:
    """What a reconnect's RECONCILE is waiting for."""

    def __init__(self, timer: IDelayedCall) -> None:
        self.done: Deferred[None] = Deferred()
        self.timer = timer
        self.seen: set[tuple[int, int, int]] = set()
        """(session, generation, seq) of every event that arrived since RECONCILE was sent."""
        self.missing: set[tuple[int, int, int]] | None = None
        """Retry-range seqs not arrived yet; None until RECONCILE_ACK."""
        self.held: list[int] = []
        self.not_held: list[int] = []
        self.retried: set[tuple[int, int]] = set()
        """(session, generation) of every RetryRange the node announced."""


class NodeLink:
    """The head's side of one Link F connection to one node (LINKF 7.2).

    Build it with :func:`connect_node` (the head dials) or :class:`HeadLinkFactory` (the node
    dials the head).  In both the head says HELLO first.

    Sends (:meth:`assign`, :meth:`append`, :meth:`revoke`, :meth:`keepalive`) are
    fire-and-forget: while the link is down they only update the bookkeeping, and a
    :meth:`reconnect` puts the node right.  Calls that wait (:meth:`generate`,
    :meth:`stage_forward`) fail with :class:`LinkError` subclasses when the link loses them.

    When the connection drops, every Deferred from :meth:`when_closed` fires with the reason;
    an owner may call :meth:`reconnect` right there to keep pending generations waiting for
    their retransmitted events.  Otherwise they fail with :class:`LinkLostError` at once.  A
    malformed frame fails every pending call with :class:`MalformedFrameError`.
    """

    def __init__(
        self,
        reactor: Any,
        ids: HeadIds,
        *,
        token: bytes = b"",
        endpoint: IStreamClientEndpoint | None = None,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        clock: IReactorTime | None = None,
        keep_wal: bool = True,
    ) -> None:
        self._reactor = reactor
        self._clock: IReactorTime = clock if clock is not None else reactor
        self.ids = ids
        self.token = token
        self._endpoint = endpoint
        self.handshake_timeout_s = handshake_timeout_s
        self.keep_wal = keep_wal
        """False forgets a generation's committed events once its call completed."""
        self.head_session = HeadSession(ids.next_command_base())
        self.hello_ack: HelloAckF | None = None
        self.capacity: CapacitySummary | None = None
        self.models: tuple[str, ...] = ()
        self._phase = _Phase.DOWN
        self._protocol: HeadLinkProtocol | None = None
        self._connecting: Deferred[Any] | None = None
        self._handshake: Deferred[None] | None = None
        self._handshake_timer: IDelayedCall | None = None
        self._reconcile: _Reconcile | None = None
        self._next_generation = 1
        self._generations: dict[tuple[int, int], GenerationCall] = {}
        self._suspended: set[tuple[int, int]] = set()
        """Generations in flight when the link dropped; a reconnect settles them."""
        self._stage_forwards: dict[int, Deferred[StageForwardRespMsg]] = {}
        self._drop_reason: Exception | None = None
        self._closed_waiters: list[Deferred[Exception]] = []
        self._close_waiters: list[Deferred[None]] = []

    # ----------------------------------------------------------------------------------------
    # State seen by owners

    @property
    def node_identity(self) -> str:
        return self.hello_ack.node_identity if self.hello_ack is not None else "<unknown node>"

    @property
    def connected(self) -> bool:
        """Whether the link is up and past its handshake (a reconcile may still be running)."""
        return self._phase in (_Phase.OPEN, _Phase.RECONCILING)

    @property
    def dialable(self) -> bool:
        """Whether :meth:`reconnect` can dial the node again (the head dialed it)."""
        return self._endpoint is not None

    def pending_generations(self) -> list[GenerationCall]:
        return list(self._generations.values())

    def when_closed(self) -> Deferred[Exception]:
        """A Deferred that fires with the reason the next time the connection drops.

        If the link is down already it fires at once with the last reason.  A connection that
        :meth:`reconnect` replaces on purpose, or one that never finished its handshake, is
        not reported here (their own Deferreds say how they ended).
        """
        d: Deferred[Exception] = Deferred()
        if self._phase in (_Phase.DOWN, _Phase.CLOSED) and self._drop_reason is not None:
            d.callback(self._drop_reason)
        else:
            self._closed_waiters.append(d)
        return d

    # ----------------------------------------------------------------------------------------
    # Head -> node

    def send_now(self, message: Message) -> bool:
        """Send one message if the link is up; False (and nothing sent) otherwise."""
        if self._protocol is None or not self.connected:
            return False
        self._protocol.send(message)
        return True

    def _send_optional(self, message: Message | None) -> None:
        if message is not None:
            self.send_now(message)

    def assign(
        self,
        session_id: int,
        *,
        lease: Lease = DEFAULT_LEASE,
        params: GenParams = DEFAULT_PARAMS,
        qos_class: int = 0,
        codec: str = "",
    ) -> int:
        """SESSION_ASSIGN with a new process-wide epoch, which is returned.

        Pending generations of the session fail with :class:`SupersededError`: the node drops
        the generations of an older epoch when a higher one is assigned (LINKF 5.2).
        """
        epoch = self.ids.next_epoch()
        for key, call in list(self._generations.items()):
            if key[0] == session_id:
                self._forget_generation(call)
                call._fail(
                    SupersededError(f"session {session_id} was re-assigned at epoch {epoch}")
                )
        self.send_now(
            self.head_session.assign_session(
                session_id,
                epoch,
                lease,
                params=encode_params(params),
                qos_class=qos_class,
                codec=codec,
            )
        )
        return epoch

    def append(self, session_id: int, tokens: Sequence[int]) -> None:
        """APPEND_CONTENT: ``tokens`` is the session's COMPLETE context, replacing the old one."""
        message = self.head_session.append(session_id, tokens)
        if message is None:
            raise UnknownSessionError(f"session {session_id} was not assigned on this link")
        self.send_now(message)

    def revoke(self, session_id: int, *, epoch: int | None = None) -> None:
        """SESSION_REVOKE; the session's pending generations fail with :class:`SessionRevokedError`.

        A session this link does not know is revoked only when ``epoch`` is given.
        """
        self._send_optional(self.head_session.revoke(session_id, epoch=epoch))
        for key, call in list(self._generations.items()):
            if key[0] == session_id:
                self._forget_generation(call)
                call._fail(SessionRevokedError(f"session {session_id} was revoked"))

    def keepalive(self) -> None:
        self.send_now(Keepalive())

    def generate(
        self,
        session_id: int,
        max_new_tokens: int,
        *,
        max_wall_ms: int = 0,
        on_tokens: Callable[[Sequence[int]], None] | None = None,
    ) -> GenerationCall:
        """GENERATE_REQ with a new generation id; committed tokens stream to ``on_tokens``.

        The call's ``result`` fails at once with :class:`UnknownSessionError` or
        :class:`LinkLostError` when the session was never assigned here or the link is down.
        """
        generation_id = self._next_generation_id()
        epoch = self.head_session.epoch_of(session_id)
        call = GenerationCall(self, session_id, generation_id, epoch or 0, on_tokens)
        if epoch is None:
            call._fail(UnknownSessionError(f"session {session_id} was not assigned on this link"))
            return call
        if not self.connected:
            call._fail(LinkLostError(f"the link to {self.node_identity} is down"))
            return call
        request = self.head_session.generate(
            session_id, generation_id, GenerationBudgetsMsg(max_new_tokens, max_wall_ms)
        )
        assert request is not None
        self._generations[(session_id, generation_id)] = call
        self.send_now(request)
        return call

    def stage_forward(
        self,
        tokens: Sequence[int],
        start_layer: int,
        end_layer: int,
        hidden_in: bytes | None = None,
    ) -> Deferred[StageForwardRespMsg]:
        """STAGE_FORWARD_REQ; fires with the STAGE_FORWARD_RESP of the same request_id."""
        request_id = self._next_generation_id()
        if not self.connected:
            return defer.fail(LinkLostError(f"the link to {self.node_identity} is down"))

        def forget(_: Deferred[StageForwardRespMsg]) -> None:
            self._stage_forwards.pop(request_id, None)

        d: Deferred[StageForwardRespMsg] = Deferred(forget)
        self._stage_forwards[request_id] = d
        self.send_now(
            StageForwardReqMsg(request_id, tuple(tokens), start_layer, end_layer, hidden_in)
        )
        return d

    def close(self) -> Deferred[None]:
        """Close the link for good; pending calls fail with :class:`LinkLostError`.

        Fires once the connection is gone.
        """
        d: Deferred[None] = Deferred()
        if self._phase is _Phase.CLOSED and self._protocol is None:
            d.callback(None)
            return d
        self._phase = _Phase.CLOSED
        self._drop_reason = LinkLostError("the head closed the link")
        if self._protocol is None:
            if self._connecting is not None:
                self._connecting.cancel()
            self._fail_handshake(self._drop_reason)
            self._fail_stage_forwards(self._drop_reason)
            self._fail_generations(self._drop_reason)
            d.callback(None)
            return d
        self._close_waiters.append(d)
        self._protocol.close()
        return d

    def _next_generation_id(self) -> int:
        generation_id = self._next_generation
        self._next_generation += 1
        return generation_id

    # ----------------------------------------------------------------------------------------
    # Dialing, handshake, reconnect

    def dial(self) -> Deferred[None]:
        """Connect and handshake (LINKF 4.3); fires once HELLO_ACK_F arrived.

        Only for a link that is down; :func:`connect_node` and :meth:`reconnect` call it.
        """
        if self._endpoint is None:
            return defer.fail(LinkError("a node that dialed the head cannot be dialed back"))
        if self._phase is not _Phase.DOWN or self._protocol is not None:
            return defer.fail(LinkError(f"cannot dial a link that is {self._phase.value}"))
        d = self._begin_handshake()
        connecting = self._endpoint.connect(
            secure_factory(
                _DialFactory(self),
                self.token,
                role=Role.INITIATOR,
                clock=self._clock,
                handshake_timeout_s=self.handshake_timeout_s,
            )
        )
        if self._handshake is d:
            self._connecting = connecting

        def connected(_: object) -> None:
            self._connecting = None

        def failed(failure: Failure) -> None:
            self._connecting = None
            self._fail_handshake(
                HandshakeError(f"could not connect for the handshake: {failure.getErrorMessage()}")
            )

        connecting.addCallbacks(connected, failed)
        return d

    def reconnect(self) -> Deferred[None]:
        """Drop the connection, dial again, handshake and reconcile (LINKF 7.3).

        Generations in flight when the link dropped keep waiting when the node still holds
        their session and shows it has them (committed events, a retry range, or events since
        the RECONCILE): their retransmitted events, and the rest of the stream the node moves
        to the new connection (decision D2), complete them normally.  The others fail with
        :class:`LinkLostError` once the reconcile is done (the caller decides on failover).
        Held sessions get their stored context appended again; sessions the node no longer
        holds are re-assigned at the same epoch (new command id) and appended.
        """
        if self._endpoint is None:
            return defer.fail(LinkError("a node that dialed the head cannot be dialed back"))
        if self._phase in (_Phase.HANDSHAKING, _Phase.RECONCILING, _Phase.CLOSED):
            return defer.fail(LinkError(f"cannot reconnect a link that is {self._phase.value}"))
        old = self._protocol
        if old is not None:
            # Detached first: its loss is no longer news to anyone.
            self._protocol = None
            old.abort()
        self._phase = _Phase.DOWN
        self._suspended.update(self._generations)
        self._drop_reason = None
        d = self.dial()
        d.addCallback(lambda _: self._start_reconcile())
        d.addErrback(self._reconnect_failed)
        return d

    def _reconnect_failed(self, failure: Failure) -> Failure:
        lost = LinkLostError(
            f"reconnect to {self.node_identity} failed: {failure.getErrorMessage()}"
        )
        self._fail_stage_forwards(lost)
        self._fail_generations(lost)
        return failure

    def _begin_handshake(self) -> Deferred[None]:
        self._phase = _Phase.HANDSHAKING
        d: Deferred[None] = Deferred()
        self._handshake = d
        self._handshake_timer = self._clock.callLater(
            self.handshake_timeout_s, self._handshake_timed_out
        )
        return d

    def _handshake_timed_out(self) -> None:
        self._handshake_timer = None
        if self._connecting is not None:
            connecting, self._connecting = self._connecting, None
            connecting.cancel()
        self._fail_handshake(
            HandshakeTimeoutError(
                f"no HELLO_ACK_F within {self.handshake_timeout_s} s: the handshake timed out"
            )
        )

    def _stop_handshake_timer(self) -> None:
        timer, self._handshake_timer = self._handshake_timer, None
        if timer is not None and timer.active():
            timer.cancel()

    def _fail_handshake(self, error: Exception) -> None:
        d, self._handshake = self._handshake, None
        if d is None:
            return
        self._stop_handshake_timer()
        protocol, self._protocol = self._protocol, None
        if self._phase is not _Phase.CLOSED:
            self._phase = _Phase.DOWN
        self._drop_reason = error
        if protocol is not None:
            protocol.abort()
        d.errback(error)

    def _handshake_message(self, message: Message) -> None:
        if not isinstance(message, HelloAckF):
            error = HandshakeError(f"expected HelloAckF, got {type(message).__name__}")
            _log.error("handshake with a node failed: {error}", error=str(error))
            self._fail_handshake(error)
            return
        d, self._handshake = self._handshake, None
        self._stop_handshake_timer()
        self.hello_ack = message
        self.capacity = message.capacity
        self.models = message.loadable_models
        self._phase = _Phase.OPEN
        assert d is not None
        d.callback(None)

    def _start_reconcile(self) -> Deferred[None]:
        self._phase = _Phase.RECONCILING
        timer = self._clock.callLater(self.handshake_timeout_s, self._reconcile_timed_out)
        state = _Reconcile(timer)
        self._reconcile = state
        self.send_now(self.head_session.reconcile())
        return state.done

    def _reconcile_timed_out(self) -> None:
        error = ReconcileError(
            f"reconcile with {self.node_identity} timed out after {self.handshake_timeout_s} s"
        )
        protocol, self._protocol = self._protocol, None
        self._drop_reason = error
        self._phase = _Phase.DOWN
        self._end_reconcile(error)
        if protocol is not None:
            protocol.abort()

    def _end_reconcile(self, error: Exception | None) -> None:
        state, self._reconcile = self._reconcile, None
        if state is None:
            return
        if state.timer.active():
            state.timer.cancel()
        if error is not None:
            state.done.errback(error)
            return
        for session_id in state.held:
            self._send_optional(self.head_session.reappend(session_id))
        for session_id in state.not_held:
            self._send_optional(self.head_session.reassign(session_id))
            self._send_optional(self.head_session.reappend(session_id))
        self._phase = _Phase.OPEN
        self._settle_suspended(state)
        state.done.callback(None)

    def _settle_suspended(self, state: _Reconcile) -> None:
        """Keep the suspended generations the node still has; fail the others (LINKF 7.3)."""
        held = set(state.held)
        evidence = state.retried | {(s, g) for s, g, _ in state.seen}
        suspended, self._suspended = self._suspended, set()
        for key in suspended:
            call = self._generations.get(key)
            if call is None:
                continue
            session_id, generation_id = key
            known = key in evidence or (
                self.head_session.watermark(session_id, call.epoch, generation_id) is not None
            )
            if session_id in held and known:
                continue
            self._forget_generation(call)
            call._fail(
                LinkLostError(
                    f"{self.node_identity} lost generation {generation_id} of session "
                    f"{session_id} with the link"
                )
            )

    def _on_reconcile_ack(self, message: ReconcileAckMsg) -> None:
        state = self._reconcile
        if state is None or state.missing is not None:
            return
        missing: set[tuple[int, int, int]] = set()
        for entry in message.sessions:
            if self.head_session.epoch_of(entry.session_id) is None:
                continue
            if entry.held:
                state.held.append(entry.session_id)
            state.retried.update((entry.session_id, r.generation_id) for r in entry.retry_ranges)
            for r in entry.retry_ranges:
                if r.to_seq < r.from_seq or r.to_seq - r.from_seq >= MAX_RETRY_RANGE:
                    if self._protocol is not None:
                        self._protocol.fail(PayloadError(f"unreasonable retry range {r}"))
                    return
                missing.update(
                    (entry.session_id, r.generation_id, seq)
                    for seq in range(r.from_seq, r.to_seq + 1)
                )
        state.not_held = [
            s
            for s in self.head_session.on_reconcile_ack(message)
            if self.head_session.epoch_of(s) is not None
        ]
        state.missing = missing - state.seen
        if not state.missing:
            self._end_reconcile(None)

    # ----------------------------------------------------------------------------------------
    # LinkOwner: what the protocol reports

    def link_made(self, protocol: HeadLinkProtocol) -> None:
        if self._handshake is None or self._protocol is not None:
            protocol.abort()
            return
        self._protocol = protocol
        protocol.send(Hello(PROTO_RANGE, LinkRole.HEAD_DAEMON, self.token))

    def message_received(self, protocol: HeadLinkProtocol, message: Message) -> None:
        if protocol is not self._protocol:
            return
        if self._handshake is not None:
            self._handshake_message(message)
        elif isinstance(message, TokenEventsMsg):
            self._on_token_events(message)
        elif isinstance(message, LeaseRenewMsg):
            self._send_optional(self.head_session.on_lease_renew(message))
        elif isinstance(message, NodeStatusMsg):
            self.capacity = message.capacity
            if message.loadable_models:
                self.models = message.loadable_models
        elif isinstance(message, StageForwardRespMsg):
            d = self._stage_forwards.pop(message.request_id, None)
            if d is not None:
                d.callback(message)
        elif isinstance(message, ReconcileAckMsg):
            self._on_reconcile_ack(message)
        # Anything else a node may send (a repeated HELLO_ACK_F, TELEMETRY, ...) is ignored.

    def link_broken(self, protocol: HeadLinkProtocol, error: Exception) -> None:
        if protocol is not self._protocol:
            protocol.abort()
            return
        if isinstance(error, WireError):
            reason: LinkError = MalformedFrameError(
                f"{self.node_identity} sent a malformed frame: {error}"
            )
        else:
            reason = LinkError(f"handling a frame from {self.node_identity} failed: {error}")
        _log.error("closing the link to {node}: {reason}", node=self.node_identity, reason=reason)
        self._drop_reason = reason
        self._fail_handshake(reason)
        self._end_reconcile(reason)
        self._fail_stage_forwards(reason)
        self._fail_generations(reason)
        protocol.abort()

    def link_lost(self, protocol: HeadLinkProtocol, reason: Failure) -> None:
        if protocol is not self._protocol:
            return
        self._protocol = None
        if self._handshake is not None:
            refused = (
                self._drop_reason
                if self._phase is _Phase.CLOSED and self._drop_reason is not None
                else _handshake_loss(reason)
            )
            self._fail_handshake(refused)
        else:
            self._dropped(reason)
        closers, self._close_waiters = self._close_waiters, []
        for d in closers:
            d.callback(None)

    def _dropped(self, reason: Failure) -> None:
        error = self._drop_reason or LinkLostError(
            f"the link to {self.node_identity} was lost: {reason.getErrorMessage()}"
        )
        self._drop_reason = error
        _log.info("the link to {node} dropped: {reason}", node=self.node_identity, reason=error)
        if self._phase is not _Phase.CLOSED:
            self._phase = _Phase.DOWN
        self._end_reconcile(ReconcileError(f"the link dropped during reconcile: {error}"))
        self._fail_stage_forwards(error)
        self._suspended.update(self._generations)
        waiters, self._closed_waiters = self._closed_waiters, []
        for d in waiters:
            d.callback(error)
        # An owner may have called reconnect() from a when_closed callback: the suspended
        # generations then wait for its reconcile; otherwise they fail now.
        if self._phase in (_Phase.DOWN, _Phase.CLOSED):
            self._fail_generations(error)

    # ----------------------------------------------------------------------------------------
    # Internals

    def _on_token_events(self, message: TokenEventsMsg) -> None:
        ingested = self.head_session.ingest(message)
        for ack in ingested.acks:
            self.send_now(ack)
        committed = {id(event) for event in ingested.committed}
        finished: list[GenerationCall] = []
        state = self._reconcile
        for event in message.events:
            key = (event.session_id, event.generation_id)
            if state is not None:
                seen = (event.session_id, event.generation_id, event.event_seq)
                state.seen.add(seen)
                if state.missing is not None:
                    state.missing.discard(seen)
            call = self._generations.get(key)
            if call is None or call.finish is not None:
                continue
            payload = event.payload
            if isinstance(payload, Tokens):
                if id(event) in committed:
                    call._deliver(payload.tokens)
            elif isinstance(payload, Finish):
                call.finish = payload.reason
                finished.append(call)
        for call in finished:
            self._forget_generation(call)
            if not self.keep_wal:
                self.head_session.forget_committed(call.session_id, call.epoch, call.generation_id)
            call._complete()
        if state is not None and state.missing is not None and not state.missing:
            self._end_reconcile(None)

    def _forget_generation(self, call: GenerationCall) -> None:
        key = (call.session_id, call.generation_id)
        if self._generations.get(key) is call:
            del self._generations[key]
            self._suspended.discard(key)
            self.head_session.retire_generation(call.session_id, call.generation_id)

    def _fail_stage_forwards(self, error: Exception) -> None:
        forwards, self._stage_forwards = self._stage_forwards, {}
        for d in forwards.values():
            d.errback(error)

    def _fail_generations(self, error: Exception) -> None:
        """Fail every pending generation."""
        self._suspended.clear()
        for call in list(self._generations.values()):
            self._forget_generation(call)
            call._fail(error)


# --------------------------------------------------------------------------------------------
# Entry points


def connect_node(
    reactor: Any,
    endpoint: str | IStreamClientEndpoint,
    *,
    ids: HeadIds,
    token: bytes = b"",
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
    clock: IReactorTime | None = None,
    keep_wal: bool = True,
) -> Deferred[NodeLink]:
    """Dial a node (a Twisted endpoint string or endpoint) and handshake.

    Fires with the open :class:`NodeLink`, or fails with :class:`HandshakeTimeoutError`,
    :class:`NodeRefusedError` (the node closed the connection: likely a token mismatch),
    :class:`MalformedFrameError` or :class:`HandshakeError`.
    """
    if isinstance(endpoint, str):
        dialer = cast(
            IStreamClientEndpoint,
            clientFromString(reactor, endpoint),  # type: ignore[no-untyped-call]
        )
    else:
        dialer = endpoint
    link = NodeLink(
        reactor,
        ids,
        token=token,
        endpoint=dialer,
        handshake_timeout_s=handshake_timeout_s,
        clock=clock,
        keep_wal=keep_wal,
    )
    d = link.dial()
    return d.addCallback(lambda _: link)


class HeadLinkFactory(Factory):
    """Accepts nodes that dial the head; each handshaken link goes to ``on_node``.

    The head still speaks first (HELLO, LINKF 4.1).  A connection whose handshake fails is
    logged and closed; ``on_node`` never sees it.

    Admission (LINKF 4.6): with a token every connection is Noise (the head the initiator).
    Without one, ``loopback_only=True`` (what ``sfhead`` passes unless --insecure-no-auth)
    accepts only loopback or Unix-socket peers.  A connection arriving while
    ``max_handshakes`` others are in their handshake is closed at once (0 = no limit).
    """

    def __init__(
        self,
        on_node: Callable[[NodeLink], None],
        *,
        reactor: Any,
        ids: HeadIds,
        token: bytes = b"",
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        clock: IReactorTime | None = None,
        keep_wal: bool = True,
        max_handshakes: int = DEFAULT_JOIN_HANDSHAKES,
        loopback_only: bool = False,
    ) -> None:
        self._on_node = on_node
        self.max_handshakes = max_handshakes
        self.loopback_only = loopback_only
        self.handshaking = 0
        """Links built and not yet past (or failed in) their handshake."""
        self._reactor = reactor
        self._ids = ids
        self._token = token
        self._handshake_timeout_s = handshake_timeout_s
        self._clock = clock
        self._keep_wal = keep_wal
        self._noise = (
            NoiseFactory(
                self,
                token=token,
                role=Role.INITIATOR,
                clock=clock if clock is not None else reactor,
                handshake_timeout_s=handshake_timeout_s,
            )
            if token
            else None
        )

    def buildProtocol(self, addr: Any) -> HeadLinkProtocol | NoiseProtocol | None:
        """The link's protocol, behind Noise (head = initiator) when there is a token; None
        (the connection is closed at once) for a refused peer."""
        if not self._token and self.loopback_only and not is_loopback_address(addr):
            _log.warn(
                "refused a node dialing in from {peer}: no fleet token, so only loopback "
                "peers are accepted (--insecure-no-auth overrides)",
                peer=addr,
            )
            return None
        if self.max_handshakes and self.handshaking >= self.max_handshakes:
            _log.warn(
                "closed a node connection from {peer} at once: {count} handshakes already "
                "in progress",
                peer=addr,
                count=self.max_handshakes,
            )
            return None
        protocol = self._link_protocol(addr)
        if self._noise is None:
            return protocol
        return NoiseProtocol(self._noise, protocol)

    def _link_protocol(self, addr: Any) -> HeadLinkProtocol:
        link = NodeLink(
            self._reactor,
            self._ids,
            token=self._token,
            handshake_timeout_s=self._handshake_timeout_s,
            clock=self._clock,
            keep_wal=self._keep_wal,
        )
        d = link._begin_handshake()
        self.handshaking += 1

        def adopted(_: None) -> None:
            self.handshaking -= 1
            self._on_node(link)

        def refused(failure: Failure) -> None:
            self.handshaking -= 1
            _log.info(
                "a node that dialed in ({peer}) failed the handshake: {reason}",
                peer=addr,
                reason=failure.getErrorMessage(),
            )

        d.addCallbacks(adopted, refused)
        return HeadLinkProtocol(link)
