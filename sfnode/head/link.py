"""The head's Link F connection to one node, on Twisted (docs/protocol.md sections 5, 6.5, 8).

Four pieces, layered like the node side:

- :class:`HeadLinkProtocol` only turns bytes into typed messages (``wire.FrameDecoder`` and
  ``wire.decode_message``) and messages into frames (its own send seq, from 1).  It decides
  nothing; it forwards everything to its owner.
- :class:`~sfnode.head.session.HeadSession` (pure) keeps the bookkeeping and builds messages.
- :class:`~sfnode.head.machines.LinkMachine` decides *when*: connecting, handshaking, open,
  reconciling, down (waiting to redial) or closed, with every timer that goes with them.
- :class:`NodeLink` is the owner that wires them to the reactor: it carries out what the
  machine asks (dial, say HELLO, reconcile, abort), offers the Deferred API (assign, append,
  generate, stage_forward, ...), answers lease renewals and keeps the node's status.

A link the head dials (:func:`connect_node`, or a fleet's ``--node``) redials on its own: at
once when its connection drops, then with the backoff of its retry policy, and reconciles
its sessions on every new connection; generations in flight when the connection dropped wait
for that reconcile and continue when the node still runs them.  A link a node dialed in
(:class:`HeadLinkFactory`) ends with its connection.

:class:`HeadIds` holds the process-wide id spaces (section 8) and the head's identity, a random
64-bit ``head_id`` sent in every HELLO (section 12.4, decision D13), so that a node keeps this
head's sessions apart from any other head's; pass one instance around explicitly.  Until the
HELLO_ACK_F has arrived no frame may be larger than one can be (decision D14).

With a fleet token every connection is Noise (``sfnode.noise``, D10) with the head as the
initiator, whichever side dialled; ``Hello.auth`` still carries the token inside it.
The reactor and the clock are always parameters: this module must never import the global
reactor, never block, and never let an exception escape ``dataReceived``.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast
from typing import Protocol as TypingProtocol

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import clientFromString
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory, Protocol, connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.admission import address_key, is_loopback_address
from sfnode.generation import TokenBatch, TokenLogprob, TokenSink
from sfnode.head.machines import (
    DEFAULT_KEEPALIVE_INTERVAL_S,
    DEFAULT_SILENCE_TIMEOUT_S,
    ConnectError,
    HandshakeError,
    HandshakeTimeoutError,
    LinkCore,
    LinkError,
    LinkInputs,
    LinkLostError,
    LinkMachine,
    NodeRefusedError,
    NodeSilentError,
    ReconcileError,
    RetryPolicy,
    retry_policy,
)
from sfnode.head.session import HeadSession
from sfnode.model_files import ModelFilesError, Reassembly
from sfnode.noise import NoiseFactory, NoiseProtocol, Role, secure_factory
from sfnode.service import describe_failure
from sfnode.wire import (
    FEATURE_CONSTRAINTS,
    FEATURE_HEAD_IDENTITY,
    FEATURE_LOGPROBS,
    FEATURE_REQUEST_CLASS,
    BlobFetchMsg,
    CapacitySummary,
    Constraint,
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
    MsgType,
    NodeStatusMsg,
    PayloadError,
    ReconcileAckMsg,
    RequestClass,
    StageForwardReqMsg,
    StageForwardRespMsg,
    TokenEventsMsg,
    Tokens,
    TokensLogprobs,
    WireError,
    XferAbortMsg,
    XferBeginMsg,
    XferChunkMsg,
    XferEndMsg,
    decode_message,
    decode_params,
    encode_params,
    message_frame,
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
MAX_RETRY_RANGE = 1 << 20
"""The most seqs one RetryRange may ask the head to wait for."""

_log = Logger(namespace="sfnode.head.link")


# --------------------------------------------------------------------------------------------
# Errors (the ones about connecting and handshaking live with the machine that raises them)


class MalformedFrameError(LinkError):
    """The node sent bytes that are not Link F; the connection was closed."""


class UnknownSessionError(LinkError):
    """The head did not assign this session on this link."""


class SessionRevokedError(LinkError):
    """The head revoked the session while a call on it was pending."""


class SupersededError(LinkError):
    """The head re-assigned the session at a new epoch; the node drops older generations."""


class ConstraintsUnsupportedError(LinkError):
    """A constrained generation for a node that did not offer FEATURE_CONSTRAINTS (it would
    ignore the constraint, docs/protocol.md section 12.3): never sent."""


LinkLost = LinkLostError
NodeRefused = NodeRefusedError


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


def _noise_unfinished(protocol: HeadLinkProtocol) -> bool:
    """Whether the connection ran over Noise and its handshake never finished."""
    session = getattr(protocol.transport, "session", None)
    return session is not None and not getattr(session, "ready", True)


def _handshake_loss(reason: Failure, protocol: HeadLinkProtocol) -> HandshakeError:
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


# --------------------------------------------------------------------------------------------
# Process-wide ids


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
        self._decoder = FrameDecoder(handshake=MsgType.HELLO_ACK_F)
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
    """Builds the protocol of each dial, owned by its link."""

    noisy = False
    """No "Starting factory" line per connection attempt."""

    def __init__(self, link: NodeLink) -> None:
        self._link = link

    def buildProtocol(self, addr: Any) -> HeadLinkProtocol:
        return HeadLinkProtocol(self._link)


# --------------------------------------------------------------------------------------------
# Generations


def token_logprobs(payload: TokensLogprobs) -> tuple[TokenLogprob, ...]:
    """The logprobs of a TokensLogprobs event, one per token (alternatives empty when the
    event lists none)."""
    tops = payload.top or [()] * len(payload.tokens)
    return tuple(TokenLogprob(v, top) for v, top in zip(payload.logprobs, tops, strict=True))


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
        on_tokens: TokenSink | None,
        *,
        logprobs: bool = False,
    ) -> None:
        self.session_id = session_id
        self.generation_id = generation_id
        self.epoch = epoch
        self.logprobs = logprobs
        """Its session's GenParams ask for logprobs (docs/protocol.md section 12.1)."""
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

    def _deliver(self, payload: Tokens) -> None:
        batch = TokenBatch(
            payload.tokens,
            token_logprobs(payload)
            if self.logprobs and isinstance(payload, TokensLogprobs)
            else None,
        )
        self.tokens.extend(batch.tokens)
        if self._on_tokens is not None:
            try:
                self._on_tokens(batch)
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


