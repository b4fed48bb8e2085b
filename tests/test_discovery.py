"""The pure rules of finding a head (sfnode.discovery.rules, docs/protocol.md section 5.6).

The TXT record a head announces (and that it never holds the token), which head a node joins
among those that answer a browse (one, or the one ``--head-name`` names; several is an error
naming them), when a node browses again, what ``--join`` accepts, and which addresses a head
announces.  No network, no reactor.
"""

from __future__ import annotations

from twisted.trial.unittest import SynchronousTestCase

from sfnode.discovery.rules import (
    DEFAULT_FLEET_PORT,
    REBROWSE_AFTER_FAILURES,
    SERVICE_TYPE,
    AnnouncementError,
    HeadAnnouncement,
    HeadAnswer,
    HeadFinder,
    JoinTarget,
    NoHeadFound,
    SeveralHeads,
    announced_addresses,
    choose_head,
    parse_join,
)
from sfnode.linkf.wire import PROTO_VERSION


def answer(name: str, *addresses: str, port: int = 8455, proto: int = PROTO_VERSION) -> HeadAnswer:
    announcement = HeadAnnouncement(name, token_required=True, proto_version=proto)
    return HeadAnswer(f"{name}.{SERVICE_TYPE}", addresses or ("10.0.0.1",), port, announcement)


def wire_txt(announcement: HeadAnnouncement) -> dict[bytes, bytes | None]:
    """The TXT record as zeroconf hands it to a browser: bytes keys and values."""
    return {k.encode(): v.encode() for k, v in announcement.txt().items()}


class AnnouncementTests(SynchronousTestCase):
    def test_txt_round_trip(self) -> None:
        """A head's announcement survives the TXT record: name, protocol version, and whether a
        token is required, both ways."""
        for required in (True, False):
            sent = HeadAnnouncement("rack-1 head", token_required=required)
            self.assertEqual(HeadAnnouncement.from_txt(wire_txt(sent)), sent)

    def test_txt_holds_no_token(self) -> None:
        """The record has exactly txtvers, proto, head and auth, and auth says only "token" or
        "none": there is no field a token could travel in."""
        txt = HeadAnnouncement("h", token_required=True).txt()
        self.assertEqual(sorted(txt), ["auth", "head", "proto", "txtvers"])
        self.assertEqual(txt["auth"], "token")
        self.assertEqual(txt["proto"], str(PROTO_VERSION))
        self.assertEqual(HeadAnnouncement("h", token_required=False).txt()["auth"], "none")

    def test_malformed_records_are_refused_with_the_reason(self) -> None:
        """A record that is not a head's (missing keys, another txtvers, a non-number proto, an
        unknown auth, an empty name, bytes that are not text) raises AnnouncementError saying
        what is wrong."""
        good = wire_txt(HeadAnnouncement("h", token_required=True))
        cases = {
            "lacks head": {k: v for k, v in good.items() if k != b"head"},
            "txtvers": {**good, b"txtvers": b"2"},
            "is not a number": {**good, b"proto": b"two"},
            "neither token nor none": {**good, b"auth": b"maybe"},
            "it is empty": {**good, b"head": b""},
            "not text": {**good, b"head": b"\xff\xfe"},
        }
        for fragment, txt in cases.items():
            with self.assertRaises(AnnouncementError) as caught:
                HeadAnnouncement.from_txt(txt)
            self.assertIn(fragment, str(caught.exception))

    def test_keys_are_case_insensitive_and_extra_keys_ignored(self) -> None:
        """DNS-SD keys compare without case (RFC 6763 section 6.4); unknown keys are room for
        later versions."""
        txt = {k.upper(): v for k, v in wire_txt(HeadAnnouncement("h", False)).items()}
        txt[b"future"] = b"1"
        self.assertEqual(HeadAnnouncement.from_txt(txt), HeadAnnouncement("h", False))


