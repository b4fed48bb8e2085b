"""Placement as a pure function (sfnode.head.fleet.placement): no links, no reactor, no clock.

Each test builds the nodes as placement sees them (:class:`NodeView`) and checks the decision:
the order of the candidates under each policy, when a request waits (no live node, every lane
busy), when it is refused (the prompt fits no window, no node serves the model), and how a
node's cached prefix weighs against its load (the prefix rule of docs/protocol.md section 8.5).
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.fleet.placement import (
    DEFAULT_PREFIX_RULE,
    NO_PREFIX,
    NodeView,
    Place,
    Policy,
    PrefixRule,
    Request,
    TooLong,
    Unserved,
    Wait,
    ahead,
    decide,
    max_window,
    prefix_credit,
    rank,
)
from sfnode.linkf.wire import CapacitySummary


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


class PrefixRuleTests(SynchronousTestCase):
    """Cached prefix length against load, under ``load-aware`` (docs/protocol.md section 8.5)."""

    def test_the_node_holding_the_prefix_wins_among_equals(self) -> None:
        """Two idle nodes alike in all but the prefix: the one believed to hold the first
        960 tokens of a 1,000-token prompt comes first, whatever the registration order;
        without the prefix rule the registration order decides."""
        cold = node(0, decode_tokens_per_s=50, prefill_tokens_per_s=500)
        holder = node(1, decode_tokens_per_s=50, prefill_tokens_per_s=500, cached_tokens=960)
        self.assertEqual(keys(rank([cold, holder], Policy.LOAD_AWARE, 1000, 64)), [1, 0])
        plain = rank([cold, holder], Policy.LOAD_AWARE, 1000, 64, prefix=NO_PREFIX)
        self.assertEqual(keys(plain), [0, 1])

    def test_the_credit_is_generations_per_thousand_cached_tokens(self) -> None:
        """The credit is weight x cached tokens / 1,000 generations (6 per 1,000 by default);
        nothing for a node that holds none of the prompt, or with weight 0."""
        holder = node(0, cached_tokens=1000)
        self.assertEqual(prefix_credit(holder, DEFAULT_PREFIX_RULE, 0), 6.0)
        self.assertEqual(prefix_credit(node(0, cached_tokens=250), DEFAULT_PREFIX_RULE, 0), 1.5)
        self.assertEqual(prefix_credit(holder, PrefixRule(weight=2.5), 0), 2.5)
        self.assertEqual(prefix_credit(holder, NO_PREFIX, 0), 0.0)
        self.assertEqual(prefix_credit(node(1), DEFAULT_PREFIX_RULE, 0), 0.0)

    def test_the_prefix_is_weighed_against_the_work_ahead(self) -> None:
        """By default 500 cached tokens are worth three generations ahead: a holder with two
        more generations ahead than an idle node wins, with four more it loses; 1,000 cached
        tokens outweigh four.  The reported rates do not change the balance."""
        for rates in ({"decode_tokens_per_s": 100, "prefill_tokens_per_s": 1000},
                      {"decode_tokens_per_s": 20, "prefill_tokens_per_s": 5000}):  # fmt: skip
            idle = node(0, **rates)
            one_more = node(1, lanes_active=2, cached_tokens=500, **rates)
            three_more = node(1, lanes_active=4, cached_tokens=500, **rates)
            larger = node(1, lanes_active=4, cached_tokens=1000, **rates)
            self.assertEqual(keys(rank([idle, one_more], Policy.LOAD_AWARE, 2000, 50)), [1, 0])
            self.assertEqual(keys(rank([idle, three_more], Policy.LOAD_AWARE, 2000, 50)), [0, 1])
            self.assertEqual(keys(rank([idle, larger], Policy.LOAD_AWARE, 2000, 50)), [1, 0])

    def test_a_holder_reporting_slower_rates_keeps_its_credit(self) -> None:
        """The credit is weighed in generations, not in seconds of the nodes' rates: a holder
        whose latest report shows a third of the other node's decode rate (rates are busy-time
        averages, and a node that just prefilled reports a low one) still wins while its work
        ahead less its credit is smaller; without any credit the estimate decides as before."""
        idle = node(0, decode_tokens_per_s=90, prefill_tokens_per_s=300)
        holder = node(1, lanes_active=2, cached_tokens=1000, decode_tokens_per_s=30,
                      prefill_tokens_per_s=100)  # fmt: skip
        self.assertEqual(keys(rank([idle, holder], Policy.LOAD_AWARE, 1100, 32)), [1, 0])
        cold = node(1, lanes_active=2, decode_tokens_per_s=30, prefill_tokens_per_s=100)
        self.assertEqual(keys(rank([idle, cold], Policy.LOAD_AWARE, 1100, 32)), [0, 1])
        faster = node(0, lanes_active=1, decode_tokens_per_s=900, prefill_tokens_per_s=3000)
        self.assertEqual(keys(rank([faster, cold], Policy.LOAD_AWARE, 1100, 32)), [0, 1])

    def test_the_longer_cached_prefix_wins(self) -> None:
        """Between two idle holders, the one believed to hold more of the context comes first."""
        short = node(0, cached_tokens=320)
        long = node(1, cached_tokens=640)
        self.assertEqual(keys(rank([short, long], Policy.LOAD_AWARE, 1000, 64)), [1, 0])

    def test_a_much_busier_holder_gets_no_credit(self) -> None:
        """However much it holds, a node with more than max_skew generations ahead of the
        least busy candidate is ranked by load alone; at exactly max_skew it keeps its credit."""
        idle = node(0)
        at_skew = node(1, inflight=4, cached_tokens=4000)
        beyond = node(1, inflight=5, cached_tokens=4000)
        rule = PrefixRule(weight=4.0, max_skew=4)
        self.assertEqual(keys(rank([idle, at_skew], Policy.LOAD_AWARE, 4100, 10, prefix=rule)),
                         [1, 0])  # fmt: skip
        self.assertEqual(keys(rank([idle, beyond], Policy.LOAD_AWARE, 4100, 10, prefix=rule)),
                         [0, 1])  # fmt: skip
        self.assertEqual(prefix_credit(beyond, rule, ahead(idle)), 0.0)
        self.assertEqual(prefix_credit(at_skew, rule, ahead(idle)), 16.0)

    def test_the_skew_counts_the_fresh_reports_like_the_estimate(self) -> None:
        """The work ahead is the fresh report's lanes and queue, or the head's own generations
        when more (or when the report is stale)."""
        self.assertEqual(ahead(node(0, lanes_active=3, queue_depth=2, inflight=1)), 5)
        self.assertEqual(ahead(node(0, lanes_active=1, inflight=4)), 4)
        self.assertEqual(ahead(node(0, age=11.0, lanes_active=6, inflight=2)), 2)

    def test_generations_that_ended_since_the_report_are_not_ahead(self) -> None:
        """A report still counts the head's generations that ended after it was sampled: they
        are taken off (never below the head's own running generations), so a node that just
        finished its work does not look busy until its next report."""
        self.assertEqual(ahead(node(0, lanes_active=6, inflight=2, ended_since_report=3)), 3)
        self.assertEqual(ahead(node(0, lanes_active=6, inflight=5, ended_since_report=3)), 5)
        self.assertEqual(ahead(node(0, lanes_active=2, inflight=0, ended_since_report=2)), 0)
        finished = node(0, lanes_active=6, decode_tokens_per_s=50, ended_since_report=6)
        running = node(1, decode_tokens_per_s=50, inflight=1)
        self.assertEqual(keys(rank([running, finished], Policy.LOAD_AWARE, 10, 64)), [0, 1])
        holder = node(0, lanes_active=7, inflight=1, ended_since_report=6, cached_tokens=900)
        other = node(1, inflight=1)
        rule = PrefixRule(max_skew=0)
        self.assertEqual(keys(rank([other, holder], Policy.LOAD_AWARE, 950, 64, prefix=rule)),
                         [0, 1])  # fmt: skip

    def test_only_load_aware_weighs_prefixes(self) -> None:
        """least-loaded and round-robin ignore what a node holds."""
        views = [node(0), node(1, cached_tokens=4000)]
        self.assertEqual(keys(rank(views, Policy.LEAST_LOADED, 4100, 64)), [0, 1])
        self.assertEqual(keys(rank(views, Policy.ROUND_ROBIN, 4100, 64)), [0, 1])

    def test_decide_passes_the_rule_on(self) -> None:
        """decide() orders by the prefix rule it is given (the default one when none)."""
        views = [node(0), node(1, cached_tokens=4000)]
        self.assertEqual(decide(views, request(4100), Policy.LOAD_AWARE), Place((1, 0)))
        self.assertEqual(
            decide(views, request(4100), Policy.LOAD_AWARE, prefix=NO_PREFIX), Place((0, 1))
        )

    def test_a_rule_refuses_negative_values(self) -> None:
        """A negative (or not-a-number) weight, or a negative skew, is refused when built."""
        for bad in (
            {"weight": -1.0},
            {"weight": float("nan")},
            {"max_skew": -1},
        ):
            with self.assertRaises(ValueError):
                PrefixRule(**bad)  # type: ignore[arg-type]
