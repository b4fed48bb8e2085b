"""What a grammar costs a node: 8 concurrent ``json_schema`` generations beside 8 unconstrained
ones, in one run, through a real ``twistd sfnode`` process (docs/engine.md section 2.4).

The node runs as deployed (the bundled model at its default settings, the environment of the
shell that started this script without ``OMP_WAIT_POLICY``), with its ``/metrics``.  This
script drives it with the head library (:class:`~sfnode.head.fleet.fleet.Fleet`), or with ``--http``
through a ``twistd sfhead`` process's OpenAI API (streamed chat requests with
``response_format``, each chunk's tokens counted from its ``logprobs``, asked of both kinds
alike): the same eight chat prompts (tests/agents.py's city questions) as
eight concurrent generations under the nested JSON Schema, then unconstrained with each
prompt's ``max_new`` set to the length of its constrained answer (so both kinds keep as many
lanes busy for as long: the comparison is of the steps, not of the answers' lengths), round
after round.  Printed per kind, the median over rounds of:

- tokens per second while all eight are decoding (from the moment the last of them has its
  first token to the moment the first of them ends: the batch is full, and what the grammar
  costs shows undiluted);
- tokens per second over the whole round (first request to last token);

and their ratio, constrained over unconstrained (the target is at least 0.8); then the node's
own figures: masks computed, the seconds that took beside the forward passes, and the seconds
steps waited for their masks.  One answer of each kind is printed, so the output can be seen.

    PYTHONPATH=. python bench/constrained.py
    PYTHONPATH=. python bench/constrained.py --rounds 3 --max-new 160
    PYTHONPATH=. python bench/constrained.py --http

This script only measures and prints; it must never assert or be imported by the package.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sfnode.generation import TokenBatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _fleetproc

KINDS = ("json_schema", "unconstrained")


@dataclass
class Run:
    """One generation: when each batch of tokens arrived."""

    submitted: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def __call__(self, batch: TokenBatch) -> None:
        self.arrivals.append((time.perf_counter(), len(batch)))
        self.tokens.extend(batch.tokens)


def rates(runs: Sequence[Run]) -> tuple[float, float]:
    """(tokens/s while all runs decode, tokens/s over the whole round)."""
    start = max(run.arrivals[0][0] for run in runs)
    end = min(run.arrivals[-1][0] for run in runs)
    inside = sum(n for run in runs for t, n in run.arrivals if start < t <= end)
    steady = inside / (end - start) if end > start else float("nan")
    first = min(run.submitted for run in runs)
    last = max(run.arrivals[-1][0] for run in runs)
    whole = sum(len(run.tokens) for run in runs) / (last - first)
    return steady, whole


class _Tokens:
    """What one streamed chat answer delivers to a :class:`Run`: its text and, per chunk, as
    many token ids as the chunk's logprobs list (the ids are not known over HTTP: -1)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.text: list[str] = []

    def event(self, body: dict[str, Any]) -> None:
        for choice in body.get("choices", []):
            entries = (choice.get("logprobs") or {}).get("content") or []
            if entries:
                self.run.arrivals.append((time.perf_counter(), len(entries)))
                self.run.tokens.extend([-1] * len(entries))
            self.text.append((choice.get("delta") or {}).get("content") or "")


