"""Abuse of the head's HTTP front door, tried against real processes: a walk around the API key,
and one client taking everyone's share (issue 19, items 1 and 4); and the surfaces agents
brought (issue 30, the ``doors-*`` scenarios): a stored response continued by another key, a
grammar that takes seconds to compile, a Responses input of 118k items, a ``logit_bias`` key of
5,000 digits, hostile chat templates sent by nodes, model files outliving their nodes, and the
response store's memory.

Starts ``twistd sfnode --engine mock`` (8 lanes, 5 ms a token) and a keyed ``twistd sfhead``
(two API keys: the attacker's and the victim's, ``--max-key-requests 64``) on loopback, as an
operator would, then runs each scenario of :data:`SCENARIOS` in turn.  The attacker connects
from 127.0.0.1, the victim from 127.0.0.2 (another loopback address: another client to the
head).  Each scenario prints one row of a Markdown table:

    | scenario | tried | figure | pass condition | result |

with its figure: the status codes the attacker got, the growth of the head's resident memory
(VmRSS, or its highest while a request ran, sampled every 10 ms), how long the victim waited,
and how late the head answered ``/healthz`` while an attack ran (each ask on a new
connection, every 20 ms: the reactor's stalls as a client sees them).  The ``doors-*``
scenarios start nodes of their own (mock engines with the bundled model's tokenizer files and
a template each) that dial the head's fleet port; a head that knows ``--model-grace`` is
started with ``--model-grace 2``.  A scenario is a coroutine function taking the
:class:`Target` and returning a :class:`Row`; add one to :data:`SCENARIOS` to add a row.

``--baseline DIR`` first runs the same scenarios against the checkout in DIR (its ``sfnode``
package and twistd plugins first on the processes' ``PYTHONPATH``; for example an export of
``main``), then against this one, and prints both tables.

    .venv/bin/python bench/abuse.py
    .venv/bin/python bench/abuse.py --only n8-flood --only idle-connections
    git archive main | tar -x -C /tmp/main && .venv/bin/python bench/abuse.py --baseline /tmp/main

This script only measures and prints; it asserts nothing, is never imported by the package, and
never leaves a process running when it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _fleetproc import (
    BenchError,
    Child,
    Row,
    child_env,
    cpu_name,
    fleet_children,
    guard_children,
    twistd,
)

ATTACKER = "127.0.0.1"
VICTIM = "127.0.0.2"
MODEL = "mock"
TOKEN_DELAY_MS = 5
LANES = 8


@dataclass
class Target:
    """The head under attack: its port, its process and the API keys; for the scenarios that
    start nodes of their own, the head's fleet port, the processes' environment, the folder
    for their logs and the options the head knows."""

    port: int
    head_pid: int
    attacker_key: str
    victim_key: str
    fleet_port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    logs: Path = Path(".")
    head_help: str = ""

    highest: float = 0.0
    """The highest VmRSS a scenario's sampler saw (:func:`highest_rss`), in MB."""

    def rss_mb(self) -> float:
        """The head's resident memory now (VmRSS), in MB."""
        for line in Path(f"/proc/{self.head_pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")


# --- a raw HTTP client -------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    body: bytes
    seconds: float

    @property
    def code(self) -> str:
        """The OpenAI error code of an error reply ("" for others)."""
        try:
            return str(json.loads(self.body)["error"]["code"])
        except (ValueError, KeyError, TypeError):
            return ""


