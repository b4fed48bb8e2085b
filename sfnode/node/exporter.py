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

Everything comes from the engine's :class:`~sfnode.generation.EngineStatistics`, so the page knows
nothing of the engine's insides.  An engine with a prefix cache (unless ``--no-prefix-cache``)
adds its figures: lookups that reused blocks and lookups that did not, prompt tokens not computed
thanks to it, blocks saved and evicted, and blocks held now.  An engine without one shows none of
them (not zeros that would read as "nothing reused").  An engine that honours constraints adds
the grammar masks it computed, the seconds that took and the seconds steps waited for them after
their forward pass (docs/engine.md section 2.4).  An engine that runs steps (both engines run the
engine loop) adds its forward passes, decode rows and the tokens they gave; with speculative
decoding on (docs/engine.md section 3.1) also the draft tokens verified and accepted, the
acceptance rate and the tokens per decode row.  An engine that holds weights of its own adds
their bytes and the bytes of the files they were read from (a quantized file's blocks are held as
stored, so the two stay close); the node's resident memory is shown whole and split into those
weights, the keys and values the engine has allocated, and the rest.

The same site answers ``/healthz`` for probes (a Kubernetes readiness or liveness probe, a load
balancer): 200 ``{"status": "ok", ...}`` while the node takes generations (its model is loaded:
the site starts after the engine is built), 503 ``{"status": "draining", ...}`` once SIGTERM
started its drain.  Both say how many heads are connected and how many generations run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from twisted.internet.interfaces import IReactorTime
from twisted.web.resource import Resource
from twisted.web.server import Request

from sfnode.generation import EngineStatistics, MaskFigures, PrefixFigures, StepFigures
from sfnode.node.host import resident_bytes
from sfnode.runtime.http_guard import DEFAULT_HEADER_TIMEOUT_S, CappedSite

if TYPE_CHECKING:
    from sfnode.node.agent import NodeAgent

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
METRICS_MAX_CONNECTIONS = 64
"""Open connections the metrics listener takes; one more is answered 503 and closed."""

_MASK_COUNTERS = (
    ("sfnode_grammar_masks", "Allowed-token masks computed for constrained rows.", "masks"),
    (
        "sfnode_grammar_mask_seconds",
        "Seconds spent computing grammar masks (beside the forward passes).",
        "seconds",
    ),
    (
        "sfnode_grammar_mask_wait_seconds",
        "Seconds steps waited for their grammar masks after their forward pass.",
        "wait_seconds",
    ),
)
_STEP_COUNTERS = (
    ("sfnode_steps", "Forward passes the engine ran.", "steps"),
    (
        "sfnode_decode_rows",
        "Decode rows computed (one per decoding generation per step, however long its draft).",
        "decode_rows",
    ),
    (
        "sfnode_decode_row_tokens",
        "Tokens the decode rows gave (more than one a row when draft tokens are accepted).",
        "decode_tokens",
    ),
)
_DRAFT_COUNTERS = (
    ("sfnode_draft_tokens", "Draft tokens verified (speculative decoding).", "drafted"),
    (
        "sfnode_draft_accepted_tokens",
        "Draft tokens the sampler drew as drafted (speculative decoding).",
        "accepted",
    ),
)
_PREFIX_COUNTERS = (
    (
        "sfnode_prefix_cache_hits",
        "Generations whose context started with cached KV blocks (they reused at least one).",
        "hits",
    ),
    (
        "sfnode_prefix_cache_misses",
        "Generations that found none of their context's blocks cached.",
        "misses",
    ),
    (
        "sfnode_prefix_cache_reused_tokens",
        "Context tokens whose KV was copied from the cache instead of computed.",
        "reused_tokens",
    ),
    (
        "sfnode_prefix_cache_saved_blocks",
        "Full 16-token blocks written into the cache.",
        "saved_blocks",
    ),
    (
        "sfnode_prefix_cache_evictions",
        "Cached blocks given up (least recently used first) to make room for new ones.",
        "evictions",
    ),
)
_STAGE_PREFIX_COUNTERS = (
    (
        "sfnode_stage_prefix_hits",
        "Pipeline stage requests that took cached blocks from the stage's prefix pools.",
        "hits",
    ),
    (
        "sfnode_stage_prefix_misses",
        "Pipeline stage requests that could have taken cached blocks and found none.",
        "misses",
    ),
    (
        "sfnode_stage_prefix_reused_tokens",
        "Pipeline stage rows taken from the stage's prefix pools instead of computed.",
        "reused_tokens",
    ),
    (
        "sfnode_stage_prefix_saved_blocks",
        "Full 16-row blocks written into the pipeline stages' prefix pools.",
        "saved_blocks",
    ),
    (
        "sfnode_stage_prefix_evictions",
        "Blocks the pipeline stages' prefix pools gave up to make room for new ones.",
        "evictions",
    ),
)
"""A stage node's prefix pools (docs/engine.md section 4): a hit or a miss is a stage request
that starts at a block boundary with a full block before its last row."""


