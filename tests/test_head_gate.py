"""The pure parts of the head's front door (sfnode.head.gate): the Host check and the
per-client and per-key request limits."""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.gate import ConcurrencyLimits, host_allowed
from sfnode.head.schema import ApiError


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
        with self.assertRaises(ApiError) as raised:
            limits.acquire("a", b"other")
        self.assertEqual(
            (raised.exception.status, raised.exception.code), (429, "rate_limit_exceeded")
        )
        self.assertEqual(raised.exception.headers, {b"retry-after": b"1"})
        limits.acquire("b", b"k")
        self.assertRaises(ApiError, limits.acquire, "c", b"k")
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
