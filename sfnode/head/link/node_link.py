"""The owner of one head link: :class:`NodeLink` (docs/protocol.md sections 5, 6.5, 8).

It wires the framing protocol (:mod:`~sfnode.head.link.protocol`), the pure bookkeeping
(:class:`~sfnode.head.link.session.HeadSession`), the link machine
(:class:`~sfnode.head.link.machine.LinkMachine`), the correlation table
(:mod:`~sfnode.head.link.calls`) and the reconcile (:mod:`~sfnode.head.link.reconcile`):
it carries out what the machine asks, offers the Deferred API and routes each incoming
message through its handler table.  It must never block, never use the global reactor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from typing import Protocol as TypingProtocol

from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.internet.protocol import Factory
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.generation import TokenSink
from sfnode.head.link.calls import CallTable, GenerationAsk, GenerationCall
from sfnode.head.link.errors import (
    ConstraintsUnsupportedError,
    MalformedFrameError,
    SessionRevokedError,
    SupersededError,
    UnknownSessionError,
)
from sfnode.head.link.files import FilesFetch, TransferMsg
from sfnode.head.link.machine import (
    ConnectError,
    HandshakeError,
    LinkCore,
    LinkError,
    LinkInputs,
    LinkLostError,
    LinkMachine,
    NodeSilentError,
    RetryPolicy,
    retry_policy,
)
from sfnode.head.link.protocol import HeadLinkProtocol, LinkOwner, handshake_loss
from sfnode.head.link.reconcile import Reconcile
from sfnode.head.link.session import HeadSession
from sfnode.head.link.settings import (
    DEFAULT_LEASE,
    DEFAULT_LINK_SETTINGS,
    DEFAULT_PARAMS,
    PROTO_RANGE,
    HeadIds,
    LinkSettings,
    describe_endpoint,
)
from sfnode.linkf.noise import Role, secure_factory
from sfnode.linkf.platform import NodePlatform, decode_platform
from sfnode.linkf.wire import (
    FEATURE_CONSTRAINTS,
    FEATURE_HEAD_IDENTITY,
    FEATURE_LOGPROBS,
    FEATURE_REQUEST_CLASS,
    CapacitySummary,
    EmbedReqMsg,
    EmbedRespMsg,
    Finish,
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
    StageBatchReqMsg,
    StageBatchRespMsg,
    StageBatchRow,
    StageForwardReqMsg,
    StageForwardRespMsg,
    StageRingTokensMsg,
    TelemetryMsg,
    TokenEventsMsg,
    Tokens,
    WireError,
    XferAbortMsg,
    XferBeginMsg,
    XferChunkMsg,
    XferEndMsg,
    decode_params,
    encode_params,
)
from sfnode.runtime.service import describe_failure

_log = Logger(namespace="sfnode.head.link")


class _DialFactory(Factory):
    """Builds the protocol of each dial, owned by its link."""

    noisy = False
    """No "Starting factory" line per connection attempt."""

    def __init__(self, owner: LinkOwner) -> None:
        self._owner = owner

    def buildProtocol(self, addr: Any) -> HeadLinkProtocol:
        return HeadLinkProtocol(self._owner)


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


_Handler = Callable[["_LinkDriver", Any], None]
_HANDLERS: dict[type[Message], _Handler] = {}
"""What the link does with each message a node sends once the handshake is over (like the
node's ``HANDLERS``): one method per message class, registered with :func:`_handles`."""

_M = TypeVar("_M", bound=Message)


def _handles(
    message_class: type[_M],
) -> Callable[[Callable[[_LinkDriver, _M], None]], Callable[[_LinkDriver, _M], None]]:
    """Register the decorated method as the link's handler of ``message_class``."""

    def register(
        handler: Callable[[_LinkDriver, _M], None],
    ) -> Callable[[_LinkDriver, _M], None]:
        if message_class in _HANDLERS:
            raise ValueError(f"{message_class.__name__} already has a handler")
        _HANDLERS[message_class] = handler
        return handler

    return register


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
    once (:class:`~sfnode.head.link.machine.NodeSilentError`).  A malformed frame fails every
    pending call with :class:`MalformedFrameError`.
    """

    def __init__(
        self,
        reactor: Any,
        ids: HeadIds,
        *,
        settings: LinkSettings = DEFAULT_LINK_SETTINGS,
        endpoint: IStreamClientEndpoint | None = None,
        description: str | None = None,
        clock: IReactorTime | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self._reactor = reactor
        self._clock: IReactorTime = clock if clock is not None else reactor
        self.ids = ids
        self.settings = settings
        self._endpoint = endpoint
        self.dialable = endpoint is not None
        """Whether the head dials this node (and so redials it)."""
        self.description = description or (
            describe_endpoint(endpoint) if endpoint is not None else "a node that dialed in"
        )
        """The endpoint string dialed, or the peer of a node that dialed in."""
        self.head_session = HeadSession(ids.next_command_base())
        self.hello_ack: HelloAckF | None = None
        self.capacity: CapacitySummary | None = None
        self.capacity_at: float | None = None
        """When the latest capacity report arrived (clock seconds)."""
        self.models: tuple[str, ...] = ()
        self.platform: NodePlatform | None = None
        """The node's CPU and engine path, from the TELEMETRY after its HELLO_ACK_F (section
        12.9); None until one came."""
        self.resident_bytes: int | None = None
        """The node's resident memory from its latest NODE_STATUS (D27); None while it
        reports none (0, as upstream nodes do)."""
        self._calls = CallTable()
        self.files = FilesFetch()
        """The fetch of the node's model files in progress (section 12.5)."""
        """Outstanding generations and stage forwards (and which generations a drop
        suspended until the redial's reconcile settles them)."""
        self._owed_revokes: dict[int, int] = {}
        """session -> epoch of revokes made while the link was down."""
        self._closed_waiters: list[Deferred[Exception]] = []
        self._close_waiters: list[Deferred[None]] = []
        self._observers: list[LinkObserver] = []
        self.ring_tokens: Callable[[NodeLink, StageRingTokensMsg], None] | None = None
        """Who reads the STAGE_RING_TOKENS of the stage rings this link's node is in
        (docs/protocol.md section 12.10): the pipeline that joined it; None: they are
        ignored."""
        self._driver = _LinkDriver(self)
        self.owner: LinkOwner = self._driver
        """What this link's connections report to (a :class:`HeadLinkProtocol`'s owner)."""
        self._core = LinkCore(
            effects=self._driver,
            clock=self._clock,
            retry=retry if retry is not None else retry_policy(),
            handshake_timeout_s=settings.handshake_timeout_s,
            keepalive_interval_s=settings.keepalive_interval_s,
            silence_timeout_s=settings.silence_timeout_s,
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
        return self._driver.connected

    @property
    def status(self) -> str:
        """new, connecting, handshaking, reconciling, open, down or closed (for humans): the
        phase of the link machine."""
        return self._core.phase

    @property
    def ready(self) -> bool:
        """Open: handshaken, and reconciled after a reconnect."""
        return self._core.phase == "open"

    @property
    def last_reason(self) -> LinkError | None:
        """Why the link last went down (None while open or before the first attempt)."""
        return self._core.last_reason

    def observe(self, observer: LinkObserver) -> None:
        self._observers.append(observer)

    @property
    def calls(self) -> CallTable:
        """Outstanding generations and stage forwards (read it; the link alone changes it)."""
        return self._calls

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
        if self.status == "closed" and self._driver.idle:
            waiters, self._close_waiters = self._close_waiters, []
            for d in waiters:
                d.callback(None)

    # ----------------------------------------------------------------------------------------
    # Head -> node

    def send_now(self, message: Message) -> bool:
        """Send one message if a connection is up past its handshake; False otherwise."""
        return self._driver.send_now(message)

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
        for call in self._calls.of_session(session_id):
            self.forget_generation(call)
            call._fail(SupersededError(f"session {session_id} was re-assigned at epoch {epoch}"))
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
        for call in self._calls.of_session(session_id):
            self.forget_generation(call)
            call._fail(SessionRevokedError(f"session {session_id} was revoked"))

    def keepalive(self) -> None:
        self.send_now(Keepalive())

    def generate(
        self, session_id: int, ask: GenerationAsk, on_tokens: TokenSink | None = None
    ) -> GenerationCall:
        """GENERATE_REQ with a new generation id, with the budgets, class and constraint of
        ``ask`` (the head's request value); committed tokens stream to ``on_tokens``.

        Each event arrives as one :class:`~sfnode.generation.TokenBatch`; when the session's
        GenParams ask for logprobs and the node offers them (:attr:`features`), the batch
        carries one :class:`~sfnode.generation.TokenLogprob` per token (docs/protocol.md
        section 12.1).

        The request class travels only to a node that set FEATURE_REQUEST_CLASS
        (:attr:`request_classes`); any other node reads every request alike (docs/protocol.md
        section 12.2).

        A constraint (docs/protocol.md section 12.3) goes only to a node that set
        FEATURE_CONSTRAINTS; for any other the call fails at once with
        :class:`ConstraintsUnsupportedError` and nothing is sent.

        The call's ``result`` fails at once with :class:`UnknownSessionError` or
        :class:`LinkLostError` when the session was never assigned here or the link is down.
        """
        generation_id = self._calls.next_id()
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
        if ask.constraint is not None and not (self.features or 0) & FEATURE_CONSTRAINTS:
            call._fail(ConstraintsUnsupportedError(f"{self.name} does not honour constraints"))
            return call
        request = self.head_session.generate(
            session_id,
            generation_id,
            GenerationBudgetsMsg(ask.max_new, ask.max_wall_ms),
            int(ask.request_class) if self.request_classes else None,
            ask.constraint,
        )
        assert request is not None
        self._calls.add(call)
        self.send_now(request)
        return call

    def stage_forward(
        self,
        tokens: Sequence[int],
        start_layer: int,
        end_layer: int,
        hidden_in: bytes | None = None,
        stage_session: int | None = None,
        position: int = 0,
    ) -> Deferred[StageForwardRespMsg]:
        """STAGE_FORWARD_REQ; fires with the STAGE_FORWARD_RESP of the same request_id.  With a
        ``stage_session`` (only to a node that set FEATURE_STAGE_KV), the rows run against
        that session's kept KV from ``position`` (docs/protocol.md section 12.8)."""
        request_id = self._calls.next_id()
        if not self.connected:
            return defer.fail(LinkLostError(f"the link to {self.name} is down"))
        d = self._calls.expect_forward(request_id)
        self.send_now(
            StageForwardReqMsg(
                request_id,
                tuple(tokens),
                start_layer,
                end_layer,
                hidden_in,
                stage_session,
                None if stage_session is None else position,
            )
        )
        return d

    def forget_generation(self, call: GenerationCall) -> None:
        """Take ``call`` out of the table and the bookkeeping (its result was settled or
        cancelled)."""
        if self._calls.forget(call):
            self.head_session.retire_generation(call.session_id, call.generation_id)


class _LinkDriver:
    """The half of a :class:`NodeLink` that its machine and its connections drive: it carries
    out what the machine asks (:class:`~sfnode.head.link.machine.LinkEffects`), hears what each
    connection reports (:class:`LinkOwner`) and routes each message through the handler
    table.  It owns the connection (the one handshaken, one being made, ones closing) and the
    reconcile under way; every other piece of state is the link's."""

    def __init__(self, link: NodeLink) -> None:
        self.link = link
        self._protocol: HeadLinkProtocol | None = None
        self._incoming: HeadLinkProtocol | None = None
        self._closing: set[HeadLinkProtocol] = set()
        self._reconcile: Reconcile | None = None

    @property
    def connected(self) -> bool:
        """A connection is up and past its handshake (a reconcile may still run)."""
        return self._protocol is not None and not self.in_handshake

    @property
    def in_handshake(self) -> bool:
        """The connection waits for its HELLO_ACK_F (the machine's ``handshaking``)."""
        return self.link._core.phase == "handshaking"

    @property
    def idle(self) -> bool:
        """No connection at all, not even one closing."""
        return not self._closing and self._protocol is None

    def send_now(self, message: Message) -> bool:
        if not self.connected or self._protocol is None:
            return False
        self._protocol.send(message)
        return True

    def send_optional(self, message: Message | None) -> None:
        if message is not None:
            self.send_now(message)

    # ----------------------------------------------------------------------------------------
    # LinkEffects: what the machine asks for

    def dial(self) -> Deferred[Any] | None:
        if self.link._endpoint is None:
            return None
        attempt = self.link._endpoint.connect(
            secure_factory(
                _DialFactory(self),
                self.link.settings.token,
                role=Role.INITIATOR,
                clock=self.link._clock,
                handshake_timeout_s=self.link.settings.handshake_timeout_s,
            )
        )

        def failed(failure: Failure) -> None:
            self.link._machine.dial_failed(
                ConnectError(f"could not connect: {describe_failure(failure)}")
            )

        attempt.addCallbacks(lambda _: None, failed)
        return attempt

    def attach(self) -> None:
        self._protocol, self._incoming = self._incoming, None
        if self._protocol is not None:
            self._protocol.send(
                Hello(
                    PROTO_RANGE,
                    LinkRole.HEAD_DAEMON,
                    self.link.settings.token,
                    self.link.ids.head_id,
                )
            )

    def reject(self) -> None:
        stray, self._incoming = self._incoming, None
        if stray is not None:
            stray.abort()

    def abort(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None:
            protocol.abort()

    def begin_reconcile(self) -> None:
        self._reconcile = Reconcile()
        self.send_now(self.link.head_session.reconcile())

    def opened(self, reconnected: bool) -> None:
        state, self._reconcile = self._reconcile, None
        if state is not None:
            for session_id in state.held:
                self.send_optional(self.link.head_session.reappend(session_id))
            for session_id in state.not_held:
                self.send_optional(self.link.head_session.reassign(session_id))
                self.send_optional(self.link.head_session.reappend(session_id))
        self._settle_suspended(state)
        owed, self.link._owed_revokes = self.link._owed_revokes, {}
        for session_id, epoch in owed.items():
            if self.link.head_session.epoch_of(session_id) is None:
                self.send_optional(self.link.head_session.revoke(session_id, epoch=epoch))
        for observer in list(self.link._observers):
            observer.link_opened(self.link, reconnected)

    def attempt_failed(self, reason: LinkError, retry_in_s: float) -> None:
        self._reconcile = None
        lost = LinkLostError(f"{self.link.name} could not be reached again: {reason}")
        self.link._calls.fail_forwards(lost)
        self._fail_generations(lost)
        if not self.link.dialable:
            # A node that dialed in and failed its handshake: nothing to redial.
            self.link._machine.close()
            return
        for observer in list(self.link._observers):
            observer.link_failed(self.link, reason, retry_in_s)

    def dropped(self, reason: LinkError) -> None:
        self._reconcile = None
        self.link._calls.fail_forwards(reason)
        if isinstance(reason, NodeSilentError) or not self.link.dialable:
            self._fail_generations(reason)
        else:
            self.link._calls.suspend_all()
        waiters, self.link._closed_waiters = self.link._closed_waiters, []
        for d in waiters:
            d.callback(reason)
        for observer in list(self.link._observers):
            observer.link_dropped(self.link, reason)

    def replaced(self) -> None:
        self.abort()
        self.link._calls.fail_forwards(
            LinkLostError(f"the link to {self.link.name} is reconnecting")
        )
        self.link._calls.suspend_all()

    def silent(self, seconds: float) -> None:
        reason = NodeSilentError(
            f"{self.link.name} sent nothing for {seconds:.1f} s (the keepalive window is "
            f"{self.link._core.silence_timeout_s:g} s): it is hung or unreachable"
        )
        self.abort()
        self._lose(reason)

    def send_keepalive(self) -> None:
        self.link.keepalive()

    def closed(self) -> None:
        self._reconcile = None
        reason = LinkLostError("the head closed the link")
        protocol, self._protocol = self._protocol, None
        if protocol is not None:
            self._closing.add(protocol)
            protocol.close()
        self.link._calls.fail_forwards(reason)
        self._fail_generations(reason)
        waiters, self.link._closed_waiters = self.link._closed_waiters, []
        for d in waiters:
            d.callback(self.link._core.last_reason or reason)
        for observer in list(self.link._observers):
            observer.link_closed(self.link)
        self.link._check_closed()

    # ----------------------------------------------------------------------------------------
    # LinkOwner: what the protocol reports

    def link_made(self, protocol: HeadLinkProtocol) -> None:
        self._incoming = protocol
        self.link._machine.connection_made()

    def message_received(self, protocol: HeadLinkProtocol, message: Message) -> None:
        if protocol is not self._protocol:
            return
        self.link._core.last_heard = self.link._clock.seconds()
        if self.in_handshake:
            _on_hello_ack(self, message)
            return
        handler = _HANDLERS.get(type(message))
        # Anything else a node may send (a repeated HELLO_ACK_F, ...) is ignored.
        if handler is not None:
            handler(self, message)

    def link_broken(self, protocol: HeadLinkProtocol, error: Exception) -> None:
        if protocol is not self._protocol:
            protocol.abort()
            return
        if isinstance(error, WireError):
            reason: LinkError = MalformedFrameError(
                f"{self.link.name} sent a malformed frame: {error}"
            )
        else:
            reason = LinkError(f"handling a frame from {self.link.name} failed: {error}")
        _log.error("closing the link to {node}: {reason}", node=self.link.name, reason=reason)
        # Everything pending fails for this reason, even what a redial could have saved: the
        # node's stream cannot be trusted.
        self.link._calls.fail_forwards(reason)
        self._fail_generations(reason)
        self.abort()
        self._lose(reason)

    def link_lost(self, protocol: HeadLinkProtocol, reason: Failure) -> None:
        if protocol in self._closing:
            self._closing.discard(protocol)
            self.link._check_closed()
            return
        if protocol is self._incoming:
            self._incoming = None
            return
        if protocol is not self._protocol:
            return
        in_handshake = self.in_handshake
        self._protocol = None
        if in_handshake:
            loss: LinkError = handshake_loss(reason, protocol)
        else:
            loss = LinkLostError(
                f"the connection to {self.link.name} ended: {describe_failure(reason)}"
            )
        self._lose(loss)

    def _lose(self, reason: LinkError) -> None:
        self.link.files.fail(reason)
        if self.link.dialable:
            self.link._machine.connection_lost(reason)
        else:
            self.link._machine.connection_ended(reason)

    # ----------------------------------------------------------------------------------------
    # Internals

    def _settle_suspended(self, state: Reconcile | None) -> None:
        """Keep the suspended generations the node still has; fail the others (section 8)."""
        for call in self.link._calls.take_suspended():
            key = (call.session_id, call.generation_id)
            committed = (
                self.link.head_session.watermark(call.session_id, call.epoch, call.generation_id)
                is not None
            )
            if state is not None and state.keeps(key, committed):
                continue
            self.link.forget_generation(call)
            call._fail(
                LinkLostError(
                    f"{self.link.name} lost generation {call.generation_id} of session "
                    f"{call.session_id} with the link"
                )
            )

    def _fail_generations(self, error: Exception) -> None:
        """Fail every pending generation."""
        self.link._calls.take_suspended()
        for call in self.link._calls.pending():
            self.link.forget_generation(call)
            call._fail(error)


def _on_hello_ack(driver: _LinkDriver, message: Message) -> None:
    """What the link does with the first message of a connection: HELLO_ACK_F, or the
    handshake fails."""
    link = driver.link
    if not isinstance(message, HelloAckF):
        link._machine.handshake_failed(
            HandshakeError(f"expected HELLO_ACK_F, got {type(message).__name__}")
        )
        return
    if link.hello_ack is None and not message.feature_flags & FEATURE_HEAD_IDENTITY:
        _log.warn(
            "node {node} does not keep the sessions of different heads apart (no head "
            "identity, docs/protocol.md section 12.4): do not share it with another head",
            node=message.node_identity,
        )
    link.hello_ack = message
    _set_capacity(link, message.capacity)
    link.models = message.loadable_models
    if link.head_session.session_ids() or link._calls.any_suspended:
        link._machine.acknowledged_with_sessions()
    else:
        link._machine.acknowledged()


def _set_capacity(link: NodeLink, capacity: CapacitySummary) -> None:
    link.capacity = capacity
    link.capacity_at = link._clock.seconds()


# The handler table: what the link does with each message a node sends after the handshake.


@_handles(ReconcileAckMsg)
def _on_reconcile_ack(driver: _LinkDriver, message: ReconcileAckMsg) -> None:
    state = driver._reconcile
    if state is None or state.acknowledged:
        return
    session = driver.link.head_session
    try:
        state.acknowledge(
            message, lambda s: session.epoch_of(s) is not None, session.on_reconcile_ack
        )
    except PayloadError as e:
        if driver._protocol is not None:
            driver._protocol.fail(e)
        return
    if state.done:
        driver.link._machine.reconciled()


@_handles(LeaseRenewMsg)
def _on_lease_renew(driver: _LinkDriver, message: LeaseRenewMsg) -> None:
    driver.send_optional(driver.link.head_session.on_lease_renew(message))


@_handles(NodeStatusMsg)
def _on_node_status(driver: _LinkDriver, message: NodeStatusMsg) -> None:
    _set_capacity(driver.link, message.capacity)
    driver.link.resident_bytes = message.mem.host_retained_bytes or None
    if message.loadable_models:
        driver.link.models = message.loadable_models
    for observer in list(driver.link._observers):
        observer.link_reported(driver.link)


@_handles(TelemetryMsg)
def _on_telemetry(driver: _LinkDriver, message: TelemetryMsg) -> None:
    """The node's platform (section 12.9); other telemetry is ignored, as upstream's is."""
    platform = decode_platform(message.spans)
    if platform is not None:
        driver.link.platform = platform


@_handles(StageForwardRespMsg)
def _on_stage_forward_resp(driver: _LinkDriver, message: StageForwardRespMsg) -> None:
    driver.link._calls.answer_forward(message)


@_handles(StageBatchRespMsg)
def _on_stage_batch_resp(driver: _LinkDriver, message: StageBatchRespMsg) -> None:
    driver.link._calls.answer_batch(message)


@_handles(StageRingTokensMsg)
def _on_stage_ring_tokens(driver: _LinkDriver, message: StageRingTokensMsg) -> None:
    receiver = driver.link.ring_tokens
    if receiver is not None:
        receiver(driver.link, message)


@_handles(EmbedRespMsg)
def _on_embed_resp(driver: _LinkDriver, message: EmbedRespMsg) -> None:
    driver.link._calls.answer_embedding(message)


def stage_batch(
    link: NodeLink, start_layer: int, end_layer: int, rows: Sequence[StageBatchRow]
) -> Deferred[StageBatchRespMsg]:
    """STAGE_BATCH_REQ on ``link`` (its node must have set ``FEATURE_STAGE_BATCH``): every row
    through ``[start_layer, end_layer)`` in one frame; fires with the STAGE_BATCH_RESP of the
    same request_id (docs/protocol.md section 12.8), or fails with a :class:`LinkError` when
    the link is down or its connection is lost meanwhile."""
    if not link.connected:
        return defer.fail(LinkLostError(f"the link to {link.name} is down"))
    request_id = link._calls.next_id()
    answered = link._calls.expect_batch(request_id)
    link.send_now(StageBatchReqMsg(request_id, start_layer, end_layer, tuple(rows)))
    return answered


def embed(link: NodeLink, texts: Sequence[str]) -> Deferred[EmbedRespMsg]:
    """EMBED_REQ on ``link`` (its node must have set ``FEATURE_EMBEDDINGS``, docs/protocol.md
    section 12.7); fires with the EMBED_RESP of the same request_id, or fails with a
    :class:`LinkError` when the link is down or its connection is lost meanwhile."""
    if not link.connected:
        return defer.fail(LinkLostError(f"the link to {link.name} is down"))
    request_id = link._calls.next_id()
    answered = link._calls.expect_embedding(request_id)
    link.send_now(EmbedReqMsg(request_id, tuple(texts)))
    return answered


def _on_transfer(driver: _LinkDriver, message: TransferMsg) -> None:
    driver.link.files.receive(message)


for _transfer in (XferBeginMsg, XferChunkMsg, XferEndMsg, XferAbortMsg):
    # The four transfer messages of section 12.5 share one handler.
    _HANDLERS[_transfer] = _on_transfer


@_handles(TokenEventsMsg)
def _on_token_events(driver: _LinkDriver, message: TokenEventsMsg) -> None:
    ingested = driver.link.head_session.ingest(message)
    for ack in ingested.acks:
        driver.send_now(ack)
    committed = {id(event) for event in ingested.committed}
    finished: list[GenerationCall] = []
    state = driver._reconcile
    for event in message.events:
        key = (event.session_id, event.generation_id)
        if state is not None:
            state.saw(event.session_id, event.generation_id, event.event_seq)
        call = driver.link._calls.get(key)
        if call is None or call.finish is not None:
            continue
        payload = event.payload
        if isinstance(payload, Tokens):
            if (
                call.logprobs
                and type(payload) is Tokens
                and (driver.link.features or 0) & FEATURE_LOGPROBS
                and driver._protocol is not None
            ):
                # A node with the bit answers a session that asks only in TokensLogprobs
                # (section 12.1): its stream cannot be rendered as asked.
                driver._protocol.fail(
                    PayloadError(
                        f"plain Tokens for generation {event.generation_id} of session "
                        f"{event.session_id}, whose GenParams ask for logprobs"
                    )
                )
                return
            if id(event) in committed:
                call._deliver(payload)
        elif isinstance(payload, Finish):
            call.finish, call.detail = payload.reason, payload.detail
            finished.append(call)
    for call in finished:
        driver.link.forget_generation(call)
        if not driver.link.settings.keep_wal:
            driver.link.head_session.wal.forget(call.session_id, call.epoch, call.generation_id)
        call._complete()
    if state is not None and state.done:
        driver.link._machine.reconciled()
