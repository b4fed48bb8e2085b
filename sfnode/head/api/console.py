"""The console's HTTP resources (docs/api.md "The console"), mounted at ``/console`` when the
head has a :class:`~sfnode.head.console.state.Console`:

- ``GET /console``: the page (``sfnode/head/console/page.html``, served from the package: no
  asset comes from anywhere else);
- ``GET /console/state``: the snapshot as JSON, for scripts and ``sfnode top``;
- ``GET /console/feed``: the snapshot as server-sent events, twice a second, while connected
  (:mod:`sfnode.head.console.feed`; at most ``MAX_VIEWERS`` at once, 503 beyond);
- ``POST /console/drain?node=NAME``: placement gives the node nothing new from now on (its
  running generations finish); only with an admin key (``admin=yes`` in the key file), sent as
  ``Authorization: Bearer`` or ``X-Api-Key`` (never as a browser's cached password: a page
  elsewhere cannot make a browser drain a node).

The API key rules are the API's: when the head has keys, every console route needs one of them.
A browser that opens the page sends it as the password of HTTP Basic (any user name): the
answer 401 asks for it, and the browser then sends it with the page's own requests.

This module must never change the fleet but through ``drain``, never answer a console route
without the key when the head has keys, and never write a key anywhere.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sized
from importlib import resources
from typing import Any, Protocol

from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from sfnode.head.api.exchange import answer, answer_error
from sfnode.head.api.gate import GateLimits, Route, method_not_allowed, unknown_url
from sfnode.head.api.keys import DEFAULT_POLICY
from sfnode.head.console.feed import Feed
from sfnode.head.console.state import Console
from sfnode.runtime.http_guard import HttpError, clip

REALM = b'Basic realm="sfhead console", charset="UTF-8"'


class ConsoleHost(Protocol):
    """What the console's resources ask of the API (:class:`~sfnode.head.api.http.OpenAIApi`)."""

    api_keys: tuple[bytes, ...]
    draining: bool
    limits: GateLimits

    @property
    def exchanges(self) -> Sized: ...

    def matching_key(self, given: bytes) -> bytes | None: ...

    def authorized(self, request: Any) -> bytes | None: ...


def page() -> bytes:
    """The console's page, from the package."""
    return resources.files("sfnode.head.console").joinpath("page.html").read_bytes()


def basic_password(request: Any) -> bytes | None:
    """The password of an ``Authorization: Basic`` header, or None."""
    scheme, _, value = (request.getHeader(b"authorization") or b"").partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    return decoded.partition(b":")[2]


def console_key(host: ConsoleHost, request: Any) -> bytes | None:
    """The API key a console request carries (``b""`` when the head has none), as a bearer
    token, ``X-Api-Key`` or the password of HTTP Basic; None: no key of the head's."""
    found = host.authorized(request)
    if found is not None or not host.api_keys:
        return found
    password = basic_password(request)
    return host.matching_key(password) if password is not None else None


def unauthorized() -> HttpError:
    return HttpError(
        401,
        "the console needs one of the head's API keys: as 'Authorization: Bearer KEY', or as "
        "the password a browser asks for",
        code="invalid_api_key",
        outcome="unauthorized",
        headers={b"www-authenticate": REALM},
    )


class ConsoleTree:
    """The console's resources and the feed they share."""

    def __init__(self, host: ConsoleHost, console: Console, clock: Any) -> None:
        self.host = host
        self.console = console
        self.feed = Feed(clock, self.encoded)
        self.root = _Root(self)
        self.root.putChild(b"state", _State(self))
        self.root.putChild(b"feed", _Feed(self))
        self.root.putChild(b"drain", _Drain(self))

    def snapshot(self) -> dict[str, Any]:
        host = self.host
        return self.console.snapshot(draining=host.draining, requests=len(host.exchanges))

    def encoded(self) -> bytes:
        return json.dumps(self.snapshot(), separators=(",", ":")).encode()


class _Leaf(Resource):
    """A console resource: the key first, then its method (a JSON 405 for any other)."""

    isLeaf = True
    route = Route(methods=(b"GET",))

    def __init__(self, tree: ConsoleTree) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.tree = tree

    def serve(self, request: Any) -> bytes | int:
        raise NotImplementedError

    def render(self, request: Any) -> bytes | int:
        method = request.method
        methods = self.route.methods
        if method not in methods and not (method == b"HEAD" and b"GET" in methods):
            return _refuse(request, method_not_allowed(method, request.path, self.route))
        if console_key(self.tree.host, request) is None:
            return _refuse(request, unauthorized())
        body = self.serve(request)
        if method == b"HEAD" and isinstance(body, bytes):
            request.setHeader(b"content-length", b"%d" % len(body))
            return b""
        return body


class _Root(_Leaf):
    """``/console``: the page; its children are the other routes."""

    isLeaf = False

    def getChild(self, path: bytes, request: Any) -> Resource:
        return _NotFound(self.tree)

    def serve(self, request: Any) -> bytes:
        body = page()
        request.setHeader(b"content-type", b"text/html; charset=utf-8")
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"x-frame-options", b"DENY")
        request.setHeader(
            b"content-security-policy",
            b"default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            b"connect-src 'self'; img-src data:",
        )
        return body


class _NotFound(_Leaf):
    route = Route()

    def render(self, request: Any) -> bytes:
        return _refuse(request, unknown_url(request.method, request.path))


class _State(_Leaf):
    def serve(self, request: Any) -> bytes:
        request.setHeader(b"cache-control", b"no-store")
        return answer(request, 200, self.tree.snapshot())


class _Feed(_Leaf):
    def serve(self, request: Any) -> bytes | int:
        feed = self.tree.feed
        if feed.full:
            return _refuse(
                request,
                HttpError(
                    503,
                    f"the console has {feed.max_viewers} viewers already",
                    kind="server_error",
                    code="too_many_viewers",
                    outcome="unavailable",
                ),
            )
        if request.method == b"HEAD":
            return b""
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"x-accel-buffering", b"no")
        feed.add(request)
        return NOT_DONE_YET


class _Drain(_Leaf):
    """``POST /console/drain?node=NAME`` (the name in the query: a node's identity may hold
    any character, a ``/`` included)."""

    route = Route(methods=(b"POST",))

    def serve(self, request: Any) -> bytes:
        key = self.tree.host.authorized(request)
        policy = self.tree.host.limits.keys.get(key or b"", DEFAULT_POLICY)
        if not key or not policy.admin:
            return _refuse(request, not_admin())
        names: list[bytes] = request.args.get(b"node", [])
        if len(names) != 1:
            return _refuse(request, HttpError(400, "name one node: ?node=NAME", param="node"))
        name = names[0].decode("utf-8", "replace")
        node = self.tree.console.fleet.registry.drain(name)
        if node is None:
            return _refuse(
                request,
                HttpError(404, f"no node is named {clip(name)!r}", code="node_not_found",
                          outcome="not_found"),
            )  # fmt: skip
        return answer(request, 200, {"node": node.name, "state": "draining"})


def not_admin() -> HttpError:
    return HttpError(
        403,
        "draining a node needs an admin key (admin=yes in --api-key-file), sent as "
        "'Authorization: Bearer KEY'",
        code="admin_key_required",
        outcome="forbidden",
    )


def _refuse(request: Any, error: HttpError) -> bytes:
    request.site.count(error.outcome)
    return answer_error(request, error)


__all__ = ["ConsoleTree", "basic_password", "console_key", "page"]
