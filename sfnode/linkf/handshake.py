"""Admission rules around the handshake (docs/protocol.md sections 5.2 and 5.3, decision D10).

:func:`hello_refusal` is the node's one place that decodes and checks a HELLO: version, then
role, then the token in constant time.

Without a fleet token a link is plaintext and unauthenticated, so it is only allowed where
nobody else can reach it: a loopback interface or a Unix socket.  :func:`plaintext_refusal`
says why a configuration must not start (before any model is loaded); ``--insecure-no-auth``
(``insecure=True``) is the operator's explicit override.  :func:`handshake_slot_refusal` is the
per-listener handshake limit (section 5.3) both sides' factories apply to the counts they keep.

Pure functions over frames and endpoint strings: no network, no files, no reactor.
"""

from __future__ import annotations

import hmac
import ipaddress

from sfnode.linkf.wire import (
    PROTO_VERSION,
    Frame,
    Hello,
    LinkRole,
    WireError,
    decode_frame,
    negotiate,
)

SUPPORTED_VERSIONS = (PROTO_VERSION, PROTO_VERSION)
"""The protocol versions the node speaks: exactly 2."""


def read_hello(frame: Frame, token: bytes) -> Hello | str:
    """The HELLO of this frame when the node accepts it, else why it refuses it (section 5.2).

    The checks run in the order of the specification: the payload decodes, a common version
    exists, the peer is a head daemon, and (when the node has a token) ``auth`` equals it,
    compared in constant time.  A node without a token accepts any ``auth``.  The accepted
    HELLO carries the head's identity (``head_id``, section 12.4) when it sent one.
    """
    try:
        hello = decode_frame(frame)
    except WireError as e:
        return f"malformed HELLO: {e}"
    if not isinstance(hello, Hello):
        return f"expected HELLO, got {type(hello).__name__}"
    if negotiate(hello.proto_versions, SUPPORTED_VERSIONS) is None:
        return f"no common proto version (offered {hello.proto_versions})"
    if hello.link_role != LinkRole.HEAD_DAEMON:
        return f"peer is not a head daemon (role {hello.link_role.name})"
    if token and not hmac.compare_digest(hello.auth, token):
        return "unauthorized: its fleet token differs"
    return hello


def hello_refusal(frame: Frame, token: bytes) -> str | None:
    """Why the node refuses this HELLO frame, or None when it accepts it (:func:`read_hello`)."""
    hello = read_hello(frame, token)
    return hello if isinstance(hello, str) else None


def _split_endpoint(description: str) -> tuple[str, list[str], dict[str, str]]:
    """(type, positional arguments, keyword arguments) of a Twisted endpoint string.

    Follows the endpoint grammar (``:`` separates, ``=`` names, ``\\`` escapes the next character)
    just far enough to find hosts and interfaces; Twisted itself still parses the string.
    """
    segments: list[tuple[str, int]] = []
    current: list[str] = []
    equals = -1
    chars = iter(description)
    for char in chars:
        if char == "\\":
            current.append(next(chars, ""))
        elif char == ":":
            segments.append(("".join(current), equals))
            current, equals = [], -1
        elif char == "=" and equals < 0:
            equals = len(current)
            current.append(char)
        else:
            current.append(char)
    segments.append(("".join(current), equals))
    kind = segments[0][0].lower()
    args: list[str] = []
    kwargs: dict[str, str] = {}
    for text, at in segments[1:]:
        if at >= 0:
            kwargs[text[:at]] = text[at + 1 :]
        else:
            args.append(text)
    return kind, args, kwargs


def _is_loopback_host(host: str) -> bool:
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_loopback_listen(description: str) -> bool:
    """Whether a server endpoint only accepts local peers (loopback interface or Unix socket)."""
    kind, args, kwargs = _split_endpoint(description)
    if kind == "unix":
        return True
    if kind in ("tcp", "tcp6"):
        # Positional order: tcp:PORT:INTERFACE:BACKLOG but tcp6:PORT:BACKLOG:INTERFACE.
        at = 1 if kind == "tcp" else 2
        interface = kwargs.get("interface", args[at] if len(args) > at else "")
        return _is_loopback_host(interface)
    if kind == "ssl":
        return _is_loopback_host(kwargs.get("interface", ""))
    return False


class _NoReactor:
    """Stands in for the reactor while a client endpoint string is parsed: Twisted's endpoint
    constructors only keep it."""


