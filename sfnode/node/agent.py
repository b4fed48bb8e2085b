"""The node agent: the one owner that builds the node's parts and wires them to its connections,
its engine and its clock.

:class:`NodeAgent` holds what all connections of one node share (docs/protocol.md section 7.1):

- the session tables, one per head identity (:class:`~sfnode.node.heads.HeadTables`, decision D13:
  a connection reaches only the sessions of the head that named itself in its HELLO);
- the running generations (:class:`~sfnode.node.generations.GenerationTable`), each with its
  generation machine;
- the responder of each message class (:class:`~sfnode.node.responders.Responders`), which every
  decoded frame of a connection past its handshake goes to;
- the reports its heads read (:class:`~sfnode.node.reports.NodeReports`: HELLO_ACK_F and
  NODE_STATUS with their capacity samples);
- the drain machine (:meth:`NodeAgent.drain` is the SIGTERM path);
- its peer links to the next stage of its stage rings (:class:`~sfnode.node.ring.PeerLinks`,
  section 12.10), closed when it stops;
- the connections, in their handshake or past it, for which it is the
  :class:`~sfnode.node.protocol.ConnectionHost`.

It follows decision D2: nothing blocks the reactor, no frame is dropped, one connection may carry
many generations, and a generation whose connection is gone keeps its events in the retry buffer
for the next RECONCILE (which also moves the rest of the stream to the reconciling connection).

It never decodes bytes itself beyond calling :mod:`sfnode.linkf.wire`, never touches a socket (it
sends through :class:`~sfnode.node.protocol.NodeConnection`), never builds a protocol factory (the
tap does: ``sfnode.node.tap.node_factory``), and reads time only from the reactor it is given.
The bounds of issue 5 are :class:`~sfnode.node.config.NodeConfig` fields, kept by the parts they
bound.  Section numbers in this module are those of docs/protocol.md.
"""

from __future__ import annotations

from array import array
from collections.abc import Generator, Mapping, Sequence
from typing import Any

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from sfnode.generation import Engine, kept_stages_of
from sfnode.linkf.handshake import read_hello
from sfnode.linkf.model_files import Bundle
from sfnode.linkf.wire import (
    Frame,
    Hello,
    HelloAckF,
    NodeStatusMsg,
    WireError,
    decode_message,
)
from sfnode.node.config import DEFAULT_HANDSHAKE_TIMEOUT_MS, NodeCommon, NodeConfig
from sfnode.node.generations import GenerationTable, checked_logprobs
from sfnode.node.heads import HeadSessions, HeadTables
from sfnode.node.machines import DrainCore, DrainInputs, DrainMachine
from sfnode.node.protocol import NodeConnection, NodeProtocol
from sfnode.node.reports import NodeReports
from sfnode.node.responders import HANDLERS, HandlerTable, Responders
from sfnode.node.ring import PeerLinks
from sfnode.node.sessions import AgentSession

__all__ = ["HANDLERS", "HandlerTable", "HeadSessions", "NodeAgent", "checked_logprobs"]

log = Logger()


