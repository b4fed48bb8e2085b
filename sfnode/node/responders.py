"""What the node does with each message a head sends (docs/protocol.md section 7.2): the dispatch
table and its responders.

Every decoded frame goes to the responder registered for its message class in :data:`HANDLERS`,
like AMP pairs a command with its responder.  :class:`Responders` holds them: each reads and
changes the node's parts (the session tables of :mod:`sfnode.node.heads`, the generations of
:mod:`sfnode.node.generations`, the drain, the engine's pipeline stages, the model files) and
answers on the connection the message came on.  Decision D2 holds: nothing blocks, no frame is
dropped, one connection may carry many generations.

Bounds (issue 5, :class:`~sfnode.node.config.NodeConfig` fields): an ASSIGN beyond
``max_sessions`` live sessions is refused and that session's GENERATE_REQs are declined (a head
fails over); a new session takes the place of the one fenced longest ago when the node holds
that many records; beyond ``max_generations`` running or queued generations, and once the drain
started, a GENERATE_REQ is declined.  Constraints (section 12.3): a constraint sent to a node
that did not offer ``FEATURE_CONSTRAINTS`` is a refusal (FINISH_REFUSED).

This module never decodes bytes itself beyond calling :mod:`sfnode.linkf.wire`, and never touches
a socket (it sends through :class:`~sfnode.node.protocol.NodeConnection`).  Section numbers are
those of docs/protocol.md.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from twisted.internet import defer
from twisted.logger import Logger
from twisted.python.failure import Failure

from sfnode.generation import (
    Embedded,
    Embedder,
    EmbeddingError,
    GenerationRequest,
    StageForward,
    StageForwardError,
    StageResult,
    kept_stages_of,
)
from sfnode.linkf.idempotency import GenerationKey
from sfnode.linkf.model_files import XFER_ABORT_UNKNOWN, transfer_messages
from sfnode.linkf.wire import (
    FINISH_DECLINED,
    FINISH_REFUSED,
    LOGPROBS_MAX,
    U32_MAX,
    AppendContentMsg,
    BlobFetchMsg,
    EmbedReqMsg,
    EmbedRespMsg,
    Finish,
    GenerateCancelMsg,
    GenerateReqMsg,
    LeaseGrantMsg,
    Message,
    ReconcileMsg,
    SessionAssignMsg,
    SessionRevokeMsg,
    StageBatchAnswer,
    StageBatchReqMsg,
    StageBatchRespMsg,
    StageForwardReqMsg,
    StageForwardRespMsg,
    StageReleaseMsg,
    StageRingJoinMsg,
    StageRingRow,
    StageRingRowsMsg,
    StageRingToken,
    StageRingTokensMsg,
    TokenEvent,
    TokenEventsMsg,
    WatermarkAckMsg,
    XferAbortMsg,
    decode_params,
    decode_tokens,
)
from sfnode.node.config import NodeCommon
from sfnode.node.generations import GenerationTable
from sfnode.node.heads import HeadSessions, HeadTables
from sfnode.node.machines import DrainInputs
from sfnode.node.protocol import NodeConnection
from sfnode.node.ring import PeerLinks, RingStage, RingTable

log = Logger()

M = TypeVar("M", bound=Message)


def _log_refusal(what: str, request_id: int, failure: Failure, expected: type[Exception]) -> None:
    """Log why a stateless request (a stage forward, an embedding) got a nil answer: the
    engine's reason when it refused as ``expected``, else the whole failure."""
    if isinstance(failure.value, expected):
        _log_refused(what, request_id, failure.getErrorMessage())
    else:
        log.failure("{what} {request} failed", failure, what=what, request=request_id)


def _log_refused(what: str, request_id: int, reason: str) -> None:
    """Log the engine's ``reason`` for refusing a stateless request (a nil answer)."""
    log.info("{what} {request} refused: {reason}", what=what, request=request_id, reason=reason)


@dataclass(frozen=True)
class Handler(Generic[M]):
    """One entry of the dispatch table: a message class and what the node does with it."""

    message_class: type[M]
    respond: Callable[[Responders, NodeConnection, M], None]
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
        [Callable[[Responders, NodeConnection, M], None]],
        Callable[[Responders, NodeConnection, M], None],
    ]:
        """Register the decorated method as the node's responder to ``message_class``."""

        def register(
            respond: Callable[[Responders, NodeConnection, M], None],
        ) -> Callable[[Responders, NodeConnection, M], None]:
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


