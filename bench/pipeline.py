"""One full node against a pipeline of 2 and 3 stage nodes on one machine (issue 36).

Every server is its own process: ``twistd sfnode`` (one full node, or one per stage) and ``twistd
sfhead`` (``--node`` for the full node, ``--pipeline`` for the stages).  Each setup gets the same
greedy streamed chat requests, one at a time and eight at once; the script prints tokens/s side
by side with the ratio to the full node, the hidden-state bytes sent between stages per
generated token (from the head's log, which counts what it sends), and whether every text
equals the full node's.  By default the setups run one after the other, never two at once;
``--rounds N`` starts every setup first (the idle ones only send their status every 2 s), then
runs each setup's requests in turn N times, so a busier minute of the machine weighs on every
setup alike, and prints each round's ratios and the medians.  The stage nodes hand a
generation's steps to each other in a stage ring (docs/protocol.md section 12.10);
``--through-head`` adds, for each pipeline, the same stages with every step through the head
(``twistd sfhead --no-stage-ring``), side by side.

Usage (from the repository's root)::

    PYTHONPATH=. .venv/bin/python bench/pipeline.py          # a float32 random Llama (~3 min)
    PYTHONPATH=. .venv/bin/python bench/pipeline.py --model PATH --stages 2
    PYTHONPATH=. .venv/bin/python bench/pipeline.py --bundled   # SmolLM2, its default mode
    PYTHONPATH=. .venv/bin/python bench/pipeline.py --bundled --stages 2 --rounds 5 --streams 1
    PYTHONPATH=. .venv/bin/python bench/pipeline.py --bundled --stages 2 --through-head --rounds 5

The default model is a random float32 Llama (hidden 512, 8 layers, window 2048) with the tiny
tokenizer, saved to the logs folder; its EOS is the tokenizer's, which a pipeline's head stops
at as the node does (a model without one would run on where the head stops).  Every node runs
with ``--threads 1`` (``--node-arg`` adds arguments), so the full node and the stages share the
cores alike.  Each setup gets one short warm-up request, and the timing starts once every node
has logged the end of its start-up check of exactness (docs/engine.md section 4.1), which runs
after a node's first step.

This script must never be imported by the package or the tests, and never leave a process it
started running (:func:`_fleetproc.guard_children`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fleetproc import (
    NODE_READY_S,
    Child,
    Phase,
    chat_body,
    child_env,
    cpu_name,
    fleet_children,
    head_serving,
    run_guarded,
    run_phase,
    served_model,
    shown,
    topics,
    twistd,
)

TARGETS = {1: 0.8, 8: 0.9}
"""Two stages' tok/s over the full node's, per concurrency (issue 36)."""
_CHECKED = rb"checked: a position's KV and logits|the start-up check of exactness failed"
"""What a node logs when its start-up check of exactness is done (docs/engine.md section 4.1)."""
_FORWARDED = re.compile(rb"pipeline generation: (\d+) tokens, (\d+) bytes of hidden states")


@contextmanager
def pipeline_head(
    stages: int,
    model: Path | None,
    env: dict[str, str],
    logs: Path,
    node_args: Sequence[str],
    ring: bool = True,
) -> Iterator[tuple[int, list[Child]]]:
    """``stages`` ``twistd sfnode`` processes and ``twistd sfhead --pipeline`` over them (with
    ``--no-stage-ring`` unless ``ring``): yields the head's HTTP port once it serves, and the
    stage nodes; stops them all when the block ends."""
    children: list[Child] = []
    model_args = ["--model", str(model)] if model is not None else []
    try:
        endpoints = []
        for i in range(stages):
            argv = twistd(
                "sfnode", "--listen", "tcp:0:interface=127.0.0.1", *model_args,
                "--identity", f"stage{i}", *node_args,
            )  # fmt: skip
            print(f"starting {shown(argv)}", flush=True)
            child = Child(f"stage{i}", argv, env, logs / f"stage{i}.log", False)
            children.append(child)
            found = child.wait_for_line(rb"sfnode listening on 127\.0\.0\.1:(\d+)", NODE_READY_S)
            endpoints.append(f"tcp:127.0.0.1:{int(found.group(1))}")
        argv = twistd(
            "sfhead", "--pipeline", ",".join(endpoints), *model_args,
            "--http", "tcp:0:interface=127.0.0.1", "--fleet-listen", "tcp:0:interface=127.0.0.1",
            *([] if ring else ["--no-stage-ring"]),
        )  # fmt: skip
        print(f"starting {shown(argv)}", flush=True)
        head = Child("sfhead", argv, env, logs / "sfhead.log", False)
        children.append(head)
        yield head_serving(head, 0, NODE_READY_S), children[:-1]
    finally:
        for child in reversed(children):
            child.stop()


def warm(port: int, nodes: Sequence[Child]) -> None:
    """One warm-up request, then every node's start-up check."""
    asyncio.run(run_phase(port, [chat_body(served_model(port), "a warm-up", 8)], 1))
    wait_for_checks(nodes)