class ChooseTests(SynchronousTestCase):
    def test_one_head_is_joined(self) -> None:
        """The only head that answers is the one joined, with or without --head-name."""
        only = answer("alpha")
        self.assertIs(choose_head([only], None), only)
        self.assertIs(choose_head([only], "alpha"), only)

    def test_no_head_is_an_error_saying_so(self) -> None:
        """No answer: NoHeadFound naming the service type."""
        with self.assertRaises(NoHeadFound) as caught:
            choose_head([], None)
        self.assertIn(SERVICE_TYPE, str(caught.exception))

    def test_several_heads_are_an_error_that_names_them(self) -> None:
        """Two heads and no --head-name: SeveralHeads naming each head and its address, and
        saying how to pick one."""
        with self.assertRaises(SeveralHeads) as caught:
            choose_head([answer("beta", "10.0.0.2"), answer("alpha", "10.0.0.1")], None)
        message = str(caught.exception)
        self.assertIn("2 heads answer", message)
        self.assertIn("'alpha' at 10.0.0.1:8455", message)
        self.assertIn("'beta' at 10.0.0.2:8455", message)
        self.assertIn("--head-name", message)

    def test_head_name_picks_one_of_several(self) -> None:
        """--head-name picks its head among several."""
        alpha, beta = answer("alpha", "10.0.0.1"), answer("beta", "10.0.0.2")
        self.assertIs(choose_head([alpha, beta], "beta"), beta)

    def test_a_missing_head_name_names_what_answered(self) -> None:
        """--head-name naming no head that answered: NoHeadFound listing the heads found."""
        with self.assertRaises(NoHeadFound) as caught:
            choose_head([answer("alpha")], "gamma")
        self.assertIn("no head named 'gamma'", str(caught.exception))
        self.assertIn("'alpha' at 10.0.0.1:8455", str(caught.exception))

    def test_two_heads_of_one_name_are_an_error(self) -> None:
        """Two heads announcing the same name cannot be told apart: SeveralHeads."""
        with self.assertRaises(SeveralHeads) as caught:
            choose_head([answer("alpha", "10.0.0.1"), answer("alpha", "10.0.0.2")], "alpha")
        self.assertIn("2 heads named 'alpha'", str(caught.exception))

    def test_other_protocol_versions_and_addressless_heads_are_left_out(self) -> None:
        """A head of another protocol version, or one without an address, is not joined, and
        does not make the choice ambiguous."""
        ours = answer("alpha")
        other = answer("old", proto=PROTO_VERSION + 1)
        nowhere = HeadAnswer("x", (), 8455, HeadAnnouncement("x", True))
        self.assertIs(choose_head([other, ours, nowhere], None), ours)
        with self.assertRaises(NoHeadFound) as caught:
            choose_head([other], None)
        self.assertIn("another protocol version", str(caught.exception))


class FinderTests(SynchronousTestCase):
    def test_browse_then_dial_then_browse_again_after_failures(self) -> None:
        """The node dials the head a browse chose; after REBROWSE_AFTER_FAILURES failed dials
        in a row it browses again; a dial that connects resets the count."""
        finder = HeadFinder()
        self.assertTrue(finder.needs_browse())
        finder.browsed([answer("alpha", "10.0.0.1")])
        self.assertFalse(finder.needs_browse())
        self.assertEqual(finder.address(), ("10.0.0.1", 8455))
        for _ in range(REBROWSE_AFTER_FAILURES - 1):
            self.assertFalse(finder.dial_failed())
        finder.connected()
        for _ in range(REBROWSE_AFTER_FAILURES - 1):
            self.assertFalse(finder.dial_failed())
        self.assertFalse(finder.needs_browse())
        self.assertTrue(finder.dial_failed())
        self.assertTrue(finder.needs_browse())

    def test_addresses_are_tried_in_turn(self) -> None:
        """A head announcing several addresses is dialled at each in turn."""
        finder = HeadFinder(rebrowse_after=10)
        finder.browsed([answer("alpha", "10.0.0.1", "192.168.5.1")])
        tried = []
        for _ in range(3):
            tried.append(finder.address()[0])
            finder.dial_failed()
        self.assertEqual(tried, ["10.0.0.1", "192.168.5.1", "10.0.0.1"])

    def test_a_browse_that_finds_nothing_falls_back_to_the_last_head(self) -> None:
        """A head restarted at the same place is dialled again even before it announces: an
        empty browse keeps the last head for one dial; with no head ever found it is
        NoHeadFound."""
        finder = HeadFinder()
        with self.assertRaises(NoHeadFound):
            finder.browsed([])
        finder.browsed([answer("alpha", "10.0.0.1")])
        for _ in range(REBROWSE_AFTER_FAILURES):
            finder.dial_failed()
        self.assertTrue(finder.needs_browse())
        self.assertEqual(finder.browsed([]).head_name, "alpha")
        self.assertEqual(finder.address(), ("10.0.0.1", 8455))
        # That last head gets one dial: failing it sends the node back to browsing.
        self.assertTrue(finder.dial_failed())
        self.assertTrue(finder.needs_browse())

    def test_a_moved_head_is_dialled_where_it_is_now(self) -> None:
        """After the head stayed away, a browse that finds it at a new address and port dials
        there."""
        finder = HeadFinder(rebrowse_after=1)
        finder.browsed([answer("alpha", "10.0.0.1")])
        finder.dial_failed()
        finder.browsed([answer("alpha", "10.0.0.9", port=9000)])
        self.assertEqual(finder.address(), ("10.0.0.9", 9000))

    def test_ambiguity_is_not_resolved_by_the_last_head(self) -> None:
        """Several heads answering stays an error even for a node that knew one of them."""
        finder = HeadFinder(rebrowse_after=1)
        finder.browsed([answer("alpha", "10.0.0.1")])
        finder.dial_failed()
        with self.assertRaises(SeveralHeads):
            finder.browsed([answer("alpha", "10.0.0.1"), answer("beta", "10.0.0.2")])
        self.assertTrue(finder.needs_browse())


