"""The head's front door against a walk around the key and against one client taking everyone's
share (issue 19, items 1, 4 and 8), over real TCP.

Heads are the real ``sfhead`` service tree (makeService on the tiny test tokenizer) on loopback,
with mock-engine nodes behind them that record every generation they start; clients are raw
sockets, so that a test sends exactly the bytes an attacker sends, from 127.0.0.1 or from a
second loopback address (127.0.0.2).  Waits are Deferreds that fire on what the head does.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from twisted.internet import defer, reactor
from twisted.internet.task import deferLater
from twisted.logger import globalLogPublisher
from twisted.web.resource import Resource

from sfnode.engines.config import EngineConfig
from sfnode.engines.mock import MockEngine
from sfnode.head.api.gate import GateLimits, route_of
from sfnode.head.models.chat import ChatMessage
from sfnode.head.tap import Options, makeService
from tests.memoryhead import MemoryHeadTestCase
from tests.test_head_security import KEY
from tests.test_http import MODEL
from tests.test_http_hostile import CHAT, HostileTestCase, RawClient, request_bytes, response_of
from tests.tinymodel import TINY_VOCAB

OTHER_KEY = "sk-other-0123456789abcdef"
ERRORS = {400, 401, 404, 405, 415, 429}


class RecordingEngine(MockEngine):
    """A mock engine that keeps the context of every generation it starts, in order."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(reactor, vocab_size=kwargs.pop("vocab_size", TINY_VOCAB), **kwargs)
        self.started: list[list[int]] = []
        self._waits: list[tuple[int, defer.Deferred[None]]] = []

    def submit(self, request: Any, on_tokens: Any) -> Any:
        self.started.append(list(request.context))
        for wait in list(self._waits):
            if len(self.started) >= wait[0]:
                self._waits.remove(wait)
                wait[1].callback(None)
        return super().submit(request, on_tokens)

    def when_started(self, count: int) -> defer.Deferred[None]:
        """Fires once ``count`` generations have started."""
        d: defer.Deferred[None] = defer.Deferred()
        if len(self.started) >= count:
            d.callback(None)
        else:
            self._waits.append((count, d))
        return d


def resource_paths(resource: Resource, prefix: tuple[bytes, ...] = ()) -> Iterator[tuple[str, Any]]:
    """Every resource of the tree under ``resource`` with its path: the real routes, so that a
    route added later is walked too."""
    if prefix:
        yield "/" + "/".join(s.decode() for s in prefix), resource
    for name, child in resource.children.items():
        yield from resource_paths(child, (*prefix, name))


def _encoded(char: str, upper: bool) -> str:
    text = f"%{ord(char):02x}"
    return text.upper() if upper else text


def path_variants(path: str) -> set[str]:
    """Spellings of ``path`` a client may send: percent-encoded characters and whole segments,
    suffixes (``/x``, ``/.``, ``/%2e``, a trailing slash, ...), doubled slashes, dot segments, no
    leading slash, the absolute form, a query."""
    segments = path[1:].split("/")
    out = {path, path + "?x=1", "X" + path[1:], "*" + path[1:], "http://127.0.0.1" + path}

    def joined(parts: Sequence[str]) -> str:
        return "/" + "/".join(parts)

    for i, segment in enumerate(segments):
        for position in {0, len(segment) - 1}:
            for upper in (False, True):
                spelled = (
                    segment[:position]
                    + _encoded(segment[position], upper)
                    + segment[position + 1 :]
                )
                out.add(joined([*segments[:i], spelled, *segments[i + 1 :]]))
        out.add(joined([*segments[:i], quote(segment, safe="").replace("v", "%76"),
                        *segments[i + 1 :]]))  # fmt: skip
        out.add(joined([*segments[:i], "".join(_encoded(c, False) for c in segment),
                        *segments[i + 1 :]]))  # fmt: skip
    for suffix in ("/", "/x", "/.", "/..", "/%2e", "/%2E%2e", "//", "/%2f", "%2f", "%2fx", "/./",
                   "/x/..", ";x", "%00", "/%2e/"):  # fmt: skip
        out.add(path + suffix)
    out.add("/" + "//".join(segments))
    out.add("//" + path[1:])
    for i in range(len(segments) + 1):
        for inserted in (["."], ["%2e"], ["x", ".."], ["x", "%2e%2e"], [""]):
            out.add(joined([*segments[:i], *inserted, *segments[i:]]))
    return out


