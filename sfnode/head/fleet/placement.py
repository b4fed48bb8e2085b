"""Placement: which node takes a session, decided from what the nodes reported (docs/protocol.md
section 8, "Per request"; the load report is section 7.5).

Everything here is a pure function of :class:`NodeView` snapshots that the fleet builds from its
links: :func:`decide` says *place it on one of these nodes, in this order*, *wait* (no live node
can take it now), or *refuse* (the prompt fits no node's window, no node serves the model, or
none offers a feature the request needs: :func:`with_features`).
Three policies order the candidates: ``load-aware`` (an estimate of when the node would finish
the request, from its reported lanes, queue and token rates), ``least-loaded`` (fewest sessions
and generations) and ``round-robin``.

``load-aware`` is also prefix-aware (:class:`PrefixRule`, :func:`prefix_credit`): a node believed
to hold the first blocks of the request's context in its prefix cache (the fleet's
:class:`~sfnode.head.fleet.prefix_index.PrefixIndex` says how many tokens, in
:attr:`NodeView.cached_tokens`) counts as that many generations less busy (``weight``
generations per 1,000 cached tokens), unless it has more than ``max_skew`` generations ahead of
the least busy candidate.  When any candidate has such a credit, the candidates are ordered by
their generations ahead less their credit, and by the estimate only among equals: the reported
rates are busy-time averages of prefill and decode together, noisy from one report to the next,
and weighing a prefix in seconds of them let that noise decide.  Requests that share a system
prompt, or the turns of one conversation, so land where their prefix already is, unless that
node is much busier.

A live node can take a generation while the generations the head runs on it are fewer than its
``max_lanes`` (0: the node did not say, no limit): requests beyond that wait at the head, where
they can still go to whichever node frees a lane first or comes back, instead of queueing
inside one node that may die.

An interactive request (docs/protocol.md section 12.2) differs in two ways, both in
:func:`takes_interactive` and :func:`prefer_interactive_lanes`: on a node that keeps a lane for
interactive work it is not held back by the head's count of busy lanes, and nodes with a free
interactive lane are tried first.

This module must never do I/O, read a clock, hold a link or keep state between calls: the
fleet passes in everything, including the round-robin cursor and the ages of the reports.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sfnode.linkf.wire import FEATURE_EMBEDDINGS, FEATURE_REQUEST_CLASS, U32_MAX, CapacitySummary

FRESH_SAMPLE_S = 10.0
"""A load report older than this does not count as the node's load."""
POOL_HIGH_PERCENT = 90
"""A node whose KV pool is at least this full is avoided while a cooler one can take the work."""
DEFAULT_DECODE_RATE = 20
"""Tokens/s assumed for a node that reported no decode rate, when no node reported one."""
DEFAULT_PREFILL_RATE = 200
DEFAULT_EXPECTED_OUT = 64
"""Tokens a session is expected to generate, when the request does not say."""
KEPT_INTERACTIVE_LANES = 1
"""Lanes the head counts on a node with the request-class bit keeping for interactive work
(docs/protocol.md section 12.2; sfnode's ``--interactive-lanes`` default, and the least a node
that keeps any keeps)."""
DEFAULT_PREFIX_WEIGHT = 6.0
"""Generations ahead that 1,000 cached prompt tokens are worth: a lane more in a node's batch
slows each of its lanes a little (a batch shares each pass over the weights), while a 1,000-token
prefill takes seconds on a CPU and slows every lane decoding beside it, and once done on a second
node it stays duplicated in both caches (docs/protocol.md section 8.5)."""
DEFAULT_PREFIX_MAX_SKEW = 6
"""Generations a node may have ahead of the least busy candidate and still be credited."""


class Policy(enum.Enum):
    """How a session's node is chosen among the eligible ones."""

    LOAD_AWARE = "load-aware"
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


