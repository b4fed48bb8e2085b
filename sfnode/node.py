"""The node agent: the one owner that wires session state, machines, engine and connections.

:class:`NodeAgent` holds what all connections of one node share (LINKF 6.1): the pure session
state (:class:`~sfnode.agent_session.AgentSession`), each session's token context and
sampling parameters, a lease machine per session, the running generations, and the busy-time
rates.  It dispatches decoded frames (LINKF 6.3) and follows decision D2: nothing blocks the
reactor, no frame is dropped, one connection may carry many generations, and a generation whose
connection is gone keeps its events in the retry buffer for the next RECONCILE (which also moves
the rest of the stream to the reconciling connection).

It never decodes bytes itself beyond calling :mod:`sfnode.wire`, never touches a socket (it
sends through :class:`~sfnode.protocol.NodeConnection`), and reads time only from the reactor it
is given.

Bounds (issue 5), each a :class:`~sfnode.config.NodeConfig` field: a generation whose retry
buffer reaches ``max_unacked_events`` stops and fences its session; a generation whose head
stopped reading holds at most ``max_held_tokens`` tokens, then stops as if the head were gone
(its sent events stay for a RECONCILE); an ASSIGN beyond ``max_sessions`` is refused and that
session's GENERATE_REQs get FINISH_REFUSED; beyond ``max_generations`` running or queued
generations a GENERATE_REQ is declined.  :meth:`NodeAgent.drain` is the SIGTERM path.
"""

from __future__ import annotations

import hmac
from array import array
from collections import OrderedDict
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, IProtocolFactory, IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.agent_session import RENEW_INTERVAL_MS, AgentSession
from sfnode.capacity import BusyTimer, RateTracker
from sfnode.config import COALESCE_MS, COALESCE_TOKENS, NodeConfig
from sfnode.generation import (
    Engine,
    EngineRefusal,
    Generation,
    GenerationRequest,
    GenerationResult,
    StageForwardError,
    StageResult,
)
from sfnode.machines import (
    GenerationCore,
    GenerationInputs,
    GenerationMachine,
    SessionCore,
    SessionInputs,
    SessionMachine,
)
from sfnode.noise import Role, secure_factory
from sfnode.protocol import NodeConnection, NodeFactory
from sfnode.wire import (
    FINISH_DECLINED,
    FINISH_REFUSED,
    PROTO_VERSION,
    U32_MAX,
    AppendContentMsg,
    CapacitySummary,
    Finish,
    Frame,
    GenerateCancelMsg,
    GenerateReqMsg,
    GenParams,
    Hello,
    HelloAckF,
    LeaseGrantMsg,
    LeaseRenewMsg,
    LinkFLimits,
    LinkRole,
    MemCountersMsg,
    MsgType,
    NodeStatusMsg,
    ReconcileMsg,
    SessionAssignMsg,
    SessionRevokeMsg,
    StageForwardReqMsg,
    StageForwardRespMsg,
    TokenEvent,
    TokenEventsMsg,
    Tokens,
    WatermarkAckMsg,
    WireError,
    decode_frame,
    decode_params,
    decode_tokens,
    negotiate,
)

log = Logger()

SUPPORTED_VERSIONS = (PROTO_VERSION, PROTO_VERSION)

REFUSED_SESSIONS_KEPT = 4096
"""How many sessions refused for max_sessions the node remembers (to answer FINISH_REFUSED)."""

GenerationKey = tuple[int, int]
"""(session_id, generation_id): how the node names a generation (LINKF 5.1)."""


