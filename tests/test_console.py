"""The operator's console (docs/api.md "The console"): its pure pieces on their own (the fleet's
event journal, the time series, client labels, the feed on a ``Clock``), then ``/console``,
``/console/state``, ``/console/feed`` and the drain over real loopback TCP, with mock nodes
behind a head, as ``sfnode top`` and scripts use them.

Why real TCP for the second half: the console reads the head's own objects (links, reports,
queue, shares) as a running head fills them, and its feed holds a connection open as a browser
does; the browser itself is tests/test_console_browser.py.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Generator, Sequence
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock, deferLater
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import Agent, readBody
from twisted.web.http_headers import Headers

from sfnode.head.api.gate import GateLimits
from sfnode.head.api.http import OpenAIApi
from sfnode.head.api.keys import KeyFileError, KeyPolicy, parse_key_line
from sfnode.head.console.feed import STALLED_UPDATES, Feed
from sfnode.head.console.record import CLIENTS_COUNTED, OTHERS, ConsoleRecord, client_label
from sfnode.head.console.series import SAMPLE_EVERY_S, Series, percentile, window_percentiles
from sfnode.head.console.state import Console
from sfnode.head.fleet.events import EventJournal
from sfnode.head.fleet.fleet import Fleet
from sfnode.head.fleet.placement import Policy
from tests.memoryhead import MemoryHeadTestCase
from tests.nodefixture import RunningNode
from tests.test_http import MESSAGES, MODEL, Head, HttpTestCase, tokenizer

ADMIN = b"sk-ops-admin"
USER = b"sk-team-user"


class JournalTests(SynchronousTestCase):
    def test_events_are_numbered_timed_and_bounded(self) -> None:
        """Events are numbered from 1 with the time the journal's clock gives; only the newest
        ``limit`` are kept, and ``since`` gives those after a number still kept."""
        clock = Clock()
        journal = EventJournal(clock.seconds, limit=3)
        for i in range(5):
            clock.advance(1)
            journal.record("joined", f"n{i}")
        self.assertEqual(len(journal), 3)
        self.assertEqual([e.seq for e in journal.latest(10)], [3, 4, 5])
        self.assertEqual([e.node for e in journal.latest(2)], ["n3", "n4"])
        self.assertEqual([e.seq for e in journal.since(4)], [5])
        self.assertEqual(journal.latest(10)[-1].at, 5.0)
        self.assertEqual(journal.last_seq, 5)

    def test_a_long_detail_is_cut(self) -> None:
        """A detail (a node's refusal, say) is kept to 200 characters."""
        journal = EventJournal(Clock().seconds)
        event = journal.record("refused", "n", detail="x" * 5000)
        self.assertEqual(len(event.detail), 200)
        self.assertEqual(event.as_json()["kind"], "refused")


class RecordTests(SynchronousTestCase):
    def test_a_key_is_named_by_its_hash_never_itself(self) -> None:
        """A client with a key is shown by 8 hex digits of the key's SHA-256, an address as it
        is, the head's own generations as (head)."""
        label = client_label(("key", b"sk-secret-key"))
        self.assertRegex(label, r"^key:[0-9a-f]{8}$")
        self.assertNotIn("secret", label)
        self.assertEqual(client_label(("address", "10.0.0.7")), "10.0.0.7")
        self.assertEqual(client_label(("address", "")), "(head)")

    def test_429s_are_counted_per_client_within_a_bound(self) -> None:
        """429s are counted per client up to CLIENTS_COUNTED clients; the rest together."""
        record = ConsoleRecord(EventJournal(Clock().seconds), Clock().seconds)
        for i in range(CLIENTS_COUNTED + 5):
            record.refused(("address", f"10.0.{i // 256}.{i % 256}"))
        record.refused(("address", "10.0.0.0"))
        self.assertEqual(len(record.rate_limited), CLIENTS_COUNTED + 1)
        self.assertEqual(record.rate_limited[OTHERS], 5)
        self.assertEqual(record.rate_limited["10.0.0.0"], 2)


class SeriesTests(SynchronousTestCase):
    def test_percentile_is_nearest_rank(self) -> None:
        """p50 and p95 by nearest rank; none of no value."""
        values = [float(v) for v in range(1, 101)]
        self.assertEqual(percentile(values, 0.5), 50.0)
        self.assertEqual(percentile(values, 0.95), 95.0)
        self.assertIsNone(percentile([], 0.5))

    def test_a_point_per_period_with_the_rate_since_the_last(self) -> None:
        """A point is taken at most every SAMPLE_EVERY_S seconds; its rate is the tokens
        delivered since the last point per second, its percentiles those of the first tokens
        since then; a model no longer served loses its series."""
        series = Series()
        firsts = [(1.0, "m", 0.1), (2.0, "m", 0.3), (7.0, "m", 0.2), (7.0, "other", 9.0)]
        series.sample(0.0, ["m"], {"m": 0}, firsts[:0])
        series.sample(3.0, ["m"], {"m": 50}, firsts[:2])  # too soon: no point
        series.sample(10.0, ["m"], {"m": 100}, firsts)
        points = series.points("m")
        self.assertEqual(len(points), 2)
        self.assertEqual(points[1], [10.0, 10.0, 200.0, 300.0])
        self.assertEqual(series.latest_rate("m"), 10.0)
        series.sample(10.0 + SAMPLE_EVERY_S, [], {}, firsts)
        self.assertEqual(series.points("m"), [])

    def test_window_percentiles_are_of_one_model_and_recent(self) -> None:
        """The model table's p50/p95 are over the last five minutes of that model, in ms."""
        firsts = [(0.0, "m", 5.0), (400.0, "m", 0.1), (401.0, "m", 0.2), (401.0, "x", 7.0)]
        self.assertEqual(window_percentiles(450.0, "m", firsts), (100.0, 200.0))


class _Request:
    """What the feed asks of a twisted.web request, recorded."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.finished: defer.Deferred[None] = defer.Deferred()
        self.producer: Any = None
        self.transport = self
        self.channel = self
        self.aborted = False

    def registerProducer(self, producer: Any, streaming: bool) -> None:
        self.producer = producer

    def unregisterProducer(self) -> None:
        self.producer = None

    def notifyFinish(self) -> defer.Deferred[None]:
        return self.finished

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abortConnection(self) -> None:
        self.aborted = True


class FeedTests(SynchronousTestCase):
    def feed(self) -> tuple[Clock, Feed, list[int]]:
        clock = Clock()
        built: list[int] = []

        def render() -> bytes:
            built.append(1)
            return b'{"n":%d}' % len(built)

        return clock, Feed(clock, render, max_viewers=2, period_s=0.5), built

    def test_nothing_is_built_without_a_viewer(self) -> None:
        """With no viewer no snapshot is built and no timer runs; the timer stops with the last
        viewer and starts again with the next."""
        clock, feed, built = self.feed()
        clock.advance(10)
        self.assertEqual((built, clock.getDelayedCalls()), ([], []))
        viewer = _Request()
        feed.add(viewer)
        self.assertEqual(len(built), 1)
        clock.advance(0.5)
        clock.advance(0.5)
        self.assertEqual(len(built), 3)
        viewer.finished.callback(None)
        self.assertEqual(clock.getDelayedCalls(), [])
        clock.advance(10)
        self.assertEqual(len(built), 3)

    def test_one_build_per_update_for_every_viewer(self) -> None:
        """Two viewers get the same bytes from one build per period, as server-sent events;
        a viewer that connects gets the latest update unless it is a period old; the feed is
        full at max_viewers."""
        clock, feed, built = self.feed()
        first, second = _Request(), _Request()
        feed.add(first)
        feed.add(second)
        self.assertTrue(feed.full)
        self.assertEqual(len(built), 1)  # the second got the first's, built this period
        clock.advance(0.5)
        self.assertEqual(len(built), 2)  # one for both
        self.assertEqual(first.written[-1], second.written[-1])
        self.assertEqual(first.written[-1], b'event: state\ndata: {"n":2}\n\n')
        first.finished.callback(None)
        second.finished.callback(None)
        clock.advance(0.6)
        feed.add(_Request())
        self.assertEqual(len(built), 3)  # the latest was a period old: built anew
        feed.add(_Request())
        self.assertEqual(len(built), 3)
        self.assertTrue(first.written[0].startswith(b"retry: "))

    def test_a_paused_viewer_is_skipped_then_cut_off(self) -> None:
        """A viewer whose connection is full (paused) is skipped, and after STALLED_UPDATES
        skipped updates it is cut off; the other keeps its updates."""
        clock, feed, _ = self.feed()
        slow, fast = _Request(), _Request()
        feed.add(slow)
        feed.add(fast)
        slow.producer.pauseProducing()
        before = len(slow.written)
        for _ in range(STALLED_UPDATES - 1):
            clock.advance(0.5)
        self.assertEqual(len(slow.written), before)
        self.assertFalse(slow.aborted)
        clock.advance(0.5)
        self.assertTrue(slow.aborted)
        self.assertEqual(len(feed.viewers), 1)
        self.assertEqual(len(fast.written), 2 + STALLED_UPDATES)


class KeyFileTests(SynchronousTestCase):
    def test_admin_field(self) -> None:
        """``admin=yes`` marks a key that may drain nodes; anything but yes or no is refused
        without repeating the key."""
        self.assertTrue(parse_key_line(b"sk-a admin=yes")[1].admin)
        self.assertFalse(parse_key_line(b"sk-a admin=no")[1].admin)
        self.assertFalse(parse_key_line(b"sk-a weight=2")[1].admin)
        with self.assertRaises(KeyFileError) as caught:
            parse_key_line(b"sk-secret admin=maybe")
        self.assertNotIn("sk-secret", str(caught.exception))


class _Body(Protocol):
    """Collects a streamed body; ``first(n)`` fires once ``n`` events arrived."""

    def __init__(self) -> None:
        self.data = b""
        self.done: defer.Deferred[None] = defer.Deferred()
        self._waiting: list[tuple[int, defer.Deferred[list[Any]]]] = []

    def events(self) -> list[Any]:
        return [
            json.loads(block.partition(b"data: ")[2])
            for block in self.data.split(b"\n\n")
            if block.startswith(b"event: state")
        ]

    def first(self, count: int) -> defer.Deferred[list[Any]]:
        d: defer.Deferred[list[Any]] = defer.Deferred()
        self._waiting.append((count, d))
        self._check()
        return d

    def _check(self) -> None:
        events = self.events()
        for entry in list(self._waiting):
            if len(events) >= entry[0]:
                self._waiting.remove(entry)
                entry[1].callback(events)

    def dataReceived(self, data: bytes) -> None:
        self.data += data
        self._check()

    def connectionLost(self, reason: Any) -> None:
        if not self.done.called:
            self.done.callback(None)


def console_head_api(fleet: Fleet, **api: Any) -> OpenAIApi:
    """An API over ``fleet`` with its console (as ``twistd sfhead`` builds it)."""
    record = ConsoleRecord(fleet.registry.events, reactor.seconds)
    console = Console(fleet, record, lambda: [MODEL], reactor.seconds)
    return OpenAIApi(
        reactor, fleet, tokenizer(), MODEL, seed_source=lambda: 7, console=console, **api
    )


class ConsoleHttpCase(HttpTestCase):
    """A head with its console, and requests to it with or without keys."""

    @defer.inlineCallbacks
    def console_head(
        self, nodes: Sequence[RunningNode], *, keys: bool = False, **fleet: Any
    ) -> Generator[defer.Deferred[Any], Any, Head]:
        f = yield self.fleet_with(nodes, **fleet)
        options: dict[str, Any] = {}
        if keys:
            policies = {ADMIN: KeyPolicy(admin=True), USER: KeyPolicy()}
            options = {"api_keys": [ADMIN, USER], "limits": GateLimits(keys=policies)}
        return (yield self.listening(f, console_head_api(f, **options)))

    @defer.inlineCallbacks
    def get(
        self, head: Head, path: str, headers: dict[bytes, list[bytes]] | None = None,
        method: bytes = b"GET",
    ) -> Generator[defer.Deferred[Any], Any, tuple[int, bytes, Any]]:
        response = yield Agent(reactor).request(
            method, (head.base + path).encode(), Headers(headers or {})
        )
        body = yield readBody(response)
        return response.code, body, response.headers

    def state(self, head: Head, key: bytes | None = None) -> defer.Deferred[Any]:
        headers = {b"authorization": [b"Bearer " + key]} if key else None
        return self.get(head, "/console/state", headers).addCallback(
            lambda answer: json.loads(answer[1])
        )


class ConsoleHttpTests(ConsoleHttpCase):
    @defer.inlineCallbacks
    def test_state_shows_the_nodes_models_and_joins(self) -> Generator[Any, Any, None]:
        """``/console/state`` lists each node (identity, address, model, serving, lanes, KV
        blocks, a heartbeat age, its features: logprobs, kept stage KV and stage batches), the
        model with its nodes, the joins in the events, and names what the wire does not
        carry."""
        a = yield self.start_vocab_node(identity="alpha", max_lanes=4)
        b = yield self.start_vocab_node(identity="beta", max_lanes=2)
        head = yield self.console_head([a, b])
        state = yield self.state(head)
        nodes = {n["name"]: n for n in state["nodes"]}
        self.assertEqual(sorted(nodes), ["alpha", "beta"])
        alpha = nodes["alpha"]
        self.assertEqual(alpha["state"], "serving")
        self.assertEqual(alpha["address"], a.endpoint)
        self.assertEqual(alpha["models"], [MODEL])
        self.assertEqual((alpha["lanes_used"], alpha["lanes_total"]), (0, 4))
        self.assertGreater(alpha["kv_total"], 0)
        self.assertGreaterEqual(alpha["heartbeat_s"], 0)
        self.assertIn("logprobs", alpha["features"])
        self.assertIn("stage_kv", alpha["features"])
        self.assertIn("stage_batch", alpha["features"])
        self.assertEqual(state["head"]["live_nodes"], 2)
        self.assertEqual(state["head"]["lanes_total"], 6)
        self.assertEqual(state["models"][0]["name"], MODEL)
        self.assertEqual(sorted(state["models"][0]["nodes"]), ["alpha", "beta"])
        joined = [e["node"] for e in state["events"] if e["kind"] == "joined"]
        self.assertEqual(sorted(joined), ["alpha", "beta"])
        # What the node runs on: its TELEMETRY after HELLO_ACK_F (docs/protocol.md 12.9).
        self.assertEqual(alpha["engine_path"], "mock")
        self.assertTrue(alpha["cpu"])
        self.assertNotIn("unreported", state)

    @defer.inlineCallbacks
    def test_a_nodes_resident_memory_comes_with_its_load_reports(
        self,
    ) -> Generator[Any, Any, None]:
        """A node's resident memory is in each NODE_STATUS (D27): none before the first
        report after the handshake, then the node process's resident set."""
        from sfnode.node.host import resident_bytes

        node = yield self.start_vocab_node(identity="alpha", status_interval_ms=100)
        head = yield self.console_head([node])
        for _ in range(100):
            state = yield self.state(head)
            if state["nodes"][0]["resident_bytes"] is not None:
                break
            yield deferLater(reactor, 0.05)
        # The node runs in this process: its report is this process's resident set.
        reported = state["nodes"][0]["resident_bytes"]
        self.assertGreater(reported, 10 * 2**20)
        here = resident_bytes()
        assert here is not None
        self.assertLess(abs(reported - here), 200 * 2**20)

    @defer.inlineCallbacks
    def test_a_refused_node_shows_why(self) -> Generator[Any, Any, None]:
        """A node that refused its model (D25) shows as ``refused`` with its reason, serves
        no model, and its join is journaled as ``refused`` with the reason."""
        from sfnode.node.refused import RefusedEngine

        why = "GGUF architecture 'x' is not supported"
        node = yield self.start_vocab_node(identity="gamma", engine=RefusedEngine(why))
        head = yield self.console_head([node])
        state = yield self.state(head)
        (gamma,) = state["nodes"]
        self.assertEqual((gamma["state"], gamma["refused"], gamma["models"]), ("refused", why, []))
        self.assertEqual([(e["kind"], e["detail"]) for e in state["events"]], [("refused", why)])
        self.assertEqual(state["models"][0]["nodes"], [])

    @defer.inlineCallbacks
    def test_the_page_is_served_whole(self) -> Generator[Any, Any, None]:
        """``/console`` is one HTML page that loads nothing from elsewhere (no src or href to
        another host) and reads the feed."""
        node = yield self.start_vocab_node()
        head = yield self.console_head([node])
        code, body, headers = yield self.get(head, "/console")
        self.assertEqual(code, 200)
        self.assertTrue(headers.getRawHeaders(b"content-type")[0].startswith(b"text/html"))
        self.assertIn(b"/feed", body)
        self.assertNotIn(b"http://", body.replace(b"http://www.w3.org/2000/svg", b""))
        self.assertNotIn(b"https://", body)
        self.assertNotIn(b"<script src", body)
        code, _, _ = yield self.get(head, "/console/nowhere")
        self.assertEqual(code, 404)
        code, _, _ = yield self.get(head, "/console/state", method=b"DELETE")
        self.assertEqual(code, 405)

    @defer.inlineCallbacks
    def test_keys_rule_the_console(self) -> Generator[Any, Any, None]:
        """With keys, every console route answers 401 without one (asking a browser for it
        with HTTP Basic); a key as a bearer token or as the Basic password opens it; a wrong
        one does not."""
        node = yield self.start_vocab_node()
        head = yield self.console_head([node], keys=True)
        for path in ("/console", "/console/state", "/console/feed"):
            code, _, headers = yield self.get(head, path)
            self.assertEqual(code, 401, path)
            self.assertIn(b"Basic", headers.getRawHeaders(b"www-authenticate")[0])
        basic = b"Basic " + base64.b64encode(b"anyone:" + USER)
        code, _, _ = yield self.get(head, "/console", {b"authorization": [basic]})
        self.assertEqual(code, 200)
        wrong = b"Basic " + base64.b64encode(b"anyone:sk-nope")
        code, _, _ = yield self.get(head, "/console/state", {b"authorization": [wrong]})
        self.assertEqual(code, 401)
        state = yield self.state(head, USER)
        self.assertEqual(state["nodes"][0]["state"], "serving")

    @defer.inlineCallbacks
    def test_drain_needs_an_admin_key_and_places_nothing_new(self) -> Generator[Any, Any, None]:
        """``POST /console/drain?node=NAME`` is 403 with a plain key or as a browser's
        Basic password, 404 for an unknown node, 400 without one, and with the admin key
        drains the node: it shows ``draining``, the journal says so, and a new request goes
        to the other node."""
        a = yield self.start_vocab_node(identity="alpha")
        b = yield self.start_vocab_node(identity="beta")
        head = yield self.console_head([a, b], keys=True, policy=Policy.LEAST_LOADED)
        path = "/console/drain?node=alpha"
        code, _, _ = yield self.get(head, path, {b"authorization": [b"Bearer " + USER]}, b"POST")
        self.assertEqual(code, 403)
        basic = b"Basic " + base64.b64encode(b"ops:" + ADMIN)
        code, _, _ = yield self.get(head, path, {b"authorization": [basic]}, b"POST")
        self.assertEqual(code, 403)
        admin = {b"authorization": [b"Bearer " + ADMIN]}
        code, _, _ = yield self.get(head, "/console/drain?node=gamma", admin, b"POST")
        self.assertEqual(code, 404)
        code, _, _ = yield self.get(head, "/console/drain", admin, b"POST")
        self.assertEqual(code, 400)
        code, body, _ = yield self.get(head, path, admin, b"POST")
        self.assertEqual((code, json.loads(body)), (200, {"node": "alpha", "state": "draining"}))
        state = yield self.state(head, USER)
        nodes = {n["name"]: n["state"] for n in state["nodes"]}
        self.assertEqual(nodes, {"alpha": "draining", "beta": "serving"})
        self.assertEqual(state["events"][-1]["kind"], "draining")
        outcome = yield head.fleet.generate(_request()).result
        self.assertEqual(outcome.node, "beta")

    @defer.inlineCallbacks
    def test_feed_streams_updates_while_connected(self) -> Generator[Any, Any, None]:
        """``/console/feed`` sends the state at once and then twice a second as server-sent
        events; a node that joins shows in a later update; when the viewer leaves the feed
        stops building updates."""
        a = yield self.start_vocab_node(identity="alpha")
        head = yield self.console_head([a])
        feed = head.api._console_tree.feed  # type: ignore[union-attr]
        self.assertEqual(feed.updates, 0)
        response = yield Agent(reactor).request(b"GET", (head.base + "/console/feed").encode())
        self.assertEqual(response.headers.getRawHeaders(b"content-type"), [b"text/event-stream"])
        body = _Body()
        response.deliverBody(body)
        events = yield body.first(1)
        self.assertEqual([n["name"] for n in events[0]["nodes"]], ["alpha"])
        b = yield self.start_vocab_node(identity="beta")
        yield head.fleet.add_node(b.endpoint)
        count = len(body.events())
        events = yield body.first(count + 1)
        self.assertEqual(sorted(n["name"] for n in events[-1]["nodes"]), ["alpha", "beta"])
        body.transport.stopProducing()  # type: ignore[attr-defined]
        yield body.done
        yield _until(lambda: not feed.viewers)
        self.assertIsNone(feed._timer)

    @defer.inlineCallbacks
    def test_failover_shows_from_to_and_tokens_kept(self) -> Generator[Any, Any, None]:
        """A node that dies mid-generation: the journal shows a failover from it to the other
        node with the tokens delivered before, and the dead node's link as lost; the dead
        node (still redialled) shows as gone."""
        first = yield self.start_vocab_node(identity="first", token_delay_s=0.005)
        second = yield self.start_vocab_node(identity="second")
        head = yield self.console_head([first, second], policy=Policy.LEAST_LOADED)
        seen: list[int] = []

        def tokens(batch: Any) -> None:
            seen.extend(batch.tokens)
            if len(seen) >= 5 and len(seen) - len(batch.tokens) < 5:
                reactor.callLater(0, _kill, first)

        outcome = yield head.fleet.generate(_request(30), on_tokens=tokens).result
        self.assertEqual((outcome.node, outcome.failovers), ("second", 1))
        state = yield self.state(head)
        failovers = [e for e in state["events"] if e["kind"] == "failover"]
        self.assertEqual(len(failovers), 1)
        self.assertEqual((failovers[0]["node"], failovers[0]["to_node"]), ("first", "second"))
        self.assertGreaterEqual(failovers[0]["tokens"], 5)
        self.assertEqual(failovers[0]["model"], "")
        self.assertIn("lost", [e["kind"] for e in state["events"]])
        self.assertEqual(state["head"]["failovers"], 1)
        nodes = {n["name"]: n["state"] for n in state["nodes"]}
        self.assertEqual(nodes, {"first": "gone", "second": "serving"})

    @defer.inlineCallbacks
    def test_clients_show_running_and_first_tokens(self) -> Generator[Any, Any, None]:
        """A completion through the API counts its first token and tokens for its model, and
        while it streams its client holds a lane in ``clients``."""
        node = yield self.start_vocab_node(token_delay_s=0.02)
        head = yield self.console_head([node])
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "stream": True}
        done = self.call(head, b"POST", "/v1/chat/completions", body)
        state = yield _until_state(self, head, lambda s: s["clients"])
        self.assertEqual(state["clients"][0]["client"], "127.0.0.1")
        self.assertEqual(state["clients"][0]["running"], 1)
        self.assertGreater(state["clients"][0]["share"], 0)
        yield done
        self.assertEqual(head.api.record.delivered, {MODEL: 40})
        self.assertEqual([m for _, m, _ in head.api.record.first_tokens], [MODEL])


