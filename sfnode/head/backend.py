"""What the head's HTTP layer asks of whatever runs its generations: a small typed interface.

The HTTP layer (:mod:`sfnode.head.http`, :mod:`sfnode.head.metrics`) never reads the fleet's
internals (its nodes, links or counters).  It asks a :class:`Backend` two things: run a
generation (:meth:`Backend.generate`) and say how things stand (:meth:`Backend.status`, one
:class:`BackendStatus` snapshot).  :class:`~sfnode.head.fleet.Fleet` is a Backend as it is;
:class:`PipelineBackend` makes a pipeline driver one.

This module must never import Twisted's reactor, the node side or torch, and never hold state:
it is types and one thin adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from twisted.internet.defer import Deferred

from sfnode.generation import TokenSink
from sfnode.wire import CapacitySummary, GenParams, RequestClass

if TYPE_CHECKING:
    from sfnode.head.fleet import FleetOutcome
    from sfnode.head.pipeline import PipelineFleet


_DEFAULT_PARAMS = GenParams()


@dataclass(frozen=True, slots=True)
class Requester:
    """Who a generation is for, as the head's queue shares lanes (docs/protocol.md section
    8.5): the client's address and the API key it was admitted with."""

    address: str = ""
    """The client's address ("" for a program's own generations: no per-address bound)."""
    key: bytes | None = None
    """The API key the request carried (None: the API is open)."""

    @property
    def share(self) -> tuple[str, bytes | str]:
        """What the queue serves round robin: the API key when there is one, else the
        address (several programs behind one address share it; one key on many addresses is
        still one client)."""
        return ("key", self.key) if self.key is not None else ("address", self.address)


ANONYMOUS = Requester()
"""The requester of generations that name none (a program embedding the fleet, tests)."""


class GenerationHandle(Protocol):
    """One generation in flight: its result, a cancel, and "placed, tokens will come"."""

    @property
    def result(self) -> Deferred[FleetOutcome]: ...

    def cancel(self) -> None: ...

    def when_placed(self) -> Deferred[None]: ...


@dataclass(frozen=True, slots=True)
class NodeReport:
    """One node as the metrics show it."""

    name: str
    up: bool
    sessions: int
    """Sessions the head placed there and has not ended."""
    capacity: CapacitySummary | None
    """The node's last NODE_STATUS capacity (docs/protocol.md section 7.5); None before one."""


@dataclass(frozen=True, slots=True)
class BackendStatus:
    """How the backend stands, for one model: what ``/healthz``, ``/v1/models``, ``/metrics``
    and the request checks need to know."""

    live_nodes: int
    """Nodes whose link is open."""
    window: int = 0
    """The largest known context window among nodes serving the model (0: none known, or
    unlimited)."""
    context_limit: int | None = None
    """A context longer than this fits no node serving the model; None while any window is
    unknown or unlimited (the fleet then tries)."""
    lanes_active: int = 0
    """Lanes decoding on live nodes (the larger of their report and the generations this head
    runs there)."""
    lanes_total: int = 0
    """Lanes the live nodes reported (0: none reported yet)."""
    queued: int = 0
    """Generations waiting for a lane: at the nodes (reported, or beyond their lanes) and in
    the head's own queue."""
    waiting: int = 0
    """Requests waiting in the head's own queue for a node (part of ``queued``)."""
    queue_rejected: int = 0
    """Requests refused at once because the head's queue was full (since start)."""
    queue_timeouts: int = 0
    """Requests that waited the queue timeout for a node in vain (since start)."""
    failovers: int = 0
    reconnects: int = 0
    nodes: tuple[NodeReport, ...] = ()
    serving_nodes: int = 0
    """Live nodes that serve the model (named it, and the head serves it with them)."""
    model_running: int = 0
    """Generations of the model decoding on the nodes serving it."""
    model_waiting: int = 0
    """Generations of the model waiting for a lane: in the head's queue, and beyond the lanes
    of the nodes serving it."""
    model_kv_blocks_used: int = 0
    """KV blocks in use on the live nodes serving the model (their latest reports)."""
    model_kv_blocks_total: int = 0
    """KV blocks in total on those nodes."""

    @property
    def busy(self) -> bool:
        """Every reported lane is taken, or generations are waiting for one."""
        return self.queued > 0 or (self.lanes_total > 0 and self.lanes_active >= self.lanes_total)


class Backend(Protocol):
    """What the HTTP API runs generations on: the fleet, or a pipeline driver."""

    def generate(
        self,
        prompt: Sequence[int],
        max_new: int,
        *,
        model: str | None = None,
        params: GenParams = ...,
        on_tokens: TokenSink | None = None,
        max_wall_ms: int = 0,
        request_class: RequestClass = ...,
        requester: Requester = ...,
    ) -> GenerationHandle:
        """Run one generation of ``prompt``; ``on_tokens(tokens)`` gets its tokens as they
        come, or ``on_tokens(tokens, logprobs)`` when ``params.logprobs`` asks for them (a
        backend that cannot return them fails the generation with
        :class:`~sfnode.head.fleet.LogprobsUnavailable`); ``request_class`` says whether someone
        waits on it (docs/protocol.md section 12.2); ``requester`` whose share of the queue it
        takes (section 8.5)."""

    def status(self, model: str | None = None) -> BackendStatus: ...


class PipelineBackend:
    """A pipeline driver as a :class:`Backend`: generations run across its stages, the status
    is that of the fleet that keeps the stage links."""

    def __init__(self, pipeline: PipelineFleet) -> None:
        self.pipeline = pipeline

    def generate(
        self,
        prompt: Sequence[int],
        max_new: int,
        *,
        model: str | None = None,
        params: GenParams = _DEFAULT_PARAMS,
        on_tokens: TokenSink | None = None,
        max_wall_ms: int = 0,
        request_class: RequestClass = RequestClass.INTERACTIVE,
        requester: Requester = ANONYMOUS,
    ) -> GenerationHandle:
        # A pipeline runs one generation at a time on its stages: there is no lane to keep,
        # so neither the class nor the requester changes anything there.
        return self.pipeline.generate(
            prompt,
            max_new,
            model=model,
            params=params,
            on_tokens=on_tokens,
            max_wall_ms=max_wall_ms,
        )

    def status(self, model: str | None = None) -> BackendStatus:
        return self.pipeline.fleet.status(model)


__all__ = [
    "ANONYMOUS",
    "Backend",
    "BackendStatus",
    "GenerationHandle",
    "NodeReport",
    "PipelineBackend",
    "Requester",
]
