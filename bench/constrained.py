"""What a grammar costs a node: 8 concurrent ``json_schema`` generations beside 8 unconstrained
ones, in one run, through a real ``twistd sfnode`` process (docs/engine.md section 2.4).

The node runs as deployed (the bundled model at its default settings, the environment of the
shell that started this script without ``OMP_WAIT_POLICY``), with its ``/metrics``.  This
script drives it with the head library (:class:`~sfnode.head.fleet.Fleet`; the HTTP API for
constraints comes later): the same eight chat prompts (tests/agents.py's city questions) as
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
    options = parser.parse_args()
    _fleetproc.guard_children()

    from twisted.internet import defer, reactor, task, threads

    from sfnode.constraint import response_format_grammar
    from sfnode.head.fleet import Fleet
    from sfnode.head.link import HeadIds
    from sfnode.models import load_tokenizer
    from sfnode.wire import Constraint
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
            for prompt, max_new in zip(prompts, lengths, strict=True):
                run = Run(time.perf_counter())
                runs.append(run)
                generations.append(
                    fleet.generate(
                        prompt,
                        max_new,
                        on_tokens=run,
                        constraint=constraint if kind == "json_schema" else None,
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
                samples[kind] = tokenizer.decode(runs[0].tokens, skip_special_tokens=True)
        after = yield threads.deferToThread(mask_figures, metrics_port)
        yield fleet.stop()
        masks, computing, waiting = (a - b for a, b in zip(after, before, strict=True))
        report(results, samples, counts, masks, computing, waiting, options)

    try:
        task.react(lambda _reactor: drive())
    finally:
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
    print(f"\n8 concurrent generations on {_fleetproc.cpu_name()}, bundled model, node defaults "
          f"{' '.join(options.node_arg)}; median of {options.rounds} rounds, tokens/s")  # fmt: skip
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
