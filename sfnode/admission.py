"""Admission rules around the handshake (docs/protocol.md sections 5.2 and 5.3, decision D10).

:func:`hello_refusal` is the node's one place that decodes and checks a HELLO: version, then
role, then the token in constant time.

Without a fleet token a link is plaintext and unauthenticated, so it is only allowed where
nobody else can reach it: a loopback interface or a Unix socket.  :func:`plaintext_refusal`
says why a configuration must not start (before any model is loaded); ``--insecure-no-auth``
(``insecure=True``) is the operator's explicit override.  The per-listener handshake limit
lives with the factories (``sfnode.protocol.NodeFactory``).

Pure functions over frames and endpoint strings: no network, no files, no reactor.
"""

from __future__ import annotations

import hmac
import ipaddress

from sfnode.wire import PROTO_VERSION, Frame, Hello, LinkRole, WireError, decode_frame, negotiate

SUPPORTED_VERSIONS = (PROTO_VERSION, PROTO_VERSION)
"""The protocol versions the node speaks: exactly 2."""


def hello_refusal(frame: Frame, token: bytes) -> str | None:
    """Why the node refuses this HELLO frame, or None when it accepts it (section 5.2).

    The checks run in the order of the specification: the payload decodes, a common version
    exists, the peer is a head daemon, and (when the node has a token) ``auth`` equals it,
    compared in constant time.  A node without a token accepts any ``auth``.
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
    return None


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


def is_loopback_head(description: str) -> bool:
    """Whether a client endpoint dials a head on this machine (loopback host or Unix socket)."""
    kind, args, kwargs = _split_endpoint(description)
    if kind == "unix":
        return True
    if kind in ("tcp", "tcp6", "tls", "ssl"):
        return _is_loopback_host(kwargs.get("host", args[0] if args else ""))
    return False


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
