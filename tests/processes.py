"""Real ``twistd`` child processes for tests: spawn one, wait for what it logs, kill it.

Every process test starts ``twistd`` the way an operator does (``twistd --pidfile= -n ...``),
through this module, so that no child outlives its test and the environment is the same.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.protocol import ProcessProtocol
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

LOOPBACK = "tcp:0:interface=127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parent.parent
TWISTD = "import sys; sys.argv[0] = 'twistd'; from twisted.scripts.twistd import run; run()"
"""``twistd`` itself, without relying on a console script's path."""


def child_env() -> dict[str, str]:
    """The environment of a child: this checkout first on PYTHONPATH (for the plugins)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


class Child(ProcessProtocol):
    """A child process whose output is searched for lines; ``ended`` fires when it exits."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.output = bytearray()
        self.ended: defer.Deferred[None] = defer.Deferred()
        self._waits: list[tuple[re.Pattern[bytes], int, defer.Deferred[list[re.Match[bytes]]]]] = []
        self.transport: Any = None

    def wait_for(self, pattern: bytes, count: int = 1) -> defer.Deferred[list[re.Match[bytes]]]:
        """Fires with the first ``count`` matches of ``pattern`` in the output."""
        d: defer.Deferred[list[re.Match[bytes]]] = defer.Deferred()
        self._waits.append((re.compile(pattern), count, d))
        self._check()
        return d

    def childDataReceived(self, childFD: int, data: bytes) -> None:  # noqa: N803
        self.output += data
        self._check()

    def _check(self) -> None:
        for wait in list(self._waits):
            pattern, count, d = wait
            found = list(pattern.finditer(self.output))
            if len(found) >= count:
                self._waits.remove(wait)
                d.callback(found[:count])

    def processEnded(self, reason: Failure) -> None:
        for _, _, d in self._waits:
            d.errback(RuntimeError(f"{self.name} ended:\n{self.output.decode(errors='replace')}"))
        self._waits.clear()
        self.ended.callback(None)

    def kill(self) -> defer.Deferred[None]:
        try:
            self.transport.signalProcess("KILL")
        except ProcessExitedAlready:
            pass
        return self.ended


NODE_LISTENING = rb"sfnode listening on 127\.0\.0\.1:(\d+)\n"
"""What a node listening on loopback (``--listen`` :data:`LOOPBACK`) logs, with its port."""


@defer.inlineCallbacks
def node_endpoint(node: Child) -> Generator[Any, Any, str]:
    """The client endpoint of ``node``'s Link F port, once it logs :data:`NODE_LISTENING`."""
    found = yield node.wait_for(NODE_LISTENING)
    return f"tcp:127.0.0.1:{int(found[0].group(1))}"


@defer.inlineCallbacks
def spawn_nodes(
    test: TestCase, nodes: Sequence[tuple[str, list[str]]]
) -> Generator[Any, Any, list[tuple[Child, str]]]:
    """Start every ``(name, args)`` node process at once (each ``twistd sfnode`` spends its
    first seconds importing, and the start-ups overlap), then wait for each to listen; fires
    with the children and their endpoints, in the order given."""
    children = [spawn_twistd(test, Child(name), args) for name, args in nodes]
    endpoints = yield defer.gatherResults([node_endpoint(child) for child in children])
    return list(zip(children, endpoints, strict=True))


def spawn_twistd(test: TestCase, child: Child, args: list[str]) -> Child:
    """Start ``twistd --pidfile= -n ARGS`` in a fresh folder; the test's cleanup kills it."""
    folder = Path(test.mktemp())
    folder.mkdir(parents=True)
    start_twistd(child, args, folder)
    test.addCleanup(child.kill)
    return child


def start_twistd(child: Child, args: list[str], folder: Path) -> None:
    """Start ``twistd --pidfile= -n ARGS`` in ``folder``, its output read by ``child``."""
    child.transport = reactor.spawnProcess(
        child,
        sys.executable,
        [sys.executable, "-c", TWISTD, "--pidfile=", "-n", *args],
        env=child_env(),
        path=str(folder),
    )


@defer.inlineCallbacks
def mock_node_and_head(
    spawn: Callable[[str, list[str]], Child], identity: str, *node_args: str
) -> Generator[Any, Any, tuple[Child, Child, str]]:
    """A ``twistd sfnode --engine mock`` listening on loopback (``node_args`` added) and a
    ``twistd sfhead`` serving model "mock" that dialed it, each started by ``spawn(name, args)``;
    fires with both and the head's base URL once the node has joined."""
    node = spawn("node", ["sfnode", "--listen", LOOPBACK, "--engine", "mock",
                          "--identity", identity, *node_args])  # fmt: skip
    endpoint = yield node_endpoint(node)
    head = spawn(
        "head",
        ["sfhead", "--http", LOOPBACK, "--fleet-listen", LOOPBACK, "--model-name", "mock",
         "--node", endpoint],
    )  # fmt: skip
    found = yield head.wait_for(rb"sfhead serving HTTP on 127\.0\.0\.1:(\d+)\n")
    yield head.wait_for(b"node " + identity.encode() + b" joined")
    return node, head, f"http://127.0.0.1:{int(found[0].group(1))}"
