"""Tests of HeadSession, the head's pure per-connection bookkeeping (docs/protocol.md section 8.1,
and section 10 item 12)."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.link.session import HeadSession
from sfnode.linkf.wire import (
    FINISH_DECLINED,
    FINISH_EOS,
    Finish,
    GenerationBudgetsMsg,
    GenerationWatermark,
    GenParams,
    Lease,
    LeaseRenewMsg,
    LeaseStateMsg,
    PayloadError,
    ReconcileAckMsg,
    SessionReconcileAck,
    TokenEvent,
    TokenEventPayload,
    TokenEventsMsg,
    Tokens,
    WatermarkAckMsg,
    decode_params,
    decode_tokens,
    encode_params,
)

LEASE = Lease(60_000, 45_000)
BUDGETS = GenerationBudgetsMsg(16, 0)


def event(
    seq: int, payload: TokenEventPayload | None = None, *, s: int = 1, e: int = 5, g: int = 100
) -> TokenEvent:
    return TokenEvent(s, e, g, seq, payload if payload is not None else Tokens((seq + 10,)))


def batch(*events: TokenEvent) -> TokenEventsMsg:
    return TokenEventsMsg(tuple(events))


def assigned(session_id: int = 1, epoch: int = 5, base: int = 1) -> HeadSession:
    head = HeadSession(base)
    head.assign_session(session_id, epoch, LEASE)
    return head


class CommandTests(SynchronousTestCase):
    def test_command_ids_start_at_the_base_and_track_the_session_watermark(self) -> None:
        """alloc_command counts up from the base; a known session's watermark follows it."""
        head = HeadSession(command_base=(1 << 32) + 1)
        self.assertEqual(head.alloc_command(9), (1 << 32) + 1)
        assign = head.assign_session(1, 3, LEASE)
        self.assertEqual(assign.command_id, (1 << 32) + 2)
        self.assertEqual(head.alloc_command(1), (1 << 32) + 3)
        record = head.session(1)
        assert record is not None
        self.assertEqual(record.command_watermark, (1 << 32) + 3)
        self.assertEqual(head.next_command_id, (1 << 32) + 4)

    def test_a_base_below_one_is_refused(self) -> None:
        """Command ids start at 1: a base of 0 is a programming error."""
        self.assertRaises(ValueError, HeadSession, 0)

    def test_assign_carries_the_epoch_lease_and_params_blob(self) -> None:
        """SESSION_ASSIGN holds the given epoch, lease, codec, qos and GenParams blob."""
        head = HeadSession()
        blob = encode_params(GenParams(temperature=0.5, seed=7))
        msg = head.assign_session(4, 2, LEASE, params=blob, qos_class=3, codec="chat")
        self.assertEqual(
            (msg.command_id, msg.session_id, msg.epoch, msg.lease, msg.codec, msg.qos_class),
            (1, 4, 2, LEASE, "chat", 3),
        )
        self.assertEqual(decode_params(msg.params), GenParams(temperature=0.5, seed=7))
        self.assertEqual(msg.policy_ref, 0)
        self.assertEqual(head.epoch_of(4), 2)

    def test_append_sends_the_complete_context_and_stores_it(self) -> None:
        """APPEND_CONTENT carries the whole context blob; reappend resends it with a new id."""
        head = assigned()
        msg = head.append(1, [300, 301, 302])
        assert msg is not None
        self.assertEqual(msg.blocks, bytes.fromhex("93cd012ccd012dcd012e"))
        self.assertEqual((msg.command_id, msg.epoch, msg.spans, msg.media_refs), (2, 5, (), ()))
        again = head.reappend(1)
        assert again is not None
        self.assertEqual(decode_tokens(again.blocks), (300, 301, 302))
        self.assertEqual(again.command_id, 3)
        self.assertIsNone(head.append(2, [1]))
        self.assertIsNone(head.reappend(2))

    def test_reassign_keeps_the_epoch_with_a_new_command(self) -> None:
        """reassign repeats the stored placement at the same epoch with a fresh command id."""
        head = HeadSession()
        first = head.assign_session(1, 5, LEASE, params=b"\x01", codec="c")
        again = head.reassign(1)
        assert again is not None
        self.assertEqual(again.epoch, 5)
        self.assertEqual(again.params, b"\x01")
        self.assertEqual(again.command_id, first.command_id + 1)
        self.assertIsNone(head.reassign(2))

    def test_a_reassign_at_a_new_epoch_keeps_the_stored_context(self) -> None:
        """The head's context for a session survives a re-assign so it can be appended again."""
        head = assigned()
        head.append(1, [1, 2])
        head.assign_session(1, 6, LEASE)
        msg = head.reappend(1)
        assert msg is not None
        self.assertEqual((msg.epoch, decode_tokens(msg.blocks)), (6, (1, 2)))