def _kill(node: RunningNode) -> None:
    """The node dies: no more connections, the open ones closed, its engine stopped."""
    node.port.stopListening()
    node.agent.stop()


def _request(max_new: int = 8) -> Any:
    from sfnode.head.fleet.backend import HeadRequest

    return HeadRequest(tuple(range(100, 112)), max_new)


def _later(seconds: float) -> defer.Deferred[None]:
    from twisted.internet.task import deferLater

    return deferLater(reactor, seconds, lambda: None)


@defer.inlineCallbacks
def _until(check: Any, tries: int = 200) -> Generator[Any, Any, None]:
    """Waits (10 ms at a time, 2 s at most) until ``check()`` holds."""
    for _ in range(tries):
        if check():
            return
        yield _later(0.01)
    raise AssertionError("the condition never held")


@defer.inlineCallbacks
def _until_state(
    test: ConsoleHttpCase, head: Head, check: Any, tries: int = 100
) -> Generator[Any, Any, Any]:
    for _ in range(tries):
        state = yield test.state(head)
        if check(state):
            return state
        yield _later(0.02)
    raise AssertionError("the console never showed it")


class RecordedInMemoryTests(MemoryHeadTestCase):
    """What the journal and the record learn from a head's own paths, on the memory reactor:
    a preemption, a resumed stream, a 429."""

    def test_a_preemption_is_journaled_with_the_tokens_kept(self) -> None:
        """Eight batch streams hold every lane of a node that keeps none for interactive
        work; a chat takes one back: the journal has a ``preempted`` event on that node with
        the tokens the preempted generation had delivered."""
        from sfnode.engines.config import EngineConfig
        from sfnode.engines.mock import MockEngine
        from tests.test_head_preempt import _chat
        from tests.tinymodel import TINY_VOCAB

        engine = MockEngine(
            self.reactor, EngineConfig(max_lanes=8, interactive_lanes=0), token_delay_s=0.02,
            vocab_size=TINY_VOCAB,
        )  # fmt: skip
        self.start_vocab_node("a", max_lanes=8, engine=engine)
        head = self.start_head()
        for _ in range(8):
            self.http(head, "10.0.0.1").send(_chat(300, "batch"))
        self.until(lambda: sum(n.inflight for n in head.fleet.nodes) == 8)
        self.advance(0.5)
        self.http(head, "10.0.0.2").send(_chat(4, "interactive"))
        journal = head.fleet.registry.events
        self.until(lambda: any(e.kind == "preempted" for e in journal.latest(50)), within=10.0)
        preempted = next(e for e in journal.latest(50) if e.kind == "preempted")
        self.assertEqual((preempted.node, preempted.model), ("a", MODEL))
        self.assertGreater(preempted.tokens, 0)
        self.until(lambda: not head.api.exchanges, within=60.0)

    def test_a_resumed_stream_is_journaled(self) -> None:
        """A client that drops mid-stream and comes back with ``Last-Event-ID``: the record
        journals a ``resumed`` event naming the model and the event it resumed after."""
        from tests.test_head_resume import _body, _CuttingClient, _dechunk, _events, _post

        self.start_vocab_node("a", max_lanes=4, token_delay_s=0.01)
        head = self.start_head()
        cutting = _CuttingClient(600)
        self.http(head, "10.0.0.7", cutting)
        assert cutting.transport is not None
        cutting.transport.write(_post(_body()))
        self.until(lambda: cutting.closed, within=10.0)
        last = _events(_dechunk(cutting.data.partition(b"\r\n\r\n")[2]))[-1][0]
        status, _, _ = self.exchange(head, _post(_body(), last=last), "10.0.0.7")
        self.assertEqual(status, 200)
        resumed = [e for e in head.api.record.events.latest(10) if e.kind == "resumed"]
        self.assertEqual(len(resumed), 1)
        self.assertEqual(resumed[0].model, MODEL)
        self.assertEqual(resumed[0].detail, f"after event {last.rpartition('.')[2]}")

    def test_429s_are_counted_for_their_key(self) -> None:
        """A key capped at one generation at a time: its second request while the first
        streams is a 429, counted for that key (by its hash) in the record."""
        from tests.test_head_resume import _body, _post

        self.start_vocab_node("a", max_lanes=4, token_delay_s=0.01)
        key = "sk-capped"
        head = self.start_head(
            api_keys=[key.encode()],
            limits=GateLimits(keys={key.encode(): KeyPolicy(concurrency=1)}),
        )
        first = self.http(head, "10.0.0.1")
        first.send(_post(_body(200), key=key))
        self.until(lambda: len(head.api.exchanges) == 1)
        status, _, _ = self.exchange(head, _post(_body(), key=key), "10.0.0.2")
        self.assertEqual(status, 429)
        self.assertEqual(head.api.record.rate_limited, {client_label(("key", key.encode())): 1})
        self.until(lambda: not head.api.exchanges, within=30.0)


__all__ = ["ADMIN", "USER", "ConsoleHttpCase", "console_head_api"]