def http_chat(port: int, model: str, question: str, kind: str, max_new: int, run: Run) -> Any:
    """One streamed chat request to the head (``json_schema`` under the nested schema, with
    logprobs so each chunk says how many tokens it holds); fires when the stream ends."""
    from io import BytesIO

    from twisted.internet import defer, protocol, reactor
    from twisted.web.client import Agent, FileBodyProducer
    from twisted.web.http_headers import Headers

    from tests.agents import NESTED_SCHEMA

    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_new,
        "stream": True,
        "logprobs": True,
        "top_logprobs": 0,
    }
    if kind == "json_schema":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": NESTED_SCHEMA},
        }
    sink = _Tokens(run)
    done: defer.Deferred[None] = defer.Deferred()

    class Reader(protocol.Protocol):
        buffer = b""

        def dataReceived(self, data: bytes) -> None:
            self.buffer += data
            while b"\n\n" in self.buffer:
                block, self.buffer = self.buffer.split(b"\n\n", 1)
                block = block.rpartition(b"\n")[2]  # the data line, after the event's id
                if block.startswith(b"data: {"):
                    sink.event(json.loads(block[6:]))

        def connectionLost(self, reason: Any = None) -> None:
            done.callback(None)

    def read(response: Any) -> Any:
        response.deliverBody(Reader())
        return done

    request = Agent(reactor).request(
        b"POST",
        f"http://127.0.0.1:{port}/v1/chat/completions".encode(),
        Headers({b"content-type": [b"application/json"]}),
        FileBodyProducer(BytesIO(json.dumps(body).encode())),
    )
    request.addCallback(read)
    request.addCallback(lambda _: setattr(run, "text", "".join(sink.text)))
    return request


