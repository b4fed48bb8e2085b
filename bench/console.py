"""What the console's feed costs the head: ``twistd sfhead`` in its own process with mock nodes
and 256 streams running, its CPU (% of one core) measured with no viewer and with 10 viewers on
``/console/feed``, side by side (issue 35's target: the feed costs less than 2% of one core).

The phases alternate (none, 10 viewers, none, 10 viewers, ...) for ``--rounds`` rounds of
``--seconds`` each, so a drift of the machine's load shows in both; the figure is the mean of
each mode and their difference.  It also prints the size of one update and how long the head
takes to answer ``/console/state`` (the snapshot built and encoded).

    PYTHONPATH=. .venv/bin/python bench/console.py            # ~2 min
    PYTHONPATH=. .venv/bin/python bench/console.py --streams 64 --seconds 5

The streams are ``/v1/completions`` with ``stream: true`` from this script's asyncio client
(raw sockets, every byte read); the viewers read their feed the same way.  For benchmark runs
only: never imported by the package or the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from bench._fleetproc import Child, child_env, run_guarded, shown, twistd

TARGET_PERCENT = 2.0


async def _hold(port: int, request: bytes, ready: asyncio.Event, counts: list[int]) -> None:
    """Open a connection, send ``request`` and read everything that comes until cancelled."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    first = True
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                return
            counts[0] += len(data)
            if first:
                first = False
                ready.set()
    finally:
        writer.close()


def _stream_request(port: int, max_tokens: int) -> bytes:
    body = json.dumps(
        {"model": "mock", "prompt": [100, 101, 102], "max_tokens": max_tokens, "stream": True}
    ).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
    ) % (port, len(body), body)


def _feed_request(port: int) -> bytes:
    return b"GET /console/feed HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % port


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


async def _measure(process: psutil.Process, seconds: float) -> float:
    """The head's CPU over ``seconds``, in % of one core."""
    before, start = _cpu_s(process), time.monotonic()
    await asyncio.sleep(seconds)
    return 100.0 * (_cpu_s(process) - before) / (time.monotonic() - start)


async def _phase(
    port: int, process: psutil.Process, viewers: int, seconds: float
) -> tuple[float, int]:
    """The head's CPU with ``viewers`` on the feed, and the bytes they got."""
    counts = [0]
    events = [asyncio.Event() for _ in range(viewers)]
    tasks = [
        asyncio.create_task(_hold(port, _feed_request(port), event, counts)) for event in events
    ]
    await asyncio.gather(*(e.wait() for e in events))
    await asyncio.sleep(1.0)  # the viewers' connections settle
    percent = await _measure(process, seconds)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(1.0)
    return percent, counts[0]


async def _run(options: argparse.Namespace, port: int, head: Child) -> int:
    process = psutil.Process(head.process.pid)
    counts = [0]
    started = [asyncio.Event() for _ in range(options.streams)]
    request = _stream_request(port, options.max_tokens)
    streams = [asyncio.create_task(_hold(port, request, e, counts)) for e in started]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5))
    print(f"{options.streams} streams running: lanes {health['lanes_active']}/"
          f"{health['lanes_total']}, requests {health['requests']}", flush=True)  # fmt: skip
    state = _state_figures(port)
    print(f"/console/state: {state[0]} bytes, answered in {state[1]:.1f} ms (median of 20)")
    idle: list[float] = []
    watched: list[float] = []
    fed = 0
    for round_ in range(options.rounds):
        percent, _ = await _phase(port, process, 0, options.seconds)
        idle.append(percent)
        percent, got = await _phase(port, process, options.viewers, options.seconds)
        watched.append(percent)
        fed += got
        print(f"round {round_ + 1}: no viewer {idle[-1]:5.1f} %   "
              f"{options.viewers} viewers {watched[-1]:5.1f} %", flush=True)  # fmt: skip
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    _report(options, idle, watched, fed)
    return 0


def _state_figures(port: int) -> tuple[int, float]:
    times = []
    size = 0
    for _ in range(20):
        start = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/console/state", timeout=5) as r:
            size = len(r.read())
        times.append(1000.0 * (time.perf_counter() - start))
    return size, statistics.median(times)


def _report(options: argparse.Namespace, idle: list[float], watched: list[float], fed: int) -> None:
    none, ten = statistics.mean(idle), statistics.mean(watched)
    cost = ten - none
    seconds = options.rounds * options.seconds
    print()
    print(f"| head CPU (% of one core), {options.streams} streams | no viewer | "
          f"{options.viewers} viewers | the feed's cost | target |")  # fmt: skip
    print("|---|---|---|---|---|")
    verdict = "met" if cost < TARGET_PERCENT else "**missed**"
    print(f"| mean of {options.rounds} x {options.seconds:g} s | {none:.1f} | {ten:.1f} | "
          f"{cost:+.1f} | < {TARGET_PERCENT:g} ({verdict}) |")  # fmt: skip
    print(f"\nthe viewers read {fed / max(1, options.viewers) / seconds / 1024:.1f} KiB/s each")


def _start(options: argparse.Namespace, logs: Path) -> tuple[int, Child]:
    env = child_env([])
    endpoints = []
    for index in range(options.nodes):
        argv = twistd(
            "sfnode", "--listen", "tcp:0:interface=127.0.0.1", "--engine", "mock",
            "--identity", f"mock-{index}", "--max-lanes", str(options.lanes),
            "--token-delay-ms", str(options.token_delay_ms),
        )  # fmt: skip
        print(f"starting {shown(argv)}", flush=True)
        node = Child(f"sfnode-{index}", argv, env, logs / f"sfnode-{index}.log", False)
        found = node.wait_for_line(rb"sfnode listening on 127\.0\.0\.1:(\d+)", 120)
        endpoints += ["--node", f"tcp:127.0.0.1:{int(found.group(1))}"]
    argv = twistd(
        "sfhead", *endpoints, "--http", "tcp:0:interface=127.0.0.1",
        "--fleet-listen", "tcp:0:interface=127.0.0.1", "--model-name", "mock",
        "--max-client-requests", "0", "--max-client-connections", "0",
        "--max-client-queued", "0",
    )  # fmt: skip
    print(f"starting {shown(argv)}", flush=True)
    head = Child("sfhead", argv, env, logs / "sfhead.log", False)
    found = head.wait_for_line(rb"sfhead serving HTTP on 127\.0\.0\.1:(\d+)", 120)
    port = int(found.group(1))
    deadline = time.monotonic() + 60
    while _live(port) < options.nodes:
        head.check_running()
        if time.monotonic() > deadline:
            raise head.failed("did not get its nodes within 60 s")
        time.sleep(0.25)
    return port, head


def _live(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return int(json.load(r).get("nodes", 0))
    except OSError:
        return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--viewers", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--lanes", type=int, default=64, help="lanes per node")
    parser.add_argument("--token-delay-ms", type=int, default=100, help="per token, per stream")
    parser.add_argument("--max-tokens", type=int, default=3000)
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=5)
    return parser


def run(options: argparse.Namespace) -> int:
    logs = Path(tempfile.mkdtemp(prefix="sfnode-bench-console-"))
    print(f"logs in {logs}")
    port, head = _start(options, logs)
    return asyncio.run(_run(options, port, head))


def main(argv: list[str]) -> int:
    return run_guarded("bench/console.py", run, _parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
