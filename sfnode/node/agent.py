"""The node agent: the one owner that dispatches frames and wires sessions, machines and the engine.

:class:`NodeAgent` holds what all connections of one node share (docs/protocol.md section 7.1):
the session records, one table per head identity (:class:`HeadSessions`, decision D13: a
connection reaches only the sessions of the head that named itself in its HELLO, and heads
without an identity share one table), each session with its lease machine; the running
generations (each with its generation machine), the drain machine and the busy-time load.
Every decoded frame goes to the handler registered for its message class in :data:`HANDLERS`
(section 7.2), like AMP pairs a command with its responder.  It follows
decision D2: nothing blocks the reactor, no frame is dropped, one connection may carry many
generations, and a generation whose connection is gone keeps its events in the retry buffer for
the next RECONCILE (which also moves the rest of the stream to the reconciling connection).

It never decodes bytes itself beyond calling :mod:`sfnode.linkf.wire`, never touches a socket (it
sends through :class:`~sfnode.node.protocol.NodeConnection`), never builds a protocol factory (the
tap does: ``sfnode.node.tap.node_factory``), and reads time only from the reactor it is given.

Bounds (issue 5), each a :class:`~sfnode.node.config.NodeConfig` field: a generation whose retry
buffer reaches ``max_unacked_events`` stops and fences its session; a generation whose head
stopped reading holds at most ``max_held_tokens`` tokens, then stops as if the head were gone
(its sent events stay for a RECONCILE); an ASSIGN beyond ``max_sessions`` live sessions is
refused and that session's GENERATE_REQs are declined (a head fails over); a fenced session is
deleted ``fenced_grace_ms`` after its fence, or when a new session needs its place; beyond
``max_generations`` running or queued generations a GENERATE_REQ is declined.
:meth:`NodeAgent.drain` is the SIGTERM path.

Logprobs (section 12.1): the node sets ``FEATURE_LOGPROBS`` when its engine
``supports_logprobs``, and a generation whose session's GenParams ask for them sends
TokensLogprobs events instead of Tokens, coalesced, retried and retransmitted alike.

Constraints (section 12.3): the node sets ``FEATURE_CONSTRAINTS`` when its engine
``supports_constraints`` and hands a GENERATE_REQ's constraint to the engine with the request;
a constraint the engine cannot honour is a refusal (FINISH_REFUSED), as is one sent to a node
that did not offer the bit.

Section numbers in this module are those of docs/protocol.md.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import psutil
from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.generation import (
    Engine,
    EngineRefusal,
    Generation,
    GenerationRequest,
    GenerationResult,
    StageForwardError,
    StageResult,
    TokenBatch,
    TokenLogprob,
)
from sfnode.linkf.handshake import read_hello
from sfnode.linkf.idempotency import GenerationKey
from sfnode.linkf.model_files import XFER_ABORT_UNKNOWN, Bundle, transfer_messages
from sfnode.linkf.wire import (
    F32_MAX,
    FEATURE_CONSTRAINTS,
    FEATURE_HEAD_IDENTITY,
    FEATURE_LOGPROBS,
    FEATURE_MODEL_FILES,
    FEATURE_REQUEST_CLASS,
    FINISH_DECLINED,
    FINISH_REFUSED,
    LOGPROBS_MAX,
    PROTO_VERSION,
    U32_MAX,
    AppendContentMsg,
    BlobFetchMsg,
    CapacitySummary,
    Finish,
    Frame,
    GenerateCancelMsg,
    GenerateReqMsg,
    Hello,
    HelloAckF,
    LeaseGrantMsg,
    LeaseRenewMsg,
    LinkFLimits,
    MemCountersMsg,
    Message,
    ModelFilesOffer,
    NodeStatusMsg,
    ReconcileMsg,
    SessionAssignMsg,
    SessionRevokeMsg,
    StageForwardReqMsg,
    StageForwardRespMsg,
    TokenEvent,
    TokenEventsMsg,
    Tokens,
    TokensLogprobs,
    WatermarkAckMsg,
    WireError,
    XferAbortMsg,
    decode_message,
    decode_params,
    decode_tokens,
)
from sfnode.node.capacity import NodeLoad
from sfnode.node.config import COALESCE_MS, COALESCE_TOKENS, NodeConfig
from sfnode.node.machines import (
    DrainCore,
    DrainInputs,
    DrainMachine,
    GenerationCore,
    GenerationInputs,
    GenerationMachine,
)
from sfnode.node.protocol import NodeConnection, NodeProtocol
from sfnode.node.sessions import RENEW_INTERVAL_MS, AgentSession

log = Logger()

M = TypeVar("M", bound=Message)


# ============================================================================================
# The dispatch table


@dataclass(frozen=True)
class Handler(Generic[M]):
    """One entry of the dispatch table: a message class and what the node does with it."""

    message_class: type[M]
    respond: Callable[[NodeAgent, NodeConnection, M], None]
    lenient: bool
    """True: a malformed payload is logged and ignored instead of closing the connection."""


class HandlerTable:
    """The node's responders, one per message class (section 7.2).

    Types without an entry are ignored without decoding their payload.
    """

    def __init__(self) -> None:
        self._by_type: dict[int, Handler[Any]] = {}

    def handles(
        self, message_class: type[M], *, lenient: bool = False
    ) -> Callable[
        [Callable[[NodeAgent, NodeConnection, M], None]],
        Callable[[NodeAgent, NodeConnection, M], None],
    ]:
        """Register the decorated method as the node's responder to ``message_class``."""

        def register(
            respond: Callable[[NodeAgent, NodeConnection, M], None],
        ) -> Callable[[NodeAgent, NodeConnection, M], None]:
            if message_class.MSG_TYPE in self._by_type:
                raise ValueError(f"{message_class.__name__} already has a handler")
            self._by_type[message_class.MSG_TYPE] = Handler(message_class, respond, lenient)
            return respond

        return register

    def get(self, msg_type: int) -> Handler[Any] | None:
        return self._by_type.get(msg_type)

    def message_classes(self) -> list[type[Message]]:
        """Every handled message class, in catalog order."""
        return [self._by_type[t].message_class for t in sorted(self._by_type)]


