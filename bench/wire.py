"""Token events per second through the whole wire path, next to raw msgpack, in one run.

The protocol path: the node's protocol (``NodeProtocol.send_message``) encodes TOKEN_EVENTS
frames, loopback TCP carries them, the head's link protocol (``HeadLinkProtocol``) decodes them
and dispatches each typed message to its owner.  Both ends run in this one process on one
reactor, so the figure counts the CPU of both sides.  The baseline is plain
``msgpack.packb`` + ``msgpack.unpackb`` of the same messages' payload objects.

Target (issue 2): the protocol path reaches at least a quarter of the raw msgpack rate.

Usage: python bench/wire.py [--events N] [--tokens-per-event K] [--rounds R]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgpack
from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint
from twisted.internet.interfaces import IReactorCore
from twisted.python.failure import Failure

from sfnode.engines.mock import MockEngine
from sfnode.head.link import HeadLinkProtocol
from sfnode.linkf.wire import (
    Hello,
    HelloAckF,
    LinkRole,
    Message,
    TokenEvent,
    TokenEventsMsg,
    Tokens,
)
from sfnode.node.agent import NodeAgent
from sfnode.node.config import NodeConfig
from sfnode.node.tap import node_factory

CHUNK = 2000
"""Frames the node writes before it lets the reactor carry them."""


def make_messages(count: int, tokens_per_event: int) -> list[TokenEventsMsg]:
    return [
        TokenEventsMsg(
            (
                TokenEvent(
                    1,
                    5,
                    100,
                    seq,
                    Tokens(tuple((seq * 7 + i) % 32000 for i in range(tokens_per_event))),
                ),
            )
        )
        for seq in range(count)
    ]


def raw_msgpack_rate(messages: list[TokenEventsMsg]) -> float:
    objects = [m.to_wire() for m in messages]
    packb, unpackb = msgpack.packb, msgpack.unpackb
    start = time.perf_counter()
    for obj in objects:
        unpackb(packb(obj, use_bin_type=True), raw=False)
    return len(objects) / (time.perf_counter() - start)


class CountingOwner:
    """The head end: says HELLO, then counts every decoded TOKEN_EVENTS message."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.received = 0
        self.ready: defer.Deferred[None] = defer.Deferred()
        self.all_received: defer.Deferred[float] = defer.Deferred()

    def link_made(self, protocol: HeadLinkProtocol) -> None:
        protocol.send(Hello((2, 2), LinkRole.HEAD_DAEMON, b""))

    def message_received(self, protocol: HeadLinkProtocol, message: Message) -> None:
        if isinstance(message, HelloAckF):
            self.ready.callback(None)
        elif isinstance(message, TokenEventsMsg):
            self.received += 1
            if self.received == self.expected:
                self.all_received.callback(time.perf_counter())

    def link_broken(self, protocol: HeadLinkProtocol, error: Exception) -> None:
        raise SystemExit(f"link broke: {error}")

    def link_lost(self, protocol: HeadLinkProtocol, reason: Failure) -> None:
        pass


@defer.inlineCallbacks
def protocol_rate(messages: list[TokenEventsMsg]):  # type: ignore[no-untyped-def]
    agent = NodeAgent(reactor, MockEngine(reactor), NodeConfig(identity="bench"))
    port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(node_factory(agent))
    owner = CountingOwner(len(messages))
    endpoint = TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port)
    from twisted.internet.protocol import Factory

    head = yield endpoint.connect(Factory.forProtocol(lambda: HeadLinkProtocol(owner)))
    yield owner.ready
    (connection,) = agent.connections
    start = time.perf_counter()
    for offset in range(0, len(messages), CHUNK):
        for message in messages[offset : offset + CHUNK]:
            connection.send(message)
        # Let the reactor move the bytes, as it would between engine steps.
        yield defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        reactor.callLater(0, d.callback, None)
        yield d
    end = yield owner.all_received
    head.transport.loseConnection()
    yield port.stopListening()
    return len(messages) / (end - start)


@defer.inlineCallbacks
def main(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    messages = make_messages(args.events, args.tokens_per_event)
    raw, path = [], []
    for _ in range(args.rounds):
        raw.append(raw_msgpack_rate(messages))
        rate = yield protocol_rate(messages)
        path.append(rate)
    raw_m, path_m = statistics.median(raw), statistics.median(path)
    print(
        f"token events of {args.tokens_per_event} tokens, {args.events} per round, "
        f"{args.rounds} rounds (medians)"
    )
    print(f"{'raw msgpack pack+unpack':<44}{raw_m:>12,.0f} events/s")
    print(f"{'sfnode: encode, loopback TCP, decode, dispatch':<44}{path_m:>12,.0f} events/s")
    ratio = path_m / raw_m
    verdict = "meets" if ratio >= 0.25 else "MISSES"
    print(f"{'ratio (target >= 0.25)':<44}{ratio:>12.2f}  {verdict} the target")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--tokens-per-event", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    arguments = parser.parse_args()

    def run() -> None:
        d = main(arguments)
        d.addErrback(lambda f: print(f.getTraceback(), file=sys.stderr))
        d.addBoth(lambda _: reactor.stop())

    core: IReactorCore = reactor  # type: ignore[assignment]
    core.callWhenRunning(run)
    core.run()
