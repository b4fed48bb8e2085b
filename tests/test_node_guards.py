"""The node's smaller doors (issue 19, item 8, node parts).

- ``--metrics`` has the HTTP guards of every sfnode listener (``sfnode.runtime.http_guard``): a cap
on open
  connections (503 beyond it) and a deadline for a request's headers (408), and an address off
  loopback is refused unless ``--metrics-insecure``;
- the plaintext-dial guard judges the host Twisted will actually dial, parsed by Twisted's own
  ``clientFromString`` (``tcp:10.1.2.3:8454:host=127.0.0.1`` dials 10.1.2.3);
- a GGUF file whose tensor table describes a tensor that cannot exist is refused, naming the
  tensor, before any conversion.

Listeners are real loopback TCP, and ``twistd sfnode`` a real process where the point is how it
starts.
"""

from __future__ import annotations

import shutil
import struct
import sys
from collections.abc import Generator
from pathlib import Path
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, TCP4ServerEndpoint, connectProtocol
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, readBody

from sfnode.engines.weights.gguf import impossible_tensor, read_tensor_table
from sfnode.head import tap as head_tap
from sfnode.linkf.handshake import dialed_host, is_loopback_head
from sfnode.node import tap
from sfnode.node.exporter import METRICS_MAX_CONNECTIONS, metrics_site
from tests.nodefixture import NodeTestCase
from tests.processes import LOOPBACK, TWISTD, child_env
from tests.test_http_hostile import RawClient, response_of

Gen = Generator[defer.Deferred[Any], Any, None]


class MetricsGuardTests(NodeTestCase):
    timeout = 60

    @defer.inlineCallbacks
    def listen(self, site: Any) -> Generator[defer.Deferred[Any], Any, int]:
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(site)
        self.addCleanup(port.stopListening)
        return int(port.getHost().port)

    @defer.inlineCallbacks
    def connect(self, port: int) -> Generator[defer.Deferred[Any], Any, RawClient]:
        client = RawClient()
        yield connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), client)

        def close() -> Any:
            if not client.closed and client.transport is not None:
                client.transport.loseConnection()
            return client.ended

        self.addCleanup(close)
        return client

    @defer.inlineCallbacks
    def test_the_twistd_metrics_listener_takes_64_connections(self) -> Gen:
        """``twistd sfnode --metrics`` on loopback: with 64 connections open (and idle), a
        65th is answered 503 too_many_connections and closed; once one closes, /metrics is
        served."""
        options = tap.Options()
        options.parseOptions(["--listen", LOOPBACK, "--metrics", LOOPBACK, "--engine", "mock"])
        node = tap.makeService(options, reactor)
        node.startService()  # type: ignore[no-untyped-call]
        self.addCleanup(node.stopService)  # type: ignore[no-untyped-call]
        bound = yield node.getServiceNamed("metrics").bound  # type: ignore[no-untyped-call]
        port = bound.getHost().port
        self.assertEqual(METRICS_MAX_CONNECTIONS, 64)
        idle = []
        for _ in range(64):
            idle.append((yield self.connect(port)))
        extra = yield self.connect(port)
        status, _, body = response_of((yield extra.ended))
        self.assertEqual(status, 503)
        self.assertIn(b"too_many_connections", body)
        assert idle[0].transport is not None
        idle[0].transport.loseConnection()
        yield idle[0].ended
        response = yield Agent(reactor).request(b"GET", f"http://127.0.0.1:{port}/metrics".encode())
        self.assertEqual(response.code, 200)
        self.assertIn(b"sfnode_lanes_active", (yield readBody(response)))

    @defer.inlineCallbacks
    def test_slow_headers_are_cut_off(self) -> Gen:
        """A metrics request whose headers drip one byte every 50 ms (each byte would reset
        an idle timer) gets 408 request_timeout when the header deadline (0.5 s here) passes,
        long before its headers are complete."""
        started = yield self.start_node()
        port = yield self.listen(metrics_site(started.agent, reactor, header_timeout_s=0.5))
        slow = yield self.connect(port)
        request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Pad: " + b"a" * 400
        sent = yield slow.drip(request, 0.05)
        status, _, body = response_of(slow.data)
        self.assertLess(sent, len(request))
        self.assertEqual(status, 408)
        self.assertIn(b"request_timeout", body)