HANDLERS = HandlerTable()
handles = HANDLERS.handles


# ============================================================================================
# The sessions of one head


class HeadSessions:
    """The session table of one head identity (decision D13), and the owner its sessions'
    lease machines report to: what they ask goes to the node with this table named."""

    def __init__(self, agent: NodeAgent, head_id: int | None) -> None:
        self.agent = agent
        self.head_id = head_id
        """The HELLO's ``head_id``; None for the table that heads without one share."""
        self.table: AgentSession[NodeConnection] = AgentSession(
            agent.clock,
            owner=self,
            renew_interval_ms=RENEW_INTERVAL_MS,
            grace_ms=agent.config.fenced_grace_ms,
            started_at=agent.started_at,
        )

    @property
    def label(self) -> str:
        """How log lines name this head: its identity in hex, or "a head without identity"."""
        return "a head without identity" if self.head_id is None else f"head {self.head_id:016x}"

    # SessionOwner

    def send_renew(self, session_id: int) -> None:
        self.agent.send_renew(self, session_id)

    def self_fenced(self, session_id: int) -> None:
        self.agent.self_fenced(self, session_id)

    def gave_up(self, session_id: int, reason: str) -> None:
        self.agent.gave_up(self, session_id, reason)

    def orphaned(self, session_id: int) -> None:
        self.agent.orphaned(self, session_id)


# ============================================================================================
# Generations


def checked_logprobs(batch: TokenBatch, asked: int) -> TokenBatch:
    """An engine's batch as a TokensLogprobs event may carry it (docs/protocol.md section
    12.1): ``asked - 1`` alternatives at most (none when ``asked`` is 1), every value clamped
    into ``[-f32 max, 0]`` (rounding above 0, and -inf for a token the engine gave no chance).

    :raises ValueError: no logprobs, or a NaN (an engine fault).
    """
    if batch.logprobs is None:
        raise ValueError("the engine handed over tokens without their logprobs")
    alternatives = asked - 1
    return TokenBatch(
        batch.tokens,
        tuple(
            TokenLogprob(
                _clamped(entry.logprob),
                tuple((token, _clamped(value)) for token, value in entry.top[:alternatives]),
            )
            for entry in batch.logprobs
        ),
    )


