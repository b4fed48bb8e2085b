"""What the fleet promises when things go wrong or get crowded: seven serving scenarios, each with
its pass condition, run against ``twistd sfhead`` and ``twistd sfnode`` as real processes (and,
where the scenario can run there, against llama.cpp's ``llama-server``).

- **worker kill**: two nodes; a node SIGKILLed in the middle of a stream; the stream completes
  exactly (the same text and finish as an uninterrupted run, in the nodes' default weights
  mode: docs/protocol.md, D12).
- **daemon restart**: nodes dial the head; the node is restarted (SIGTERM, start again): the next
  requests are served; then the head is restarted: the node rejoins and requests are served
  within a few seconds of the head serving HTTP again.
- **agents + chat**: eight requests with ~1,200-word prompts and 64 new tokens each, then two
  seconds later a short chat ("What is the capital of France?"): the chat's first token within
  1.0 s, every agent finishes, and the agents' throughput drops by less than 15% against the same
  kind of agents with no chat.
- **KV exhaustion**: 32 concurrent near-window prompts against 8 lanes whose KV pool holds 8
  windows (the window made small with the node's ``--max-context``): all complete, none refused.
- **conversation**: 200 turns; each resends the history, trimmed by the client to the window
  (when it no longer fits, the oldest exchanges go, down to three quarters of it): every turn
  answered; the first-token time by turn is printed.
- **client disconnect**: one lane; a streaming client goes away after a few tokens; the next
  request starts at once (its first token within 0.5 s of its time on an idle server).
- **shared-prefix burst**: 32 requests at once sharing a ~1,000-token prompt: the shared part is
  prefilled at most twice, read from the node's ``sfnode_prefilled_tokens`` (llama-server:
  ``llamacpp:prompt_tokens_total``).

Sizes are scaled so that each scenario takes a few minutes or less on 2 cores with the bundled
model.  ``--engine tiny`` runs a tiny random Llama, ``--engine mock`` the mock engine (no model:
a check of the harness and of the head and node logic).  llama-server runs when bench/peer.py
built it (``~/.cache/sfnode/peer``; ``--peer no`` skips it), on the bundled GGUF file as it is.

    .venv/bin/python bench/semantics.py                        # every scenario, bundled model
    .venv/bin/python bench/semantics.py --engine mock          # the harness on the mock engine
    .venv/bin/python bench/semantics.py --only agents-chat --peer no

This script only measures and prints; it asserts nothing, is not part of CI, is never imported
by the package, and never leaves a server running when it exits (bench/_fleetproc.py's process
helpers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
# bench/_fleetproc.py: child processes; bench/peer.py: the llama-server it built.
import _fleetproc
import peer

SCENARIOS = (
    "worker-kill",
    "daemon-restart",
    "agents-chat",
    "kv-exhaustion",
    "conversation",
    "client-disconnect",
    "shared-prefix",
)
PEER_SCENARIOS = tuple(name for name in SCENARIOS if name != "worker-kill")
"""What can run against one llama-server (a worker kill needs two nodes behind one head)."""
CHAT_QUESTION = "What is the capital of France?"
CALL_TIMEOUT_S = 600.0
READY_S = 900.0
"""A node's first start converts the GGUF model; a busy machine makes everything slower."""
WORDS = (
    "the system request node lane token model cache prompt answer agent tool file line error "
    "value table index query result batch stream window block memory thread worker server head "
    "client budget latency report metric counter status review change commit branch merge test "
    "build deploy config option default limit queue order time second minute hour day week data "
    "record field column row schema user account session key secret policy rule check update "
    "create delete read write open close start stop run wait retry fail pass score summary "
    "should must could would will can may not and or but if then else when while for with from "
    "into over under after before between each every some many few more less first last next "
    "new old large small fast slow high low good bad clear exact simple careful complete"
).split()


# --- the client --------------------------------------------------------------------------------


@dataclass
class Reply:
    """One completion request as the client saw it (times in seconds from sending it)."""

    status: int = 0
    first: float | None = None
    """When the first chunk with text arrived (the whole answer, when not streamed)."""
    end: float = 0.0
    text: str = ""
    chunks: int = 0
    finish: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    longest_gap: float = 0.0
    error: str = ""
    request_class: str | None = None
    """The X-Request-Class header of the answer (sfhead names the class it used)."""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.finish is not None


async def _chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> Any:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()).strip():
                    pass
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        while data := await reader.read(65536):
            yield data


