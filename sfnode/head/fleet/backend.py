"""What the head's HTTP layer asks of whatever runs its generations: a small typed interface.

The HTTP layer (:mod:`sfnode.head.api.http`, :mod:`sfnode.head.api.metrics`) never reads the fleet's
internals (its nodes, links or counters).  It asks a :class:`Backend` two things: run a
generation (:meth:`Backend.generate`, its tokens streamed as
:class:`~sfnode.generation.TokenBatch` values) and say how things stand
(:meth:`Backend.status`, one :class:`BackendStatus` snapshot).  A generation is asked for with
one frozen :class:`HeadRequest`, built once from the checked HTTP body and passed as it is to
the fleet, its failover attempts and the link's GENERATE_REQ.  How a generation ends is
declared here too: :class:`FleetOutcome` and the :class:`FleetError` family, so that the HTTP
layer, the fleet and the pipeline driver all import them from here and none of them from
another.  :class:`~sfnode.head.fleet.fleet.Fleet` and
:class:`~sfnode.head.fleet.pipeline.PipelineFleet` are Backends as they are.

This module must never import Twisted's reactor, another module of the head, the node side or
torch, and never hold state: it is types only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from twisted.internet.defer import Deferred

from sfnode.generation import Embedded, TokenSink
from sfnode.linkf.wire import (
    FEATURE_CONSTRAINTS,
    FEATURE_LOGPROBS,
    CapacitySummary,
    Constraint,
    GenParams,
    RequestClass,
)

_DEFAULT_PARAMS = GenParams()


# --------------------------------------------------------------------------------------------
# How a generation ends


@dataclass(frozen=True, slots=True)
class FleetOutcome:
    """How a fleet generation ended: every token delivered, in order, and the finish reason."""

    tokens: list[int]
    finish: int
    node: str
    """The node that finished it."""
    failovers: int
    detail: int = 0
    """The last Finish's ``detail`` bits (``FINISH_DETAIL_CLOSED``: the node closed the
    constrained output within its budget, docs/protocol.md section 12.6)."""


class FleetError(Exception):
    """A request the fleet cannot serve."""


class NoNodeAvailable(FleetError):
    """No live node could take the request (none came back or freed a lane in time, or none
    serves the model)."""


class QueueFull(FleetError):
    """Every live node is busy and the queue of waiting requests is full."""


class ClientQueueFull(QueueFull):
    """The client's address already holds its share of the queue (``max_client_queued``)."""

    def __init__(self, address: str, limit: int) -> None:
        super().__init__(
            f"this client address has {limit} generations waiting for a lane, the most one "
            "address may have waiting (--max-client-queued); retry when some have started"
        )
        self.address = address
        self.limit = limit


class NodeDown(FleetError):
    """The session's node cannot be reached now."""


class NodeDeclined(FleetError):
    """The node answered FINISH_DECLINED (stale epoch, replayed command, or draining)."""


class SessionClosed(FleetError):
    """The session was closed; it cannot append or generate any more."""


class GenerationTimedOut(FleetError):
    """The generation passed its wall budget (``max_generation_s``) without ending."""


class LogprobsUnavailable(FleetError):
    """The request asks for logprobs and no node serving the model returns them (every one
    of them has said so: its HELLO_ACK_F lacks FEATURE_LOGPROBS, docs/protocol.md 12.1)."""


class ConstraintsUnavailable(FleetError):
    """The generation has a constraint and no node serving the model honours constraints
    (every one of them has said so: its HELLO_ACK_F lacks FEATURE_CONSTRAINTS,
    docs/protocol.md section 12.3)."""


class ConstraintRefused(FleetError):
    """A node refused the generation's constraint (FINISH_REFUSED for a context that fits
    it): a grammar its library cannot compile, or delivered tokens the grammar refuses."""


# --------------------------------------------------------------------------------------------
# Who asks, and what they are told


