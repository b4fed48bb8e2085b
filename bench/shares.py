"""One client holding every lane, and a bystander: how long the bystander waits for its first
token (issue 34, docs/protocol.md section 8.5 "Shares").

Starts two ``twistd sfnode --engine mock`` nodes (``--max-lanes 8``, ``--token-delay-ms 20``:
16 lanes, 50 tokens a second each) and a ``twistd sfhead`` dialing both, each in its own process
on loopback, with the front door's per-address limits raised so that one address may open
every stream it likes.  The hog (127.0.0.1) opens ``--hogs`` streamed chats of
``--hog-tokens`` tokens and never reads a byte; once the head shows every lane busy, the
bystander (127.0.0.2) sends ``--rounds`` streamed chats of 8 tokens one after the other and
times each one's first token.  Prints one row per checkout:

    | checkout | hog streams | lanes busy | bystander first token | bystander answer |

``--baseline DIR`` first runs the same against the checkout in DIR (for example an export of
``main``), then against this one.

    PYTHONPATH=. .venv/bin/python bench/shares.py
    git archive main | tar -x -C /tmp/main
    PYTHONPATH=. .venv/bin/python bench/shares.py --baseline /tmp/main

This script only measures and prints; it asserts nothing, is never imported by the package, and
never leaves a process running when it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
from dataclasses import dataclass
from pathlib import Path

from _fleetproc import Child, child_env, get_json, guard_children, head_serving, shown, twistd

HOG = "127.0.0.1"
BYSTANDER = "127.0.0.2"
MODEL = "mock"
LANES = 8
NODES = 2
TOKEN_DELAY_MS = 20
READY_S = 120.0


@dataclass
class Figures:
    hogs_open: int
    lanes_busy: str
    first_token_s: list[float]
    whole_s: list[float]


def _post(body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nConnection: close\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )


def _chat(max_tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


async def _bystander(port: int) -> tuple[float, float]:
    """Seconds to the first text of a streamed chat from :data:`BYSTANDER`, and to its end."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(BYSTANDER, 0))
    writer.write(_post(_chat(8)))
    await writer.drain()
    first = None
    data = b""
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            break
        data += chunk
        if first is None and b'"content": "' in data.replace(b'"content": ""', b""):
            first = time.monotonic() - started
    writer.close()
    return (first if first is not None else float("nan")), time.monotonic() - started


async def _measure(port: int, hogs: int, hog_tokens: int, rounds: int) -> Figures:
    writers = []
    for _ in range(hogs):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(HOG, 0))
        except OSError:
            break
        writer.write(_post(_chat(hog_tokens)))
        writers.append(writer)
    await asyncio.sleep(3.0)
    try:
        health = get_json(f"http://127.0.0.1:{port}/healthz")
    except urllib.error.HTTPError as busy:  # 503 while every lane is busy: the same body
        health = json.load(busy)
    lanes = f"{health.get('lanes_active')}/{health.get('lanes_total')}"
    busy = f"{lanes} ({health.get('queued')} queued)"
    firsts, wholes = [], []
    for _ in range(rounds):
        first, whole = await _bystander(port)
        firsts.append(first)
        wholes.append(whole)
    for writer in writers:
        writer.transport.abort()
    return Figures(len(writers), busy, firsts, wholes)


def run(checkout: str | None, options: argparse.Namespace, logs: Path) -> Figures:
    """Two nodes and a head (from ``checkout``, else this one), the hog and the bystander."""
    logs.mkdir(parents=True, exist_ok=True)
    # PYTHONSAFEPATH: ``python -c`` would otherwise put the working folder (this checkout)
    # ahead of PYTHONPATH, and the baseline would run this checkout's code.
    env = child_env([f"PYTHONPATH={checkout}", "PYTHONSAFEPATH=1"] if checkout else [])
    where = subprocess.run(
        [sys.executable, "-c", "import sfnode; print(sfnode.__file__)"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    print(f"the processes import {where}", flush=True)
    children: list[Child] = []
    try:
        nodes = []
        for i in range(NODES):
            argv = twistd(
                "sfnode", "--listen", "tcp:0:interface=127.0.0.1", "--engine", "mock",
                "--identity", f"mock{i}", "--max-lanes", str(LANES),
                "--token-delay-ms", str(TOKEN_DELAY_MS),
            )  # fmt: skip
            print(f"starting {shown(argv)}", flush=True)
            node = Child(f"sfnode{i}", argv, env, logs / f"sfnode{i}.log", False)
            children.append(node)
            found = node.wait_for_line(rb"sfnode listening on 127\.0\.0\.1:(\d+)", READY_S)
            nodes += ["--node", f"tcp:127.0.0.1:{int(found.group(1))}"]
        argv = twistd(
            "sfhead", *nodes, "--http", "tcp:0:interface=127.0.0.1",
            "--fleet-listen", "tcp:0:interface=127.0.0.1", "--model-name", MODEL,
            "--max-client-requests", "1024", "--max-client-connections", "1024",
            "--max-connections", "2048", "--max-queued", "1024", "--max-client-queued", "0",
            "--queue-timeout", "0",
        )  # fmt: skip
        print(f"starting {shown(argv)}", flush=True)
        head = Child("sfhead", argv, env, logs / "sfhead.log", False)
        children.append(head)
        port = head_serving(head, NODES, READY_S)
        return asyncio.run(_measure(port, options.hogs, options.hog_tokens, options.rounds))
    finally:
        for child in reversed(children):
            child.stop()


def _row(name: str, figures: Figures) -> str:
    firsts = figures.first_token_s
    return (
        f"| {name} | {figures.hogs_open} | {figures.lanes_busy} | "
        f"{statistics.median(firsts):.3f} s, {max(firsts):.3f} s | "
        f"{statistics.median(figures.whole_s):.3f} s |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a checkout to measure first (e.g. main)")
    parser.add_argument("--hogs", type=int, default=200, help="streams the hog opens")
    parser.add_argument("--hog-tokens", type=int, default=400, help="tokens per hog stream")
    parser.add_argument("--rounds", type=int, default=5, help="bystander requests")
    options = parser.parse_args()
    guard_children()
    logs = Path(tempfile.mkdtemp(prefix="bench-shares-"))
    rows = []
    if options.baseline:
        rows.append(_row(f"baseline ({options.baseline})", run(options.baseline, options,
                                                               logs / "baseline")))  # fmt: skip
    rows.append(_row("this checkout", run(None, options, logs / "this")))
    print(f"\n{NODES} mock nodes x {LANES} lanes, {TOKEN_DELAY_MS} ms a token; "
          f"hog: {options.hogs} unread streams of {options.hog_tokens} tokens from {HOG}; "
          f"bystander: {options.rounds} streams of 8 tokens from {BYSTANDER}\n")  # fmt: skip
    print("| checkout | hog streams | lanes busy (queued) | bystander first token (median, max) "
          "| bystander whole answer (median) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for row in rows:
        print(row)
    print(f"\nlogs: {logs}")


if __name__ == "__main__":
    main()
