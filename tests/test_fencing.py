"""Node-level fencing: a running stream whose head stops renewing emits nothing after the fence.

docs/protocol.md section 6.4: an expired, unfenced session fences itself; a fenced session emits
nothing, and its generations stop without a Finish.  The unit tests of the lease machine and the
session state pin the pieces; this test pins the whole node: a real NodeAgent and a scripted head
joined in memory (``twisted.test.iosim``), with a generation streaming when the lease runs out.

The node's time is a ``MemoryReactorClock`` that the test moves (the node, its machines, its mock
engine and the bytes between it and the head all run on it), so the fence happens at a known
instant.  Each clock step is followed by a barrier: a GENERATE_REQ for a session the node does
not hold, answered at once with FINISH_DECLINED; once the head has that answer, the node has
handled everything sent before it and everything the node wrote before it has arrived (one
connection, in order).
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer

from sfnode.linkf.wire import (
    FINISH_DECLINED,
    AppendContentMsg,
    Finish,
    GenerateReqMsg,
    GenerationBudgetsMsg,
    Lease,
    LeaseGrantMsg,
    LeaseRenewMsg,
    SessionAssignMsg,
    Tokens,
    encode_tokens,
)
from tests.nodefixture import PROMPT, MemoryNodeTestCase, RawHead, expected_tokens, finish_of

LEASE_MS = 1000
RENEW_BY_MS = 500
STEP_S = 0.01
"""Clock step: one mock token per step."""
UNKNOWN_SESSION = 999


class FencingTests(MemoryNodeTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.command = 0
        self.barriers = 0

    def next_command(self) -> int:
        self.command += 1
        return self.command

    def barrier(self, head: RawHead) -> defer.Deferred[Any]:
        """Fires once the node handled everything sent before and its answers arrived."""
        self.barriers += 1
        head.send(
            GenerateReqMsg(
                self.next_command(), UNKNOWN_SESSION, 1, self.barriers, GenerationBudgetsMsg(1)
            )
        )
        return head.wait_for(finish_of(UNKNOWN_SESSION, self.barriers, FINISH_DECLINED))

    def test_no_token_after_the_fence_of_a_running_stream(self) -> None:
        """A stream runs under a 1000 ms lease; the head grants the first renewal, then stops
        renewing.  The lease runs out 1000 ms after that grant, while tokens still flow: the
        session fences itself at that instant, every event the node emitted was emitted
        before it (none while fenced), the head receives no token and no Finish afterwards
        (the clock runs on for 2 s), the engine is idle, and the tokens received are the exact
        prefix of the uninterrupted run."""
        node = self.start_node(identity="fencing", token_delay_s=STEP_S)
        clock = self.reactor
        agent = node.agent
        emitted: list[tuple[float, bool, Any]] = []
        emit = agent.session.emit

        def recording_emit(session_id: int, generation_id: int, payload: Any) -> Any:
            fenced = bool(agent.session.is_fenced(session_id))
            batch = emit(session_id, generation_id, payload)
            if session_id == 1 and batch is not None:
                emitted.append((clock.seconds(), fenced, payload))
            return batch

        agent.session.emit = recording_emit  # type: ignore[method-assign]
        head = self.raw_head(node)
        self.wait(head.hello())
        head.send(
            SessionAssignMsg(self.next_command(), 1, 1, Lease(LEASE_MS, RENEW_BY_MS), "", b"", 0, 0)
        )
        head.send(AppendContentMsg(self.next_command(), 1, 1, encode_tokens(PROMPT)))
        head.send(GenerateReqMsg(self.next_command(), 1, 1, 1, GenerationBudgetsMsg(10**6)))
        self.wait(self.barrier(head))
        self.assertEqual(agent.running_generations, 1)

        def renewals() -> int:
            return sum(1 for m in head.received if isinstance(m, LeaseRenewMsg))

        granted_at: float | None = None
        while granted_at is None:
            clock.advance(STEP_S)
            self.wait(self.barrier(head))
            if renewals():
                head.send(LeaseGrantMsg(1, 1, LEASE_MS, RENEW_BY_MS))
                self.wait(self.barrier(head))
                granted_at = clock.seconds()
            self.assertLess(clock.seconds(), 1.0, "no LEASE_RENEW within the first lease")
        fence_at = granted_at + LEASE_MS / 1000.0
        while not agent.session.is_fenced(1):
            self.assertLess(clock.seconds(), fence_at + 0.5, "the session outlived its lease")
            clock.advance(STEP_S)
            self.wait(self.barrier(head))
        fenced_at = clock.seconds()
        # The lease runs out 1000 ms after the grant (the node's timer adds 1 ms for its
        # whole-millisecond lease clock): within the clock step that reaches that moment.
        self.assertGreaterEqual(fenced_at, fence_at - 1e-6)
        self.assertLessEqual(fenced_at, fence_at + STEP_S + 0.002)
        self.assertGreater(renewals(), 1)  # the node asked again and got no grant
        received_at_fence = len(head.received)
        while clock.seconds() < fenced_at + 2.0:
            clock.advance(STEP_S)
            self.wait(self.barrier(head))

        # Emissions: all before the fence, none while fenced, and the stream ran to the end.
        self.assertEqual([e for e in emitted if e[1]], [])
        self.assertTrue(all(at <= fenced_at for at, _, _ in emitted))
        last_tokens_at = max(at for at, _, p in emitted if isinstance(p, Tokens))
        self.assertGreater(last_tokens_at, fence_at - 0.25)
        # On the wire: nothing but barrier answers, renewals and status after the fence.
        events = head.events(1, 1)
        after = head.received[received_at_fence:]
        self.assertEqual([m for m in after if getattr(m, "events", None) and
                          any(e.session_id == 1 for e in m.events)], [])  # fmt: skip
        self.assertFalse(any(isinstance(e.payload, Finish) for e in events))
        tokens = [t for e in events for t in e.payload.tokens]
        self.assertEqual(tokens, [t for _, _, p in emitted for t in p.tokens])
        self.assertGreater(len(tokens), int(fence_at / STEP_S) // 2)
        self.assertEqual(tokens, expected_tokens(PROMPT, len(tokens)))
        self.assertEqual(agent.running_generations, 0)
        self.assertEqual(node.engine.statistics().lanes_active, 0)
