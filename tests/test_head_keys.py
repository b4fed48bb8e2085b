"""Each API key's share and caps (docs/api.md "API keys"): the key file's fields
(sfnode.head.api.keys), the token meter, ``twistd sfhead --api-key-file`` reading them, and the
head answering a key over its own cap with 429 and ``Retry-After`` while other keys go on (in
memory, tests/memoryhead.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twisted.python import usage
from twisted.trial.unittest import SynchronousTestCase

from sfnode.head.api.gate import GateLimits
from sfnode.head.api.keys import KeyFileError, KeyPolicy, TokenMeter, parse_key_line
from sfnode.head.api.request_class import HeadClass
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.tap import Options
from tests.memoryhead import MemoryHead, MemoryHeadTestCase
from tests.test_http import MESSAGES, MODEL
from tests.test_http_hostile import request_bytes


class KeyLineTests(SynchronousTestCase):
    def test_fields_after_the_key(self) -> None:
        """A key alone has the default policy; its fields set weight, concurrency, tokens
        per minute and class, in any order and case of name."""
        self.assertEqual(parse_key_line(b"sk-a"), (b"sk-a", KeyPolicy()))
        key, policy = parse_key_line(
            b"sk-b  class=batch Weight=2.5 concurrency=4 tokens-per-minute=1000"
        )
        self.assertEqual(key, b"sk-b")
        self.assertEqual(policy, KeyPolicy(2.5, 4, 1000, HeadClass.BATCH))

    def test_a_bad_field_is_refused_without_the_key(self) -> None:
        """A field that is not name=value, an unknown one, a weight of 0 or not a number, a
        negative cap or an unknown class is refused, and the message never holds the key."""
        for line in (
            b"sk-secret weight",
            b"sk-secret colour=red",
            b"sk-secret weight=0",
            b"sk-secret weight=nan",
            b"sk-secret concurrency=-1",
            b"sk-secret tokens-per-minute=lots",
            b"sk-secret class=urgent",
        ):
            with self.assertRaises(KeyFileError) as raised:
                parse_key_line(line)
            self.assertNotIn("sk-secret", str(raised.exception))


class TokenMeterTests(SynchronousTestCase):
    def test_a_key_waits_until_its_bucket_refills(self) -> None:
        """With 600 tokens per minute (10 a second): a key may start requests until it has
        spent them all, then waits (1 - level) / rate seconds; a key without a cap, or no key,
        never waits."""
        policies = {b"k": KeyPolicy(tokens_per_minute=600), b"free": KeyPolicy()}
        meter = TokenMeter(policies)
        self.assertEqual(meter.wait_s(b"k", 0.0), 0.0)
        meter.spend(b"k", 500, 0.0)
        self.assertEqual(meter.wait_s(b"k", 0.0), 0.0)
        meter.spend(b"k", 200, 0.0)
        self.assertAlmostEqual(meter.wait_s(b"k", 0.0), 10.1)
        self.assertAlmostEqual(meter.wait_s(b"k", 5.0), 5.1)
        self.assertEqual(meter.wait_s(b"k", 10.2), 0.0)
        meter.spend(b"free", 10**9, 0.0)
        meter.spend(None, 10**9, 0.0)
        self.assertEqual((meter.wait_s(b"free", 0.0), meter.wait_s(None, 0.0)), (0.0, 0.0))

    def test_the_bucket_holds_at_most_a_minute(self) -> None:
        """An idle hour saves no more than one minute's tokens."""
        meter = TokenMeter({b"k": KeyPolicy(tokens_per_minute=60)})
        meter.spend(b"k", 1, 0.0)
        meter.spend(b"k", 60, 3600.0)
        self.assertGreater(meter.wait_s(b"k", 3600.0), 0.0)


