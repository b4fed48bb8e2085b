"""The node's own Prometheus figures (``twistd sfnode --metrics ENDPOINT``): engine and capacity.

A collector reads the engine's live statistics and the node's latest busy-time rates at scrape
time, in a registry of its own (never the process-global one, so several nodes can run in one
process).  A scrape only reads: it never takes a rate sample (that would move the baseline the
NODE_STATUS rates are measured from).

The listener has the guards every sfnode listener has (``sfnode.runtime.http_guard``): at most
``max_connections`` open connections (one more is answered 503 and closed) and
``header_timeout_s`` for a request's headers (408 after), so idle or slow connections cannot
hold it.  ``twistd sfnode`` refuses a ``--metrics`` address off loopback unless
``--metrics-insecure``: the figures say what the node runs and how busy it is.

An engine with a prefix cache (one with ``prefix_statistics()``, the transformers engine unless
``--no-prefix-cache``) adds its figures: lookups that reused blocks and lookups that did not,
prompt tokens not computed thanks to it, blocks saved and evicted, and blocks held now.  An
engine without one shows none of them (not zeros that would read as "nothing reused").
An engine that honours constraints adds the grammar masks it computed, the seconds that took
and the seconds steps waited for them after their forward pass (docs/engine.md section 2.4).
An engine with a scheduler (the transformers engine) adds its forward passes, decode rows and the
tokens they gave; with speculative decoding on (docs/engine.md section 3.1) also the draft tokens
verified and accepted, the acceptance rate and the tokens per decode row.

The same site answers ``/healthz`` for probes (a Kubernetes readiness or liveness probe, a load
balancer): 200 ``{"status": "ok", ...}`` while the node takes generations (its model is loaded:
the site starts after the engine is built), 503 ``{"status": "draining", ...}`` once SIGTERM
started its drain.  Both say how many heads are connected and how many generations run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from twisted.internet.interfaces import IReactorTime
from twisted.web.resource import Resource
from twisted.web.server import Request

from sfnode.engines.scheduling.prefix_cache import PrefixCacheStats
from sfnode.engines.scheduling.scheduler import SchedulerCounts
from sfnode.runtime.http_guard import DEFAULT_HEADER_TIMEOUT_S, CappedSite

if TYPE_CHECKING:
    from sfnode.node.agent import NodeAgent

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
METRICS_MAX_CONNECTIONS = 64
"""Open connections the metrics listener takes; one more is answered 503 and closed."""


@runtime_checkable
class MaskFiguresSource(Protocol):
    """An engine that computes grammar masks (the transformers engine)."""

    def mask_figures(self) -> tuple[int, float, float]:
        """(masks computed, seconds computing them, seconds steps waited for them)."""


@runtime_checkable
class StepCountsSource(Protocol):
    """An engine with a scheduler (the transformers engine)."""

    speculation: object | None
    """How it drafts, or None without speculative decoding."""

    def step_counts(self) -> SchedulerCounts:
        """The scheduler's cumulative figures."""


@runtime_checkable
class PrefixStatisticsSource(Protocol):
    """An engine that may keep a prefix cache (the transformers engine)."""

    def prefix_statistics(self) -> PrefixCacheStats | None:
        """The cache's figures, or None when the engine runs without one."""