def _dialed_endpoint(description: str) -> object | None:
    """The endpoint Twisted's own ``clientFromString`` builds of ``description`` (the innermost
    one of a ``tls:`` wrapper), or None when Twisted does not parse it."""
    from twisted.internet import endpoints

    try:
        endpoint: object = endpoints.clientFromString(_NoReactor(), description)  # type: ignore[no-untyped-call]
    except Exception:
        return None
    for _ in range(4):
        inner = getattr(endpoint, "_wrappedEndpoint", None)
        if inner is None:
            break
        endpoint = inner
    return endpoint


def dialed_host(description: str) -> str | None:
    """The host a TCP-family client endpoint string makes Twisted dial, read from the endpoint
    Twisted itself builds of the string, so that nothing the string says twice
    (``tcp:10.1.2.3:8454:host=127.0.0.1`` dials 10.1.2.3) can make this answer differ from the
    socket.  None for other kinds (a Unix socket, a plugin's) and for strings Twisted does not
    parse.
    """
    from twisted.internet import endpoints

    endpoint = _dialed_endpoint(description)
    if isinstance(endpoint, endpoints.HostnameEndpoint):
        return str(endpoint._hostText)
    if isinstance(
        endpoint,
        (endpoints.TCP4ClientEndpoint, endpoints.TCP6ClientEndpoint, endpoints.SSL4ClientEndpoint),
    ):
        return str(endpoint._host)
    return None


def is_loopback_head(description: str) -> bool:
    """Whether a client endpoint dials a peer on this machine (a Unix socket, or a loopback
    host as :func:`dialed_host` reads it); an unknown kind is not."""
    from twisted.internet import endpoints

    if isinstance(_dialed_endpoint(description), endpoints.UNIXClientEndpoint):
        return True
    host = dialed_host(description)
    return host is not None and _is_loopback_host(host)


def address_key(address: object) -> str:
    """The part of a peer's address (``IAddress``) that handshake slots are counted by: its
    host (any port), or the kind of socket (every Unix-socket peer shares one)."""
    host = getattr(address, "host", None)
    return str(host) if host is not None else type(address).__name__


def handshake_slot_refusal(
    limits: tuple[int, int], in_progress: int, from_address: int, address: str
) -> str | None:
    """Why one more connection from ``address`` is closed at once (section 5.3), or None.

    ``limits`` are the listener's most handshakes at once and most from one address (0: no
    limit); ``in_progress`` and ``from_address`` are its connections in their handshake, in all
    and from ``address``."""
    most, most_per_address = limits
    if most and in_progress >= most:
        return f"{most} handshakes already in progress"
    if most_per_address and from_address >= most_per_address:
        return f"{most_per_address} handshakes from {address} already in progress"
    return None


def describe_address(address: object) -> str:
    """``host:port`` (``[host]:port`` for IPv6) or the socket path of an address (``IAddress``,
    listening or a peer's) as log lines name it; a Unix socket without a path is "a Unix
    socket"."""
    host = getattr(address, "host", None)
    port = getattr(address, "port", None)
    if host is not None and port is not None:
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    if not hasattr(address, "name"):
        return str(address)
    name = address.name
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    return str(name) if name else "a Unix socket"


def is_loopback_address(address: object) -> bool:
    """Whether a connected peer's address (``IAddress``) is on this machine.

    Loopback IPv4/IPv6 hosts and Unix sockets are; anything else (or an unknown kind) is not.
    """
    host = getattr(address, "host", None)
    if host is not None:
        return _is_loopback_host(str(host))
    return type(address).__name__ == "UNIXAddress"


def plaintext_refusal(
    *,
    token: bytes,
    insecure: bool,
    listen: str | None = None,
    dial: str | None = None,
    dial_what: str = "the head",
) -> str | None:
    """Why this configuration may not start without a token, or None when it may.

    ``listen`` is a server endpoint string, ``dial`` a client endpoint string (``dial_what``
    names its peer in the message).  Every refusal contains "without a fleet token".
    """
    if token or insecure:
        return None
    if listen is not None and not is_loopback_listen(listen):
        return (
            f"refusing to listen on {listen} without a fleet token: give --auth-file, "
            "listen on a loopback interface (interface=127.0.0.1), or pass --insecure-no-auth"
        )
    if dial is not None and not is_loopback_head(dial):
        return (
            f"refusing to dial {dial_what} {dial} without a fleet token: give --auth-file "
            "or pass --insecure-no-auth"
        )
    return None