def _clamped(value: float) -> float:
    if math.isnan(value):
        raise ValueError("the engine gave a NaN logprob")
    return min(max(value, -F32_MAX), 0.0)


@dataclass(eq=False)
class NodeGeneration:
    """One accepted generation: the owner of its machine and of its engine generation."""

    agent: NodeAgent
    key: GenerationKey
    connection: NodeConnection
    """Where its events go; moved by a RECONCILE, kept when closed (events then wait)."""
    head: HeadSessions
    """The table of the head whose session it is."""
    logprobs: int = 0
    """The session's GenParams.logprobs as this node honours it: 0 sends Tokens events; n from
    1 to LOGPROBS_MAX sends TokensLogprobs with n - 1 alternatives (docs/protocol.md 12.1)."""
    machine: GenerationInputs = field(init=False)
    engine_generation: Generation | None = None
    held: list[TokenBatch] = field(default_factory=list)
    """Batches not emitted yet because the head stopped reading (bounded by max_held_tokens)."""
    held_tokens: int = 0

    def emit_tokens(self, batch: TokenBatch) -> bool:
        connection = self.connection
        if connection.open and not connection.writable:
            self.held.append(batch)
            self.held_tokens += len(batch)
            cap = self.agent.config.max_held_tokens
            if cap and self.held_tokens > cap:
                log.warn(
                    "stopped generation {generation} of session {session}: its head at {peer} "
                    "has not read for {count} tokens (max_held_tokens {cap})",
                    generation=self.key.generation_id,
                    session=self.key.session_id,
                    peer=connection.peer,
                    count=self.held_tokens,
                    cap=cap,
                )
                self._take_held()
                return False
            return True
        return self._emit(self._payload(TokenBatch.join([*self._take_held(), batch])))

    def release_held(self) -> None:
        """The head reads again: send what was held (a refusal stops it at the next flush)."""
        if self.held:
            self._emit(self._payload(TokenBatch.join(self._take_held())))

    def _take_held(self) -> list[TokenBatch]:
        held, self.held = self.held, []
        self.held_tokens = 0
        return held

    def _payload(self, batch: TokenBatch) -> Tokens:
        """Tokens, or TokensLogprobs for a generation that asked for logprobs (coalesced
        together, so an event carries the logprobs of exactly its tokens)."""
        if not self.logprobs:
            return Tokens(batch.tokens)
        logprobs = batch.logprobs or ()
        return TokensLogprobs(
            batch.tokens,
            tuple(entry.logprob for entry in logprobs),
            tuple(entry.top for entry in logprobs) if self.logprobs > 1 else (),
        )

    def emit_finish(self, reason: int) -> None:
        self.release_held()
        self._emit(Finish(reason))

    def _emit(self, payload: Tokens | Finish) -> bool:
        sessions = self.head.table
        session_id, generation_id, _ = self.key
        cap = self.agent.config.max_unacked_events
        if cap and sessions.unacked_events(session_id, generation_id) >= cap:
            sessions.give_up(
                session_id,
                f"generation {generation_id} has {cap} unacknowledged events "
                f"(max_unacked_events {cap})",
            )
            return False
        batch = sessions.emit(session_id, generation_id, payload)
        if batch is None:
            return False
        self.connection.send(batch)
        return True

    def stop_engine(self) -> None:
        if self.engine_generation is not None:
            self.engine_generation.cancel()

    def fail(self, reason: str) -> None:
        self.connection.close(
            f"generation {self.key.generation_id} of session {self.key.session_id} failed in "
            f"the engine: {reason}"
        )

    def done(self) -> None:
        self.agent.generation_done(self)


# ============================================================================================
# The node


