"""What the benchmarks that run the fleet as deployed share: its processes and an HTTP client.

``bench/peer.py`` and ``bench/fleet.py`` start ``twistd -n --pidfile= sfnode`` and ``twistd -n
--pidfile= sfhead`` as separate processes on free ports (:func:`fleet_processes`), with the
environment of the shell that started the script without ``OMP_WAIT_POLICY`` (:func:`child_env`;
a test-suite setting that slows a dedicated server), and send them streamed OpenAI chat requests
with a small asyncio client (:func:`run_phase`) that times the first text of every answer.
Every benchmark that starts processes guards them (:func:`run_guarded`); the abuse benchmarks
print their scenarios as :class:`Row`.

This module is for benchmark scripts only: it must never be imported by the package or the
tests, never assert, and never leave a process it started running when the script exits (call
:func:`guard_children` first).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any, TypeVar

# The environment of the shell that started the script, taken when this module is imported
# (before any script changes its own).
SHELL_ENV = dict(os.environ)

NODE_READY_S = 900.0
"""The node's first start converts the GGUF model (about half a minute, more on a busy machine)."""
STOP_S = 30.0
TOPICS = (
    "a lighthouse keeper",
    "a dragon who is afraid of fire",
    "a city under the sea",
    "a robot learning to paint",
    "two rival bakers",
    "a lost expedition in Antarctica",
    "a talking cat",
    "the first colony on Mars",
    "a haunted library",
    "a young inventor",
    "a storm at sea",
    "a detective in Victorian London",
    "a forgotten kingdom",
    "a journey across the desert",
    "a clockmaker's apprentice",
    "a friendship between a fox and a crow",
)
WARM_UP_TOPIC = "a quiet village in the mountains"

FLOOR = "import torch, twisted.application.app; from twisted.internet import reactor"
"""What every node imports before it reads a model: the floor of its start and of its memory
(issue 32: warm start at most the floor's import time + 1 s; the node without keys and values
at most the floor's resident memory + the weights + 60 MB)."""


Options = TypeVar("Options")


class BenchError(Exception):
    """The benchmark cannot go on; the message says why and where the logs are."""


# --- child processes -------------------------------------------------------------------------

_CHILDREN: list[Child] = []


class Child:
    """A process this script started: its output goes to a log file; ``stop`` ends it."""

    def __init__(
        self, name: str, argv: Sequence[str], env: dict[str, str], log_path: Path, group: bool
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "wb")  # closed by stop()
        # A build runs make and compilers: in its own process group so that stop ends them all.
        self.group = group
        self.process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=group,
        )
        _CHILDREN.append(self)

    def tail(self, lines: int = 25) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def failed(self, what: str) -> BenchError:
        return BenchError(f"{self.name} {what}; the end of {self.log_path}:\n{self.tail()}")

    def check_running(self) -> None:
        status = self.process.poll()
        if status is not None:
            raise self.failed(f"exited with status {status}")

    def wait_for_line(self, pattern: bytes, timeout: float) -> re.Match[bytes]:
        """The first match of ``pattern`` in the child's output, polled until ``timeout``."""
        compiled = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            found = compiled.search(self.log_path.read_bytes())
            if found:
                return found
            self.check_running()
            if time.monotonic() > deadline:
                raise self.failed(f"did not print {pattern.decode()!r} within {timeout:.0f} s")
            time.sleep(0.2)

    def wait(self) -> int:
        """Wait for the end; the exit status."""
        return self.process.wait()

    def stop(self) -> None:
        """End the process (SIGTERM, then SIGKILL after 30 s) and wait for it; idempotent."""
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        self._log.close()
        if self in _CHILDREN:
            _CHILDREN.remove(self)

    def _signal(self, signum: int) -> None:
        try:
            if self.group:
                os.killpg(self.process.pid, signum)
            else:
                self.process.send_signal(signum)
        except ProcessLookupError:
            pass


def stop_children() -> None:
    """Stop every process started through :class:`Child` that is still running."""
    for child in list(reversed(_CHILDREN)):
        child.stop()


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    # Turned into SystemExit so that every ``finally`` (and then atexit) stops the children.
    raise SystemExit(128 + signum)


def guard_children() -> None:
    """Stop the children at exit, and on SIGTERM or SIGHUP (call once, from the main thread)."""
    atexit.register(stop_children)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _exit_on_signal)


def run_guarded(script: str, run: Callable[[Options], int], options: Options) -> int:
    """``run(options)`` with the children guarded and stopped at the end; a
    :class:`BenchError` is printed as ``script: why`` and exits 1."""
    guard_children()
    try:
        return run(options)
    except BenchError as e:
        print(f"{script}: {e}", file=sys.stderr)
        return 1
    finally:
        stop_children()