def run_phases(port: int, options: argparse.Namespace) -> dict[int, Phase]:
    """Each concurrency's requests (``--streams``), one after the other."""
    model = served_model(port)
    phases = {}
    for c in options.streams:
        count = options.requests if c == 1 else max(options.requests, 2 * c)
        bodies = [chat_body(model, topic, options.max_tokens) for topic in topics(count)]
        phases[c] = asyncio.run(run_phase(port, bodies, c))
        print(f"  {c} at once: {phases[c].rate:.1f} tok/s", flush=True)
    return phases


def wait_for_checks(nodes: Sequence[Child]) -> None:
    """Every node's start-up check of exactness done: it runs on a node's worker after its
    first step (docs/engine.md section 4.1), so requests timed while it runs would measure it,
    once per stage, instead of serving.  A failed check stops the bench."""
    for node in nodes:
        found = node.wait_for_line(_CHECKED, NODE_READY_S)
        if b"failed" in found.group(0):
            raise node.failed("its start-up check of exactness failed")


def forwarded_per_token(log: Path) -> float:
    """Hidden-state bytes sent between stages per generated token, from the head's log."""
    tokens = sent = 0
    for match in _FORWARDED.finditer(log.read_bytes()):
        tokens += int(match.group(1))
        sent += int(match.group(2))
    return sent / tokens if tokens else float("nan")


def texts(phases: dict[int, Phase]) -> list[list[str]]:
    return [[answer.text for answer in phases[c].answers] for c in sorted(phases)]


def differing(phases: dict[int, Phase], one: dict[int, Phase]) -> str:
    """Which answers differ from the full node's (concurrency and request index)."""
    out = []
    for c in sorted(phases):
        for i, (a, b) in enumerate(zip(phases[c].answers, one[c].answers, strict=True)):
            if a.text != b.text:
                out.append(f"{c} at once, request {i}")
    return "; ".join(out)


Rounds = list[dict[int, Phase]]
"""One setup's phases, a dict per round."""