class _Families:
    """Metric families of one node, labelled with its identity and model."""

    def __init__(self, identity: str, model: str) -> None:
        self._labels = ["node", "model"]
        self._values = [identity, model]

    def counter(self, name: str, help_text: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, help_text, labels=self._labels)
        family.add_metric(self._values, value)
        return family

    def gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, help_text, labels=self._labels)
        family.add_metric(self._values, value)
        return family

    def counters(
        self, table: tuple[tuple[str, str, str], ...], figures: object
    ) -> Iterator[Metric]:
        """One counter per row of ``table`` (name, help, the field of ``figures`` it shows)."""
        for name, help_text, field in table:
            yield self.counter(name, help_text, getattr(figures, field))


class NodeCollector(Collector):
    """Engine counters and gauges of one node, labelled with its identity and model."""

    def __init__(self, agent: NodeAgent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        stats = agent.engine.statistics()
        decode, prefill = agent.reports.rates
        family = _Families(agent.config.identity, agent.config.model_name)
        yield family.counter(
            "sfnode_decoded_tokens", "Tokens decoded by the engine.", stats.decoded_tokens
        )
        yield family.counter(
            "sfnode_prefilled_tokens",
            "Prompt tokens prefilled by the engine.",
            stats.prefilled_tokens,
        )
        gauge = family.gauge
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
        yield gauge(
            "sfnode_sessions", "Sessions holding a context.", agent.heads.sessions_with_context()
        )
        yield gauge("sfnode_connections", "Head connections past the handshake.",
                    len(agent.connections))  # fmt: skip
        yield gauge(
            "sfnode_generations", "Generations running or queued.", agent.running_generations
        )
        yield from _engine_metrics(family, stats.masks, stats.steps, stats.prefix)
        if stats.stage_prefix is not None:
            yield from family.counters(_STAGE_PREFIX_COUNTERS, stats.stage_prefix)
            yield family.gauge(
                "sfnode_stage_prefix_blocks",
                "Blocks the pipeline stages' prefix pools hold now.",
                stats.stage_prefix.cached_blocks,
            )
        yield from _memory_metrics(family, stats, resident_bytes())


def _memory_metrics(
    family: _Families, stats: EngineStatistics, resident: int | None
) -> Iterator[Metric]:
    """The weights' bytes against their files', and the process's resident memory split into
    the weights, the keys and values, and the rest (the interpreter, libraries, buffers)."""
    weights = stats.weights
    if weights is not None:
        yield family.gauge(
            "sfnode_weights_bytes",
            "Bytes of the weights the engine's step reads (a file's blocks held as stored).",
            weights.held_bytes,
        )
        yield family.gauge(
            "sfnode_weights_file_bytes",
            "Bytes of the weight files the model was read from.",
            weights.file_bytes,
        )
    if resident is None:
        return
    held = 0
    if weights is not None:
        held = weights.held_bytes if weights.resident_bytes is None else weights.resident_bytes
    kv = stats.kv_bytes or 0
    yield family.gauge("sfnode_resident_bytes", "Resident memory of the node process.", resident)
    yield family.gauge(
        "sfnode_resident_weights_bytes", "Of it, the weights the step reads (resident pages).", held
    )
    yield family.gauge("sfnode_resident_kv_bytes", "Of it, the keys and values allocated.", kv)
    yield family.gauge(
        "sfnode_resident_rest_bytes",
        "Of it, the rest: the interpreter, libraries and buffers (the resident memory less the "
        "weights and the keys and values).",
        max(0, resident - held - kv),
    )


def _engine_metrics(
    family: _Families,
    masks: MaskFigures | None,
    steps: StepFigures | None,
    prefix: PrefixFigures | None,
) -> Iterator[Metric]:
    """The figures only some engines have: none of a kind the engine does not keep."""
    if masks is not None:
        yield from family.counters(_MASK_COUNTERS, masks)
    if steps is not None:
        yield from family.counters(_STEP_COUNTERS, steps)
        yield family.gauge(
            "sfnode_tokens_per_decode_row",
            "Tokens per decode row since start (1 without speculative decoding).",
            steps.decode_tokens / steps.decode_rows if steps.decode_rows else 0.0,
        )
        if steps.speculative:
            yield from family.counters(_DRAFT_COUNTERS, steps)
            yield family.gauge(
                "sfnode_draft_acceptance_ratio",
                "Accepted over verified draft tokens since start (speculative decoding).",
                steps.accepted / steps.drafted if steps.drafted else 0.0,
            )
    if prefix is not None:
        yield from family.counters(_PREFIX_COUNTERS, prefix)
        yield family.gauge(
            "sfnode_prefix_cache_blocks", "Blocks the cache holds now.", prefix.cached_blocks
        )


class Page(Resource):
    """A page that answers every GET with what ``answer(request)`` returns."""

    isLeaf = True

    def __init__(self, answer: Callable[[Request], bytes]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._answer = answer

    def render_GET(self, request: Request) -> bytes:
        return self._answer(request)


def prometheus_text(registry: CollectorRegistry, request: Request) -> bytes:
    """``GET /metrics``: the registry in Prometheus text format."""
    request.setHeader(b"content-type", CONTENT_TYPE)  # type: ignore[no-untyped-call]
    return generate_latest(registry)


def health(agent: NodeAgent, request: Request) -> bytes:
    """``/healthz``: 200 while the node takes generations, 503 once it drains."""
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
    root.putChild(b"metrics", Page(partial(prometheus_text, registry)))
    root.putChild(b"healthz", Page(partial(health, agent)))
    return CappedSite(
        root, reactor=reactor, max_connections=max_connections, header_timeout_s=header_timeout_s
    )
