"""The fleet's registry of nodes: each node's link and the head's own count of its load
(:class:`FleetNode`), and :class:`NodeRegistry`, which dials the nodes the head is told about,
adopts the ones that dial in, and hears what their links say (docs/protocol.md section 8).

Every link it builds gets the registry's one :class:`~sfnode.head.link.LinkSettings`, dialed
or dialed in.  This module must never place a request, never use the global reactor (the
reactor and the clock are parameters), and never import torch or the node side.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime, IStreamClientEndpoint
from twisted.logger import Logger

from sfnode.head.fleet import placement
from sfnode.head.fleet.events import EventJournal
from sfnode.head.fleet.model_admission import ModelAdmission
from sfnode.head.fleet.prefix_index import BlockKey, PrefixIndex
from sfnode.head.link import (
    HeadIds,
    HeadLinkFactory,
    LinkError,
    LinkSettings,
    NodeLink,
    parse_endpoint,
)
from sfnode.head.link.machine import RetryPolicy
from sfnode.linkf.prefix_blocks import KV_BLOCK_TOKENS
from sfnode.linkf.wire import FEATURE_EMBEDDINGS

_log = Logger(namespace="sfnode.head.fleet.fleet")


class FleetNode:
    """One node of the registry: its link, and the head's own count of its load."""

    def __init__(self, link: NodeLink, order: int) -> None:
        self.link = link
        self.order = order
        """Registration order: unique, the last tie-breaker of placement."""
        self.sessions = 0
        """Sessions placed here and not ended."""
        self.inflight = 0
        """Generations the head runs here."""
        self.admitted = True
        """The head serves the model it names with it (sfnode.head.fleet.model_admission)."""
        self.interactive_inflight = 0
        """How many of them are interactive (docs/protocol.md section 12.2)."""
        self.failed_attempts = 0
        """Failed (re)connection attempts since the link was last open."""
        self.last_failure = ""
        self.prefixes = PrefixIndex()
        """The blocks of the contexts placed and generated here (what its cache may hold)."""
        self.declined_at: float | None = None
        """When it last declined a generation (clock seconds); it takes nothing new until a
        load report sampled after that arrives."""
        self.ended: deque[float] = deque()
        """When this head's generations here ended, since the node's latest load report."""
        self.draining = False
        """An operator drained it (the console): it takes no new generation, the running ones
        finish."""
        self.dialled_at: float | None = None
        """When the head started dialing it (clock seconds); None for a node that dialed in."""

    @property
    def name(self) -> str:
        return self.link.name

    @property
    def description(self) -> str:
        """The endpoint string dialed, or the peer of a node that dialed in."""
        return self.link.description

    @property
    def label(self) -> str:
        """The name and, when it says more, the endpoint: ``vm (tcp:10.0.0.5:8454)``."""
        name, description = self.link.name, self.link.description
        return name if name == description else f"{name} ({description})"

    @property
    def dialed(self) -> bool:
        return self.link.dialable

    @property
    def live(self) -> bool:
        """Its link is open, the head serves its model with it and it is not drained:
        placement may use it."""
        return self.link.ready and self.admitted and self.refused is None and not self.draining

    @property
    def refused(self) -> str | None:
        """Why the node serves no model, as its HELLO_ACK_F said (docs/protocol.md section
        5.2, D25); None for a node that serves one."""
        ack = self.link.hello_ack
        return ack.refused if ack is not None else None

    @property
    def down(self) -> bool:
        return not self.link.ready

    @property
    def models(self) -> tuple[str, ...]:
        return self.link.models

    @property
    def embeds(self) -> bool:
        """It serves its model as an embedding model (docs/protocol.md section 12.7): it
        takes EMBED_REQ and no generation."""
        return bool((self.link.features or 0) & FEATURE_EMBEDDINGS)

    @property
    def window(self) -> int | None:
        """The node's context window: None while unknown, 0 when unlimited."""
        capacity = self.link.capacity
        return None if capacity is None else capacity.max_context_tokens

    def view(self, now: float, keys: Sequence[BlockKey] = ()) -> placement.NodeView:
        """What placement knows of this node now, for a request whose context has the block
        keys ``keys`` (how much of it the node is believed to hold)."""
        at = self.link.capacity_at
        self._forget_reported_ends()
        return placement.NodeView(
            key=self.order,
            live=self.live,
            models=self.link.models,
            capacity=self.link.capacity,
            report_age_s=None if at is None else now - at,
            sessions=self.sessions,
            inflight=self.inflight,
            features=self.link.features,
            interactive_inflight=self.interactive_inflight,
            cached_tokens=self.prefixes.cached_blocks(keys) * KV_BLOCK_TOKENS if keys else 0,
            ended_since_report=len(self.ended),
            declined=self.declined_at is not None and (at is None or at <= self.declined_at),
        )

    def generation_started(self, interactive: bool) -> None:
        """One of this head's generations starts here (counted by class, section 12.2)."""
        self.inflight += 1
        if interactive:
            self.interactive_inflight += 1

    def generation_ended(self, now: float, interactive: bool) -> None:
        """One of this head's generations here ended (its lane is free)."""
        self.inflight -= 1
        if interactive:
            self.interactive_inflight -= 1
        self._forget_reported_ends()
        self.ended.append(now)

    def _forget_reported_ends(self) -> None:
        # Only the ends after the latest report matter: that report still counts them, a
        # later one does not.
        at = self.link.capacity_at
        while self.ended and (at is None or self.ended[0] <= at):
            self.ended.popleft()

    def remember(self, keys: Sequence[BlockKey]) -> None:
        """The node was sent, or computed, the blocks named ``keys``."""
        capacity = self.link.capacity
        if capacity is not None and capacity.kv_blocks_total:
            # Bounded like the node's own pool, so the index forgets about when the node evicts.
            self.prefixes.capacity = capacity.kv_blocks_total
        self.prefixes.record(keys)

    def fits(self, length: int) -> bool:
        """Whether a context of ``length`` tokens fits (an unknown window is tried)."""
        window = self.window
        return window is None or window == 0 or length <= window

    def __repr__(self) -> str:
        return f"<FleetNode {self.name} {self.link.status}>"


