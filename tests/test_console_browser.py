"""The console as a person uses it: ``/console`` open in headless Chromium (Debian's
``chromium`` package, driven by Playwright through its ``executable_path``; never a browser
Playwright downloads) while the fleet behind the head changes.

A head with mock nodes on real loopback TCP, its API behind keys (the browser gives the key as
the password HTTP Basic asks for); the page is opened once and never reloaded.  A node joins, a
generation fails over, a node is drained through the admin route: each must show on the page
within 2 s.  A screenshot of the page is saved in the test's temporary folder.

The head runs on the test's reactor; the browser runs on a thread of its own (Playwright's
asyncio API), asking the reactor for each change with ``blockingCallFromThread``.  Without
Chromium or Playwright the test is skipped, unless ``CI`` is set (``.ci/run`` installs
Chromium): then it fails.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import urllib.parse
import urllib.request
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor, threads
from twisted.trial.unittest import SkipTest

from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.fleet.placement import Policy
from tests.nodefixture import RunningNode
from tests.test_console import ADMIN, USER, ConsoleHttpCase

SHOWS_WITHIN_MS = 2000


def chromium() -> str:
    """Debian's chromium, or skip (fail under CI: .ci/run installs it)."""
    path = shutil.which("chromium")
    missing = None
    if path is None:
        missing = "Debian's chromium is not installed (apt-get install -y chromium)"
    else:
        try:
            import playwright.async_api  # noqa: F401
        except ImportError:
            missing = "playwright is not installed (pip install playwright; the test extras)"
    if missing is not None:
        if os.environ.get("CI"):
            raise AssertionError(f"CI is set but {missing}")
        raise SkipTest(missing)
    assert path is not None
    return path


class BrowserTests(ConsoleHttpCase):
    @defer.inlineCallbacks
    def test_join_failover_and_drain_show_without_reload(self) -> Generator[Any, Any, None]:
        """The page opened once shows a node that joins, a failover (from which node to which,
        with the tokens kept) and a drained node, each within 2 s; then a screenshot."""
        executable = chromium()
        alpha = yield self.start_vocab_node(identity="alpha", token_delay_s=0.01)
        beta = yield self.start_vocab_node(identity="beta")
        head = yield self.console_head([alpha], keys=True, policy=Policy.LEAST_LOADED)
        shot = Path(self.mktemp()) / "console.png"
        shot.parent.mkdir(parents=True)

        def on_reactor(action: Callable[[], Any]) -> Any:
            return threads.blockingCallFromThread(reactor, action)

        async def scenario() -> dict[str, Any]:
            from playwright.async_api import async_playwright

            async with async_playwright() as p:
                args = ["--no-sandbox"] if os.geteuid() == 0 else []
                browser = await p.chromium.launch(executable_path=executable, args=args)
                try:
                    context = await browser.new_context(
                        http_credentials={"username": "ops", "password": USER.decode()},
                        viewport={"width": 1280, "height": 900},
                    )
                    page = await context.new_page()
                    return await _watch(page, head, on_reactor, (alpha, beta), shot)
                finally:
                    await browser.close()

        seen = yield threads.deferToThread(asyncio.run, scenario())
        feed = head.api._console_tree.feed  # type: ignore[union-attr]
        yield _until(lambda: not feed.viewers)
        self.assertEqual(seen["first"], "serving")
        self.assertEqual(seen["joined"], "serving")
        self.assertIn("alpha \u2192 beta", seen["failover"])
        self.assertIn("tokens kept", seen["failover"])
        self.assertEqual(seen["drained"], "draining")
        self.assertTrue(shot.exists() and shot.stat().st_size > 10_000)


async def _watch(
    page: Any,
    head: Any,
    on_reactor: Callable[[Callable[[], Any]], Any],
    nodes: tuple[RunningNode, RunningNode],
    shot: Path,
) -> dict[str, Any]:
    """Open the page, then change the fleet three times and wait for each to show."""
    alpha, beta = nodes
    seen: dict[str, Any] = {}
    await page.goto(head.base + "/console")
    row = await page.wait_for_selector('tr[data-node="alpha"]', timeout=5000)
    seen["first"] = await row.get_attribute("data-state")

    on_reactor(lambda: head.fleet.add_node(beta.endpoint))
    row = await page.wait_for_selector('tr[data-node="beta"]', timeout=SHOWS_WITHIN_MS)
    seen["joined"] = await row.get_attribute("data-state")

    on_reactor(lambda: _fail_over(head, alpha))
    event = await page.wait_for_selector('li[data-kind="failover"]', timeout=SHOWS_WITHIN_MS)
    seen["failover"] = await event.inner_text()

    await asyncio.to_thread(_drain, head.base, "beta")
    row = await page.wait_for_selector(
        'tr[data-node="beta"][data-state="draining"]', timeout=SHOWS_WITHIN_MS
    )
    seen["drained"] = await row.get_attribute("data-state")
    await page.screenshot(path=str(shot), full_page=True)
    return seen


def _fail_over(head: Any, alpha: RunningNode) -> defer.Deferred[Any]:
    """A generation on alpha whose node dies after 5 tokens: it ends on beta."""
    seen: list[int] = []

    def tokens(batch: Any) -> None:
        seen.extend(batch.tokens)
        if len(seen) >= 5 and len(seen) - len(batch.tokens) < 5:
            reactor.callLater(0, _kill, alpha)

    return head.fleet.generate(HeadRequest(tuple(range(100, 112)), 30), on_tokens=tokens).result


def _kill(node: RunningNode) -> None:
    node.port.stopListening()
    node.agent.stop()


def _drain(base: str, node: str) -> None:
    """What an operator's script does: the admin route with the admin key."""
    query = urllib.parse.urlencode({"node": node})
    request = urllib.request.Request(f"{base}/console/drain?{query}", method="POST")
    request.add_header("Authorization", "Bearer " + ADMIN.decode())
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200


@defer.inlineCallbacks
def _until(check: Callable[[], bool], tries: int = 200) -> Generator[Any, Any, None]:
    from twisted.internet.task import deferLater

    for _ in range(tries):
        if check():
            return
        yield deferLater(reactor, 0.01, lambda: None)
    raise AssertionError("the condition never held")