class MetricsAddressTests(TestCase):
    def test_metrics_off_loopback_needs_metrics_insecure(self) -> None:
        """``--metrics`` on all interfaces is a usage error naming --metrics-insecure; with the
        flag, or on loopback, it is taken."""
        with self.assertRaises(usage.UsageError) as raised:
            tap.Options().parseOptions(
                ["--listen", LOOPBACK, "--metrics", "tcp:9100", "--engine", "mock"]
            )
        self.assertIn("--metrics-insecure", str(raised.exception))
        for extra in (["--metrics", "tcp:9100", "--metrics-insecure"], ["--metrics", LOOPBACK]):
            tap.Options().parseOptions(["--listen", LOOPBACK, "--engine", "mock", *extra])

    async def test_twistd_refuses_open_metrics_before_loading_anything(self) -> None:
        """``twistd sfnode --metrics tcp:0`` (every interface) exits non-zero with the reason,
        without a traceback."""
        from twisted.internet.utils import getProcessOutputAndValue

        folder = Path(self.mktemp()).resolve()
        folder.mkdir(parents=True)
        out, err, code = await getProcessOutputAndValue(
            sys.executable,
            ["-c", TWISTD, "--pidfile=", "-n", "sfnode", "--listen", LOOPBACK, "--metrics",
             "tcp:0", "--engine", "mock"],
            env=child_env(),
            path=str(folder),
        )  # fmt: skip
        self.assertNotEqual(code, 0)
        self.assertIn(b"refusing to serve metrics on tcp:0 off loopback", out + err)
        self.assertNotIn(b"Traceback", out + err)


class DialGuardTests(SynchronousTestCase):
    def test_the_host_is_the_one_twisted_dials(self) -> None:
        """The host is read from the endpoint Twisted builds of the string: a positional host
        wins over a host= keyword, as in ``clientFromString``."""
        cases = {
            "tcp:10.1.2.3:8454:host=127.0.0.1": "10.1.2.3",
            "tcp:host=127.0.0.1:8454": "127.0.0.1",
            "tcp:1.2.3.4:4:host=localhost": "1.2.3.4",
            "tls:10.0.0.1:8454": "10.0.0.1",
            "tcp:host=\\:\\:1:port=8454": "::1",
        }
        for description, host in cases.items():
            self.assertEqual(dialed_host(description), host, description)
        self.assertFalse(is_loopback_head("tcp:10.1.2.3:8454:host=127.0.0.1"))
        self.assertFalse(is_loopback_head("tcp:host=::1:port=8454"))  # host "" (unescaped)
        self.assertTrue(is_loopback_head("unix:/run/sfhead.sock"))
        self.assertTrue(is_loopback_head("tcp:localhost:8454"))

    def test_neither_daemon_dials_a_disguised_remote_host_without_a_token(self) -> None:
        """``--head`` (sfnode) and ``--node`` (sfhead) refuse
        ``tcp:10.1.2.3:8454:host=127.0.0.1`` without a fleet token: it dials 10.1.2.3."""
        disguised = "tcp:10.1.2.3:8454:host=127.0.0.1"
        with self.assertRaises(usage.UsageError) as raised:
            tap.Options().parseOptions(["--head", disguised, "--engine", "mock"])
        self.assertIn("without a fleet token", str(raised.exception))
        with self.assertRaises(usage.UsageError) as raised:
            head_tap.Options().parseOptions(["--node", disguised])
        self.assertIn("without a fleet token", str(raised.exception))
        tap.Options().parseOptions(["--head", "tcp:host=127.0.0.1:8454", "--engine", "mock"])


# --------------------------------------------------------------------------------------------
# GGUF


