"""Throughput and time to first token through HTTP + head + node, next to the engine alone.

One process, one reactor, loopback TCP: the same transformers engine serves the same greedy
requests three times per round: submitted to the engine directly; through the head's fleet over
Link F without HTTP; and as streamed ``/v1/completions`` requests to the head's HTTP API
(client -> HTTP -> head -> Link F -> node -> engine).  Printed per mode: aggregate tokens/s and
TTFT (median, p90); then the throughput ratio HTTP/engine (target >= 0.95) and the median TTFT
added (target <= 10 ms).  Client, head, node and engine share one process (and the GIL), so a
very fast tiny model overstates the head's per-token cost.

    PYTHONPATH=. python bench/fleet.py                    # the bundled SmolLM2-135M
    PYTHONPATH=. python bench/fleet.py --tiny             # a tiny random Llama (quick check)
    PYTHONPATH=. python bench/fleet.py --requests 16 --concurrency 4 --max-tokens 64

This script only measures and prints; it must never assert or be imported by the package.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

from twisted.internet import defer, task
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import Agent, FileBodyProducer, HTTPConnectionPool
from twisted.web.http_headers import Headers


class Run:
    """Figures of one mode in one round."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.tokens = 0
        self.ttft: list[float] = []
        self.wall = 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0

    def ttft_ms(self, q: float) -> float:
        ordered = sorted(self.ttft)
        if not ordered:
            return float("nan")
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@defer.inlineCallbacks
def run_streams(
    label: str,
    start: Callable[[list[int], Callable[[Sequence[int]], None]], defer.Deferred[Any]],
    prompts: Sequence[list[int]],
    concurrency: int,
) -> Generator[Any, Any, Run]:
    """``start(prompt, on_tokens)`` for each prompt, ``concurrency`` at a time; its Deferred
    fires with something that has the generated ``tokens``."""
    run = Run(label)
    lock = defer.DeferredSemaphore(concurrency)

    @defer.inlineCallbacks
    def one(prompt: list[int]) -> Generator[Any, Any, None]:
        started = time.perf_counter()
        first: list[float] = []

        def seen(tokens: Sequence[int]) -> None:
            if not first and tokens:
                first.append(time.perf_counter())

        outcome = yield start(prompt, seen)
        run.tokens += len(outcome.tokens)
        run.ttft.append(first[0] - started)

    started = time.perf_counter()
    yield defer.gatherResults([lock.run(one, p) for p in prompts])
    run.wall = time.perf_counter() - started
    return run


def run_engine(
    engine: Any, prompts: Sequence[list[int]], max_tokens: int, concurrency: int
) -> defer.Deferred[Run]:
    """The requests straight to the engine, in this process."""
    from sfnode.generation import GenerationRequest
    from sfnode.wire import GenParams

    def start(prompt: list[int], seen: Callable[[Sequence[int]], None]) -> defer.Deferred[Any]:
        result: defer.Deferred[Any] = engine.submit(
            GenerationRequest(prompt, GenParams(), max_tokens), seen
        ).result
        return result

    return run_streams("engine alone", start, prompts, concurrency)


def run_fleet(
    fleet: Any, prompts: Sequence[list[int]], max_tokens: int, concurrency: int
) -> defer.Deferred[Run]:
    """The same requests through the head's fleet (Link F to the node), without HTTP."""

    def start(prompt: list[int], seen: Callable[[Sequence[int]], None]) -> defer.Deferred[Any]:
        result: defer.Deferred[Any] = fleet.generate(prompt, max_tokens, on_tokens=seen).result
        return result

    return run_streams("head + node", start, prompts, concurrency)


class _NoDelayEndpoint:
    """A client endpoint whose connections set TCP_NODELAY (as good HTTP clients do)."""

    def __init__(self, wrapped: Any) -> None:
        self._wrapped = wrapped

    def connect(self, factory: Any) -> defer.Deferred[Any]:
        def no_delay(protocol: Any) -> Any:
            protocol.transport.setTcpNoDelay(True)
            return protocol

        d: defer.Deferred[Any] = self._wrapped.connect(factory)
        return d.addCallback(no_delay)


class _NoDelayEndpoints:
    def __init__(self, reactor: Any) -> None:
        self._reactor = reactor

    def endpointForURI(self, uri: Any) -> _NoDelayEndpoint:
        return _NoDelayEndpoint(TCP4ClientEndpoint(self._reactor, uri.host.decode(), uri.port))