class NodeAgent:
    """A Link F node: shared by every connection it serves, in either dial direction."""

    def __init__(
        self,
        reactor: IReactorTime,
        engine: Engine,
        config: NodeConfig,
        model_files: Bundle | None = None,
    ) -> None:
        """``model_files`` are the files a head needs to serve the model (section 12.5),
        offered in HELLO_ACK_F and sent on BLOB_FETCH; None: the node offers none."""
        self.clock = reactor
        self.engine = engine
        self.config = config
        self.started_at = reactor.seconds()
        """The node's time base (section 6.1), shared by the tables of all heads."""
        self._connections: list[NodeConnection] = []
        self._protocols: set[NodeProtocol] = set()
        common = NodeCommon(reactor, engine, config, model_files, self.started_at)
        self.heads = HeadTables(common, self._connected, self._stop_generations)
        self.reports = NodeReports(
            common, now_ms=self.now_ms, live_sessions=self.heads.live_sessions
        )
        self.generations = GenerationTable(
            common,
            self.heads,
            on_start=self.reports.generation_started,
            on_end=self._generation_ended,
        )
        self._drain: DrainInputs = DrainMachine(
            DrainCore(
                clock=reactor,
                owner=self.generations,
                drain_timeout_ms=config.drain_timeout_ms,
                ack_wait_ms=config.drain_ack_wait_ms,
            )
        )
        self.peers = PeerLinks(
            reactor,
            token=config.auth_token,
            # A peer link's dial is always bounded, even where the node waits forever.
            handshake_timeout_s=(config.handshake_timeout_ms or DEFAULT_HANDSHAKE_TIMEOUT_MS)
            / 1000.0,
            # Rows it could not deliver are reported to their ring's head.
            on_lost=lambda msg, why: self._responders.ring_rows_lost(msg, why),
        )
        """Its links to the next stage of its stage rings (section 12.10)."""
        self._responders = Responders(common, self.heads, self.generations, self._drain, self.peers)

    def _connected(self) -> Sequence[NodeConnection]:
        return self._connections

    def _stop_generations(self, head: HeadSessions, session_id: int) -> None:
        self.generations.cancel_session(head, session_id)

    def _generation_ended(self) -> None:
        self.reports.generation_ended()
        self._drain.generation_done()

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
        yield self.peers.close()
        for head in self.heads:
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
        return int((self.clock.seconds() - self.started_at) * 1000)

    # ------------------------------------------------------------------ what tests read

    @property
    def session(self) -> AgentSession[Any]:
        """The table of the heads that gave no identity in their HELLO."""
        return self.heads.of(None).table

    def sessions_of(self, head_id: int | None = None) -> AgentSession[Any]:
        """The session table of one head identity (None: heads without one); an empty table
        when that head holds nothing here."""
        head = self.heads.peek(head_id)
        return (head or HeadSessions(self.heads, head_id)).table

    def contexts_of(self, head_id: int | None = None) -> Mapping[int, array[int]]:
        """Each session's token context, for that head's sessions that have one (None: the
        heads without identity)."""
        return self.heads.contexts_of(head_id)

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
        return len(self.generations)

    @property
    def accepting(self) -> bool:
        """Whether new generations are taken: True until the drain starts."""
        return self._drain.accepting()

    # ------------------------------------------------------------------ ConnectionHost

    def read_hello(self, frame: Frame) -> Hello | str:
        return read_hello(frame, self.config.auth_token)

    def hello_ack(self) -> HelloAckF:
        return self.reports.hello_ack()

    def status(self) -> NodeStatusMsg:
        return self.reports.status()

    def serve(self, connection: NodeConnection, frame: Frame) -> None:
        """Handle one frame of a connection past its handshake (section 7.2).

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
        handler.respond(self._responders, connection, message)

    def protocol_opened(self, protocol: NodeProtocol) -> None:
        self._protocols.add(protocol)

    def protocol_closed(self, protocol: NodeProtocol) -> None:
        self._protocols.discard(protocol)

    def connection_ready(self, connection: NodeConnection) -> None:
        self._connections.append(connection)

    def connection_writable(self, connection: NodeConnection, writable: bool) -> None:
        if writable:
            for generation in self.generations.on_connection(connection):
                generation.release_held()

    def connection_ended(self, connection: NodeConnection) -> None:
        self._connections.remove(connection)
        self._responders.connection_ended(connection)
        kept = kept_stages_of(self.engine)
        if kept is not None:
            # Its stage sessions go with it (docs/protocol.md section 12.8).
            kept.release(connection)
        head = self.heads.peek(connection.head_id)
        if head is None:
            return
        for session in head.table:
            if session.home is connection:
                session.home = None
        self.heads.forget_if_idle(head)
