"""Tests of sfnode.linkf.idempotency: command tables, retry buffers, lease clocks and event dedup.

They pin docs/protocol.md section 10 items 3 to 7 (and the memory bounds this edition adds).  Pure
logic, so every test is synchronous and never touches a reactor or a clock.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from sfnode.linkf.idempotency import (
    U64_MAX,
    Accepted,
    AlreadyCommitted,
    CommandTable,
    DedupKey,
    EventDedup,
    Gap,
    LeaseClock,
    RetryBuffer,
    StaleEpoch,
)


def applied(capacity: int, last: int) -> CommandTable:
    """A table of ``capacity`` that has applied the command ids 1 to ``last``."""
    table = CommandTable(capacity=capacity)
    for i in range(1, last + 1):
        table.apply(i)
    return table


class CommandTableTests(SynchronousTestCase):
    def test_replay_is_not_recomputed(self) -> None:
        """A replayed command id is refused, so the work it guards runs exactly once (item 3)."""
        table = CommandTable()
        calls: list[int] = []

        def run(command_id: int) -> bool:
            if table.apply(command_id):
                calls.append(command_id)
                return True
            return False

        self.assertTrue(run(1))
        self.assertFalse(run(1))
        self.assertEqual(calls, [1])
        self.assertIn(1, table)

    def test_trim_keeps_ids_above_watermark(self) -> None:
        """trim(3) over ids 1..5 keeps exactly 4 and 5; 1..3 become fresh again (item 3)."""
        table = CommandTable()
        for i in range(1, 6):
            self.assertTrue(table.apply(i))
        table.trim(3)
        self.assertEqual(list(table), [4, 5])
        self.assertEqual(len(table), 2)
        self.assertFalse(table.apply(4))
        self.assertTrue(table.apply(3))

    def test_trim_u64_max_clears(self) -> None:
        """trim(u64::MAX) forgets every id, including u64::MAX itself."""
        table = CommandTable()
        table.apply(7)
        table.apply(U64_MAX)
        table.trim(U64_MAX)
        self.assertEqual(len(table), 0)
        self.assertTrue(table.apply(U64_MAX))
        self.assertTrue(table.apply(7))

    def test_trim_zero_keeps_everything_above_zero(self) -> None:
        """trim(0) drops only id 0."""
        table = CommandTable()
        table.apply(0)
        table.apply(1)
        table.trim(0)
        self.assertEqual(list(table), [1])

    def test_memory_is_bounded_and_replays_still_refused(self) -> None:
        """Past its capacity the table folds the oldest ids, still refusing every one of them."""
        table = CommandTable(capacity=4)
        for i in range(1, 11):
            self.assertTrue(table.apply(i))
        self.assertEqual(len(table), 4)
        for i in range(1, 11):
            self.assertFalse(table.apply(i), i)
        self.assertTrue(table.apply(11))

    def test_trim_releases_folded_ids(self) -> None:
        """A trim at or above every folded id forgets the fold, so those ids are fresh again."""
        table = applied(2, 5)
        table.trim(3)
        self.assertEqual(list(table), [4, 5])
        self.assertTrue(table.apply(2))

    def test_partial_trim_of_folded_range(self) -> None:
        """A trim inside the folded range forgets the ids at or below it and keeps the rest."""
        table = applied(1, 5)
        table.trim(2)
        self.assertTrue(table.apply(2))
        self.assertFalse(table.apply(3))
        self.assertFalse(table.apply(5))

    def test_capacity_must_be_positive(self) -> None:
        """A table that can remember nothing is a programming error."""
        self.assertRaises(ValueError, CommandTable, 0)


class RetryBufferTests(SynchronousTestCase):
    def _buffer(self, seqs: range) -> RetryBuffer[str]:
        buffer: RetryBuffer[str] = RetryBuffer()
        for seq in seqs:
            buffer.push(seq, f"e{seq}")
        return buffer

    def test_ack_pops_acknowledged_prefix(self) -> None:
        """ack(1) over seqs 0..2 keeps only seq 2 (item 6)."""
        buffer = self._buffer(range(3))
        buffer.ack(1)
        self.assertEqual(len(buffer), 1)
        self.assertEqual(buffer.retransmit_from(0), ["e2"])

    def test_retransmit_from_yields_tail(self) -> None:
        """retransmit_from(3) over 0..4 is [3, 4]; from(100) is empty; the buffer is kept."""
        buffer = self._buffer(range(5))
        self.assertEqual(buffer.retransmit_from(3), ["e3", "e4"])
        self.assertEqual(buffer.retransmit_from(100), [])
        self.assertEqual(buffer.retransmit_from(0), ["e0", "e1", "e2", "e3", "e4"])
        self.assertEqual(len(buffer), 5)

    def test_ack_of_all_empties(self) -> None:
        """Acknowledging the last seq empties the buffer; a lower ack afterwards is harmless."""
        buffer = self._buffer(range(2))
        buffer.ack(1)
        self.assertEqual(len(buffer), 0)
        buffer.ack(0)
        self.assertEqual(len(buffer), 0)

    def test_ack_below_front_keeps_everything(self) -> None:
        """An ack below the oldest buffered seq removes nothing."""
        buffer = self._buffer(range(3, 6))
        buffer.ack(2)
        self.assertEqual(len(buffer), 3)


class LeaseClockTests(SynchronousTestCase):
    def test_boundaries(self) -> None:
        """Lease 10000/8000: renewal due at exactly 8000 ms, expiry at exactly 10000 ms (item 7)."""
        received = 100_000
        clock = LeaseClock(received, 10_000, 8_000)
        self.assertFalse(clock.must_renew(received + 7_999))
        self.assertTrue(clock.must_renew(received + 8_000))
        self.assertTrue(clock.must_renew(received + 8_001))
        self.assertFalse(clock.expired(received + 9_999))
        self.assertTrue(clock.expired(received + 10_000))
        self.assertTrue(clock.expired(received + 20_000))

    def test_time_until_renewal_and_expiry(self) -> None:
        """renew_in and expires_in (what the lease machine arms its timers with) count down to
        the same boundaries as must_renew and expired, and stay 0 afterwards."""
        received = 100_000
        clock = LeaseClock(received, 10_000, 8_000)
        self.assertEqual((clock.renew_in(received), clock.expires_in(received)), (8_000, 10_000))
        self.assertEqual(
            (clock.renew_in(received + 7_999), clock.expires_in(received + 9_999)), (1, 1)
        )
        for now in (received + 8_000, received + 10_000, received + 50_000):
            self.assertEqual(clock.renew_in(now), 0)
            self.assertTrue(clock.must_renew(now))
        self.assertEqual(clock.expires_in(received + 10_000), 0)

    def test_now_before_receipt(self) -> None:
        """A now earlier than receipt is never due nor expired, even for a zero lease."""
        clock = LeaseClock(100_000, 10_000, 8_000)
        self.assertFalse(clock.must_renew(50_000))
        self.assertFalse(clock.expired(50_000))
        zero = LeaseClock(100, 0, 0)
        self.assertFalse(zero.must_renew(99))
        self.assertFalse(zero.expired(99))
        self.assertTrue(zero.expired(100))
        self.assertEqual(zero.age(99), 0)


class EventDedupTests(SynchronousTestCase):
    def test_stale_epoch_fenced(self) -> None:
        """An event of an older epoch is StaleEpoch and leaves no watermark (item 4)."""
        dedup = EventDedup()
        dedup.set_session_epoch(1, 5)
        self.assertEqual(dedup.accept((1, 4, 1), 0), StaleEpoch())
        self.assertIsNone(dedup.watermark((1, 4, 1)))
        self.assertEqual(dedup.accept((1, 5, 1), 0), Accepted())

    def test_raising_epoch_forgets_older_keys(self) -> None:
        """set_session_epoch with a higher epoch forgets older keys; their events turn stale."""
        dedup = EventDedup()
        dedup.set_session_epoch(1, 5)
        dedup.accept((1, 5, 1), 0)
        dedup.accept((2, 5, 1), 0)
        self.assertEqual(len(dedup), 2)
        dedup.set_session_epoch(1, 6)
        self.assertEqual(len(dedup), 1)
        self.assertIsNone(dedup.watermark((1, 5, 1)))
        self.assertEqual(dedup.accept((1, 5, 1), 1), StaleEpoch())
        self.assertEqual(dedup.watermark((2, 5, 1)), 0)
        self.assertEqual(dedup.session_epoch(1), 6)

    def test_same_or_lower_epoch_forgets_nothing(self) -> None:
        """Setting the same epoch again keeps the keys of that epoch."""
        dedup = EventDedup()
        dedup.set_session_epoch(1, 5)
        dedup.accept((1, 5, 1), 0)
        dedup.set_session_epoch(1, 5)
        self.assertEqual(dedup.watermark((1, 5, 1)), 0)

    def test_retire_generation_and_session_bound_memory(self) -> None:
        """retire_generation forgets one key and retire_session every key of a session (item 4)."""
        dedup = EventDedup()
        for g in range(10):
            self.assertEqual(dedup.accept((1, 1, g), 0), Accepted())
        self.assertEqual(len(dedup), 10)
        for g in range(10):
            dedup.retire_generation((1, 1, g))
        self.assertEqual(len(dedup), 0)
        dedup.retire_generation((1, 1, 99))
        dedup.accept((2, 1, 1), 0)
        dedup.accept((3, 1, 1), 0)
        dedup.set_session_epoch(2, 1)
        dedup.retire_session(2)
        self.assertEqual(len(dedup), 1)
        self.assertIsNone(dedup.session_epoch(2))
        self.assertIsNone(dedup.watermark((2, 1, 1)))

    def test_contiguous_accept(self) -> None:
        """Seqs 0, 1, 2 in order are all Accepted and the watermark is 2 (item 5)."""
        dedup = EventDedup()
        key = DedupKey(1, 1, 1)
        for seq in range(3):
            self.assertEqual(dedup.accept(key, seq), Accepted())
        self.assertEqual(dedup.watermark(key), 2)

    def test_duplicate_after_lost_ack(self) -> None:
        """A retransmission of committed seqs is AlreadyCommitted; the watermark stays (item 5)."""
        dedup = EventDedup()
        key = (1, 1, 1)
        dedup.accept(key, 0)
        dedup.accept(key, 1)
        self.assertEqual(dedup.accept(key, 0), AlreadyCommitted())
        self.assertEqual(dedup.accept(key, 1), AlreadyCommitted())
        self.assertEqual(dedup.watermark(key), 1)

    def test_gap(self) -> None:
        """0 then 2 gives Gap(expected 1, got 2) and the watermark stays 0 (item 5)."""
        dedup = EventDedup()
        key = (1, 1, 1)
        dedup.accept(key, 0)
        self.assertEqual(dedup.accept(key, 2), Gap(expected=1, got=2))
        self.assertEqual(dedup.watermark(key), 0)

    def test_gap_before_anything(self) -> None:
        """A first event with seq 1 is a Gap from 0 and leaves no watermark."""
        dedup = EventDedup()
        self.assertEqual(dedup.accept((1, 1, 1), 1), Gap(expected=0, got=1))
        self.assertIsNone(dedup.watermark((1, 1, 1)))
        self.assertEqual(len(dedup), 0)

    def test_generations_independent(self) -> None:
        """Two generations of one session keep separate watermarks (item 5)."""
        dedup = EventDedup()
        dedup.accept((1, 1, 1), 0)
        dedup.accept((1, 1, 1), 1)
        dedup.accept((1, 1, 2), 0)
        self.assertEqual(dedup.watermark((1, 1, 1)), 1)
        self.assertEqual(dedup.watermark((1, 1, 2)), 0)

    def test_higher_epoch_event_without_set_is_accepted(self) -> None:
        """An event of an epoch above the recorded one is judged by its own key, not refused."""
        dedup = EventDedup()
        dedup.set_session_epoch(1, 5)
        self.assertEqual(dedup.accept((1, 6, 1), 0), Accepted())
        self.assertEqual(dedup.session_epoch(1), 5)
