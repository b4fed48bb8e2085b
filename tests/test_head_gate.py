"""The pure parts of the head's front door (sfnode.head.api.gate): the Host check, what a path is
(canonical segments and the resolved route), and the per-client and per-key limits."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource

from sfnode.head.api.gate import (
    ConcurrencyLimits,
    Route,
    canonical_segments,
    host_allowed,
    resolve,
)
from sfnode.runtime.http_guard import HttpError


class HostTests(SynchronousTestCase):
    def test_ip_literals_and_localhost_are_always_allowed(self) -> None:
        """IPv4 and IPv6 literals (with or without a port), localhost in any case and with a
        trailing dot, and a request without Host are answered with no names configured."""
        for host in (
            b"127.0.0.1", b"127.0.0.1:8453", b"10.1.2.3", b"[::1]", b"[::1]:8453",
            b"[fe80::1]:80", b"localhost", b"LocalHost:8453", b"localhost.", None,
        ):  # fmt: skip
            self.assertTrue(host_allowed(host, ()), host)

    def test_names_need_to_be_listed(self) -> None:
        """A DNS name is answered only when listed (case and trailing dot ignored) or when *
        is; lookalikes of allowed names and of IP addresses are not; non-ASCII is refused."""
        allowed = ("head.example",)
        for host in (b"head.example", b"HEAD.example:8453", b"head.example."):
            self.assertTrue(host_allowed(host, allowed), host)
        for host in (
            b"evil.example", b"head.example.evil.example", b"127.0.0.1.nip.io", b"localhost.evil",
            b"h\xc3\xa9ad.example", b"[::1", b"",
        ):  # fmt: skip
            self.assertFalse(host_allowed(host, allowed), host)
        self.assertTrue(host_allowed(b"anything.example", ("*",)))


class LimitTests(SynchronousTestCase):
    def test_per_client_and_per_key_counts(self) -> None:
        """A client address gets per_client permits at once, a key per_key (across
        addresses); one more is a 429 rate_limit_exceeded with Retry-After; a release
        (once, however often it is called) makes room again; 0 means no limit."""
        limits = ConcurrencyLimits(per_client=2, per_key=3)
        a1 = limits.acquire("a", b"k")
        limits.acquire("a", b"k")
        with self.assertRaises(HttpError) as raised:
            limits.acquire("a", b"other")
        self.assertEqual(
            (raised.exception.status, raised.exception.code), (429, "rate_limit_exceeded")
        )
        self.assertEqual(raised.exception.headers, {b"retry-after": b"1"})
        limits.acquire("b", b"k")
        self.assertRaises(HttpError, limits.acquire, "c", b"k")
        limits.acquire("c", None)
        a1.release()
        a1.release()
        self.assertEqual((limits.clients["a"], limits.keys[b"k"]), (1, 2))
        limits.acquire("a", b"k")
        unlimited = ConcurrencyLimits(per_client=0, per_key=0)
        for _ in range(1000):
            unlimited.acquire("a", b"k")

    def test_released_entries_are_forgotten(self) -> None:
        """Counters of addresses and keys with nothing open are dropped (a scan of many
        addresses leaves nothing behind)."""
        limits = ConcurrencyLimits(per_client=1, per_key=1)
        for i in range(100):
            limits.acquire(f"10.0.0.{i}", f"k{i}".encode()).release()
        self.assertEqual((dict(limits.clients), dict(limits.keys)), ({}, {}))


class _Node(Resource):
    def __init__(self, route: Route, leaf: bool = False) -> None:
        super().__init__()
        self.route = route
        self.isLeaf = leaf


class PathTests(SynchronousTestCase):
    def test_canonical_segments_are_what_twisted_web_routes_by(self) -> None:
        """A canonical path gives its percent-decoded segments (as twisted.web decodes them);
        no leading slash, an empty, ``.`` or ``..`` segment (encoded or not) and an encoded
        slash are not canonical."""
        self.assertEqual(
            canonical_segments(b"/v1/chat/completions"), [b"v1", b"chat", b"completions"]
        )
        self.assertEqual(canonical_segments(b"/v%31/%63hat"), [b"v1", b"chat"])
        for path in (
            b"v1/chat", b"X/v1", b"*", b"/", b"//v1", b"/v1/", b"/v1//chat", b"/./v1", b"/v1/.",
            b"/v1/..", b"/v1/%2e", b"/v1/%2E%2e", b"/v1%2fchat", b"http://h/v1", b"",
        ):  # fmt: skip
            self.assertIsNone(canonical_segments(path), path)

    def test_resolve_walks_the_tree_and_keeps_what_it_found(self) -> None:
        """resolve finds the resource twisted.web would, is keyed when a resource on the way
        is, hands a suffix to a route that takes one, and resolves unknown paths, suffixes on
        routes that take none and non-canonical paths to the not-found resource."""
        root = _Node(Route())
        v1 = _Node(Route(keyed=True))
        leaf = _Node(Route(methods=(b"POST",), completion=True), leaf=True)
        models = _Node(Route(methods=(b"GET",), suffix=True), leaf=True)
        health = _Node(Route(methods=(b"GET",)), leaf=True)
        root.putChild(b"v1", v1)
        root.putChild(b"healthz", health)
        v1.putChild(b"completions", leaf)
        v1.putChild(b"models", models)
        missing = Resource()
        found = resolve(root, b"/v%31/completions", None, missing)
        self.assertEqual((found.resource, found.keyed, found.canonical), (leaf, True, True))
        self.assertEqual((found.prepath, found.postpath), ((b"v1", b"completions"), ()))
        found = resolve(root, b"/v1/models/org/name", None, missing)
        self.assertEqual((found.resource, found.postpath), (models, (b"org", b"name")))
        self.assertFalse(resolve(root, b"/healthz", None, missing).keyed)
        for path, keyed, canonical in (
            (b"/v1/completions/x", True, True), (b"/v1/nothing", True, True),
            (b"/healthz/x", False, True), (b"/v1", True, True),
            (b"/v1/completions/%2e", False, False), (b"Xv1/completions", False, False),
        ):  # fmt: skip
            found = resolve(root, path, None, missing)
            self.assertIs(found.resource, missing, path)
            self.assertFalse(found.found, path)
            self.assertEqual((found.keyed, found.canonical), (keyed, canonical), path)


class GenerationCountTests(SynchronousTestCase):
    def test_n_choices_count_n(self) -> None:
        """A permit widened by n - 1 counts n generations; widening past a limit is a 429 and
        takes nothing; a request larger than a limit alone is a 400 naming n; the release
        gives all of them back."""
        limits = ConcurrencyLimits(per_client=8, per_key=6)
        first = limits.acquire("a", b"k")
        first.widen(4)
        self.assertEqual((limits.clients["a"], limits.keys[b"k"]), (5, 5))
        second = limits.acquire("a", None)
        with self.assertRaises(HttpError) as raised:
            second.widen(3)
        self.assertEqual(
            (raised.exception.status, raised.exception.code), (429, "rate_limit_exceeded")
        )
        self.assertEqual(limits.clients["a"], 6)
        with self.assertRaises(HttpError) as raised:
            limits.acquire("b", None).widen(8)
        self.assertEqual((raised.exception.status, raised.exception.param), (400, "n"))
        with self.assertRaises(HttpError) as raised:
            limits.acquire("c", b"k2").widen(6)
        self.assertEqual((raised.exception.status, raised.exception.param), (400, "n"))
        first.release()
        second.release()
        self.assertEqual(limits.clients["a"], 0)
        self.assertNotIn(b"k", limits.keys)
