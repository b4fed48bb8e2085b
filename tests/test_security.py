"""Tests of fleet tokens and admission (issue 5, points 1 to 3).

They pin ``python -m sfnode token`` as an operator runs it (docs/protocol.md section 5.4: 64
lowercase hex chars, mode 0600, created once and never overwritten, ``$SFNODE_HOME/token`` by
default), that ``--auth-file`` reads that file through the same function, that a real ``twistd
sfnode`` refuses an open listener without a token before it imports torch or loads a model (item
67), and that a listener closes the 65th concurrent handshake at once while the first 64 wait for
their handshake timeout (docs/protocol.md section 5.3).  (A ``--head`` node facing another token
keeps redialling: tests/test_dial_process.py.)
"""

from __future__ import annotations

import stat
import sys
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol, connectionDone
from twisted.internet.task import Clock
from twisted.internet.utils import getProcessOutputAndValue
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase, TestCase

from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.link import HeadIds, HeadLinkFactory, LinkSettings
from sfnode.linkf import fleet_token
from sfnode.node import tap
from tests.nodefixture import NodeTestCase, expected_tokens
from tests.test_tap import REPO_ROOT, TWISTD, child_env

TOKEN = b"4f" * 32
OTHER = b"9a" * 32
Gen = Generator[defer.Deferred[Any], Any, None]


def run(args: list[str], env: dict[str, str]) -> defer.Deferred[tuple[bytes, bytes, int]]:
    result: defer.Deferred[tuple[bytes, bytes, int]] = getProcessOutputAndValue(
        sys.executable, args, env=env, path=str(REPO_ROOT), reactor=reactor
    )
    return result


def isolated_env(home: Path) -> dict[str, str]:
    """The child environment with its own HOME and no SFNODE_HOME: no stray token is found."""
    env = child_env()
    env["HOME"] = str(home)
    env.pop(fleet_token.HOME_VARIABLE, None)
    return env


class TokenCommandTests(TestCase):
    """Item 15: ``python -m sfnode token``."""

    async def test_creates_once_with_mode_0600_and_prints_it(self) -> None:
        """The first run creates the file (64 lowercase hex chars, mode 0600) and prints the
        token; a second run prints the same token and leaves the file as it was."""
        home = Path(self.mktemp()).resolve()
        path = home / "fleet" / "token"
        env = isolated_env(home)
        out, err, code = await run(["-m", "sfnode", "token", "--file", str(path)], env)
        self.assertEqual(code, 0, err)
        token = out.decode().strip()
        self.assertRegex(token, r"\A[0-9a-f]{64}\Z")
        self.assertEqual(stat.S_IMODE(path.stat().st_mode), 0o600)
        self.assertEqual(path.read_text().strip(), token)
        self.assertIn("created", err.decode())
        before = path.stat().st_mtime_ns
        out2, err2, code2 = await run(["-m", "sfnode", "token", "--file", str(path)], env)
        self.assertEqual((code2, out2.decode().strip()), (0, token), err2)
        self.assertEqual(path.stat().st_mtime_ns, before)
        self.assertEqual(fleet_token.read_token(path), token.encode())

    async def test_default_path_is_under_sfnode_home(self) -> None:
        """Without --file the token goes to $SFNODE_HOME/token; an existing token there
        (whatever its text) is printed trimmed and never replaced."""
        home = Path(self.mktemp()).resolve()
        env = isolated_env(home)
        env[fleet_token.HOME_VARIABLE] = str(home / "sf")
        out, err, code = await run(["-m", "sfnode", "token"], env)
        self.assertEqual(code, 0, err)
        self.assertEqual((home / "sf" / "token").read_text().strip(), out.decode().strip())
        (home / "sf" / "token").write_bytes(b"  operator-chosen\n")
        out, err, code = await run(["-m", "sfnode", "token"], env)
        self.assertEqual((code, out.decode().strip()), (0, "operator-chosen"), err)
        self.assertEqual((home / "sf" / "token").read_bytes(), b"  operator-chosen\n")