def gguf_bytes(
    tensors: list[tuple[str, tuple[int, ...], int]], data: int = 1024, version: int = 3
) -> bytes:
    """A GGUF file: one metadata entry, the tensor table (name, shape, ggml type; offsets one
    after the other as their shapes say), and ``data`` bytes of data."""

    def string(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), 1)
    out += string("general.architecture") + struct.pack("<I", 8) + string("llama")
    offset = 0
    for name, shape, kind in tensors:
        out += string(name) + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in shape)
        out += struct.pack("<IQ", kind, offset)
        count = 1
        for d in shape:
            count *= d
        offset += count * 4 if kind == 0 else count // 32 * 20
    out += bytes(-len(out) % 32)
    return out + bytes(data)


F32, Q4_1 = 0, 3


class GgufTableTests(SynchronousTestCase):
    def problem(self, tensors: list[tuple[str, tuple[int, ...], int]], data: int = 1024) -> Any:
        path = Path(self.mktemp())
        path.write_bytes(gguf_bytes(tensors, data))
        return impossible_tensor(read_tensor_table(path), path.stat().st_size)

    def test_possible_tensors_pass(self) -> None:
        """F32 [4, 8] and Q4_1 [64, 2] (two rows of two 32-value blocks) with their data."""
        self.assertIsNone(self.problem([("a", (4, 8), F32), ("b", (64, 2), Q4_1)]))

    def test_impossible_shapes_are_named(self) -> None:
        """A dimension of 0, five dimensions, rows that are not whole Q4_1 blocks, more
        elements than any model, and data past the end of the file are each named with the
        tensor."""
        cases = [
            ([("w", (576, 0), F32)], "'w' has an impossible shape [576, 0] (a dimension of 0)"),
            ([("w", (1, 1, 1, 1, 1), F32)], "(5 dimensions; 1 to 4)"),
            ([("w", (48, 2), Q4_1)], "not whole 32-value blocks of Q4_1"),
            ([("w", (1 << 21, 1 << 20), F32)], "elements)"),
            ([("w", (64, 64), F32)], "it needs 16384 bytes of F32 data"),
        ]
        for tensors, message in cases:
            problem = self.problem(tensors)
            self.assertIsNotNone(problem, message)
            self.assertIn(message, problem)


class GgufProcessTests(TestCase):
    timeout = 300

    async def test_a_gguf_with_a_row_count_of_0_is_refused_with_a_clear_message(self) -> None:
        """The bundled SmolLM2 GGUF with one tensor's row count patched to 0: ``twistd sfnode
        --model`` exits non-zero naming that tensor and its impossible shape, with no
        traceback and no converted folder left behind."""
        from twisted.internet.utils import getProcessOutputAndValue

        from sfnode.engines.weights import loading

        folder = Path(self.mktemp()).resolve()
        folder.mkdir(parents=True)
        bad = folder / "zero-rows.gguf"
        shutil.copyfile(loading.default_gguf(), bad)
        (entry,) = [e for e in read_tensor_table(bad) if e.name == "blk.0.ffn_down.weight"]
        self.assertEqual(entry.shape, (1536, 576))
        with open(bad, "r+b") as file:
            table = file.read(entry.offset)
            name = b"blk.0.ffn_down.weight"
            at = table.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4
            file.seek(at + 8)
            file.write(struct.pack("<Q", 0))
        cache = folder / "cache"
        out, err, code = await getProcessOutputAndValue(
            sys.executable,
            ["-c", TWISTD, "--pidfile=", "-n", "sfnode", "--listen", LOOPBACK, "--model",
             str(bad), "--cache-dir", str(cache), "--device", "cpu"],
            env=child_env(),
            path=str(folder),
        )  # fmt: skip
        text = (out + err).decode(errors="replace")
        self.assertNotEqual(code, 0, text)
        self.assertIn(
            "tensor 'blk.0.ffn_down.weight' has an impossible shape [1536, 0] (a dimension of 0)",
            text,
        )
        self.assertNotIn("Traceback", text)
        self.assertEqual(list(cache.iterdir()) if cache.exists() else [], [])
