"""The head's Prometheus metrics, in a registry of its own.

Requests by outcome (every answer is counted once: served, refused at the door, failed), tokens
in and out, time to first token, requests and connections open now, and, read from the backend's
:class:`~sfnode.head.fleet.backend.BackendStatus` at scrape time, per-node capacity, live nodes,
lanes, waiting generations, the head's queue of requests waiting for a node (waiting now, refused
because it was full, timed out), failovers and reconnects; a pipeline's plan (each stage's node
and layers); and, per model, the gauges an
inference gateway's endpoint picker reads (:mod:`sfnode.head.api.gauges`).

This module must never use prometheus_client's global registry (two heads in one process keep
their own numbers) and never read the fleet's internals: only ``Backend.status()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from sfnode.head.api.gauges import gateway_gauges
from sfnode.head.fleet.backend import BackendStatus
from sfnode.runtime.http_guard import clip

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
EXPOSITION_CONTENT_TYPE = CONTENT_TYPE_LATEST
REASON_LABEL = 160
"""The most characters of a refused node's reason ``sfhead_node_refused`` shows."""

_CAPACITY_GAUGES = (
    ("lanes_active", "Lanes decoding now."),
    ("max_lanes", "Lanes the node decodes at once."),
    ("queue_depth", "Generations waiting for a lane."),
    ("kv_blocks_used", "KV cache blocks in use."),
    ("kv_blocks_total", "KV cache blocks in total."),
    ("max_context_tokens", "The node's context window."),
    ("decode_tokens_per_s", "Decode rate over busy time (tokens/s)."),
    ("prefill_tokens_per_s", "Prefill rate over busy time (tokens/s)."),
)


