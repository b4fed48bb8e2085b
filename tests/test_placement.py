"""Placement as a pure function (sfnode.head.placement): no links, no reactor, no clock.

Each test builds the nodes as placement sees them (:class:`NodeView`) and checks the decision:
the order of the candidates under each policy, when a request waits (no live node, every lane
busy), and when it is refused (the prompt fits no window, no node serves the model).
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.placement import (
    NodeView,
    Place,
    Policy,
    Request,
    TooLong,
    Unserved,
    Wait,
    decide,
    max_window,
    rank,
)
from sfnode.wire import CapacitySummary


def node(key: int, *, live: bool = True, age: float | None = 1.0, **fields: object) -> NodeView:
    """A node with a fresh report built from ``fields`` (capacity fields, sessions, inflight,
    models)."""
    capacity_fields = {k: v for k, v in fields.items() if k in CapacitySummary.__dataclass_fields__}
    view_fields = {k: v for k, v in fields.items() if k not in capacity_fields}
    capacity = CapacitySummary(**capacity_fields)  # type: ignore[arg-type]
    return NodeView(key=key, live=live, capacity=capacity, report_age_s=age, **view_fields)  # type: ignore[arg-type]


def keys(views: list[NodeView]) -> list[int]:
    return [v.key for v in views]


def request(length: int = 10, **fields: object) -> Request:
    return Request(model=fields.pop("model", None), length=length, **fields)  # type: ignore[arg-type]


class PolicyTests(SynchronousTestCase):
    def test_the_eta_prefers_the_node_with_less_work_ahead(self) -> None:
        """A fresh report of busy lanes and a queue puts a node behind an idle one, even with
        fewer sessions; a faster decode rate wins among equals."""
        busy = node(0, lanes_active=6, queue_depth=2, decode_tokens_per_s=50)
        idle = node(1, decode_tokens_per_s=50, sessions=3)
        fast = node(2, decode_tokens_per_s=500, sessions=3)
        ranked = rank([busy, idle, fast], Policy.LOAD_AWARE, 10, 64)
        self.assertEqual([v.key for v in ranked], [2, 1, 0])

    def test_a_hot_kv_pool_is_avoided_unless_all_are_hot(self) -> None:
        """A node at >= 90 % KV occupancy is dropped from the candidates while another is
        cooler; when all are hot they all stay."""
        hot = node(0, kv_blocks_used=95, kv_blocks_total=100)
        cool = node(1, kv_blocks_used=10, kv_blocks_total=100)
        self.assertEqual([v.key for v in rank([hot, cool], Policy.LOAD_AWARE, 10, 64)], [1])
        hot2 = node(1, kv_blocks_used=95, kv_blocks_total=100)
        self.assertEqual([v.key for v in rank([hot, hot2], Policy.LOAD_AWARE, 10, 64)], [0, 1])

    def test_a_stale_report_counts_only_the_heads_own_inflight(self) -> None:
        """A report older than 10 s no longer counts as the node's load: only the head's own
        running generations do."""
        fresh_busy = node(0, lanes_active=8, queue_depth=8)
        other = node(1, inflight=1)
        self.assertEqual(keys(rank([fresh_busy, other], Policy.LOAD_AWARE, 10, 64)), [1, 0])
        stale_busy = node(0, age=11.0, lanes_active=8, queue_depth=8)
        self.assertEqual(keys(rank([stale_busy, other], Policy.LOAD_AWARE, 10, 64)), [0, 1])

    def test_least_loaded_counts_sessions_and_generations(self) -> None:
        """least-loaded orders by sessions + generations, then registration order."""
        views = [node(0, sessions=2), node(1, sessions=1, inflight=2), node(2, sessions=1)]
        self.assertEqual([v.key for v in rank(views, Policy.LEAST_LOADED, 10, 64)], [2, 0, 1])

    def test_round_robin_rotates_from_the_cursor(self) -> None:
        """round-robin starts at the cursor (modulo the candidates) in registration order."""
        views = [node(2), node(0), node(1)]
        orders = [[v.key for v in rank(views, Policy.ROUND_ROBIN, 10, 64, c)] for c in range(4)]
        self.assertEqual(orders, [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]])


class DecisionTests(SynchronousTestCase):
    def test_only_live_nodes_with_a_free_lane_are_candidates(self) -> None:
        """A node that is down, or whose lanes are all taken by the head's generations, is not
        a candidate; a session opened idle (no lane needed) may still go to a full node."""
        views = [node(0, live=False), node(1, max_lanes=2, inflight=2), node(2, max_lanes=2)]
        self.assertEqual(decide(views, request(), Policy.LEAST_LOADED), Place((2,)))
        full = [node(0, live=False), node(1, max_lanes=2, inflight=2)]
        self.assertIsInstance(decide(full, request(), Policy.LEAST_LOADED), Wait)
        self.assertEqual(decide(full, request(needs_lane=False), Policy.LEAST_LOADED), Place((1,)))

    def test_a_node_that_reports_no_lanes_is_never_full(self) -> None:
        """max_lanes 0 (not reported) puts no limit on the head's generations there."""
        self.assertEqual(decide([node(0, inflight=50)], request(), Policy.LOAD_AWARE), Place((0,)))

    def test_no_live_node_means_wait_not_refuse(self) -> None:
        """With every node down (or none yet) the request waits, with a reason."""
        for views in ([], [node(0, live=False), node(1, live=False)]):
            decision = decide(views, request(), Policy.LOAD_AWARE)
            assert isinstance(decision, Wait)
            self.assertIn("no live node", decision.reason)
        busy = decide([node(0, max_lanes=1, inflight=1)], request(), Policy.LOAD_AWARE)
        assert isinstance(busy, Wait)
        self.assertIn("lane", busy.reason)

    def test_a_prompt_no_window_holds_is_too_long_even_with_nodes_down(self) -> None:
        """Known windows that are all too small refuse the prompt (quoting the largest) whether
        or not their nodes are live; an unknown or unlimited window lets it wait or place."""
        views = [node(0, live=False, max_context_tokens=64), node(1, max_context_tokens=32)]
        self.assertEqual(decide(views, request(96), Policy.LOAD_AWARE), TooLong(96, 64))
        unknown = [node(0, max_context_tokens=64), NodeView(key=1, live=False)]
        self.assertIsInstance(decide(unknown, request(96), Policy.LOAD_AWARE), Wait)
        unlimited = [node(0, max_context_tokens=0)]
        self.assertEqual(decide(unlimited, request(96), Policy.LOAD_AWARE), Place((0,)))

    def test_the_quoted_window_is_that_of_the_models_nodes(self) -> None:
        """Only nodes serving the model count for the refusal and for max_window."""
        views = [
            node(0, models=("m",), max_context_tokens=64),
            node(1, models=("x",), max_context_tokens=4096),
        ]
        self.assertEqual(decide(views, request(96, model="m"), Policy.LOAD_AWARE), TooLong(96, 64))
        self.assertEqual(max_window(views, "m"), 64)
        self.assertEqual(max_window(views, None), 4096)

    def test_a_model_no_node_serves_is_refused_once_every_node_said(self) -> None:
        """When every node has said what it serves and none serves the model, it is refused;
        while one has not said (never connected), the request may wait for it."""
        said = [node(0, models=("a",)), node(1, live=False, models=("b",))]
        self.assertEqual(decide(said, request(model="c"), Policy.LOAD_AWARE), Unserved("c"))
        unsaid = [node(0, models=("a",)), NodeView(key=1, live=False)]
        self.assertIsInstance(decide(unsaid, request(model="c"), Policy.LOAD_AWARE), Wait)

    def test_nodes_tried_already_come_last(self) -> None:
        """A failover lists the nodes it tried after the others, and still lists them (a node
        that came back is better than waiting)."""
        views = [node(0), node(1), node(2)]
        decision = decide(views, request(avoid=frozenset({0})), Policy.LEAST_LOADED)
        self.assertEqual(decision, Place((1, 2, 0)))
