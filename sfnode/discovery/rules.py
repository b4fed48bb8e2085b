"""Finding a head on the local network (docs/protocol.md section 5.6): the pure rules.

A head whose fleet listener is off loopback announces itself by DNS-SD as an instance of
``_superfluid-fleet._tcp``; a node started with ``--join auto`` browses for it and dials what it
finds.  This module holds everything about that which needs no network:

- :class:`HeadAnnouncement`: the TXT record (``txtvers``, ``proto``, ``head``, ``auth``), encoded
  and decoded with its checks.  It never carries the fleet token, only whether one is required.
- :class:`HeadAnswer` and :func:`choose_head`: which of the heads that answered a browse the node
  joins (one answering, or the one ``--head-name`` names; several is an error naming them).
- :class:`HeadFinder`: the node's memory between dials: the head it found, the address it tries
  next, and when its head has stayed unreachable long enough to browse again.
- :func:`parse_join`: what ``--join`` says (``auto`` or ``HOST[:PORT]``).
- :func:`announced_addresses`: which addresses a head announces for its ``--fleet-listen``.

No sockets, no reactor, no clock, no zeroconf here: :mod:`sfnode.discovery.dnssd` is the one module
that talks multicast DNS.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sfnode.linkf.wire import PROTO_VERSION

SERVICE_TYPE = "_superfluid-fleet._tcp.local."
"""The DNS-SD service type of a head's fleet listener (section 5.6)."""
TXT_VERSION = "1"
"""``txtvers`` of the TXT record this module writes and reads."""
DEFAULT_FLEET_PORT = 8455
"""The port of a head's fleet listener when ``--join HOST`` gives none (sfhead's default)."""
AUTO = "auto"
"""``--join auto``: find the head by DNS-SD."""
MAX_HEAD_NAME = 63
"""A DNS-SD instance name is one DNS label: at most 63 bytes of UTF-8."""
REBROWSE_AFTER_FAILURES = 3
"""Failed dials in a row to the head a browse found after which the node browses again."""

AUTH_TOKEN = "token"
AUTH_NONE = "none"


class AnnouncementError(ValueError):
    """A TXT record that is not a head's announcement (or not one this node can read)."""


class NoHeadFound(Exception):
    """A browse found no head this node can join."""


class SeveralHeads(Exception):
    """Several heads answered and nothing says which one to join; the message names them."""


def valid_head_name(name: str) -> str | None:
    """Why ``name`` cannot be a head's name (an instance label), or None when it can."""
    if not name:
        return "it is empty"
    if len(name.encode("utf-8")) > MAX_HEAD_NAME:
        return f"it is longer than {MAX_HEAD_NAME} bytes"
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        return "it contains control characters"
    return None


@dataclass(frozen=True, slots=True)
class HeadAnnouncement:
    """What a head says of itself in its TXT record (section 5.6)."""

    head_name: str
    token_required: bool
    proto_version: int = PROTO_VERSION

    def txt(self) -> dict[str, str]:
        """The TXT record's keys and values.  Never the token: only whether one is needed."""
        return {
            "txtvers": TXT_VERSION,
            "proto": str(self.proto_version),
            "head": self.head_name,
            "auth": AUTH_TOKEN if self.token_required else AUTH_NONE,
        }

    @classmethod
    def from_txt(cls, properties: Mapping[bytes, bytes | None]) -> HeadAnnouncement:
        """The announcement in a TXT record as zeroconf hands it over (bytes keys and values).

        :raises AnnouncementError: a key is missing or malformed, or ``txtvers`` is not one
            this node reads.
        """
        fields: dict[str, str] = {}
        for key, value in properties.items():
            try:
                name = key.decode("ascii").lower()
                fields[name] = (value or b"").decode("utf-8")
            except UnicodeDecodeError:
                raise AnnouncementError(f"TXT key or value is not text: {key!r}") from None
        version = fields.get("txtvers")
        if version != TXT_VERSION:
            raise AnnouncementError(f"txtvers {version!r} (this node reads {TXT_VERSION})")
        missing = [k for k in ("proto", "head", "auth") if k not in fields]
        if missing:
            raise AnnouncementError(f"TXT record lacks {', '.join(missing)}")
        try:
            proto = int(fields["proto"], 10)
        except ValueError:
            raise AnnouncementError(f"proto {fields['proto']!r} is not a number") from None
        name = fields["head"]
        why = valid_head_name(name)
        if why is not None:
            raise AnnouncementError(f"head name {name!r}: {why}")
        auth = fields["auth"]
        if auth not in (AUTH_TOKEN, AUTH_NONE):
            raise AnnouncementError(f"auth {auth!r} is neither {AUTH_TOKEN} nor {AUTH_NONE}")
        return cls(head_name=name, token_required=auth == AUTH_TOKEN, proto_version=proto)