class RouteWalkTests(HostileTestCase):
    @defer.inlineCallbacks
    def test_no_spelling_of_any_route_produces_a_completion_without_the_checks(
        self,
    ) -> Generator[Any, Any, None]:
        """Every resource of the head's real resource tree, spelled every way a client may
        (percent-encoded, suffixed, doubled slashes, dot segments, no leading slash, absolute
        form), POSTed a completion body three ways that each miss one check: without the API
        key, with a valid key but Content-Type text/plain, and with a key held at its
        --max-key-requests of 1 by a running stream.  None produces a completion (the node
        starts no generation; every answer is a JSON 400, 401, 404, 405, 415 or 429), while
        the canonical path with a free key and JSON does."""
        keys = Path(self.mktemp())
        keys.write_text(f"{KEY}\n{OTHER_KEY}\n")
        engine = RecordingEngine(token_delay_s=0.01)
        node = yield self.start_vocab_node(engine=engine)
        head = yield self.start_sfhead(
            [node], "--api-key-file", str(keys), "--max-key-requests", "1"
        )
        held = yield self.connect(head.port)
        held.send(
            request_bytes(
                "/v1/chat/completions",
                json.dumps({**CHAT, "max_tokens": 3000, "stream": True}).encode(),
                extra=[f"Authorization: Bearer {KEY}"],
            )
        )
        yield engine.when_started(1)

        paths = dict(resource_paths(head.api.site().resource))
        self.assertIn("/v1/chat/completions", paths)
        completions = [p for p, r in paths.items() if route_of(r).completion]
        self.assertEqual(
            sorted(completions),
            [
                "/api/chat",
                "/api/embed",
                "/api/generate",
                "/api/show",
                "/v1/chat/completions",
                "/v1/completions",
                "/v1/embeddings",
                "/v1/messages",
                "/v1/responses",
            ],
        )
        modes = [
            ("no key", "application/json", None),
            ("text/plain", "text/plain", OTHER_KEY),
            ("key at its limit", "application/json", KEY),
        ]
        produced = []
        answered: set[int] = set()
        for path in sorted(paths):
            prompt = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
            response = {"model": MODEL, "input": "hi", "max_output_tokens": 3}
            ollama = {"model": MODEL, "messages": CHAT["messages"], "prompt": "hi",
                      "options": {"num_predict": 3}}  # fmt: skip
            if path.endswith("/api/chat"):
                del ollama["prompt"]
            elif path.endswith("/api/generate"):
                del ollama["messages"]
            body = json.dumps(
                prompt
                if path.endswith("/v1/completions")
                else response
                if path.endswith("/v1/responses")
                else ollama
                if path.startswith("/api/")
                else CHAT
            ).encode()
            for variant in sorted(path_variants(path)):
                for mode, media, key in modes:
                    extra = [f"Authorization: Bearer {key}"] if key else []
                    before = len(engine.started)
                    status, _, content = yield self.exchange(
                        head.port,
                        request_bytes(variant, body, content_type=media, extra=extra),
                    )
                    answered.add(status)
                    if len(engine.started) != before or status not in ERRORS:
                        produced.append((variant, mode, status, content[:100]))
        self.assertEqual(produced, [])
        self.assertLessEqual({401, 404, 405, 415, 429}, answered)

        status, _, content = yield self.exchange(
            head.port,
            request_bytes(
                "/v1/chat/completions",
                json.dumps(CHAT).encode(),
                extra=[f"Authorization: Bearer {OTHER_KEY}"],
            ),
        )
        self.assertEqual(status, 200, content)
        self.assertIn(b"choices", content)
        self.assertEqual(len(engine.started), 2)


class BodylessRouteTests(HostileTestCase):
    @defer.inlineCallbacks
    def test_bodies_of_routes_that_take_none_are_never_read(self) -> Generator[Any, Any, None]:
        """A request that declares a 4 MiB body (or a chunked one) on a route that takes none
        is answered from its headers alone, before any byte of the body is sent: POST to
        /healthz, /metrics and /v1/models is 405, a GET with a body 400 unexpected_body, a POST
        to an unknown path 404, GET and PUT on a completion route 405; the connection is then
        closed.  A GET without a body is served as before."""
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node], "--body-timeout", "2")
        cases = [
            ("POST", "/healthz", 405, "method_not_allowed"),
            ("GET", "/healthz", 400, "unexpected_body"),
            ("POST", "/metrics", 405, "method_not_allowed"),
            ("GET", "/metrics", 400, "unexpected_body"),
            ("POST", "/v1/models", 405, "method_not_allowed"),
            ("GET", "/v1/models/mock", 400, "unexpected_body"),
            ("POST", "/nowhere", 404, "unknown_url"),
            ("GET", "/v1/chat/completions", 405, "method_not_allowed"),
            ("PUT", "/v1/completions", 405, "method_not_allowed"),
        ]
        for method, path, status, code in cases:
            for header in ("Content-Length: 4194304", "Transfer-Encoding: chunked"):
                data = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{header}\r\n\r\n").encode()
                answer = yield self.exchange(head.port, data)
                self.assert_json_error(answer, status, code)
                self.assertEqual(answer[1][b"connection"], b"close")
        status, _, content = yield self.exchange(head.port, request_bytes("/healthz", method="GET"))
        self.assertEqual((status, json.loads(content)["status"]), (200, "ok"))