def request_bytes(
    method: str,
    path: str,
    body: bytes = b"",
    *,
    key: str | None = None,
    content_type: str = "application/json",
    length: int | None = None,
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
             f"Content-Type: {content_type}"]  # fmt: skip
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    if body or length is not None:
        lines.append(f"Content-Length: {len(body) if length is None else length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def parse_reply(data: bytes, seconds: float) -> Reply:
    head, _, body = data.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        status = 0
    if b"transfer-encoding: chunked" in head.lower():
        chunks, rest = [], body
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            chunks.append(rest[:size])
            rest = rest[size + 2 :]
        body = b"".join(chunks)
    return Reply(status, body, seconds)


async def connect(port: int, bind: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(bind, 0))


async def exchange(port: int, data: bytes, bind: str, timeout: float = 120.0) -> Reply:
    """Send ``data`` on a new connection from ``bind`` and read until the head closes it."""
    started = time.perf_counter()
    try:
        reader, writer = await connect(port, bind)
    except OSError:
        return Reply(0, b"", time.perf_counter() - started)
    try:
        writer.write(data)
        received = await asyncio.wait_for(reader.read(), timeout)
    except (TimeoutError, OSError):
        received = b""
    finally:
        writer.transport.abort()
    return parse_reply(received, time.perf_counter() - started)


@dataclass
class Held:
    """Connections a scenario holds open (streams, idle ones) until it ends."""

    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    tasks: list[asyncio.Task[bytes]] = field(default_factory=list)

    async def open_from_attacker(
        self, port: int, count: int, request: bytes = b""
    ) -> list[asyncio.Task[bytes]]:
        """``count`` connections from the attacker's address (one refused is skipped), each
        sending ``request`` and held: the first bytes each gets within 2 s, as tasks."""
        arrivals = []
        for _ in range(count):
            try:
                reader, writer = await connect(port, ATTACKER)
            except OSError:
                continue
            if request:
                writer.write(request)
            self.writers.append(writer)
            arrivals.append(asyncio.ensure_future(first_bytes(reader, 2.0)))
        return arrivals

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for writer in self.writers:
            writer.transport.abort()


async def read_all(reader: asyncio.StreamReader) -> bytes:
    return await reader.read()


async def first_bytes(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """What arrives within ``timeout`` (b"" if nothing)."""
    try:
        return await asyncio.wait_for(reader.read(4096), timeout)
    except TimeoutError:
        return b""


def chat(content: str, max_tokens: int, **extra: Any) -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": content}],
         "max_tokens": max_tokens, **extra}
    ).encode()  # fmt: skip


async def victim_chat(target: Target) -> Reply:
    """The victim's one short chat completion (8 tokens), timed from connect to answer."""
    return await exchange(
        target.port,
        request_bytes(
            "POST", "/v1/chat/completions", chat("a short question", 8), key=target.victim_key
        ),
        VICTIM,
    )


async def drained(target: Target, timeout: float = 60.0) -> None:
    """Wait until the head has no request open (what an attacker left behind has ended), for
    up to ``timeout`` seconds (a head that keeps some open is left as it is)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = await exchange(target.port, request_bytes("GET", "/healthz"), VICTIM, 5.0)
        try:
            if json.loads(reply.body).get("requests") == 0:
                return
        except ValueError:
            pass
        await asyncio.sleep(0.2)
    print(f"  (the head still had requests open {timeout:.0f} s after the scenario)")


async def health(target: Target) -> dict[str, Any]:
    reply = await exchange(target.port, request_bytes("GET", "/healthz"), VICTIM)
    data: dict[str, Any] = json.loads(reply.body) if reply.body else {}
    return data


def counted(replies: Sequence[Reply]) -> str:
    """Status codes with their counts: ``56 x 429 rate_limit_exceeded, 8 x 200``."""
    counts = Counter(f"{r.status} {r.code}".strip() if r.status else "no answer" for r in replies)
    return ", ".join(f"{n} x {what}" for what, n in counts.most_common())


# --- the scenarios -----------------------------------------------------------------------------


def body_for(path: str) -> bytes:
    """A valid body for the completion route ``path`` names (chat or legacy)."""
    if "chat" in path or "%63hat" in path:
        return chat("hi", 4)
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4}).encode()


async def encoded_path(target: Target) -> Row:
    """Item 1: paths the router decodes into a completion route, without a key, text/plain."""
    paths = ["/v%31/chat/completions", "/%761/completions", "Xv1/chat/completions"]
    replies = []
    for path in paths:
        data = request_bytes("POST", path, body_for(path), content_type="text/plain")
        replies.append(await exchange(target.port, data, ATTACKER))
    return unserved_row("encoded-path", "no key, `text/plain`: ", paths, replies)


async def suffix_at_key_limit(target: Target) -> Row:
    """Item 1: suffixed completion paths with a key held at --max-key-requests, text/plain."""
    held = Held()
    body = chat("hold the key", 2000, n=8, stream=True)
    for _ in range(8):  # 8 x n 8 = the key's 64 generations, from a third address
        reader, writer = await connect(target.port, "127.0.0.3")
        writer.write(request_bytes("POST", "/v1/chat/completions", body, key=target.attacker_key))
        held.writers.append(writer)
        held.tasks.append(asyncio.ensure_future(read_all(reader)))
    await asyncio.sleep(1.0)
    paths = ["/v1/chat/completions/x", "/v1/completions/%2e", "/v1/chat/completions/"]
    replies = []
    try:
        for path in paths:
            data = request_bytes(
                "POST", path, body_for(path), key=target.attacker_key, content_type="text/plain"
            )
            replies.append(await exchange(target.port, data, ATTACKER))
    finally:
        held.close()
    await drained(target)
    tried = "key held at `--max-key-requests 64`, `text/plain`: "
    return unserved_row("suffix-at-key-limit", tried, paths, replies)


def unserved_row(scenario: str, tried: str, paths: list[str], replies: list[Reply]) -> Row:
    """The row of ``paths`` that must not be served: each one's status; passes with no 2xx."""
    return Row(
        scenario,
        tried + ", ".join(f"`{p}`" for p in paths),
        ", ".join(str(r.status) for r in replies),
        "no 2xx",
        all(not 200 <= r.status < 300 for r in replies),
    )