def mask_figures(port: int) -> tuple[float, float, float]:
    """(masks, seconds computing, seconds waited) from the node's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = []
    for name in ("sfnode_grammar_masks", "sfnode_grammar_mask_seconds",
                 "sfnode_grammar_mask_wait_seconds"):  # fmt: skip
        found = re.search(rf"^{name}_total{{[^}}]*}} (\S+)$", text, re.M)
        values.append(float(found.group(1)) if found else float("nan"))
    return values[0], values[1], values[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each kind")
    parser.add_argument("--max-new", type=int, default=160, help="new tokens at most")
    parser.add_argument("--node-arg", action="append", default=[], help="extra sfnode option")
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the node")
    parser.add_argument(
        "--http", action="store_true", help="through a twistd sfhead's HTTP API (streamed chat)"
    )
    options = parser.parse_args()
    _fleetproc.guard_children()

    from twisted.internet import defer, reactor, task, threads

    from sfnode.decoding.constraint import response_format_grammar
    from sfnode.engines.weights.loading import load_tokenizer
    from sfnode.head.fleet.backend import HeadRequest
    from sfnode.head.fleet.fleet import Fleet
    from sfnode.head.link import HeadIds
    from sfnode.linkf.wire import Constraint
    from tests.agents import CITY_QUESTIONS, NESTED_SCHEMA

    tokenizer = load_tokenizer(None)
    prompts = []
    for question in CITY_QUESTIONS:
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    grammar = response_format_grammar(
        {"type": "json_schema", "json_schema": {"name": "city", "schema": NESTED_SCHEMA}}
    )
    logs = Path(tempfile.mkdtemp(prefix="sfnode-constrained-"))
    argv = _fleetproc.twistd(
        "sfnode", "--listen", "tcp:0:interface=127.0.0.1",
        "--metrics", "tcp:0:interface=127.0.0.1", *options.node_arg,
    )  # fmt: skip
    print(f"starting {_fleetproc.shown(argv)} (logs in {logs})", flush=True)
    node = _fleetproc.Child("sfnode", argv, _fleetproc.child_env(options.env), logs / "sfnode.log",
                            False)  # fmt: skip
    found = node.wait_for_line(rb"sfnode listening on 127\.0\.0\.1:(\d+)", _fleetproc.NODE_READY_S)
    endpoint = f"tcp:127.0.0.1:{int(found.group(1))}"
    metrics_port = int(node.wait_for_line(rb"sfnode metrics on 127\.0\.0\.1:(\d+)", 60).group(1))
    head = None
    http_port = 0
    if options.http:
        head_argv = _fleetproc.twistd(
            "sfhead", "--node", endpoint, "--http", "tcp:0:interface=127.0.0.1",
            "--fleet-listen", "tcp:0:interface=127.0.0.1",
        )  # fmt: skip
        print(f"starting {_fleetproc.shown(head_argv)}", flush=True)
        head = _fleetproc.Child(
            "sfhead", head_argv, _fleetproc.child_env(options.env), logs / "sfhead.log", False
        )
        http_port = _fleetproc.head_serving(head, 1, 120)
    model = _fleetproc.served_model(http_port) if http_port else ""
    results: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    samples: dict[str, str] = {}
    counts: dict[str, list[int]] = {kind: [] for kind in KINDS}

    @defer.inlineCallbacks
    def drive() -> Generator[Any, Any, None]:
        fleet = Fleet(reactor, ids=HeadIds())
        yield fleet.add_node(endpoint)
        constraint = Constraint(0, grammar)

        @defer.inlineCallbacks
        def round_of(kind: str, lengths: Sequence[int]) -> Generator[Any, Any, list[Run]]:
            runs = []
            generations = []
            for question, prompt, max_new in zip(CITY_QUESTIONS, prompts, lengths, strict=True):
                run = Run(time.perf_counter())
                runs.append(run)
                if options.http:
                    generations.append(http_chat(http_port, model, question, kind, max_new, run))
                    continue
                generations.append(
                    fleet.generate(
                        HeadRequest(
                            prompt,
                            max_new,
                            constraint=constraint if kind == "json_schema" else None,
                        ),
                        on_tokens=run,
                    ).result
                )
            yield defer.gatherResults(generations)
            return runs

        full = [options.max_new] * len(prompts)
        # Warm-up: the kernels' first calls, the grammar library's first tables.
        runs = yield round_of("json_schema", full)
        yield round_of("unconstrained", [len(run.tokens) for run in runs])
        before = yield threads.deferToThread(mask_figures, metrics_port)
        for _ in range(options.rounds):
            constrained = yield round_of("json_schema", full)
            lengths = [len(run.tokens) for run in constrained]
            plain = yield round_of("unconstrained", lengths)
            for kind, runs in (("json_schema", constrained), ("unconstrained", plain)):
                results[kind].append(rates(runs))
                counts[kind].append(sum(len(run.tokens) for run in runs))
                samples[kind] = getattr(runs[0], "text", None) or tokenizer.decode(
                    runs[0].tokens, skip_special_tokens=True
                )
        after = yield threads.deferToThread(mask_figures, metrics_port)
        yield fleet.stop()
        masks, computing, waiting = (a - b for a, b in zip(after, before, strict=True))
        report(results, samples, counts, masks, computing, waiting, options)

    try:
        task.react(lambda _reactor: drive())
    finally:
        if head is not None:
            head.stop()
        node.stop()


def report(
    results: dict[str, list[tuple[float, float]]],
    samples: dict[str, str],
    counts: dict[str, list[int]],
    masks: float,
    computing: float,
    waiting: float,
    options: Any,
) -> None:
    via = "through twistd sfhead's HTTP API" if options.http else "through the head library"
    print(f"\n8 concurrent generations on {_fleetproc.cpu_name()}, bundled model, node defaults "
          f"{' '.join(options.node_arg)}, {via}; median of {options.rounds} rounds, "
          "tokens/s")  # fmt: skip
    print(f"{'':28}{'unconstrained':>15}{'json_schema':>15}{'ratio':>9}")
    print(
        f"{'tokens per round':28}{statistics.median(counts['unconstrained']):>15.0f}"
        f"{statistics.median(counts['json_schema']):>15.0f}"
    )
    for index, label in enumerate(("all 8 decoding", "whole round")):
        plain = statistics.median(r[index] for r in results["unconstrained"])
        constrained = statistics.median(r[index] for r in results["json_schema"])
        print(f"{label:28}{plain:>15.1f}{constrained:>15.1f}{constrained / plain:>9.2f}")
    if masks:
        print(
            f"node: {masks:.0f} masks in the measured rounds, {computing * 1e3 / masks:.3f} ms "
            f"each to compute beside the forward pass, steps waited {waiting * 1e3:.1f} ms "
            f"in all for them"
        )
    for kind in KINDS:
        print(f"a {kind} answer: {json.dumps(samples.get(kind, ''))[:300]}")
    with open("/proc/loadavg") as f:
        print(f"load average: {f.read().strip()}")


if __name__ == "__main__":
    main()