def bench(options: argparse.Namespace) -> int:
    logs = Path(options.logs or tempfile.mkdtemp(prefix="sfnode-pipeline-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    model = options.model
    if model is None and not options.bundled:
        from tests.tinymodel import save_tiny_model

        model = save_tiny_model(
            logs / "model", hidden=options.hidden, layers=options.layers, window=2048
        )
    env = child_env([])
    node_args = ["--threads", "1", "--max-lanes", "8", *options.node_arg]
    shown_model = model or "the bundled one (default weights mode)"
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; model {shown_model}; logs in {logs}", flush=True)
    pipelines = {f"{n} stages": (n, True) for n in options.stages}
    if options.through_head:
        pipelines.update({f"{n} stages through the head": (n, False) for n in options.stages})
    folders = {"1 node": logs / "one"}
    folders.update(
        {
            name: logs / f"{n}-stages{'' if ring else '-through-head'}"
            for name, (n, ring) in pipelines.items()
        }
    )
    results: dict[str, Rounds] = {name: [] for name in folders}

    def start(name: str, running: ExitStack) -> int:
        """``name``'s setup started (stopped when ``running`` closes) and warmed up."""
        folder = folders[name]
        folder.mkdir(exist_ok=True)
        print(name, flush=True)
        if name == "1 node":
            fleet = running.enter_context(fleet_children(node_args, env, model, folder))
            port, nodes = fleet.port, [fleet.node]
        else:
            n, ring = pipelines[name]
            port, nodes = running.enter_context(
                pipeline_head(n, model, env, folder, node_args, ring)
            )
        warm(port, nodes)
        return port

    if options.rounds == 1:
        for name in folders:  # one setup at a time, each stopped before the next starts
            with ExitStack() as running:
                results[name].append(run_phases(start(name, running), options))
    else:
        with ExitStack() as running:
            ports = {name: start(name, running) for name in folders}
            for r in range(options.rounds):
                for name, port in ports.items():
                    print(f"round {r + 1}, {name}", flush=True)
                    results[name].append(run_phases(port, options))
    for name, folder in folders.items():
        (folder / "texts.json").write_text(json.dumps(texts(results[name][0]), indent=1))
    per_token = {
        name: forwarded_per_token(folder / "sfhead.log")
        for name, folder in folders.items()
        if name != "1 node"
    }
    return report(results, per_token, options.streams)


def report(results: dict[str, Rounds], per_token: dict[str, float], streams: Sequence[int]) -> int:
    one = results["1 node"]
    rounds = len(one)
    failed = False
    if rounds > 1:
        print()
        for name, runs in results.items():
            if name == "1 node":
                continue
            for c in streams:
                ratios = [run[c].rate / base[c].rate for run, base in zip(runs, one, strict=True)]
                shown_ratios = ", ".join(f"{r:.2f}" for r in ratios)
                print(f"{name}, {c} at once, ratio each round: {shown_ratios}")
    print()
    what = "median of " + str(rounds) + " rounds, " if rounds > 1 else ""
    print(
        "| setup | "
        + " | ".join(f"{what}tok/s, {c} at once | ratio" for c in streams)
        + " | bytes/token between stages | texts equal the node's |"
    )
    print("|---|" + "---|---|" * len(streams) + "---|---|")
    for name, runs in results.items():
        equal = all(texts(run) == texts(base) for run, base in zip(runs, one, strict=True))
        failed |= not equal
        if not equal:
            for run, base in zip(runs, one, strict=True):
                if texts(run) != texts(base):
                    print(f"{name}: answers that differ from the node's: {differing(run, base)}")
        cells = []
        for c in streams:
            rate = statistics.median(run[c].rate for run in runs)
            ratio = rate / statistics.median(base[c].rate for base in one)
            mark = ""
            if name == "2 stages" and c in TARGETS:
                ok = ratio >= TARGETS[c]
                failed |= not ok
                mark = f" (target {TARGETS[c]}: {'met' if ok else 'MISSED'})"
            cells.append(f"{rate:.1f} | {ratio:.2f}{mark}")
        sent = per_token.get(name)
        print(
            f"| {name} | {' | '.join(cells)} | {'-' if sent is None else f'{sent:.0f}'} | "
            f"{'yes' if equal else 'NO'} |"
        )
    return 1 if failed else 0


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="model folder or .gguf")
    p.add_argument("--bundled", action="store_true", help="the bundled model, as nodes serve it")
    p.add_argument("--hidden", type=int, default=512, help="the random Llama's hidden size")
    p.add_argument("--layers", type=int, default=8, help="the random Llama's layers")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3], help="pipelines to run")
    p.add_argument("--requests", type=int, default=8, help="requests per concurrency")
    p.add_argument(
        "--streams", type=int, nargs="+", default=[1, 8], help="concurrencies to run (1 8)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="every setup started at once, their requests run in turn this many times "
        "(default 1: one setup at a time)",
    )
    p.add_argument(
        "--through-head",
        action="store_true",
        help="also run each pipeline with every step through the head (--no-stage-ring)",
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--node-arg", action="append", default=[], help="more twistd sfnode args")
    p.add_argument("--logs", default=None, help="folder for the logs (default: a new one)")
    options = p.parse_args(argv)
    if options.rounds < 1 or min(options.streams) < 1:
        p.error("--rounds and every --streams value must be at least 1")
    return options


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    os.environ.pop("OMP_WAIT_POLICY", None)
    return run_guarded("bench/pipeline.py", bench, options)


if __name__ == "__main__":
    sys.exit(main())