class NodeAgent:
    """A Link F node: shared by every connection it serves, in either dial direction."""

    def __init__(
        self,
        reactor: IReactorTime,
        engine: Engine,
        config: NodeConfig,
        model_files: Bundle | None = None,
    ) -> None:
        self._reactor = reactor
        self.engine = engine
        self.config = config
        self.model_files = model_files
        """The files a head needs to serve the model (docs/protocol.md section 12.5), offered
        in HELLO_ACK_F and sent on BLOB_FETCH; None: the node offers none."""
        self._transfer_ids = itertools.count(1)
        self.started_at = reactor.seconds()
        """The node's time base (section 6.1), shared by the tables of all heads."""
        self._heads: dict[int | None, HeadSessions] = {}
        """The session table of each head identity (D13); None: heads without one."""
        self._generations: dict[GenerationKey, NodeGeneration] = {}
        self._connections: list[NodeConnection] = []
        self._protocols: set[NodeProtocol] = set()
        self._load = NodeLoad()
        self._host_memory_bytes = int(psutil.virtual_memory().total)
        self._at_session_cap = False
        self._at_generation_cap = False
        self._drain: DrainInputs = DrainMachine(
            DrainCore(
                clock=reactor,
                owner=self,
                drain_timeout_ms=config.drain_timeout_ms,
                ack_wait_ms=config.drain_ack_wait_ms,
            )
        )

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        self.engine.start()

    def drain(self) -> defer.Deferred[None]:
        """Stop taking generations, let the running ones finish, then settle (issue 5).

        New GENERATE_REQs are declined at once.  Running generations get ``drain_timeout_ms``
        to finish; the rest are cancelled (their Finish is CANCELLED).  Then the node waits up
        to ``drain_ack_wait_ms`` for the heads to acknowledge the final events.  Connections
        stay open throughout; :meth:`stop` closes them.  Calling it again joins the same drain.
        """
        return self._drain.drain()

    @defer.inlineCallbacks
    def stop(self) -> Generator[defer.Deferred[Any], Any, None]:
        """End any drain, close every connection, stop every lease timer and the engine."""
        self._drain.stopped()
        yield self.close_connections("the node is stopping")
        for head in list(self._heads.values()):
            head.table.stop_all()
        yield self.engine.stop()

    def close_connections(self, reason: str) -> defer.Deferred[None]:
        """Close every connection (in its handshake or not); fires once all of them are gone."""
        protocols = list(self._protocols)
        waiting = [p.lost for p in protocols]
        for protocol in protocols:
            protocol.close(reason)
        return defer.gatherResults(waiting).addCallback(lambda _: None)

    def now_ms(self) -> int:
        """Monotonic milliseconds since this node was created (section 6.1)."""
        return int((self._reactor.seconds() - self.started_at) * 1000)

    # ------------------------------------------------------------------ session tables (D13)

    def sessions_of(self, head_id: int | None = None) -> AgentSession[NodeConnection]:
        """The session table of one head identity (None: heads without one); an empty table
        when that head holds nothing here."""
        head = self._heads.get(head_id)
        return head.table if head is not None else HeadSessions(self, head_id).table

    @property
    def session(self) -> AgentSession[NodeConnection]:
        """The table of the heads that gave no identity in their HELLO."""
        return self._head(None).table

    def _head(self, head_id: int | None) -> HeadSessions:
        head = self._heads.get(head_id)
        if head is None:
            head = self._heads[head_id] = HeadSessions(self, head_id)
        return head

    def _head_of(self, connection: NodeConnection) -> HeadSessions:
        return self._head(connection.head_id)

    def _forget_head_if_idle(self, head: HeadSessions) -> None:
        """Drop an empty table whose head has no connection left (bounded memory whatever
        identities heads invent)."""
        if head.head_id is None or len(head.table):
            return
        if any(c.head_id == head.head_id for c in self._connections):
            return
        if self._heads.get(head.head_id) is head:
            del self._heads[head.head_id]

    def live_sessions(self) -> int:
        """Sessions held and not fenced, over every head: what ``max_sessions`` bounds."""
        return sum(head.table.live_count() for head in self._heads.values())

    def session_records(self) -> int:
        """Sessions held, fenced ones included, over every head."""
        return sum(len(head.table) for head in self._heads.values())

    def sessions_with_context(self) -> int:
        """Sessions holding a token context, over every head."""
        return sum(1 for head in self._heads.values() for s in head.table if s.context is not None)

    @property
    def connections(self) -> Sequence[NodeConnection]:
        """Connections past their handshake."""
        return tuple(self._connections)

    @property
    def protocols(self) -> frozenset[NodeProtocol]:
        """Every transport of this node not yet lost, in its handshake or past it."""
        return frozenset(self._protocols)

    @property
    def running_generations(self) -> int:
        return len(self._generations)

    @property
    def accepting(self) -> bool:
        """Whether new generations are taken: True until the drain starts."""
        return self._drain.accepting()

    @property
    def contexts(self) -> Mapping[int, array[int]]:
        """Each session's token context, for the sessions that have one, of the heads without
        identity (:meth:`contexts_of` for a head that has one)."""
        return self.contexts_of(None)

    def contexts_of(self, head_id: int | None) -> Mapping[int, array[int]]:
        """Each session's token context, for that head's sessions that have one."""
        head = self._heads.get(head_id)
        if head is None:
            return {}
        return {s.session_id: s.context for s in head.table if s.context is not None}

    # ------------------------------------------------------------------ ConnectionHost

    @property
    def clock(self) -> IReactorTime:
        return self._reactor

    @property
    def handshake_timeout_ms(self) -> int:
        return self.config.handshake_timeout_ms

    @property
    def idle_timeout_ms(self) -> int:
        return self.config.idle_timeout_ms

    @property
    def status_interval_ms(self) -> int:
        return self.config.status_interval_ms

    def read_hello(self, frame: Frame) -> Hello | str:
        return read_hello(frame, self.config.auth_token)

    def hello_ack(self) -> HelloAckF:
        return HelloAckF(
            chosen_version=PROTO_VERSION,
            node_identity=self.config.identity,
            capacity=self.capacity(),
            loadable_models=(self.config.model_name,),
            # Every engine reads GenerationRequest.interactive (section 12.2).
            feature_flags=FEATURE_REQUEST_CLASS
            | FEATURE_HEAD_IDENTITY
            | (FEATURE_LOGPROBS if self.engine.supports_logprobs else 0)
            | (FEATURE_CONSTRAINTS if self.engine.supports_constraints else 0)
            | (FEATURE_MODEL_FILES if self.model_files is not None else 0),
            limits=LinkFLimits(),
            model_files=(
                ModelFilesOffer(self.model_files.content_hash, len(self.model_files.data))
                if self.model_files is not None
                else None
            ),
        )

    def status(self) -> NodeStatusMsg:
        capacity = self.capacity()
        return NodeStatusMsg(
            capacity=capacity,
            loadable_models=(self.config.model_name,),
            mem=MemCountersMsg(
                pool_blocks_total=capacity.kv_blocks_total,
                pool_blocks_used=capacity.kv_blocks_used,
            ),
        )

    def protocol_opened(self, protocol: NodeProtocol) -> None:
        self._protocols.add(protocol)

    def protocol_closed(self, protocol: NodeProtocol) -> None:
        self._protocols.discard(protocol)

    def connection_ready(self, connection: NodeConnection) -> None:
        self._connections.append(connection)

    def connection_writable(self, connection: NodeConnection, writable: bool) -> None:
        if not writable:
            return
        for generation in list(self._generations.values()):
            if generation.connection is connection:
                generation.release_held()

    def connection_ended(self, connection: NodeConnection) -> None:
        self._connections.remove(connection)
        head = self._heads.get(connection.head_id)
        if head is None:
            return
        for session in head.table:
            if session.home is connection:
                session.home = None
        self._forget_head_if_idle(head)

    @property
    def rates(self) -> tuple[int, int]:
        """The latest busy-time (decode, prefill) tokens per second, without a new sample."""
        rates = self._load.rates
        return rates.decode_tokens_per_s, rates.prefill_tokens_per_s

    def capacity(self) -> CapacitySummary:
        """A fresh capacity sample (section 7.5 and decision D8)."""
        return self._load.summary(
            self.now_ms(),
            self.engine.statistics(),
            host_memory_bytes=self._host_memory_bytes,
            active_sessions=self.live_sessions(),
            max_sessions=self.config.max_sessions,
            max_context_tokens=self.engine.context_window,
            max_lanes=self.config.max_lanes,
        )

    # ------------------------------------------------------------------ dispatch (7.2)

    def serve(self, connection: NodeConnection, frame: Frame) -> None:
        """Handle one frame of a connection past its handshake.

        Raises :class:`WireError` for a malformed payload of a handled type (unless its
        handler is lenient); the connection then closes itself.  Types without a handler are
        dropped undecoded.
        """
        handler = HANDLERS.get(frame.msg_type)
        if handler is None:
            return
        try:
            message = decode_message(frame.msg_type, frame.payload)
        except WireError as e:
            if not handler.lenient:
                raise
            log.warn(
                "ignored a malformed {name}: {error}",
                name=handler.message_class.MSG_TYPE.name,
                error=e,
            )
            return
        handler.respond(self, connection, message)

    @handles(ReconcileMsg)
    def _on_reconcile(self, connection: NodeConnection, msg: ReconcileMsg) -> None:
        head = self._head_of(connection)
        ack, retransmissions = head.table.on_reconcile(msg)
        connection.send(ack)
        for batch in retransmissions:
            connection.send(batch)
        for entry in ack.sessions:
            session = head.table.get(entry.session_id)
            if entry.held and session is not None:
                session.home = connection
                for generation in self._generations_of(head, entry.session_id):
                    generation.connection = connection

    @handles(SessionAssignMsg)
    def _on_assign(self, connection: NodeConnection, msg: SessionAssignMsg) -> None:
        head = self._head_of(connection)
        cap = self.config.max_sessions
        if cap and not head.table.has_session(msg.session_id):
            if self.live_sessions() >= cap:
                # Silent, as every refused ASSIGN (section 7.2); its GENERATE_REQs are
                # declined, which a head fails over on.
                if not self._at_session_cap:
                    log.warn(
                        "refusing new sessions (the first: session {session} of {head}): this "
                        "node holds max_sessions={cap} live sessions",
                        session=msg.session_id,
                        head=head.label,
                        cap=cap,
                    )
                self._at_session_cap = True
                return
            if self.session_records() >= cap:
                self._make_room()
        session = head.table.on_assign(msg)
        if session is None:
            return
        self._at_session_cap = False
        session.params = decode_params(msg.params)
        session.home = connection

    def _make_room(self) -> None:
        """Delete the session fenced longest ago, of any head, for a new one (section 7.7)."""
        oldest: tuple[int, HeadSessions, int] | None = None
        for head in self._heads.values():
            session = head.table.oldest_fenced()
            if session is not None and (oldest is None or session.fenced_at < oldest[0]):
                oldest = (session.fenced_at, head, session.session_id)
        if oldest is None:
            return
        _, head, session_id = oldest
        log.info(
            "deleted fenced session {session} of {head} to make room for a new session",
            session=session_id,
            head=head.label,
        )
        head.table.delete(session_id)
        self._cancel_generations_of(head, session_id)
        self._forget_head_if_idle(head)

    @handles(SessionRevokeMsg)
    def _on_revoke(self, connection: NodeConnection, msg: SessionRevokeMsg) -> None:
        head = self._head_of(connection)
        if head.table.on_revoke(msg) is not None:
            self._cancel_generations_of(head, msg.session_id)
            self._forget_head_if_idle(head)

    @handles(AppendContentMsg)
    def _on_append(self, connection: NodeConnection, msg: AppendContentMsg) -> None:
        session = self._head_of(connection).table.on_append(
            msg.session_id, msg.epoch, msg.command_id
        )
        if session is None:
            return
        session.home = connection
        # Strict: a malformed context is fatal to the connection, after the command was
        # recorded (section 7.2).
        session.context = array("I", decode_tokens(msg.blocks))

    @handles(GenerateReqMsg)
    def _on_generate(self, connection: NodeConnection, msg: GenerateReqMsg) -> None:
        if not self._drain.accepting():
            self._answer_at_once(connection, msg, FINISH_DECLINED)
            return
        cap = self.config.max_generations
        if cap and len(self._generations) >= cap:
            if not self._at_generation_cap:
                log.warn("declining generations: {cap} are running or queued", cap=cap)
            self._at_generation_cap = True
            self._answer_at_once(connection, msg, FINISH_DECLINED)
            return
        self._at_generation_cap = False
        head = self._head_of(connection)
        session = head.table.on_generate(msg)
        if session is None:
            self._answer_at_once(connection, msg, FINISH_DECLINED)
            return
        session.home = connection
        if msg.constraint is not None and not self.engine.supports_constraints:
            # Only a head that ignored this node's HELLO_ACK_F sends one (section 12.3).
            log.info(
                "refused generation {generation} of session {session}: this node does not "
                "honour constraints",
                generation=msg.generation_id,
                session=msg.session_id,
            )
            self._answer_at_once(connection, msg, FINISH_REFUSED)
            return
        params = session.params
        # Logprobs only from an engine that has them (this node's HELLO_ACK_F said so); a
        # value past the largest reads as the largest (docs/protocol.md section 12.1).
        asked = min(params.logprobs, LOGPROBS_MAX) if self.engine.supports_logprobs else 0
        if asked != params.logprobs:
            params = replace(params, logprobs=asked)
        self._start_generation(
            connection,
            head,
            msg,
            GenerationRequest(
                context=tuple(session.context or ()),
                params=params,
                max_new=min(msg.budgets.max_new_tokens, U32_MAX),
                max_wall_ms=msg.budgets.max_wall_ms,
                interactive=msg.interactive,
                constraint=msg.constraint,
            ),
        )

    def _answer_at_once(self, connection: NodeConnection, msg: GenerateReqMsg, reason: int) -> None:
        """A Finish sent at once, bypassing the retry buffer and the event seqs (section 7.3)."""
        connection.send(
            TokenEventsMsg(
                (TokenEvent(msg.session_id, msg.epoch, msg.generation_id, 0, Finish(reason)),)
            )
        )

    @handles(StageForwardReqMsg)
    def _on_stage_forward(self, connection: NodeConnection, msg: StageForwardReqMsg) -> None:
        def answer(result: StageResult) -> None:
            connection.send(StageForwardRespMsg(msg.request_id, result.hidden, result.token))

        def refuse(failure: Failure) -> None:
            if not isinstance(failure.value, StageForwardError):
                log.failure("stage forward {request} failed", failure, request=msg.request_id)
            else:
                log.info(
                    "stage forward {request} refused: {reason}",
                    request=msg.request_id,
                    reason=failure.getErrorMessage(),
                )
            connection.send(StageForwardRespMsg(msg.request_id, None, None))

        self.engine.stage_forward(
            msg.tokens, msg.start_layer, msg.end_layer, msg.hidden_in
        ).addCallbacks(answer, refuse)

    @handles(BlobFetchMsg)
    def _on_blob_fetch(self, connection: NodeConnection, msg: BlobFetchMsg) -> None:
        """Send the model files a head asks for by their hash (section 12.5), else abort."""
        transfer_id = next(self._transfer_ids)
        files = self.model_files
        if files is None or files.content_hash != msg.content_hash:
            connection.send(XferAbortMsg(transfer_id, XFER_ABORT_UNKNOWN))
            return
        log.info(
            "sending the model files {hash} ({size} bytes) to the head",
            hash=files.short_hash,
            size=len(files.data),
        )
        for message in transfer_messages(files, transfer_id):
            connection.send(message)

    @handles(WatermarkAckMsg)
    def _on_watermark_ack(self, connection: NodeConnection, msg: WatermarkAckMsg) -> None:
        self._head_of(connection).table.on_watermark_ack(msg)
        self._drain.acked()

    @handles(LeaseGrantMsg)
    def _on_lease_grant(self, connection: NodeConnection, msg: LeaseGrantMsg) -> None:
        self._head_of(connection).table.on_lease_grant(msg)

    @handles(GenerateCancelMsg, lenient=True)
    def _on_cancel(self, connection: NodeConnection, msg: GenerateCancelMsg) -> None:
        key = GenerationKey(msg.session_id, msg.generation_id, connection.head_id)
        generation = self._generations.get(key)
        if generation is not None:
            generation.machine.cancel()

    # ------------------------------------------------------------------ generations (7.3)

    def _start_generation(
        self,
        connection: NodeConnection,
        head: HeadSessions,
        msg: GenerateReqMsg,
        request: GenerationRequest,
    ) -> None:
        key = GenerationKey(msg.session_id, msg.generation_id, head.head_id)
        previous = self._generations.get(key)
        if previous is not None:
            # The same generation id again with a fresh command: the entry (and its event
            # sequence) continues (section 6.2); the older run stops sending.
            previous.machine.cancel()
        asked = request.params.logprobs
        generation = NodeGeneration(self, key, connection, head, logprobs=asked)
        machine = generation.machine = GenerationMachine(
            GenerationCore(
                clock=self._reactor,
                owner=generation,
                coalesce_tokens=COALESCE_TOKENS,
                coalesce_ms=COALESCE_MS,
            )
        )
        self._generations[key] = generation
        self._load.busy.started(self.now_ms())

        def on_tokens(batch: TokenBatch) -> None:
            if not asked:
                machine.tokens(batch if batch.logprobs is None else TokenBatch(batch.tokens))
                return
            try:
                checked = checked_logprobs(batch, asked)
            except ValueError as e:
                log.error(
                    "generation {generation} of session {session}: {error}",
                    generation=msg.generation_id,
                    session=msg.session_id,
                    error=str(e),
                )
                generation.stop_engine()
                machine.failed(str(e))
                return
            machine.tokens(checked)

        engine_generation = self.engine.submit(request, on_tokens)
        generation.engine_generation = engine_generation

        def failed(failure: Failure) -> None:
            if isinstance(failure.value, EngineRefusal):
                log.info(
                    "refused generation {generation} of session {session}: {reason}",
                    generation=msg.generation_id,
                    session=msg.session_id,
                    reason=failure.getErrorMessage(),
                )
                machine.refused()
            else:
                log.failure("generation {key} failed in the engine", failure, key=tuple(key))
                machine.failed(failure.getErrorMessage())

        def finished(result: GenerationResult) -> None:
            machine.finished(result)

        engine_generation.result.addCallbacks(finished, failed)

    def generation_done(self, generation: NodeGeneration) -> None:
        self._load.busy.stopped(self.now_ms())
        if self._generations.get(generation.key) is generation:
            del self._generations[generation.key]
        self._drain.generation_done()

    def _generations_of(self, head: HeadSessions, session_id: int) -> list[NodeGeneration]:
        return [
            g
            for key, g in self._generations.items()
            if key.session_id == session_id and key.head_id == head.head_id
        ]

    def _cancel_generations_of(self, head: HeadSessions, session_id: int) -> None:
        for generation in self._generations_of(head, session_id):
            generation.machine.cancel()

    # ------------------------------------------------------------------ what lease machines ask

    def send_renew(self, head: HeadSessions, session_id: int) -> None:
        """A lease machine asks for a grant: to the session's home, else the first connection
        of the same head."""
        session = head.table.get(session_id)
        if session is None:
            return
        home = session.home
        if home is not None and home.open:
            targets = [home]
        else:
            targets = [c for c in self._connections if c.head_id == head.head_id][:1]
        for connection in targets:
            connection.send(LeaseRenewMsg(session_id, session.epoch))

    def self_fenced(self, head: HeadSessions, session_id: int) -> None:
        """That session's lease expired (its machine fenced it): forget its context and stop
        its generations; its record and unacknowledged events stay for the grace period
        (section 6.4)."""
        log.warn(
            "session {session} of {head} fenced itself: its lease expired",
            session=session_id,
            head=head.label,
        )
        session = head.table.get(session_id)
        if session is not None:
            session.forget_context()
        self._cancel_generations_of(head, session_id)

    def gave_up(self, head: HeadSessions, session_id: int, reason: str) -> None:
        """That session's machine fenced it because a bound was reached: forget its context."""
        log.warn(
            "fenced session {session} of {head}: {reason}",
            session=session_id,
            head=head.label,
            reason=reason,
        )
        session = head.table.get(session_id)
        if session is not None:
            session.forget_context()

    def orphaned(self, head: HeadSessions, session_id: int) -> None:
        """That session stayed fenced for the grace period: no head came back for it, so its
        record and unacknowledged events go (section 6.4)."""
        log.info(
            "deleted session {session} of {head}: fenced for {grace} ms and not reclaimed",
            session=session_id,
            head=head.label,
            grace=self.config.fenced_grace_ms,
        )
        head.table.remove_orphan(session_id)
        self._cancel_generations_of(head, session_id)
        self._forget_head_if_idle(head)

    # ------------------------------------------------------------------ DrainOwner

    def running_generation_keys(self) -> frozenset[GenerationKey]:
        return frozenset(self._generations)

    def cancel_generations(self) -> None:
        for generation in list(self._generations.values()):
            generation.machine.cancel()

    def unacked_events(self, keys: frozenset[GenerationKey]) -> int:
        total = 0
        for session_id, generation_id, head_id in keys:
            head = self._heads.get(head_id)
            if head is not None:
                total += head.table.unacked_events(session_id, generation_id)
        return total