@dataclass
class Row:
    """One scenario's line of a Markdown table ``| scenario | tried | figure | pass condition |
    result |`` (the abuse benchmarks)."""

    scenario: str
    tried: str
    figure: str
    condition: str
    passed: bool

    def markdown(self) -> str:
        result = "pass" if self.passed else "**FAIL**"
        return f"| {self.scenario} | {self.tried} | {self.figure} | {self.condition} | {result} |"


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.load(response)


def wait_until(child: Child, url: str, ready: Callable[[Any], bool], timeout: float) -> None:
    """Poll ``url`` until its JSON answer satisfies ``ready`` (non-200 answers count as not)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if ready(get_json(url, timeout=2)):
                return
        except (OSError, ValueError, urllib.error.URLError):
            pass
        child.check_running()
        if time.monotonic() > deadline:
            raise child.failed(f"was not ready at {url} within {timeout:.0f} s")
        time.sleep(0.25)


def head_serving(head: Child, nodes: int, timeout: float) -> int:
    """The HTTP port of the ``head`` child once it serves and its /healthz counts at least
    ``nodes`` live nodes (within ``timeout`` seconds for each)."""
    found = head.wait_for_line(rb"sfhead serving HTTP on 127\.0\.0\.1:(\d+)", timeout)
    port = int(found.group(1))
    wait_until(
        head,
        f"http://127.0.0.1:{port}/healthz",
        lambda body: body.get("nodes", 0) >= nodes,
        timeout,
    )
    return port


def child_env(extra: Sequence[str]) -> dict[str, str]:
    """The shell's environment without OMP_WAIT_POLICY, plus ``KEY=VALUE`` settings."""
    env = {k: v for k, v in SHELL_ENV.items() if k != "OMP_WAIT_POLICY"}
    env.update(parse_env(extra))
    return env