class TokenFileTests(SynchronousTestCase):
    """The token file functions themselves."""

    def test_default_path(self) -> None:
        """$SFNODE_HOME/token when set, else ~/.config/sfnode/token."""
        self.assertEqual(fleet_token.default_token_path({"SFNODE_HOME": "/x"}), Path("/x/token"))
        self.assertEqual(
            fleet_token.default_token_path({}), Path("~/.config/sfnode/token").expanduser()
        )

    def test_auth_file_reads_what_token_wrote(self) -> None:
        """--auth-file reads a created token file through the same trimmed reader."""
        path = Path(self.mktemp()) / "token"
        token, created = fleet_token.ensure_token(path)
        self.assertTrue(created)
        options = tap.Options()
        options.parseOptions(
            ["--listen", "tcp:0:interface=0.0.0.0", "--engine", "mock", "--auth-file", str(path)]
        )
        self.assertEqual(options["auth-token"], token)
        self.assertEqual(fleet_token.ensure_token(path), (token, False))

    def test_empty_existing_file_is_an_error(self) -> None:
        """An existing file without a token is reported, not overwritten."""
        path = Path(self.mktemp())
        path.write_bytes(b"\n")
        self.assertRaises(fleet_token.TokenError, fleet_token.ensure_token, path)
        self.assertEqual(path.read_bytes(), b"\n")


class AdmissionProcessTests(TestCase):
    """Item 67: no open listener without a token, decided before any model is loaded."""

    async def test_open_listener_without_token_is_refused_before_loading(self) -> None:
        """``twistd sfnode --listen tcp:0:interface=0.0.0.0`` with the default (transformers)
        engine and no token exits non-zero with "without a fleet token", no traceback, and
        torch never imported (so no model was loaded: the refusal comes first).  How long the
        child takes is not asserted (a loaded machine can take many seconds to start Python);
        a child that never exits fails the test at trial's timeout."""
        home = Path(self.mktemp()).resolve()
        home.mkdir(parents=True)
        probe = (
            "import atexit, sys; "
            "atexit.register(lambda: print('torch imported:', 'torch' in sys.modules)); " + TWISTD
        )
        out, err, code = await run(
            ["-c", probe, "--pidfile=", "-n", "sfnode", "--listen", "tcp:0:interface=0.0.0.0"],
            isolated_env(home),
        )
        text = (out + err).decode()
        self.assertNotEqual(code, 0, text)
        self.assertIn("without a fleet token", text)
        self.assertIn("torch imported: False", text)
        self.assertNotIn("Traceback", text)


class Silent(Protocol):
    """Connects and never says anything."""

    def __init__(self) -> None:
        self.closed: defer.Deferred[float] = defer.Deferred()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self.closed.callback(time.monotonic())