class GenerateTests(SynchronousTestCase):
    def test_generate_retry_reuses_command_and_generation(self) -> None:
        """A retried generate returns the same GENERATE_REQ: same command and generation (12)."""
        head = assigned()
        first = head.generate(1, 100, BUDGETS)
        retry = head.generate(1, 100, GenerationBudgetsMsg(99, 1))
        assert first is not None
        self.assertIs(retry, first)
        self.assertEqual((first.command_id, first.generation_id, first.epoch), (2, 100, 5))
        self.assertEqual(head.next_command_id, 3)

    def test_generate_for_an_unknown_session_is_none(self) -> None:
        """No GENERATE_REQ for a session the head never assigned."""
        self.assertIsNone(HeadSession().generate(1, 1, BUDGETS))

    def test_a_new_epoch_forgets_issued_generates_of_the_old_one(self) -> None:
        """After a re-assign, the same generation id gets a new request at the new epoch."""
        head = assigned()
        old = head.generate(1, 100, BUDGETS)
        head.assign_session(1, 6, LEASE)
        new = head.generate(1, 100, BUDGETS)
        assert old is not None and new is not None
        self.assertEqual(new.epoch, 6)
        self.assertNotEqual(new.command_id, old.command_id)

    def test_retire_generation_forgets_key_tracking_and_request(self) -> None:
        """retire_generation drops the dedup key, the tracking and the issued request."""
        head = assigned()
        first = head.generate(1, 100, BUDGETS)
        head.on_token_events(batch(event(0)))
        head.retire_generation(1, 100)
        self.assertIsNone(head.watermark(1, 5, 100))
        self.assertEqual(head.tracked(1), [])
        again = head.generate(1, 100, BUDGETS)
        assert first is not None and again is not None
        self.assertNotEqual(again.command_id, first.command_id)
        self.assertEqual(head.wal.tokens(1, 5, 100), [10])


class DedupTests(SynchronousTestCase):
    def test_contiguous_events_commit_and_ack_the_highest_seq(self) -> None:
        """Seqs 0..2 in one batch commit in order and get ONE ack with watermark 2."""
        head = assigned()
        acks = head.on_token_events(batch(event(0), event(1), event(2, Finish(FINISH_EOS))))
        self.assertEqual(acks, [WatermarkAckMsg(1, 5, 100, 2)])
        self.assertEqual(head.wal.tokens(1, 5, 100), [10, 11])
        self.assertEqual(head.wal.finish(1, 5, 100), FINISH_EOS)
        self.assertEqual([e.event_seq for e in head.wal.events(1, 5, 100)], [0, 1, 2])

    def test_a_retransmitted_batch_commits_nothing_and_re_acks(self) -> None:
        """A batch already committed commits nothing and re-acks watermark 1 (item 12)."""
        head = assigned()
        head.on_token_events(batch(event(0), event(1)))
        ingested = head.ingest(batch(event(0), event(1)))
        self.assertEqual(ingested.acks, [WatermarkAckMsg(1, 5, 100, 1)])
        self.assertEqual(ingested.committed, [])
        self.assertEqual(head.wal.tokens(1, 5, 100), [10, 11])

    def test_a_duplicate_mixed_with_a_new_event_gives_one_ack(self) -> None:
        """AlreadyCommitted and Accepted under one key: one ack with the highest contiguous seq."""
        head = assigned()
        head.on_token_events(batch(event(0)))
        ingested = head.ingest(batch(event(0), event(1)))
        self.assertEqual(ingested.acks, [WatermarkAckMsg(1, 5, 100, 1)])
        self.assertEqual([e.event_seq for e in ingested.committed], [1])

    def test_stale_epoch_events_never_commit_nor_ack(self) -> None:
        """An event of an epoch older than the session's is dropped without an ack (item 12)."""
        head = assigned(epoch=5)
        head.assign_session(1, 6, LEASE)
        acks = head.on_token_events(batch(event(0, e=5)))
        self.assertEqual(acks, [])
        self.assertEqual(head.wal.events(1, 5, 100), [])
        fresh = head.on_token_events(batch(event(0, e=6)))
        self.assertEqual(fresh, [WatermarkAckMsg(1, 6, 100, 0)])

    def test_a_gap_is_dropped_without_an_ack(self) -> None:
        """Seq 2 after 0 is a gap: not committed, not acked; 1 then 2 commit in order."""
        head = assigned()
        head.on_token_events(batch(event(0)))
        self.assertEqual(head.on_token_events(batch(event(2))), [])
        self.assertEqual(head.wal.tokens(1, 5, 100), [10])
        acks = head.on_token_events(batch(event(1), event(2)))
        self.assertEqual(acks, [WatermarkAckMsg(1, 5, 100, 2)])

    def test_a_first_event_that_is_a_gap_gets_no_ack(self) -> None:
        """A key whose first event is seq 1 has no watermark, so nothing is acked."""
        head = assigned()
        self.assertEqual(head.on_token_events(batch(event(1))), [])

    def test_one_ack_per_touched_key_in_first_touch_order(self) -> None:
        """Events of two generations interleaved give one ack per generation, each its highest."""
        head = assigned()
        acks = head.on_token_events(
            batch(event(0, g=7), event(0, g=8), event(1, g=7), event(1, g=8), event(2, g=7))
        )
        self.assertEqual(acks, [WatermarkAckMsg(1, 5, 7, 2), WatermarkAckMsg(1, 5, 8, 1)])

    def test_a_declined_finish_with_seq_zero_is_a_duplicate_after_commits(self) -> None:
        """A DECLINED finish at seq 0 for a generation with commits is re-acked, not committed."""
        head = assigned()
        head.on_token_events(batch(event(0), event(1)))
        acks = head.on_token_events(batch(event(0, Finish(FINISH_DECLINED))))
        self.assertEqual(acks, [WatermarkAckMsg(1, 5, 100, 1)])
        self.assertIsNone(head.wal.finish(1, 5, 100))


