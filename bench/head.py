"""The head alone, as an operator sees it: start time, resident memory, and how long a 5 MB prompt
delays a concurrent ``/healthz``.

Runs real processes: ``twistd sfhead`` on the bundled model (or ``--model``) and a mock-engine
``twistd sfnode`` with a window of a million tokens (so that the 5 MB prompt is tokenized, not
refused by the cheap length bound).  Prints:

- seconds from spawning ``twistd sfhead`` to its "serving HTTP" line, and its resident memory
  then (VmRSS) and whether libtorch is mapped;
- ``/healthz`` round trips while idle, and while the head parses and tokenizes a 5 MB prompt
  (median and worst), the time the big request took, and VmRSS right after it and a second
  later.

    PYTHONPATH=. python bench/head.py
    PYTHONPATH=. python bench/head.py --prompt-mb 20 --model ~/models/SomeModel

This script only measures and prints; it must never assert or be imported by the package.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TWISTD = "import sys; sys.argv[0] = 'twistd'; from twisted.scripts.twistd import run; run()"
LOOPBACK = "tcp:0:interface=127.0.0.1"


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", TWISTD, "--pidfile=", "-n", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
        )


def wait_for(log: Path, pattern: str, timeout: float = 600.0) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        time.sleep(0.01)
    raise SystemExit(f"timed out waiting for {pattern!r} in {log}:\n{log.read_text()}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def get(port: int, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", path, body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def health_times(port: int, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        get(port, "/healthz")
        out.append(time.perf_counter() - started)
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: bundled)")
    parser.add_argument("--prompt-mb", type=float, default=5.0)
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="sfhead-bench-"))
    node_log, head_log = folder / "node.log", folder / "head.log"
    node = spawn(
        ["sfnode", "--listen", LOOPBACK, "--engine", "mock", "--max-context", "1000000"],
        node_log,
    )
    head = None
    try:
        node_port = int(wait_for(node_log, r"sfnode listening on 127\.0\.0\.1:(\d+)").group(1))
        head_args = ["sfhead", "--http", LOOPBACK, "--fleet-listen", LOOPBACK,
                     "--node", f"tcp:127.0.0.1:{node_port}", "--max-body", "64M",
                     "--model-name", "mock"]  # fmt: skip
        if options.model:
            head_args += ["--model", options.model]
        started = time.perf_counter()
        head = spawn(head_args, head_log)
        port = int(wait_for(head_log, r"sfhead serving HTTP on 127\.0\.0\.1:(\d+)").group(1))
        start_s = time.perf_counter() - started
        start_rss = rss_mb(head.pid)
        torch = "libtorch" in Path(f"/proc/{head.pid}/maps").read_text()
        wait_for(head_log, r"node \S+ joined")
        print(f"start: {start_s:.2f} s to 'serving HTTP'; VmRSS {start_rss:.1f} MB; "
              f"libtorch mapped: {torch}")  # fmt: skip

        idle: list[float] = []
        for _ in range(50):
            t = time.perf_counter()
            get(port, "/healthz")
            idle.append(time.perf_counter() - t)
        small = json.dumps({"model": "mock", "prompt": "hello", "max_tokens": 4}).encode()
        post(port, "/v1/completions", small)
        print(f"/healthz idle: median {statistics.median(idle) * 1000:.1f} ms, "
              f"worst {max(idle) * 1000:.1f} ms; VmRSS {rss_mb(head.pid):.1f} MB")  # fmt: skip

        words = "the quick brown fox jumps over the lazy dog "
        prompt = (words * int(options.prompt_mb * 1e6 / len(words) + 1))[
            : int(options.prompt_mb * 1e6)
        ]
        body = json.dumps({"model": "mock", "prompt": prompt, "max_tokens": 1}).encode()
        stop = threading.Event()
        busy: list[float] = []
        poller = threading.Thread(target=health_times, args=(port, stop, busy))
        poller.start()
        t = time.perf_counter()
        status, content = post(port, "/v1/completions", body)
        big_s = time.perf_counter() - t
        stop.set()
        poller.join()
        after = rss_mb(head.pid)
        time.sleep(1.0)
        later = rss_mb(head.pid)
        print(
            f"{options.prompt_mb:g} MB prompt: HTTP {status} in {big_s:.2f} s ({content[:80]!r}...)"
        )
        print(
            f"/healthz during it: {len(busy)} answered, median "
            f"{statistics.median(busy) * 1000:.1f} ms, worst {max(busy) * 1000:.1f} ms"
        )
        print(f"VmRSS right after: {after:.1f} MB; one second later: {later:.1f} MB")
    finally:
        for process in (head, node):
            if process is not None:
                process.terminate()
                process.wait(30)
        print(f"logs in {folder}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