def parse_env(settings: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` settings as a dict; :class:`BenchError` for one without ``=``."""
    parsed = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key:
            raise BenchError(f"an environment setting must be KEY=VALUE, not {setting!r}")
        parsed[key] = value
    return parsed


def twistd(*args: str) -> list[str]:
    """The command line of ``twistd -n --pidfile= ARGS`` with this script's Python."""
    run = "import sys; sys.argv[0] = 'twistd'; from twisted.scripts.twistd import run; run()"
    return [sys.executable, "-c", run, "-n", "--pidfile=", *args]


def shown(argv: Sequence[str]) -> str:
    """A :func:`twistd` command line as a user would type it."""
    return "twistd " + subprocess.list2cmdline(list(argv)[3:])


@dataclass
class RunningFleet:
    """A started ``twistd sfnode`` and ``twistd sfhead``: the head's HTTP port and both
    children."""

    port: int
    head: Child
    node: Child


@contextmanager
def fleet_processes(
    node_args: Sequence[str],
    env: dict[str, str],
    model: Path | None,
    logs: Path,
    children: list[Child] | None = None,
) -> Iterator[int]:
    """``twistd sfnode`` listening on a free loopback port and ``twistd sfhead`` dialing it,
    serving HTTP on another: yields that HTTP port once the head has the node, and stops both
    when the block ends.  Their output goes to ``logs/sfnode.log`` and ``logs/sfhead.log``;
    ``children``, when given, gets the node's and then the head's :class:`Child`."""
    with fleet_children(node_args, env, model, logs) as fleet:
        if children is not None:
            children.extend((fleet.node, fleet.head))
        yield fleet.port


@contextmanager
def fleet_children(
    node_args: Sequence[str],
    env: dict[str, str],
    model: Path | None,
    logs: Path,
    head_args: Sequence[str] = (),
) -> Iterator[RunningFleet]:
    """:func:`fleet_processes`, with ``head_args`` for the head and both children yielded."""
    model_args = ["--model", str(model)] if model is not None else []
    node_argv = twistd("sfnode", "--listen", "tcp:0:interface=127.0.0.1", *model_args, *node_args)
    print(f"starting {shown(node_argv)}", flush=True)
    node = Child("sfnode", node_argv, env, logs / "sfnode.log", False)
    head: Child | None = None
    try:
        found = node.wait_for_line(rb"sfnode listening on 127\.0\.0\.1:(\d+)", NODE_READY_S)
        head_argv = twistd(
            "sfhead",
            "--node", f"tcp:127.0.0.1:{int(found.group(1))}",
            "--http", "tcp:0:interface=127.0.0.1",
            "--fleet-listen", "tcp:0:interface=127.0.0.1",
            *model_args,
            *head_args,
        )  # fmt: skip
        print(f"starting {shown(head_argv)}", flush=True)
        head = Child("sfhead", head_argv, env, logs / "sfhead.log", False)
        port = head_serving(head, 1, NODE_READY_S)
        yield RunningFleet(port, head, node)
    finally:
        if head is not None:
            head.stop()
        node.stop()


def cpu_extensions() -> str:
    """The CPU's vector extensions that decide sfnode's kernels (docs/engine.md section 5.1), as
    ``avx2 fma f16c; no avx512f, ...``: the node's own description of its CPU."""
    from sfnode.engines.kernels.choice import (
        Cpu,  # imports torch: only the benches that print it pay
    )

    return Cpu.here().describe()


def memory_mb(pid: int) -> tuple[float, float]:
    """``(VmRSS, VmHWM)`` of a process in MB: its resident memory now and at its peak.

    A process that has gone, or a status without both lines, raises: a figure of 0 MB in a
    table would read as a measurement."""
    found: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) / 1024
    if len(found) != 2:
        raise RuntimeError(f"process {pid} reports no resident memory (VmRSS, VmHWM): {found}")
    return found["VmRSS"], found["VmHWM"]


def floor_mb() -> float:
    """Resident MB of a fresh interpreter that has imported :data:`FLOOR` (``VmRSS``), run with
    the user's shell's environment as the node is."""
    env = {k: v for k, v in SHELL_ENV.items() if k != "OMP_WAIT_POLICY"}
    code = FLOOR + "; print(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])"
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    return int(out.stdout.split()[-1]) / 1024


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "an unknown CPU"


# --- the client ------------------------------------------------------------------------------


@dataclass
class Answer:
    """One streamed completion as the client saw it."""

    tokens: int = 0
    """``usage.completion_tokens`` of the last chunk, else the content chunks counted."""
    first: float | None = None
    """Seconds from sending the request to the first chunk with text."""
    text: str = ""
    chunks: int = 0
    usage: bool = False


@dataclass
class Phase:
    """The requests of one concurrency on one server."""

    concurrency: int
    answers: list[Answer]
    wall: float
    client_cpu: float

    @property
    def tokens(self) -> int:
        return sum(a.tokens for a in self.answers)

    @property
    def rate(self) -> float:
        return self.tokens / self.wall if self.wall > 0 else 0.0

    def first_token_ms(self, q: float) -> float:
        times = sorted(a.first for a in self.answers if a.first is not None)
        if not times:
            return float("nan")
        if q == 0.5:
            return 1000 * statistics.median(times)
        return 1000 * times[min(len(times) - 1, round(q * (len(times) - 1)))]


async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The response body as it arrives (chunked, sized or until the connection closes)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()).strip():
                    pass  # trailers
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


async def stream_chat(host: str, port: int, body: dict[str, Any]) -> Answer:
    """POST one streamed chat completion on a fresh connection and read it to the end."""
    payload = json.dumps(body).encode()
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode() + payload
    reader, writer = await asyncio.open_connection(host, port)
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        writer.write(request)
        await writer.drain()
        status_line = (await reader.readline()).decode("latin-1").strip()
        headers: dict[str, str] = {}
        while line := (await reader.readline()).decode("latin-1").strip():
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        answer = Answer()
        if status_line.split(" ")[1:2] != ["200"]:
            error = b"".join([chunk async for chunk in _body(reader, headers)])
            raise BenchError(f"{status_line} from :{port}: {error.decode(errors='replace')[:500]}")
        buffer = b""
        async for data in _body(reader, headers):
            arrived = time.perf_counter()
            buffer += data.replace(b"\r\n", b"\n")
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                _read_event(event, answer, arrived - started, port)
        if not answer.usage:
            answer.tokens = answer.chunks
        return answer
    finally:
        writer.close()


def _read_event(event: bytes, answer: Answer, elapsed: float, port: int) -> None:
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise BenchError(f"error event from :{port}: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                answer.chunks += 1
                answer.text += text
                if answer.first is None:
                    answer.first = elapsed
        usage = chunk.get("usage")
        if usage and "completion_tokens" in usage:
            answer.tokens = int(usage["completion_tokens"])
            answer.usage = True


def story_request(topic: str) -> str:
    """The user message of every benchmark chat request (issue 9's prompts)."""
    return f"Write a long, detailed story about {topic}"


def chat_body(model: str, topic: str, max_tokens: int) -> dict[str, Any]:
    """A greedy streamed chat request for ``topic``, asking for usage in the last chunk."""
    return chat_request(model, story_request(topic), max_tokens)


# The "extract" workload: what agents ask of a model about text they were given (repeat it,
# quote from it, fix it, rewrite a name in it), over short passages written for this benchmark.
# Most of each answer is copied from the prompt, which is where drafting by prompt lookup pays.
PASSAGES = (
    (
        "The lighthouse on Carrow Point was built in 1871 from granite quarried on the island "
        "itself. Its lamp burned paraffin until 1923, when an electric light replaced it, and the "
        "last keeper, Agnes Mollory, left the tower in 1958. Today the lantern room is open to "
        "visitors on Saturdays, and the keeper's cottage holds a small museum of ship models, "
        "charts and the logbooks Agnes kept for thirty-one years."
    ),
    (
        "To reset the controller, hold the red button for ten seconds until the status light "
        "blinks twice. Release the button, wait for the light to turn solid green, and then "
        "connect the cable to port B. If the light turns amber instead, the firmware update did "
        "not finish: repeat the reset, and keep the controller plugged in for at least five "
        "minutes before you disconnect it again."
    ),
    (
        "Maria Okafor opened her bakery on Linden Street in the spring of 2009 with two ovens and "
        "a borrowed mixer. By 2015 she employed eleven people and supplied bread to four schools "
        "in the district. Her sourdough starter, which she calls Henrietta, is older than the "
        "bakery itself; she carried it in a jar on the train from Lagos when she moved to the "
        "city as a student."
    ),
    (
        "The committee met on Tuesday and agreed on three changes to the library's opening hours. "
        "From the first of March the reading room will open at eight instead of nine, the archive "
        "will close at five on Fridays, and the children's section will stay open until seven on "
        "Thursdays. The changes will be reviewed in September, after the summer term."
    ),
)
_QUOTED = ("keeper", "light", "sourdough", "archive")
_RENAMED = (("Agnes", "Edith"), ("controller", "device"), ("Maria", "Ada"), ("committee", "board"))
_TYPOS = (("the", "teh"), ("and", "adn"), ("which", "wich"), ("will", "wil"))


def extract_request(index: int) -> str:
    """The user message of the ``index``-th extract request: each passage asked to be repeated,
    quoted from, corrected and rewritten in turn (any four requests in a row ask all four)."""
    passage = PASSAGES[index % len(PASSAGES)]
    kind = (index + index // len(PASSAGES)) % 4
    n = index % len(PASSAGES)
    if kind == 0:
        return f"Repeat the following text exactly, word for word:\n\n{passage}"
    if kind == 1:
        return (
            f"Quote, word for word, every sentence of this text that mentions the word "
            f'"{_QUOTED[n]}":\n\n{passage}'
        )
    if kind == 2:
        wrong, right = _TYPOS[n][1], _TYPOS[n][0]
        return (
            "Fix the spelling mistakes in this text and return the whole corrected text:\n\n"
            + passage.replace(f" {right} ", f" {wrong} ")
        )
    old, new = _RENAMED[n]
    return f'Copy this text, replacing "{old}" with "{new}" everywhere:\n\n{passage}'


def chat_request(model: str, message: str, max_tokens: int) -> dict[str, Any]:
    """A greedy streamed chat request with one user message, asking for usage at the end."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def served_model(port: int) -> str:
    """The first model id the server at ``port`` lists."""
    models = get_json(f"http://127.0.0.1:{port}/v1/models")
    return str(models["data"][0]["id"])


async def run_phase(port: int, bodies: Sequence[dict[str, Any]], concurrency: int) -> Phase:
    """``bodies`` in order, ``concurrency`` in flight (a closed loop: the next on each end)."""
    answers: list[Answer | None] = [None] * len(bodies)
    pending = iter(range(len(bodies)))

    async def client() -> None:
        for index in pending:
            answers[index] = await stream_chat("127.0.0.1", port, bodies[index])

    cpu = time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    done = [a for a in answers if a is not None]
    return Phase(concurrency, done, wall, time.process_time() - cpu)


def topics(count: int, start: int = 0) -> list[str]:
    """``count`` topics from position ``start`` of an endless list: the 16 of the issue, then
    again as "part 2", "part 3", ..."""
    end = start + count
    rounds = [TOPICS] + [
        tuple(f"{t} (part {n})" for t in TOPICS) for n in range(2, end // len(TOPICS) + 2)
    ]
    return [topic for round_ in rounds for topic in round_][start:end]