async def n8_flood(target: Target) -> Row:
    """Item 4: one address sends 64 streamed requests with n 8; another then asks once."""
    held = Held()
    body = chat("flood", 200, n=8, stream=True, temperature=1)
    answers: list[asyncio.Task[bytes]] = []
    for _ in range(64):
        reader, writer = await connect(target.port, ATTACKER)
        writer.write(request_bytes("POST", "/v1/chat/completions", body, key=target.attacker_key))
        held.writers.append(writer)
        answers.append(asyncio.ensure_future(first_bytes(reader, 2.0)))
    try:
        first = await asyncio.gather(*answers)
        status = await health(target)
        victim = await victim_chat(target)
    finally:
        held.close()
    await drained(target)
    attacker = counted([parse_reply(data, 0) for data in first if data])
    silent = sum(1 for data in first if not data)
    return Row(
        "n8-flood",
        "127.0.0.1: 64 streamed chat requests, `n: 8`, 200 tokens each; then 127.0.0.2 asks "
        "for 8 tokens",
        f"attacker: {attacker}, {silent} waiting; head queued {status.get('queued')}; victim "
        f"{victim.status} in {victim.seconds:.2f} s",
        "victim 200 in < 3 s (the attacker's backlog is 7 rounds of about 1 s)",
        victim.status == 200 and victim.seconds < 3.0,
    )


async def idle_connections(target: Target) -> Row:
    """Item 4: one address opens 1,100 idle connections; another is served."""
    held = Held()
    rss = target.rss_mb()
    arrivals = await held.open_from_attacker(target.port, 1100)
    try:
        first = await asyncio.gather(*arrivals)
        probe = await exchange(target.port, request_bytes("GET", "/healthz"), VICTIM)
        victim = await victim_chat(target)
        grown = target.rss_mb() - rss
    finally:
        held.close()
    refused = [parse_reply(data, 0) for data in first if data]
    return Row(
        "idle-connections",
        "127.0.0.1 opens 1,100 idle connections; 127.0.0.2 asks `/healthz` and a completion",
        f"attacker: {counted(refused)}, {len(first) - len(refused)} held; victim /healthz "
        f"{probe.status} in {probe.seconds:.3f} s, completion {victim.status} in "
        f"{victim.seconds:.2f} s; head RSS {grown:+.0f} MB",
        "victim 200 and 200",
        probe.status == 200 and victim.status == 200,
    )


