"""Lanes shared by clients under load (docs/protocol.md section 8.5, "Shares"), over HTTP in
memory (tests/memoryhead.py): one address holding every lane cannot delay another client's
first token beyond a step and its prefill, a stream its client stops reading parks instead of
holding a lane, and every answer stays the one an uninterrupted run gives.
"""

from __future__ import annotations

from typing import Any

from sfnode.head.api.gate import GateLimits
from tests.memoryhead import MemoryHead, MemoryHeadTestCase
from tests.test_http import (
    MESSAGES,
    MODEL,
    StreamingClient,
    expected_tokens,
    post_bytes,
    prompt_ids,
    sse_events,
    text_of,
)
from tests.test_http_hostile import response_of

STEP_S = 0.02
"""The mock nodes' step: one token per lane every 20 ms of the memory clock."""


def _body(max_tokens: int) -> dict[str, Any]:
    """A greedy streamed chat request for ``max_tokens`` tokens."""
    return {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
    }


def _streamed_text(data: bytes) -> str:
    _, _, body = response_of(data)
    return "".join(
        choice["delta"].get("content") or ""
        for event in sse_events(body)
        if isinstance(event, dict)
        for choice in event["choices"]
    )


class SharesOverHttpTests(MemoryHeadTestCase):
    def head_with_hog(self, hog: int, *, reclaim: bool = True, tokens: int = 400) -> Any:
        """Two mock nodes of 8 lanes (16 in all) and a head whose limits let one address
        open ``hog`` streams of ``tokens`` tokens each; fires once they hold every lane and
        the rest wait."""
        for name in ("a", "b"):
            self.start_vocab_node(name, max_lanes=8, token_delay_s=STEP_S)
        limits = GateLimits(max_client_requests=1024, max_client_connections=1024)
        head = self.start_head(
            fleet_options={
                "max_queued": 1024,
                "max_client_queued": 0,
                "queue_timeout_s": 0,
                "reclaim_lanes": reclaim,
            },
            limits=limits,
        )
        body = _body(tokens)
        hogs = []
        for _ in range(hog):
            client = self.http(head, "10.0.0.1")
            client.send(post_bytes(body, close=True))
            hogs.append(client)
        self.until(lambda: head.fleet.queued == hog - 16)
        return head, hogs

    def first_token_after(self, head: MemoryHead) -> tuple[float, StreamingClient]:
        """Seconds of the memory clock from a second client's stream request to its first
        token, and the client."""
        body = _body(8)
        client = StreamingClient()
        self.http(head, "10.0.0.2", client)
        sent = self.reactor.seconds()
        assert client.transport is not None
        client.transport.write(post_bytes(body, close=True))
        self.until(lambda: client.content_seen.called, within=30.0)
        return self.reactor.seconds() - sent, client

    def test_a_bystander_gets_its_first_token_within_a_step_of_200_streams(self) -> None:
        """One address holds all 16 lanes with 200 long streams; a second client's first
        token comes within one step and its prefill (< 1 s of the memory clock, where
        waiting for a hog's lane to free would take its 400 steps, 8 s), and its answer is
        the uninterrupted one; /metrics counts the lanes taken back."""
        head, _ = self.head_with_hog(200)
        waited, client = self.first_token_after(head)
        self.assertLess(waited, 1.0)
        self.until(lambda: client.ended.called)
        text = _streamed_text(client.data)
        self.assertEqual(text, text_of(expected_tokens(prompt_ids(MESSAGES), 8)))
        self.assertGreaterEqual(head.fleet.shares.reclaimed, 1)
        _, metrics = self.call(head, b"GET", "/metrics")
        reclaimed = f"sfhead_lanes_reclaimed_total {float(head.fleet.shares.reclaimed)}"
        self.assertIn(reclaimed, metrics.decode())

    def test_without_taking_lanes_back_the_bystander_waits(self) -> None:
        """The same load with lanes taken back turned off (reclaim_lanes False): the
        bystander waits for a hog's generation to end, several seconds (what the test above
        rules out)."""
        head, _ = self.head_with_hog(20, tokens=200, reclaim=False)
        waited, _ = self.first_token_after(head)
        self.assertGreater(waited, 1.0)

    def test_the_hogs_answers_stay_exact_when_their_lanes_are_taken_back(self) -> None:
        """Streams that gave their lanes back to a bystander and resumed end with the text an
        uninterrupted run gives, none cut or repeated."""
        head, hogs = self.head_with_hog(18, tokens=60)
        for address in ("10.0.0.2", "10.0.0.3", "10.0.0.4"):
            body = _body(8)
            client = self.http(head, address)
            client.send(post_bytes(body, close=True))
        self.until(lambda: all(h.closed for h in hogs), within=60.0)
        self.assertGreaterEqual(head.fleet.shares.reclaimed, 3)
        expected = text_of(expected_tokens(prompt_ids(MESSAGES), 60))
        for hog in hogs:
            self.assertEqual(_streamed_text(hog.data), expected)

    def test_a_stream_nobody_reads_parks_and_resumes_exactly(self) -> None:
        """A stream whose client stops reading (the transport pauses the producer) gives its
        lane back at once, so a waiting request takes it; when the client reads again the
        stream resumes and ends with the uninterrupted text."""
        self.start_vocab_node("a", max_lanes=1, token_delay_s=STEP_S)
        head = self.start_head()
        body = _body(40)
        reader = self.http(head, "10.0.0.1", StreamingClient())
        reader.transport.write(post_bytes(body, close=True))
        self.until(lambda: reader.content_seen.called)
        other = self.http(head, "10.0.0.2")
        other.send(post_bytes({**body, "max_tokens": 5}, close=True))
        self.until(lambda: head.fleet.queued == 1)
        (exchange,) = [
            x for x in head.api.exchanges if x.request.getClientAddress().host == "10.0.0.1"
        ]
        exchange._watch.pauseProducing()
        self.until(lambda: other.closed, within=2.0)
        self.assertEqual(
            _streamed_text(other.data), text_of(expected_tokens(prompt_ids(MESSAGES), 5))
        )
        self.assertEqual(head.fleet.queued, 0)
        exchange._watch.resumeProducing()
        self.until(lambda: reader.ended.called)
        self.assertEqual(
            _streamed_text(reader.data), text_of(expected_tokens(prompt_ids(MESSAGES), 40))
        )
