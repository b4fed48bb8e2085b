"""Node behaviours of docs/protocol.md section 10: the head library (or a scripted head) against a
node, joined in memory (``twisted.test.iosim`` on a ``MemoryReactorClock``: the node's real
protocol, machines and mock engine, no socket, time moved by the test).

Each test names the upstream scenario it follows ("item N" of docs/protocol.md section 10) or the
decision of this edition it pins (D2: no blocking, no dropped frames).  The node runs the mock
engine.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer, task
from twisted.trial.unittest import SynchronousTestCase

from sfnode.engines.mock import MockEngineFault
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.link import NodeLink, NodeRefusedError, stage_batch
from sfnode.linkf.wire import (
    FEATURE_STAGE_BATCH,
    FEATURE_STAGE_KV,
    FINISH_DECLINED,
    FINISH_EOS,
    FINISH_EXPIRED,
    FINISH_LENGTH,
    FINISH_REFUSED,
    AppendContentMsg,
    Finish,
    GenerateReqMsg,
    GenerationBudgetsMsg,
    Hello,
    Lease,
    LeaseGrantMsg,
    LeaseRenewMsg,
    LinkRole,
    MsgType,
    NodeStatusMsg,
    SessionAssignMsg,
    StageBatchRow,
    StageReleaseMsg,
    TokenEventsMsg,
    Tokens,
    WatermarkAckMsg,
    encode_frame,
    encode_tokens,
    message_frame,
)
from sfnode.node.agent import HANDLERS, HandlerTable
from tests.nodefixture import (
    LONG_LEASE,
    PROMPT,
    MemoryNode,
    MemoryNodeTestCase,
    RawHead,
    expected_tokens,
    finish_of,
    opened,
    serves,
    stream_of,
)


def assign_raw(
    head: RawHead, command: int, session: int, epoch: int, lease: Lease = LONG_LEASE
) -> None:
    head.send(SessionAssignMsg(command, session, epoch, lease, "", b"", 0, 0))


def session_with_prompt(test: MemoryNodeTestCase, node: MemoryNode) -> RawHead:
    """A raw head that said HELLO to ``node``, assigned session 1 at epoch 5 (command 1) and
    appended :data:`PROMPT` to it (command 2): its next command is 3."""
    head = test.raw_head(node)
    test.wait(head.hello())
    assign_raw(head, 1, 1, 5)
    head.send(AppendContentMsg(2, 1, 5, encode_tokens(PROMPT)))
    return head


class GenerationTests(MemoryNodeTestCase):
    def test_generation_matches_local_run(self) -> None:
        """Item 19: 16 tokens equal a local run, one Finish, events <= tokens + 1, and the
        HELLO_ACK_F names the model "mock"."""
        node = self.start_node()
        link = self.dial(node)
        self.assertEqual(link.models, ("mock",))
        link.assign(1)
        link.append(1, PROMPT)
        call = link.generate(1, HeadRequest((), 16))
        outcome = self.wait(call.result)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 16))
        self.assertEqual(outcome.finish, FINISH_LENGTH)
        events = link.head_session.wal.events(1, call.epoch, call.generation_id)
        self.assertEqual(sum(isinstance(e.payload, Finish) for e in events), 1)
        self.assertLessEqual(len(events), 16 + 1)

    def test_two_generations_share_one_connection(self) -> None:
        """D2: two generations on one connection run together and both finish correctly."""
        node = self.start_node(token_delay_s=0.001)
        link = opened(self.dial(node))
        link.assign(2)
        link.append(2, [7, 8, 9])
        first = link.generate(1, HeadRequest((), 40))
        second = link.generate(2, HeadRequest((), 25))
        a, b = self.wait(defer.gatherResults([first.result, second.result]))
        self.assertEqual(a.tokens, expected_tokens(PROMPT, 40))
        self.assertEqual(b.tokens, expected_tokens([7, 8, 9], 25))
        self.assertEqual((a.finish, b.finish), (FINISH_LENGTH, FINISH_LENGTH))
        self.assertEqual(len(node.agent.connections), 1)

    def test_concurrent_streams_on_two_nodes(self) -> None:
        """Items 28 and 40: eight concurrent streams spread over two nodes are all correct."""
        links = []
        for i in range(2):
            node = self.start_node(identity=f"n{i}")
            links.append(self.dial(node))
        calls = []
        for session in range(8):
            link = links[session % 2]
            link.assign(session)
            link.append(session, [session, session + 1])
            calls.append(link.generate(session, HeadRequest((), 20)))
        outcomes = self.wait(defer.gatherResults([c.result for c in calls]))
        for session, outcome in enumerate(outcomes):
            self.assertEqual(outcome.tokens, expected_tokens([session, session + 1], 20))

    def test_cancel_mid_stream(self) -> None:
        """Item 51: a cancel after >= 5 tokens ends the stream with CANCELLED, far short of
        its budget, and the tokens sent are a prefix of the full run."""
        node = self.start_node(token_delay_s=0.002)
        link = opened(self.dial(node))
        seen: list[int] = []

        def on_tokens(tokens: Any) -> None:
            seen.extend(tokens)
            if len(seen) >= 5:
                call.cancel()

        call = link.generate(1, HeadRequest((), 1_000_000), on_tokens=on_tokens)
        self.assert_cancelled_after_five(self.wait(call.result), node)

    def test_refusal_keeps_the_link(self) -> None:
        """Item 22: a prompt longer than the window (64) gets FINISH_REFUSED and no token; the
        same connection then serves a fitting session."""
        node = self.start_node(context_window=64)
        link = self.dial(node)
        self.assertEqual(link.hello_ack.capacity.max_context_tokens, 64)
        link.assign(1)
        link.append(1, list(range(96)))
        refused = self.wait(link.generate(1, HeadRequest((), 4)).result)
        self.assertEqual((refused.tokens, refused.finish), ([], FINISH_REFUSED))
        link.assign(2)
        link.append(2, PROMPT)
        served = self.wait(link.generate(2, HeadRequest((), 4)).result)
        self.assertEqual(served.tokens, expected_tokens(PROMPT, 4))

    def test_length_at_the_window(self) -> None:
        """A generation that reaches the context window stops there with LENGTH."""
        node = self.start_node(context_window=20)
        link = opened(self.dial(node))
        outcome = self.wait(link.generate(1, HeadRequest((), 100)).result)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 8))
        self.assertEqual(outcome.finish, FINISH_LENGTH)

    def test_wall_budget_expires(self) -> None:
        """A generation past its max_wall_ms ends with FINISH_EXPIRED after the tokens it made."""
        node = self.start_node(token_delay_s=0.005)
        link = opened(self.dial(node))
        outcome = self.wait(link.generate(1, HeadRequest((), 1_000_000, max_wall_ms=60)).result)
        self.assertEqual(outcome.finish, FINISH_EXPIRED)
        self.assertLess(len(outcome.tokens), 1000)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, len(outcome.tokens)))

    def test_eos_is_the_last_token(self) -> None:
        """D6: when the model emits its EOS id, that id is the last token and the finish is EOS."""
        reference = expected_tokens(PROMPT, 6)
        node = self.start_node(eos_token_id=reference[5])
        link = opened(self.dial(node))
        outcome = self.wait(link.generate(1, HeadRequest((), 50)).result)
        self.assertEqual(outcome.tokens, reference)
        self.assertEqual(outcome.finish, FINISH_EOS)

    def test_engine_failure_closes_only_that_connection(self) -> None:
        """docs/protocol.md section 7.4: an engine error closes the connection that asked; another
        connection's session is untouched and the node keeps serving.  The fault is logged
        twice: by the engine loop for the step that failed, and by the node for the
        generation that step carried."""
        self.fault_closes_only_its_link(self.start_node(poison_token=666))
        self.assertEqual(len(self.flushLoggedErrors(MockEngineFault)), 2)


class SessionTests(MemoryNodeTestCase):
    def test_assign_is_idempotent_and_epochs_absolute(self) -> None:
        """Item 8: a replayed ASSIGN and a lower epoch are refused (silently): generating at
        the refused epoch is declined, at the held epoch it runs."""
        node = self.start_node()
        head = self.raw_head(node)
        self.wait(head.hello())
        assign_raw(head, 1, 7, 5)
        assign_raw(head, 1, 7, 9)  # replayed command id: refused, epoch stays 5
        assign_raw(head, 2, 7, 4)  # lower epoch: refused
        head.send(AppendContentMsg(3, 7, 5, encode_tokens(PROMPT)))
        head.send(GenerateReqMsg(4, 7, 9, 1, GenerationBudgetsMsg(3)))
        head.send(GenerateReqMsg(5, 7, 4, 2, GenerationBudgetsMsg(3)))
        head.send(GenerateReqMsg(6, 7, 5, 3, GenerationBudgetsMsg(3)))
        for generation in (1, 2, 3):
            self.wait(head.wait_for(finish_of(7, generation)))
        self.assertEqual([e.payload for e in head.events(7, 1)], [Finish(FINISH_DECLINED)])
        self.assertEqual([e.payload for e in head.events(7, 2)], [Finish(FINISH_DECLINED)])
        self.assertEqual(
            stream_of(head.events(7, 3)), (expected_tokens(PROMPT, 3), [FINISH_LENGTH])
        )

    def test_replayed_generate_does_not_restart(self) -> None:
        """Item 9: a replayed GENERATE (same command id) is declined with event_seq 0 outside
        the stream, and the running stream goes on from its own next seq."""
        node = self.start_node(token_delay_s=0.002)
        head = session_with_prompt(self, node)
        request = GenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(20))
        head.send(request)
        head.send(request)
        self.wait(head.wait_for(finish_of(1, 100, FINISH_LENGTH)))
        events = head.events(1, 100)
        declined = [e for e in events if e.payload == Finish(FINISH_DECLINED)]
        self.assertEqual([e.event_seq for e in declined], [0])
        stream = [e for e in events if e not in declined]
        self.assertEqual([e.event_seq for e in stream], list(range(len(stream))))
        tokens = [t for e in stream if isinstance(e.payload, Tokens) for t in e.payload.tokens]
        self.assertEqual(tokens, expected_tokens(PROMPT, 20))

    def test_append_is_gated(self) -> None:
        """Item 10: an APPEND with a wrong epoch, an unknown session or a replayed command is
        ignored; the generation runs on the last accepted context."""
        node = self.start_node()
        head = session_with_prompt(self, node)
        head.send(AppendContentMsg(3, 1, 4, encode_tokens([1, 2])))  # stale epoch
        head.send(AppendContentMsg(2, 1, 5, encode_tokens([3, 4])))  # replayed command
        head.send(AppendContentMsg(4, 2, 5, encode_tokens([5, 6])))  # unknown session
        head.send(GenerateReqMsg(5, 1, 5, 1, GenerationBudgetsMsg(4)))
        self.wait(head.wait_for(finish_of(1, 1)))
        self.assertEqual(
            stream_of(head.events(1, 1)), (expected_tokens(PROMPT, 4), [FINISH_LENGTH])
        )

    def test_reassignment_and_second_generation_wins(self) -> None:
        """Item 21: re-assigning gives a higher epoch; re-append and generate give the same
        greedy output."""
        node = self.start_node()
        link = self.dial(node)
        first_epoch = link.assign(1)
        link.append(1, PROMPT)
        first = self.wait(link.generate(1, HeadRequest((), 10)).result)
        second_epoch = link.assign(1)
        self.assertGreater(second_epoch, first_epoch)
        link.append(1, PROMPT)
        second = self.wait(link.generate(1, HeadRequest((), 10)).result)
        self.assertEqual(first.tokens, second.tokens)
        self.assertEqual(node.agent.sessions_of(self.ids.head_id).session_epoch(1), second_epoch)

    def test_second_head_reusing_a_session_id_never_hangs(self) -> None:
        """Item 23: after one head ran generations on session 1, a second head's assign of the
        same id gets tokens or FINISH_DECLINED, never silence; a fresh session still works."""
        node = self.start_node()
        first = self.dial(node)
        first.assign(1)
        first.append(1, PROMPT)
        for _ in range(3):
            self.wait(first.generate(1, HeadRequest((), 3)).result)
        second = self.dial(node)
        second.assign(1)
        second.append(1, [4, 5, 6])
        outcome = self.wait(second.generate(1, HeadRequest((), 3)).result)
        self.assertEqual(
            (outcome.tokens, outcome.finish), (expected_tokens([4, 5, 6], 3), FINISH_LENGTH)
        )
        second.assign(2)
        second.append(2, [4, 5, 6])
        fresh = self.wait(second.generate(2, HeadRequest((), 3)).result)
        self.assertEqual(fresh.tokens, expected_tokens([4, 5, 6], 3))

    def test_revoke_forgets_the_session(self) -> None:
        """A SESSION_REVOKE drops the session: its context is gone and a GENERATE is declined."""
        node = self.start_node()
        link = self.dial(node)
        epoch = link.assign(1)
        link.append(1, PROMPT)
        self.wait(link.generate(1, HeadRequest((), 2)).result)
        link.revoke(1)
        head = self.raw_head(node)
        self.wait(head.hello(head_id=self.ids.head_id))
        head.send(GenerateReqMsg(1 << 40, 1, epoch, 9, GenerationBudgetsMsg(2)))
        self.wait(head.wait_for(finish_of(1, 9)))
        self.assertEqual([e.payload for e in head.events(1, 9)], [Finish(FINISH_DECLINED)])
        self.assertNotIn(1, node.agent.contexts_of(self.ids.head_id))


class ReconcileTests(MemoryNodeTestCase):
    def test_unacked_events_are_retransmitted_on_reconcile(self) -> None:
        """Items 16 and 18: events the head did not acknowledge stay buffered; a RECONCILE
        with watermark 1 retransmits exactly the later seqs in one batch with their range,
        and acknowledged ones are gone."""
        node = self.start_node()
        head = session_with_prompt(self, node)
        head.send(GenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(40)))
        self.wait(head.wait_for(finish_of(1, 100)))
        sent = head.events(1, 100)
        # The first token at once, then 16, 16 and 7 coalesced, then the Finish.
        self.assertEqual([e.event_seq for e in sent], [0, 1, 2, 3, 4])
        head.send(WatermarkAckMsg(1, 5, 100, 0))
        ack = self.wait(head.reconcile(1, 5, [(100, 1)]))
        (entry,) = ack.sessions
        self.assertTrue(entry.held)
        self.assertEqual(
            [(r.generation_id, r.from_seq, r.to_seq) for r in entry.retry_ranges], [(100, 2, 4)]
        )
        retransmission = self.wait(head.following(ack))
        self.assertEqual(retransmission.events, tuple(sent[2:]))
        self.assertEqual(node.agent.session.unacked_events(1, 100), 4)

    def test_reconcile_during_a_generation_is_answered(self) -> None:
        """D2: a RECONCILE that arrives while a generation streams on the same connection is
        answered at once, and the stream still completes correctly."""
        node = self.start_node(token_delay_s=0.003)
        head = session_with_prompt(self, node)
        head.send(GenerateReqMsg(3, 1, 5, 100, GenerationBudgetsMsg(60)))
        self.wait(head.wait_for(lambda m: isinstance(m, TokenEventsMsg)))
        ack = self.wait(head.reconcile(1, 5, [(100, None)]))
        self.assertTrue(ack.sessions[0].held)
        self.wait(head.wait_for(finish_of(1, 100)))
        after = head.received.index(ack)
        finish_index = next(i for i, m in enumerate(head.received) if finish_of(1, 100)(m))
        self.assertLess(after, finish_index)
        seqs = sorted({e.event_seq for e in head.events(1, 100)})
        self.assertEqual(seqs, list(range(len(seqs))))
        tokens: list[int] = []
        for seq in seqs:
            event = next(e for e in head.events(1, 100) if e.event_seq == seq)
            if isinstance(event.payload, Tokens):
                tokens.extend(event.payload.tokens)
        self.assertEqual(tokens, expected_tokens(PROMPT, 60))

    def test_reconnect_holds_session_and_resumes(self) -> None:
        """Items 18 and 24: after a generation, a reconnect reconciles the session as held with
        no retransmission, commits nothing new, and the next generation equals the first."""
        node = self.start_node()
        link = opened(self.dial(node))
        call = link.generate(1, HeadRequest((), 12))
        first = self.wait(call.result)
        committed = len(link.head_session.wal.events(1, call.epoch, call.generation_id))
        self.wait(link.reconnect())
        self.assertEqual(
            len(link.head_session.wal.events(1, call.epoch, call.generation_id)), committed
        )
        second = self.wait(link.generate(1, HeadRequest((), 12)).result)
        self.assertEqual(first.tokens, second.tokens)

    def test_reconnect_mid_stream_completes_the_generation(self) -> None:
        """D2 with 7.3: a link dropped in the middle of a stream reconnects and reconciles; the
        generation completes with every token exactly once."""
        node = self.start_node(token_delay_s=0.003)
        link = opened(self.dial(node))
        reconnected: list[defer.Deferred[None]] = []

        def on_tokens(tokens: Any) -> None:
            if not reconnected:
                reconnected.append(link.reconnect())

        call = link.generate(1, HeadRequest((), 80), on_tokens=on_tokens)
        outcome = self.wait(call.result)
        self.wait(reconnected[0])
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 80))
        self.assertEqual(outcome.finish, FINISH_LENGTH)


class HandshakeTests(MemoryNodeTestCase):
    def test_hello_ack_describes_the_node(self) -> None:
        """Items 19 and 32: HELLO_ACK_F carries version 2, the identity, ["mock"], the window,
        the lanes, the host memory (D8) and the advertised limits."""
        node = self.start_node(identity="proc-node", context_window=512, max_lanes=4)
        link = self.dial(node)
        ack = link.hello_ack
        self.assertEqual((ack.chosen_version, ack.node_identity), (2, "proc-node"))
        self.assertEqual(ack.loadable_models, ("mock",))
        self.assertEqual(ack.capacity.max_context_tokens, 512)
        self.assertEqual(ack.capacity.max_lanes, 4)
        self.assertGreater(ack.capacity.host_memory_bytes, 0)
        self.assertEqual(ack.capacity.kv_blocks_total, 32 * 4)
        self.assertEqual((ack.limits.max_frame, ack.limits.transfer_window), (16 * 1024 * 1024, 8))

    def test_node_status_reports_capacity(self) -> None:
        """docs/protocol.md section 7.5: NODE_STATUS arrives every status interval with live
        capacity, and the busy-time decode rate becomes non-zero after a generation."""
        node = self.start_node(status_interval_ms=100, token_delay_s=0.002)
        head = session_with_prompt(self, node)
        head.send(GenerateReqMsg(3, 1, 5, 1, GenerationBudgetsMsg(150)))
        self.wait(head.wait_for(finish_of(1, 1)))
        status = self.wait(
            head.wait_for(
                lambda m: isinstance(m, NodeStatusMsg) and m.capacity.decode_tokens_per_s > 0
            )
        )
        self.assertEqual(status.loadable_models, ("mock",))
        self.assertEqual(status.capacity.active_sessions, 1)
        self.assertEqual(status.mem.pool_blocks_total, status.capacity.kv_blocks_total)

    def test_wrong_token_and_non_head_are_refused(self) -> None:
        """Item 27: a wrong token or none against a keyed node fails the handshake, a peer that
        is not a head is refused, and the right token works."""
        node = self.start_node(auth_token=b"right-token")
        self.assertRaises(NodeRefusedError, self.dial, node, token=b"wrong-token")
        self.assertRaises(NodeRefusedError, self.dial, node)
        impostor = self.raw_head(node)
        impostor.send(Hello((2, 2), LinkRole.NODE_AGENT, b"right-token"))
        self.wait(impostor.lost)
        old = self.raw_head(node)
        old.send(Hello((1, 1), LinkRole.HEAD_DAEMON, b"right-token"))
        self.wait(old.lost)
        self.assertEqual(impostor.received + old.received, [])
        link = self.dial(node, token=b"right-token")
        self.wait(serves(self, link, 1, 3))


class RobustnessTests(MemoryNodeTestCase):
    def test_bad_frame_closes_only_that_connection(self) -> None:
        """A malformed envelope or payload closes that one connection with a logged reason;
        a generation on another connection finishes correctly."""
        node = self.start_node(token_delay_s=0.002)
        link = opened(self.dial(node))
        call = link.generate(1, HeadRequest((), 50))
        bad_envelope = self.raw_head(node)
        self.wait(bad_envelope.hello())
        bad_envelope.send_bytes(b"\x05\x00\x00\x00" + b"\x00" * 5)
        bad_payload = self.raw_head(node)
        self.wait(bad_payload.hello())
        # An APPEND whose context blob is not an array of u32.
        bad_payload.send(AppendContentMsg(1, 1, 1, b"\xc3"))
        assign_raw(bad_payload, 1 << 41, 1 << 20, 1)
        bad_payload.send(AppendContentMsg((1 << 41) + 1, 1 << 20, 1, b"\xa1x"))
        self.wait(defer.gatherResults([bad_envelope.lost, bad_payload.lost]))
        outcome = self.wait(call.result)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 50))
        self.assertTrue(link.connected)
        self.flushLoggedErrors()


class PipelineTests(MemoryNodeTestCase):
    def run_pipeline(self, boundaries: list[int], steps: int) -> list[int]:
        links = []
        for i in range(len(boundaries)):
            node = self.start_node(identity=f"stage{i}")
            links.append(self.dial(node))
        context = list(PROMPT)
        out = []
        for _ in range(steps):
            hidden: bytes | None = None
            start = 0
            token = None
            for link, end in zip(links, boundaries, strict=False):
                tokens = context if hidden is None else []
                response = self.wait(link.stage_forward(tokens, start, end, hidden))
                hidden, token, start = response.hidden, response.token, end
            self.assertIsNotNone(token)
            context.append(token)
            out.append(token)
        return out

    def test_two_stage_pipeline_matches_one_node(self) -> None:
        """Item 64: stages [0,12) and [12,24) give the 8 tokens of a single full node."""
        tokens = self.run_pipeline([12, 24], 8)
        self.assertEqual(tokens, expected_tokens(PROMPT, 8))

    def test_three_stage_pipeline_matches_one_node(self) -> None:
        """Item 65: stages split at 8 and 16 give the 6 tokens of a single full node."""
        tokens = self.run_pipeline([8, 16, 24], 6)
        self.assertEqual(tokens, expected_tokens(PROMPT, 6))

    def test_kept_stages_follow_the_test_vector(self) -> None:
        """docs/protocol.md section 12.8: a node with the mock sets feature bit 7; session 5's
        tokens 100..111 through [0, 12) give twelve rows, the last the stateless hidden, and
        [12, 24) on them gives 31198; then [31198] at position 12 gives 16521.  A position the
        session does not hold answers nil (and drops it); after STAGE_RELEASE, position 12 is
        unknown; the last stage, which holds 13 rows, continues at 13 until then."""
        first, last = self.dial(self.start_node(identity="a")), self.dial(self.start_node())
        self.assertTrue((first.features or 0) & FEATURE_STAGE_KV)
        prompt = list(range(100, 112))
        rows = self.wait(first.stage_forward(prompt, 0, 12, None, 5, 0)).hidden
        self.assertEqual(len(rows), 96)
        self.assertEqual(rows[-8:].hex(" "), "81 80 20 8c 32 96 a1 3a")
        self.assertEqual(self.wait(last.stage_forward([], 12, 24, rows, 5, 0)).token, 31198)
        row = self.wait(first.stage_forward([31198], 0, 12, None, 5, 12)).hidden
        self.assertEqual(row.hex(" "), "37 96 08 00 6a 2b 99 e7")
        self.assertEqual(self.wait(last.stage_forward([], 12, 24, row, 5, 12)).token, 16521)
        self.assertEqual(16521, expected_tokens(prompt, 2)[1])
        skipped = self.wait(first.stage_forward([7], 0, 12, None, 5, 20))
        self.assertEqual((skipped.hidden, skipped.token), (None, None))
        self.assertIsNotNone(self.wait(last.stage_forward([], 12, 24, row, 5, 13)).token)
        last.send_now(StageReleaseMsg(5))
        gone = self.wait(last.stage_forward([], 12, 24, row, 5, 13))
        self.assertEqual((gone.hidden, gone.token), (None, None))

    def test_a_stage_batch_answers_each_row_as_alone(self) -> None:
        """docs/protocol.md section 12.8, D28: a node with the mock sets feature bit 8; one
        STAGE_BATCH_REQ of sessions 5 (the test vector's tokens) and 6 answers each row's
        hidden states as a STAGE_FORWARD_REQ of its own does, the next stage's batch gives
        31198 and the full node's first token after PROMPT, and a row at a position its
        session does not hold answers nil alone (the others still answer)."""
        first, last = self.dial(self.start_node(identity="a")), self.dial(self.start_node())
        self.assertTrue((first.features or 0) & FEATURE_STAGE_BATCH)
        prompt = tuple(range(100, 112))
        rows = (StageBatchRow(5, 0, prompt, None), StageBatchRow(6, 0, tuple(PROMPT), None))
        hidden = self.wait(stage_batch(first, 0, 12, rows)).answers
        alone = self.wait(first.stage_forward(PROMPT, 0, 12, None, 7, 0)).hidden
        self.assertEqual(hidden[0].hidden[-8:].hex(" "), "81 80 20 8c 32 96 a1 3a")
        self.assertEqual(hidden[1].hidden, alone)
        on = tuple(
            StageBatchRow(row.stage_session, 0, (), a.hidden)
            for row, a in zip(rows, hidden, strict=True)
        )
        tokens = self.wait(stage_batch(last, 12, 24, on)).answers
        self.assertEqual([t.token for t in tokens], [31198, expected_tokens(PROMPT, 1)[0]])
        mixed = (StageBatchRow(5, 12, (31198,), None), StageBatchRow(6, 40, (1,), None))
        answers = self.wait(stage_batch(first, 0, 12, mixed)).answers
        self.assertEqual(answers[0].hidden.hex(" "), "37 96 08 00 6a 2b 99 e7")
        self.assertEqual((answers[1].hidden, answers[1].token), (None, None))

    def test_bad_stage_requests_answer_nil(self) -> None:
        """docs/protocol.md section 7.6: bad layer bounds or a malformed hidden blob answer {nil,
        nil}."""
        node = self.start_node()
        link = self.dial(node)
        for args in [(PROMPT, 5, 3, None), (PROMPT, 0, 25, None), ([], 12, 24, b"short")]:
            response = self.wait(link.stage_forward(*args))
            self.assertEqual((response.hidden, response.token), (None, None))


class FramesBeforeBadBytesTests(MemoryNodeTestCase):
    def test_frames_ahead_of_bad_bytes_are_handled(self) -> None:
        """An ASSIGN and an APPEND that arrive in one write with bad bytes behind them are
        applied before the connection closes: valid input is never lost."""
        node = self.start_node()
        head = self.raw_head(node)
        self.wait(head.hello())
        head.send_bytes(
            message_frame(SessionAssignMsg(1, 3, 5, LONG_LEASE, "", b"", 0, 0), 2)
            + message_frame(AppendContentMsg(2, 3, 5, encode_tokens(PROMPT)), 3)
            + b"\x05\x00\x00\x00"
        )
        self.wait(head.lost)
        self.assertEqual(node.agent.session.session_epoch(3), 5)
        self.assertEqual(list(node.agent.contexts_of(None)[3]), PROMPT)


class TimedTests(MemoryNodeTestCase):
    """Behaviours that take time (leases, idle and handshake timeouts), on a memory reactor:
    the same node and head library, with exact timing and no waiting."""

    def test_lease_expiry_fences_the_session(self) -> None:
        """Item 11: lease 300/150 with no grant: a LEASE_RENEW is asked at 150 ms (one only:
        D3 allows one a second), the session fences itself at 300 ms and drops its context,
        then refuses generations; a new ASSIGN un-fences it."""
        node = self.start_node()
        head = self.raw_head()
        head.hello()
        self.flush()
        assign_raw(head, 1, 1, 5, Lease(300, 150))
        head.send(AppendContentMsg(2, 1, 5, encode_tokens(PROMPT)))
        self.advance(0.14)
        self.assertEqual(head.of_type(LeaseRenewMsg), [])
        self.advance(0.02)
        self.assertEqual(head.of_type(LeaseRenewMsg), [LeaseRenewMsg(1, 5)])
        self.advance(0.13)
        self.assertFalse(node.agent.session.is_fenced(1))
        self.advance(0.02)
        self.assertTrue(node.agent.session.is_fenced(1))
        self.assertNotIn(1, node.agent.contexts_of(None))
        self.advance(1.0)
        self.assertEqual(len(head.of_type(LeaseRenewMsg)), 1)
        head.send(GenerateReqMsg(3, 1, 5, 1, GenerationBudgetsMsg(4)))
        self.flush()
        self.assertEqual([e.payload for e in head.events(1, 1)], [Finish(FINISH_DECLINED)])
        assign_raw(head, 4, 1, 5)
        head.send(AppendContentMsg(5, 1, 5, encode_tokens(PROMPT)))
        head.send(GenerateReqMsg(6, 1, 5, 2, GenerationBudgetsMsg(2)))
        self.advance(0.3)
        self.assertEqual(head.events(1, 2)[-1].payload, Finish(FINISH_LENGTH))

    def test_grant_extends_the_lease(self) -> None:
        """D4 with item 16: a head that grants every renewal keeps the session unfenced well
        past its lease duration (2.5 s of a 1 s lease renewed from 100 ms)."""
        node = self.start_node()
        link = self.dial()
        link.assign(1, lease=Lease(1000, 100))
        link.append(1, PROMPT)
        self.advance(2.5)
        self.assertFalse(node.agent.sessions_of(self.ids.head_id).is_fenced(1))
        call = link.generate(1, HeadRequest((), 3))
        self.advance(0.3)
        self.assertEqual(self.successResultOf(call.result).tokens, expected_tokens(PROMPT, 3))

    def test_stale_grant_does_not_extend_a_new_epoch(self) -> None:
        """Item 17: a grant for epoch 5 arriving after a re-assign to epoch 6 does not extend
        the epoch-6 lease, which still fences on time (250 ms after its ASSIGN)."""
        node = self.start_node()
        head = self.raw_head()
        head.hello()
        assign_raw(head, 1, 1, 5, Lease(250, 200))
        assign_raw(head, 2, 1, 6, Lease(250, 200))
        self.flush()
        self.advance(0.15)
        head.send(LeaseGrantMsg(1, 5, 10_000, 9_000))
        self.advance(0.09)
        self.assertFalse(node.agent.session.is_fenced(1))
        self.advance(0.02)
        self.assertTrue(node.agent.session.is_fenced(1))

    def test_keepalive_keeps_an_idle_link_open(self) -> None:
        """Item 29: a KEEPALIVE every 50 ms across three idle timeouts keeps the connection;
        without them the node drops it one idle timeout later."""
        node = self.start_node(idle_timeout_ms=600)
        link = self.dial()
        loop = task.LoopingCall(link.keepalive)
        loop.clock = self.reactor
        loop.start(0.05)
        self.advance(1.8)
        loop.stop()
        self.assertTrue(link.connected)
        self.assertEqual(len(node.agent.connections), 1)
        closed = link.when_closed()
        self.advance(0.55)
        self.assertNoResult(closed)
        self.advance(0.1)
        self.successResultOf(closed)
        self.assertEqual(node.agent.connections, ())

    def dropped_when_idle(self, idle_timeout_ms: int, count: int) -> tuple[NodeLink, list[int]]:
        """A link to a node with that idle timeout, after a generation of ``count`` tokens
        over :data:`PROMPT` in session 1, the drop of the link once idle that long (checked
        at 10 ms past it), and its reconnect; the link and the tokens of that generation."""
        self.start_node(idle_timeout_ms=idle_timeout_ms)
        link = opened(self.dial())
        first = link.generate(1, HeadRequest((), count))
        self.flush()
        tokens = self.successResultOf(first.result).tokens
        closed = link.when_closed()
        self.advance(idle_timeout_ms / 1000 + 0.01)
        self.successResultOf(closed)
        reconnected = link.reconnect()
        self.connect()
        self.successResultOf(reconnected)
        return link, tokens

    def test_idle_drop_is_transparent(self) -> None:
        """Item 26: the node drops a link idle for 400 ms; a reconnect and reconcile make the
        next generation return the same tokens."""
        link, tokens = self.dropped_when_idle(400, 6)
        second = link.generate(1, HeadRequest((), 6))
        self.flush()
        self.assertEqual(self.successResultOf(second.result).tokens, tokens)

    def test_append_after_idle_drop_rebinds(self) -> None:
        """Item 31: after an idle drop and reconnect, an append of the grown context and a
        generate give the output of the grown prompt."""
        link, tokens = self.dropped_when_idle(300, 4)
        grown = PROMPT + tokens + [42]
        link.append(1, grown)
        outcome = link.generate(1, HeadRequest((), 5))
        self.flush()
        self.assertEqual(self.successResultOf(outcome.result).tokens, expected_tokens(grown, 5))

    def test_silent_connection_does_not_wedge_the_node(self) -> None:
        """Item 25: a peer that never says HELLO is dropped at the 300 ms handshake timeout
        (not before) while a real head is served meanwhile."""
        self.start_node(handshake_timeout_ms=300)
        silent = self.raw_head()
        link = opened(self.dial())
        call = link.generate(1, HeadRequest((), 4))
        self.flush()
        self.assertEqual(self.successResultOf(call.result).tokens, expected_tokens(PROMPT, 4))
        self.advance(0.29)
        self.assertNoResult(silent.lost)
        self.advance(0.02)
        self.successResultOf(silent.lost)
        self.assertEqual(silent.received, [])


class HelloTests(MemoryNodeTestCase):
    """The HELLO is decoded and checked in one place, during the handshake only."""

    def test_a_malformed_hello_refuses_the_handshake(self) -> None:
        """A HELLO whose payload does not decode closes the connection before any answer."""
        self.start_node()
        head = self.raw_head()
        head.send_bytes(encode_frame(int(MsgType.HELLO), 1, b"\x93\x92\x02"))
        self.flush()
        self.successResultOf(head.lost)
        self.assertEqual(head.received, [])

    def test_a_hello_after_the_handshake_is_ignored_undecoded(self) -> None:
        """After the handshake a HELLO, even a malformed one, is ignored: the connection stays
        and keeps serving."""
        node = self.start_node()
        head = self.raw_head()
        head.hello()
        self.flush()
        head.send_bytes(encode_frame(int(MsgType.HELLO), 2, b"\xc1"))
        assign_raw(head, 1, 1, 5)
        head.send(AppendContentMsg(2, 1, 5, encode_tokens(PROMPT)))
        head.send(GenerateReqMsg(3, 1, 5, 1, GenerationBudgetsMsg(3)))
        self.flush()
        self.assertNoResult(head.lost)
        self.assertEqual(
            stream_of(head.events(1, 1)), (expected_tokens(PROMPT, 3), [FINISH_LENGTH])
        )
        self.assertEqual(len(node.agent.connections), 1)


class DispatchTableTests(SynchronousTestCase):
    """The node's responders are registered with their message class (docs/protocol.md 7.2)."""

    def test_the_node_handles_exactly_the_types_of_the_specification(self) -> None:
        """RECONCILE, ASSIGN, REVOKE, LEASE_GRANT, APPEND, GENERATE, WATERMARK_ACK,
        BLOB_FETCH (section 12.5), GENERATE_CANCEL, STAGE_FORWARD_REQ, EMBED_REQ (section
        12.7), STAGE_RELEASE and STAGE_BATCH_REQ (section 12.8), STAGE_RING_JOIN and
        STAGE_RING_ROWS (section 12.10) have a responder; every other type has none."""
        self.assertEqual(
            [cls.MSG_TYPE for cls in HANDLERS.message_classes()],
            [
                MsgType.RECONCILE,
                MsgType.SESSION_ASSIGN,
                MsgType.SESSION_REVOKE,
                MsgType.LEASE_GRANT,
                MsgType.APPEND_CONTENT,
                MsgType.GENERATE_REQ,
                MsgType.WATERMARK_ACK,
                MsgType.BLOB_FETCH,
                MsgType.GENERATE_CANCEL,
                MsgType.STAGE_FORWARD_REQ,
                MsgType.EMBED_REQ,
                MsgType.STAGE_RELEASE,
                MsgType.STAGE_BATCH_REQ,
                MsgType.STAGE_RING_JOIN,
                MsgType.STAGE_RING_ROWS,
            ],
        )

    def test_a_second_responder_for_one_class_is_refused(self) -> None:
        """Registering two responders for one message class is an error, not a silent swap."""
        table = HandlerTable()
        table.handles(WatermarkAckMsg)(lambda agent, connection, msg: None)
        with self.assertRaises(ValueError):
            table.handles(WatermarkAckMsg)(lambda agent, connection, msg: None)