def _take(reply: Reply, body: dict[str, Any], elapsed: float) -> bool:
    """Fold one JSON body (a chunk or a whole answer) into ``reply``; True if it held text."""
    if "error" in body:
        reply.error = str(body["error"].get("message", body["error"]))
        return False
    texted = False
    for choice in body.get("choices") or []:
        delta = choice.get("delta") or choice.get("message") or {}
        text = delta.get("content") if isinstance(delta, dict) else None
        if text is None:
            text = choice.get("text")
        if text:
            reply.text += text
            reply.chunks += 1
            texted = True
            if reply.first is None:
                reply.first = elapsed
        if choice.get("finish_reason"):
            reply.finish = choice["finish_reason"]
    usage = body.get("usage")
    if usage:
        reply.prompt_tokens = usage.get("prompt_tokens", reply.prompt_tokens)
        reply.completion_tokens = usage.get("completion_tokens", reply.completion_tokens)
    return texted


async def call(*args: Any, **kwargs: Any) -> Reply:
    """:func:`request` bounded by :data:`CALL_TIMEOUT_S` (a hung server is a failed answer)."""
    try:
        return await asyncio.wait_for(request(*args, **kwargs), CALL_TIMEOUT_S)
    except TimeoutError:
        return Reply(error=f"no answer within {CALL_TIMEOUT_S:.0f} s")


async def request(
    port: int,
    path: str,
    body: dict[str, Any] | None = None,
    *,
    headers: dict[str, str] | None = None,
    on_text: Callable[[Reply], None] | None = None,
    leave_after: int | None = None,
) -> Reply:
    """One HTTP request on a fresh connection (GET when ``body`` is None).  ``on_text`` is
    called after each chunk with text; ``leave_after`` closes the connection after that many
    (a client that goes away)."""
    reply = Reply()
    payload = b"" if body is None else json.dumps(body).encode()
    method = "GET" if body is None else "POST"
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n{extra}\r\n"
    ).encode()
    started = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        reply.error = f"cannot connect: {e}"
        return reply
    try:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(head + payload)
        await writer.drain()
        status_line = (await reader.readline()).decode("latin-1").split()
        reply.status = int(status_line[1]) if len(status_line) > 1 else 0
        response_headers: dict[str, str] = {}
        while line := (await reader.readline()).decode("latin-1").strip():
            name, _, value = line.partition(":")
            response_headers[name.strip().lower()] = value.strip()
        reply.request_class = response_headers.get("x-request-class")
        streamed = "text/event-stream" in response_headers.get("content-type", "")
        buffer = b""
        last = started
        async for data in _chunks(reader, response_headers):
            now = time.perf_counter()
            reply.longest_gap = max(reply.longest_gap, now - last)
            last = now
            buffer += data.replace(b"\r\n", b"\n")
            if not streamed:
                continue
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                        continue
                    if _take(reply, json.loads(line[5:]), now - started) and on_text:
                        on_text(reply)
            if leave_after is not None and reply.chunks >= leave_after:
                reply.error = "left"
                return reply
        if method == "GET":
            reply.text = buffer.decode(errors="replace")
        elif not streamed and buffer:
            _take(reply, json.loads(buffer), time.perf_counter() - started)
        reply.end = time.perf_counter() - started
    except (OSError, ValueError, asyncio.IncompleteReadError) as e:
        reply.error = reply.error or f"{type(e).__name__}: {e}"
    finally:
        writer.close()
    return reply


async def get_text(port: int, path: str) -> str:
    """The body of ``GET path`` (empty when it failed)."""
    reply = await call(port, path)
    return reply.text if reply.status == 200 else ""


def metric(text: str, name: str) -> float | None:
    """The sum of every sample of ``name`` in Prometheus text (None when there is none)."""
    total = None
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


def words(count: int, seed: int) -> str:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        word = rng.choice(WORDS)
        out.append(word + ("." if i % 15 == 14 else ""))
    return " ".join(out)


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f} ms"