@dataclass(eq=False)
class NodeGeneration:
    """One accepted generation: the owner of its machine and of its engine generation."""

    agent: NodeAgent
    key: GenerationKey
    connection: NodeConnection
    """Where its events go; moved by a RECONCILE, kept when closed (events then wait)."""
    machine: GenerationInputs = field(init=False)
    engine_generation: Generation | None = None
    held: list[int] = field(default_factory=list)
    """Tokens not emitted yet because the head stopped reading (bounded by max_held_tokens)."""

    def emit_tokens(self, tokens: Sequence[int]) -> bool:
        connection = self.connection
        if connection.open and not connection.writable:
            self.held.extend(tokens)
            cap = self.agent.config.max_held_tokens
            if cap and len(self.held) > cap:
                session_id, generation_id = self.key
                log.warn(
                    "stopped generation {generation} of session {session}: its head at {peer} "
                    "has not read for {count} tokens (max_held_tokens {cap})",
                    generation=generation_id,
                    session=session_id,
                    peer=connection.peer,
                    count=len(self.held),
                    cap=cap,
                )
                self.held.clear()
                return False
            return True
        held, self.held = self.held, []
        return self._emit(Tokens((*held, *tokens)))

    def release_held(self) -> None:
        """The head reads again: send what was held (a refusal stops it at the next flush)."""
        if self.held:
            held, self.held = self.held, []
            self._emit(Tokens(tuple(held)))

    def emit_finish(self, reason: int) -> None:
        self.release_held()
        self._emit(Finish(reason))

    def _emit(self, payload: Tokens | Finish) -> bool:
        agent = self.agent
        cap = agent.config.max_unacked_events
        if cap and agent.session.unacked_events(*self.key) >= cap:
            agent.give_up(
                self.key[0],
                f"generation {self.key[1]} has {cap} unacknowledged events "
                f"(max_unacked_events {cap})",
            )
            return False
        batch = agent.session.emit(*self.key, payload)
        if batch is None:
            return False
        self.connection.send(batch)
        return True

    def stop_engine(self) -> None:
        if self.engine_generation is not None:
            self.engine_generation.cancel()

    def fail(self, reason: str) -> None:
        session_id, generation_id = self.key
        self.connection.close(
            f"generation {generation_id} of session {session_id} failed in the engine: {reason}"
        )

    def done(self) -> None:
        self.agent.generation_done(self)


@dataclass(eq=False)
class NodeSession:
    """The node's side of one session beyond the pure state: its lease machine and home."""

    machine: SessionInputs
    home: NodeConnection | None = None
    """The connection that last spoke for this session; renewals go there first."""