async def bodies_to_healthz(target: Target) -> Row:
    """Item 4: 200 connections POST 4 MB bodies to /healthz without a key."""
    size = 4 * 1024 * 1024
    chunk = b"x" * 65536
    rss = target.rss_mb()
    peak = rss

    sent_before_answer: list[int] = []

    async def one(bind: str) -> Reply:
        nonlocal peak
        started = time.perf_counter()
        try:
            reader, writer = await connect(target.port, bind)
        except OSError:
            return Reply(0, b"", 0.0)
        received = bytearray()

        async def collect() -> None:
            # Kept as it arrives: the head drops the connection once it has discarded enough
            # of a refused body, and a reset would lose what a single read() had not returned.
            try:
                while chunk := await reader.read(65536):
                    received.extend(chunk)
            except OSError:
                pass

        reading = asyncio.ensure_future(collect())
        sent = 0
        try:
            writer.write(request_bytes("POST", "/healthz", length=size))
            while sent < size and not received:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
                await asyncio.sleep(0)  # one chunk per turn: the answer is read as it comes
        except OSError:
            pass
        try:
            await asyncio.wait_for(reading, 120.0)
        except TimeoutError:
            pass
        finally:
            writer.transport.abort()
            peak = max(peak, target.rss_mb())
        sent_before_answer.append(sent)
        return parse_reply(bytes(received), time.perf_counter() - started)

    binds = [f"127.0.1.{1 + i % 4}" for i in range(200)]  # 50 per address
    replies = await asyncio.gather(*(one(b) for b in binds))
    await drained(target)
    return Row(
        "bodies-to-healthz",
        "200 connections (4 addresses) POST 4 MiB bodies to `/healthz`, no key",
        f"{counted(replies)}, the client had sent at most {max(sent_before_answer) // 1024} "
        f"KiB of its body when it arrived; head RSS {peak - rss:+.0f} MB at most",
        "every one 405 from its headers; RSS growth < 50 MB",
        all(r.status == 405 for r in replies) and peak - rss < 50,
    )


async def unread_streams(target: Target) -> Row:
    """Item 4: one address opens 200 streams and reads none; another asks once."""
    held = Held()
    body = chat("never read", 400, stream=True, temperature=1)
    request = request_bytes("POST", "/v1/chat/completions", body, key=target.attacker_key)
    arrivals = await held.open_from_attacker(target.port, 200, request)
    try:
        first = await asyncio.gather(*arrivals)  # reads at most the first 4 KiB of each
        victim = await victim_chat(target)
    finally:
        held.close()
    await drained(target)
    answered = [parse_reply(data, 0) for data in first if data]
    return Row(
        "unread-streams",
        "127.0.0.1 opens 200 streams of 400 tokens and reads none; then 127.0.0.2 asks for "
        "8 tokens",
        f"attacker: {counted(answered)}, {len(first) - len(answered)} silent; victim "
        f"{victim.status} in {victim.seconds:.2f} s",
        "victim 200 in < 5 s (one generation is about 2 s; the stall timeout is 30 s)",
        victim.status == 200 and victim.seconds < 5.0,
    )


# --- issue 30: the surfaces agents brought -------------------------------------------------------


async def post_json(
    target: Target, path: str, body: Any, key: str | None, bind: str = ATTACKER
) -> Reply:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await exchange(target.port, request_bytes("POST", path, data, key=key), bind)


class Watch:
    """The victim's view of the head while an attack runs: ``/healthz`` asked every 20 ms on a
    new connection (the longest answer), and a streamed chat completion (the longest gap
    between two pieces of it)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.longest_health = 0.0
        self.longest_gap = 0.0
        self._stop = False
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._health()), asyncio.ensure_future(self._stream())]

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)

    async def _health(self) -> None:
        while not self._stop:
            reply = await exchange(self.target.port, request_bytes("GET", "/healthz"), VICTIM, 60)
            self.longest_health = max(self.longest_health, reply.seconds)
            await asyncio.sleep(0.02)

    async def _stream(self) -> None:
        body = chat("a long answer", 100_000, stream=True, temperature=1)
        data = request_bytes("POST", "/v1/chat/completions", body, key=self.target.victim_key)
        reader, writer = await connect(self.target.port, VICTIM)
        writer.write(data)
        last = time.perf_counter()
        try:
            while not self._stop:
                piece = await reader.read(4096)
                if not piece:
                    break
                now = time.perf_counter()
                self.longest_gap = max(self.longest_gap, now - last)
                last = now
        finally:
            writer.transport.abort()


async def reconnects(target: Target) -> float:
    """``sfhead_reconnects_total`` now (links to nodes that dropped and came back)."""
    reply = await exchange(
        target.port, request_bytes("GET", "/metrics", key=target.victim_key), VICTIM
    )
    for line in reply.body.decode(errors="replace").splitlines():
        if line.startswith("sfhead_reconnects_total "):
            return float(line.split()[1])
    return float("nan")


def slow_schema(prefix: str, count: int = 400) -> dict[str, Any]:
    """The issue's schema: ``count`` patternProperties (400: 12 s of compiling)."""
    patterns = {f"^{prefix}{i}[a-z]+$": {"type": "string"} for i in range(count)}
    return {"type": "object", "patternProperties": patterns}


