"""The stage sessions' table (docs/protocol.md section 12.8): slots, positions, layer ranges and
the bounds, pure (no engine, no reactor); and the head's step groups, which send the rows of
the generations they carry to each stage together, over recording links on a Clock."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from sfnode.engines.scheduling.stages import STAGE_IDLE_S, StageSessions
from sfnode.generation import StageForwardError
from sfnode.head.fleet.pipeline import PipelineError, StepGroup, _Kept
from sfnode.head.link.calls import CallTable
from sfnode.linkf.wire import (
    FEATURE_STAGE_BATCH,
    FEATURE_STAGE_KV,
    StageBatchAnswer,
    StageBatchReqMsg,
    StageBatchRespMsg,
    StageBatchRow,
)

LAYERS = (0, 4)


class StageSessionsTests(SynchronousTestCase):
    def test_a_session_continues_from_any_position_it_holds(self) -> None:
        """Opened at 0 on a free slot, a session continues at its length or before it (the
        rows beyond are forgotten), keeps its slot, and position 0 starts it over."""
        table = StageSessions(slots=2, window=100)
        slot = table.claim("a", 1, 0, 10, LAYERS, 0.0)
        self.assertEqual(table.claim("a", 1, 10, 1, LAYERS, 1.0), slot)
        self.assertEqual(table.claim("a", 1, 5, 2, LAYERS, 2.0), slot)
        self.assertRaises(StageForwardError, table.claim, "a", 1, 8, 1, LAYERS, 3.0)
        self.assertEqual(len(table), 0)
        self.assertEqual(table.claim("a", 1, 0, 3, (0, 2), 4.0), slot)

    def test_refusals_drop_the_session(self) -> None:
        """An unknown session past 0, another layer range, no rows, or positions past the
        window are refused, and the session is then gone."""
        table = StageSessions(slots=2, window=16)
        self.assertRaises(StageForwardError, table.claim, "a", 1, 3, 1, LAYERS, 0.0)
        for position, rows, layers in ((4, 1, (0, 2)), (4, 0, LAYERS), (4, 13, LAYERS)):
            table.claim("a", 1, 0, 4, LAYERS, 0.0)
            self.assertRaises(StageForwardError, table.claim, "a", 1, position, rows, layers, 0.0)
            self.assertEqual(len(table), 0)

    def test_sessions_are_bounded_by_the_slots_and_idleness(self) -> None:
        """With every slot held, a new session is refused until one has been idle
        STAGE_IDLE_S; it then takes that slot, and the evicted one is unknown."""
        table = StageSessions(slots=2, window=100)
        first = table.claim("a", 1, 0, 1, LAYERS, 0.0)
        table.claim("b", 1, 0, 1, LAYERS, 10.0)
        self.assertRaises(StageForwardError, table.claim, "c", 1, 0, 1, LAYERS, STAGE_IDLE_S - 1)
        self.assertEqual(table.claim("c", 1, 0, 1, LAYERS, STAGE_IDLE_S), first)
        self.assertRaises(StageForwardError, table.claim, "a", 1, 1, 1, LAYERS, 70.0)
        self.assertEqual(len(table), 2)

    def test_an_owner_or_a_session_is_released(self) -> None:
        """Dropping a session frees its slot; dropping an owner frees all of its, and only
        its; two owners' sessions of one id are distinct."""
        table = StageSessions(slots=3, window=100)
        table.claim("a", 1, 0, 1, LAYERS, 0.0)
        table.claim("a", 2, 0, 1, LAYERS, 0.0)
        table.claim("b", 1, 0, 1, LAYERS, 0.0)
        table.drop("a", 2)
        self.assertEqual(len(table), 2)
        table.drop("a")
        self.assertEqual(len(table), 1)
        self.assertEqual(table.claim("b", 1, 1, 1, LAYERS, 1.0), 2)


class _Answer:
    """A stage's answer to one row (what a STAGE_FORWARD_RESP carries)."""

    def __init__(self, token: int | None = None, hidden: bytes | None = None) -> None:
        self.token, self.hidden = token, hidden


class _Link:
    """A stage link to a node without feature bit 8: it records each STAGE_FORWARD_REQ and
    answers when the test says."""

    features = FEATURE_STAGE_KV

    def __init__(self, name: str) -> None:
        self.name = name
        self.sent: list[tuple[Any, ...]] = []
        self.answers: list[Deferred[_Answer]] = []

    def stage_forward(self, *request: Any) -> Deferred[_Answer]:
        self.sent.append(request)
        d: Deferred[_Answer] = Deferred()
        self.answers.append(d)
        return d


class _BatchLink:
    """A stage link to a node that set feature bit 8: its frames are recorded, and the test
    answers them through the link's real call table."""

    features = FEATURE_STAGE_KV | FEATURE_STAGE_BATCH
    connected = True

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls = CallTable()
        self.sent: list[StageBatchReqMsg] = []

    def send_now(self, message: StageBatchReqMsg) -> None:
        self.sent.append(message)

    def answer(self, *answers: StageBatchAnswer) -> None:
        """Answer the last batch sent."""
        self._calls.answer_batch(StageBatchRespMsg(self.sent[-1].request_id, answers))


