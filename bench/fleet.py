"""What the fleet costs: the engine alone against the same requests through HTTP, head and node.

Two modes, run one after the other (never at once), on the same greedy chat requests:

- **engine alone**: the engine in this process, built exactly as ``twistd sfnode`` builds it
  (``sfnode.node.tap.build_engine`` with the node's options), each request's context rendered as the
  head renders it, submitted directly;
- **fleet**: the same requests as streamed OpenAI ``/v1/chat/completions`` requests to a real
  ``twistd sfhead`` and ``twistd sfnode``, separate processes on free loopback ports, with
  default settings plus ``--node-arg`` (client -> HTTP -> head -> Link F -> node -> engine).

Each round runs every concurrency (``--concurrency``, default 1 and 8) in both modes, the two
modes in turn (which goes first alternates between rounds); every phase gets prompts of its own,
the same in both modes, so no phase finds its prompts in a prefix cache.  Printed per mode and
concurrency: aggregate tokens/s (completion tokens over the phase's wall time) and time to the
first token (median, p90), the best of the rounds (other work only ever slows a run down); then
the throughput ratio fleet/engine (target >= 0.95) and the median first-token time the fleet adds
(target <= 10 ms), met or missed, and whether both modes generated the same texts.

One deliberate difference from a second ``twistd sfnode`` start: with quantized weights, the
row count from which prompt chunks are multiplied by dense bfloat16 copies is timed when an
engine starts (docs/engine.md section 5), and on a busy machine two starts often pick different
ones (8, 32, 64 and 128 rows were all seen here), which changes how fast prompts are computed and,
through rounding, the greedy texts.  So the node is started first and the in-process engine
takes the node's choice (from its log) instead of timing its own; ``--own-crossover`` lets it
time its own.  Both engines' start-up lines are printed.

Both modes get the environment of the shell that started the script without
``OMP_WAIT_POLICY`` (a test-suite setting that slows a dedicated node), plus ``--node-env``:
the in-process engine too, since this script drops it before torch is loaded.

    .venv/bin/python bench/fleet.py                   # the bundled SmolLM2-135M (3 to 5 min)
    .venv/bin/python bench/fleet.py --tiny            # a tiny random Llama (quick check)
    .venv/bin/python bench/fleet.py --concurrency 4 --requests 8 --node-arg=--weights=float32

This script only measures and prints; it asserts nothing, is never imported by the package,
and never leaves a process running when it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _fleetproc import (
    WARM_UP_TOPIC,
    Answer,
    BenchError,
    Phase,
    chat_body,
    child_env,
    cpu_name,
    fleet_processes,
    guard_children,
    parse_env,
    run_phase,
    served_model,
    stop_children,
    story_request,
    topics,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ENGINE = "engine alone"
FLEET = "fleet"
MODES = (ENGINE, FLEET)
RATE_TARGET = 0.95
"""Fleet tokens/s at least this fraction of the engine's alone."""
ADDED_TTFT_TARGET_MS = 10.0
"""The fleet adds at most this much to the median time to first token."""
CROSSOVER = re.compile(r"prompt chunks of (\d+) tokens or more")
"""The engine's log line naming the row count from which prompts use dense copies."""


class EngineClient:
    """The requests straight to an in-process engine, timed as the HTTP client times them."""

    def __init__(self, engine: Any, renderer: Any) -> None:
        self.engine = engine
        self.renderer = renderer

    def context(self, topic: str) -> list[int]:
        """The token ids the head sends a node for the chat request about ``topic``."""
        from sfnode.head.models.chat import ChatMessage

        ids: list[int] = self.renderer.chat([ChatMessage("user", story_request(topic))])
        return ids

    async def answer(self, context: list[int], max_tokens: int) -> Answer:
        from sfnode.generation import GenerationRequest
        from sfnode.head.api.request_class import DEFAULT_INTERACTIVE_PROMPT_TOKENS
        from sfnode.linkf.wire import GenParams

        answer = Answer(usage=True)

        def seen(tokens: Sequence[int], logprobs: Any = None, /) -> None:
            if answer.first is None and tokens:
                answer.first = time.perf_counter() - started

        # What the head asks of a node for temperature 0 (sfnode.head.api.schema), with the class
        # its default rule gives the prompt (sfnode.head.api.request_class: a short chat is
        # interactive).
        interactive = len(context) <= DEFAULT_INTERACTIVE_PROMPT_TOKENS
        request = GenerationRequest(
            context, GenParams(temperature=0.0, top_p=1.0), max_tokens, interactive=interactive
        )
        started = time.perf_counter()
        result = await self.engine.submit(request, seen).result
        answer.tokens = len(result.tokens)
        answer.text = self.renderer.decode(result.tokens)
        return answer

    async def phase(self, topics_: Sequence[str], max_tokens: int, concurrency: int) -> Phase:
        """``topics_`` in order, ``concurrency`` in flight (a closed loop, as ``run_phase``)."""
        from twisted.internet import defer

        contexts = [self.context(t) for t in topics_]
        answers: list[Answer | None] = [None] * len(contexts)
        pending = iter(range(len(contexts)))

        async def client() -> None:
            for index in pending:
                answers[index] = await self.answer(contexts[index], max_tokens)

        cpu = time.process_time()
        started = time.perf_counter()
        await defer.gatherResults(
            [defer.Deferred.fromCoroutine(client()) for _ in range(concurrency)]
        )
        wall = time.perf_counter() - started
        done = [a for a in answers if a is not None]
        return Phase(concurrency, done, wall, time.process_time() - cpu)