@dataclass(frozen=True, slots=True)
class Requester:
    """Who a generation is for, as the head's queue shares lanes (docs/protocol.md section
    8.5): the client's address and the API key it was admitted with."""

    address: str = ""
    """The client's address ("" for a program's own generations: no per-address bound)."""
    key: bytes | None = None
    """The API key the request carried (None: the API is open)."""
    weight: float = 1.0
    """Its share's weight: lanes are shared in proportion to it (the key file's
    ``weight=``, docs/api.md "API keys")."""

    @property
    def share(self) -> tuple[str, bytes | str]:
        """Whom the queue shares lanes among: the API key when there is one, else the
        address (several programs behind one address share it; one key on many addresses is
        still one client)."""
        return ("key", self.key) if self.key is not None else ("address", self.address)


ANONYMOUS = Requester()
"""The requester of generations that name none (a program embedding the fleet, tests)."""


def needed_features(params: GenParams, constraint: Constraint | None = None) -> int:
    """The feature flags a node must offer to serve a session with ``params`` (and a
    generation with ``constraint``)."""
    return (FEATURE_LOGPROBS if params.logprobs else 0) | (
        FEATURE_CONSTRAINTS if constraint is not None else 0
    )


@dataclass(frozen=True, slots=True)
class HeadRequest:
    """One generation as the head's API asked for it: built once from the checked body and
    passed as it is from the exchange to the backend, the fleet's attempts and the link's
    GENERATE_REQ (a failover passes a copy with what is left of ``max_new`` and the
    constraint's ``generated_from``)."""

    prompt: tuple[int, ...]
    """The complete context to generate after (the rendered, tokenized prompt)."""
    max_new: int
    """The most tokens to generate."""
    model: str | None = None
    """The model it is for (None: whatever the nodes serve)."""
    params: GenParams = _DEFAULT_PARAMS
    """Sampling, seed and logprobs (``params.logprobs``: how many alternatives per token,
    docs/protocol.md section 12.1)."""
    max_wall_ms: int = 0
    """The node's wall budget for it (0: none)."""
    request_class: RequestClass = RequestClass.INTERACTIVE
    """Whether someone waits on it (docs/protocol.md section 12.2)."""
    requester: Requester = ANONYMOUS
    """Whose share of the queue it takes (section 8.5)."""
    background: bool = False
    """A batch generation that waits for all other work: ranked last in the head's queue and
    its lanes taken back first (section 8.5, "Shares"); nodes see it as batch."""
    constraint: Constraint | None = None
    """The grammar and sampler controls its output follows (section 12.3)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(self.prompt))

    @property
    def interactive(self) -> bool:
        return self.request_class == RequestClass.INTERACTIVE

    @property
    def rank(self) -> int:
        """Its class's place in the head's queue and preemption (docs/protocol.md section
        8.5, "Shares"): 0 interactive, 1 batch, 2 background."""
        if self.interactive:
            return 0
        return 2 if self.background else 1

    @property
    def features(self) -> int:
        """What a node must offer to run it."""
        return needed_features(self.params, self.constraint)


class GenerationHandle(Protocol):
    """One generation in flight: its result, a cancel, and "placed, tokens will come"."""

    @property
    def result(self) -> Deferred[FleetOutcome]: ...

    def cancel(self) -> None: ...

    def when_placed(self) -> Deferred[None]: ...

    def park(self) -> None:
        """Its client stopped reading: give the lane back until :meth:`unpark`."""

    def unpark(self) -> None:
        """Its client reads again: go on where it stopped."""


@dataclass(frozen=True, slots=True)
class NodeReport:
    """One node as the metrics show it."""

    name: str
    up: bool
    sessions: int
    """Sessions the head placed there and has not ended."""
    capacity: CapacitySummary | None
    """The node's last NODE_STATUS capacity (docs/protocol.md section 7.5); None before one."""
    refused: str | None = None
    """Why the node serves no model (its HELLO_ACK_F said so, D25); None when it serves one."""


