"""``sfnode top``: the head's console in the terminal (docs/api.md "The console").

A Textual app that reads the head's ``/console/state`` every ``--interval`` seconds and shows the
nodes (sortable), the models, the clients and the latest events.  Keys: ``s`` sorts the nodes
by the next column, ``r`` reverses the order, ``d`` drains the node under the cursor (the
head answers 403 unless the key is an admin key, ``admin=yes`` in its key file), ``g``
refreshes now, ``q`` quits.

The key comes from ``--key-file`` or the ``SFHEAD_API_KEY`` environment variable (never from
the command line, where other users of the machine can read it).  HTTP runs on a worker thread
(``asyncio.to_thread``), so the terminal never waits on the network.

This is an operator's program, not library code: it must never be imported by sfnode itself,
never write escape codes itself (Textual draws), and never show the key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import DataTable, Footer, Header, Static

PROG = "sfnode top"
KEY_ENV = "SFHEAD_API_KEY"
TIMEOUT_S = 5.0

SORTS = ("name", "state", "lanes", "kv", "tokens_per_s", "heartbeat_s")
"""The node columns ``s`` sorts by, in turn."""
_STATE_ORDER = {"serving": 0, "joining": 1, "draining": 2, "refused": 3, "gone": 4}
NODE_COLUMNS = (
    "node", "state", "models", "lanes", "KV", "tok/s", "heartbeat", "memory", "runs on", "address",
)  # fmt: skip
EVENTS_SHOWN = 12


class TopError(Exception):
    """What the head answered instead of what was asked (its message is shown)."""


class HeadClient:
    """The head's console routes over HTTP (blocking: run on a worker thread)."""

    def __init__(self, url: str, key: str = "") -> None:
        self.url = url.rstrip("/")
        self._key = key

    def _call(self, path: str, method: str = "GET") -> Any:
        request = urllib.request.Request(self.url + path, method=method)
        if self._key:
            request.add_header("Authorization", "Bearer " + self._key)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                return json.load(response)
        except urllib.error.HTTPError as e:
            raise TopError(f"{e.code}: {_message(e.read())}") from e
        except (OSError, ValueError) as e:
            raise TopError(f"cannot read {self.url}: {e}") from e

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = self._call("/console/state")
        return state

    def drain(self, node: str) -> str:
        query = urllib.parse.urlencode({"node": node})
        answer = self._call(f"/console/drain?{query}", method="POST")
        return f"{answer.get('node', node)} is {answer.get('state', 'draining')}"


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode("utf-8", "replace")


def sort_key(column: str) -> Any:
    """How ``column`` orders node rows (of ``/console/state``)."""

    def key(node: dict[str, Any]) -> Any:
        if column == "state":
            return _STATE_ORDER.get(node["state"], 9)
        if column == "lanes":
            return node.get("lanes_used", 0) / (node.get("lanes_total") or 1)
        if column == "kv":
            return node.get("kv_used", 0) / (node.get("kv_total") or 1)
        value = node.get(column)
        return (value is None, value if value is not None else 0)

    return key


def node_cells(node: dict[str, Any]) -> tuple[str, ...]:
    """One node's row."""

    def ratio(used: str, total: str) -> str:
        return f"{node[used]}/{node[total]}" if node.get(total) else "-"

    beat = node.get("heartbeat_s")
    return (
        node["name"],
        node["state"],
        ", ".join(node["models"]),
        ratio("lanes_used", "lanes_total"),
        ratio("kv_used", "kv_total"),
        str(node.get("tokens_per_s", "-")),
        "-" if beat is None else f"{beat:.1f} s",
        _mebibytes(node.get("resident_bytes")),
        " on ".join(filter(None, (node.get("engine_path"), node.get("cpu")))) or "-",
        node["address"],
    )


def _mebibytes(count: int | None) -> str:
    """``412 MiB``, or ``-`` when the node said nothing."""
    return "-" if not count else f"{count / 2**20:.0f} MiB"


def summary(state: dict[str, Any]) -> str:
    head = state["head"]
    text = (
        f"nodes {head['live_nodes']} live / {state['nodes_total']}   "
        f"lanes {head['lanes_active']}/{head['lanes_total']}   queued {head['queued']}   "
        f"requests {head['requests']}   failovers {head['failovers']}   "
        f"reclaimed {head['reclaimed']}"
    )
    return ("DRAINING   " if head["draining"] else "") + text


def event_line(event: dict[str, Any]) -> str:
    if event["kind"] == "failover":
        what = f"{event['node']} -> {event['to_node'] or 'no node'}, {event['tokens']} tokens kept"
    else:
        what = " ".join(str(event[k]) for k in ("node", "model", "detail") if event[k])
    return f"#{event['seq']} {event['kind']}: {what}"