def answer_at_once(connection: NodeConnection, msg: GenerateReqMsg, reason: int) -> None:
    """A Finish sent at once, bypassing the retry buffer and the event seqs (section 7.3)."""
    connection.send(
        TokenEventsMsg(
            (TokenEvent(msg.session_id, msg.epoch, msg.generation_id, 0, Finish(reason)),)
        )
    )


class Responders:
    """The node's responder to each message class (see the module)."""

    def __init__(
        self,
        common: NodeCommon,
        heads: HeadTables,
        generations: GenerationTable,
        drain: DrainInputs,
        peers: PeerLinks,
    ) -> None:
        self._common = common
        self._rings = RingTable()
        self._peers = peers
        self._heads = heads
        self._generations = generations
        self._drain = drain
        self._transfer_ids = itertools.count(1)
        self._at_session_cap = False
        self._at_generation_cap = False

    def _head_of(self, connection: NodeConnection) -> HeadSessions:
        return self._heads.of(connection.head_id)

    @handles(ReconcileMsg)
    def reconcile(self, connection: NodeConnection, msg: ReconcileMsg) -> None:
        head = self._head_of(connection)
        ack, retransmissions = head.table.on_reconcile(msg)
        connection.send(ack)
        for batch in retransmissions:
            connection.send(batch)
        for entry in ack.sessions:
            session = head.table.get(entry.session_id)
            if entry.held and session is not None:
                session.home = connection
                for generation in self._generations.of_session(head, entry.session_id):
                    generation.connection = connection

    @handles(SessionAssignMsg)
    def assign(self, connection: NodeConnection, msg: SessionAssignMsg) -> None:
        head = self._head_of(connection)
        cap = self._common.config.max_sessions
        if cap and not head.table.has_session(msg.session_id):
            if self._heads.live_sessions() >= cap:
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
            if self._heads.session_records() >= cap:
                self._heads.make_room()
        session = head.table.on_assign(msg)
        if session is None:
            return
        self._at_session_cap = False
        session.params = decode_params(msg.params)
        session.home = connection

    @handles(SessionRevokeMsg)
    def revoke(self, connection: NodeConnection, msg: SessionRevokeMsg) -> None:
        head = self._head_of(connection)
        if head.table.on_revoke(msg) is not None:
            self._generations.cancel_session(head, msg.session_id)
            self._heads.forget_if_idle(head)

    @handles(AppendContentMsg)
    def append(self, connection: NodeConnection, msg: AppendContentMsg) -> None:
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
    def generate(self, connection: NodeConnection, msg: GenerateReqMsg) -> None:
        if not self._drain.accepting() or self._at_generation_bound():
            answer_at_once(connection, msg, FINISH_DECLINED)
            return
        head = self._head_of(connection)
        session = head.table.on_generate(msg)
        if session is None:
            answer_at_once(connection, msg, FINISH_DECLINED)
            return
        session.home = connection
        if msg.constraint is not None and not self._common.engine.supports_constraints:
            # Only a head that ignored this node's HELLO_ACK_F sends one (section 12.3).
            log.info(
                "refused generation {generation} of session {session}: this node does not "
                "honour constraints",
                generation=msg.generation_id,
                session=msg.session_id,
            )
            answer_at_once(connection, msg, FINISH_REFUSED)
            return
        params = session.params
        # Logprobs only from an engine that has them (this node's HELLO_ACK_F said so); a
        # value past the largest reads as the largest (section 12.1).
        asked = min(params.logprobs, LOGPROBS_MAX) if self._common.engine.supports_logprobs else 0
        if asked != params.logprobs:
            params = replace(params, logprobs=asked)
        request = GenerationRequest(
            context=tuple(session.context or ()),
            params=params,
            max_new=min(msg.budgets.max_new_tokens, U32_MAX),
            max_wall_ms=msg.budgets.max_wall_ms,
            interactive=msg.interactive,
            constraint=msg.constraint,
        )
        key = GenerationKey(msg.session_id, msg.generation_id, head.head_id)
        self._generations.start(connection, head, key, request)

    def _at_generation_bound(self) -> bool:
        """Whether ``max_generations`` run or wait (logged once each time it is reached)."""
        cap = self._common.config.max_generations
        if cap and len(self._generations) >= cap:
            if not self._at_generation_cap:
                log.warn("declining generations: {cap} are running or queued", cap=cap)
            self._at_generation_cap = True
            return True
        self._at_generation_cap = False
        return False

    @handles(StageForwardReqMsg)
    def stage_forward(self, connection: NodeConnection, msg: StageForwardReqMsg) -> None:
        def answer(result: StageResult) -> None:
            connection.send(StageForwardRespMsg(msg.request_id, result.hidden, result.token))

        def refuse(failure: Failure) -> None:
            _log_refusal("stage forward", msg.request_id, failure, StageForwardError)
            connection.send(StageForwardRespMsg(msg.request_id, None, None))

        engine = self._common.engine
        kept = kept_stages_of(engine)
        if msg.stage_session is None:
            running = engine.stage_forward(
                msg.tokens, msg.start_layer, msg.end_layer, msg.hidden_in
            )
        elif kept is not None:
            forward = StageForward(msg.tokens, msg.start_layer, msg.end_layer, msg.hidden_in)
            running = kept.forward(connection, msg.stage_session, msg.position or 0, forward)
        else:
            running = defer.fail(StageForwardError("this node keeps no stage KV"))
        running.addCallbacks(answer, refuse)

    @handles(StageBatchReqMsg)
    def stage_batch(self, connection: NodeConnection, msg: StageBatchReqMsg) -> None:
        """Every row through the layers in one pass, answered in one STAGE_BATCH_RESP (section
        12.8); a refused row answers nil and nil, and its session is dropped."""

        def answer(results: list[StageResult | StageForwardError]) -> None:
            answers = []
            for result in results:
                if isinstance(result, StageForwardError):
                    _log_refused("stage batch", msg.request_id, str(result))
                    answers.append(StageBatchAnswer(None, None))
                else:
                    answers.append(StageBatchAnswer(result.hidden, result.token))
            connection.send(StageBatchRespMsg(msg.request_id, tuple(answers)))

        kept = kept_stages_of(self._common.engine)
        if kept is not None:
            requests = [
                (
                    row.stage_session,
                    row.position,
                    StageForward(row.tokens, msg.start_layer, msg.end_layer, row.hidden_in),
                )
                for row in msg.rows
            ]
            kept.forward_all(connection, requests).addCallback(answer)
        else:
            answer([StageForwardError("this node keeps no stage KV") for _ in msg.rows])

    @handles(StageReleaseMsg)
    def stage_release(self, connection: NodeConnection, msg: StageReleaseMsg) -> None:
        """Forget that stage session of the connection (section 12.8); silent."""
        kept = kept_stages_of(self._common.engine)
        if kept is not None:
            kept.release(connection, msg.stage_session)

    @handles(StageRingJoinMsg)
    def stage_ring_join(self, connection: NodeConnection, msg: StageRingJoinMsg) -> None:
        """Record this connection's stage of the ring (section 12.10); silent, a refusal
        only logged."""
        refusal = (
            "this node keeps no stage KV"
            if kept_stages_of(self._common.engine) is None
            else self._rings.join(connection, msg.ring, msg.start_layer, msg.end_layer, msg.next)
        )
        if refusal is not None:
            log.info("ring join {ring} refused: {reason}", ring=msg.ring, reason=refusal)

    @handles(StageRingRowsMsg)
    def stage_ring_rows(self, connection: NodeConnection, msg: StageRingRowsMsg) -> None:
        """Run a ring's rows, from any connection, against the stage sessions of the
        connection that JOINed the ring, in one pass with whatever else waits (section
        12.10); then hand on what they give."""
        stage = self._rings.get(msg.ring)
        kept = kept_stages_of(self._common.engine)
        if stage is None or kept is None:
            log.info(
                "dropped {n} rows of ring {ring} from {peer}: no such ring here",
                n=len(msg.rows),
                ring=msg.ring,
                peer=connection.peer,
            )
            return
        rows: list[StageRingRow] = []
        refused: list[StageRingToken] = []
        for row in msg.rows:
            if len(row.tokens) > 1:
                # A ring row is one position (section 12.10): the last stage could not count
                # the hidden rows of more.  Refused as any row is, its session dropped (12.8).
                kept.release(stage.owner, row.stage_session)
                refused.append(StageRingToken(row.stage_session, row.position, None))
            else:
                rows.append(row)
        if refused:
            _log_refused("ring rows", msg.ring, "a ring step carries one token")
            self._to_ring_head(stage, msg.ring, refused)
        if not rows:
            return
        requests = [
            (
                row.stage_session,
                row.position,
                StageForward(row.tokens, stage.start_layer, stage.end_layer, row.hidden_in),
            )
            for row in rows
        ]
        running = kept.forward_all(stage.owner, requests)
        running.addCallback(lambda results: self._ring_answers(msg.ring, stage, rows, results))
        running.addErrback(
            lambda failure: log.failure("rows of ring {ring} failed", failure, ring=msg.ring)
        )

    def _ring_answers(
        self,
        ring: int,
        stage: RingStage,
        rows: list[StageRingRow],
        results: list[StageResult | StageForwardError],
    ) -> None:
        """A middle stage's hidden states to ``next``; the last stage's tokens to the ring's
        head and each generation's next step to ``next`` (stage 0); nil for a refused row."""
        onward: list[StageRingRow] = []
        tokens: list[StageRingToken] = []
        for row, result in zip(rows, results, strict=True):
            if isinstance(result, StageForwardError):
                _log_refused("ring row", ring, str(result))
                tokens.append(StageRingToken(row.stage_session, row.position, None))
            elif result.token is None:
                onward.append(
                    StageRingRow(
                        row.stage_session, row.position, (), result.hidden, row.left, row.stop
                    )
                )
            else:
                at = row.position + 1
                tokens.append(StageRingToken(row.stage_session, at, result.token))
                if row.left > 1 and result.token not in row.stop:
                    onward.append(
                        StageRingRow(
                            row.stage_session, at, (result.token,), None, row.left - 1, row.stop
                        )
                    )
        if onward:  # first: the next step waits for it, the head's copy waits for nothing
            self._peers.send(stage.next, StageRingRowsMsg(ring, tuple(onward)))
        if tokens:
            self._to_ring_head(stage, ring, tokens)

    def ring_rows_lost(self, msg: StageRingRowsMsg, why: str) -> None:
        """Rows a peer link could not deliver: each a nil token to the ring's head (section
        12.10), when this node still knows the ring."""
        stage = self._rings.get(msg.ring)
        if stage is not None:
            _log_refused("ring rows", msg.ring, why)
            lost = [StageRingToken(r.stage_session, r.position, None) for r in msg.rows]
            self._to_ring_head(stage, msg.ring, lost)

    @staticmethod
    def _to_ring_head(stage: RingStage, ring: int, tokens: list[StageRingToken]) -> None:
        """STAGE_RING_TOKENS to the connection that joined ``stage``'s ring (section 12.10)."""
        if isinstance(stage.owner, NodeConnection):
            stage.owner.send(StageRingTokensMsg(ring, tuple(tokens)))

    def connection_ended(self, connection: NodeConnection) -> None:
        """Its rings go with it (section 12.10)."""
        self._rings.drop_owner(connection)

    @handles(EmbedReqMsg)
    def embed(self, connection: NodeConnection, msg: EmbedReqMsg) -> None:
        """Embed the texts (section 12.7); a node without an embedding model, or a failed
        run, answers nil vectors."""

        def answer(result: Embedded) -> None:
            connection.send(EmbedRespMsg(msg.request_id, result.vectors, result.dim, result.tokens))

        def refuse(failure: Failure) -> None:
            _log_refusal("embedding", msg.request_id, failure, EmbeddingError)
            connection.send(EmbedRespMsg(msg.request_id, None, 0, 0))

        engine = self._common.engine
        if not isinstance(engine, Embedder):
            log.info("embedding {request} refused: no embedding model", request=msg.request_id)
            connection.send(EmbedRespMsg(msg.request_id, None, 0, 0))
            return
        engine.embed(msg.texts).addCallbacks(answer, refuse)

    @handles(BlobFetchMsg)
    def blob_fetch(self, connection: NodeConnection, msg: BlobFetchMsg) -> None:
        """Send the model files a head asks for by their hash (section 12.5), else abort."""
        transfer_id = next(self._transfer_ids)
        files = self._common.model_files
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
    def watermark_ack(self, connection: NodeConnection, msg: WatermarkAckMsg) -> None:
        self._head_of(connection).table.on_watermark_ack(msg)
        self._drain.acked()

    @handles(LeaseGrantMsg)
    def lease_grant(self, connection: NodeConnection, msg: LeaseGrantMsg) -> None:
        self._head_of(connection).table.on_lease_grant(msg)

    @handles(GenerateCancelMsg, lenient=True)
    def cancel(self, connection: NodeConnection, msg: GenerateCancelMsg) -> None:
        key = GenerationKey(msg.session_id, msg.generation_id, connection.head_id)
        generation = self._generations.get(key)
        if generation is not None:
            generation.machine.cancel()
