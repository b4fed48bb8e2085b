"""Link F under abuse: the scenarios of issue 19, items 2, 5 and 6, against real processes.

Every scenario starts its own ``twistd sfnode --engine mock`` and ``twistd sfhead`` processes on
free loopback ports (``bench/_fleetproc.py``), does what an attacker or a mishap does, measures
what it cost, and prints one Markdown table row:

    scenario | tried | figure | pass condition | result

- **4 MiB HELLO** (item 5): a valid HELLO padded to 4 MiB sent to a node without a token while
  a head streams through that node: the node's RSS growth, when it closed the connection, the
  stream's longest pause.
- **silent connections to a node / to the fleet listener** (item 5): one address keeps 64
  connections to a node (8 to a head's fleet listener) open and silent, re-opening any that is
  closed; a head (a node) from another address joins meanwhile: how long that took.
- **two heads, one node** (item 2): a stream through each of two heads on one node at once.
- **a head killed and restarted** (items 2 and 3): a head is killed mid-stream and another one
  started; the new head's stream, and when the node fenced and then deleted the orphan.
- **a Finish that never comes** (item 2): a generation slower than ``--max-generation-time``.
- **garbage on the head's port / another token** (item 6): what answers a ``--head`` node's dial
  is 50 bytes of garbage, or a head with another fleet token; then the real head listens there.

    .venv/bin/python bench/abuse_link.py                  # every scenario (about 2 minutes)
    .venv/bin/python bench/abuse_link.py --only two_heads --only big_hello

This script only measures and prints; it asserts nothing, is never imported by the package or
the tests, and never leaves a process it started running when it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import struct
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from _fleetproc import BenchError, Child, Row, child_env, guard_children, twistd

TOKEN = "4f" * 32
OTHER = "9a" * 32
HELLO_BYTES = 4 * 1024 * 1024


@dataclass
class Bench:
    logs: Path
    env: dict[str, str]
    tokenizer: str
    """A folder with the bundled model's tokenizer, for the heads (weights are never loaded)."""
    counter: int = 0
    children: list[Child] = field(default_factory=list)

    def log_path(self, name: str) -> Path:
        self.counter += 1
        return self.logs / f"{self.counter:02d}-{name}.log"

    def spawn(self, name: str, *args: str) -> Child:
        child = Child(name, twistd(*args), self.env, self.log_path(name), False)
        self.children.append(child)
        return child

    def node(self, *args: str) -> tuple[Child, int]:
        """``twistd sfnode --listen`` on a free loopback port: (process, port)."""
        child = self.spawn(
            "sfnode", "sfnode", "--listen", "tcp:0:interface=127.0.0.1", "--engine", "mock", *args
        )
        found = child.wait_for_line(rb"sfnode listening on 127\.0\.0\.1:(\d+)", 60)
        return child, int(found.group(1))

    def head(self, *args: str, fleet: str = "tcp:0:interface=127.0.0.1") -> tuple[Child, int, int]:
        """``twistd sfhead`` with its HTTP API and fleet listener on loopback: (process, HTTP
        port, fleet port)."""
        child = self.spawn(
            "sfhead", "sfhead", "--model", self.tokenizer, "--model-name", "mock",
            "--http", "tcp:0:interface=127.0.0.1", "--fleet-listen", fleet, *args,
        )  # fmt: skip
        http = child.wait_for_line(rb"sfhead serving HTTP on 127\.0\.0\.1:(\d+)", 60)
        listening = child.wait_for_line(rb"sfhead accepting nodes on 127\.0\.0\.1:(\d+)", 60)
        return child, int(http.group(1)), int(listening.group(1))

    def stop_all(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.children.clear()


def token_file(folder: Path, token: str) -> str:
    path = folder / f"token-{token[:4]}"
    path.write_text(token + "\n")
    return str(path)


def live_nodes(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as answer:
            return int(json.load(answer).get("nodes", 0))
    except (OSError, ValueError, urllib.error.URLError):
        return 0


def wait_for_nodes(port: int, count: int, timeout: float) -> float | None:
    """Seconds until the head at ``port`` has ``count`` live nodes; None if not in time."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if live_nodes(port) >= count:
            return time.monotonic() - started
        time.sleep(0.05)
    return None


@dataclass
class Stream:
    status: int = 0
    tokens: int = 0
    """``usage.completion_tokens``."""
    chunks: int = 0
    longest_gap: float = 0.0
    finish: str | None = None
    error: str | None = None
    seconds: float = 0.0


def chat(port: int, max_tokens: int, stream: bool = True, timeout: float = 60.0) -> Stream:
    """One chat completion on a fresh connection, read to its end; the chunks' longest gap."""
    body = json.dumps(
        {"model": "mock", "messages": [{"role": "user", "content": "hi"}],
         "max_tokens": max_tokens, "temperature": 0, "stream": stream,
         **({"stream_options": {"include_usage": True}} if stream else {})}
    ).encode()  # fmt: skip
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    result = Stream()
    started = time.monotonic()
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        last: float | None = None
        try:
            while chunk := sock.recv(65536):
                now = time.monotonic()
                if last is not None and b"data: {" in chunk:
                    result.longest_gap = max(result.longest_gap, now - last)
                if b"data: {" in chunk:
                    last = now
                data += chunk
        except TimeoutError:
            result.error = f"nothing for {timeout:g} s: the client gave up"
    result.seconds = time.monotonic() - started
    head, _, rest = data.partition(b"\r\n\r\n")
    result.status = int(head.split(b" ")[1]) if head else 0
    for line in rest.split(b"\n"):
        line = line.strip()
        if line.startswith(b"{") and not stream:
            answer = json.loads(line)
            if "error" in answer:
                result.error = answer["error"].get("code")
            else:
                result.tokens = answer["usage"]["completion_tokens"]
                result.finish = answer["choices"][0]["finish_reason"]
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if "error" in event:
            result.error = event["error"].get("code")
            continue
        if event.get("usage"):
            result.tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            if choice.get("delta", {}).get("content"):
                result.chunks += 1
            if choice.get("finish_reason"):
                result.finish = choice["finish_reason"]
    return result


def in_thread(work: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``work`` in a thread now; the returned function waits and gives its result."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as e:  # carried to the caller
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join() -> Any:
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    return join


@contextmanager
def silent_connections(port: int, count: int, source: str = "127.0.0.1") -> Iterator[list[int]]:
    """``count`` silent connections from ``source`` to ``port``, re-opened whenever one is
    closed, while the block runs; yields [connections the server closed]."""
    closed = [0]
    stop = threading.Event()

    def keep() -> None:
        sockets: list[socket.socket] = []
        while not stop.is_set():
            while len(sockets) < count and not stop.is_set():
                sock = socket.socket()
                sock.bind((source, 0))
                sock.settimeout(2)
                try:
                    sock.connect(("127.0.0.1", port))
                except OSError:
                    sock.close()
                    continue
                sock.setblocking(False)
                sockets.append(sock)
            for sock in list(sockets):
                try:
                    data = sock.recv(4096)  # a head says HELLO first: read, say nothing
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    continue
                closed[0] += 1
                sockets.remove(sock)
                sock.close()
            time.sleep(0.01)
        for sock in sockets:
            sock.close()

    thread = threading.Thread(target=keep, daemon=True)
    thread.start()
    time.sleep(0.5)
    try:
        yield closed
    finally:
        stop.set()
        thread.join()


def rss_mb(child: Child) -> float:
    return psutil.Process(child.process.pid).memory_info().rss / 1e6


# --- the scenarios -----------------------------------------------------------------------------


def big_hello(bench: Bench) -> Row:
    node, node_port = bench.node("--token-delay-ms", "5")
    _, http, _ = bench.head("--node", f"tcp:127.0.0.1:{node_port}")
    wait_for_nodes(http, 1, 30)
    before = rss_mb(node)
    peak = [before]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak[0] = max(peak[0], rss_mb(node))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    streaming = in_thread(lambda: chat(http, 400))
    time.sleep(0.3)
    # A HELLO that every node reads as valid, padded with a fourth element of four million
    # empty arrays (ignored as an appended field, but decoded first: a list object each).
    pad = HELLO_BYTES - 13
    payload = b"\x94\x92\x02\x02\x91\x02\xc4\x00\xdd" + struct.pack(">I", pad) + b"\x90" * pad
    frame = struct.pack("<IHHQQB", 21 + len(payload), 2, 1, 1, 0, 0) + payload
    started = time.monotonic()
    answered = b""
    ended = "closed"
    with socket.create_connection(("127.0.0.1", node_port), timeout=15) as sock:
        try:
            sock.sendall(frame)
        except OSError:
            pass  # closed while sending: refused before the body was read
        try:
            # Until the node closes the connection, or answers (a HELLO_ACK_F: accepted).
            answered = sock.recv(65536)
        except TimeoutError:
            ended = "no answer"
        except OSError:
            pass
    closed_after = time.monotonic() - started
    stream = streaming()
    sampling.set()
    sampler.join()
    growth = peak[0] - before
    acked = len(answered) > 0
    return Row(
        "4 MiB HELLO, node without a token",
        "a valid HELLO padded to 4 MiB (4 million empty arrays) while a head streams 400 "
        "tokens through the node",
        f"RSS +{growth:.1f} MB; "
        + (
            f"HELLO_ACK_F after {closed_after * 1000:.0f} ms"
            if acked
            else f"{ended} after {closed_after * 1000:.0f} ms, no HELLO_ACK_F"
        )
        + f"; stream {stream.tokens} "
        f"tokens, longest pause {stream.longest_gap * 1000:.0f} ms",
        "RSS +< 20 MB, no HELLO_ACK_F, stream whole with no pause > 500 ms",
        growth < 20 and not acked and stream.finish == "length" and stream.longest_gap < 0.5,
    )


def silent_node_slots(bench: Bench) -> Row:
    _, node_port = bench.node()

    def head_dials() -> int:
        return bench.head("--node", f"tcp:127.0.0.1:{node_port}:bindAddress=127.0.0.2")[1]

    seconds, refused = joined_despite_silence(node_port, 64, head_dials, timeout=20)
    return Row(
        "silent connections to a node",
        "127.0.0.1 keeps 64 silent connections to a node (re-opened when closed); a head "
        "from 127.0.0.2 dials it",
        joined_figure(seconds, refused, ("head", "it started"), "node", 20),
        "joins within 5 s",
        seconds is not None and seconds < 5,
    )


def silent_fleet_slots(bench: Bench) -> Row:
    _, http, fleet = bench.head()

    def node_dials_in() -> int:
        bench.spawn(
            "sfnode", "sfnode", "--head", f"tcp:127.0.0.1:{fleet}:bindAddress=127.0.0.2",
            "--engine", "mock",
        )  # fmt: skip
        return http

    seconds, refused = joined_despite_silence(fleet, 8, node_dials_in, timeout=30)
    return Row(
        "silent connections to the fleet listener",
        "127.0.0.1 keeps 8 silent connections to the head's fleet port (re-opened when "
        "closed); a node from 127.0.0.2 dials in",
        joined_figure(seconds, refused, ("node", "its process started"), "head", 30),
        "joins within 5 s of its start",
        seconds is not None and seconds < 5,
    )


def joined_despite_silence(
    port: int, count: int, join: Callable[[], int], *, timeout: float
) -> tuple[float | None, int]:
    """While ``count`` silent connections hold ``port``, ``join`` starts a process that joins
    a head (it answers the head's HTTP port): seconds until the head had a live node (None: not
    within ``timeout``), and how many of the silent connections were closed meanwhile."""
    with silent_connections(port, count) as closed:
        started = time.monotonic()
        http = join()
        joined = wait_for_nodes(http, 1, timeout)
        return (time.monotonic() - started if joined is not None else None), closed[0]


def joined_figure(
    seconds: float | None, refused: int, joiner: tuple[str, str], closer: str, timeout: int
) -> str:
    """What a silent-connections scenario measured: when the joiner (who, since when) joined,
    and how many silent connections the ``closer`` closed meanwhile."""
    who, since = joiner
    if seconds is None:
        return f"the {who} did not join within {timeout} s"
    return (
        f"{who} joined {seconds:.2f} s after {since}; the {closer} closed {refused} of the "
        "silent ones"
    )


def two_heads(bench: Bench) -> Row:
    _, node_port = bench.node("--token-delay-ms", "5")
    ports = []
    for _ in range(2):
        _, http, _ = bench.head("--node", f"tcp:127.0.0.1:{node_port}")
        wait_for_nodes(http, 1, 30)
        ports.append(http)
    joins = [in_thread(lambda p=p: chat(p, 200, timeout=20)) for p in ports]
    streams = [join() for join in joins]
    figure = "; ".join(
        f"head {i + 1}: HTTP {s.status}, {s.tokens} tokens, finish {s.finish}"
        + (f" ({s.error})" if s.error else "")
        for i, s in enumerate(streams)
    )
    return Row(
        "two heads, one node",
        "two sfhead processes (each numbering sessions from 1) stream 200 tokens each through "
        "one node at once",
        figure,
        "both 200 tokens, finish length",
        all(s.tokens == 200 and s.finish == "length" for s in streams),
    )


def restarted_head(bench: Bench) -> Row:
    node, node_port = bench.node("--token-delay-ms", "5", "--fenced-grace-ms", "2000")
    first, http, _ = bench.head("--node", f"tcp:127.0.0.1:{node_port}", "--lease-ms", "2000")
    wait_for_nodes(http, 1, 30)
    abandoned = in_thread(lambda: chat(http, 2000))
    time.sleep(0.5)
    first.process.kill()
    killed = time.monotonic()
    first.wait()
    try:
        abandoned()
    except OSError:
        pass
    _, http2, _ = bench.head("--node", f"tcp:127.0.0.1:{node_port}", "--lease-ms", "2000")
    wait_for_nodes(http2, 1, 30)
    stream = chat(http2, 200)
    try:
        deleted: Any = node.wait_for_line(rb"deleted session 1 of head [0-9a-f]+: fenced", 15)
    except BenchError:
        deleted = None
    seconds = time.monotonic() - killed
    fenced = re.search(rb"session 1 of head [0-9a-f]+ fenced itself", node.log_path.read_bytes())
    return Row(
        "a head killed and restarted",
        "a head (lease 2 s) is killed mid-stream; a new head process streams through the same "
        "node (grace 2 s)",
        f"new head: HTTP {stream.status}, {stream.tokens} tokens; old session "
        f"{'fenced, then ' if fenced else ''}deleted {seconds:.1f} s after the kill"
        if deleted
        else "the old session was not deleted",
        "new stream whole; old session deleted within lease + grace + 3 s",
        stream.tokens == 200 and deleted is not None and seconds < 7,
    )


def missing_finish(bench: Bench) -> Row:
    node, node_port = bench.node(
        "--token-delay-ms", "1000", "--metrics", "tcp:0:interface=127.0.0.1"
    )
    metrics = int(node.wait_for_line(rb"sfnode metrics on 127\.0\.0\.1:(\d+)", 30).group(1))
    _, http, _ = bench.head("--node", f"tcp:127.0.0.1:{node_port}", "--max-generation-time", "2")
    wait_for_nodes(http, 1, 30)
    answer = chat(http, 100, stream=False)
    time.sleep(0.3)
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5) as page:
        text = page.read().decode()
    running = re.search(r"^sfnode_generations\{[^}]*\} (\S+)$", text, re.M)
    left = float(running.group(1)) if running else -1.0
    return Row(
        "a Finish that never comes in time",
        "a generation at one token a second, 100 asked, on a head with --max-generation-time 2",
        f"HTTP {answer.status} {answer.error} after {answer.seconds:.1f} s; generations left "
        f"on the node: {left:g}",
        "504 generation_timeout within 3 s, none left running",
        answer.status == 504
        and answer.error == "generation_timeout"
        and answer.seconds < 3
        and left == 0,
    )


def dial_then_head(bench: Bench, first: str) -> Row:
    """A ``--head`` node whose dials are first answered by garbage or by a head with another
    token; then the real head listens on that port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    attempts = [0]
    stop = threading.Event()
    squatter: Child | None = None
    server: socket.socket | None = None
    if first == "garbage":
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        server.settimeout(0.1)

        def answer() -> None:
            assert server is not None
            while not stop.is_set():
                try:
                    connection, _ = server.accept()
                except OSError:
                    continue
                attempts[0] += 1
                connection.sendall(b"\x00\x30" + os.urandom(48))
                time.sleep(0.05)
                connection.close()

        threading.Thread(target=answer, daemon=True).start()
    else:
        squatter, _, _ = bench.head(
            "--auth-file", token_file(bench.logs, OTHER), fleet=f"tcp:{port}:interface=127.0.0.1"
        )
    node = bench.spawn(
        "sfnode", "sfnode", "--head", f"tcp:127.0.0.1:{port}", "--engine", "mock",
        "--auth-file", token_file(bench.logs, TOKEN),
    )  # fmt: skip
    node.wait_for_line(rb"the handshake failed", 30)
    time.sleep(4.0)
    running = node.process.poll() is None
    log = node.log_path.read_bytes()
    if first == "garbage":
        stop.set()
        assert server is not None
        server.close()
        tried = "50 bytes of garbage (a Noise length of 48, then 48 random bytes)"
    else:
        attempts[0] = len(re.findall(rb"refused 127\.0\.0\.1:\d+: its fleet token differs", log))
        assert squatter is not None
        squatter.stop()
        tried = "a head holding another fleet token"
    started = time.monotonic()
    _, http, _ = bench.head(
        "--auth-file", token_file(bench.logs, TOKEN), fleet=f"tcp:{port}:interface=127.0.0.1"
    )
    joined = wait_for_nodes(http, 1, 30)
    seconds = time.monotonic() - started if joined is not None else None
    reason = re.search(rb"the handshake failed: ([^;]+);", log)
    return Row(
        "garbage on the head's port" if first == "garbage" else "a head with another token",
        f"{tried} answers a --head node's dial (keyed) for 4 s; then the real head listens there",
        f"process {'running' if running else 'exited ' + str(node.process.returncode)} after "
        f"{attempts[0]} failed handshakes (logged: {reason.group(1).decode() if reason else '-'}); "
        + (
            f"joined {seconds:.2f} s after the head started"
            if seconds is not None
            else "did not join within 30 s"
        ),
        "still running, >= 3 attempts, joins within 5 s of the head",
        running and attempts[0] >= 3 and seconds is not None and seconds < 5,
    )


SCENARIOS: dict[str, Callable[[Bench], Row]] = {
    "big_hello": big_hello,
    "silent_node": silent_node_slots,
    "silent_fleet": silent_fleet_slots,
    "two_heads": two_heads,
    "restarted_head": restarted_head,
    "missing_finish": missing_finish,
    "garbage_dial": lambda bench: dial_then_head(bench, "garbage"),
    "wrong_token_dial": lambda bench: dial_then_head(bench, "token"),
}


def head_tokenizer() -> str:
    """A folder holding the bundled model's tokenizer.json (a node's converted GGUF)."""
    from sfnode.engines.weights import loading

    try:
        folder = loading.gguf_cache_folder(loading.default_gguf())
        if (folder / "tokenizer.json").is_file():
            return str(folder)
    except loading.ModelLoadError:
        pass
    for folder in sorted(loading.default_cache_dir().glob("SmolLM2-*")):
        if (folder / "tokenizer.json").is_file():
            return str(folder)
    raise BenchError("no converted SmolLM2 folder: start a transformers node once first")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench/abuse_link.py", description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(SCENARIOS), default=[])
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="also run every scenario with the sfnode of this checkout (its processes get "
        "PYTHONPATH=DIR), printed after this tree's rows and marked as the baseline",
    )
    options = parser.parse_args(argv)
    guard_children()
    names = options.only or list(SCENARIOS)
    trees = [("", child_env([]))]
    if options.baseline:
        baseline = child_env([])
        baseline["PYTHONPATH"] = os.pathsep.join(
            [str(Path(options.baseline).resolve()), *filter(None, [baseline.get("PYTHONPATH")])]
        )
        trees.append(("baseline: ", baseline))
    print("| scenario | tried | figure | pass condition | result |")
    print("|---|---|---|---|---|", flush=True)
    failed = 0
    tokenizer = head_tokenizer()
    for label, env in trees:
        with tempfile.TemporaryDirectory(prefix="sfnode-abuse-") as folder:
            # The children start here: `python -c` puts its working folder first on sys.path,
            # which must not be a checkout (it would win over the baseline's PYTHONPATH).
            os.chdir(folder)
            bench = Bench(Path(folder), env, tokenizer)
            for name in names:
                try:
                    row = SCENARIOS[name](bench)
                except BenchError as e:
                    reason = str(e).splitlines()
                    tail = " / ".join(line.strip() for line in reason[-3:])
                    row = Row(name, "-", f"could not run: {reason[0]} ... {tail}", "-", False)
                finally:
                    bench.stop_all()
                row.scenario = label + row.scenario
                failed += not row.passed and not label
                print(row.markdown().replace("\n", " "), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