@dataclass(frozen=True, slots=True)
class NodeView:
    """What placement knows of one node at one moment."""

    key: int
    """The node's registration order: unique and stable, the last tie-breaker."""
    live: bool
    """Its link is open (handshaken, and reconciled after a reconnect)."""
    models: tuple[str, ...] = ()
    """The models it serves; () until it said (it is then assumed to serve any)."""
    capacity: CapacitySummary | None = None
    """Its latest load report (HELLO_ACK_F or NODE_STATUS), None before the first."""
    report_age_s: float | None = None
    """Seconds since that report arrived."""
    sessions: int = 0
    """Sessions the head placed there and has not ended."""
    inflight: int = 0
    """Generations the head runs there now."""
    features: int | None = None
    """The feature flags of its latest HELLO_ACK_F (docs/protocol.md section 12); None before
    its first handshake."""
    interactive_inflight: int = 0
    """How many of them are interactive (docs/protocol.md section 12.2)."""
    cached_tokens: int = 0
    """Leading tokens of the request's context this node is believed to hold in its prefix
    cache (the fleet's prefix index); 0 when none or unknown."""
    ended_since_report: int = 0
    """Generations the head ran there that ended after its load report was sampled: the
    report still counts them as running."""
    declined: bool = False
    """It declined a generation since its latest load report (full, or draining)."""

    @property
    def request_classes(self) -> bool:
        """The node set FEATURE_REQUEST_CLASS: it admits interactive work first and keeps a
        lane for it (docs/protocol.md section 12.2)."""
        return bool((self.features or 0) & FEATURE_REQUEST_CLASS)

    @property
    def window(self) -> int | None:
        """The node's context window: None while unknown, 0 when unlimited."""
        return None if self.capacity is None else self.capacity.max_context_tokens

    @property
    def fresh(self) -> bool:
        """Whether its load report is recent enough to count."""
        return self.report_age_s is not None and self.report_age_s < FRESH_SAMPLE_S

    @property
    def free_lane(self) -> bool:
        """Whether the head runs fewer generations there than the node has lanes."""
        lanes = 0 if self.capacity is None else self.capacity.max_lanes
        return lanes == 0 or self.inflight < lanes

    def serves(self, model: str | None) -> bool:
        """Whether it generates with ``model`` (or has not said what it serves yet); a node
        that serves an embedding model generates nothing (docs/protocol.md section 12.7)."""
        if (self.features or 0) & FEATURE_EMBEDDINGS:
            return False
        return model is None or not self.models or model in self.models

    def fits(self, length: int) -> bool:
        """Whether a context of ``length`` tokens fits its window (an unknown one is tried)."""
        window = self.window
        return window is None or window == 0 or length <= window

    @property
    def full(self) -> bool:
        """Whether it takes no new session now: it declined work since its latest report, or
        a fresh report has its live sessions at its ``max_sessions`` (docs/protocol.md 7.7)."""
        if self.declined:
            return True
        capacity = self.capacity
        if capacity is None or not self.fresh:
            return False
        cap = capacity.max_sessions
        return 0 < cap < U32_MAX and capacity.active_sessions >= cap


@dataclass(frozen=True, slots=True)
class Request:
    """What is to be placed."""

    model: str | None
    length: int
    """Tokens of context the node will hold."""
    expected_out: int = DEFAULT_EXPECTED_OUT
    """Tokens it is expected to generate (the load-aware estimate uses it)."""
    needs_lane: bool = True
    """A generation starts at once (it needs a free lane); False for a session opened idle."""
    avoid: frozenset[int] = frozenset()
    """Keys of nodes tried already for this request: they come last, if at all."""
    features: int = 0
    """Feature flags the node must have set (``FEATURE_LOGPROBS`` for a session that asks
    for logprobs, docs/protocol.md section 12.1)."""
    interactive: bool = False
    """Someone waits on it (docs/protocol.md section 12.2)."""


@dataclass(frozen=True, slots=True)
class PrefixRule:
    """How much a cached prefix counts against load (the ``load-aware`` policy only)."""

    weight: float = DEFAULT_PREFIX_WEIGHT
    """Generations ahead a node is credited per 1,000 tokens of the request's context it holds
    (0: prefixes are ignored)."""
    max_skew: int = DEFAULT_PREFIX_MAX_SKEW
    """A node with more than this many generations ahead of the least busy candidate gets no
    credit, however much of the prompt it holds."""

    def __post_init__(self) -> None:
        if not self.weight >= 0:
            raise ValueError(f"the prefix weight must be 0 or more, not {self.weight!r}")
        if self.max_skew < 0:
            raise ValueError(f"the prefix skew must be 0 or more, not {self.max_skew!r}")


DEFAULT_PREFIX_RULE = PrefixRule()
NO_PREFIX = PrefixRule(weight=0.0)
"""A rule that ignores cached prefixes: ``load-aware`` as it was before prefix reuse."""


@dataclass(frozen=True, slots=True)
class Place:
    """Place it on the first of these nodes that still takes it (keys, best first)."""

    order: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Wait:
    """No live node can take it now; one may come back or free a lane."""

    reason: str


@dataclass(frozen=True, slots=True)
class TooLong:
    """No node serving the model can hold ``length`` tokens; ``largest`` is the widest window."""

    length: int
    largest: int


