"""The head's closed doors, round two (issue 30), on the memory head (tests/memoryhead.py): what
one API key's requests leave behind belongs to that key, client input is parsed within bounds
and refused in OpenAI's shape, a chat template from a node is bounded in what it builds, models
leave with their last node, and the response store counts what it holds.

Each test is one finding of the issue, tried as the attacker tried it, on a head with mock nodes
in memory (no socket, no thread, no sleep).
"""

from __future__ import annotations

import json
from typing import Any

from tests.memoryhead import MemoryHead, MemoryHeadTestCase
from tests.test_http import MODEL

KEY_A = b"sk-tenant-a-" + b"a" * 20
KEY_B = b"sk-tenant-b-" + b"b" * 20


class DoorsTestCase(MemoryHeadTestCase):
    def post(
        self, head: MemoryHead, path: str, body: Any, key: bytes | None = None
    ) -> tuple[int, dict[str, Any]]:
        """The status and JSON body of one POST (with ``key`` as the bearer token)."""
        from tests.test_http_hostile import request_bytes

        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        extra = [f"Authorization: Bearer {key.decode()}"] if key is not None else []
        status, _, content = self.exchange(head, request_bytes(path, data, extra=extra))
        return status, json.loads(content)


class OwnedResponsesTests(DoorsTestCase):
    def test_another_key_gets_the_404_of_an_unknown_id(self) -> None:
        """A response stored by key A is continued by A; key B naming its id gets exactly the
        404 ``previous_response_not_found`` an id nobody stored gets (same body but for the
        id), and nothing of A's conversation reaches a node for B."""
        self.start_vocab_node()
        head = self.start_head(api_keys=[KEY_A, KEY_B])
        secret = "the launch code is 0000"
        body = {"model": MODEL, "input": secret, "max_output_tokens": 2}
        status, first = self.post(head, "/v1/responses", body, KEY_A)
        self.assertEqual(status, 200, first)
        again = {"model": MODEL, "input": "go on", "max_output_tokens": 2}
        status, _ = self.post(
            head, "/v1/responses", {**again, "previous_response_id": first["id"]}, KEY_A
        )
        self.assertEqual(status, 200)
        crossed = self.post(
            head, "/v1/responses", {**again, "previous_response_id": first["id"]}, KEY_B
        )
        unknown_id = "resp_" + "0" * 32
        unknown = self.post(
            head, "/v1/responses", {**again, "previous_response_id": unknown_id}, KEY_B
        )
        self.assertEqual(crossed[0], 404)
        self.assertEqual(
            json.dumps(crossed[1]).replace(first["id"], "ID"),
            json.dumps(unknown[1]).replace(unknown_id, "ID"),
        )
        self.assertEqual(crossed[1]["error"]["code"], "previous_response_not_found")

    def test_a_keyless_head_keeps_responses_for_its_one_owner(self) -> None:
        """On a head without keys (loopback) a stored response is continued as before: its
        owner is None, the same for every request."""
        self.start_vocab_node()
        head = self.start_head()
        body = {"model": MODEL, "input": "hello", "max_output_tokens": 2}
        status, first = self.post(head, "/v1/responses", body)
        self.assertEqual(status, 200, first)
        status, second = self.post(
            head, "/v1/responses", {**body, "previous_response_id": first["id"]}
        )
        self.assertEqual(status, 200, second)
