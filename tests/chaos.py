"""A fleet under faults, with real processes: the harness of ``tests/test_chaos.py`` (a few
seconds) and ``bench/chaos.py`` (the long soak).

It starts ``twistd sfnode --engine mock`` nodes and one ``twistd sfhead``, in either direction:
the head dials the nodes (``--node``) or the nodes dial the head (``--head``).  It first asks
the fleet, whole and quiet, for the reference answer of each prompt; then it streams completions
at a fixed concurrency while a chaos driver SIGKILLs one node at a time and restarts it on the
same port (only while every node is up, so all but one are up at every moment), and SIGSTOPs one
node once for a while (then SIGCONT).  Every streamed text is compared with its reference.

This module measures and reports; it must never decide a test's outcome (the tests assert on
the :class:`ChaosReport` it returns) and never leave a process behind (:meth:`Fleet.stop`).
"""

from __future__ import annotations

import json
import random
import re
import signal
import socket
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor, task
from twisted.internet.error import ProcessExitedAlready
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool, readBody
from twisted.web.http_headers import Headers

from tests.processes import Child, start_twistd

DIAL = "dial"
"""The head dials every node (``sfhead --node``)."""
DIAL_IN = "dial-in"
"""Every node dials the head (``sfnode --head``)."""


@dataclass
class ChaosConfig:
    """What to run, and how rough to be."""

    folder: Path
    direction: str = DIAL
    nodes: int = 3
    requests: int = 400
    concurrency: int = 16
    tokens: int = 96
    prompts: int = 16
    """Distinct prompts (each with its own reference answer), used in turn."""
    token_delay_ms: int = 10
    kill_every_s: tuple[float, float] = (0.8, 1.6)
    min_kills: int = 0
    """Keep streaming until at least this many kills happened (the tests want some)."""
    hang_s: float = 3.0
    """One node is SIGSTOPped this long, once (0: never)."""
    hang_after_s: float = 2.0
    keepalive_timeout_s: float = 3.0
    """The head's --keepalive-timeout: above the nodes' status interval."""
    status_interval_ms: int = 2_000
    """The nodes' --status-interval-ms."""
    seed: int = 1
    resume_every: int = 0
    """Every this many streams, the client drops its connection after its third event and
    resumes the stream with ``Last-Event-ID`` (docs/api.md "Streams that resume"; 0: never)."""


@dataclass
class StreamResult:
    """One streamed completion."""

    prompt: int
    status: int = 0
    text: str = ""
    finish: str | None = None
    error: str = ""
    longest_gap_s: float = 0.0
    """The longest time without a byte, from the request on."""
    exact: bool = False
    resumed: bool = False
    """Its client dropped mid-stream and resumed it."""


@dataclass
class ChaosReport:
    """What happened."""

    direction: str
    results: list[StreamResult] = field(default_factory=list)
    kills: int = 0
    hangs: int = 0
    failovers: int = 0
    reconnects: int = 0
    queue_timeouts: int = 0
    queue_rejected: int = 0
    elapsed_s: float = 0.0
    head_log: bytes = b""

    @property
    def total(self) -> int:
        return len(self.results)

    @property
    def exact(self) -> int:
        return sum(1 for r in self.results if r.exact)

    @property
    def resumes(self) -> int:
        return sum(1 for r in self.results if r.resumed)

    @property
    def unavailable(self) -> int:
        """Answers 503 (or an error event inside a stream)."""
        return sum(1 for r in self.results if r.status == 503 or r.error)

    @property
    def longest_stall_s(self) -> float:
        return max((r.longest_gap_s for r in self.results), default=0.0)

    def summary(self) -> str:
        return (
            f"{self.direction}: {self.exact}/{self.total} streams exact "
            f"({self.resumes} resumed), "
            f"{self.unavailable} unavailable, {self.failovers} failovers, "
            f"{self.reconnects} reconnects, {self.kills} kills, {self.hangs} SIGSTOP, "
            f"longest stall {self.longest_stall_s:.2f} s, {self.elapsed_s:.1f} s"
        )


