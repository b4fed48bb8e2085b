"""``sfnode top`` (sfnode.cli.top) through Textual's own test harness (``App.run_test`` and its
pilot), against a real head with mock nodes over loopback TCP.

The head runs on the test's reactor; the Textual app runs its asyncio loop on a thread of its
own (``deferToThread``), as a terminal would run it beside a head elsewhere, and reads the
head's ``/console/state`` over HTTP.  The pure helpers (row cells, sort order, event lines)
are pinned without a terminal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any

from twisted.internet import defer, threads
from twisted.trial.unittest import SynchronousTestCase

from sfnode.cli.top import HeadClient, TopApp, TopError, event_line, node_cells, sort_key
from tests.test_console import ADMIN, USER, ConsoleHttpCase

WAIT_S = 5.0


def _node(name: str, state: str, used: int, total: int, beat: float | None) -> dict[str, Any]:
    return {
        "name": name, "state": state, "models": ["m"], "lanes_used": used,
        "lanes_total": total, "kv_used": 1, "kv_total": 10, "tokens_per_s": 5,
        "heartbeat_s": beat, "address": "tcp:h:1", "resident_bytes": 412 * 2**20,
        "engine_path": "native step, q4_1 weights", "cpu": "AMD EPYC (avx2)",
    }  # fmt: skip


class HelperTests(SynchronousTestCase):
    def test_rows_and_orders(self) -> None:
        """A node's row shows lanes and KV as used/total; sorting by state puts serving
        first, by lanes the least used first, and a missing heartbeat after any."""
        a = _node("a", "draining", 3, 4, 2.0)
        b = _node("b", "serving", 1, 4, None)
        self.assertEqual(
            node_cells(a),
            ("a", "draining", "m", "3/4", "1/10", "5", "2.0 s", "412 MiB",
             "native step, q4_1 weights on AMD EPYC (avx2)", "tcp:h:1"),
        )  # fmt: skip
        said_nothing = {**a, "resident_bytes": None, "engine_path": None, "cpu": None}
        self.assertEqual(node_cells(said_nothing)[7:9], ("-", "-"))
        self.assertEqual([n["name"] for n in sorted([a, b], key=sort_key("state"))], ["b", "a"])
        self.assertEqual([n["name"] for n in sorted([a, b], key=sort_key("lanes"))], ["b", "a"])
        self.assertEqual(
            [n["name"] for n in sorted([b, a], key=sort_key("heartbeat_s"))], ["a", "b"]
        )

    def test_event_lines(self) -> None:
        """A failover reads from -> to with the tokens kept; others their node and detail."""
        failover = {"seq": 3, "kind": "failover", "node": "x", "to_node": "y", "tokens": 9,
                    "model": "m", "detail": ""}  # fmt: skip
        self.assertEqual(event_line(failover), "#3 failover: x -> y, 9 tokens kept")
        left = {"seq": 4, "kind": "left", "node": "x", "to_node": "", "tokens": 0, "model": "",
                "detail": "gone"}  # fmt: skip
        self.assertEqual(event_line(left), "#4 left: x gone")

    def test_an_unreachable_head_is_an_error_with_its_address(self) -> None:
        """Nothing listening: a TopError naming the address, not a traceback."""
        with self.assertRaises(TopError) as caught:
            HeadClient("http://127.0.0.1:9").state()
        self.assertIn("127.0.0.1:9", str(caught.exception))


async def _until(pilot: Any, check: Callable[[], bool]) -> None:
    """Lets the app run until ``check()`` holds (at most WAIT_S)."""
    for _ in range(int(WAIT_S / 0.05)):
        if check():
            return
        await pilot.pause(0.05)
    raise AssertionError("the app never got there")


def _rows(app: TopApp) -> list[str]:
    from textual.widgets import DataTable

    table = app.query_one("#nodes", DataTable)
    return [str(table.get_row_at(i)[0]) for i in range(table.row_count)]


def _state_of(app: TopApp, name: str) -> str:
    assert app.state is not None
    return str({n["name"]: n["state"] for n in app.state["nodes"]}[name])


class TopTests(ConsoleHttpCase):
    @defer.inlineCallbacks
    def test_top_shows_sorts_and_drains_with_the_admin_key(self) -> Generator[Any, Any, None]:
        """``sfnode top`` with the admin key lists the head's nodes sorted by name; ``r``
        reverses them (the cursor stays on its node); ``d`` drains the node under the cursor,
        which the head and the app then show as draining."""
        alpha = yield self.start_vocab_node(identity="alpha")
        beta = yield self.start_vocab_node(identity="beta")
        head = yield self.console_head([alpha, beta], keys=True)

        async def scenario() -> dict[str, Any]:
            app = TopApp(HeadClient(head.base, ADMIN.decode()), interval_s=0.2)
            seen: dict[str, Any] = {}
            async with app.run_test(size=(150, 40)) as pilot:
                await _until(pilot, lambda: len(_rows(app)) == 2)
                seen["sorted"] = _rows(app)
                await pilot.press("r")
                seen["reversed"] = _rows(app)
                seen["cursor"] = app.selected_node()
                await pilot.press("up", "d")
                await _until(pilot, lambda: _state_of(app, "beta") == "draining")
                seen["after"] = {n["name"]: n["state"] for n in app.state["nodes"]}  # type: ignore[index]
                seen["summary"] = str(app.query_one("#summary").render())
            return seen

        seen = yield threads.deferToThread(asyncio.run, scenario())
        self.assertEqual(seen["sorted"], ["alpha", "beta"])
        self.assertEqual(seen["reversed"], ["beta", "alpha"])
        self.assertEqual(seen["cursor"], "alpha")
        self.assertEqual(seen["after"], {"alpha": "serving", "beta": "draining"})
        self.assertIn("nodes 1 live / 2", seen["summary"])
        self.assertTrue(head.fleet.node_named("beta").draining)  # type: ignore[union-attr]

    @defer.inlineCallbacks
    def test_a_refresh_that_returns_after_the_console_closed_shows_nothing(
        self,
    ) -> Generator[Any, Any, None]:
        """The refresh timer's request may come back after the console has begun to close and
        its widgets are gone: showing that state is skipped, not an error that ends the app
        with a traceback."""
        alpha = yield self.start_vocab_node(identity="alpha")
        head = yield self.console_head([alpha])

        async def scenario() -> dict[str, Any] | None:
            app = TopApp(HeadClient(head.base), interval_s=60.0)
            async with app.run_test(size=(150, 40)) as pilot:
                await _until(pilot, lambda: _rows(app) == ["alpha"])
            await app.action_refresh()
            return app.state

        state = yield threads.deferToThread(asyncio.run, scenario())
        self.assertIsNotNone(state)
        self.assertEqual([n["name"] for n in state["nodes"]], ["alpha"])

    @defer.inlineCallbacks
    def test_drain_without_the_admin_key_changes_nothing(self) -> Generator[Any, Any, None]:
        """With a plain key ``d`` shows the head's refusal (403, an admin key is needed) and
        the node keeps serving; a node whose name looks like markup is shown as it is."""
        alpha = yield self.start_vocab_node(identity="alpha[/b]")
        head = yield self.console_head([alpha], keys=True)

        async def scenario() -> list[str]:
            app = TopApp(HeadClient(head.base, USER.decode()), interval_s=0.2)
            async with app.run_test(size=(150, 40)) as pilot:
                await _until(pilot, lambda: _rows(app) == ["alpha[/b]"])
                await pilot.press("d")
                await _until(pilot, lambda: bool(app._notifications))
                return [n.message for n in app._notifications]

        notes = yield threads.deferToThread(asyncio.run, scenario())
        self.assertEqual(len(notes), 1)
        self.assertIn("cannot drain alpha[/b]: 403", notes[0])
        self.assertIn("admin key", notes[0])
        self.assertFalse(head.fleet.node_named("alpha[/b]").draining)  # type: ignore[union-attr]