class LinkObserver(TypingProtocol):
    """What a link tells whoever watches it (the fleet); none of these may raise."""

    def link_opened(self, link: NodeLink, reconnected: bool) -> None:
        """The link is open (handshaken, and reconciled when it held sessions)."""

    def link_failed(self, link: NodeLink, reason: LinkError, retry_in_s: float | None) -> None:
        """An attempt to (re)connect failed; the next starts in ``retry_in_s`` (None: never)."""

    def link_dropped(self, link: NodeLink, reason: LinkError) -> None:
        """The open link lost its connection (a dialed link is redialling already)."""

    def link_reported(self, link: NodeLink) -> None:
        """A NODE_STATUS brought a new load report (``link.capacity``)."""

    def link_closed(self, link: NodeLink) -> None:
        """The link is over: closed by the head, or the connection of a node that dialed in
        ended or failed its handshake."""


class _Reconcile:
    """What a reconnect's RECONCILE is waiting for."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int, int]] = set()
        """(session, generation, seq) of every event that arrived since RECONCILE was sent."""
        self.missing: set[tuple[int, int, int]] | None = None
        """Retry-range seqs not arrived yet; None until RECONCILE_ACK."""
        self.held: list[int] = []
        self.not_held: list[int] = []
        self.retried: set[tuple[int, int]] = set()
        """(session, generation) of every RetryRange the node announced."""


class NodeLink:
    """The head's side of one Link F connection to one node (section 8).

    Build it with :func:`connect_node` (the head dials) or :class:`HeadLinkFactory` (the node
    dials the head).  In both the head says HELLO first.

    Sends (:meth:`assign`, :meth:`append`, :meth:`revoke`, :meth:`keepalive`) are
    fire-and-forget: while the link is down they only update the bookkeeping, and the next
    connection's reconcile puts the node right (a revoke that could not be sent goes out then).
    Calls that wait (:meth:`generate`, :meth:`stage_forward`) fail with :class:`LinkError`
    subclasses when the link loses them: a generation in flight when an open connection
    dropped waits for the redial's reconcile, and fails when that attempt fails or the node no
    longer has it; a node that went silent for the keepalive window fails its generations at
    once (:class:`~sfnode.head.machines.NodeSilentError`).  A malformed frame fails every
    pending call with :class:`MalformedFrameError`.
    """

    def __init__(
        self,
        reactor: Any,
        ids: HeadIds,
        *,
        token: bytes = b"",
        endpoint: IStreamClientEndpoint | None = None,
        description: str | None = None,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        clock: IReactorTime | None = None,
        keep_wal: bool = True,
        retry: RetryPolicy | None = None,
        keepalive_interval_s: float = DEFAULT_KEEPALIVE_INTERVAL_S,
        silence_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S,
    ) -> None:
        self._reactor = reactor
        self._clock: IReactorTime = clock if clock is not None else reactor
        self.ids = ids
        self.token = token
        self._endpoint = endpoint
        self.description = description or (
            describe_endpoint(endpoint) if endpoint is not None else "a node that dialed in"
        )
        """The endpoint string dialed, or the peer of a node that dialed in."""
        self.handshake_timeout_s = handshake_timeout_s
        self.keep_wal = keep_wal
        """False forgets a generation's committed events once its call completed."""
        self.head_session = HeadSession(ids.next_command_base())
        self.hello_ack: HelloAckF | None = None
        self.capacity: CapacitySummary | None = None
        self.capacity_at: float | None = None
        """When the latest capacity report arrived (clock seconds)."""
        self.models: tuple[str, ...] = ()
        self.status = "new"
        """new, connecting, handshaking, reconciling, open, down or closed (for humans)."""
        self.ready = False
        """Open: handshaken, and reconciled after a reconnect."""
        self._protocol: HeadLinkProtocol | None = None
        self._incoming: HeadLinkProtocol | None = None
        self._closing: set[HeadLinkProtocol] = set()
        self._awaiting_ack = False
        self._reconcile: _Reconcile | None = None
        self._next_generation = 1
        self._generations: dict[tuple[int, int], GenerationCall] = {}
        self._suspended: set[tuple[int, int]] = set()
        """Generations in flight when the connection dropped; the redial's reconcile settles
        them."""
        self._stage_forwards: dict[int, Deferred[StageForwardRespMsg]] = {}
        self._fetch: tuple[Reassembly, Deferred[bytes]] | None = None
        """The transfer of model files in progress (docs/protocol.md section 12.5)."""
        self._owed_revokes: dict[int, int] = {}
        """session -> epoch of revokes made while the link was down."""
        self._closed_waiters: list[Deferred[Exception]] = []
        self._close_waiters: list[Deferred[None]] = []
        self._observers: list[LinkObserver] = []
        self._core = LinkCore(
            effects=self,
            clock=self._clock,
            retry=retry if retry is not None else retry_policy(),
            handshake_timeout_s=handshake_timeout_s,
            keepalive_interval_s=keepalive_interval_s,
            silence_timeout_s=silence_timeout_s,
        )
        self._machine: LinkInputs = LinkMachine(self._core)

    # ----------------------------------------------------------------------------------------
    # State seen by owners

    @property
    def node_identity(self) -> str:
        return self.hello_ack.node_identity if self.hello_ack is not None else "<unknown node>"

    @property
    def features(self) -> int | None:
        """The feature flags of the node's latest HELLO_ACK_F (docs/protocol.md section 12);
        None before the first handshake."""
        return self.hello_ack.feature_flags if self.hello_ack is not None else None

    @property
    def name(self) -> str:
        """The node's identity once known, else its endpoint string (or peer)."""
        return self.hello_ack.node_identity if self.hello_ack is not None else self.description

    @property
    def request_classes(self) -> bool:
        """Whether the node reads request classes (FEATURE_REQUEST_CLASS in its HELLO_ACK_F,
        docs/protocol.md section 12.2)."""
        return bool((self.features or 0) & FEATURE_REQUEST_CLASS)

    @property
    def connected(self) -> bool:
        """Whether a connection is up and past its handshake (a reconcile may still run)."""
        return self._protocol is not None and not self._awaiting_ack

    @property
    def dialable(self) -> bool:
        """Whether the head dials this node (and so redials it)."""
        return self._endpoint is not None

    @property
    def last_reason(self) -> LinkError | None:
        """Why the link last went down (None while open or before the first attempt)."""
        return self._core.last_reason

    def observe(self, observer: LinkObserver) -> None:
        self._observers.append(observer)

    def pending_generations(self) -> list[GenerationCall]:
        return list(self._generations.values())

    def when_closed(self) -> Deferred[Exception]:
        """A Deferred that fires with the reason the next time an open connection drops (or
        the link is closed).  If the link is down or closed already it fires at once with
        the last reason.  A connection :meth:`reconnect` replaces on purpose, or one that
        never finished its handshake, is not reported here."""
        d: Deferred[Exception] = Deferred()
        last = self._core.last_reason
        if last is not None and self.status in ("down", "closed"):
            d.callback(last)
        else:
            self._closed_waiters.append(d)
        return d

    def when_open(self) -> Deferred[None]:
        """Fires when the link is open: at once if it is, else when the attempt under way
        succeeds; fails when that attempt fails, or at once when the link is down or closed."""
        d: Deferred[None] = Deferred()
        self._core.open_waiters.append(d)
        self._machine.wait_open()
        return d

    # ----------------------------------------------------------------------------------------
    # Life cycle

    def start(self) -> None:
        """Dial the node (or, for a node dialing in, start waiting for its handshake)."""
        self._machine.start()

    def reconnect(self) -> Deferred[None]:
        """Drop the connection (if any), dial again, handshake and reconcile (section 8).

        Generations in flight keep waiting when the node still holds their session and shows
        it has them (committed events, a retry range, or events since the RECONCILE): their
        retransmitted events, and the rest of the stream the node moves to the new connection
        (decision D2), complete them normally.  The others fail with :class:`LinkLostError`
        once the reconcile is done (the caller decides on failover).  Held sessions get their
        stored context appended again; sessions the node no longer holds are re-assigned at
        the same epoch (new command id) and appended.  Fires once the link is open again.
        """
        if not self.dialable:
            return defer.fail(LinkError("a node that dialed the head cannot be dialed back"))
        d: Deferred[None] = Deferred()
        self._core.open_waiters.append(d)
        self._machine.redial()
        self._machine.wait_open()
        return d

    def close(self) -> Deferred[None]:
        """Close the link for good; pending calls fail with :class:`LinkLostError`.

        Fires once the connection is gone.
        """
        d: Deferred[None] = Deferred()
        self._close_waiters.append(d)
        self._machine.close()
        self._check_closed()
        return d

    def _check_closed(self) -> None:
        if self.status == "closed" and not self._closing and self._protocol is None:
            waiters, self._close_waiters = self._close_waiters, []
            for d in waiters:
                d.callback(None)

    # ----------------------------------------------------------------------------------------
    # Head -> node

    def send_now(self, message: Message) -> bool:
        """Send one message if a connection is up past its handshake; False otherwise."""
        if self._protocol is None or self._awaiting_ack:
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
        the generations of an older epoch when a higher one is assigned (section 6.2).
        """
        epoch = self.ids.next_epoch()
        self._owed_revokes.pop(session_id, None)
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

        A session this link does not know is revoked only when ``epoch`` is given.  A revoke
        that cannot be sent now (the link is down) goes out after the next reconcile, so a
        node that was only unreachable frees what it still runs for the session.
        """
        message = self.head_session.revoke(session_id, epoch=epoch)
        if message is not None and not self.send_now(message):
            self._owed_revokes[session_id] = message.epoch
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
        on_tokens: TokenSink | None = None,
        request_class: RequestClass = RequestClass.INTERACTIVE,
        constraint: Constraint | None = None,
    ) -> GenerationCall:
        """GENERATE_REQ with a new generation id; committed tokens stream to ``on_tokens``.

        Each event arrives as one :class:`~sfnode.generation.TokenBatch`; when the session's
        GenParams ask for logprobs and the node offers them (:attr:`features`), the batch
        carries one :class:`~sfnode.generation.TokenLogprob` per token (docs/protocol.md
        section 12.1).

        ``request_class`` travels only to a node that set FEATURE_REQUEST_CLASS
        (:attr:`request_classes`); any other node reads every request alike (docs/protocol.md
        section 12.2).

        ``constraint`` (docs/protocol.md section 12.3) goes only to a node that set
        FEATURE_CONSTRAINTS; for any other the call fails at once with
        :class:`ConstraintsUnsupportedError` and nothing is sent.

        The call's ``result`` fails at once with :class:`UnknownSessionError` or
        :class:`LinkLostError` when the session was never assigned here or the link is down.
        """
        generation_id = self._next_generation_id()
        epoch = self.head_session.epoch_of(session_id)
        record = self.head_session.session(session_id)
        asks = record is not None and decode_params(record.params).logprobs > 0
        call = GenerationCall(self, session_id, generation_id, epoch or 0, on_tokens, logprobs=asks)
        if epoch is None:
            call._fail(UnknownSessionError(f"session {session_id} was not assigned on this link"))
            return call
        if not self.connected:
            call._fail(LinkLostError(f"the link to {self.name} is down"))
            return call
        if constraint is not None and not (self.features or 0) & FEATURE_CONSTRAINTS:
            call._fail(ConstraintsUnsupportedError(f"{self.name} does not honour constraints"))
            return call
        request = self.head_session.generate(
            session_id,
            generation_id,
            GenerationBudgetsMsg(max_new_tokens, max_wall_ms),
            int(request_class) if self.request_classes else None,
            constraint,
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
            return defer.fail(LinkLostError(f"the link to {self.name} is down"))

        def forget(_: Deferred[StageForwardRespMsg]) -> None:
            self._stage_forwards.pop(request_id, None)

        d: Deferred[StageForwardRespMsg] = Deferred(forget)
        self._stage_forwards[request_id] = d
        self.send_now(
            StageForwardReqMsg(request_id, tuple(tokens), start_layer, end_layer, hidden_in)
        )
        return d

    def _next_generation_id(self) -> int:
        generation_id = self._next_generation
        self._next_generation += 1
        return generation_id

    # ----------------------------------------------------------------------------------------
    # LinkEffects: what the machine asks for

    def dial(self) -> Deferred[Any] | None:
        self.status = "connecting"
        if self._endpoint is None:
            return None
        attempt = self._endpoint.connect(
            secure_factory(
                _DialFactory(self),
                self.token,
                role=Role.INITIATOR,
                clock=self._clock,
                handshake_timeout_s=self.handshake_timeout_s,
            )
        )

        def failed(failure: Failure) -> None:
            self._machine.dial_failed(
                ConnectError(f"could not connect: {describe_failure(failure)}")
            )

        attempt.addCallbacks(lambda _: None, failed)
        return attempt

    def attach(self) -> None:
        self._protocol, self._incoming = self._incoming, None
        self._awaiting_ack = True
        self.status = "handshaking"
        if self._protocol is not None:
            self._protocol.send(
                Hello(PROTO_RANGE, LinkRole.HEAD_DAEMON, self.token, self.ids.head_id)
            )

    def reject(self) -> None:
        stray, self._incoming = self._incoming, None
        if stray is not None:
            stray.abort()

    def abort(self) -> None:
        protocol, self._protocol = self._protocol, None
        self._awaiting_ack = False
        if protocol is not None:
            protocol.abort()

    def begin_reconcile(self) -> None:
        self.status = "reconciling"
        self._reconcile = _Reconcile()
        self.send_now(self.head_session.reconcile())

    def opened(self, reconnected: bool) -> None:
        self.status = "open"
        self.ready = True
        state, self._reconcile = self._reconcile, None
        if state is not None:
            for session_id in state.held:
                self._send_optional(self.head_session.reappend(session_id))
            for session_id in state.not_held:
                self._send_optional(self.head_session.reassign(session_id))
                self._send_optional(self.head_session.reappend(session_id))
        self._settle_suspended(state)
        owed, self._owed_revokes = self._owed_revokes, {}
        for session_id, epoch in owed.items():
            if self.head_session.epoch_of(session_id) is None:
                self._send_optional(self.head_session.revoke(session_id, epoch=epoch))
        for observer in list(self._observers):
            observer.link_opened(self, reconnected)

    def attempt_failed(self, reason: LinkError, retry_in_s: float) -> None:
        self.status = "down"
        self.ready = False
        self._reconcile = None
        lost = LinkLostError(f"{self.name} could not be reached again: {reason}")
        self._fail_stage_forwards(lost)
        self._fail_generations(lost)
        if not self.dialable:
            # A node that dialed in and failed its handshake: nothing to redial.
            self._machine.close()
            return
        for observer in list(self._observers):
            observer.link_failed(self, reason, retry_in_s)

    def dropped(self, reason: LinkError) -> None:
        self.ready = False
        self._reconcile = None
        self._fail_stage_forwards(reason)
        if isinstance(reason, NodeSilentError) or not self.dialable:
            self._fail_generations(reason)
        else:
            self._suspended.update(self._generations)
        waiters, self._closed_waiters = self._closed_waiters, []
        for d in waiters:
            d.callback(reason)
        for observer in list(self._observers):
            observer.link_dropped(self, reason)

    def replaced(self) -> None:
        self.ready = False
        self.abort()
        self._fail_stage_forwards(LinkLostError(f"the link to {self.name} is reconnecting"))
        self._suspended.update(self._generations)

    def silent(self, seconds: float) -> None:
        reason = NodeSilentError(
            f"{self.name} sent nothing for {seconds:.1f} s (the keepalive window is "
            f"{self._core.silence_timeout_s:g} s): it is hung or unreachable"
        )
        self.abort()
        self._lose(reason)

    def send_keepalive(self) -> None:
        self.keepalive()

    def closed(self) -> None:
        was_open = self.ready
        self.status = "closed"
        self.ready = False
        self._reconcile = None
        reason = LinkLostError("the head closed the link")
        if self._core.last_reason is None or was_open:
            self._core.last_reason = reason
        protocol, self._protocol = self._protocol, None
        self._awaiting_ack = False
        if protocol is not None:
            self._closing.add(protocol)
            protocol.close()
        self._fail_stage_forwards(reason)
        self._fail_generations(reason)
        waiters, self._closed_waiters = self._closed_waiters, []
        for d in waiters:
            d.callback(self._core.last_reason or reason)
        for observer in list(self._observers):
            observer.link_closed(self)
        self._check_closed()

    # ----------------------------------------------------------------------------------------
    # LinkOwner: what the protocol reports

    def link_made(self, protocol: HeadLinkProtocol) -> None:
        self._incoming = protocol
        self._machine.connection_made()

    def message_received(self, protocol: HeadLinkProtocol, message: Message) -> None:
        if protocol is not self._protocol:
            return
        self._core.last_heard = self._clock.seconds()
        if self._awaiting_ack:
            self._on_hello_ack(message)
        elif isinstance(message, TokenEventsMsg):
            self._on_token_events(message)
        elif isinstance(message, LeaseRenewMsg):
            self._send_optional(self.head_session.on_lease_renew(message))
        elif isinstance(message, NodeStatusMsg):
            self._set_capacity(message.capacity)
            if message.loadable_models:
                self.models = message.loadable_models
            for observer in list(self._observers):
                observer.link_reported(self)
        elif isinstance(message, StageForwardRespMsg):
            d = self._stage_forwards.pop(message.request_id, None)
            if d is not None:
                d.callback(message)
        elif isinstance(message, ReconcileAckMsg):
            self._on_reconcile_ack(message)
        elif isinstance(message, (XferBeginMsg, XferChunkMsg, XferEndMsg, XferAbortMsg)):
            self._on_transfer(message)
        # Anything else a node may send (a repeated HELLO_ACK_F, TELEMETRY, ...) is ignored.

    def link_broken(self, protocol: HeadLinkProtocol, error: Exception) -> None:
        if protocol is not self._protocol:
            protocol.abort()
            return
        if isinstance(error, WireError):
            reason: LinkError = MalformedFrameError(f"{self.name} sent a malformed frame: {error}")
        else:
            reason = LinkError(f"handling a frame from {self.name} failed: {error}")
        _log.error("closing the link to {node}: {reason}", node=self.name, reason=reason)
        # Everything pending fails for this reason, even what a redial could have saved: the
        # node's stream cannot be trusted.
        self._fail_stage_forwards(reason)
        self._fail_generations(reason)
        self.abort()
        self._lose(reason)

    def link_lost(self, protocol: HeadLinkProtocol, reason: Failure) -> None:
        if protocol in self._closing:
            self._closing.discard(protocol)
            self._check_closed()
            return
        if protocol is self._incoming:
            self._incoming = None
            return
        if protocol is not self._protocol:
            return
        in_handshake = self._awaiting_ack
        self._protocol = None
        self._awaiting_ack = False
        if in_handshake:
            loss: LinkError = _handshake_loss(reason, protocol)
        else:
            loss = LinkLostError(f"the connection to {self.name} ended: {describe_failure(reason)}")
        self._lose(loss)

    def _lose(self, reason: LinkError) -> None:
        self._fail_fetch(reason)
        if self.dialable:
            self._machine.connection_lost(reason)
        else:
            self._machine.connection_ended(reason)

    # ----------------------------------------------------------------------------------------
    # Internals

    def _set_capacity(self, capacity: CapacitySummary) -> None:
        self.capacity = capacity
        self.capacity_at = self._clock.seconds()

    def _on_hello_ack(self, message: Message) -> None:
        if not isinstance(message, HelloAckF):
            self._machine.handshake_failed(
                HandshakeError(f"expected HELLO_ACK_F, got {type(message).__name__}")
            )
            return
        self._awaiting_ack = False
        if self.hello_ack is None and not message.feature_flags & FEATURE_HEAD_IDENTITY:
            _log.warn(
                "node {node} does not keep the sessions of different heads apart (no head "
                "identity, docs/protocol.md section 12.4): do not share it with another head",
                node=message.node_identity,
            )
        self.hello_ack = message
        self._set_capacity(message.capacity)
        self.models = message.loadable_models
        if self.head_session.session_ids() or self._suspended:
            self._machine.acknowledged_with_sessions()
        else:
            self._machine.acknowledged()

    def _settle_suspended(self, state: _Reconcile | None) -> None:
        """Keep the suspended generations the node still has; fail the others (section 8)."""
        held = set(state.held) if state is not None else set()
        evidence = (
            state.retried | {(s, g) for s, g, _ in state.seen} if state is not None else set()
        )
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
                    f"{self.name} lost generation {generation_id} of session "
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
            self._machine.reconciled()

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
                if (
                    call.logprobs
                    and type(payload) is Tokens
                    and (self.features or 0) & FEATURE_LOGPROBS
                    and self._protocol is not None
                ):
                    # A node with the bit answers a session that asks only in TokensLogprobs
                    # (section 12.1): its stream cannot be rendered as asked.
                    self._protocol.fail(
                        PayloadError(
                            f"plain Tokens for generation {event.generation_id} of session "
                            f"{event.session_id}, whose GenParams ask for logprobs"
                        )
                    )
                    return
                if id(event) in committed:
                    call._deliver(payload)
            elif isinstance(payload, Finish):
                call.finish = payload.reason
                finished.append(call)
        for call in finished:
            self._forget_generation(call)
            if not self.keep_wal:
                self.head_session.forget_committed(call.session_id, call.epoch, call.generation_id)
            call._complete()
        if state is not None and state.missing is not None and not state.missing:
            self._machine.reconciled()

    def fetch_model_files(self, content_hash: bytes) -> Deferred[bytes]:
        """Ask the node for the model files named ``content_hash`` (BLOB_FETCH, section
        12.5); fires with the bundle, checked against the hash, or fails with
        :class:`~sfnode.model_files.ModelFilesError` (the node sent something else, or
        aborted) or :class:`LinkError` (the link was lost first).  One fetch at a time."""
        if self._fetch is not None:
            return defer.fail(ModelFilesError("a transfer of model files is already in progress"))
        if not self.send_now(BlobFetchMsg(content_hash)):
            return defer.fail(LinkError(f"the link to {self.name} is not open"))
        done: Deferred[bytes] = Deferred()
        self._fetch = (Reassembly(content_hash), done)
        return done

    def _on_transfer(
        self, message: XferBeginMsg | XferChunkMsg | XferEndMsg | XferAbortMsg
    ) -> None:
        if self._fetch is None:
            return  # nothing asked (or a fetch already failed): ignored, as section 4.1 says
        reassembly, done = self._fetch
        try:
            if isinstance(message, XferBeginMsg):
                reassembly.begin(message)
            elif isinstance(message, XferChunkMsg):
                reassembly.chunk(message)
            elif isinstance(message, XferEndMsg):
                data = reassembly.end(message)
                self._fetch = None
                done.callback(data)
            else:
                raise ModelFilesError(f"the node aborted the transfer (reason {message.reason})")
        except ModelFilesError as e:
            self._fail_fetch(e)

    def _fail_fetch(self, error: Exception) -> None:
        if self._fetch is not None:
            _, done = self._fetch
            self._fetch = None
            done.errback(error)

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
    retry: RetryPolicy | None = None,
    silence_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S,
) -> Deferred[NodeLink]:
    """Dial a node (a Twisted endpoint string or endpoint) and handshake.

    Fires with the open :class:`NodeLink` (which then redials on its own whenever its
    connection drops, until it is closed), or fails with the reason of the first attempt:
    :class:`~sfnode.head.machines.ConnectError`, :class:`HandshakeTimeoutError`,
    :class:`NodeRefusedError` (the node closed the connection during the handshake),
    :class:`MalformedFrameError` or :class:`HandshakeError`; the link is then closed.
    """
    if isinstance(endpoint, str):
        description = endpoint
        dialer = cast(
            IStreamClientEndpoint,
            clientFromString(reactor, endpoint),  # type: ignore[no-untyped-call]
        )
    else:
        description = describe_endpoint(endpoint)
        dialer = endpoint
    link = NodeLink(
        reactor,
        ids,
        token=token,
        endpoint=dialer,
        description=description,
        handshake_timeout_s=handshake_timeout_s,
        clock=clock,
        keep_wal=keep_wal,
        retry=retry,
        silence_timeout_s=silence_timeout_s,
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
        token: bytes = b"",
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        clock: IReactorTime | None = None,
        keep_wal: bool = True,
        max_handshakes: int = DEFAULT_JOIN_HANDSHAKES,
        max_address_handshakes: int = DEFAULT_JOIN_ADDRESS_HANDSHAKES,
        loopback_only: bool = False,
        silence_timeout_s: float = DEFAULT_SILENCE_TIMEOUT_S,
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
        self._token = token
        self._handshake_timeout_s = handshake_timeout_s
        self._clock = clock
        self._keep_wal = keep_wal
        self.silence_timeout_s = silence_timeout_s
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
                peer=_peer(addr),
            )
            return None
        if self.max_handshakes and self.handshaking >= self.max_handshakes:
            _log.warn(
                "closed a node connection from {peer} at once: {count} handshakes already "
                "in progress",
                peer=_peer(addr),
                count=self.max_handshakes,
            )
            return None
        address = address_key(addr)
        if (
            self.max_address_handshakes
            and self.handshaking_from[address] >= self.max_address_handshakes
        ):
            _log.warn(
                "closed a node connection from {peer} at once: {count} handshakes from "
                "{address} already in progress",
                peer=_peer(addr),
                count=self.max_address_handshakes,
                address=address,
            )
            return None
        protocol = self._link_protocol(addr)
        if self._noise is None:
            return protocol
        return NoiseProtocol(self._noise, protocol)

    def _link_protocol(self, addr: Any) -> HeadLinkProtocol:
        peer = _peer(addr)
        address = address_key(addr)
        link = NodeLink(
            self._reactor,
            self._ids,
            token=self._token,
            description=peer,
            handshake_timeout_s=self._handshake_timeout_s,
            clock=self._clock,
            keep_wal=self._keep_wal,
            silence_timeout_s=self.silence_timeout_s,
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
        return HeadLinkProtocol(link)


def _peer(addr: Any) -> str:
    """``host:port`` of a peer address, or its socket path."""
    host = getattr(addr, "host", None)
    port = getattr(addr, "port", None)
    if host is not None and port is not None:
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    name = getattr(addr, "name", None)
    if isinstance(name, bytes):
        return name.decode(errors="replace") or "a Unix socket"
    return str(name) if name else "a Unix socket"


__all__ = [
    "ConnectError",
    "GenerationCall",
    "GenerationOutcome",
    "HandshakeError",
    "HandshakeTimeoutError",
    "HeadIds",
    "HeadLinkFactory",
    "HeadLinkProtocol",
    "LinkError",
    "LinkLostError",
    "LinkObserver",
    "MalformedFrameError",
    "NodeLink",
    "NodeRefusedError",
    "NodeSilentError",
    "ReconcileError",
    "SessionRevokedError",
    "SupersededError",
    "UnknownSessionError",
    "connect_node",
    "describe_failure",
]