class LeaseAndReconcileTests(SynchronousTestCase):
    def test_lease_renew_is_granted_only_for_the_current_epoch(self) -> None:
        """LEASE_RENEW at the session's epoch gets the session's lease; others get nothing."""
        head = assigned(epoch=5)
        grant = head.on_lease_renew(LeaseRenewMsg(1, 5))
        assert grant is not None
        self.assertEqual(
            (grant.session_id, grant.epoch, grant.duration_ms, grant.renew_by_ms),
            (1, 5, 60_000, 45_000),
        )
        head.assign_session(1, 6, LEASE)
        self.assertIsNone(head.on_lease_renew(LeaseRenewMsg(1, 5)))
        self.assertIsNone(head.on_lease_renew(LeaseRenewMsg(2, 6)))

    def test_reconcile_reports_none_when_nothing_was_committed(self) -> None:
        """A tracked generation with no committed event reconciles with watermark None (12)."""
        head = assigned()
        head.generate(1, 100, BUDGETS)
        (state,) = head.reconcile().sessions
        self.assertEqual(state.generation_watermarks, (GenerationWatermark(100, None),))
        self.assertEqual((state.session_id, state.epoch), (1, 5))
        self.assertEqual(state.lease_state, LeaseStateMsg(LEASE, 0))
        self.assertEqual(state.command_watermark, 2)

    def test_reconcile_reports_committed_watermarks_of_the_current_epoch(self) -> None:
        """Watermarks come from dedup; generations of older epochs are not reported."""
        head = assigned()
        head.generate(1, 100, BUDGETS)
        head.on_token_events(batch(event(0), event(1)))
        self.assertEqual(
            head.reconcile().sessions[0].generation_watermarks, (GenerationWatermark(100, 1),)
        )
        head.assign_session(1, 6, LEASE)
        head.on_token_events(batch(event(0, e=6, g=101)))
        self.assertEqual(
            head.reconcile().sessions[0].generation_watermarks, (GenerationWatermark(101, 0),)
        )

    def test_reconcile_ack_names_the_sessions_not_held(self) -> None:
        """on_reconcile_ack returns exactly the ids whose held flag is false."""
        head = HeadSession()
        view = LeaseStateMsg(Lease(0, 0), 0)
        ack = ReconcileAckMsg(
            (SessionReconcileAck(1, True, (), view), SessionReconcileAck(2, False, (), view))
        )
        self.assertEqual(head.on_reconcile_ack(ack), [2])

    def test_revoke_forgets_the_session(self) -> None:
        """SESSION_REVOKE for a known session; afterwards it is unknown and unreported."""
        head = assigned()
        head.generate(1, 100, BUDGETS)
        msg = head.revoke(1)
        assert msg is not None
        self.assertEqual((msg.command_id, msg.session_id, msg.epoch), (3, 1, 5))
        self.assertIsNone(head.epoch_of(1))
        self.assertEqual(head.reconcile().sessions, ())
        self.assertIsNone(head.issued(1, 100))
        self.assertIsNone(head.revoke(1))

    def test_revoke_of_an_unknown_session_needs_an_epoch(self) -> None:
        """A session placed elsewhere is revoked with the given epoch and the next command."""
        head = HeadSession()
        msg = head.revoke(3, epoch=9)
        assert msg is not None
        self.assertEqual((msg.command_id, msg.session_id, msg.epoch), (1, 3, 9))

    def test_wal_entries_can_be_forgotten(self) -> None:
        """wal.forget drops one generation's committed events from the WAL."""
        head = assigned()
        head.on_token_events(batch(event(0)))
        self.assertEqual(head.wal.keys(), [(1, 5, 100)])
        head.wal.forget(1, 5, 100)
        self.assertEqual(head.wal.keys(), [])

    def test_an_append_with_a_bad_token_changes_nothing(self) -> None:
        """A token that is not a u32 raises before the context or a command id is used."""
        head = assigned()
        head.append(1, [1, 2])
        before = head.next_command_id
        self.assertRaises(PayloadError, head.append, 1, [1, -5])
        self.assertEqual((head.context(1), head.next_command_id), ((1, 2), before))