class NodeCollector(Collector):
    """Engine counters and gauges of one node, labelled with its identity and model."""

    def __init__(self, agent: NodeAgent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        stats = agent.engine.statistics()
        decode, prefill = agent.rates
        labels = ["node", "model"]
        values = [agent.config.identity, agent.config.model_name]

        def counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, help_text, labels=labels)
            family.add_metric(values, value)
            return family

        def gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, help_text, labels=labels)
            family.add_metric(values, value)
            return family

        yield counter(
            "sfnode_decoded_tokens", "Tokens decoded by the engine.", stats.decoded_tokens
        )
        yield counter(
            "sfnode_prefilled_tokens",
            "Prompt tokens prefilled by the engine.",
            stats.prefilled_tokens,
        )
        yield gauge("sfnode_queue_depth", "Generations waiting for a lane.", stats.queue_depth)
        yield gauge("sfnode_lanes_active", "Generations decoding now.", stats.lanes_active)
        yield gauge("sfnode_max_lanes", "Configured lanes.", agent.config.max_lanes)
        yield gauge("sfnode_kv_blocks_used", "KV blocks (16 tokens) in use.", stats.kv_blocks_used)
        yield gauge("sfnode_kv_blocks_total", "KV blocks in the pool.", stats.kv_blocks_total)
        yield gauge(
            "sfnode_context_window_tokens", "Most tokens one stream may hold.",
            agent.engine.context_window,
        )  # fmt: skip
        yield gauge("sfnode_decode_tokens_per_second", "Busy-time decode rate (EWMA).", decode)
        yield gauge("sfnode_prefill_tokens_per_second", "Busy-time prefill rate (EWMA).", prefill)
        yield gauge("sfnode_sessions", "Sessions holding a context.", agent.sessions_with_context())
        yield gauge("sfnode_connections", "Head connections past the handshake.",
                    len(agent.connections))  # fmt: skip
        yield gauge(
            "sfnode_generations", "Generations running or queued.", agent.running_generations
        )
        engine = agent.engine
        if engine.supports_constraints and isinstance(engine, MaskFiguresSource):
            masks, computing, waiting = engine.mask_figures()
            yield counter(
                "sfnode_grammar_masks", "Allowed-token masks computed for constrained rows.", masks
            )
            yield counter(
                "sfnode_grammar_mask_seconds",
                "Seconds spent computing grammar masks (beside the forward passes).",
                computing,
            )
            yield counter(
                "sfnode_grammar_mask_wait_seconds",
                "Seconds steps waited for their grammar masks after their forward pass.",
                waiting,
            )
        if isinstance(engine, StepCountsSource):
            yield from _step_metrics(engine, counter, gauge)
        prefix = engine.prefix_statistics() if isinstance(engine, PrefixStatisticsSource) else None
        if prefix is None:
            return
        yield counter(
            "sfnode_prefix_cache_hits",
            "Generations whose context started with cached KV blocks (they reused at least one).",
            prefix.hits,
        )
        yield counter(
            "sfnode_prefix_cache_misses",
            "Generations that found none of their context's blocks cached.",
            prefix.misses,
        )
        yield counter(
            "sfnode_prefix_cache_reused_tokens",
            "Context tokens whose KV was copied from the cache instead of computed.",
            prefix.reused_tokens,
        )
        yield counter(
            "sfnode_prefix_cache_saved_blocks",
            "Full 16-token blocks written into the cache.",
            prefix.saved_blocks,
        )
        yield counter(
            "sfnode_prefix_cache_evictions",
            "Cached blocks given up (least recently used first) to make room for new ones.",
            prefix.evictions,
        )
        yield gauge(
            "sfnode_prefix_cache_blocks", "Blocks the cache holds now.", prefix.cached_blocks
        )


def _step_metrics(
    engine: StepCountsSource,
    counter: Callable[[str, str, float], CounterMetricFamily],
    gauge: Callable[[str, str, float], GaugeMetricFamily],
) -> Iterator[Metric]:
    counts = engine.step_counts()
    yield counter("sfnode_steps", "Forward passes the engine ran.", counts.steps)
    yield counter(
        "sfnode_decode_rows",
        "Decode rows computed (one per decoding generation per step, however long its draft).",
        counts.decode_rows,
    )
    yield counter(
        "sfnode_decode_row_tokens",
        "Tokens the decode rows gave (more than one a row when draft tokens are accepted).",
        counts.decode_tokens,
    )
    yield gauge(
        "sfnode_tokens_per_decode_row",
        "Tokens per decode row since start (1 without speculative decoding).",
        counts.decode_tokens / counts.decode_rows if counts.decode_rows else 0.0,
    )
    if engine.speculation is None:
        return
    yield counter(
        "sfnode_draft_tokens", "Draft tokens verified (speculative decoding).", counts.drafted
    )
    yield counter(
        "sfnode_draft_accepted_tokens",
        "Draft tokens the sampler drew as drafted (speculative decoding).",
        counts.accepted,
    )
    yield gauge(
        "sfnode_draft_acceptance_ratio",
        "Accepted over verified draft tokens since start (speculative decoding).",
        counts.accepted / counts.drafted if counts.drafted else 0.0,
    )


class MetricsResource(Resource):
    """``GET /metrics``: the registry in Prometheus text format."""

    isLeaf = True

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._registry = registry

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"content-type", CONTENT_TYPE)  # type: ignore[no-untyped-call]
        return generate_latest(self._registry)


class HealthResource(Resource):
    """``/healthz``: 200 while the node takes generations, 503 once it drains."""

    isLeaf = True

    def __init__(self, agent: NodeAgent) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._agent = agent

    def render_GET(self, request: Request) -> bytes:
        agent = self._agent
        accepting = agent.accepting
        request.setResponseCode(200 if accepting else 503)
        request.setHeader(b"content-type", b"application/json")  # type: ignore[no-untyped-call]
        body = {
            "status": "ok" if accepting else "draining",
            "node": agent.config.identity,
            "model": agent.config.model_name,
            "heads": len(agent.connections),
            "generations": agent.running_generations,
        }
        return json.dumps(body).encode()


def metrics_site(
    agent: NodeAgent,
    reactor: IReactorTime,
    *,
    max_connections: int = METRICS_MAX_CONNECTIONS,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
) -> CappedSite:
    """A web site serving this node's figures at ``/metrics`` and its health at ``/healthz``,
    behind the shared guards (its deadlines run on ``reactor``)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(NodeCollector(agent))
    root = Resource()  # type: ignore[no-untyped-call]
    root.putChild(b"metrics", MetricsResource(registry))
    root.putChild(b"healthz", HealthResource(agent))
    return CappedSite(
        root, reactor=reactor, max_connections=max_connections, header_timeout_s=header_timeout_s
    )
