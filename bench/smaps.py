"""Where the node's and the head's resident memory goes while serving (issue 32).

Starts ``twistd sfnode`` and ``twistd sfhead`` as ``bench/sizes.py`` starts them, on one GGUF
file (``--model``; default the Llama 3 Q4_K_M file ``bench/sizes.py`` makes), sends the warm-up
answer, waits for the node's start-up check, then the phases of ``bench/sizes.py`` (``--requests``
greedy streamed chat answers one at a time, then eight at once), and reads each process's
``/proc/PID/smaps`` as the last answer ends (serving) and :data:`peer.AT_REST_S` later (at
rest).  Printed per process: resident MB by kind of map, largest first (the heap; anonymous maps;
each file by its name, the model's file among them; the stack), with the total as ``VmRSS``
reads it.

    .venv/bin/python bench/smaps.py --cache-dir ~/.cache/sfnode/peer
    .venv/bin/python bench/smaps.py --model FILE.gguf --node-env MALLOC_ARENA_MAX=2

:func:`breakdown` is usable on any process id (``python bench/smaps.py --pid PID``).  This script
only measures and prints; it asserts nothing and never leaves a server running when it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import peer
from _fleetproc import (
    FLOOR,
    WARM_UP_TOPIC,
    Child,
    chat_body,
    child_env,
    fleet_processes,
    floor_mb,
    run_guarded,
    run_phase,
    served_model,
    topics,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def breakdown(pid: int) -> Counter[str]:
    """Resident KB of process ``pid`` by kind of map: ``[heap]``, ``[anon]`` (anonymous maps,
    the C heaps of threads and large allocations among them), ``[stack]``, and each mapped file
    by its base name (a library, the model's file)."""
    found: Counter[str] = Counter()
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            path = head[5].strip() if len(head) > 5 else ""
            name = os.path.basename(path) if path.startswith("/") else (path or "[anon]")
        elif line.startswith("Rss:"):
            found[name] += int(line.split()[1])
    return found


def regions(pid: int, top: int) -> str:
    """The ``top`` largest anonymous maps of process ``pid`` (the heap among them) by resident
    MB, with their size: glibc's arenas of threads are 64 MB maps, torch's and NumPy's large
    allocations maps of their own."""
    found: list[tuple[int, int, str]] = []
    size, name = 0, ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            first, _, last = head[0].partition("-")
            size = int(last, 16) - int(first, 16)
            name = head[5].strip() if len(head) > 5 else "[anon]"
        elif line.startswith("Rss:") and not name.startswith("/"):
            found.append((int(line.split()[1]), size, name))
    found.sort(reverse=True)
    return ", ".join(
        f"{rss / 1024:.1f} of {size / 2**20:.1f} {name}" for rss, size, name in found[:top]
    )


def memory_metrics(port: int) -> dict[str, float]:
    """The node's ``sfnode_resident_*`` gauges (``/metrics``) in MB, by the name after the
    prefix (``bytes``, ``weights_bytes``, ``kv_bytes``, ``rest_bytes``)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return {
        line.split("{")[0].split()[0].removeprefix("sfnode_resident_"): float(line.split()[-1])
        / 2**20
        for line in text.splitlines()
        if line.startswith("sfnode_resident_")
    }


def counted(figures: dict[str, float]) -> str:
    return ", ".join(f"{name} {mb:.1f}" for name, mb in figures.items())


def floor_target(figures: dict[str, float], floor: float) -> str:
    """Issue 32's target for the node without keys and values against the node's own count."""
    without_kv = figures["bytes"] - figures["kv_bytes"]
    target = floor + figures["weights_bytes"] + 60
    met = "met" if without_kv <= target else "not met"
    return (
        f"the node without keys and values {without_kv:.0f} MB; floor {floor:.0f} + weights "
        f"{figures['weights_bytes']:.0f} + 60 = {target:.0f} MB: {met}"
    )


def shown(found: Counter[str], top: int) -> str:
    """The breakdown in MB, largest first, the rest summed."""
    total = sum(found.values())
    items = found.most_common()
    parts = [f"{name} {kb / 1024:.1f}" for name, kb in items[:top]]
    rest = sum(kb for _, kb in items[top:])
    return f"{total / 1024:.0f} MB = " + ", ".join(parts) + f", the rest {rest / 1024:.1f}"


def run(options: argparse.Namespace) -> int:
    if options.pid is not None:
        print(f"pid {options.pid}: {shown(breakdown(options.pid), options.top)}")
        print(f"largest anonymous maps (MB resident of size): {regions(options.pid, options.top)}")
        return 0
    cache = (options.cache_dir or peer.default_cache()).expanduser().resolve()
    model = options.model or cache.parent / "sizes" / "llama3" / "llama3-Q4_K_M.gguf"
    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    children: list[Child] = []
    env = child_env(options.node_env)
    node_args = [*options.node_arg, peer.METRICS_ARG]
    with fleet_processes(node_args, env, model, logs, children) as port:
        found = children[0].wait_for_line(rb"sfnode metrics on 127\.0\.0\.1:(\d+)", 60.0)
        metrics_port = int(found.group(1))
        name = served_model(port)
        asyncio.run(run_phase(port, [chat_body(name, WARM_UP_TOPIC, options.max_tokens)], 1))
        peer.wait_for_check(children[0])
        bodies = [chat_body(name, topic, options.max_tokens) for topic in topics(options.requests)]
        for concurrency in (1, 8):
            print(f"  {len(bodies)} requests, {concurrency} at a time ...", flush=True)
            asyncio.run(run_phase(port, bodies, concurrency))
        serving = [breakdown(child.process.pid) for child in children]
        own = [memory_metrics(metrics_port)]
        time.sleep(peer.AT_REST_S)
        resting = [breakdown(child.process.pid) for child in children]
        own.append(memory_metrics(metrics_port))
        largest = [regions(child.process.pid, options.top) for child in children]
    print(f"\n{model.name}, {options.requests} requests of max_tokens {options.max_tokens}")
    for child, now, later, maps in zip(children, serving, resting, largest, strict=True):
        print(f"{child.name} serving: {shown(now, options.top)}")
        print(f"{child.name} at rest: {shown(later, options.top)}")
        print(f"{child.name} at rest, largest anonymous maps (MB resident of size): {maps}")
    print(f"the node's own count (MB), serving: {counted(own[0])}; at rest: {counted(own[1])}")
    floor = floor_mb()
    print(f"issue 32, serving: {floor_target(own[0], floor)}")
    print(f"issue 32, at rest: {floor_target(own[1], floor)}")
    print(f"floor: python -c {FLOOR!r}")
    return 0


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/smaps.py",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", type=Path, default=None, help="the GGUF file (default: see above)")
    p.add_argument("--pid", type=int, default=None, help="only print this process's breakdown")
    p.add_argument("--requests", type=int, default=8, help="requests per phase (default: 8)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens (default: 64)")
    p.add_argument("--top", type=int, default=12, help="kinds of map shown (default: 12)")
    p.add_argument("--node-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--node-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--cache-dir", type=Path, default=None, help="as bench/peer.py's")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_guarded("bench/smaps.py", run, parse(argv))


if __name__ == "__main__":
    sys.exit(main())