class TopApp(App[None]):
    """The terminal console."""

    TITLE = "sfhead top"
    CSS = "DataTable { height: auto; max-height: 50%; } #summary { padding: 0 1; }"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("s", "sort", "Sort"),
        Binding("r", "reverse", "Reverse"),
        Binding("d", "drain", "Drain node"),
        Binding("g", "refresh", "Refresh"),
    ]

    def __init__(self, client: HeadClient, interval_s: float = 1.0) -> None:
        super().__init__()
        self.client = client
        self.interval_s = interval_s
        self.state: dict[str, Any] | None = None
        self.sort_column = SORTS[0]
        self.reverse = False
        self.error = ""

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("connecting", id="summary")
        yield DataTable(id="nodes", cursor_type="row")
        yield DataTable(id="models", cursor_type="none")
        yield DataTable(id="clients", cursor_type="none")
        yield Static("", id="events")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#nodes", DataTable).add_columns(*NODE_COLUMNS)
        models = self.query_one("#models", DataTable)
        models.add_columns("model", "nodes", "running", "queued", "tok/s", "ttft p50", "ttft p95")
        self.query_one("#clients", DataTable).add_columns(
            "client", "running", "queued", "share", "429s"
        )
        self.set_interval(self.interval_s, self.action_refresh)
        self.call_later(self.action_refresh)

    async def action_refresh(self) -> None:
        try:
            state = await asyncio.to_thread(self.client.state)
        except TopError as e:
            self.error = str(e)
            self.query_one("#summary", Static).update(Text(str(e), style="bold"))
            return
        self.error = ""
        self.state = state
        self.show()

    def show(self) -> None:
        state = self.state
        if state is None or not self.is_running:
            # A refresh whose request returned after the console began to close: its widgets
            # are gone, and there is nothing left to show the state on.
            return
        self.query_one("#summary", Static).update(Text(summary(state)))
        self._show_nodes(state["nodes"])
        models = self.query_one("#models", DataTable)
        models.clear()
        for m in state["models"]:
            models.add_row(*_plain(
                m["name"], str(len(m["nodes"])), str(m["running"]), str(m["queued"]),
                str(m["tokens_per_s"]), _ms(m["first_token_p50_ms"]),
                _ms(m["first_token_p95_ms"]),
            ))  # fmt: skip
        clients = self.query_one("#clients", DataTable)
        clients.clear()
        for c in state["clients"]:
            clients.add_row(*_plain(
                c["client"], str(c["running"]), str(c["queued"]),
                f"{100 * c['share']:.0f} %", str(c["rate_limited"]),
            ))  # fmt: skip
        lines = [event_line(e) for e in state["events"][-EVENTS_SHOWN:]]
        self.query_one("#events", Static).update(Text("\n".join(reversed(lines))))

    def _show_nodes(self, nodes: list[dict[str, Any]]) -> None:
        table = self.query_one("#nodes", DataTable)
        selected = self.selected_node()
        table.clear()
        for node in sorted(nodes, key=sort_key(self.sort_column), reverse=self.reverse):
            table.add_row(*_plain(*node_cells(node)), key=node["name"])
        if selected is not None and selected in {n["name"] for n in nodes}:
            table.move_cursor(row=table.get_row_index(selected))

    def selected_node(self) -> str | None:
        table = self.query_one("#nodes", DataTable)
        if not table.row_count:
            return None
        row = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        return None if row.value is None else str(row.value)

    def action_sort(self) -> None:
        self.sort_column = SORTS[(SORTS.index(self.sort_column) + 1) % len(SORTS)]
        self.notify(f"nodes sorted by {self.sort_column}")
        self.show()

    def action_reverse(self) -> None:
        self.reverse = not self.reverse
        self.show()

    async def action_drain(self) -> None:
        node = self.selected_node()
        if node is None:
            return
        try:
            said = await asyncio.to_thread(self.client.drain, node)
        except TopError as e:
            self.notify(f"cannot drain {node}: {e}", severity="error", markup=False)
            return
        self.notify(said, markup=False)
        await self.action_refresh()


def _plain(*cells: str) -> list[Text]:
    """Cells shown as they are: what a node or a head names is never read as markup."""
    return [Text(cell) for cell in cells]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", default="http://127.0.0.1:8453", help="the head's HTTP address (%(default)s)"
    )
    parser.add_argument(
        "--key-file",
        type=Path,
        help=f"a file whose first line is the API key (default: ${KEY_ENV}, else none)",
    )
    parser.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes (%(default)s)"
    )
    return parser


def read_key(key_file: Path | None) -> str:
    if key_file is not None:
        lines = key_file.read_text().split()
        return lines[0] if lines else ""
    return os.environ.get(KEY_ENV, "")


def main(argv: Sequence[str] | None = None) -> int:
    options = _parser().parse_args(argv)
    if options.interval <= 0:
        _parser().error("--interval must be above 0")
    app = TopApp(HeadClient(options.url, read_key(options.key_file)), options.interval)
    app.run()
    return 0


__all__ = ["HeadClient", "TopApp", "TopError", "main"]
