"""The head's DNS-SD announcement (sfnode.discovery.announce, docs/protocol.md section 5.6).

:class:`AnnounceService` against a recording announcer (no multicast here; tests/test_multihost.py
announces and browses for real): it announces once the fleet listener is bound, at the bound
port and the machine's reachable addresses, with the head's name and whether a token is
required (never the token); it withdraws on stop, after an announcement still under way; a
failing announcer is logged and never stops the head.  Then ``twistd sfhead``'s options and
service tree: an ``announce`` child exactly when the fleet listener is off loopback and
``--no-announce`` is not given.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twisted.internet import defer
from twisted.internet.address import IPv4Address
from twisted.logger import capturedLogs, formatEvent
from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from sfnode.discovery.announce import AnnounceService
from sfnode.discovery.rules import HeadAnnouncement
from sfnode.head import tap as head_tap


class RecordingAnnouncer:
    """An Announcer that records what it is told; ``pending`` holds announcements the test
    fires by hand (``auto`` fires them at once)."""

    def __init__(self, auto: bool = True, fail: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.auto = auto
        self.fail = fail
        self.pending: list[defer.Deferred[str]] = []

    def announce(
        self, announcement: HeadAnnouncement, port: int, addresses: Sequence[str]
    ) -> defer.Deferred[str]:
        self.calls.append(("announce", announcement, port, tuple(addresses)))
        if self.fail:
            return defer.fail(OSError("no multicast here"))
        d: defer.Deferred[str] = defer.Deferred()
        if self.auto:
            d.callback(f"{announcement.head_name}._superfluid-fleet._tcp.local.")
        else:
            self.pending.append(d)
        return d

    def withdraw(self) -> defer.Deferred[None]:
        self.calls.append(("withdraw",))
        return defer.succeed(None)


class FakePort:
    def __init__(self, host: str, port: int) -> None:
        self._address = IPv4Address("TCP", host, port)

    def getHost(self) -> IPv4Address:
        return self._address


class FakeListener:
    """What AnnounceService reads of the fleet listener: ``bound``."""

    def __init__(self) -> None:
        self.bound: defer.Deferred[Any] = defer.Deferred()


ANNOUNCEMENT = HeadAnnouncement("alpha", token_required=True)
ADDRESSES = ["127.0.0.1", "10.0.0.5", "169.254.3.3"]


class AnnounceServiceTests(SynchronousTestCase):
    def service(self, announcer: RecordingAnnouncer) -> tuple[AnnounceService, FakeListener]:
        listener = FakeListener()
        service = AnnounceService(
            listener,
            ANNOUNCEMENT,
            announcer,
            lambda: list(ADDRESSES),  # type: ignore[arg-type]
        )
        return service, listener

    def test_announces_once_bound_and_withdraws_on_stop(self) -> None:
        """Nothing is announced before the listener is bound; then the bound port at the
        reachable addresses (not loopback, not link-local), logged with the head's name; stop
        withdraws it."""
        announcer = RecordingAnnouncer()
        service, listener = self.service(announcer)
        with capturedLogs() as events:
            service.startService()
            self.assertEqual(announcer.calls, [])
            listener.bound.callback(FakePort("0.0.0.0", 8455))
        self.assertEqual(announcer.calls, [("announce", ANNOUNCEMENT, 8455, ("10.0.0.5",))])
        self.assertEqual(service.instance, "alpha._superfluid-fleet._tcp.local.")
        lines = [formatEvent(e) for e in events]
        self.assertIn(
            "sfhead announcing 'alpha' on _superfluid-fleet._tcp.local. at 10.0.0.5:8455 "
            "(token required)",
            lines,
        )
        self.successResultOf(service.stopService())
        self.assertEqual(announcer.calls[-1], ("withdraw",))

    def test_a_stop_during_the_announcement_withdraws_after_it(self) -> None:
        """A head stopped while its announcement is still being registered withdraws it once
        the registration is done (never leaving it behind), and the stop waits for that."""
        announcer = RecordingAnnouncer(auto=False)
        service, listener = self.service(announcer)
        service.startService()
        listener.bound.callback(FakePort("0.0.0.0", 8455))
        stopped = service.stopService()
        self.assertNoResult(stopped)
        self.assertEqual([c[0] for c in announcer.calls], ["announce"])
        announcer.pending[0].callback("alpha._superfluid-fleet._tcp.local.")
        self.successResultOf(stopped)
        self.assertEqual([c[0] for c in announcer.calls], ["announce", "withdraw"])

    def test_a_failed_announcement_is_logged_and_not_withdrawn(self) -> None:
        """An announcer that fails (no multicast, a busy port) costs a logged error naming the
        way out (join by address), not the head; nothing is withdrawn on stop."""
        announcer = RecordingAnnouncer(fail=True)
        service, listener = self.service(announcer)
        with capturedLogs() as events:
            service.startService()
            listener.bound.callback(FakePort("0.0.0.0", 8455))
        self.assertEqual(len(self.flushLoggedErrors(OSError)), 1)
        lines = [formatEvent(e) for e in events]
        self.assertTrue([line for line in lines if "cannot announce itself" in line], lines)
        self.assertTrue([line for line in lines if "join it by address" in line], lines)
        self.successResultOf(service.stopService())
        self.assertEqual([c[0] for c in announcer.calls], ["announce"])

    def test_nothing_reachable_means_no_announcement(self) -> None:
        """A listener bound to loopback has nothing to announce: a warning, no record."""
        announcer = RecordingAnnouncer()
        service, listener = self.service(announcer)
        with capturedLogs() as events:
            service.startService()
            listener.bound.callback(FakePort("127.0.0.1", 8455))
        self.assertEqual(announcer.calls, [])
        self.assertTrue([e for e in events if "not announcing" in formatEvent(e)])
        self.successResultOf(service.stopService())
        self.assertEqual(announcer.calls, [])


class HeadOptionsTests(SynchronousTestCase):
    def folder(self) -> str:
        from tests.tinymodel import tiny_tokenizer

        folder = str(Path(self.mktemp()))
        tiny_tokenizer().save_pretrained(folder)
        return folder

    def token(self) -> str:
        path = Path(self.mktemp())
        path.write_text("s" * 64 + "\n")
        return str(path)

    def parse(self, *argv: str) -> head_tap.Options:
        options = head_tap.Options()
        options.parseOptions(list(argv))
        return options

    def test_head_name_defaults_to_the_host_name(self) -> None:
        """--head-name defaults to this host's name; an empty or too long one is refused."""
        self.assertEqual(self.parse()["head-name"], socket.gethostname()[:63])
        self.assertEqual(self.parse("--head-name", "rack-1")["head-name"], "rack-1")
        for bad, why in (("", "empty"), ("x" * 64, "longer than 63 bytes")):
            with self.assertRaises(usage.UsageError) as caught:
                self.parse("--head-name", bad)
            self.assertIn(why, str(caught.exception))

    def children(self, *argv: str) -> tuple[list[str], RecordingAnnouncer]:
        announcer = RecordingAnnouncer()
        options = self.parse("--model", self.folder(), "--http", "tcp:0:interface=127.0.0.1",
                             *argv)  # fmt: skip
        head = head_tap.makeService(options, announcer=announcer)
        return [child.name for child in head], announcer

    def test_announce_only_off_loopback_and_unless_told_not_to(self) -> None:
        """The service tree has an ``announce`` child only for a fleet listener off loopback
        without --no-announce; its announcement names the head and says a token is required,
        and carries nothing of the token."""
        names, _ = self.children("--fleet-listen", "tcp:0:interface=127.0.0.1")
        self.assertNotIn("announce", names)
        token = self.token()
        names, _ = self.children("--fleet-listen", "tcp:0", "--auth-file", token, "--no-announce")
        self.assertNotIn("announce", names)
        announcer = RecordingAnnouncer()
        options = self.parse("--model", self.folder(), "--http", "tcp:0:interface=127.0.0.1",
                             "--fleet-listen", "tcp:0", "--auth-file", token,
                             "--head-name", "rack-1")  # fmt: skip
        head = head_tap.makeService(options, announcer=announcer)
        names = [child.name for child in head]
        self.assertEqual(names, ["fleet", "fleet-listen", "http", "announce"])
        announce = head.getServiceNamed("announce")  # type: ignore[no-untyped-call]
        self.assertEqual(announce.announcement, HeadAnnouncement("rack-1", token_required=True))
        self.assertIs(announce.announcer, announcer)
        txt = announce.announcement.txt()
        self.assertNotIn("s" * 64, " ".join(txt.values()))