class _Pipeline:
    """What a step group reads of its pipeline: the ranges, the clock, the byte count."""

    def __init__(self, clock: Clock) -> None:
        self.ranges = [(0, 2), (2, 4)]
        self.clock = clock
        self.forwarded = 0

    def count_forwarded(self, kept: Any, hidden: bytes | None) -> None:
        self.forwarded += len(hidden or b"")


class _StepGroupCase(SynchronousTestCase):
    """A step group over two stage links of the class :attr:`link` (per-row frames by default)."""

    link: type[_Link] | type[_BatchLink] = _Link

    def setUp(self) -> None:
        self.clock = Clock()
        self.pipeline = _Pipeline(self.clock)
        self.links = [self.link("stage0"), self.link("stage1")]
        self.group = StepGroup(self.pipeline)  # type: ignore[arg-type]

    def kept(self, session: int) -> _Kept:
        return _Kept(session=session, links=self.links)  # type: ignore[arg-type]


class StepGroupTests(_StepGroupCase):
    def test_a_round_waits_for_every_member_and_sends_their_rows_together(self) -> None:
        """Two members' rows reach the first stage in one reactor turn, once both asked; the
        second stage gets both hidden states only when the first answered both; each member
        gets its own token; a member asking again waits for the other."""
        a, b = self.kept(1), self.kept(2)
        first = self.group.submit(a, (5, 6), 0)
        self.clock.advance(0)
        self.assertEqual(len(self.links[0].sent), 1)  # a lone member's round went at once
        self.links[0].answers[0].callback(_Answer(hidden=b"h" * 8))
        self.links[1].answers[0].callback(_Answer(token=9))
        self.assertEqual(self.successResultOf(first), 9)
        self.group.submit(a, (9,), 2)
        later = self.group.submit(b, (7,), 0)
        self.assertEqual(len(self.links[0].sent), 1)
        self.clock.advance(0)
        self.assertEqual(
            self.links[0].sent[1:],
            [((9,), 0, 2, None, 1, 2), ((7,), 0, 2, None, 2, 0)],
        )
        self.links[0].answers[1].callback(_Answer(hidden=b"a" * 4))
        self.assertEqual(len(self.links[1].sent), 1)
        self.links[0].answers[2].callback(_Answer(hidden=b"b" * 4))
        self.assertEqual(
            self.links[1].sent[1:], [((), 2, 4, b"a" * 4, 1, 2), ((), 2, 4, b"b" * 4, 2, 0)]
        )
        self.links[1].answers[2].callback(_Answer(token=3))
        self.assertNoResult(later)
        self.links[1].answers[1].callback(_Answer(token=4))
        self.assertEqual(self.successResultOf(later), 3)
        self.assertEqual(self.pipeline.forwarded, 16)
        self.assertEqual(self.group.rounds, 2)

    def test_a_member_asking_again_with_its_token_is_sent_in_the_same_turn(self) -> None:
        """A member that asks its next step as its token comes in (as a generation does) has
        its next round sent at once, without waiting for another reactor turn, together with
        a member that joined while the round ran."""
        a = self.kept(1)
        steps: list[Deferred[int]] = []

        def again(token: int) -> int:
            steps.append(self.group.submit(a, (token,), 2))
            return token

        self.group.submit(a, (5, 6), 0).addCallback(again)
        self.clock.advance(0)
        self.links[0].answers[0].callback(_Answer(hidden=b"h" * 8))
        self.links[1].answers[0].callback(_Answer(token=9))
        self.assertEqual(len(steps), 1)
        self.assertEqual(self.links[0].sent[1:], [((9,), 0, 2, None, 1, 2)])
        steps[0].addCallback(again)
        b = self.kept(2)
        self.links[0].answers[1].callback(_Answer(hidden=b"h" * 4))
        self.group.submit(b, (7,), 0)
        self.assertEqual(len(self.links[0].sent), 2)  # b waits for a's round to end
        self.links[1].answers[1].callback(_Answer(token=3))
        self.assertEqual(
            self.links[0].sent[2:], [((7,), 0, 2, None, 2, 0), ((3,), 0, 2, None, 1, 2)]
        )
        self.assertEqual(self.group.rounds, 3)

    def test_a_failed_member_leaves_and_the_others_go_on(self) -> None:
        """A row whose stage fails gets the failure and leaves the group: the other member's
        next round does not wait for it, and it joins again with its next step."""
        a, b = self.kept(1), self.kept(2)
        failed = self.group.submit(a, (1,), 0)
        going = self.group.submit(b, (2,), 0)
        self.clock.advance(0)
        self.links[0].answers[0].errback(PipelineError("lost"))
        self.links[0].answers[1].callback(_Answer(hidden=b"x"))
        self.links[1].answers[0].callback(_Answer(token=8))
        self.failureResultOf(failed, PipelineError)
        self.assertEqual(self.successResultOf(going), 8)
        self.assertEqual(self.group.members, {id(b)})
        self.group.submit(b, (8,), 1)
        self.clock.advance(0)
        self.assertEqual(len(self.links[0].sent), 3)
        self.group.submit(a, (1,), 0)
        self.clock.advance(0)
        self.assertEqual(len(self.links[0].sent), 3)  # a waits for b's round to end
        self.assertEqual(self.group.members, {id(a), id(b)})

    def test_a_member_that_ends_or_is_cancelled_is_not_waited_for(self) -> None:
        """A member that leaves (its generation ended) or whose step is cancelled (its wall
        budget passed) no longer holds the others' round back."""
        a, b = self.kept(1), self.kept(2)
        self.group.submit(a, (1,), 0)
        waiting = self.group.submit(b, (2,), 0)
        self.clock.advance(0)
        self.links[0].answers[0].callback(_Answer(hidden=b"x"))
        self.links[0].answers[1].callback(_Answer(hidden=b"y"))
        self.links[1].answers[0].callback(_Answer(token=1))
        self.links[1].answers[1].callback(_Answer(token=2))
        self.successResultOf(waiting)
        cancelled = self.group.submit(b, (2,), 1)
        self.clock.advance(0)
        self.assertEqual(len(self.links[0].sent), 2)
        cancelled.cancel()
        self.failureResultOf(cancelled, CancelledError)
        self.clock.advance(0)
        self.assertEqual(len(self.links[0].sent), 2)  # a has not asked yet
        self.group.leave(a)
        self.group.submit(b, (2,), 1)
        self.clock.advance(0)
        self.assertEqual(len(self.links[0].sent), 3)