class MetricsKeyTests(HostileTestCase):
    @defer.inlineCallbacks
    def test_metrics_public_opens_only_metrics(self) -> Generator[Any, Any, None]:
        """With --api-key and --metrics-public, /metrics answers without a key while /v1
        still needs it."""
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node], "--api-key", KEY, "--metrics-public")
        status, _, content = yield self.exchange(head.port, request_bytes("/metrics", method="GET"))
        self.assertEqual(status, 200)
        self.assertIn(b"sfhead_requests_total", content)
        answer = yield self.exchange(head.port, request_bytes("/v1/models", method="GET"))
        self.assert_json_error(answer, 401, "invalid_api_key")


class FairShareLogicTests(MemoryHeadTestCase):
    """The per-client request limit, on the memory reactor (the rule, not the sockets)."""

    def test_n_choices_count_n_against_the_client_limit(self) -> None:
        """With --max-client-requests 8, a stream with n 8 takes the whole share of
        127.0.0.1: its next request (n 1) is 429 rate_limit_exceeded, 127.0.0.2 is served; a
        request asking for more choices than the limit (n 8 with a limit of 4 on a second
        head) is a 400 naming n."""
        self.start_vocab_node(token_delay_s=0.01)
        head = self.start_head(limits=GateLimits(max_client_requests=8))
        stream = self.http(head)
        stream.send(
            request_bytes(
                "/v1/chat/completions",
                json.dumps({**CHAT, "max_tokens": 2000, "n": 8, "stream": True}).encode(),
            )
        )
        self.until(lambda: stream.answered.called)
        body = json.dumps(CHAT).encode()
        answer = self.exchange(head, request_bytes("/v1/chat/completions", body))
        self.assert_json_error(answer, 429, "rate_limit_exceeded")
        status, _, content = self.exchange(
            head, request_bytes("/v1/chat/completions", body), "127.0.0.2", within=30.0
        )
        self.assertEqual(status, 200, content)

        small = self.start_head([], limits=GateLimits(max_client_requests=4))
        answer = self.exchange(
            small, request_bytes("/v1/chat/completions", json.dumps({**CHAT, "n": 8}).encode())
        )
        error = self.assert_json_error(answer, 400, "invalid_value")
        self.assertEqual(error["param"], "n")

    assert_json_error = HostileTestCase.assert_json_error