@dataclass(frozen=True, slots=True)
class HeadAnswer:
    """One head that answered a browse: its instance, where it listens, what it announced."""

    instance: str
    addresses: tuple[str, ...]
    port: int
    announcement: HeadAnnouncement

    @property
    def head_name(self) -> str:
        return self.announcement.head_name

    def where(self) -> str:
        """``host:port`` of its first address (``[v6]:port`` for IPv6), for log lines."""
        return join_address(self.addresses[0], self.port) if self.addresses else "(no address)"

    def describe(self) -> str:
        """``'name' at host:port``, as log lines and errors name a head."""
        return f"{self.head_name!r} at {self.where()}"


def join_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 literal."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def choose_head(answers: Iterable[HeadAnswer], head_name: str | None) -> HeadAnswer:
    """The head to join among ``answers``.

    Heads that speak another protocol version, or announced no address, are left out.  With
    ``head_name`` the one head of that name is chosen; without it, the only head that answered.

    :raises NoHeadFound: no head fits (the message says what answered, if anything).
    :raises SeveralHeads: several fit; the message names each and says how to pick one.
    """
    answers = list(answers)
    usable = sorted(
        (a for a in answers if a.announcement.proto_version == PROTO_VERSION and a.addresses),
        key=lambda a: (a.head_name, a.instance),
    )
    others = [a for a in answers if a not in usable]
    if head_name is not None:
        named = [a for a in usable if a.head_name == head_name]
        if len(named) == 1:
            return named[0]
        if not named:
            found = ", ".join(a.describe() for a in usable) or "none"
            raise NoHeadFound(
                f"no head named {head_name!r} answers on {SERVICE_TYPE} (heads found: {found})"
            )
        usable = named
    if len(usable) == 1:
        return usable[0]
    if not usable:
        ignored = ""
        if others:
            ignored = " (ignored, speaking another protocol version or with no address: " + (
                ", ".join(f"{a.head_name!r} proto {a.announcement.proto_version}" for a in others)
                + ")"
            )
        raise NoHeadFound(f"no head answers on {SERVICE_TYPE}{ignored}")
    names = ", ".join(a.describe() for a in usable)
    if head_name is not None:
        raise SeveralHeads(
            f"{len(usable)} heads named {head_name!r} answer on {SERVICE_TYPE}: {names}; give "
            "those heads different --head-name values, or join one by address (--join HOST:PORT)"
        )
    raise SeveralHeads(
        f"{len(usable)} heads answer on {SERVICE_TYPE}: {names}; pick one with --head-name "
        "NAME (or join one by address with --join HOST:PORT)"
    )