class HandshakeLimitTests(NodeTestCase):
    """docs/protocol.md section 5.3: at most 64 handshakes in progress per listener."""

    @defer.inlineCallbacks
    def test_the_65th_concurrent_handshake_is_closed_at_once(self) -> Gen:
        """With 64 silent connections in their handshake (keyed node, Noise), a 65th is
        closed at once while the 64 stay open until their 3 s handshake timeout; afterwards a
        real head is served.  The node's timers run on a ``Clock``: however slowly the 65
        connections arrive, the 64 time out only when the test moves the clock past 3 s."""
        clock = Clock()
        node = yield self.start_node(
            auth_token=TOKEN, handshake_timeout_ms=3000, clock=clock, max_address_handshakes=0
        )
        factory = node.node_factory
        self.assertEqual(factory.max_handshakes, 64)
        built: defer.Deferred[None] = defer.Deferred()
        answers: list[defer.Deferred[Any]] = [defer.Deferred() for _ in range(65)]
        """What the node's factory built for each connection, in order (None: refused)."""
        unanswered = list(answers)
        original = factory.buildProtocol

        def counting(addr: Any) -> Any:
            protocol = original(addr)
            if unanswered:
                unanswered.pop(0).callback(protocol)
            if len(factory.protocols) == 64 and not built.called:
                built.callback(None)
            return protocol

        factory.buildProtocol = counting  # type: ignore[method-assign]
        endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", node.port_number)
        silent = [Silent() for _ in range(64)]
        yield defer.gatherResults([connectProtocol(endpoint, p) for p in silent])
        yield built
        self.assertEqual(factory.handshaking(), 64)
        extra = Silent()
        yield connectProtocol(endpoint, extra)
        refused = yield answers[-1]
        self.assertIsNone(refused)
        yield extra.closed
        self.assertEqual([p for p in silent if p.closed.called], [])
        self.assertEqual(len(factory.protocols), 64)
        clock.advance(3.0)
        yield defer.gatherResults([p.closed for p in silent])
        link = yield self.dial(node, token=TOKEN)
        link.assign(1)
        link.append(1, [1, 2, 3])
        outcome = yield link.generate(1, HeadRequest((), 4)).result
        self.assertEqual(outcome.tokens, expected_tokens([1, 2, 3], 4))


class HeadAdmissionTests(SynchronousTestCase):
    """docs/protocol.md section 5.3 on the head's side: what ``HeadLinkFactory`` admits from dialing
    nodes."""

    def test_without_a_token_only_loopback_peers_when_asked(self) -> None:
        """With loopback_only (sfhead without --insecure-no-auth) and no token a remote peer
        is refused (no protocol: closed at once) while loopback and Unix peers are greeted;
        with a token any peer gets a Noise protocol."""
        from twisted.internet.address import IPv4Address, UNIXAddress
        from twisted.internet.task import Clock

        from sfnode.linkf.noise import NoiseProtocol

        clock = Clock()
        plain = HeadLinkFactory(
            lambda _: None, reactor=clock, ids=HeadIds(),
            settings=LinkSettings(handshake_timeout_s=1.0), loopback_only=True,
        )  # fmt: skip
        self.assertIsNone(plain.buildProtocol(IPv4Address("TCP", "10.1.2.3", 5000)))
        self.assertIsNotNone(plain.buildProtocol(IPv4Address("TCP", "127.0.0.1", 5000)))
        self.assertIsNotNone(plain.buildProtocol(UNIXAddress(b"/tmp/s")))
        keyed = HeadLinkFactory(
            lambda _: None, reactor=clock, ids=HeadIds(),
            settings=LinkSettings(token=TOKEN, handshake_timeout_s=1.0), loopback_only=True,
        )  # fmt: skip
        self.assertIsInstance(
            keyed.buildProtocol(IPv4Address("TCP", "10.1.2.3", 5000)), NoiseProtocol
        )
        clock.advance(2.0)

    def test_at_most_max_handshakes_nodes_in_their_handshake(self) -> None:
        """max_handshakes=2 (default 8): a third connection during two handshakes is closed
        at once; once those handshakes timed out a new one is admitted."""
        from twisted.internet.address import IPv4Address
        from twisted.internet.task import Clock

        from sfnode.head.link import DEFAULT_JOIN_HANDSHAKES

        self.assertEqual(DEFAULT_JOIN_HANDSHAKES, 8)
        clock = Clock()
        factory = HeadLinkFactory(
            lambda _: None, reactor=clock, ids=HeadIds(),
            settings=LinkSettings(handshake_timeout_s=1.0), max_handshakes=2,
        )  # fmt: skip
        peer = IPv4Address("TCP", "127.0.0.1", 5000)
        self.assertIsNotNone(factory.buildProtocol(peer))
        self.assertIsNotNone(factory.buildProtocol(peer))
        self.assertIsNone(factory.buildProtocol(peer))
        clock.advance(1.0)
        self.assertEqual(factory.handshaking, 0)
        self.assertIsNotNone(factory.buildProtocol(peer))
        clock.advance(1.0)