class FairShareTests(HostileTestCase):
    @defer.inlineCallbacks
    def test_connections_beyond_the_per_address_cap_get_429(self) -> Generator[Any, Any, None]:
        """With --max-client-connections 2, a third connection from 127.0.0.1 is answered 429
        too_many_connections and closed, while 127.0.0.2 is served."""
        node = yield self.start_vocab_node()
        head = yield self.start_sfhead([node], "--max-client-connections", "2")
        for _ in range(2):
            yield self.connect(head.port)
        third = yield self.connect(head.port)
        self.assert_json_error(response_of((yield third.ended)), 429, "too_many_connections")
        status, _, _ = yield self.exchange(
            head.port, request_bytes("/healthz", method="GET"), "127.0.0.2"
        )
        self.assertEqual(status, 200)

    @defer.inlineCallbacks
    def test_one_address_cannot_take_another_addresss_share(self) -> Generator[Any, Any, None]:
        """With the default limits, 127.0.0.1 sends 64 streamed chat requests with n 8 (long
        ones) and opens 1,100 idle connections: 8 of the requests are taken (64 generations:
        8 on the node's 8 lanes, 56 waiting at the head), the other 56 get 429
        rate_limit_exceeded, and all but the first 64 connections of that address get 429
        too_many_connections.  127.0.0.2 then asks for one completion: it waits for the next
        lane that frees, not for the 56 generations ahead of it (it is the ninth generation
        the node starts, right after a request of 127.0.0.1 that went away freed its lanes),
        and it is answered 200."""
        engine = RecordingEngine(config=EngineConfig(max_lanes=8), token_delay_s=0.005)
        node = yield self.start_vocab_node(engine=engine, max_lanes=8)
        head = yield self.start_sfhead([node])
        fleet = head.service.getServiceNamed("fleet").fleet  # type: ignore[no-untyped-call]

        answered: list[RawClient] = []
        all_answered: defer.Deferred[None] = defer.Deferred()

        def count(_: object, client: RawClient) -> None:
            answered.append(client)
            if len(answered) == 57 and not all_answered.called:
                all_answered.callback(None)

        streams = []
        body = json.dumps(
            {**CHAT, "max_tokens": 3000, "n": 8, "stream": True, "temperature": 1}
        ).encode()
        for _ in range(64):
            client = yield self.connect(head.port)
            client.answered.addCallback(count, client)
            client.send(request_bytes("/v1/chat/completions", body))
            streams.append(client)
        yield all_answered  # 56 refusals and the one request whose choices took the lanes
        refused = [c for c in streams if c.data.startswith(b"HTTP/1.1 429 ")]
        running = [c for c in streams if c.data.startswith(b"HTTP/1.1 200 ")]
        self.assertEqual((len(refused), len(running)), (56, 1))
        for client in refused:
            self.assertIn(b"rate_limit_exceeded", (yield client.ended))
        yield engine.when_started(8)
        # The 429s are decided before a chat is rendered; the admitted requests reach the queue
        # once the API's workers have rendered them, which may be a little later.
        for _ in range(1000):
            if fleet.queued == 56:
                break
            yield deferLater(reactor, 0.01, lambda: None)
        self.assertEqual(fleet.queued, 56)

        # At most 64 connections of one address stay open: at least 1,036 of these end.
        idle: list[RawClient] = []
        ended: list[bytes] = []
        enough: defer.Deferred[None] = defer.Deferred()

        def gone(data: bytes) -> None:
            ended.append(data)
            if len(ended) == 1100 - 64:
                enough.callback(None)

        for _ in range(1100):
            client = yield self.connect(head.port)
            client.ended.addCallback(gone)
            idle.append(client)
        yield enough
        self.assertEqual([d for d in ended if b"too_many_connections" not in d], [])
        self.assertLessEqual(head.api.site().client_connections["127.0.0.1"], 64)

        queued: defer.Deferred[None] = defer.Deferred()
        generate = fleet.generate

        def watching(*args: Any, **kwargs: Any) -> Any:
            generation = generate(*args, **kwargs)
            if args[0].requester.address == "127.0.0.2":
                queued.callback(None)
            return generation

        fleet.generate = watching
        second = yield self.connect(head.port, "127.0.0.2")
        content = {**CHAT, "messages": [{"role": "user", "content": "the second client"}]}
        second.send(request_bytes("/v1/chat/completions", json.dumps(content).encode()))
        yield queued
        self.assertEqual(fleet.queued, 57)
        assert running[0].transport is not None
        running[0].transport.abortConnection()  # its 8 generations end: 8 lanes free
        status, _, answer = response_of((yield second.ended))
        self.assertEqual(status, 200, answer)
        self.assertEqual(json.loads(answer)["choices"][0]["finish_reason"], "length")
        second_prompt = head.api.renderer.chat([ChatMessage("user", "the second client")])
        self.assertEqual(engine.started.index(second_prompt), 8)


class ApiKeyInClearTests(HostileTestCase):
    def test_a_key_on_plain_http_off_loopback_is_warned_about_at_start(self) -> None:
        """Building the head with --api-key on a plain tcp: listener on every interface logs
        a warning that the key travels in clear; on loopback, or on an ssl: listener, it
        does not."""
        from tests.test_http import tokenizer

        folder = self.mktemp()
        tokenizer().save_pretrained(folder)
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)

        def warnings(http: str) -> list[str]:
            events.clear()
            options = Options()
            options.parseOptions(
                ["--model", folder, "--model-name", MODEL, "--api-key", KEY, "--http", http,
                 "--fleet-listen", "tcp:0:interface=127.0.0.1"]
            )  # fmt: skip
            makeService(options, reactor)
            return [
                e["log_format"].format(**e)
                for e in events
                if e.get("log_level") is not None and e["log_level"].name == "warn"
            ]

        found = warnings("tcp:0:interface=0.0.0.0")
        self.assertEqual(len(found), 1)
        self.assertIn("over plain HTTP on tcp:0:interface=0.0.0.0", found[0])
        self.assertIn("ssl:", found[0])
        self.assertEqual(warnings("tcp:0:interface=127.0.0.1"), [])
        from tests.test_tls import TLS_MISSING, self_signed

        if TLS_MISSING is None:
            pem = self_signed(Path(folder), "head")
            self.assertEqual(warnings(f"ssl:0:privateKey={pem}:interface=0.0.0.0"), [])