def slow_format(prefix: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "n", "schema": slow_schema(prefix)}}


async def doors_stored_response(target: Target) -> Row:
    """Item 1: the victim stores a response; the attacker's key continues it."""
    body = {"model": MODEL, "input": "the launch code is 0000", "max_output_tokens": 2}
    first = await post_json(target, "/v1/responses", body, target.victim_key, VICTIM)
    ident = json.loads(first.body).get("id", "")
    again = {"model": MODEL, "input": "go on", "max_output_tokens": 2}
    crossed = await post_json(
        target, "/v1/responses", {**again, "previous_response_id": ident}, target.attacker_key
    )
    unknown = await post_json(
        target, "/v1/responses", {**again, "previous_response_id": "resp_" + "0" * 32},
        target.attacker_key,
    )  # fmt: skip
    return Row(
        "doors-stored-response",
        "key B passes key A's `previous_response_id`; then an unknown id",
        f"A's id: {crossed.status} {crossed.code}; unknown id: {unknown.status} {unknown.code}",
        "A's id answered as the unknown one (404)",
        crossed.status == unknown.status == 404 and crossed.code == unknown.code,
    )


async def doors_grammar(target: Target) -> Row:
    """Item 2: one completion whose schema has 400 patternProperties, while the victim watches."""
    before = await reconnects(target)
    watch = Watch(target)
    watch.start()
    await asyncio.sleep(0.5)
    body = {
        "model": MODEL,
        "prompt": [5, 6, 7],
        "max_tokens": 4,
        "response_format": slow_format("a"),
    }
    attack = await post_json(target, "/v1/completions", body, target.attacker_key)
    await asyncio.sleep(0.5)
    await watch.stop()
    dropped = await reconnects(target) - before
    return Row(
        "doors-grammar",
        "a completion whose `json_schema` has 400 patternProperties; 127.0.0.2 asks /healthz "
        "every 20 ms and streams",
        f"attacker {attack.status} {attack.code} in {attack.seconds:.1f} s; /healthz longest "
        f"{watch.longest_health:.3f} s; stream's longest gap {watch.longest_gap:.3f} s; node "
        f"link reconnects {dropped:.0f}",
        "/healthz < 0.05 s, no reconnect",
        watch.longest_health < 0.05 and dropped == 0,
    )


async def doors_grammar_pool(target: Target) -> Row:
    """Item 2: two slow-schema chats take the worker pool; the victim's chat is timed."""
    alone = await victim_chat(target)
    attacks = [
        asyncio.ensure_future(
            post_json(
                target,
                "/v1/chat/completions",
                json.loads(chat("x", 4, response_format=slow_format(prefix))),
                target.attacker_key,
            )
        )
        for prefix in ("b", "c")
    ]
    await asyncio.sleep(0.3)
    victim = await victim_chat(target)
    replies = await asyncio.gather(*attacks)
    return Row(
        "doors-grammar-pool",
        "two chats whose schemas have 400 patternProperties; then 127.0.0.2's 8-token chat",
        f"attacker: {counted(replies)}; victim {victim.status} in {victim.seconds:.2f} s "
        f"(alone {alone.seconds:.2f} s)",
        "victim 200 within 0.5 s",
        victim.status == 200 and victim.seconds < 0.5,
    )


async def doors_responses_input(target: Target) -> Row:
    """Item 2: a /v1/responses input of 118k items (3.9 MB), while the victim watches."""
    items = [{"role": "user", "content": "x"}] * 118_000
    body = json.dumps({"model": MODEL, "input": items, "max_output_tokens": 1}).encode()
    watch = Watch(target)
    watch.start()
    await asyncio.sleep(0.5)
    attack = await post_json(target, "/v1/responses", body, target.attacker_key)
    await asyncio.sleep(0.5)
    await watch.stop()
    return Row(
        "doors-responses-input",
        f"a `/v1/responses` input of 118,000 items ({len(body) / 1e6:.1f} MB); 127.0.0.2 "
        "asks /healthz every 20 ms and streams",
        f"attacker {attack.status} {attack.code} in {attack.seconds:.1f} s; /healthz longest "
        f"{watch.longest_health:.3f} s; stream's longest gap {watch.longest_gap:.3f} s",
        "/healthz < 0.05 s",
        watch.longest_health < 0.05,
    )