class NodeRegistry:
    """The fleet's nodes, in registration order, and a :class:`~sfnode.head.link.LinkObserver`
    of each one's link.  ``on_room()`` is called whenever a node may take work it could not
    before (a node joined, a link opened again); ``on_report()`` when a node reported its
    load."""

    def __init__(
        self,
        reactor: object,
        clock: IReactorTime,
        ids: HeadIds,
        settings: LinkSettings,
        retry: RetryPolicy,
        retry_max_s: float,
        on_room: Callable[[], None],
        on_report: Callable[[], None],
        models: ModelAdmission | None = None,
    ) -> None:
        self._reactor = reactor
        self.models = models
        """Which node serves which model, by the head's model registry (None: every node
        serves the model it names)."""
        if models is not None:
            models.changed = self._model_judged
        self._clock = clock
        self.ids = ids
        self.settings = settings
        self._retry = retry
        self.retry_max_s = retry_max_s
        """The longest redial delay (for the log)."""
        self._on_room = on_room
        self._on_report = on_report
        self.nodes: list[FleetNode] = []
        self.reconnects = 0
        """Links that opened again after a drop (since start)."""
        self.stopping = False
        """The head is stopping: a node that dials in now is turned away."""
        self._orders = itertools.count()
        self._join_waiters: list[Deferred[FleetNode]] = []
        self.events = EventJournal(clock.seconds)
        """What happened to the fleet, for the console (sfnode.head.fleet.events): joins,
        leaves, drains here; failovers and preemptions by the fleet's generations."""

    def views(self, keys: Sequence[BlockKey] = ()) -> list[placement.NodeView]:
        """What placement knows of every node now (for a context with block keys ``keys``)."""
        now = self._clock.seconds()
        return [n.view(now, keys) for n in self.nodes]

    def dial(self, endpoint: str | IStreamClientEndpoint) -> Deferred[FleetNode]:
        """Register a node the head dials and start dialing it; fires with it once the first
        attempt ended, whether it reached the node or not (a node that cannot be reached is
        kept and redialled with backoff)."""
        dialer, description = parse_endpoint(self._reactor, endpoint)
        link = NodeLink(
            self._reactor,
            self.ids,
            settings=self.settings,
            endpoint=dialer,
            description=description,
            clock=self._clock,
            retry=self._retry,
        )
        node = FleetNode(link, next(self._orders))
        node.dialled_at = self._clock.seconds()
        self.nodes.append(node)
        link.observe(self)
        link.start()
        first = link.when_open()
        return first.addBoth(lambda _: node)

    def listen_factory(self, *, loopback_only: bool = False) -> HeadLinkFactory:
        """The protocol factory for a port that nodes dial (``--fleet-listen``).

        ``loopback_only`` (what ``twistd sfhead`` asks for without a fleet token, unless
        --insecure-no-auth) closes connections from anywhere but loopback at once.
        """
        return HeadLinkFactory(
            self.adopt,
            reactor=self._reactor,
            ids=self.ids,
            settings=self.settings,
            clock=self._clock,
            loopback_only=loopback_only,
        )

    def starting_for(self, start_s: float) -> float:
        """Seconds until every node the head dials that has never answered (it may be
        converting or loading its model) has had ``start_s`` to do it; 0 when none is
        starting."""
        now = self._clock.seconds()
        return max(
            (
                node.dialled_at + start_s - now
                for node in self.nodes
                if node.dialled_at is not None and node.link.hello_ack is None
            ),
            default=0.0,
        )

    def named(self, name: str) -> FleetNode | None:
        for node in self.nodes:
            if node.name == name:
                return node
        return None

    def drain(self, name: str) -> FleetNode | None:
        """Drain the node named ``name`` (None: no such node): placement gives it nothing
        new from now on (its generations running finish; a reconnect keeps it drained)."""
        node = self.named(name)
        if node is not None and not node.draining:
            node.draining = True
            self.events.record("draining", node.name, detail=f"{node.inflight} running")
            _log.info("node {node} drained by an operator", node=node.label)
        return node

    def next_join(self) -> Deferred[FleetNode]:
        """Fires with the next node that dials in and passes the handshake."""
        d: Deferred[FleetNode] = Deferred()
        self._join_waiters.append(d)
        return d

    def of_link(self, link: NodeLink) -> FleetNode | None:
        for node in self.nodes:
            if node.link is link:
                return node
        return None

    def adopt(self, link: NodeLink) -> None:
        """A node dialed in and passed the handshake: it joins by identity."""
        if self.stopping:
            link.close()
            return
        node = FleetNode(link, next(self._orders))
        self.nodes.append(node)
        link.observe(self)
        self._judge(node)
        _log_joined(node, f"dialed in from {link.description}")
        self._joined(node)
        waiters, self._join_waiters = self._join_waiters, []
        for d in waiters:
            d.callback(node)
        self._on_room()

    def _joined(self, node: FleetNode) -> None:
        if node.refused is not None:
            self.events.record("refused", node.name, detail=node.refused)
        else:
            self.events.record("joined", node.name, model=", ".join(node.models))

    def _judge(self, node: FleetNode) -> None:
        """Whether the head serves the model ``node`` names with it (at every handshake: a
        node may come back with other files)."""
        if self.models is not None:
            node.admitted = self.models.judge(node.link)

    def _model_judged(self, link: NodeLink) -> None:
        """The verdict on ``link`` changed after its handshake (its files arrived)."""
        node = self.of_link(link)
        if node is not None and self.models is not None:
            node.admitted = self.models.admits(link)
            self._on_room()

    # ----------------------------------------------------------------------------------------
    # LinkObserver: what the links say

    def link_opened(self, link: NodeLink, reconnected: bool) -> None:
        node = self.of_link(link)
        if node is None:
            return
        self._judge(node)
        if not reconnected:
            _log_joined(node, f"dialed {node.description}")
            self._joined(node)
        else:
            self.reconnects += 1
            self.events.record("back", node.name)
            if node.failed_attempts:
                _log.info(
                    "node {node} is back after {count} failed attempts",
                    node=node.label,
                    count=node.failed_attempts,
                )
            else:
                _log.info(
                    "the link to {node} is open again (reconciled)",
                    node=node.label,
                )
        node.failed_attempts = 0
        node.last_failure = ""
        if reconnected:
            # The node may have restarted with an empty cache; what it kept is learned again.
            node.prefixes.clear()
        self._on_room()

    def link_failed(self, link: NodeLink, reason: LinkError, retry_in_s: float | None) -> None:
        node = self.of_link(link)
        if node is None:
            return
        node.failed_attempts += 1
        text = str(reason)
        if node.failed_attempts == 1:
            _log.warn(
                "node {node} is down: {reason}; redialling in {delay:.1f} s, "
                "then backing off up to {cap:g} s",
                node=node.label,
                reason=text,
                delay=retry_in_s or 0.0,
                cap=self.retry_max_s,
            )
        elif text != node.last_failure:
            _log.info(
                "node {node} is still down: {reason} (attempt {count})",
                node=node.label,
                reason=text,
                count=node.failed_attempts,
            )
        node.last_failure = text

    def link_dropped(self, link: NodeLink, reason: LinkError) -> None:
        node = self.of_link(link)
        if node is None:
            return
        self.events.record("lost", node.name, detail=str(reason))
        if link.dialable:
            _log.info(
                "the link to {node} dropped: {reason}; redialling",
                node=node.label,
                reason=str(reason),
            )

    def link_reported(self, link: NodeLink) -> None:
        if self.of_link(link) is not None:
            # A fresh report may say that a full node (or one that declined) has room again.
            self._on_report()

    def link_closed(self, link: NodeLink) -> None:
        node = self.of_link(link)
        if node is None or self.stopping or link.dialable:
            return
        self.nodes.remove(node)
        if self.models is not None:
            self.models.forget(link)
        self.events.record("left", node.name, detail=str(link.last_reason or ""))
        _log.info(
            "node {node} left: {reason}",
            node=node.name,
            reason=str(link.last_reason or "its connection ended"),
        )


def _log_joined(node: FleetNode, how: str) -> None:
    if node.refused is not None:
        _log.error(
            "node {node} joined ({how}) refusing its model: {reason}; it stays connected but "
            "serves nothing",
            node=node.name,
            how=how,
            reason=node.refused,
        )
        return
    _log.info(
        "node {node} joined ({how}; models {models}, window {window})",
        node=node.name,
        how=how,
        models=", ".join(node.link.models) or "-",
        window=node.window,
    )