class NodeAgent:
    """A Link F node: shared by every connection it serves, in either dial direction."""

    def __init__(self, reactor: IReactorTime, engine: Engine, config: NodeConfig) -> None:
        self._reactor = reactor
        self.engine = engine
        self.config = config
        self.session = AgentSession()
        self.contexts: dict[int, array[int]] = {}
        """Each session's token context, 4 bytes a token (at most one 16 MiB APPEND each)."""
        self.params: dict[int, GenParams] = {}
        self._sessions: dict[int, NodeSession] = {}
        self._generations: dict[GenerationKey, NodeGeneration] = {}
        self._connections: list[NodeConnection] = []
        self._started_at = reactor.seconds()
        self._busy = BusyTimer()
        self._rates = RateTracker()
        self._host_memory_bytes = int(psutil.virtual_memory().total)
        self._factory = NodeFactory(self, config.max_handshakes)
        self._secure_factory = secure_factory(
            self._factory,
            config.auth_token,
            role=Role.RESPONDER,
            clock=reactor,
            handshake_timeout_s=config.handshake_timeout_ms / 1000.0,
            on_refused=self._refused,
        )
        self._refusal_observers: list[Callable[[str], None]] = []
        self._refused_sessions: OrderedDict[int, None] = OrderedDict()
        """Sessions whose ASSIGN was refused for max_sessions (newest last, bounded)."""
        self._at_generation_cap = False
        self.draining = False
        """True once :meth:`drain` started: every new GENERATE_REQ is declined."""
        self._drain_phase: str | None = None
        """None, then "generations" (waiting for them), "acks" (waiting for acks), "done"."""
        self._drain_waiters: list[defer.Deferred[None]] = []
        self._drain_timer: IDelayedCall | None = None
        self._drain_keys: set[GenerationKey] = set()

    # ------------------------------------------------------------------ life cycle

    def factory(self) -> IProtocolFactory:
        """The protocol factory for listening or dialing; every connection shares this node.

        With a fleet token it is the Noise responder around the node's factory (D10), in both
        dial directions.
        """
        return self._secure_factory

    @property
    def node_factory(self) -> NodeFactory:
        """The node's own factory inside any Noise wrapper (its connections, its limits)."""
        return self._factory

    def add_refusal_observer(self, observer: Callable[[str], None]) -> None:
        """Call ``observer(peer)`` whenever a peer is refused for holding another token."""
        self._refusal_observers.append(observer)

    def _refused(self, peer: str) -> None:
        for observer in list(self._refusal_observers):
            observer(peer)

    def start(self) -> None:
        self.engine.start()

    def drain(self) -> defer.Deferred[None]:
        """Stop taking generations, let the running ones finish, then settle (issue 5).

        New GENERATE_REQs are declined at once.  Running generations get ``drain_timeout_ms``
        to finish; the rest are cancelled (their Finish is CANCELLED).  Then the node waits up
        to ``drain_ack_wait_ms`` for the heads to acknowledge the final events.  Connections
        stay open throughout; :meth:`stop` closes them.  Calling it again joins the same drain.
        """
        if self._drain_phase == "done":
            return defer.succeed(None)
        waiter: defer.Deferred[None] = defer.Deferred()
        self._drain_waiters.append(waiter)
        if self._drain_phase is None:
            self.draining = True
            self._drain_phase = "generations"
            self._drain_keys = set(self._generations)
            log.info(
                "draining: declining new generations, letting {count} running ones finish "
                "(up to {timeout} s)",
                count=len(self._generations),
                timeout=self.config.drain_timeout_ms / 1000.0,
            )
            if self._generations:
                self._drain_timer = self._reactor.callLater(
                    self.config.drain_timeout_ms / 1000.0, self._drain_timed_out
                )
            else:
                self._drain_acks()
        return waiter

    def _drain_timed_out(self) -> None:
        self._drain_timer = None
        log.warn(
            "drain timeout: cancelling {count} generations that are still running",
            count=len(self._generations),
        )
        for generation in list(self._generations.values()):
            generation.machine.cancel()

    def _drain_acks(self) -> None:
        """Every generation is over: wait briefly for the acknowledgements of their events."""
        timer = self._drain_timer
        self._drain_timer = None
        if timer is not None and timer.active():
            timer.cancel()
        self._drain_phase = "acks"
        if not self._unacked_drain_events():
            self._drain_done()
            return
        self._drain_timer = self._reactor.callLater(
            self.config.drain_ack_wait_ms / 1000.0, self._drain_done
        )

    def _unacked_drain_events(self) -> int:
        return sum(self.session.unacked_events(*key) for key in self._drain_keys)

    def _drain_done(self) -> None:
        timer, self._drain_timer = self._drain_timer, None
        if timer is not None and timer.active():
            timer.cancel()
        if self._drain_phase == "done":
            return
        log.info("drained: {left} events left unacknowledged", left=self._unacked_drain_events())
        self._drain_phase = "done"
        self._drain_keys = set()
        waiters, self._drain_waiters = self._drain_waiters, []
        for waiter in waiters:
            waiter.callback(None)

    @defer.inlineCallbacks
    def stop(self) -> Generator[defer.Deferred[Any], Any, None]:
        """Close every connection, stop every lease timer and the engine."""
        timer, self._drain_timer = self._drain_timer, None
        if timer is not None and timer.active():
            timer.cancel()
        yield self._factory.close_all("the node is stopping")
        for node_session in self._sessions.values():
            node_session.machine.ended()
        self._sessions.clear()
        yield self.engine.stop()

    def now_ms(self) -> int:
        """Monotonic milliseconds since this node was created (LINKF 5.1)."""
        return int((self._reactor.seconds() - self._started_at) * 1000)

    @property
    def connections(self) -> Sequence[NodeConnection]:
        """Connections past their handshake."""
        return tuple(self._connections)

    @property
    def running_generations(self) -> int:
        return len(self._generations)

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

    def check_hello(self, hello: Hello) -> str | None:
        """LINKF 4.3 step 2: version, then role, then the token in constant time."""
        if negotiate(hello.proto_versions, SUPPORTED_VERSIONS) is None:
            return f"no common proto version (offered {hello.proto_versions})"
        if hello.link_role != LinkRole.HEAD_DAEMON:
            return f"peer is not a head daemon (role {hello.link_role.name})"
        token = self.config.auth_token
        if token and not hmac.compare_digest(hello.auth, token):
            return "unauthorized: its fleet token differs"
        return None

    def hello_ack(self) -> HelloAckF:
        return HelloAckF(
            chosen_version=PROTO_VERSION,
            node_identity=self.config.identity,
            capacity=self.capacity(),
            loadable_models=(self.config.model_name,),
            feature_flags=0,
            limits=LinkFLimits(),
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
        for node_session in self._sessions.values():
            if node_session.home is connection:
                node_session.home = None

    @property
    def rates(self) -> tuple[int, int]:
        """The latest busy-time (decode, prefill) tokens per second, without a new sample."""
        return self._rates.decode_tokens_per_s, self._rates.prefill_tokens_per_s

    def capacity(self) -> CapacitySummary:
        """A fresh capacity sample (LINKF 6.5 and decision D8)."""
        now = self.now_ms()
        stats = self.engine.statistics()
        decode, prefill = self._rates.sample(
            self._busy.busy_ms(now), stats.decoded_tokens, stats.prefilled_tokens
        )
        return CapacitySummary(
            host_memory_bytes=self._host_memory_bytes,
            active_sessions=len(self.contexts),
            max_sessions=min(self.config.max_sessions, U32_MAX) or U32_MAX,
            max_context_tokens=self.engine.context_window,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            lanes_active=stats.lanes_active,
            max_lanes=self.config.max_lanes,
            queue_depth=stats.queue_depth,
            decode_tokens_per_s=decode,
            prefill_tokens_per_s=prefill,
            sampled_at_ms=now,
        )

    # ------------------------------------------------------------------ dispatch (LINKF 6.3)

    def serve(self, connection: NodeConnection, frame: Frame) -> None:
        """Handle one frame of a connection past its handshake.

        Raises :class:`WireError` for a malformed payload of a handled type; the connection
        then closes itself.  Types the node does not handle are dropped undecoded.
        """
        handler = self._HANDLERS.get(frame.msg_type)
        if handler is None:
            return
        if frame.msg_type == MsgType.GENERATE_CANCEL:
            try:
                message = decode_frame(frame)
            except WireError as e:
                log.warn("ignored a malformed GENERATE_CANCEL: {error}", error=e)
                return
        else:
            message = decode_frame(frame)
        handler(self, connection, message)

    def _on_reconcile(self, connection: NodeConnection, msg: ReconcileMsg) -> None:
        fenced_before = {s for s in self.session.session_ids() if self.session.is_fenced(s)}
        ack, retransmissions = self.session.on_reconcile(msg, self.now_ms())
        connection.send(ack)
        for batch in retransmissions:
            connection.send(batch)
        for entry in ack.sessions:
            node_session = self._sessions.get(entry.session_id)
            if node_session is None:
                continue
            if entry.held:
                node_session.home = connection
                for generation in self._generations_of(entry.session_id):
                    generation.connection = connection
            elif entry.session_id not in fenced_before and self.session.is_fenced(entry.session_id):
                node_session.machine.superseded()

    def _on_assign(self, connection: NodeConnection, msg: SessionAssignMsg) -> None:
        cap = self.config.max_sessions
        if cap and not self.session.has_session(msg.session_id):
            if len(self.session.session_ids()) >= cap:
                # Silent, as every refused ASSIGN (LINKF 6.3); its GENERATE_REQs are REFUSED.
                if msg.session_id not in self._refused_sessions:
                    log.warn(
                        "refused session {session}: this node holds max_sessions={cap} sessions",
                        session=msg.session_id,
                        cap=cap,
                    )
                self._refused_sessions[msg.session_id] = None
                self._refused_sessions.move_to_end(msg.session_id)
                while len(self._refused_sessions) > REFUSED_SESSIONS_KEPT:
                    self._refused_sessions.popitem(last=False)
                return
        if not self.session.on_assign(msg, self.now_ms()):
            return
        self._refused_sessions.pop(msg.session_id, None)
        self.params[msg.session_id] = decode_params(msg.params)
        node_session = self._sessions.get(msg.session_id)
        if node_session is None:
            machine = SessionMachine(
                SessionCore(
                    clock=self._reactor,
                    owner=self,
                    session_id=msg.session_id,
                    renew_interval_ms=RENEW_INTERVAL_MS,
                )
            )
            node_session = self._sessions[msg.session_id] = NodeSession(machine)
        node_session.home = connection
        node_session.machine.lease_started(msg.lease.duration_ms, msg.lease.renew_by_ms)

    def _on_revoke(self, connection: NodeConnection, msg: SessionRevokeMsg) -> None:
        if not self.session.on_revoke(msg):
            return
        self._forget(msg.session_id)
        node_session = self._sessions.pop(msg.session_id, None)
        if node_session is not None:
            node_session.machine.ended()

    def _on_append(self, connection: NodeConnection, msg: AppendContentMsg) -> None:
        if not self.session.on_append(msg.session_id, msg.epoch, msg.command_id):
            return
        self._note_home(msg.session_id, connection)
        # Strict: a malformed context is fatal to the connection, after the command was
        # recorded (LINKF 6.3).
        self.contexts[msg.session_id] = array("I", decode_tokens(msg.blocks))

    def _on_generate(self, connection: NodeConnection, msg: GenerateReqMsg) -> None:
        if self.draining:
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
        if not self.session.on_generate(msg):
            refused = msg.session_id in self._refused_sessions and not self.session.has_session(
                msg.session_id
            )
            self._answer_at_once(connection, msg, FINISH_REFUSED if refused else FINISH_DECLINED)
            return
        self._note_home(msg.session_id, connection)
        self._start_generation(connection, msg)

    def _answer_at_once(self, connection: NodeConnection, msg: GenerateReqMsg, reason: int) -> None:
        """A Finish sent at once, bypassing the retry buffer and the event seqs (LINKF 6.4)."""
        connection.send(
            TokenEventsMsg(
                (TokenEvent(msg.session_id, msg.epoch, msg.generation_id, 0, Finish(reason)),)
            )
        )

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

    def _on_watermark_ack(self, connection: NodeConnection, msg: WatermarkAckMsg) -> None:
        self.session.on_watermark_ack(msg)
        if self._drain_phase == "acks" and not self._unacked_drain_events():
            self._drain_done()

    def _on_lease_grant(self, connection: NodeConnection, msg: LeaseGrantMsg) -> None:
        if self.session.on_lease_grant(msg, self.now_ms()):
            node_session = self._sessions.get(msg.session_id)
            if node_session is not None:
                node_session.machine.lease_started(msg.duration_ms, msg.renew_by_ms)

    def _on_cancel(self, connection: NodeConnection, msg: GenerateCancelMsg) -> None:
        generation = self._generations.get((msg.session_id, msg.generation_id))
        if generation is not None:
            generation.machine.cancel()

    _HANDLERS: dict[int, Callable[[NodeAgent, NodeConnection, Any], None]] = {
        MsgType.RECONCILE: _on_reconcile,
        MsgType.SESSION_ASSIGN: _on_assign,
        MsgType.SESSION_REVOKE: _on_revoke,
        MsgType.APPEND_CONTENT: _on_append,
        MsgType.GENERATE_REQ: _on_generate,
        MsgType.STAGE_FORWARD_REQ: _on_stage_forward,
        MsgType.WATERMARK_ACK: _on_watermark_ack,
        MsgType.LEASE_GRANT: _on_lease_grant,
        MsgType.GENERATE_CANCEL: _on_cancel,
    }

    # ------------------------------------------------------------------ generations (6.4)

    def _start_generation(self, connection: NodeConnection, msg: GenerateReqMsg) -> None:
        key = (msg.session_id, msg.generation_id)
        previous = self._generations.get(key)
        if previous is not None:
            # The same generation id again with a fresh command: the entry (and its event
            # sequence) continues (LINKF 5.3.4); the older run stops sending.
            previous.machine.cancel()
        generation = NodeGeneration(self, key, connection)
        generation.machine = GenerationMachine(
            GenerationCore(
                clock=self._reactor,
                owner=generation,
                coalesce_tokens=COALESCE_TOKENS,
                coalesce_ms=COALESCE_MS,
            )
        )
        self._generations[key] = generation
        self._busy.started(self.now_ms())
        request = GenerationRequest(
            context=tuple(self.contexts.get(msg.session_id, ())),
            params=self.params.get(msg.session_id, GenParams()),
            max_new=min(msg.budgets.max_new_tokens, U32_MAX),
            max_wall_ms=msg.budgets.max_wall_ms,
        )
        machine = generation.machine
        engine_generation = self.engine.submit(request, machine.tokens)
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
                log.failure("generation {key} failed in the engine", failure, key=key)
                machine.failed(failure.getErrorMessage())

        def finished(result: GenerationResult) -> None:
            machine.finished(result)

        engine_generation.result.addCallbacks(finished, failed)

    def generation_done(self, generation: NodeGeneration) -> None:
        self._busy.stopped(self.now_ms())
        if self._generations.get(generation.key) is generation:
            del self._generations[generation.key]
        if self._drain_phase == "generations" and not self._generations:
            self._drain_acks()

    def give_up(self, session_id: int, reason: str) -> None:
        """Fence a session because a bound was reached, and forget its context (issue 5)."""
        if not self.session.fence(session_id):
            return
        log.warn("fenced session {session}: {reason}", session=session_id, reason=reason)
        self.contexts.pop(session_id, None)
        self.params.pop(session_id, None)
        node_session = self._sessions.get(session_id)
        if node_session is not None:
            node_session.machine.superseded()

    def _generations_of(self, session_id: int) -> list[NodeGeneration]:
        return [g for (s, _), g in self._generations.items() if s == session_id]

    # ------------------------------------------------------------------ SessionOwner

    def send_renew(self, session_id: int) -> None:
        epoch = self.session.session_epoch(session_id)
        if epoch is None:
            return
        node_session = self._sessions.get(session_id)
        home = node_session.home if node_session is not None else None
        targets = [home] if home is not None and home.open else self._connections[:1]
        for connection in targets:
            connection.send(LeaseRenewMsg(session_id, epoch))

    def self_fence(self, session_id: int) -> None:
        for action in self.session.poll(self.now_ms()):
            log.warn(
                "session {session} fenced itself: its lease expired", session=action.session_id
            )
            self._forget(action.session_id)

    # ------------------------------------------------------------------ helpers

    def _note_home(self, session_id: int, connection: NodeConnection) -> None:
        node_session = self._sessions.get(session_id)
        if node_session is not None:
            node_session.home = connection

    def _forget(self, session_id: int) -> None:
        """Drop a session's context and parameters and stop its running generations."""
        self.contexts.pop(session_id, None)
        self.params.pop(session_id, None)
        for generation in self._generations_of(session_id):
            generation.machine.cancel()