class _Sse(Protocol):
    """Reads one streamed completion: time of the first text, completion tokens."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.first: float | None = None
        self.buffer = b""
        self.tokens = 0
        self.done: defer.Deferred[None] = defer.Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.buffer += data
        while b"\n\n" in self.buffer:
            block, self.buffer = self.buffer.split(b"\n\n", 1)
            if not block.startswith(b"data: {"):
                continue
            event = json.loads(block[6:])
            if event.get("usage"):
                self.tokens = event["usage"]["completion_tokens"]
            if self.first is None and any(c.get("text") for c in event.get("choices", [])):
                self.first = time.perf_counter()

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.done.callback(None)


@defer.inlineCallbacks
def run_http(
    reactor: Any, url: str, prompts: Sequence[list[int]], max_tokens: int, concurrency: int
) -> Generator[Any, Any, Run]:
    from io import BytesIO

    run = Run("HTTP + head + node")
    pool = HTTPConnectionPool(reactor)
    pool.maxPersistentPerHost = concurrency
    agent = Agent.usingEndpointFactory(reactor, _NoDelayEndpoints(reactor), pool=pool)
    lock = defer.DeferredSemaphore(concurrency)

    @defer.inlineCallbacks
    def one(prompt: list[int]) -> Generator[Any, Any, None]:
        body = {
            "model": "bench",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        response = yield agent.request(
            b"POST",
            url.encode(),
            Headers({b"content-type": [b"application/json"]}),
            FileBodyProducer(BytesIO(json.dumps(body).encode())),
        )
        reader = _Sse(started)
        response.deliverBody(reader)
        yield reader.done
        run.tokens += reader.tokens
        if reader.first is not None:
            run.ttft.append(reader.first - started)

    started = time.perf_counter()
    yield defer.gatherResults([lock.run(one, p) for p in prompts])
    run.wall = time.perf_counter() - started
    yield pool.closeCachedConnections()
    return run


def load(options: argparse.Namespace) -> tuple[Any, Any]:
    """(model, tokenizer)."""
    if options.tiny:
        sys.path.insert(0, ".")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from tests.tinymodel import save_tiny_model

        folder = save_tiny_model(tempfile.mkdtemp(prefix="sfnode-bench-"), window=2048)
        model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
        model.eval()
        return model, AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    from sfnode import models

    loaded = models.load_model(options.model, threads=options.threads or None)
    return loaded.model, loaded.tokenizer


@defer.inlineCallbacks
def main(reactor: Any, options: argparse.Namespace) -> Generator[Any, Any, None]:
    from sfnode.config import NodeConfig
    from sfnode.engines.transformers_engine import TransformersEngine
    from sfnode.head.fleet import Fleet
    from sfnode.head.gate import GateLimits
    from sfnode.head.http import OpenAIApi, Renderer
    from sfnode.head.schema import ChatMessage
    from sfnode.node import NodeAgent
    from sfnode.tap import node_factory

    if options.node_coalesce_ms is not None:
        # Diagnostic only: the node holds a generation's first tokens for its coalescing
        # interval (200 ms); this shows what the head and HTTP add on their own.
        import sfnode.node

        sfnode.node.COALESCE_MS = options.node_coalesce_ms  # type: ignore[misc]
    model, tokenizer = load(options)
    engine = TransformersEngine(model, reactor, max_lanes=options.concurrency)
    engine.start()
    renderer = Renderer(tokenizer)
    prompts = [
        renderer.chat([ChatMessage("user", f"Request {i}: tell me about the sea.")])
        for i in range(options.requests)
    ]
    agent = NodeAgent(
        reactor, engine, NodeConfig(identity="bench", model_name="bench",
                                    max_lanes=options.concurrency)
    )  # fmt: skip
    node_endpoint = TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1")
    node_port = yield node_endpoint.listen(node_factory(agent))
    fleet = Fleet(reactor)
    yield fleet.add_node(f"tcp:127.0.0.1:{node_port.getHost().port}")
    # One client sends every request: no per-client limit.
    api = OpenAIApi(reactor, fleet, tokenizer, "bench", limits=GateLimits(max_client_requests=0))
    site = api.site()
    site.noisy = False
    http_port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
    url = f"http://127.0.0.1:{http_port.getHost().port}/v1/completions"

    # Warm up both paths (first forward passes, connections, tokenizer caches).
    yield run_engine(engine, prompts[:1], 4, 1)
    yield run_http(reactor, url, prompts[:1], 4, 1)

    runs: list[tuple[Run, Run, Run]] = []
    for _ in range(options.rounds):
        alone = yield run_engine(engine, prompts, options.max_tokens, options.concurrency)
        linked = yield run_fleet(fleet, prompts, options.max_tokens, options.concurrency)
        through = yield run_http(reactor, url, prompts, options.max_tokens, options.concurrency)
        runs.append((alone, linked, through))

    print(
        f"\n{options.requests} requests, {options.concurrency} at once, up to "
        f"{options.max_tokens} tokens each, greedy; {options.rounds} rounds\n"
    )
    print(f"{'round':>5}  {'mode':<20} {'tokens':>7} {'tok/s':>8} {'TTFT p50':>10} "
          f"{'TTFT p90':>10}")  # fmt: skip
    for i, pair in enumerate(runs, 1):
        for run in pair:
            print(
                f"{i:>5}  {run.name:<20} {run.tokens:>7} {run.rate:>8.1f} "
                f"{run.ttft_ms(0.5):>8.1f}ms {run.ttft_ms(0.9):>8.1f}ms"
            )
    alone_rate = statistics.mean(r[0].rate for r in runs)
    through_rate = statistics.mean(r[2].rate for r in runs)
    alone_ttft = statistics.mean(r[0].ttft_ms(0.5) for r in runs)
    linked_ttft = statistics.mean(r[1].ttft_ms(0.5) for r in runs)
    through_ttft = statistics.mean(r[2].ttft_ms(0.5) for r in runs)
    ratio = through_rate / alone_rate if alone_rate else float("nan")
    added = through_ttft - alone_ttft
    print(
        f"\nmean over rounds: engine alone {alone_rate:.1f} tok/s, TTFT p50 {alone_ttft:.1f} ms;"
        f" through the fleet {through_rate:.1f} tok/s, TTFT p50 {through_ttft:.1f} ms"
        f" (of which Link F alone: TTFT p50 {linked_ttft:.1f} ms)"
    )
    print(
        f"throughput ratio {ratio:.3f} (target >= 0.95): {'ok' if ratio >= 0.95 else 'MISSED'};"
        f" added median TTFT {added:.1f} ms (target <= 10 ms): "
        f"{'ok' if added <= 10 else 'MISSED'}"
    )
    yield http_port.stopListening()
    yield fleet.stop()
    yield node_port.stopListening()
    yield agent.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: bundled)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--node-coalesce-ms",
        type=int,
        default=None,
        help="diagnostic: override the node's token coalescing interval (default: the node's)",
    )
    args = parser.parse_args()
    task.react(main, [args])