def fleet_phase(port: int, model: str, topics_: Sequence[str], max_tokens: int, c: int) -> Any:
    """The chat requests to the head at ``port``, run by the asyncio client on a thread of its
    own (this process's reactor stays free, though it has nothing to do meanwhile)."""
    from twisted.internet import threads

    bodies = [chat_body(model, topic, max_tokens) for topic in topics_]
    return threads.deferToThread(asyncio.run, run_phase(port, bodies, c))


def best(phases: Sequence[Phase]) -> tuple[float, float, float]:
    """(tokens/s, TTFT p50 ms, TTFT p90 ms), each the best over ``phases``."""
    return (
        max(p.rate for p in phases),
        min(p.first_token_ms(0.5) for p in phases),
        min(p.first_token_ms(0.9) for p in phases),
    )


def build_in_process_engine(
    reactor: Any, model: Path | None, node_args: Sequence[str], dense_rows: int | None, own: bool
) -> tuple[Any, list[str]]:
    """The engine ``twistd sfnode --listen ... [--model MODEL] NODE_ARGS`` would serve with,
    and the lines its start logged.

    ``dense_rows`` is the node's choice of the row count from which prompt chunks use dense
    copies of quantized weights (None: never); ``own`` times it here instead, as the node
    did.  It is timed at start (docs/engine.md section 5), so on a busy machine two starts pick
    different ones, and prompts are then computed at different speeds and rounded
    differently: given the node's choice, this engine takes it instead of timing its own.
    """
    from twisted.logger import formatEvent, globalLogPublisher
    from twisted.python import usage

    import sfnode.engines.weights.gather
    from sfnode.node.tap import Options, build_engine

    options = Options()
    model_args = ["--model", str(model)] if model is not None else []
    try:
        options.parseOptions(["--listen", "tcp:0:interface=127.0.0.1", *model_args, *node_args])
    except usage.UsageError as e:
        raise BenchError(f"--node-arg: {e}") from e
    lines: list[str] = []

    def keep(event: dict[str, Any]) -> None:
        if str(event.get("log_namespace", "")).startswith("sfnode.engines"):
            lines.append(formatEvent(event))

    measure = sfnode.engines.weights.gather.dense_rows
    if not own:
        sfnode.engines.weights.gather.dense_rows = lambda projection: dense_rows  # type: ignore[assignment]
    globalLogPublisher.addObserver(keep)
    try:
        return build_engine(reactor, options), lines
    finally:
        globalLogPublisher.removeObserver(keep)
        sfnode.engines.weights.gather.dense_rows = measure  # type: ignore[assignment]


def node_dense_rows(lines: Sequence[str]) -> int | None:
    """The node's crossover to dense prompt products, from its start-up lines (None: none)."""
    for line in lines:
        found = CROSSOVER.search(line)
        if found:
            return int(found.group(1))
    return None


def node_lines(log: Path) -> list[str]:
    """What the node's engine logged at start (its weights, kernels and crossover)."""
    return [
        line.split("] ", 1)[-1]
        for line in log.read_text(errors="replace").splitlines()
        if "[sfnode.engines." in line
    ]