async def doors_logit_bias(target: Target) -> Row:
    """Item 3: a logit_bias key of 5,000 digits on the three routes."""
    bias = {"9" * 5000: 1}
    replies = [
        await post_json(target, "/v1/chat/completions", json.loads(chat("x", 2, logit_bias=bias)),
                        target.attacker_key),
        await post_json(target, "/v1/completions",
                        {"model": MODEL, "prompt": "x", "max_tokens": 2, "logit_bias": bias},
                        target.attacker_key),
        await post_json(target, "/v1/responses",
                        {"model": MODEL, "input": "x", "logit_bias": bias}, target.attacker_key),
    ]  # fmt: skip
    return Row(
        "doors-logit-bias",
        "`logit_bias` with a key of 5,000 digits on chat, completions, responses",
        ", ".join(str(r.status) for r in replies),
        "400, 400, 400",
        all(r.status == 400 for r in replies),
    )


async def highest_rss(target: Target) -> None:
    """Note the head's highest VmRSS in ``target.highest``, every 10 ms, until cancelled."""
    target.highest = target.rss_mb()
    while True:
        target.highest = max(target.highest, target.rss_mb())
        await asyncio.sleep(0.01)


TEMPLATES = {
    "doubling": '{% set s = namespace(v="x") %}{% for i in range(27) %}{% set s.v = s.v ~ s.v %}'
    "{% endfor %}{{ s.v | length }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "writing": '{% for i in range(3000) %}{{ "y" * 1000 }}{% endfor %}'
    "{% for m in messages %}{{ m.content }}{% endfor %}",
    "tojson": "{{ raise_exception | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}",
}
"""The hostile chat templates of the issue, as a node sends them."""