@dataclass(frozen=True, slots=True)
class Unserved:
    """Every node has said what it serves, and none serves ``model``."""

    model: str


@dataclass(frozen=True, slots=True)
class Unsupported:
    """Every node serving the model has said what it offers, and none offers ``features``."""

    features: int


Decision = Place | Wait | TooLong | Unserved | Unsupported


def decide(
    views: Sequence[NodeView],
    request: Request,
    policy: Policy,
    cursor: int = 0,
    prefix: PrefixRule | None = None,
) -> Decision:
    """Where ``request`` goes, given the nodes as they are now.

    ``cursor`` is the round-robin position (the caller advances it after each placement);
    ``prefix`` weighs the views' ``cached_tokens`` against load (``load-aware`` only; None:
    :data:`DEFAULT_PREFIX_RULE`).
    """
    serving = [v for v in views if v.serves(request.model)]
    if request.model is not None and views and not serving and all(v.models for v in views):
        return Unserved(request.model)
    offering = with_features(serving, request.features)
    if isinstance(offering, Unsupported):
        return offering
    serving = offering
    largest = too_long(serving, request.length)
    if largest is not None:
        return TooLong(request.length, largest)
    candidates = [
        v
        for v in serving
        if v.live
        and v.fits(request.length)
        and not v.full
        and (
            v.free_lane or not request.needs_lane or (request.interactive and takes_interactive(v))
        )
    ]
    if not candidates:
        live = [v for v in serving if v.live and v.fits(request.length)]
        if live and all(v.full for v in live):
            return Wait("every live node is full or draining")
        if live:
            return Wait("every lane of the live nodes is busy")
        return Wait("no live node serves " + (request.model or "the model"))
    ranked = rank(candidates, policy, request.length, request.expected_out, cursor, prefix)
    if request.interactive:
        ranked = prefer_interactive_lanes(ranked)
    preferred = [v.key for v in ranked if v.key not in request.avoid]
    tried = [v.key for v in ranked if v.key in request.avoid]
    return Place(tuple(preferred + tried))


def with_features(views: Sequence[NodeView], features: int) -> list[NodeView] | Unsupported:
    """The views whose node offers every flag of ``features``, keeping the ones that have not
    said yet (a node not handshaken may offer them; the request waits for it).

    :class:`Unsupported` when some node serves the model and every one of them has said,
    and none offers them: waiting cannot help.
    """
    if not features:
        return list(views)
    kept = [v for v in views if v.features is None or v.features & features == features]
    if views and not kept:
        return Unsupported(features)
    return kept


def takes_interactive(view: NodeView) -> bool:
    """Whether an interactive generation may go to ``view`` although the head counts all its
    lanes busy: the node keeps a lane for interactive work (it set the request-class bit) and
    the head runs no more interactive generations there than such lanes.  It then starts in
    that lane, or first when a lane frees, rather than wait at the head behind batch work."""
    return view.request_classes and view.interactive_inflight < KEPT_INTERACTIVE_LANES


def free_interactive_lane(view: NodeView) -> bool:
    """Whether an interactive generation would start at once on ``view``: the head counts a
    free lane there and a fresh report agrees (``lanes_active`` < ``max_lanes``: it also
    counts other heads' work), or the node keeps a lane for it (:func:`takes_interactive`)."""
    if takes_interactive(view):
        return True
    capacity = view.capacity
    if capacity is None or not capacity.max_lanes:
        return True
    if view.fresh and capacity.lanes_active >= capacity.max_lanes:
        return False
    return view.free_lane


def prefer_interactive_lanes(ranked: Sequence[NodeView]) -> list[NodeView]:
    """``ranked`` with the nodes that have a free interactive lane first, each group in its
    own order (docs/protocol.md section 12.2)."""
    free = [v for v in ranked if free_interactive_lane(v)]
    return free + [v for v in ranked if not free_interactive_lane(v)]


def too_long(views: Iterable[NodeView], length: int) -> int | None:
    """The largest window, when every one of ``views`` has a known, finite window and none
    holds ``length`` tokens; else None (something may fit, or nothing is known yet)."""
    windows = [v.window for v in views]
    if not windows or any(w is None or w == 0 for w in windows):
        return None
    largest = max(w for w in windows if w is not None)
    return largest if length > largest else None


def max_window(views: Iterable[NodeView], model: str | None) -> int:
    """The largest known window among the nodes serving ``model`` (0: unknown or unlimited)."""
    return max((v.window or 0 for v in views if v.serves(model)), default=0)