@dataclass(frozen=True, slots=True)
class StageReport:
    """One pipeline stage as the metrics and the console show it: its node and its layers
    ``[start, end)`` (docs/protocol.md section 7.6)."""

    stage: int
    node: str
    start: int
    end: int
    planned: str
    """How its boundaries were chosen: ``given`` (--pipeline-layers), ``planned`` (by the
    stage nodes' memory and speed) or ``even``."""

    def as_json(self) -> dict[str, object]:
        return {
            "stage": self.stage,
            "node": self.node,
            "first_layer": self.start,
            "end_layer": self.end,
            "layers": self.end - self.start,
            "boundaries": self.planned,
        }


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
    reclaimed: int = 0
    """Lanes taken back from a client over its share or from a later class (section 8.5,
    "Shares"; since start)."""
    reconnects: int = 0
    nodes: tuple[NodeReport, ...] = ()
    serving_nodes: int = 0
    """Live nodes that generate with the model (named it, and the head serves it with
    them)."""
    model_running: int = 0
    """Generations of the model decoding on the nodes serving it."""
    model_waiting: int = 0
    """Generations of the model waiting for a lane: in the head's queue, and beyond the lanes
    of the nodes serving it."""
    model_kv_blocks_used: int = 0
    """KV blocks in use on the live nodes serving the model (their latest reports)."""
    model_kv_blocks_total: int = 0
    """KV blocks in total on those nodes."""
    embedding_nodes: int = 0
    """Live nodes that serve the model as an embedding model (docs/protocol.md section
    12.7)."""
    stages: tuple[StageReport, ...] = ()
    """A pipeline's stages, in order (none for a fleet)."""

    @property
    def busy(self) -> bool:
        """Every reported lane is taken, or generations are waiting for one."""
        return self.queued > 0 or (self.lanes_total > 0 and self.lanes_active >= self.lanes_total)


class Backend(Protocol):
    """What the HTTP API runs generations on: the fleet, or a pipeline driver."""

    def generate(
        self, request: HeadRequest, on_tokens: TokenSink | None = None
    ) -> GenerationHandle:
        """Run one generation of ``request``; ``on_tokens(batch)`` gets its tokens as they
        come, one :class:`~sfnode.generation.TokenBatch` at a time, each token once, carrying
        logprobs when ``request.params.logprobs`` asks for them (a backend that cannot return
        them fails the generation with :class:`LogprobsUnavailable`); ``result`` fires with a
        :class:`FleetOutcome` or fails with a :class:`FleetError` (or a link error).  A
        backend that cannot enforce ``request.constraint`` (docs/protocol.md section 12.3)
        raises or fails with :class:`ConstraintsUnavailable`."""

    def status(self, model: str | None = None) -> BackendStatus: ...

    @property
    def embeddings(self) -> EmbeddingBackend | None:
        """Where embedding requests go (None: this backend serves none)."""


class EmbeddingBackend(Protocol):
    """What the HTTP API asks of a backend's embeddings (docs/protocol.md section 12.7)."""

    def embed(self, model: str, texts: Sequence[str]) -> Deferred[Embedded]:
        """One vector per text from a node serving ``model`` as an embedding model; fails
        with :class:`NoNodeAvailable` when none can."""


__all__ = [
    "ANONYMOUS",
    "Backend",
    "BackendStatus",
    "ClientQueueFull",
    "ConstraintRefused",
    "ConstraintsUnavailable",
    "EmbeddingBackend",
    "FleetError",
    "FleetOutcome",
    "GenerationHandle",
    "GenerationTimedOut",
    "HeadRequest",
    "LogprobsUnavailable",
    "NoNodeAvailable",
    "NodeDeclined",
    "NodeDown",
    "NodeReport",
    "QueueFull",
    "Requester",
    "SessionClosed",
    "needed_features",
]
