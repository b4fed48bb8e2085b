"""Tests of the node's drain on SIGTERM (issue 5, point 6), in process and in a real twistd.

They pin that a draining node declines every new GENERATE_REQ with FINISH_DECLINED at once,
lets running generations finish until the drain timeout, cancels the rest with a CANCELLED
Finish that still reaches the head, waits for the head's acknowledgements, and only then closes
its connections and exits.
"""

from __future__ import annotations

import re
import sys

from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase

from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.link import HeadIds, NodeLink, connect_node
from sfnode.linkf.wire import FINISH_CANCELLED, FINISH_DECLINED, FINISH_LENGTH
from tests.nodefixture import PROMPT, MemoryNodeTestCase, expected_tokens
from tests.test_tap import TWISTD, TwistdProcess, child_env

STEP_S = 0.01
"""One clock step: one mock token."""


class AgentDrainTests(MemoryNodeTestCase):
    """NodeAgent.drain in process, the head link joined to the node in memory.

    The node, its machines, its mock engine and the head link run on a ``MemoryReactorClock``
    that the test moves, so the drain window is exact however loaded the machine is.  After
    each clock step a barrier (a STAGE_FORWARD, which the mock answers at once) makes sure the
    node handled everything sent before it and that its answers arrived (one connection, in
    order).
    """

    def step(self, link: NodeLink, seconds: float = STEP_S) -> None:
        self.reactor.advance(seconds)
        self.wait(link.stage_forward([1], 0, 1))

    def test_drain_declines_finishes_and_cancels(self) -> None:
        """During a drain a new GENERATE is DECLINED, a generation that ends inside the 600 ms
        drain window ends with LENGTH, and one that outlives it ends with CANCELLED exactly when
        the window closes; the drain fires once the head acknowledged those final events
        (before the ack wait could end it), with the link still open."""
        node = self.start_node(identity="drain", token_delay_s=STEP_S, drain_timeout_ms=600)
        clock = self.reactor
        link = self.dial(node)
        for session in (1, 2, 3):
            link.assign(session)
            link.append(session, PROMPT)
        short = link.generate(1, HeadRequest((), 20))
        long = link.generate(2, HeadRequest((), 1_000_000))
        self.step(link)
        drained = node.agent.drain()
        drain_started = clock.seconds()
        late = self.wait(link.generate(3, HeadRequest((), 5)).result)
        self.assertEqual((late.tokens, late.finish), ([], FINISH_DECLINED))
        while not long.result.called:
            self.assertLess(clock.seconds(), drain_started + 1.0, "the drain window never closed")
            self.step(link)
        done = self.wait(short.result)
        self.assertEqual((done.tokens, done.finish), (expected_tokens(PROMPT, 20), FINISH_LENGTH))
        cancelled = self.wait(long.result)
        self.assertEqual(cancelled.finish, FINISH_CANCELLED)
        self.assertEqual(cancelled.tokens, expected_tokens(PROMPT, len(cancelled.tokens)))
        # 600 ms of 10 ms tokens: cancelled when the window closed, not before.
        self.assertGreaterEqual(clock.seconds() - drain_started, 0.6 - 1e-6)
        self.assertGreaterEqual(len(cancelled.tokens), 55)
        # The acknowledgements end the drain; the clock stands still, so the ack wait cannot.
        for _ in range(100):
            if drained.called:
                break
            self.wait(link.stage_forward([1], 0, 1))
        self.assertTrue(drained.called, "the drain did not end on the head's acknowledgements")
        self.assertTrue(link.connected)
        self.assertEqual(node.agent.running_generations, 0)


class DrainingTwistd(TwistdProcess):
    """A twistd child whose output can be waited on."""

    def __init__(self) -> None:
        super().__init__()
        self._waiting: list[tuple[re.Pattern[bytes], defer.Deferred[None]]] = []

    def wait_output(self, pattern: bytes) -> defer.Deferred[None]:
        d: defer.Deferred[None] = defer.Deferred()
        self._waiting.append((re.compile(pattern), d))
        self._check()
        return d

    def childDataReceived(self, childFD: int, data: bytes) -> None:  # noqa: N803
        super().childDataReceived(childFD, data)
        self._check()

    def _check(self) -> None:
        for waiting in list(self._waiting):
            if waiting[0].search(self.output):
                self._waiting.remove(waiting)
                waiting[1].callback(None)


class ProcessDrainTests(TestCase):
    """Point 6 with a real ``twistd sfnode`` process and SIGTERM."""

    async def test_sigterm_drains_a_running_generation(self) -> None:
        """SIGTERM on a node with a running generation (mock engine, 10 ms per token,
        --drain-timeout 1): a new GENERATE is DECLINED, the running one is cancelled after the
        drain timeout and its CANCELLED Finish reaches the head, then the process exits 0
        with no traceback."""
        process = DrainingTwistd()
        args = [
            sys.executable, "-c", TWISTD, "--pidfile=", "-n", "sfnode",
            "--listen", "tcp:0:interface=127.0.0.1", "--engine", "mock",
            "--token-delay-ms", "10", "--drain-timeout", "1",
        ]  # fmt: skip
        transport = reactor.spawnProcess(
            process, sys.executable, args, env=child_env(), path=self.mktemp_dir()
        )

        self.addCleanup(process.kill)
        port = await process.listening
        link = await connect_node(reactor, f"tcp:127.0.0.1:{port}", ids=HeadIds())
        self.addCleanup(link.close)
        for session in (1, 2):
            link.assign(session)
            link.append(session, PROMPT)
        first: defer.Deferred[None] = defer.Deferred()
        running = link.generate(
            1,
            HeadRequest((), 1_000_000),
            on_tokens=lambda _: None if first.called else first.callback(None),
        )
        await first
        transport.signalProcess("TERM")
        await process.wait_output(rb"draining: declining new generations")
        late = await link.generate(2, HeadRequest((), 5)).result
        self.assertEqual((late.tokens, late.finish), ([], FINISH_DECLINED))
        outcome = await running.result
        self.assertEqual(outcome.finish, FINISH_CANCELLED)
        self.assertGreater(len(outcome.tokens), 0)
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, len(outcome.tokens)))
        output = await process.stopped(self)
        self.assertIn("drain timeout: cancelling 1 generations", output)
        self.assertIn("drained: 0 events left unacknowledged", output)

    def mktemp_dir(self) -> str:
        from pathlib import Path

        path = Path(self.mktemp()).resolve()
        path.mkdir(parents=True)
        return str(path)