def rank(
    views: Sequence[NodeView],
    policy: Policy,
    length: int,
    expected_out: int,
    cursor: int = 0,
    prefix: PrefixRule | None = None,
) -> list[NodeView]:
    """``views`` in the order ``policy`` tries them."""
    if not views:
        return []
    if policy is Policy.ROUND_ROBIN:
        ordered = sorted(views, key=lambda v: v.key)
        start = cursor % len(ordered)
        return ordered[start:] + ordered[:start]
    if policy is Policy.LEAST_LOADED:
        return sorted(views, key=lambda v: (v.sessions + v.inflight, v.key))
    return _load_aware(views, length, expected_out, prefix or DEFAULT_PREFIX_RULE)


def _hot(view: NodeView) -> bool:
    capacity = view.capacity
    if capacity is None or not capacity.kv_blocks_total or not view.fresh:
        return False
    return capacity.kv_blocks_used * 100 // capacity.kv_blocks_total >= POOL_HIGH_PERCENT


def _mean(values: list[int], default: int) -> float:
    """The mean of the rates that were reported (0 means "not measured yet")."""
    reported = [v for v in values if v]
    return sum(reported) / len(reported) if reported else default


def ahead(view: NodeView) -> int:
    """Generations a new one would wait behind on ``view`` (or share its lanes with)."""
    capacity = view.capacity
    if capacity is not None and view.fresh:
        # The report counts this head's running generations too, also those that ended since
        # it was sampled (taken off here, or a node that just finished work would look busy
        # for up to a status interval); inflight covers the ones started since.
        reported = capacity.lanes_active + capacity.queue_depth - view.ended_since_report
        return max(reported, view.inflight)
    return view.inflight


def prefix_credit(view: NodeView, rule: PrefixRule, least_ahead: int) -> float:
    """Generations taken off ``view``'s work ahead for the prefix it holds.

    ``weight * cached_tokens / 1000``; nothing when the rule's weight is 0, the node holds none
    of the context, or it has more than ``max_skew`` generations ahead of ``least_ahead`` (the
    least busy candidate's).
    """
    if rule.weight <= 0 or view.cached_tokens <= 0:
        return 0.0
    if ahead(view) - least_ahead > rule.max_skew:
        return 0.0
    return rule.weight * view.cached_tokens / 1000


def _load_aware(
    views: Sequence[NodeView], length: int, expected_out: int, prefix: PrefixRule
) -> list[NodeView]:
    """Least estimated time to finish first: the work ahead of the request and its own tokens
    at the node's decode rate, and its prompt at the prefill rate; hot KV pools last.  When a
    candidate holds a prefix of the request (:func:`prefix_credit`), least work ahead less the
    credit first, the estimate among equals."""
    cool = [v for v in views if not _hot(v)]
    pool = cool or list(views)
    mean_decode = _mean(
        [v.capacity.decode_tokens_per_s for v in pool if v.capacity is not None],
        DEFAULT_DECODE_RATE,
    )
    mean_prefill = _mean(
        [v.capacity.prefill_tokens_per_s for v in pool if v.capacity is not None],
        DEFAULT_PREFILL_RATE,
    )
    least_ahead = min(ahead(v) for v in pool)

    def eta(view: NodeView) -> float:
        capacity = view.capacity
        decode = (capacity.decode_tokens_per_s if capacity is not None else 0) or mean_decode
        prefill = (capacity.prefill_tokens_per_s if capacity is not None else 0) or mean_prefill
        return (ahead(view) + 1) * expected_out / decode + length / prefill

    credits = {v.key: prefix_credit(v, prefix, least_ahead) for v in pool}
    if any(credits.values()):
        return sorted(pool, key=lambda v: (ahead(v) - credits[v.key], eta(v), v.sessions, v.key))
    return sorted(pool, key=lambda v: (eta(v), v.sessions, v.key))


__all__ = [
    "DEFAULT_EXPECTED_OUT",
    "DEFAULT_PREFIX_MAX_SKEW",
    "DEFAULT_PREFIX_RULE",
    "DEFAULT_PREFIX_WEIGHT",
    "NO_PREFIX",
    "Decision",
    "NodeView",
    "Place",
    "Policy",
    "PrefixRule",
    "Request",
    "TooLong",
    "Unserved",
    "Unsupported",
    "Wait",
    "ahead",
    "decide",
    "free_interactive_lane",
    "max_window",
    "prefer_interactive_lanes",
    "prefix_credit",
    "rank",
    "takes_interactive",
    "too_long",
    "with_features",
]