class KeyFileOptionTests(SynchronousTestCase):
    def test_the_key_file_gives_each_key_its_policy(self) -> None:
        """--api-key-file's fields reach the front door's limits (GateLimits.keys); a bad
        field is a usage error naming the file and the key's line number, not the key."""
        path = Path(self.mktemp())
        path.write_text("# teams\nsk-a weight=3 class=batch\nsk-b\n")
        options = Options()
        options.parseOptions(["--api-key-file", str(path)])
        self.assertEqual(options["api-keys"], (b"sk-a", b"sk-b"))
        limits: GateLimits = options["limits"]
        self.assertEqual(limits.keys[b"sk-a"], KeyPolicy(3.0, request_class=HeadClass.BATCH))
        self.assertEqual(limits.keys[b"sk-b"], KeyPolicy())
        path.write_text("sk-a\nsk-secret concurrency=x\n")
        with self.assertRaises(usage.UsageError) as raised:
            Options().parseOptions(["--api-key-file", str(path)])
        self.assertIn("key 2", str(raised.exception))
        self.assertNotIn("sk-secret", str(raised.exception))


def _chat(key: str, max_tokens: int = 4) -> bytes:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    return request_bytes(
        "/v1/chat/completions", json.dumps(body).encode(), extra=[f"Authorization: Bearer {key}"]
    )


class KeyCapsOverHttpTests(MemoryHeadTestCase):
    def head(self, **policies: Any) -> MemoryHead:
        self.start_vocab_node()
        keys = {name.encode(): policy for name, policy in policies.items()}
        return self.start_head(api_keys=list(keys), limits=GateLimits(keys=keys))

    def test_a_key_past_its_tokens_per_minute_gets_429_with_retry_after(self) -> None:
        """A key of 60 tokens a minute spends its prompt and answer; its next request is a
        429 whose Retry-After is the whole seconds until its bucket holds a token again,
        while another key is served; after that wait it is served again."""
        head = self.head(sk_meter=KeyPolicy(tokens_per_minute=60), sk_other=KeyPolicy())
        status, _, _ = self.exchange(head, _chat("sk_meter", max_tokens=60))
        self.assertEqual(status, 200)
        status, headers, content = self.exchange(head, _chat("sk_meter"))
        self.assertEqual(status, 429)
        self.assertEqual(json.loads(content)["error"]["code"], "rate_limit_exceeded")
        retry_after = int(headers[b"retry-after"])
        self.assertGreater(retry_after, 1)
        self.assertLessEqual(retry_after, 120)
        self.assertEqual(self.exchange(head, _chat("sk_other"))[0], 200)
        self.advance(retry_after, step=0.5)
        self.assertEqual(self.exchange(head, _chat("sk_meter"))[0], 200)

    def test_a_keys_own_concurrency_and_class(self) -> None:
        """A key of concurrency 1 asking for two choices at once is refused (400: it could
        never run); a key whose class is batch has its requests classed batch (the answer's
        X-Request-Class) and its weight reaches the fleet with the request (its share of the
        lanes)."""
        batch = KeyPolicy(weight=2.0, request_class=HeadClass.BATCH)
        head = self.head(sk_one=KeyPolicy(concurrency=1), sk_batch=batch)
        asked: list[HeadRequest] = []
        generate = head.fleet.generate

        def recording(request: HeadRequest, on_tokens: Any = None) -> Any:
            asked.append(request)
            return generate(request, on_tokens)

        head.fleet.generate = recording  # type: ignore[method-assign]
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "n": 2}
        auth = ["Authorization: Bearer sk_one"]
        data = request_bytes("/v1/chat/completions", json.dumps(body).encode(), extra=auth)
        status, _, content = self.exchange(head, data)
        self.assertEqual(status, 400)
        self.assertIn("1 generations one API key", json.loads(content)["error"]["message"])
        status, headers, _ = self.exchange(head, _chat("sk_batch"))
        self.assertEqual((status, headers[b"x-request-class"]), (200, b"batch"))
        (request,) = asked
        self.assertEqual((request.requester.key, request.requester.weight), (b"sk_batch", 2.0))
        self.assertEqual(request.requester.share, ("key", b"sk_batch"))