class ParseJoinTests(SynchronousTestCase):
    def test_forms(self) -> None:
        """auto, HOST, HOST:PORT, [v6], [v6]:PORT and a bare IPv6 literal; the port defaults
        to the head's fleet port."""
        self.assertIsNone(parse_join("auto"))
        self.assertIsNone(parse_join(" AUTO "))
        cases = {
            "head.example": JoinTarget("head.example", DEFAULT_FLEET_PORT),
            "head.example:9000": JoinTarget("head.example", 9000),
            "10.1.2.3:8455": JoinTarget("10.1.2.3", 8455),
            "[fd00::1]": JoinTarget("fd00::1", DEFAULT_FLEET_PORT),
            "[fd00::1]:9000": JoinTarget("fd00::1", 9000),
            "fd00::1": JoinTarget("fd00::1", DEFAULT_FLEET_PORT),
        }
        for text, target in cases.items():
            self.assertEqual(parse_join(text), target, text)
        self.assertEqual(str(JoinTarget("fd00::1", 1)), "[fd00::1]:1")

    def test_bad_values_say_what_is_expected(self) -> None:
        """Empty, a bad port, a URL, unbalanced brackets: ValueError naming the forms."""
        for text in ("", "head:0", "head:70000", "head:http", "http://head:8455",
                     "[fd00::1", "[head]:1", "fd00::zz", "a b:1"):  # fmt: skip
            with self.assertRaises(ValueError) as caught:
                parse_join(text)
            self.assertIn("expected auto, HOST or HOST:PORT", str(caught.exception), text)

    def test_endpoint_string_escapes_ipv6(self) -> None:
        """The endpoint string for the loopback rules escapes the colons of an IPv6 host."""
        self.assertEqual(JoinTarget("::1", 8455).endpoint_string(), "tcp:host=\\:\\:1:port=8455")
        self.assertEqual(JoinTarget("h", 1).endpoint_string(), "tcp:host=h:port=1")


class AnnouncedAddressTests(SynchronousTestCase):
    def test_every_interface_announces_the_reachable_addresses(self) -> None:
        """A listener on every interface announces each IPv4 address other machines can
        reach: not loopback, not link-local, no duplicates, no IPv6 (section 5.6)."""
        mine = ["127.0.0.1", "10.0.0.5", "169.254.1.1", "fe80::1", "192.168.1.7", "10.0.0.5"]
        for interface in (None, "0.0.0.0", "::"):
            self.assertEqual(announced_addresses(interface, mine), ("10.0.0.5", "192.168.1.7"))

    def test_one_interface_announces_itself_or_nothing(self) -> None:
        """A listener bound to one address announces that address; one bound to loopback
        announces nothing."""
        self.assertEqual(announced_addresses("10.0.0.5", ["10.0.0.6"]), ("10.0.0.5",))
        self.assertEqual(announced_addresses("127.0.0.1", ["10.0.0.5"]), ())
        self.assertEqual(announced_addresses(None, ["127.0.0.1"]), ())
