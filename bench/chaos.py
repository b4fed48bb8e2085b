"""A soak of the fleet under faults: real processes, one node killed at a time, one hung.

Starts ``--nodes`` ``twistd sfnode --engine mock --token-delay-ms 10`` processes and one
``twistd sfhead`` (the head dials the nodes, or the nodes dial the head, or both in turn), takes
the reference answer of each prompt from the quiet fleet, then streams ``--requests``
completions of ``--tokens`` tokens, ``--concurrency`` at a time, while every 0.8 to 1.6 s one
node is SIGKILLed and restarted on its port (only while all are up: at most one is down at a
time) and one node is SIGSTOPped for ``--hang`` seconds once.  Printed per direction: streams
that equal their reference out of all, answers that failed (503 or an error in the stream),
the head's failovers and reconnects, kills, and the longest stall (the longest time any stream
went without a byte, from its request on).  Then the head of a dial-in fleet is killed and
started again ``--head-restart`` seconds later: printed are the delays after which each node
joined it again and when the first request (sent as soon as it served HTTP) was answered.

    PYTHONPATH=. python bench/chaos.py                        # both directions, 400 streams
    PYTHONPATH=. python bench/chaos.py --direction dial --requests 100 --nodes 4

The harness is ``tests/chaos.py`` (shared with ``tests/test_chaos.py``).  This script only
measures and prints; it must never assert or be imported by the package.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

from twisted.internet import defer, task

from tests.chaos import DIAL, DIAL_IN, ChaosConfig, run_chaos, run_head_restart


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench/chaos.py", description=__doc__.split("\n")[0])
    parser.add_argument("--direction", choices=(DIAL, DIAL_IN, "both"), default="both")
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--token-delay-ms", type=int, default=10)
    parser.add_argument("--hang", type=float, default=4.0, help="SIGSTOP seconds (0: none)")
    parser.add_argument("--keepalive-timeout", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--resume-every",
        type=int,
        default=4,
        help="every this many streams, the client drops after 3 events and resumes with "
        "Last-Event-ID (0: never)",
    )
    parser.add_argument(
        "--head-restart",
        type=float,
        default=5.0,
        help="then kill the head of a dial-in fleet, start it again after this many seconds, "
        "and time the nodes' return (0: skip)",
    )
    options = parser.parse_args(argv)
    directions = [DIAL, DIAL_IN] if options.direction == "both" else [options.direction]

    @defer.inlineCallbacks
    def soak(reactor: Any) -> Generator[Any, Any, None]:
        for direction in directions:
            with tempfile.TemporaryDirectory(prefix="sfnode-chaos-") as folder:
                config = ChaosConfig(
                    folder=Path(folder),
                    direction=direction,
                    nodes=options.nodes,
                    requests=options.requests,
                    concurrency=options.concurrency,
                    tokens=options.tokens,
                    token_delay_ms=options.token_delay_ms,
                    hang_s=options.hang,
                    hang_after_s=5.0,
                    keepalive_timeout_s=options.keepalive_timeout,
                    seed=options.seed,
                    resume_every=options.resume_every,
                )
                report = yield run_chaos(config)
            print(report.summary(), flush=True)
            print(
                f"  queue: {report.queue_timeouts} timed out, {report.queue_rejected} refused "
                "as full",
                flush=True,
            )
            for result in [r for r in report.results if not r.exact][:5]:
                print(f"  not exact: {result}", flush=True)
        if options.head_restart > 0:
            with tempfile.TemporaryDirectory(prefix="sfnode-chaos-") as folder:
                config = ChaosConfig(
                    folder=Path(folder),
                    nodes=options.nodes,
                    tokens=options.tokens,
                    prompts=1,
                    token_delay_ms=options.token_delay_ms,
                )
                restart = yield run_head_restart(config, down_s=options.head_restart)
            print(restart.summary(), flush=True)

    task.react(soak)


if __name__ == "__main__":
    main(sys.argv[1:])