def tokenizer_folder(root: Path, name: str, template: str) -> Path:
    """The bundled model's tokenizer files (3.5 MB) with ``template`` as its chat template,
    copied from its conversion in the cache (never converted here: a node converts it)."""
    from sfnode.linkf import model_cache

    source = model_cache.gguf_cache_folder(model_cache.default_gguf())
    if not (source / "tokenizer.json").exists():
        raise BenchError(f"no converted bundled model at {source}: start a node once first")
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    for file in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (folder / file).write_bytes((source / file).read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(template)
    return folder


def dial_in(target: Target, name: str, folder: Path) -> Child:
    """A mock node serving ``name`` with ``folder``'s files, dialing the head."""
    argv = twistd(
        "sfnode", "--engine", "mock", "--model", str(folder), "--model-name", name,
        "--identity", name, "--join", f"127.0.0.1:{target.fleet_port}",
    )  # fmt: skip
    return Child(name, argv, target.env, target.logs / f"{name}.log", False)


async def models_listed(target: Target) -> list[str]:
    reply = await exchange(
        target.port, request_bytes("GET", "/v1/models", key=target.victim_key), VICTIM
    )
    return [entry["id"] for entry in json.loads(reply.body).get("data", [])]


async def until_listed(target: Target, names: Sequence[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not set(names) <= set(await models_listed(target)):
        if time.monotonic() > deadline:
            raise BenchError(f"the head did not serve {names} within {timeout:.0f} s")
        await asyncio.sleep(0.3)


async def doors_templates(target: Target) -> Row:
    """Item 4: nodes send hostile chat templates; a chat for each, the head's peak memory."""
    root = target.logs / "templates"
    nodes = [dial_in(target, f"t-{n}", tokenizer_folder(root, n, t)) for n, t in TEMPLATES.items()]
    figures = []
    try:
        await until_listed(target, [f"t-{n}" for n in TEMPLATES])
        for name in TEMPLATES:
            body = {
                "model": f"t-{name}",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            }
            rss = target.rss_mb()
            sampler = asyncio.ensure_future(highest_rss(target))
            replies = [
                await post_json(target, "/v1/chat/completions", body, target.attacker_key),
                await post_json(target, "/v1/chat/completions", body, target.attacker_key),
            ]
            sampler.cancel()
            figures.append((name, replies, target.highest - rss))
    finally:
        for node in nodes:
            node.stop()
    return Row(
        "doors-templates",
        "nodes send templates: a string doubled 27 times, 3 MB of output, `tojson` of a "
        "function; two chats each",
        "; ".join(f"{n}: {counted(r)}, head peak {g:+.0f} MB" for n, r, g in figures),
        "no 5xx, each peak < +50 MB",
        all(r.status < 500 for _, rs, _ in figures for r in rs)
        and all(g < 50 for _, _, g in figures),
    )


async def metric_series(target: Target, prefix: str) -> int:
    reply = await exchange(
        target.port, request_bytes("GET", "/metrics", key=target.victim_key), VICTIM
    )
    return sum(1 for line in reply.body.decode().splitlines() if f'model_name="{prefix}' in line)


async def doors_model_files(target: Target) -> Row:
    """Item 5: ten nodes join with distinct 3.5 MB bundles and leave."""
    root = target.logs / "bundles"
    names = [f"m-{i}" for i in range(10)]
    rss = target.rss_mb()
    for batch in (names[:5], names[5:]):
        nodes = [
            dial_in(target, name, tokenizer_folder(root, name, "{{ messages }}" + " " * i))
            for i, name in enumerate(batch)
        ]
        try:
            await until_listed(target, batch)
        finally:
            for node in nodes:
                node.stop()
    grace = 2.0 if "--model-grace" in target.head_help else 0.0
    await asyncio.sleep(grace + 3.0)
    listed = [n for n in await models_listed(target) if n.startswith("m-")]
    series = await metric_series(target, "m-")
    grown = target.rss_mb() - rss
    return Row(
        "doors-model-files",
        "10 nodes join with distinct 3.5 MB bundles and leave"
        + (" (`--model-grace 2`)" if grace else ""),
        f"/v1/models lists {len(listed)} of them; {series} metric series; head RSS {grown:+.0f} MB",
        "none listed, no series",
        not listed and series == 0,
    )


async def doors_store_memory(target: Target) -> Row:
    """Item 6: stored responses with large inputs: what the head holds for what it counts.

    Twenty responses first (the head's working memory for such requests reaches its plateau),
    then the growth of its resident memory over a hundred more, next to their JSON."""
    items = [{"role": "user", "content": f"hello {i}"} for i in range(9000)]
    body = json.dumps({"model": MODEL, "input": items, "max_output_tokens": 1}).encode()
    stored = len(json.dumps([*items, {"role": "assistant", "content": ""}])) / 2**20
    statuses = []
    rss = 0.0
    for count in range(120):
        if count == 20:
            rss = target.rss_mb()
        statuses.append(await post_json(target, "/v1/responses", body, target.attacker_key))
    grown = target.rss_mb() - rss
    counted_mb = stored * sum(1 for r in statuses[20:] if r.status == 200)
    metrics = await exchange(
        target.port, request_bytes("GET", "/metrics", key=target.victim_key), VICTIM
    )
    shown = [
        line.split()[1]
        for line in metrics.body.decode().splitlines()
        if line.startswith("sfhead_responses_stored_bytes ")
    ]
    held = f"/metrics {float(shown[0]) / 2**20:.1f} MiB" if shown else "not in /metrics"
    return Row(
        "doors-store-memory",
        "120 stored responses, each an input of 9,000 items; the head's memory over the last 100",
        f"{counted(statuses)}; last 100: {counted_mb:.1f} MiB of JSON, head RSS {grown:+.0f} "
        f"MB ({grown / max(counted_mb, 1e-9):.1f} MB per MiB); store {held}",
        "under 1 MB per MiB of JSON, figure in /metrics",
        bool(shown) and grown < counted_mb,
    )


Scenario = Callable[[Target], Awaitable[Row]]
SCENARIOS: list[tuple[str, Scenario]] = [
    ("encoded-path", encoded_path),
    ("suffix-at-key-limit", suffix_at_key_limit),
    ("n8-flood", n8_flood),
    ("idle-connections", idle_connections),
    ("bodies-to-healthz", bodies_to_healthz),
    ("unread-streams", unread_streams),
    ("doors-stored-response", doors_stored_response),
    ("doors-logit-bias", doors_logit_bias),
    ("doors-templates", doors_templates),
    ("doors-store-memory", doors_store_memory),
    ("doors-model-files", doors_model_files),
    ("doors-responses-input", doors_responses_input),
    ("doors-grammar-pool", doors_grammar_pool),
    ("doors-grammar", doors_grammar),
]
"""Every scenario, in the order they run: (name, coroutine function)."""

HEADER = "| scenario | tried | figure | pass condition | result |\n| --- | --- | --- | --- | --- |"


async def run(target: Target, names: Sequence[str]) -> list[Row]:
    rows = []
    for name, scenario in SCENARIOS:
        if names and name not in names:
            continue
        print(f"running {name} ...", flush=True)
        rows.append(await scenario(target))
        print(rows[-1].markdown(), flush=True)
    return rows


def attack(
    checkout: Path | None, names: Sequence[str], head_extra: Sequence[str], logs: Path
) -> list[Row]:
    """Start a node and a keyed head (from ``checkout``, else this one), run the scenarios."""
    logs.mkdir(parents=True, exist_ok=True)
    keys = {"attacker": "sk-attacker-" + "a" * 20, "victim": "sk-victim-" + "b" * 20}
    key_file = logs / "api-keys"
    key_file.write_text(f"{keys['attacker']}\n{keys['victim']}\n")
    node_args = ["--engine", "mock", "--max-lanes", str(LANES),
                 "--token-delay-ms", str(TOKEN_DELAY_MS), "--max-context", "131072"]  # fmt: skip
    head_args = ["--model-name", MODEL, "--api-key-file", str(key_file),
                 "--max-key-requests", "64", *head_extra]  # fmt: skip
    # PYTHONSAFEPATH: ``python -c`` would otherwise put the working folder (this checkout)
    # ahead of PYTHONPATH, and the baseline would run this checkout's code.
    baseline = [f"PYTHONPATH={checkout}", "PYTHONSAFEPATH=1"] if checkout is not None else []
    env = child_env(baseline)
    where = subprocess.run(
        [sys.executable, "-c", "import sfnode; print(sfnode.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    print(f"the processes import {where}", flush=True)
    head_help = subprocess.run(
        twistd("sfhead", "--help"), env=env, capture_output=True, text=True, check=True
    ).stdout
    if "--model-grace" in head_help:
        head_args = [*head_args, "--model-grace", "2"]
    with fleet_children(node_args, env, None, logs, head_args) as fleet:
        found = fleet.head.wait_for_line(rb"sfhead accepting nodes on 127\.0\.0\.1:(\d+)", 10)
        target = Target(
            fleet.port,
            fleet.head.process.pid,
            keys["attacker"],
            keys["victim"],
            fleet_port=int(found.group(1)),
            env=env,
            logs=logs,
            head_help=head_help,
        )
        print(f"head VmRSS at start: {target.rss_mb():.0f} MB", flush=True)
        return asyncio.run(run(target, names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        choices=[name for name, _ in SCENARIOS],
        help="run only this scenario (repeatable)",
    )
    parser.add_argument("--head-arg", action="append", default=[], help="one more sfhead option")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="a checkout to attack first, for comparison (its sfnode and plugins are used)",
    )
    options = parser.parse_args()
    guard_children()
    logs = Path(tempfile.mkdtemp(prefix="sfnode-abuse-"))
    print(f"{cpu_name()}; logs in {logs}", flush=True)
    tables: list[tuple[str, list[Row]]] = []
    try:
        if options.baseline is not None:
            print(f"\nbaseline: {options.baseline}", flush=True)
            rows = attack(options.baseline, options.only, options.head_arg, logs / "baseline")
            tables.append((f"baseline ({options.baseline})", rows))
            print("\nthis checkout", flush=True)
        rows = attack(None, options.only, options.head_arg, logs / "this")
        tables.append(("this checkout", rows))
    except BenchError as e:
        sys.exit(f"abuse: {e}")
    print(f"\nload average: {Path('/proc/loadavg').read_text().strip()}")
    for title, rows in tables:
        print(f"\n{title}\n\n{HEADER}")
        for row in rows:
            print(row.markdown())


if __name__ == "__main__":
    main()
