"""The console's snapshot (``GET /console/state``, and each update of ``/console/feed``): the
fleet as an operator reads it, built on demand from the head's own objects (the fleet's nodes
and their links' latest reports, its queue and shares, its event journal) and the HTTP layer's
:class:`~sfnode.head.console.record.ConsoleRecord`.

- ``nodes``: identity, address, models, state (``joining``, ``serving``, ``draining``,
  ``refused``, ``gone``), lanes used and in total, KV blocks used and in total, the decode rate
  the node reports (tokens/s over its busy time), the age of its latest load report (its
  heartbeat: NODE_STATUS, docs/protocol.md section 7.5), its host memory, the features it
  offers, and what it runs on (its CPU and engine path, and its resident memory: section 12.9;
  None from a node that does not say, never guessed).
- ``models``: the nodes serving each, running and queued generations, tokens/s, the first-token
  p50 and p95 of the last minutes and their time series (:mod:`sfnode.head.console.series`).
- ``clients``: per client (API key by its hash, else address): lanes held, generations
  queued, its share of the fleet's lanes, its 429s.
- ``events``: the newest of the fleet's journal (:mod:`sfnode.head.fleet.events`).
- ``pipeline``: a pipeline's stages in order, each its node, its layers ``[first_layer,
  end_layer)`` and how the boundaries were chosen (``given``, ``planned``, ``even``); empty for
  a fleet.

Every list is bounded (:data:`NODES_SHOWN`, :data:`CLIENTS_SHOWN`, :data:`EVENTS_SHOWN`), so a
snapshot's size and the time it takes on the reactor are bounded too.  This module must never
change the fleet, send anything, or show an API key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from sfnode.head.console.record import ConsoleRecord, client_label
from sfnode.head.console.series import Series, window_percentiles
from sfnode.head.fleet.backend import StageReport
from sfnode.head.fleet.events import EventJournal
from sfnode.head.fleet.fleet import Fleet
from sfnode.head.fleet.nodes import FleetNode
from sfnode.linkf.wire import (
    FEATURE_CONSTRAINTS,
    FEATURE_EMBEDDINGS,
    FEATURE_LOGPROBS,
    FEATURE_MODEL_FILES,
    FEATURE_REQUEST_CLASS,
    FEATURE_STAGE_BATCH,
    FEATURE_STAGE_KV,
)

NODES_SHOWN = 200
CLIENTS_SHOWN = 50
EVENTS_SHOWN = 60
MODELS_SHOWN = 32

_FEATURES = (
    (FEATURE_LOGPROBS, "logprobs"),
    (FEATURE_REQUEST_CLASS, "classes"),
    (FEATURE_CONSTRAINTS, "constraints"),
    (FEATURE_MODEL_FILES, "files"),
    (FEATURE_EMBEDDINGS, "embeddings"),
    (FEATURE_STAGE_KV, "stage_kv"),
    (FEATURE_STAGE_BATCH, "stage_batch"),
)
_JOINING = frozenset({"new", "connecting", "handshaking", "reconciling"})


def node_state(node: FleetNode) -> str:
    """``refused`` (it serves no model, D25), ``draining`` (an operator drained it),
    ``serving`` (placement may use it), ``joining`` (its first handshake, a reconcile, or its
    model's files on their way) or ``gone`` (its link is down: redialled, or it left)."""
    link = node.link
    if node.refused is not None:
        return "refused"
    if link.ready and node.draining:
        return "draining"
    if node.live:
        return "serving"
    if link.ready or link.status == "reconciling":
        return "joining"
    if link.status in _JOINING and link.hello_ack is None:
        return "joining"
    return "gone"


def node_row(node: FleetNode, now: float) -> dict[str, Any]:
    """One node as the console shows it."""
    link = node.link
    capacity = link.capacity
    row: dict[str, Any] = {
        "name": node.name,
        "address": node.description,
        "dialed": node.dialed,
        "models": list(node.models),
        "state": node_state(node),
        "link": link.status,
        "running": node.inflight,
        "sessions": node.sessions,
        "heartbeat_s": None if link.capacity_at is None else round(now - link.capacity_at, 1),
        "features": [name for flag, name in _FEATURES if (link.features or 0) & flag],
        "refused": node.refused,
        "last_failure": node.last_failure[:200],
        "cpu": None if link.platform is None else link.platform.cpu,
        "engine_path": None if link.platform is None else link.platform.engine,
        "resident_bytes": link.resident_bytes,
    }
    if capacity is None:
        return row
    lanes_total = capacity.max_lanes
    used = max(capacity.lanes_active, node.inflight)
    row.update(
        lanes_used=min(used, lanes_total) if lanes_total else used,
        lanes_total=lanes_total,
        queue_depth=capacity.queue_depth,
        kv_used=capacity.kv_blocks_used,
        kv_total=capacity.kv_blocks_total,
        tokens_per_s=capacity.decode_tokens_per_s,
        window=capacity.max_context_tokens,
        host_memory_bytes=capacity.host_memory_bytes,
    )
    return row


class Console:
    """The owner of the console's figures: the fleet it reads, the HTTP layer's record, the
    time series it samples when asked; ``models()`` names the models served."""

    def __init__(
        self,
        fleet: Fleet,
        record: ConsoleRecord,
        models: Callable[[], Sequence[str]],
        now: Callable[[], float],
        stages: Callable[[], Sequence[StageReport]] = tuple,
    ) -> None:
        """``stages()``: a pipeline's plan now (none for a fleet)."""
        self.fleet = fleet
        self.stages = stages
        self.record = record
        self.models = models
        self.now = now
        self.series = Series()

    @property
    def events(self) -> EventJournal:
        return self.fleet.registry.events

    def snapshot(self, *, draining: bool = False, requests: int = 0) -> dict[str, Any]:
        """The whole state now (``draining``, ``requests``: the HTTP layer's own)."""
        now = self.now()
        fleet = self.fleet
        status = fleet.status()
        models = list(self.models())[:MODELS_SHOWN]
        record = self.record
        self.series.sample(now, models, record.delivered, record.first_tokens)
        nodes = fleet.nodes
        return {
            "now": round(now, 3),
            "head": {
                "draining": draining,
                "requests": requests,
                "live_nodes": status.live_nodes,
                "lanes_active": status.lanes_active,
                "lanes_total": status.lanes_total,
                "queued": status.queued,
                "waiting": status.waiting,
                "failovers": status.failovers,
                "reclaimed": status.reclaimed,
                "reconnects": status.reconnects,
            },
            "nodes": [node_row(n, now) for n in nodes[:NODES_SHOWN]],
            "nodes_total": len(nodes),
            "models": [self._model_row(m, now) for m in models],
            "clients": self._clients(status.lanes_total),
            "events": [e.as_json() for e in self.events.latest(EVENTS_SHOWN)],
            "pipeline": [stage.as_json() for stage in self.stages()[:NODES_SHOWN]],
        }

    def _model_row(self, model: str, now: float) -> dict[str, Any]:
        status = self.fleet.status(model)
        p50, p95 = window_percentiles(now, model, self.record.first_tokens)
        return {
            "name": model,
            "nodes": [n.name for n in self.fleet.nodes if n.live and model in n.models],
            "running": status.model_running,
            "queued": status.model_waiting,
            "tokens_per_s": round(self.series.latest_rate(model), 1),
            "first_token_p50_ms": p50,
            "first_token_p95_ms": p95,
            "series": self.series.points(model),
        }

    def _clients(self, lanes_total: int) -> list[dict[str, Any]]:
        """Each client holding a lane, waiting for one or refused with 429: the busiest
        first."""
        rows: dict[str, dict[str, Any]] = {}

        def row(label: str) -> dict[str, Any]:
            found = rows.get(label)
            if found is None:
                found = rows[label] = {"client": label, "running": 0, "queued": 0, "share": 0.0}
                found["rate_limited"] = self.record.rate_limited.get(label, 0)
            return found

        shares = self.fleet.shares
        share: Hashable
        for share in list(shares.shares()):
            held = shares.held(share)
            entry = row(client_label(share))
            entry["running"] += held
            entry["share"] = round(held / lanes_total, 3) if lanes_total else 0.0
        for waiter in self.fleet.queue:
            row(client_label(waiter.share))["queued"] += 1
        for label in self.record.rate_limited:
            row(label)
        ordered = sorted(
            rows.values(), key=lambda r: (-(r["running"] + r["queued"]), -r["rate_limited"])
        )
        return ordered[:CLIENTS_SHOWN]


__all__ = ["EVENTS_SHOWN", "NODES_SHOWN", "Console", "node_row", "node_state"]