@dataclass(slots=True)
class HeadFinder:
    """What a ``--join auto`` node remembers between dials (section 5.6).

    The node dials the head its last browse chose, trying its announced addresses in turn; after
    :data:`REBROWSE_AFTER_FAILURES` failed dials in a row the head is taken for gone and the next
    attempt browses again.  A browse that finds nothing still lets the node try the last head it
    knew, once (a head restarted at the same address needs no announcement to be found again);
    if that dial fails too, the next attempt browses again.
    """

    head_name: str | None = None
    rebrowse_after: int = REBROWSE_AFTER_FAILURES
    head: HeadAnswer | None = None
    """The head being dialled, until it stays unreachable."""
    last: HeadAnswer | None = None
    """The last head this node joined or chose: the fallback when a browse finds none."""
    failures: int = 0
    _next: int = field(default=0, repr=False)

    def needs_browse(self) -> bool:
        """Whether the next attempt must browse first (no head, or the head stayed away)."""
        return self.head is None

    def browsed(self, answers: Sequence[HeadAnswer]) -> HeadAnswer:
        """Take the result of a browse: the head chosen, now the one dialled.

        With no head found, the last head known is dialled once more if there is one (a single
        failure then sends the node back to browsing).

        :raises NoHeadFound: nothing fits and no head was known before.
        :raises SeveralHeads: as :func:`choose_head` (the last head is not dialled then).
        """
        failures = 0
        try:
            chosen = choose_head(answers, self.head_name)
        except NoHeadFound:
            if self.last is None:
                raise
            chosen = self.last
            failures = self.rebrowse_after - 1
        if chosen != self.head:
            self._next = 0
        self.head = self.last = chosen
        self.failures = failures
        return chosen

    def address(self) -> tuple[str, int]:
        """The (host, port) to dial now: the head's addresses in turn, one per attempt."""
        if self.head is None:
            raise RuntimeError("no head to dial: browse first")
        addresses = self.head.addresses
        return addresses[self._next % len(addresses)], self.head.port

    def dial_failed(self) -> bool:
        """Count a failed dial (or a refused handshake); True when the head is now forgotten
        and the next attempt browses again."""
        if self.head is None:
            return False
        self.failures += 1
        self._next += 1
        if self.failures >= self.rebrowse_after:
            self.head = None
            self.failures = 0
            return True
        return False

    def connected(self) -> None:
        """A dial reached the head: failures start again from 0, the same address is kept."""
        self.failures = 0
        if self.head is not None:
            self._next %= len(self.head.addresses)


@dataclass(frozen=True, slots=True)
class JoinTarget:
    """``--join HOST[:PORT]``: a head by address."""

    host: str
    port: int

    def __str__(self) -> str:
        return join_address(self.host, self.port)

    def endpoint_string(self) -> str:
        """The same head as a Twisted client endpoint string (for the loopback rules)."""
        host = self.host.replace("\\", "\\\\").replace(":", "\\:")
        return f"tcp:host={host}:port={self.port}"


def parse_join(value: str) -> JoinTarget | None:
    """What ``--join`` says: None for ``auto``, else the head's host and port.

    ``HOST``, ``HOST:PORT``, ``[IPv6]``, ``[IPv6]:PORT`` and a bare IPv6 literal are accepted;
    the port defaults to :data:`DEFAULT_FLEET_PORT`.

    :raises ValueError: the value is none of these (the message says what is expected).
    """
    text = value.strip()
    expected = "expected auto, HOST or HOST:PORT (for example head.example:8455 or [fd00::1]:8455)"
    if text.lower() == AUTO:
        return None
    if not text:
        raise ValueError(f"an empty value: {expected}")
    port_text: str | None = None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"{value!r}: {expected}")
        port_text = rest[1:] if rest else None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host!r} in brackets is not an IPv6 address: {expected}") from None
    elif text.count(":") > 1:
        host = text
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{value!r}: {expected}") from None
    else:
        host, colon, port_text = text.partition(":")
        if not colon:
            port_text = None
    if not host or any(c.isspace() or c in "/@" for c in host):
        raise ValueError(f"{value!r}: {expected}")
    port = DEFAULT_FLEET_PORT
    if port_text is not None:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"port {port_text!r} is not a TCP port (1-65535): {expected}")
        port = int(port_text)
    return JoinTarget(host, port)


def announced_addresses(
    interface: str | None, interface_addresses: Iterable[str]
) -> tuple[str, ...]:
    """The addresses a head announces for a fleet listener bound to ``interface``.

    ``interface`` is the bound host (``0.0.0.0``, ``::`` or None for every interface);
    ``interface_addresses`` are this machine's addresses.  Loopback and link-local addresses are
    never announced (a node elsewhere cannot dial them); an empty result means nothing to
    announce.  IPv4 only, as the browse (section 5.6).
    """

    def reachable(text: str) -> bool:
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            return False
        return (
            address.version == 4
            and not address.is_loopback
            and not address.is_link_local
            and not address.is_unspecified
            and not address.is_multicast
        )

    if interface not in (None, "", "0.0.0.0", "::"):
        return (interface,) if reachable(interface) else ()
    seen: list[str] = []
    for text in interface_addresses:
        if reachable(text) and text not in seen:
            seen.append(text)
    return tuple(seen)