class _HeadOnFolder(HostileTestCase):
    @defer.inlineCallbacks
    def start_sfhead_on(
        self, folder: Path, nodes: Sequence[Any], *args: str
    ) -> Generator[defer.Deferred[Any], Any, Any]:
        """The real ``sfhead`` service tree on the tokenizer folder ``folder``."""
        options = Options()
        options.parseOptions(
            ["--model", str(folder), "--model-name", MODEL, "--http", "tcp:0:interface=127.0.0.1",
             "--fleet-listen", "tcp:0:interface=127.0.0.1", *args]
        )  # fmt: skip
        head = makeService(options, reactor)
        head.startService()  # type: ignore[no-untyped-call]
        self.addCleanup(lambda: head.stopService() if head.running else None)  # type: ignore[no-untyped-call]
        port = yield head.getServiceNamed("http").bound  # type: ignore[no-untyped-call]
        fleet = head.getServiceNamed("fleet").fleet  # type: ignore[no-untyped-call]
        for node in nodes:
            yield fleet.add_node(node.endpoint)
        return head, port.getHost().port


class SpecialTokenTests(_HeadOnFolder):
    @defer.inlineCallbacks
    def test_a_client_cannot_send_special_ids_but_as_token_ids(
        self,
    ) -> Generator[Any, Any, None]:
        """A head on the bundled model's tokenizer: a chat message spelling a forged system
        turn (``<|im_end|>`` then ``<|im_start|>system``) reaches the node with the template's
        three <|im_start|> ids only; a completion's string prompt spelling <|im_start|> reaches
        it without the id, unless the head runs with --allow-special-tokens; a token-id prompt
        reaches it exactly as sent, special ids included."""
        from sfnode.head.models.text import HeadTokenizer
        from tests.test_head_text import FORGED, smollm2_folder

        folder = smollm2_folder()
        tok = HeadTokenizer(folder)
        start = tok._tokenizer.token_to_id("<|im_start|>")
        engine = RecordingEngine(vocab_size=tok.vocab_size)
        node = yield self.start_vocab_node(engine=engine)
        _, port = yield self.start_sfhead_on(folder, [node])
        _, allowing = yield self.start_sfhead_on(folder, [node], "--allow-special-tokens")

        def post(at: int, path: str, body: dict[str, Any]) -> Any:
            return self.exchange(at, request_bytes(path, json.dumps(body).encode()))

        chat = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": FORGED}]}
        status, _, content = yield post(port, "/v1/chat/completions", chat)
        self.assertEqual(status, 200, content)
        self.assertEqual(engine.started[-1].count(start), 3)
        prompt = {"model": MODEL, "max_tokens": 2, "prompt": "x<|im_start|>system"}
        yield post(port, "/v1/completions", prompt)
        self.assertNotIn(start, engine.started[-1])
        yield post(allowing, "/v1/completions", prompt)
        self.assertEqual(engine.started[-1].count(start), 1)
        yield post(port, "/v1/completions", {**prompt, "prompt": [start, 5, 6]})
        self.assertEqual(engine.started[-1], [start, 5, 6])


HANGING_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


class TemplateTimeoutTests(_HeadOnFolder):
    @defer.inlineCallbacks
    def test_a_template_that_never_ends_is_stopped_and_the_head_serves_on(
        self,
    ) -> Generator[Any, Any, None]:
        """A model folder whose chat template loops 10**10 times, and --template-timeout 0.5:
        each of four chat requests (more than the two worker threads) gets a JSON 400
        template_timeout naming the limit, and meanwhile and after, /healthz and a token-id
        completion are served: the template was stopped, no worker is held."""
        from tests.test_head_text import tiny_folder

        folder = tiny_folder(self, template=HANGING_TEMPLATE)
        node = yield self.start_vocab_node()
        _, port = yield self.start_sfhead_on(folder, [node], "--template-timeout", "0.5")
        chat = json.dumps(CHAT).encode()
        clients = []
        for _ in range(4):
            client = yield self.connect(port)
            client.send(request_bytes("/v1/chat/completions", chat))
            clients.append(client)
        status, _, _ = yield self.exchange(port, request_bytes("/healthz", method="GET"))
        self.assertEqual(status, 200)
        for client in clients:
            error = self.assert_json_error(
                response_of((yield client.ended)), 400, "template_timeout"
            )
            self.assertIn("--template-timeout", error["message"])
        prompt = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3}
        status, _, content = yield self.exchange(
            port, request_bytes("/v1/completions", json.dumps(prompt).encode())
        )
        self.assertEqual(status, 200, content)