# --- servers -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Target:
    """A server the scenarios talk to: its HTTP port, the model name, how to build bodies."""

    name = ""
    port = 0
    model = ""
    chat = True
    """Whether prompts go to /v1/chat/completions (else /v1/completions with plain text)."""
    id_range = (1000, 30000)
    """Token ids a prompt of raw ids may use."""

    def body(
        self, text: str, max_tokens: int, *, stream: bool = True
    ) -> tuple[str, dict[str, Any]]:
        """A greedy completion request for ``text``: (path, body)."""
        common: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            common["stream_options"] = {"include_usage": True}
        if self.chat:
            return "/v1/chat/completions", {
                **common,
                "messages": [{"role": "user", "content": text}],
            }
        return "/v1/completions", {**common, "prompt": text}

    def messages_body(
        self, messages: list[dict[str, str]], max_tokens: int
    ) -> tuple[str, dict[str, Any]]:
        if self.chat:
            return self.body("", max_tokens)[0], {
                **self.body("", max_tokens)[1],
                "messages": messages,
            }
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.body(text, max_tokens)

    def ids_body(
        self, ids: Sequence[int], max_tokens: int, *, stream: bool = True
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(ids),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def learn_model(self) -> None:
        models = json.loads(asyncio.run(get_text(self.port, "/v1/models")) or "{}")
        self.model = str(models["data"][0]["id"])

    def prefilled(self) -> float | None:
        """Prompt tokens computed so far (all nodes), from the servers' metrics."""
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class Fleet(Target):
    """``twistd sfhead`` and ``twistd sfnode`` processes on fixed free ports."""

    def __init__(
        self,
        options: argparse.Namespace,
        logs: Path,
        *,
        nodes: int = 1,
        node_args: Sequence[str] = (),
        dial_in: bool = False,
    ) -> None:
        self.options = options
        self.logs = logs
        self.name = "sfnode"
        self.chat = options.engine != "tiny"
        self.id_range = (3, 500) if options.engine == "tiny" else (1000, 30000)
        self.port = free_port()
        self.fleet_port = free_port()
        self.node_ports = [free_port() for _ in range(nodes)]
        self.metrics_ports = [free_port() for _ in range(nodes)]
        self.node_args = list(node_args)
        self.dial_in = dial_in
        self.nodes: list[_fleetproc.Child | None] = [None] * nodes
        self.head: _fleetproc.Child | None = None
        self._spawned = 0

    def _spawn(self, name: str, args: Sequence[str]) -> _fleetproc.Child:
        self._spawned += 1
        log = self.logs / f"{name}-{self._spawned}.log"
        return _fleetproc.Child(
            name, _fleetproc.twistd(*args), _fleetproc.child_env(self.options.node_env), log, False
        )

    def start_node(self, index: int) -> _fleetproc.Child:
        if self.dial_in:
            where = ["--head", f"tcp:127.0.0.1:{self.fleet_port}"]
        else:
            where = ["--listen", f"tcp:{self.node_ports[index]}:interface=127.0.0.1"]
        node = self._spawn(
            f"node{index}",
            [
                "sfnode",
                *where,
                "--identity",
                f"node{index}",
                "--metrics",
                f"tcp:{self.metrics_ports[index]}:interface=127.0.0.1",
                *self.options.engine_node_args,
                *self.options.node_arg,
                *self.node_args,
            ],
        )
        self.nodes[index] = node
        if not self.dial_in:
            node.wait_for_line(rb"sfnode listening on", READY_S)
        return node

    def start_head(self) -> _fleetproc.Child:
        args = [
            "sfhead",
            "--http",
            f"tcp:{self.port}:interface=127.0.0.1",
            "--fleet-listen",
            f"tcp:{self.fleet_port}:interface=127.0.0.1",
            *self.options.engine_head_args,
            *self.options.head_arg,
        ]
        if not self.dial_in:
            for port in self.node_ports:
                args += ["--node", f"tcp:127.0.0.1:{port}"]
        self.head = self._spawn("head", args)
        self.head.wait_for_line(rb"sfhead serving HTTP on", READY_S)
        return self.head

    def wait_nodes(self, count: int | None = None) -> None:
        wanted = len(self.nodes) if count is None else count
        assert self.head is not None
        _fleetproc.wait_until(
            self.head,
            f"http://127.0.0.1:{self.port}/healthz",
            lambda body: body.get("nodes", 0) >= wanted,
            READY_S,
        )

    def start(self) -> Fleet:
        if self.dial_in:
            self.start_head()
            for index in range(len(self.nodes)):
                self.start_node(index)
        else:
            for index in range(len(self.nodes)):
                self.start_node(index)
            self.start_head()
        self.wait_nodes()
        self.learn_model()
        return self

    def node_metrics(self, index: int) -> str:
        return asyncio.run(get_text(self.metrics_ports[index], "/metrics"))

    async def node_metrics_async(self, index: int) -> str:
        return await get_text(self.metrics_ports[index], "/metrics")

    def prefilled(self) -> float | None:
        values = [
            metric(self.node_metrics(i), "sfnode_prefilled_tokens_total")
            for i in range(len(self.nodes))
        ]
        return None if any(v is None for v in values) else sum(v or 0.0 for v in values)

    def stop(self) -> None:
        if self.head is not None:
            self.head.stop()
        for node in self.nodes:
            if node is not None:
                node.stop()


class LlamaServer(Target):
    """llama.cpp's ``llama-server`` on the bundled GGUF file (bench/peer.py built it)."""

    def __init__(
        self,
        options: argparse.Namespace,
        logs: Path,
        *,
        parallel: int = 8,
        ctx_per_slot: int = 2048,
        extra: Sequence[str] = (),
    ) -> None:
        self.options = options
        self.logs = logs
        self.name = "llama-server"
        self.port = free_port()
        self.parallel = parallel
        self.ctx = ctx_per_slot * parallel
        self.extra = list(extra)
        self.child: _fleetproc.Child | None = None
        self._runs = 0

    def start(self) -> LlamaServer:
        self._runs += 1
        argv = [
            str(self.options.llama_server),
            "-m",
            str(self.options.gguf),
            "-t",
            "2",
            "-np",
            str(self.parallel),
            "-c",
            str(self.ctx),
            "--metrics",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.extra,
        ]
        self.child = _fleetproc.Child(
            "llama-server",
            argv,
            _fleetproc.child_env(()),
            self.logs / f"llama-server-{self._runs}.log",
            False,
        )
        _fleetproc.wait_until(
            self.child,
            f"http://127.0.0.1:{self.port}/health",
            lambda body: body.get("status") == "ok",
            READY_S,
        )
        self.learn_model()
        return self

    def prefilled(self) -> float | None:
        return metric(asyncio.run(get_text(self.port, "/metrics")), "llamacpp:prompt_tokens_total")

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()


# --- scenarios -----------------------------------------------------------------------------------


@dataclass
class Row:
    scenario: str
    server: str
    condition: str
    passed: bool | None
    figures: str

    @property
    def result(self) -> str:
        return "pass" if self.passed else "FAIL" if self.passed is False else "n/a"


def run_all(bodies: Sequence[Awaitable[Reply]]) -> list[Reply]:
    async def gather() -> list[Reply]:
        return list(await asyncio.gather(*bodies))

    return asyncio.run(gather())


def worker_kill(options: argparse.Namespace, logs: Path) -> Row:
    condition = "the stream completes exactly (same text and finish as without the kill)"
    # The continuation recomputes the delivered tokens as a prompt, which the engine computes
    # exactly as the decode steps that made them, in every weights mode (docs/protocol.md
    # section 8.5, decision D12).
    fleet = Fleet(options, logs, nodes=2).start()
    try:
        path, body = fleet.body(f"Tell a long story about {words(6, 1)}.", options.kill_tokens)
        reference = asyncio.run(call(fleet.port, path, body))

        async def killed() -> tuple[Reply, str]:
            started = asyncio.Event()
            task = asyncio.create_task(
                call(
                    fleet.port,
                    path,
                    body,
                    on_text=lambda r: started.set() if r.chunks >= options.kill_after else None,
                )
            )
            waiting = asyncio.create_task(started.wait())
            await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            victim = ""
            if task.done():
                return await task, victim
            for index in range(2):
                running = metric(await fleet.node_metrics_async(index), "sfnode_generations")
                node = fleet.nodes[index]
                if running and node is not None and node.process.poll() is None:
                    os.kill(node.process.pid, signal.SIGKILL)
                    victim = f"node{index}"
                    break
            return await task, victim

        reply, victim = asyncio.run(killed())
    finally:
        fleet.stop()
    exact = reply.ok and reply.text == reference.text and reply.finish == reference.finish
    figures = (
        f"killed {victim or 'no node (none was running it)'} after {options.kill_after} chunks; "
        f"{reply.chunks} chunks, finish {reply.finish}, longest stall {ms(reply.longest_gap)}, "
        f"{reply.end:.1f} s (uninterrupted {reference.end:.1f} s)"
    )
    if reply.text != reference.text:
        same = next(
            (i for i, (a, b) in enumerate(zip(reply.text, reference.text, strict=False)) if a != b),
            min(len(reply.text), len(reference.text)),
        )
        figures += (
            f"; the texts part after {same} of {len(reference.text)} characters: "
            f"{reference.text[same : same + 30]!r} uninterrupted, {reply.text[same : same + 30]!r} "
            "after the kill"
        )
    if not reply.ok:
        figures += f"; error {reply.error or reply.status}"
    return Row("worker kill", "sfnode", condition, exact and bool(victim), figures)


def daemon_restart(options: argparse.Namespace, logs: Path) -> list[Row]:
    rows = []
    fleet = Fleet(options, logs, dial_in=True).start()
    try:
        path, body = fleet.body("Say hello.", 8)
        before = asyncio.run(call(fleet.port, path, body))
        node = fleet.nodes[0]
        assert node is not None
        node.stop()
        restarted = time.perf_counter()
        fleet.start_node(0)
        sent = time.perf_counter() - restarted
        replies = run_all([call(fleet.port, path, body) for _ in range(3)])
        served = all(r.ok for r in replies)
        first = min((r.first for r in replies if r.first is not None), default=None)
        rows.append(
            Row(
                "daemon restart: node",
                "sfnode",
                "the next requests are served",
                before.ok and served,
                f"3 requests sent as the node restarted: {sum(r.ok for r in replies)}/3 served, "
                "the "
                f"first token {sent + (first or float('nan')):.1f} s after the restart began",
            )
        )
        assert fleet.head is not None
        fleet.head.stop()
        fleet.start_head()
        serving = time.perf_counter()
        replies = run_all([call(fleet.port, path, body) for _ in range(3)])
        waited = max((r.end for r in replies), default=0.0)
        ok = all(r.ok for r in replies)
        rows.append(
            Row(
                "daemon restart: head",
                "sfnode",
                "the node rejoins and requests are served within 5 s of the head serving HTTP",
                ok and waited <= 5.0,
                f"3 requests sent when the new head served HTTP: {sum(r.ok for r in replies)}/3 "
                f"served, all answered within {waited:.1f} s "
                f"({time.perf_counter() - serving:.1f} s after it served)",
            )
        )
    finally:
        fleet.stop()
    return rows


def daemon_restart_peer(options: argparse.Namespace, logs: Path) -> list[Row]:
    server = LlamaServer(options, logs).start()
    try:
        path, body = server.body("Say hello.", 8)
        before = asyncio.run(call(server.port, path, body))
        server.stop()
        restarted = time.perf_counter()
        server.start()
        ready = time.perf_counter() - restarted
        replies = run_all([call(server.port, path, body) for _ in range(3)])
    finally:
        server.stop()
    return [
        Row(
            "daemon restart: server",
            "llama-server",
            "the next requests are served",
            before.ok and all(r.ok for r in replies),
            f"ready {ready:.1f} s after the restart began; {sum(r.ok for r in replies)}/3 served",
        )
    ]


def agents_chat(target: Target, options: argparse.Namespace) -> Row:
    condition = (
        "chat first token <= 1.0 s, every agent finishes, agent throughput drops "
        "< 15% against the same agents with no chat"
    )
    try:
        path, warm = target.body("Warm up: say a word.", 4)
        asyncio.run(call(target.port, path, warm))
        chat_path, chat_body = target.body(CHAT_QUESTION, 16)
        idle = asyncio.run(call(target.port, chat_path, chat_body))

        def agents(seed: int) -> list[tuple[str, dict[str, Any]]]:
            return [
                target.body(
                    f"You are agent {i}. Read these notes and list the three most important "
                    f"actions.\n\n{words(options.agent_words, seed * 100 + i)}",
                    options.agent_tokens,
                )
                for i in range(options.agents)
            ]

        async def phase(seed: int, chat: bool) -> tuple[list[Reply], Reply | None]:
            tasks = [asyncio.create_task(call(target.port, p, b)) for p, b in agents(seed)]
            chat_reply = None
            if chat:
                await asyncio.sleep(options.chat_delay)
                chat_reply = await call(target.port, chat_path, chat_body)
            return list(await asyncio.gather(*tasks)), chat_reply

        alone, _ = asyncio.run(phase(1, chat=False))
        mixed, chat = asyncio.run(phase(2, chat=True))
    finally:
        target.stop()
    assert chat is not None

    def rate(replies: list[Reply]) -> float:
        # The agents were sent together: their throughput runs until the last one ended.
        wall = max(r.end for r in replies)
        return sum(r.completion_tokens or r.chunks for r in replies) / wall if wall else 0.0

    alone_rate, mixed_rate = rate(alone), rate(mixed)
    drop = 1 - mixed_rate / alone_rate if alone_rate else float("nan")
    finished = sum(r.ok for r in alone) + sum(r.ok for r in mixed)
    passed = (
        chat.ok
        and chat.first is not None
        and chat.first <= 1.0
        and finished == 2 * options.agents
        and drop < 0.15
    )
    prompt = statistics.mean(r.prompt_tokens or 0 for r in mixed)
    classes = sorted({r.request_class or "-" for r in mixed})
    figures = (
        f"chat first token {ms(chat.first)} (alone on the idle server {ms(idle.first)}; class "
        f"{chat.request_class or '-'}), answer "
        f"{chat.text.strip()[:60]!r}; agents finished {finished}/{2 * options.agents}, "
        f"{prompt:.0f} prompt tokens each (class {'/'.join(classes)}); agent throughput "
        f"{alone_rate:.1f} tok/s alone, {mixed_rate:.1f} with the chat ({100 * drop:+.1f}% drop); "
        f"the agents took {max(r.end for r in alone):.1f} / {max(r.end for r in mixed):.1f} s"
    )
    return Row("agents + chat", target.name, condition, passed, figures)


def kv_exhaustion(target: Target, options: argparse.Namespace) -> Row:
    condition = f"{options.kv_requests} concurrent near-window prompts: all complete, none refused"
    try:
        length = options.kv_window - options.kv_tokens - 8
        rng = random.Random(5)
        low, high = target.id_range
        bodies = [
            target.ids_body([rng.randrange(low, high) for _ in range(length)], options.kv_tokens)
            for _ in range(options.kv_requests)
        ]
        started = time.perf_counter()
        replies = run_all([call(target.port, "/v1/completions", b) for b in bodies])
        wall = time.perf_counter() - started
    finally:
        target.stop()
    done = sum(r.ok for r in replies)
    refused = [r.status for r in replies if r.status != 200]
    errors = sorted({r.error[:80] for r in replies if r.error})
    figures = (
        f"{done}/{len(replies)} complete, {len(refused)} refused "
        f"({', '.join(map(str, sorted(set(refused)))) or 'none'}), prompts of {length} tokens, "
        f"window {options.kv_window}, in {wall:.1f} s; first token median "
        f"{ms(statistics.median([r.first for r in replies if r.first is not None] or [0.0]))}, "
        f"max {ms(max((r.first for r in replies if r.first is not None), default=None))}"
        + (f"; errors: {errors}" if errors else "")
    )
    return Row(
        "KV exhaustion", target.name, condition, done == len(replies) and not refused, figures
    )


def conversation(target: Target, options: argparse.Namespace) -> Row:
    condition = (
        f"{options.turns} turns, each resending the history trimmed to the window: every turn "
        "answered"
    )
    from sfnode.head.models.chat import ChatMessage
    from sfnode.head.models.text import Renderer
    from sfnode.head.tap import load_head_tokenizer

    renderer = Renderer(load_head_tokenizer(options.head_model))
    budget = options.conv_window - options.conv_tokens - 8

    def length(messages: list[dict[str, str]]) -> int:
        if target.chat:
            return len(renderer.chat([ChatMessage(m["role"], m["content"]) for m in messages]))
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return len(renderer.completion(text))

    history: list[dict[str, str]] = []
    firsts: list[float | None] = []
    answered = 0
    trimmed = 0
    lengths = []
    started = time.perf_counter()
    try:
        for turn in range(1, options.turns + 1):
            history.append(
                {
                    "role": "user",
                    "content": f"Turn {turn}: tell me one short fact about the number {turn}.",
                }
            )
            if length(history) > budget:
                # Like a chat client: drop the oldest exchanges, down to three quarters of the
                # window, so that the next turns extend the same prefix again.
                while length(history) > budget * 3 // 4 and len(history) > 1:
                    del history[:2]
                    trimmed += 1
            lengths.append(length(history))
            path, body = target.messages_body(history, options.conv_tokens)
            reply = asyncio.run(call(target.port, path, body))
            firsts.append(reply.first)
            if reply.ok:
                answered += 1
            history.append({"role": "assistant", "content": reply.text or "(no answer)"})
    finally:
        target.stop()
    wall = time.perf_counter() - started
    marks = sorted({1, *range(25, options.turns + 1, 25), options.turns})
    by_turn = ", ".join(f"{t}: {ms(firsts[t - 1])}" for t in marks if t <= len(firsts))
    known = [f for f in firsts if f is not None]
    head_tail = ""
    if len(known) >= 40:
        head_tail = (
            f"; median of turns 1-20 {ms(statistics.median(known[:20]))}, "
            f"of the last 20 {ms(statistics.median(known[-20:]))}"
        )
    figures = (
        f"{answered}/{options.turns} answered in {wall:.0f} s; window {options.conv_window}, "
        f"prompts up to {max(lengths, default=0)} tokens, {trimmed} oldest exchanges trimmed; "
        f"first token by turn {by_turn}{head_tail}"
    )
    return Row("conversation", target.name, condition, answered == options.turns, figures)


def client_disconnect(target: Target, options: argparse.Namespace, fleet: Fleet | None) -> Row:
    condition = (
        "one lane: after a streaming client leaves, the next request's first token within 0.5 s "
        "of its time on an idle server"
    )
    try:
        path, long_body = target.body(
            f"Write a very long essay about {words(5, 7)}.", options.disconnect_tokens
        )
        next_path, next_body = target.body("Name a colour.", 8)
        asyncio.run(call(target.port, next_path, next_body))  # warm up
        idle = asyncio.run(call(target.port, next_path, next_body))

        async def scenario() -> tuple[Reply, Reply]:
            left = await call(target.port, path, long_body, leave_after=options.leave_after)
            return left, await call(target.port, next_path, next_body)

        left, following = asyncio.run(scenario())
        decoded = None
        if fleet is not None:
            # Tokens the node decoded in all: the abandoned stream's, had it run to its end,
            # would show here.
            decoded = metric(fleet.node_metrics(0), "sfnode_decoded_tokens_total")
    finally:
        target.stop()
    delay = None if following.first is None or idle.first is None else following.first - idle.first
    passed = (
        following.ok and delay is not None and delay <= 0.5 and left.chunks >= options.leave_after
    )
    figures = (
        f"left after {left.chunks} chunks; next request's first token {ms(following.first)} "
        f"(idle {ms(idle.first)}, {ms(delay)} later)"
        + (
            ""
            if decoded is None
            else f"; the node decoded {decoded:.0f} tokens in all "
            f"(the abandoned stream asked for {options.disconnect_tokens})"
        )
    )
    return Row("client disconnect", target.name, condition, passed, figures)


def shared_prefix(target: Target, options: argparse.Namespace) -> Row:
    condition = (
        f"{options.shared_requests} requests at once sharing a {options.shared_tokens}-token "
        "prompt: the shared part prefilled at most twice"
    )
    try:
        rng = random.Random(11)
        low, high = target.id_range
        shared = [rng.randrange(low, high) for _ in range(options.shared_tokens)]
        bodies = [
            target.ids_body(
                shared + [rng.randrange(low, high) for _ in range(options.shared_unique)],
                options.shared_out,
            )
            for _ in range(options.shared_requests)
        ]
        # A warm-up on a prompt that shares nothing with the burst.
        asyncio.run(call(target.port, "/v1/completions", target.ids_body([low + 1] * 8, 2)))
        before = target.prefilled()
        started = time.perf_counter()
        replies = run_all([call(target.port, "/v1/completions", b) for b in bodies])
        wall = time.perf_counter() - started
        after = target.prefilled()
    finally:
        target.stop()
    done = sum(r.ok for r in replies)
    if before is None or after is None:
        return Row(
            "shared-prefix burst",
            target.name,
            condition,
            None,
            f"{done}/{len(replies)} answered; no prefilled-token counter to read",
        )
    computed = after - before
    unique = options.shared_requests * (options.shared_unique + options.shared_tokens % 16)
    aligned = options.shared_tokens - options.shared_tokens % 16
    times = (computed - unique) / aligned if aligned else float("nan")
    figures = (
        f"{done}/{len(replies)} answered in {wall:.1f} s; {computed:.0f} prompt tokens computed "
        f"for {options.shared_requests} x {options.shared_tokens + options.shared_unique}: the "
        f"shared part {times:.2f} times"
    )
    return Row(
        "shared-prefix burst",
        target.name,
        condition,
        done == len(replies) and times <= 2.0,
        figures,
    )


# --- which servers each scenario runs on ------------------------------------------------------

Runner = Callable[[argparse.Namespace, Path], "Row | list[Row]"]


def kv_node_args(options: argparse.Namespace) -> list[str]:
    """A small window and a KV pool of exactly ``kv_lanes`` windows (transformers only)."""
    args = [f"--max-context={options.kv_window}", f"--max-lanes={options.kv_lanes}"]
    if options.transformers:
        args.append(f"--kv-blocks={options.kv_lanes * options.kv_window // 16}")
    return args


def fleet_disconnect(options: argparse.Namespace, logs: Path) -> Row:
    fleet = Fleet(options, logs, node_args=["--max-lanes=1"]).start()
    return client_disconnect(fleet, options, fleet)


RUNNERS: dict[str, tuple[Runner, Runner | None]] = {
    "worker-kill": (worker_kill, None),
    "daemon-restart": (daemon_restart, daemon_restart_peer),
    "agents-chat": (
        lambda o, logs: agents_chat(Fleet(o, logs).start(), o),
        lambda o, logs: agents_chat(LlamaServer(o, logs).start(), o),
    ),
    "kv-exhaustion": (
        lambda o, logs: kv_exhaustion(Fleet(o, logs, node_args=kv_node_args(o)).start(), o),
        lambda o, logs: kv_exhaustion(
            LlamaServer(o, logs, parallel=o.kv_lanes, ctx_per_slot=o.kv_window).start(), o
        ),
    ),
    "conversation": (
        lambda o, logs: conversation(
            Fleet(o, logs, node_args=[f"--max-context={o.conv_window}"]).start(), o
        ),
        lambda o, logs: conversation(
            LlamaServer(o, logs, parallel=1, ctx_per_slot=o.conv_window).start(), o
        ),
    ),
    "client-disconnect": (
        fleet_disconnect,
        lambda o, logs: client_disconnect(LlamaServer(o, logs, parallel=1).start(), o, None),
    ),
    "shared-prefix": (
        lambda o, logs: shared_prefix(Fleet(o, logs).start(), o),
        lambda o, logs: shared_prefix(LlamaServer(o, logs).start(), o),
    ),
}


# --- main ----------------------------------------------------------------------------------------


def engine_args(options: argparse.Namespace, scratch: Path) -> None:
    """Fill in the node and head arguments, and the head's tokenizer, for ``--engine``."""
    if options.engine == "mock":
        options.engine_node_args = [
            "--engine",
            "mock",
            "--token-delay-ms",
            str(options.token_delay_ms),
        ]
        options.engine_head_args = ["--model-name", "mock"]
        options.head_model = None
        options.transformers = False
    elif options.engine == "tiny":
        from tests.tinymodel import save_tiny_model

        folder = save_tiny_model(scratch / "tiny", window=8192)
        options.engine_node_args = ["--model", str(folder)]
        options.engine_head_args = ["--model", str(folder)]
        options.head_model = str(folder)
        options.transformers = True
    else:
        model = [] if options.model is None else ["--model", str(options.model)]
        options.engine_node_args = model
        options.engine_head_args = model
        options.head_model = None if options.model is None else str(options.model)
        options.transformers = True


def run(options: argparse.Namespace) -> int:
    scratch = Path(tempfile.mkdtemp(prefix="sfnode-semantics-"))
    logs = scratch / "logs"
    logs.mkdir()
    engine_args(options, scratch)
    peer_ok = False
    if options.peer != "no" and options.engine == "bundled" and options.model is None:
        server = peer.binaries(peer.default_cache())["llama-server"]
        if os.access(server, os.X_OK):
            from sfnode.engines.weights.loading import default_gguf

            options.llama_server, options.gguf, peer_ok = server, default_gguf(), True
        elif options.peer == "yes":
            raise _fleetproc.BenchError(
                f"no llama-server at {server}: run bench/peer.py --build-only"
            )
    chosen = options.only or list(SCENARIOS)
    print(
        f"{_fleetproc.cpu_name()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}; engine "
        f"{options.engine}; llama-server {'yes' if peer_ok else 'no'}; logs in {logs}",
        flush=True,
    )
    rows: list[Row] = []

    def attempt(name: str, server: str, runner: Runner) -> None:
        print(f"- {name} on {server} ...", flush=True)
        began = time.perf_counter()
        try:
            result = runner(options, logs)
        except (_fleetproc.BenchError, OSError, AssertionError, KeyError, ValueError) as e:
            # Reported in the table (and its traceback here); the next scenario starts clean.
            traceback.print_exc()
            _fleetproc.stop_children()
            result = Row(name, server, "-", False, f"could not run: {str(e)[:300]}")
        for row in result if isinstance(result, list) else [result]:
            row.figures += f" [{time.perf_counter() - began:.0f} s]"
            rows.append(row)
            print(f"  {row.result}: {row.figures}", flush=True)

    for name in chosen:
        fleet_runner, peer_runner = RUNNERS[name]
        attempt(name, "sfnode", fleet_runner)
        if peer_ok and peer_runner is not None:
            attempt(name, "llama-server", peer_runner)

    load = os.getloadavg()[0]
    print(f"\n### Serving semantics (engine {options.engine}; load {load:.2f} at the end)\n")
    print("| scenario | server | pass condition | result | figures |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.scenario} | {row.server} | {row.condition} | {row.result} | {row.figures} |")
    for label in sorted({r.server for r in rows}):
        mine = [r for r in rows if r.server == label]
        print(f"\n{label}: {sum(bool(r.passed) for r in mine)}/{len(mine)} passed")
    return 0


SIZES: dict[str, int | float] = {
    "kill-tokens": 96, "kill-after": 3,
    "agents": 8, "agent-words": 1200, "agent-tokens": 64, "chat-delay": 2.0,
    "kv-requests": 32, "kv-lanes": 8, "kv-window": 512, "kv-tokens": 16,
    "turns": 200, "conv-window": 1024, "conv-tokens": 16,
    "disconnect-tokens": 400, "leave-after": 4,
    "shared-requests": 32, "shared-tokens": 1008, "shared-unique": 8, "shared-out": 4,
}  # fmt: skip
"""The sizes of the scenarios (``--NAME VALUE``, one line a scenario) and their defaults."""
SIZE_HELP = {"kill-after": "chunks before the SIGKILL", "kv-window": "the node's --max-context"}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    paragraphs = __doc__.split("\n\n")
    p = argparse.ArgumentParser(
        prog="bench/semantics.py",
        description="\n\n".join(paragraphs[:3]),
        epilog="examples:\n\n" + next(t for t in paragraphs if t.startswith("    .venv")),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--engine",
        choices=("bundled", "tiny", "mock"),
        default="bundled",
        help="the nodes' engine: the bundled SmolLM2 (default), a tiny random Llama, "
        "or the mock engine",
    )
    p.add_argument("--model", type=Path, default=None, help="another model for --engine bundled")
    p.add_argument(
        "--only", action="append", choices=SCENARIOS, help="run this scenario (repeatable)"
    )
    p.add_argument(
        "--peer",
        choices=("auto", "yes", "no"),
        default="auto",
        help="run llama-server too: when built (auto), always, or never",
    )
    p.add_argument(
        "--node-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for sfhead and sfnode, repeatable",
    )
    p.add_argument(
        "--node-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for every twistd sfnode, repeatable (write it with '=', e.g. "
        "--node-arg=--weights=float32)",
    )
    p.add_argument(
        "--head-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for twistd sfhead, repeatable (write it with '=')",
    )
    p.add_argument(
        "--token-delay-ms", type=int, default=20, help="the mock engine's delay per token"
    )
    sizes = p.add_argument_group("sizes")
    for name, default in SIZES.items():
        sizes.add_argument(
            f"--{name}", type=type(default), default=default, help=SIZE_HELP.get(name)
        )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return _fleetproc.run_guarded("bench/semantics.py", run, parse(argv))


if __name__ == "__main__":
    sys.exit(main())