class HeadMetrics:
    """The head's metrics.  ``status`` is asked at every scrape; ``open_requests`` and
    ``open_connections`` too (the HTTP layer's own counts), and ``statuses`` (each served
    model's status) for the gateway's gauges."""

    def __init__(
        self,
        status: Callable[[], BackendStatus],
        *,
        open_requests: Callable[[], int] = lambda: 0,
        open_connections: Callable[[], int] = lambda: 0,
        statuses: Callable[[], Mapping[str, BackendStatus]] = dict,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "sfhead_requests",
            "Requests by outcome (ok, cancelled, drained, bad_request, not_found, unauthorized, "
            "forbidden, too_large, unsupported_media_type, rate_limited, timeout, too_long, "
            "unavailable, error).",
            ["outcome"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "sfhead_prompt_tokens", "Prompt tokens sent to nodes.", registry=self.registry
        )
        self.completion_tokens = Counter(
            "sfhead_completion_tokens",
            "Tokens generated and delivered to clients.",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "sfhead_time_to_first_token_seconds",
            "From request received to first token at the head.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_StatusCollector(status, open_requests, open_connections, statuses))

    def watch(self, families: Callable[[], Iterable[Metric]]) -> None:
        """Add the families ``families()`` returns at every scrape (a part of the HTTP layer
        that keeps figures of its own: the response store, the reactor's stalls)."""
        self.registry.register(_Families(families))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _StatusCollector(Collector):
    """Reads the backend's status and the HTTP layer's counts at scrape time."""

    def __init__(
        self,
        status: Callable[[], BackendStatus],
        open_requests: Callable[[], int],
        open_connections: Callable[[], int],
        statuses: Callable[[], Mapping[str, BackendStatus]],
    ) -> None:
        self._status = status
        self._open_requests = open_requests
        self._open_connections = open_connections
        self._statuses = statuses

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        status = self._status()
        yield from _node_families(status)
        yield from _stage_families(status)
        yield GaugeMetricFamily("sfhead_live_nodes", "Live nodes.", value=float(status.live_nodes))
        yield GaugeMetricFamily(
            "sfhead_lanes_active", "Lanes decoding on live nodes.", value=status.lanes_active
        )
        yield GaugeMetricFamily(
            "sfhead_lanes_total", "Lanes the live nodes reported.", value=status.lanes_total
        )
        yield GaugeMetricFamily(
            "sfhead_queued",
            "Generations waiting for a lane, at the nodes and in the head's queue.",
            value=status.queued,
        )
        yield GaugeMetricFamily(
            "sfhead_requests_open",
            "Completion requests being answered now.",
            value=self._open_requests(),
        )
        yield GaugeMetricFamily(
            "sfhead_http_connections", "HTTP connections open now.", value=self._open_connections()
        )
        yield CounterMetricFamily(
            "sfhead_failovers", "Generations moved to another node.", value=status.failovers
        )
        yield CounterMetricFamily(
            "sfhead_reconnects", "Links reconnected and reconciled.", value=status.reconnects
        )
        yield CounterMetricFamily(
            "sfhead_lanes_reclaimed",
            "Lanes taken back for a waiting client or class (its generation resumes later).",
            value=status.reclaimed,
        )
        yield GaugeMetricFamily(
            "sfhead_queued_requests",
            "Requests waiting in the head's queue for a node.",
            value=status.waiting,
        )
        yield CounterMetricFamily(
            "sfhead_queue_rejected",
            "Requests refused at once because the head's queue was full.",
            value=status.queue_rejected,
        )
        yield CounterMetricFamily(
            "sfhead_queue_timeouts",
            "Requests that waited the queue timeout for a node in vain.",
            value=status.queue_timeouts,
        )
        yield from gateway_gauges(self._statuses())


class _Families(Collector):
    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._families = families

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        return self._families()


def _node_families(status: BackendStatus) -> Iterable[Metric]:
    """The families labelled by node: up, sessions, and each capacity gauge."""
    up = GaugeMetricFamily("sfhead_node_up", "1 while the node is live.", labels=["node"])
    sessions = GaugeMetricFamily(
        "sfhead_node_sessions", "Sessions placed on the node.", labels=["node"]
    )
    gauges = {
        field: GaugeMetricFamily(f"sfhead_node_{field}", text, labels=["node"])
        for field, text in _CAPACITY_GAUGES
    }
    refused = GaugeMetricFamily(
        "sfhead_node_refused",
        "1 for a connected node that refused its model (docs/protocol.md D25), with why.",
        labels=["node", "reason"],
    )
    for node in status.nodes:
        up.add_metric([node.name], 1.0 if node.up else 0.0)
        if node.refused is not None:
            # One series per refused node, its reason clipped: the cardinality is the nodes'.
            refused.add_metric([node.name, clip(node.refused, REASON_LABEL)], 1.0)
        sessions.add_metric([node.name], float(node.sessions))
        if node.capacity is None:
            continue
        for field, gauge in gauges.items():
            gauge.add_metric([node.name], float(getattr(node.capacity, field)))
    yield up
    yield refused
    yield sessions
    yield from gauges.values()


__all__ = ["EXPOSITION_CONTENT_TYPE", "TTFT_BUCKETS", "HeadMetrics"]


def _stage_families(status: BackendStatus) -> Iterable[Metric]:
    """A pipeline's plan (docs/protocol.md section 7.6), labelled by stage and node: each
    stage's first layer, its end layer (exclusive, as STAGE_FORWARD_REQ's ``end_layer``) and
    its layer count.  Nothing for a fleet."""
    if not status.stages:
        return
    labels = ["stage", "node"]
    first = GaugeMetricFamily(
        "sfhead_stage_first_layer", "The first layer a pipeline stage runs.", labels=labels
    )
    end = GaugeMetricFamily(
        "sfhead_stage_end_layer",
        "The layer a pipeline stage stops before (its last layer + 1).",
        labels=labels,
    )
    layers = GaugeMetricFamily(
        "sfhead_stage_layers", "Layers a pipeline stage runs.", labels=labels
    )
    for stage in status.stages:
        values = [str(stage.stage), stage.node]
        first.add_metric(values, float(stage.start))
        end.add_metric(values, float(stage.end))
        layers.add_metric(values, float(stage.end - stage.start))
    yield first
    yield end
    yield layers