def free_port() -> int:
    """A TCP port nobody listens on now (so that a node can be restarted on it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class _Body(Protocol):
    """Collects a streamed body and the longest gap between its bytes; with ``cut_after``,
    drops the connection once that many whole events came (what follows them is left out)."""

    def __init__(self, started: float, cut_after: int = 0) -> None:
        self.data = b""
        self.last = started
        self.longest = 0.0
        self.cut_after = cut_after
        self.cut = False
        self.done: defer.Deferred[bytes] = defer.Deferred()

    def dataReceived(self, data: bytes) -> None:
        now = time.monotonic()
        self.longest = max(self.longest, now - self.last)
        self.last = now
        if self.cut:
            return
        self.data += data
        events = self.data.split(b"\n\n")
        if self.cut_after and len(events) > self.cut_after:
            self.data = b"".join(event + b"\n\n" for event in events[: self.cut_after])
            self.cut = True
            self.transport.stopProducing()  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        now = time.monotonic()
        self.longest = max(self.longest, now - self.last)
        self.done.callback(self.data)


class Fleet:
    """The processes of one fleet, restarted and stopped on demand."""

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.head_port = free_port()
        self.fleet_port = free_port()
        self.node_ports = [free_port() for _ in range(config.nodes)]
        self.nodes: list[Child | None] = [None] * config.nodes
        self.up = [False] * config.nodes
        self.head: Child | None = None
        self.children: list[Child] = []
        self._spawned = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.head_port}"

    def _spawn(self, name: str, args: list[str]) -> Child:
        self._spawned += 1
        folder = self.config.folder / f"{self._spawned:03d}-{name}"
        folder.mkdir(parents=True, exist_ok=True)
        child = Child(name)
        start_twistd(child, args, folder)
        self.children.append(child)
        return child

    def start_head(self) -> Child:
        args = [
            "sfhead",
            "--http", f"tcp:{self.head_port}:interface=127.0.0.1",
            "--fleet-listen", f"tcp:{self.fleet_port}:interface=127.0.0.1",
            "--model-name", "mock",
            "--keepalive-timeout", f"{self.config.keepalive_timeout_s:g}",
        ]  # fmt: skip
        if self.config.direction == DIAL:
            for port in self.node_ports:
                args += ["--node", f"tcp:127.0.0.1:{port}"]
        self.head = self._spawn("head", args)
        return self.head

    def start_node(self, index: int) -> defer.Deferred[Any]:
        """Start node ``index`` on its port; fires once it listens (or reached the head)."""
        if self.config.direction == DIAL:
            where = ["--listen", f"tcp:{self.node_ports[index]}:interface=127.0.0.1"]
            ready = rb"sfnode listening on"
        else:
            where = ["--head", f"tcp:127.0.0.1:{self.fleet_port}"]
            ready = rb"handshake with .* done"
        node = self._spawn(
            f"node{index}",
            ["sfnode", *where, "--engine", "mock", "--identity", f"chaos{index}",
             "--token-delay-ms", str(self.config.token_delay_ms),
             "--status-interval-ms", str(self.config.status_interval_ms)],
        )  # fmt: skip
        self.nodes[index] = node

        def up(_: Any) -> None:
            if self.nodes[index] is node:
                self.up[index] = True

        return node.wait_for(ready).addCallback(up)

    @defer.inlineCallbacks
    def start(self) -> Generator[Any, Any, None]:
        """Every node and the head, then wait until the head has every node."""
        head = self.start_head()
        yield defer.gatherResults([self.start_node(i) for i in range(self.config.nodes)])
        yield head.wait_for(rb"sfhead serving HTTP on")
        yield head.wait_for(rb"node chaos\d joined", self.config.nodes)

    def kill(self, index: int) -> defer.Deferred[None]:
        node = self.nodes[index]
        self.up[index] = False
        assert node is not None
        return node.kill()

    def signal(self, index: int, number: int) -> None:
        node = self.nodes[index]
        assert node is not None
        node.transport.signalProcess(number)

    @defer.inlineCallbacks
    def stop(self) -> Generator[Any, Any, None]:
        """Kill every process this fleet started (a stopped one is continued first)."""
        for child in self.children:
            try:
                child.transport.signalProcess(signal.SIGCONT)
            except ProcessExitedAlready:
                pass
        yield defer.gatherResults([child.kill() for child in self.children])


class Load:
    """Streamed completions against the head, compared with the references."""

    def __init__(self, fleet: Fleet, config: ChaosConfig) -> None:
        self.fleet = fleet
        self.config = config
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.agent = Agent(reactor, pool=self.pool)
        self.references: list[str] = []

    def body(self, prompt: int, stream: bool) -> bytes:
        # Prompts as token ids: the mock's tokens are a pure function of them.
        ids = [100 + prompt, *range(200, 212)]
        request = {"model": "mock", "prompt": ids, "max_tokens": self.config.tokens}
        return json.dumps({**request, "temperature": 0, "stream": stream}).encode()

    def post(self, body: bytes, last_event: bytes | None = None) -> defer.Deferred[Any]:
        headers = Headers({b"content-type": [b"application/json"]})
        if last_event is not None:
            headers.addRawHeader(b"last-event-id", last_event)
        return self.agent.request(
            b"POST",
            (self.fleet.base + "/v1/completions").encode(),
            headers,
            FileBodyProducer(BytesIO(body)),
        )

    @defer.inlineCallbacks
    def read(
        self, body: bytes, result: StreamResult, cut_after: int = 0, last: bytes | None = None
    ) -> Generator[Any, Any, _Body]:
        """POST ``body`` (resuming after ``last``) and read its stream, dropping it after
        ``cut_after`` events when asked."""
        started = time.monotonic()
        response = yield self.post(body, last)
        result.status = response.code
        reader = _Body(started, cut_after)
        response.deliverBody(reader)
        yield reader.done
        result.longest_gap_s = max(result.longest_gap_s, reader.longest)
        return reader

    @defer.inlineCallbacks
    def reference(self) -> Generator[Any, Any, None]:
        """The answer of every prompt from the whole, quiet fleet."""

        @defer.inlineCallbacks
        def one(prompt: int) -> Generator[Any, Any, str]:
            response = yield self.post(self.body(prompt, stream=False))
            answer = json.loads((yield readBody(response)))
            if response.code != 200:
                raise RuntimeError(f"the reference request failed: {answer}")
            return str(answer["choices"][0]["text"])

        self.references = yield defer.gatherResults(
            [one(prompt) for prompt in range(self.config.prompts)]
        )

    @defer.inlineCallbacks
    def stream(self, index: int) -> Generator[Any, Any, StreamResult]:
        prompt = index % self.config.prompts
        result = StreamResult(prompt)
        every = self.config.resume_every
        try:
            body = self.body(prompt, stream=True)
            cut_after = 3 if every and index % every == 0 else 0
            reader = yield self.read(body, result, cut_after)
            data = reader.data
            if reader.cut:
                # Dropped after its third event: resume after the last one it got.
                last = data.split(b"\n\n")[-2].split(b"\n")[0].removeprefix(b"id: ")
                result.resumed = True
                data += (yield self.read(body, result, last=last)).data
        except Exception as e:
            result.error = f"{type(e).__name__}: {e}"
            return result
        texts = []
        for block in data.split(b"\n\n"):
            block = block.rpartition(b"\n")[2]  # the data line, after the event's id
            if not block.startswith(b"data: {"):
                continue
            event = json.loads(block[len(b"data: ") :])
            if "error" in event:
                result.error = event["error"].get("message", "error")
                continue
            choice = event["choices"][0]
            texts.append(choice["text"])
            result.finish = choice["finish_reason"] or result.finish
        result.text = "".join(texts)
        if result.status != 200 and not result.error:
            result.error = data.decode(errors="replace")[:200]
        result.exact = (
            result.status == 200
            and not result.error
            and data.rstrip().endswith(b"data: [DONE]")
            and result.text == self.references[prompt]
        )
        return result


@defer.inlineCallbacks
def chaos_driver(
    fleet: Fleet, config: ChaosConfig, report: ChaosReport, running: list[bool]
) -> Generator[Any, Any, None]:
    """While ``running[0]``: now and then kill one node and restart it (only while every node
    is up); once, SIGSTOP one node for ``hang_s`` then SIGCONT it."""
    rng = random.Random(config.seed)
    started = time.monotonic()
    hung = False
    restarts: list[defer.Deferred[Any]] = []
    while running[0]:
        yield task.deferLater(reactor, rng.uniform(*config.kill_every_s), lambda: None)
        if not running[0] or not all(fleet.up):
            continue
        victim = rng.randrange(config.nodes)
        if config.hang_s > 0 and not hung and time.monotonic() - started >= config.hang_after_s:
            hung = True
            fleet.up[victim] = False
            fleet.signal(victim, signal.SIGSTOP)
            report.hangs += 1
            yield task.deferLater(reactor, config.hang_s, lambda: None)
            fleet.signal(victim, signal.SIGCONT)
            fleet.up[victim] = True
            continue
        yield fleet.kill(victim)
        report.kills += 1
        restarts.append(fleet.start_node(victim))
    yield defer.DeferredList(restarts, consumeErrors=True)


def _metric(text: str, name: str) -> int:
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return int(float(found.group(1))) if found else 0


@defer.inlineCallbacks
def _stop(fleet: Fleet, load: Load) -> Generator[Any, Any, bytes]:
    """Stop every process of ``fleet`` and close ``load``'s connections; fires with what the
    head logged (nothing when no head was started)."""
    yield fleet.stop()
    yield load.pool.closeCachedConnections()
    return b"" if fleet.head is None else bytes(fleet.head.output)


@defer.inlineCallbacks
def run_chaos(config: ChaosConfig) -> Generator[Any, Any, ChaosReport]:
    """Start a fleet, take the references, stream under chaos, report; stop every process."""
    fleet = Fleet(config)
    report = ChaosReport(config.direction)
    load = Load(fleet, config)
    try:
        yield fleet.start()
        yield load.reference()
        running = [True]
        driver = chaos_driver(fleet, config, report, running)
        lock = defer.DeferredSemaphore(config.concurrency)
        started = time.monotonic()

        def finished(result: StreamResult) -> None:
            report.results.append(result)
            lock.release()

        @defer.inlineCallbacks
        def streams() -> Generator[Any, Any, None]:
            index = 0
            pending: list[defer.Deferred[Any]] = []
            while not driver.called and (
                index < config.requests
                or report.kills < config.min_kills
                or (config.hang_s > 0 and report.hangs == 0)
            ):
                yield lock.acquire()
                pending.append(load.stream(index).addCallback(finished))
                index += 1
            yield defer.gatherResults(pending)

        yield streams()
        report.elapsed_s = time.monotonic() - started
        running[0] = False
        yield driver
        response = yield load.agent.request(b"GET", (fleet.base + "/metrics").encode())
        metrics = (yield readBody(response)).decode()
        report.failovers = _metric(metrics, "sfhead_failovers_total")
        report.reconnects = _metric(metrics, "sfhead_reconnects_total")
        report.queue_timeouts = _metric(metrics, "sfhead_queue_timeouts_total")
        report.queue_rejected = _metric(metrics, "sfhead_queue_rejected_total")
    finally:
        report.head_log = yield _stop(fleet, load)
    return report


@dataclass
class RestartReport:
    """A head killed and started again, with nodes that dial it."""

    rejoined_s: list[float] = field(default_factory=list)
    """Per node: from the new head accepting nodes to that node joining it."""
    first_answer_s: float = 0.0
    """From the new head serving HTTP to the end of the first answer (sent at once)."""
    first_exact: bool = False
    head_log: bytes = b""

    def summary(self) -> str:
        joined = ", ".join(f"{s:.2f}" for s in self.rejoined_s)
        return (
            f"head restart: nodes rejoined {joined} s after the head listened; the first "
            f"request, sent at once, was answered {'exactly' if self.first_exact else 'WRONGLY'} "
            f"{self.first_answer_s:.2f} s after the head served HTTP"
        )


@defer.inlineCallbacks
def run_head_restart(
    config: ChaosConfig, down_s: float = 5.0
) -> Generator[Any, Any, RestartReport]:
    """Nodes dial the head; the head is SIGKILLed, stays away ``down_s`` seconds (the nodes'
    redials back off meanwhile), and starts again on the same ports.  A request is sent as soon
    as it serves HTTP: it waits for a node, which must dial in again by itself."""
    config.direction = DIAL_IN
    fleet = Fleet(config)
    load = Load(fleet, config)
    report = RestartReport()
    try:
        yield fleet.start()
        yield load.reference()
        assert fleet.head is not None
        yield fleet.head.kill()
        yield task.deferLater(reactor, down_s, lambda: None)
        head = fleet.start_head()

        def stamp(_: Any) -> float:
            return time.monotonic()

        accepting = head.wait_for(rb"sfhead accepting nodes on").addCallback(stamp)
        serving = head.wait_for(rb"sfhead serving HTTP on").addCallback(stamp)
        joined = [
            head.wait_for(rb"node chaos%d joined" % i).addCallback(stamp)
            for i in range(config.nodes)
        ]
        listened = yield accepting
        served = yield serving
        first = yield load.stream(0)
        answered = time.monotonic()
        times = yield defer.gatherResults(joined)
        report.rejoined_s = [t - listened for t in times]
        report.first_answer_s = answered - served
        report.first_exact = first.exact
    finally:
        report.head_log = yield _stop(fleet, load)
    return report
