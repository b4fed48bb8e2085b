"""Real ``twistd`` child processes for tests: spawn one, wait for what it logs, kill it.

Every process test starts ``twistd`` the way an operator does (``twistd --pidfile= -n ...``),
through this module, so that no child outlives its test and the environment is the same.
Processes that the tests of a class share (:class:`SharedProcess`, stopped after the last of
them by :func:`stop_after_the_class`) outlive one test but never the test process.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest
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


HEAD_SERVING = rb"sfhead serving HTTP on 127\.0\.0\.1:(\d+)\n"
"""What a head serving HTTP on loopback (``--http`` :data:`LOOPBACK`) logs, with its port."""


def spawner(test: TestCase) -> Callable[[str, list[str]], Child]:
    """``spawn(name, args)``: :func:`spawn_twistd` for ``test``, with a :class:`Child` named
    ``name``."""
    return lambda name, args: spawn_twistd(test, Child(name), args)


@defer.inlineCallbacks
def loopback_head(
    spawn: Callable[[str, list[str]], Child], *head_args: str, nodes: Sequence[str] = ()
) -> Generator[Any, Any, tuple[Child, str]]:
    """A ``twistd sfhead`` serving HTTP and accepting nodes on loopback (``head_args`` added)
    that dials each endpoint of ``nodes``, started by ``spawn("head", args)``; fires with it
    and its base URL once it serves HTTP (its nodes may not have joined yet)."""
    dials = [arg for endpoint in nodes for arg in ("--node", endpoint)]
    head = spawn("head", ["sfhead", "--http", LOOPBACK, "--fleet-listen", LOOPBACK,
                          *head_args, *dials])  # fmt: skip
    found = yield head.wait_for(HEAD_SERVING)
    return head, f"http://127.0.0.1:{int(found[0].group(1))}"


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
    head, base = yield loopback_head(spawn, "--model-name", "mock", nodes=[endpoint])
    yield head.wait_for(b"node " + identity.encode() + b" joined")
    return node, head, base


class SharedProcess:
    """A process that several tests share: started with :mod:`subprocess` in a session of its
    own and read by a thread, not by the reactor (trial wants the reactor's selectables gone
    after every test); :meth:`stop` signals its whole group and waits, and the test process
    stops it when it exits if no test did."""

    def __init__(self, name: str, stop_signal: int = signal.SIGKILL) -> None:
        self.name = name
        self.stop_signal = stop_signal
        self.child: subprocess.Popen[bytes] | None = None
        self.output = bytearray()
        self._changed = threading.Condition()
        self._ended = False

    def start(self, args: list[str], cwd: Path) -> None:
        """Run ``args`` in ``cwd`` with :func:`child_env` (stopping the process this one ran
        before, if any), its output read from now on."""
        self.stop()
        self.output.clear()
        self._ended = False
        self.child = subprocess.Popen(
            args,
            env=child_env(),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        atexit.register(self.stop)
        threading.Thread(target=self._read, args=(self.child,), daemon=True).start()

    def start_twistd(self, args: list[str], cwd: Path) -> None:
        """``twistd --pidfile= -n ARGS`` in ``cwd``, as :func:`start_twistd` runs it."""
        self.start([sys.executable, "-c", TWISTD, "--pidfile=", "-n", *args], cwd)

    def _read(self, child: subprocess.Popen[bytes]) -> None:
        assert child.stdout is not None
        for line in iter(child.stdout.readline, b""):
            with self._changed:
                self.output += line
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, pattern: bytes, timeout: float) -> re.Match[bytes]:
        """The first match of ``pattern`` in the output, once it is there; blocks (a test
        thread's call, or through ``deferToThread``) for at most ``timeout`` seconds, and
        raises with the output if the process ended or the time ran out first."""
        compiled = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while (found := compiled.search(self.output)) is None:
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    why = "exited" if self._ended else f"did not log {pattern!r} in {timeout:g} s"
                    raise RuntimeError(
                        f"{self.name} {why}:\n{self.output.decode(errors='replace')}"
                    )
                self._changed.wait(left)
        return found

    def stop(self) -> None:
        """Signal the process's group with ``stop_signal`` and wait for the process (SIGKILL
        after a minute)."""
        child, self.child = self.child, None
        if child is None or child.poll() is not None:
            return
        os.killpg(child.pid, self.stop_signal)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


_still_to_run: dict[type, set[str]] = {}


def stop_after_the_class(test: unittest.TestCase, stop: Callable[[], None]) -> None:
    """Call ``stop`` when the last test of ``test``'s class has run, from that test's cleanup:
    what the class's tests share lives as long as they run.  A run of only some of them
    leaves ``stop`` to the test process's exit (a :class:`SharedProcess` stops itself)."""
    cls = type(test)
    if cls not in _still_to_run:
        _still_to_run[cls] = set(unittest.TestLoader().getTestCaseNames(cls))
    remaining = _still_to_run[cls]

    def after() -> None:
        remaining.discard(test._testMethodName)
        if not remaining:
            stop()

    test.addCleanup(after)
