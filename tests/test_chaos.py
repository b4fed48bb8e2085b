"""The fleet under faults with real processes (tests/chaos.py): both dial directions.

Three ``twistd sfnode --engine mock`` nodes and one ``twistd sfhead``; streamed completions run
while nodes are SIGKILLed and restarted on their port one at a time and one node is SIGSTOPped
for longer than the head's keepalive window (a 1 s status interval, so the keepalive and the
stop are short), then continued.  Every stream must equal the
uninterrupted run of its prompt, none may fail, and the head must have failed over.  The long
soak of the same harness is ``bench/chaos.py``.  Nodes that dial a head that was killed dial
its successor by themselves, and its first request is served.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

from twisted.internet import defer
from twisted.trial.unittest import TestCase

from tests.chaos import (
    DIAL,
    DIAL_IN,
    ChaosConfig,
    ChaosReport,
    RestartReport,
    run_chaos,
    run_head_restart,
)


class ChaosTests(TestCase):
    timeout = 240

    @defer.inlineCallbacks
    def chaos(self, direction: str) -> Generator[Any, Any, ChaosReport]:
        config = ChaosConfig(
            folder=Path(self.mktemp()),
            direction=direction,
            requests=48,
            concurrency=8,
            tokens=48,
            prompts=8,
            kill_every_s=(0.4, 0.8),
            min_kills=2,
            hang_s=2.5,
            hang_after_s=0.3,
            keepalive_timeout_s=1.75,
            status_interval_ms=1_000,
            resume_every=4,
        )
        report: ChaosReport = yield run_chaos(config)
        wrong = [r for r in report.results if not r.exact][:3]
        self.assertEqual((report.exact, report.unavailable), (report.total, 0), (report, wrong))
        self.assertGreaterEqual(report.resumes, 10, report.summary())
        self.assertGreaterEqual(report.kills, 2)
        self.assertEqual(report.hangs, 1)
        self.assertGreaterEqual(report.failovers, 1, report.summary())
        self.assertNotIn(b"Traceback", report.head_log)
        return report

    def test_nodes_the_head_dials(self) -> defer.Deferred[ChaosReport]:
        """The head dials the nodes (--node): kills, restarts and a SIGSTOP cost no stream,
        and neither do clients that drop a stream every fourth time and resume it."""
        return self.chaos(DIAL)

    def test_nodes_that_dial_the_head(self) -> defer.Deferred[ChaosReport]:
        """The nodes dial the head (--head): kills, restarts and a SIGSTOP cost no stream,
        and neither do clients that drop a stream every fourth time and resume it."""
        return self.chaos(DIAL_IN)

    @defer.inlineCallbacks
    def test_nodes_rejoin_a_restarted_head_and_its_first_request_is_served(
        self,
    ) -> Generator[Any, Any, None]:
        """The head is SIGKILLed and started again after 3 s on its ports: every node that
        dials it joins the new head by itself, and a request sent as soon as the new head
        serves HTTP waits for them and is answered exactly."""
        config = ChaosConfig(folder=Path(self.mktemp()), nodes=2, tokens=16, prompts=1)
        report: RestartReport = yield run_head_restart(config, down_s=3.0)
        self.assertTrue(report.first_exact, report.summary())
        self.assertEqual(len(report.rejoined_s), 2)
        self.assertNotIn(b"Traceback", report.head_log)