async def bench(reactor: Any, options: argparse.Namespace) -> None:
    from sfnode.head.api.http import Renderer
    from sfnode.head.tap import load_head_tokenizer

    logs = Path(options.logs or tempfile.mkdtemp(prefix="sfnode-fleet-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    model = options.model
    if options.tiny:
        from tests.tinymodel import save_tiny_model

        # No EOS: every request generates --max-tokens tokens.
        model = save_tiny_model(logs / "tiny-model", window=2048, eos=None)
    load = [os.getloadavg()[0]]
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs; load average {load[0]:.2f}; model "
        f"{model or 'the bundled one'}; logs in {logs}",
        flush=True,
    )
    env = child_env(options.node_env)
    concurrencies: list[int] = options.concurrency or [1, 8]
    phases: dict[tuple[str, int], list[Phase]] = {(m, c): [] for m in MODES for c in concurrencies}
    engine: Any = None
    try:
        with fleet_processes(options.node_arg, env, model, logs) as port:
            served = served_model(port)
            node_said = node_lines(logs / "sfnode.log")
            print("  the node's engine:", *node_said, sep="\n    ", flush=True)
            rows = node_dense_rows(node_said)
            own = options.own_crossover
            print("building the engine in this process as twistd sfnode does ...", flush=True)
            started = time.monotonic()
            engine, said = build_in_process_engine(reactor, model, options.node_arg, rows, own)
            engine.start()
            crossover = f"from {rows} rows" if rows is not None else "none"
            taken = "" if own else f", taking the node's crossover to dense prompts ({crossover})"
            print(
                f"  built in {time.monotonic() - started:.0f} s{taken}:",
                *said,
                sep="\n    ",
                flush=True,
            )
            renderer = Renderer(load_head_tokenizer(str(model) if model is not None else None))
            client = EngineClient(engine, renderer)
            # One warm-up request each: first passes, connections, tokenizer caches.
            await client.phase([WARM_UP_TOPIC], options.max_tokens, 1)
            await fleet_phase(port, served, [WARM_UP_TOPIC], options.max_tokens, 1)
            phase_number = 0
            for round_ in range(options.rounds):
                order = MODES if round_ % 2 == 0 else MODES[::-1]
                for c in concurrencies:
                    chosen = topics(options.requests, phase_number * options.requests)
                    phase_number += 1
                    for mode in order:
                        print(
                            f"  round {round_ + 1}, {mode}: {len(chosen)} requests, {c} at a "
                            "time ...",
                            flush=True,
                        )
                        if mode == ENGINE:
                            done = await client.phase(chosen, options.max_tokens, c)
                        else:
                            done = await fleet_phase(port, served, chosen, options.max_tokens, c)
                        phases[mode, c].append(done)
    finally:
        if engine is not None:
            await engine.stop()
    load.append(os.getloadavg()[0])
    report(options, concurrencies, phases, load, engine)


def report(
    options: argparse.Namespace,
    concurrencies: Sequence[int],
    phases: dict[tuple[str, int], list[Phase]],
    load: Sequence[float],
    engine: Any,
) -> None:
    print(
        f"\n{options.requests} greedy streamed chat requests per phase, max_tokens "
        f"{options.max_tokens}; {options.rounds} round(s), best of them shown; weights "
        f"{engine.weights.mode}; node args: {' '.join(options.node_arg) or '(none)'}; load "
        f"average {load[0]:.2f} at the start, {load[-1]:.2f} at the end"
    )
    cpus = os.cpu_count() or 1
    if max(load) > cpus / 2:
        print(
            f"\nWARNING: a load average above {cpus / 2:g} on {cpus} CPUs: other processes "
            "competed with these runs; read the figures with care (--rounds 3 keeps the best "
            "of three)."
        )
    header = "| mode |" + "".join(
        f" tok/s, {c} at a time | first token p50 / p90, {c} at a time |" for c in concurrencies
    )
    print(f"\n{header}\n|---|" + "---|---|" * len(concurrencies))
    for mode in MODES:
        cells = []
        for c in concurrencies:
            rate, p50, p90 = best(phases[mode, c])
            cells.append(f" {rate:.1f} | {p50:.0f} / {p90:.0f} ms |")
        print(f"| {mode} |{''.join(cells)}")

    print("\n| round | mode | concurrency | tokens | seconds | tok/s | first token p50 / p90 |")
    print("|---|---|---|---|---|---|---|")
    for round_ in range(options.rounds):
        for c in concurrencies:
            for mode in MODES:
                p = phases[mode, c][round_]
                print(
                    f"| {round_ + 1} | {mode} | {c} | {p.tokens} | {p.wall:.2f} | {p.rate:.1f} "
                    f"| {p.first_token_ms(0.5):.0f} / {p.first_token_ms(0.9):.0f} ms |"
                )

    print("\n| target | value | met |\n|---|---|---|")
    for c in concurrencies:
        alone_rate, alone_p50, _ = best(phases[ENGINE, c])
        fleet_rate, fleet_p50, _ = best(phases[FLEET, c])
        ratio = fleet_rate / alone_rate if alone_rate > 0 else float("nan")
        added = fleet_p50 - alone_p50
        print(
            f"| {c} at a time: tok/s fleet / engine >= {RATE_TARGET} | {ratio:.3f} "
            f"| {'met' if ratio >= RATE_TARGET else 'missed'} |"
        )
        print(
            f"| {c} at a time: median first token added by the fleet <= "
            f"{ADDED_TTFT_TARGET_MS:g} ms | {added:.1f} ms "
            f"| {'met' if added <= ADDED_TTFT_TARGET_MS else 'missed'} |"
        )
    print()
    for c in concurrencies:
        pairs = [
            (a, b)
            for alone, through in zip(phases[ENGINE, c], phases[FLEET, c], strict=True)
            for a, b in zip(alone.answers, through.answers, strict=True)
        ]
        counts = sum(a.tokens == b.tokens for a, b in pairs)
        texts = sum(a.text == b.text for a, b in pairs)
        cpu = sum(p.client_cpu for p in phases[FLEET, c]) / len(phases[FLEET, c])
        print(
            f"- {c} at a time: same completion token counts in {counts} of {len(pairs)} "
            f"requests, same texts in {texts}; the HTTP client's CPU {cpu:.2f} s per phase"
        )


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench/fleet.py",
        description="\n\n".join(__doc__.split("\n\n")[:4]),
        epilog="examples:\n\n" + "\n\n".join(__doc__.split("\n\n")[4:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", type=Path, default=None, help="model folder or .gguf (default: the bundled)"
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="a tiny random Llama (hidden 64, 3 layers) saved to the logs folder instead",
    )
    p.add_argument("--requests", type=int, default=16, help="requests per phase (default: 16)")
    p.add_argument(
        "--concurrency",
        type=int,
        action="append",
        default=[],
        metavar="N",
        help="requests in flight, repeatable (default: 1 and 8)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens (default: 64)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every phase (default: 2)")
    p.add_argument(
        "--node-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an argument for twistd sfnode and the in-process engine's options, repeatable; "
        "write it with '=' (e.g. --node-arg=--weights=float32 --node-arg=--max-lanes=16)",
    )
    p.add_argument(
        "--node-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for both modes (this process and sfhead and sfnode), "
        "repeatable (e.g. --node-env OMP_WAIT_POLICY=ACTIVE)",
    )
    p.add_argument(
        "--own-crossover",
        action="store_true",
        help="let the in-process engine time its own crossover to dense prompt products "
        "instead of taking the node's (docs/engine.md section 5); two starts on a busy "
        "machine often pick different ones, which changes prompt speed and greedy texts",
    )
    p.add_argument("--logs", default=None, help="folder for the servers' logs (default: a temp)")
    options = p.parse_args(argv)
    if options.tiny and options.model is not None:
        p.error("give --tiny or --model, not both")
    for name in ("requests", "max_tokens", "rounds"):
        if getattr(options, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if any(c < 1 for c in options.concurrency):
        p.error("--concurrency must be at least 1")
    return options


def main(argv: Sequence[str] | None = None) -> int:
    options = parse(argv)
    try:
        settings = parse_env(options.node_env)
    except BenchError as e:
        print(f"bench/fleet.py: {e}", file=sys.stderr)
        return 2
    # Before torch is imported, so that OpenMP starts with the environment the servers get.
    os.environ.pop("OMP_WAIT_POLICY", None)
    os.environ.update(settings)
    guard_children()

    from twisted.internet import defer, task

    status = [0]

    async def run(reactor: Any) -> None:
        try:
            await bench(reactor, options)
        except BenchError as e:
            print(f"bench/fleet.py: {e}", file=sys.stderr)
            status[0] = 1

    try:
        task.react(lambda reactor: defer.Deferred.fromCoroutine(run(reactor)))
    except SystemExit as e:
        if e.code:
            return int(e.code) if isinstance(e.code, int) else 1
    finally:
        stop_children()
    return status[0]


if __name__ == "__main__":
    sys.exit(main())