class BatchedStepGroupTests(_StepGroupCase):
    """Step groups over nodes that set feature bit 8 (docs/protocol.md section 12.8, D28)."""

    link = _BatchLink

    def test_a_round_sends_one_batch_per_stage(self) -> None:
        """Two members' rows go to each stage as one STAGE_BATCH_REQ (the first stage's with
        their tokens, the next with the hidden states it answered, in the members' order),
        and each member gets the token of its own row."""
        a, b = self.kept(1), self.kept(2)
        first = self.group.submit(a, (5, 6), 0)
        second = self.group.submit(b, (7,), 3)
        self.clock.advance(0)
        (sent,) = self.links[0].sent
        self.assertEqual((sent.start_layer, sent.end_layer), (0, 2))
        self.assertEqual(
            sent.rows, (StageBatchRow(1, 0, (5, 6), None), StageBatchRow(2, 3, (7,), None))
        )
        self.links[0].answer(StageBatchAnswer(b"a" * 8, None), StageBatchAnswer(b"b" * 4, None))
        (on,) = self.links[1].sent
        self.assertEqual(
            on.rows, (StageBatchRow(1, 0, (), b"a" * 8), StageBatchRow(2, 3, (), b"b" * 4))
        )
        self.links[1].answer(StageBatchAnswer(None, 11), StageBatchAnswer(None, 12))
        self.assertEqual((self.successResultOf(first), self.successResultOf(second)), (11, 12))
        self.assertEqual(self.pipeline.forwarded, 12)

    def test_a_refused_row_or_a_short_answer_fails_its_rows(self) -> None:
        """A row answered nil fails alone with PipelineError (the other member gets its
        token); a batch answered with fewer answers than rows fails every row of it."""
        a, b = self.kept(1), self.kept(2)
        refused = self.group.submit(a, (5,), 0)
        going = self.group.submit(b, (7,), 0)
        self.clock.advance(0)
        self.links[0].answer(StageBatchAnswer(None, None), StageBatchAnswer(b"b" * 8, None))
        self.links[1].answer(StageBatchAnswer(None, 4))
        self.failureResultOf(refused, PipelineError)
        self.assertEqual(self.successResultOf(going), 4)
        short_a = self.group.submit(a, (5,), 0)
        short_b = self.group.submit(b, (4,), 1)
        self.clock.advance(0)
        self.links[0].answer(StageBatchAnswer(b"x" * 8, None))
        self.failureResultOf(short_a, PipelineError)
        self.failureResultOf(short_b, PipelineError)
        self.assertEqual(self.group.members, set())

    def test_members_on_different_links_of_a_stage_get_a_batch_each(self) -> None:
        """Members whose sessions are on different nodes for a stage (one rebuilt on a spare)
        get one STAGE_BATCH_REQ per link; a short answer on one link fails only its rows."""
        spare = _BatchLink("spare0")
        a = self.kept(1)
        b = _Kept(session=2, links=[spare, self.links[1]])  # type: ignore[list-item]
        first = self.group.submit(a, (5,), 0)
        second = self.group.submit(b, (7,), 0)
        self.clock.advance(0)
        self.assertEqual([m.rows for m in self.links[0].sent], [(StageBatchRow(1, 0, (5,), None),)])
        self.assertEqual([m.rows for m in spare.sent], [(StageBatchRow(2, 0, (7,), None),)])
        spare.answer()
        self.links[0].answer(StageBatchAnswer(b"a" * 8, None))
        self.links[1].answer(StageBatchAnswer(None, 11))
        self.assertEqual(self.successResultOf(first), 11)
        self.failureResultOf(second, PipelineError)
