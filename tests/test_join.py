"""``twistd sfnode --join``: a node that joins a head by address or finds it by DNS-SD.

The options (one direction, ``--head-name`` only with ``auto``, no plaintext off loopback),
then the node's real service tree (``sfnode.node.tap.makeService``, mock engine) against the head's
real fleet listener (``sfnode.head.fleet.fleet.Fleet``) over loopback TCP: joining by address,
keeping on after a wrong token until the head holds the right one, and ``--join auto`` through a
recording browser (no multicast here; tests/test_multihost.py browses for real): it dials the
head the browse found, browses again when that head stays away, and reports several heads as an
error that names them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from twisted.application.service import MultiService
from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.interfaces import IListeningPort
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase, TestCase

from sfnode.discovery.rules import SERVICE_TYPE, HeadAnnouncement, HeadAnswer
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.fleet.fleet import Fleet, FleetNode, FleetSettings
from sfnode.head.link import HeadIds
from sfnode.node import tap
from tests.nodefixture import expected_tokens

PROMPT = [5, 6, 7, 8]


def parse(*argv: str) -> tap.Options:
    options = tap.Options()
    options.parseOptions(list(argv))
    return options


class JoinOptionsTests(SynchronousTestCase):
    """``--join`` and ``--head-name`` are checked before anything starts."""

    def token(self, text: bytes = b"t" * 64) -> str:
        path = Path(self.mktemp())
        path.write_bytes(text + b"\n")
        return str(path)

    def test_forms(self) -> None:
        """--join HOST[:PORT] gives the head's address (port 8455 by default); --join auto
        asks for DNS-SD."""
        options = parse("--join", "127.0.0.1:9000", "--engine", "mock")
        self.assertEqual((str(options["join-target"]), options["join-auto"]), ("127.0.0.1:9000",
                         False))  # fmt: skip
        self.assertEqual(str(parse("--join", "localhost", "--engine", "mock")["join-target"]),
                         "localhost:8455")  # fmt: skip
        options = parse("--join", "auto", "--auth-file", self.token(), "--engine", "mock")
        self.assertEqual((options["join-target"], options["join-auto"]), (None, True))

    def test_exactly_one_direction(self) -> None:
        """--join with --head or --listen is refused, naming every direction."""
        for other in (["--head", "tcp:127.0.0.1:1"], ["--listen", "tcp:0:interface=127.0.0.1"]):
            with self.assertRaises(usage.UsageError) as caught:
                parse("--join", "127.0.0.1", *other)
            self.assertIn("exactly one of --join", str(caught.exception))

    def test_bad_join_is_a_usage_error(self) -> None:
        """A --join value that is no HOST[:PORT] is refused with the forms expected."""
        with self.assertRaises(usage.UsageError) as caught:
            parse("--join", "head:0")
        self.assertIn("--join", str(caught.exception))
        self.assertIn("HOST:PORT", str(caught.exception))

    def test_head_name_needs_auto_and_a_valid_name(self) -> None:
        """--head-name means nothing without --join auto, and must be a DNS-SD instance
        label."""
        with self.assertRaises(usage.UsageError) as caught:
            parse("--join", "127.0.0.1", "--head-name", "a")
        self.assertIn("--head-name needs --join auto", str(caught.exception))
        with self.assertRaises(usage.UsageError) as caught:
            parse("--join", "auto", "--auth-file", self.token(), "--head-name", "x" * 64)
        self.assertIn("longer than 63 bytes", str(caught.exception))

    def test_no_plaintext_off_loopback(self) -> None:
        """Without a fleet token a node joins only a head on loopback: --join to another
        address, and --join auto (a head on the network), are refused unless
        --insecure-no-auth (D10)."""
        for join in ("10.1.2.3:8455", "auto", "head.example"):
            with self.assertRaises(usage.UsageError) as caught:
                parse("--join", join, "--engine", "mock")
            self.assertIn("without a fleet token", str(caught.exception))
            parse("--join", join, "--engine", "mock", "--insecure-no-auth")
            parse("--join", join, "--engine", "mock", "--auth-file", self.token())
        parse("--join", "127.0.0.1:8455", "--engine", "mock")
        parse("--join", "[::1]:8455", "--engine", "mock")


class RecordingBrowser:
    """A Browser that answers what the test says, and counts browses."""

    def __init__(self) -> None:
        self.answers: list[HeadAnswer] = []
        self.browses = 0
        self.browsed: list[defer.Deferred[None]] = []

    def browse(self, duration_s: float) -> defer.Deferred[list[HeadAnswer]]:
        self.browses += 1
        waiters, self.browsed = self.browsed, []
        for waiter in waiters:
            reactor.callLater(0, waiter.callback, None)
        return defer.succeed(list(self.answers))

    def next_browse(self) -> defer.Deferred[None]:
        waiter: defer.Deferred[None] = defer.Deferred()
        self.browsed.append(waiter)
        return waiter


class LogLines:
    """The formatted log lines of this process while a test runs."""

    def __init__(self, test: TestCase) -> None:
        self.lines: list[str] = []
        self._waits: list[tuple[Callable[[list[str]], bool], defer.Deferred[None]]] = []
        globalLogPublisher.addObserver(self._observe)
        test.addCleanup(globalLogPublisher.removeObserver, self._observe)

    def _observe(self, event: dict[str, Any]) -> None:
        self.lines.append(formatEvent(event))
        for wait in list(self._waits):
            if wait[0](self.lines):
                self._waits.remove(wait)
                reactor.callLater(0, wait[1].callback, None)

    def matching(self, fragment: str) -> list[str]:
        return [line for line in self.lines if fragment in line]

    def wait_for(self, fragment: str, count: int = 1) -> defer.Deferred[None]:
        """Fires once ``count`` lines hold ``fragment``."""
        d: defer.Deferred[None] = defer.Deferred()

        def test(lines: list[str]) -> bool:
            return len([x for x in lines if fragment in x]) >= count

        if test(self.lines):
            d.callback(None)
        else:
            self._waits.append((test, d))
        return d


class JoinTests(TestCase):
    """A --join node against the head's real fleet listener, on loopback."""

    timeout = 60

    async def head(self, token: bytes, port: int = 0) -> tuple[Fleet, IListeningPort]:
        fleet = Fleet(reactor, FleetSettings(token=token), ids=HeadIds())
        listening = await TCP4ServerEndpoint(reactor, port, interface="127.0.0.1").listen(
            fleet.listen_factory()
        )
        self.addCleanup(fleet.stop)
        self.addCleanup(listening.stopListening)
        return fleet, listening

    def token_file(self, token: bytes) -> str:
        path = Path(self.mktemp())
        path.write_bytes(token + b"\n")
        return str(path)

    def node(self, *args: str, browser: RecordingBrowser | None = None) -> MultiService:
        options = parse("--engine", "mock", *args)
        node = tap.makeService(options, reactor, browser=browser)
        node.startService()  # type: ignore[no-untyped-call]
        self.addCleanup(node.stopService)  # type: ignore[no-untyped-call]
        return node

    async def serves(self, fleet: Fleet, joined: FleetNode, name: str) -> None:
        self.assertEqual(joined.name, name)
        outcome = await fleet.generate(HeadRequest(PROMPT, 6)).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 6))

    async def test_join_by_address(self) -> None:
        """--join 127.0.0.1:PORT dials the head's fleet listener, passes the keyed handshake
        and serves its generations."""
        token = b"a" * 64
        fleet, listening = await self.head(token)
        joined = fleet.next_join()
        self.node("--join", f"127.0.0.1:{listening.getHost().port}", "--identity", "j1",
                  "--auth-file", self.token_file(token))  # fmt: skip
        await self.serves(fleet, await joined, "j1")

    async def test_a_wrong_token_is_logged_and_the_node_keeps_trying(self) -> None:
        """A head holding another token: the node logs an error that names the head and the
        fix, the head logs the failed handshake, and the node redials (with backoff) until a
        head with its token listens there, which it then joins."""
        logs = LogLines(self)
        node_token, head_token = b"b" * 64, b"c" * 64
        fleet, listening = await self.head(head_token)
        port = listening.getHost().port
        self.node("--join", f"127.0.0.1:{port}", "--identity", "j2",
                  "--auth-file", self.token_file(node_token))  # fmt: skip
        await logs.wait_for("its fleet token differs", 3)
        errors = logs.matching("the handshake failed")
        self.assertEqual(len(errors), 1, logs.lines)  # once, not at every redial
        self.assertIn(
            f"the head at 127.0.0.1:{port}: the handshake failed: Noise message 1 does not "
            "decrypt: the peer holds another fleet token",
            errors[0],
        )
        self.assertTrue(logs.matching("failed the handshake"), logs.lines)
        self.assertEqual(fleet.live_nodes(), [])
        # Someone fixes the head: the same port now holds a head with the node's token.
        await listening.stopListening()
        await fleet.stop()
        fixed, _ = await self.head(node_token, port)
        await self.serves(fixed, await fixed.next_join(), "j2")

    def answer(self, name: str, port: int) -> HeadAnswer:
        return HeadAnswer(
            f"{name}.{SERVICE_TYPE}", ("127.0.0.1",), port, HeadAnnouncement(name, True)
        )

    async def test_join_auto_dials_the_head_found_and_browses_again(self) -> None:
        """--join auto dials the head a browse found; when that head goes away and stays
        unreachable the node browses again and joins the head found now (elsewhere)."""
        token = b"d" * 64
        first, first_port = await self.head(token)
        browser = RecordingBrowser()
        browser.answers = [self.answer("first", first_port.getHost().port)]
        joined = first.next_join()
        self.node("--join", "auto", "--identity", "j3", "--auth-file", self.token_file(token),
                  browser=browser)  # fmt: skip
        await self.serves(first, await joined, "j3")
        self.assertEqual(browser.browses, 1)
        second, second_port = await self.head(token)
        browser.answers = [self.answer("second", second_port.getHost().port)]
        joined = second.next_join()
        await first_port.stopListening()
        await first.stop()
        await self.serves(second, await joined, "j3")
        self.assertEqual(browser.browses, 2)

    async def test_several_heads_are_an_error_naming_them(self) -> None:
        """Two heads answering and no --head-name: the node logs an error naming both and
        --head-name, joins neither, and browses again; with --head-name it joins its head."""
        logs = LogLines(self)
        token = b"e" * 64
        alpha, alpha_port = await self.head(token)
        beta, beta_port = await self.head(token)
        browser = RecordingBrowser()
        browser.answers = [self.answer("alpha", alpha_port.getHost().port),
                           self.answer("beta", beta_port.getHost().port)]  # fmt: skip
        self.node("--join", "auto", "--identity", "j4", "--auth-file", self.token_file(token),
                  browser=browser)  # fmt: skip
        await browser.next_browse()
        await browser.next_browse()
        errors = logs.matching("2 heads answer")
        self.assertEqual(len(errors), 1, logs.lines)
        self.assertIn(f"'alpha' at 127.0.0.1:{alpha_port.getHost().port}", errors[0])
        self.assertIn(f"'beta' at 127.0.0.1:{beta_port.getHost().port}", errors[0])
        self.assertIn("--head-name", errors[0])
        self.assertEqual((alpha.live_nodes(), beta.live_nodes()), ([], []))
        joined = beta.next_join()
        self.node("--join", "auto", "--head-name", "beta", "--identity", "j5",
                  "--auth-file", self.token_file(token), browser=browser)  # fmt: skip
        await self.serves(beta, await joined, "j5")
