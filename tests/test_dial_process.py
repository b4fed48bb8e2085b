"""A node that dials never gives up because of noise (issue 19, item 6; docs/protocol.md D9 and
section 5.2).

``twistd sfnode --head ENDPOINT`` runs as a real process, as an operator starts it, with a fleet
token.  Whatever answers its dial first (50 bytes of garbage from anything that took the head's
port while the head restarts, or a head that holds another token and may be fixed) makes a
failed handshake that the node logs with its reason and retries with its usual backoff; when the
real head listens on that port, the node joins it and serves.  Only a configuration error at
start stops it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.utils import getProcessOutputAndValue
from twisted.trial.unittest import TestCase

from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.link import HeadIds, HeadLinkFactory, LinkSettings, NodeLink
from tests.nodefixture import expected_tokens
from tests.processes import TWISTD, Child, child_env, spawn_twistd

TOKEN = b"4f" * 32
OTHER = b"9a" * 32
PROMPT = list(range(100, 112))


class Garbage(Protocol):
    """Answers a connection with a Noise length of 48 and 48 random bytes (50 in all), as
    anything else listening on the head's port might."""

    def connectionMade(self) -> None:
        self.factory.connections += 1  # type: ignore[attr-defined]
        assert self.transport is not None
        self.transport.write(b"\x00\x30" + os.urandom(48))


class DialTests(TestCase):
    timeout = 120
    """On main the node exits with status 1 at its first refused handshake: ``Child.wait_for``
    then fails with its whole output."""

    def token_file(self, token: bytes) -> str:
        folder = Path(self.mktemp()).resolve()
        folder.mkdir(parents=True)
        path = folder / "token"
        path.write_bytes(token + b"\n")
        return str(path)

    async def start_dialing_node(self, port: int) -> Child:
        node = Child("sfnode")
        spawn_twistd(
            self,
            node,
            [
                "sfnode", "--head", f"tcp:127.0.0.1:{port}", "--engine", "mock",
                "--identity", "dialer", "--auth-file", self.token_file(TOKEN),
            ],
        )  # fmt: skip
        return node

    async def head_on(self, port: int, token: bytes) -> tuple[Any, defer.Deferred[NodeLink]]:
        """A head accepting nodes on ``port`` with ``token``; the Deferred fires with the first
        node that joins."""
        joined: defer.Deferred[NodeLink] = defer.Deferred()
        factory = HeadLinkFactory(
            lambda link: None if joined.called else joined.callback(link),
            reactor=reactor,
            ids=HeadIds(),
            settings=LinkSettings(token=token, handshake_timeout_s=10.0),
        )
        listening = await TCP4ServerEndpoint(reactor, port, interface="127.0.0.1").listen(factory)
        self.addCleanup(listening.stopListening)
        return listening, joined

    async def serve_one(self, joined: defer.Deferred[NodeLink]) -> None:
        link = await joined
        self.addCleanup(link.close)
        self.assertEqual(link.node_identity, "dialer")
        link.assign(1)
        link.append(1, PROMPT)
        outcome = await link.generate(1, HeadRequest((), 6)).result
        self.assertEqual(outcome.tokens, expected_tokens(PROMPT, 6))

    async def test_garbage_on_the_heads_port_is_retried_until_the_head_is_back(self) -> None:
        """Garbage answers three dials: each failed handshake is logged with its reason, the
        redials back off (0.1 s, 0.2 s, 0.4 s ... at most 2 s) and the process stays up;
        then the head listens on that port and the node joins it and serves."""
        factory = Factory.forProtocol(Garbage)
        factory.connections = 0  # type: ignore[attr-defined]
        squatter = await TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(factory)
        port = squatter.getHost().port
        node = await self.start_dialing_node(port)
        found = await node.wait_for(
            rb"the handshake failed: ([^;]+); redialling in ([\d.]+) s \(attempt (\d+)\)", 1
        )
        self.assertIn(b"the peer holds another fleet token, or is not a head", found[0].group(1))
        await node.wait_for(rb"refused 127\.0\.0\.1:\d+: its fleet token differs", 3)
        self.assertGreaterEqual(factory.connections, 3)  # type: ignore[attr-defined]
        self.assertFalse(node.ended.called)
        await squatter.stopListening()
        _, joined = await self.head_on(port, TOKEN)
        await self.serve_one(joined)
        await node.wait_for(rb"handshake with 127\.0\.0\.1:\d+ done")
        self.assertNotIn(b"Traceback", bytes(node.output))

    async def test_a_head_with_another_token_is_retried_until_it_is_fixed(self) -> None:
        """A head that holds another fleet token: the node logs that the handshake failed
        because the tokens differ and keeps redialling; once the head is restarted with the
        right token on the same port, the node joins it and serves."""
        wrong, joined_wrong = await self.head_on(0, OTHER)
        port = wrong.getHost().port
        node = await self.start_dialing_node(port)
        await node.wait_for(rb"the handshake failed: Noise message 1 does not decrypt", 1)
        await node.wait_for(rb"refused 127\.0\.0\.1:\d+: its fleet token differs", 2)
        self.assertFalse(node.ended.called)
        self.assertFalse(joined_wrong.called)
        await wrong.stopListening()
        _, joined = await self.head_on(port, TOKEN)
        await self.serve_one(joined)

    async def test_a_configuration_error_still_stops_it(self) -> None:
        """A missing token file or an endpoint that is not one stops ``twistd sfnode --head``
        at once with a message and a non-zero status (nothing is dialed)."""
        args = [sys.executable, "-c", TWISTD, "--pidfile=", "-n", "sfnode", "--engine", "mock"]
        folder = Path(self.mktemp()).resolve()
        folder.mkdir(parents=True)
        for extra, message in (
            (["--head", "tcp:127.0.0.1:1", "--auth-file", str(folder / "none")],
             b"cannot read --auth-file"),
            (["--head", "tcp:127.0.0.1:notaport"], b"is not a client endpoint string"),
        ):  # fmt: skip
            out, err, code = await getProcessOutputAndValue(
                sys.executable, args[1:] + extra, env=child_env(), path=str(folder)
            )
            self.assertNotEqual(code, 0)
            self.assertIn(message, out + err)
            self.assertNotIn(b"Traceback", out + err)
