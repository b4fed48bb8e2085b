"""How long a node takes from its process start to the first token it serves, cold and warm.

Starts a real ``twistd -n sfnode --listen tcp:0`` (the bundled model unless ``--model``), waits
for its listening line, dials it with a Link F client (the head's own link) and asks for one
token of a short prompt; the time from just before the process was spawned to that token is the
figure.  *Cold* runs the node on an empty ``--cache-dir`` (it converts the GGUF model, packs
the weights, builds and measures its kernels); *warm* runs it again on the cache it just made,
``--runs`` times (the fastest and the median are shown: other work on a shared machine only
ever slows a start down).  With ``--phases`` it also prints, per start, when each line of the
node's log arrived, to see where the time goes.  Issue 24's target: warm, at most 2 s on the
bundled model.  Issue 32's target: warm, at most the floor import time + 1 s, where the floor is
a bare interpreter importing what every node imports (torch, twisted and its reactor), timed
in processes of its own (``--floor-runs``, the fastest shown) and printed beside the starts.

    .venv/bin/python bench/restart.py                    # cold once, warm three times
    .venv/bin/python bench/restart.py --no-cold --runs 5 --phases
    .venv/bin/python bench/restart.py --node-arg=--weights=float32

The node gets the environment of the shell that started the script, without ``OMP_WAIT_POLICY``.
This script only measures and prints; it asserts nothing, is not part of CI, is never imported
by the package, and never leaves a node running when it exits.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twisted.internet import defer, protocol, task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fleetproc import FLOOR, SHELL_ENV, cpu_name, twistd

PROMPT = list(range(100, 132))
"""A short prompt of plain token ids (any model with more than 132 tokens takes it)."""
READY_S = 900.0
"""A cold start converts the GGUF model: about half a minute, more on a busy machine."""
_LISTENING = re.compile(rb"sfnode listening on 127\.0\.0\.1:(\d+)")


@dataclass
class Start:
    """One start of the node: the seconds to its listening line and to its first token, and
    when each line of its output arrived."""

    label: str
    listening: float = 0.0
    first_token: float = 0.0
    lines: list[tuple[float, str]] = field(default_factory=list)


class NodeOutput(protocol.ProcessProtocol):
    """Collects the node's output lines with their arrival times; fires ``listening`` with its
    port and ``ended`` when it exits."""

    def __init__(self, started: float, start: Start) -> None:
        self.started = started
        self.start = start
        self.buffer = b""
        self.listening: defer.Deferred[int] = defer.Deferred()
        self.ended: defer.Deferred[None] = defer.Deferred()

    def outReceived(self, data: bytes) -> None:
        now = time.monotonic() - self.started
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            self.start.lines.append((now, line.decode(errors="replace")))
            found = _LISTENING.search(line)
            if found and not self.listening.called:
                self.start.listening = now
                self.listening.callback(int(found.group(1)))

    errReceived = outReceived

    def processEnded(self, reason: Any) -> None:
        if not self.listening.called:
            tail = "\n".join(text for _, text in self.start.lines[-25:])
            self.listening.errback(RuntimeError(f"the node exited before listening:\n{tail}"))
        self.ended.callback(None)


async def one_start(
    reactor: Any, label: str, cache: Path, options: argparse.Namespace
) -> Start:
    from sfnode.head.fleet.backend import HeadRequest
    from sfnode.head.link import HeadIds, connect_node

    model = ["--model", options.model] if options.model else []
    argv = twistd(
        "sfnode", "--listen", "tcp:0:interface=127.0.0.1", "--cache-dir", str(cache),
        *model, *options.node_arg,
    )  # fmt: skip
    env = {k: v for k, v in SHELL_ENV.items() if k != "OMP_WAIT_POLICY"}
    start = Start(label)
    started = time.monotonic()
    output = NodeOutput(started, start)
    process = reactor.spawnProcess(output, argv[0], argv, env=env)
    try:
        port = await defer.Deferred.fromCoroutine(_within(reactor, output.listening, READY_S))
        link = await connect_node(reactor, f"tcp:127.0.0.1:{port}", ids=HeadIds())
        try:
            link.assign(1)
            link.append(1, PROMPT)
            await link.generate(1, HeadRequest((), 1)).result
            start.first_token = time.monotonic() - started
        finally:
            await link.close()
    finally:
        if output.ended.called is False:
            process.signalProcess(signal.SIGTERM)
        await output.ended
    return start


async def _within(reactor: Any, d: defer.Deferred[int], seconds: float) -> int:
    d.addTimeout(seconds, reactor)
    return await d


def floor_seconds() -> float:
    """Seconds a fresh interpreter takes to import :data:`FLOOR` and exit."""
    import subprocess

    env = {k: v for k, v in SHELL_ENV.items() if k != "OMP_WAIT_POLICY"}
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", FLOOR], env=env, check=True)
    return time.monotonic() - started


def print_phases(start: Start) -> None:
    print(f"\n#### {start.label}: the node's log lines as they arrived\n")
    print("```")
    for at, text in start.lines:
        print(f"{at:7.2f} s  {text[:160]}")
    print("```")


async def main(reactor: Any, options: argparse.Namespace) -> None:
    print(f"CPU: {cpu_name()}; load average before: {open('/proc/loadavg').read().strip()}")
    shown = "twistd -n sfnode --listen tcp:0 --cache-dir DIR " + " ".join(
        [*(["--model", options.model] if options.model else []), *options.node_arg]
    )
    print(f"node: {shown}\n", flush=True)
    starts: list[Start] = []
    root = Path(tempfile.mkdtemp(prefix="sfnode-restart-"))
    try:
        if options.cache_dir:
            cache = Path(options.cache_dir).expanduser()
        else:
            cache = root / "cache"
        if options.cold:
            if options.cache_dir:
                cache = root / "cold-cache"
            print("cold start (empty cache) ...", flush=True)
            starts.append(await one_start(reactor, "cold", cache, options))
        for run in range(options.runs):
            print(f"warm start {run + 1} of {options.runs} ...", flush=True)
            starts.append(await one_start(reactor, f"warm {run + 1}", cache, options))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n| start | to listening | to first token |")
    print("|---|---|---|")
    for start in starts:
        print(f"| {start.label} | {start.listening:.2f} s | {start.first_token:.2f} s |")
    floors = [floor_seconds() for _ in range(options.floor_runs)]
    warm = [s.first_token for s in starts if s.label.startswith("warm")]
    if warm:
        best, median = min(warm), statistics.median(warm)
        print(f"\nwarm start to the first token: fastest {best:.2f} s, median {median:.2f} s")
    if warm and floors:
        floor = min(floors)
        met = "met" if best <= floor + 1.0 else "not met"
        print(
            f"\n| warm start to first token (fastest) | floor import time (fastest of "
            f"{len(floors)}) | difference | target: at most floor + 1 s |\n|---|---|---|---|\n"
            f"| {best:.2f} s | {floor:.2f} s | {best - floor:+.2f} s | {met} |"
        )
        print(f"\nfloor: python -c {FLOOR!r}")
    print(f"load average after: {open('/proc/loadavg').read().strip()}")
    if options.phases:
        for start in starts:
            print_phases(start)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Time from a node's process start to its first token, cold and warm.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="the node's --model (default: the bundled one)")
    p.add_argument(
        "--node-arg",
        action="append",
        default=[],
        help="an argument for the node, e.g. --node-arg=--weights=float32 (repeatable)",
    )
    p.add_argument("--runs", type=int, default=3, help="warm starts")
    p.add_argument(
        "--cold",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="start once on an empty cache first",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="the warm starts' --cache-dir (default: the one the cold start made, in a "
        "temporary folder removed at the end)",
    )
    p.add_argument("--phases", action="store_true", help="print each start's log lines, timed")
    p.add_argument("--floor-runs", type=int, default=3, help="timings of the floor imports")
    options = p.parse_args(argv)
    if options.runs < 0:
        p.error("--runs must be at least 0")
    if not options.cold and options.runs and not options.cache_dir:
        p.error("warm starts without a cold one need --cache-dir (e.g. ~/.cache/sfnode/models)")
    return options


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parsed = parse(None)
    task.react(lambda reactor: defer.Deferred.fromCoroutine(main(reactor, parsed)))
