"""One completion request's life in the head (sfnode.head.api.exchange) on the memory reactor.

The API (:class:`~sfnode.head.api.http.OpenAIApi`, front door included) answers requests written
into a twisted.web channel over a ``StringTransport``; a recording backend stands in for the
fleet, so each test fires placements, tokens, results and failures itself and reads exactly
what was written.  Time is a ``Clock``: the stall timeout and the drain are advanced, never
waited for.  Real-TCP tests of the same API (tests/test_http.py, tests/test_http_hostile.py)
keep what only a socket shows: the ``openai`` client, kernel buffers filling, a peer that goes
away.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from twisted.internet.address import IPv4Address
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionAborted, ConnectionDone
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import SynchronousTestCase

from sfnode.generation import TokenBatch
from sfnode.head.api.exchange import MOVES, Exchange, Phase, finish_reason, request_label
from sfnode.head.api.gate import GateLimits
from sfnode.head.api.http import OpenAIApi
from sfnode.head.fleet.backend import BackendStatus, FleetOutcome, HeadRequest, QueueFull
from sfnode.linkf.wire import FINISH_CANCELLED, FINISH_EOS, FINISH_LENGTH
from tests.memoryhead import InlineWorkers, ThreadlessReactor
from tests.test_http import tokenizer
from tests.test_http_hostile import request_bytes

_T = TypeVar("_T")
MODEL = "mock"


class _Generation:
    """A generation the recording backend handed out; the test ends it."""

    def __init__(self, prompt: Sequence[int], max_new: int, on_tokens: Any) -> None:
        self.prompt = list(prompt)
        self.max_new = max_new
        self.on_tokens = on_tokens
        self.result: Deferred[FleetOutcome] = Deferred()
        self.placed: Deferred[None] = Deferred()
        self.cancels = 0
        self.parks: list[bool] = []
        """Each park (True) and unpark (False), in order."""
        self.sent: list[int] = []

    def cancel(self) -> None:
        self.cancels += 1

    def park(self) -> None:
        self.parks.append(True)

    def unpark(self) -> None:
        self.parks.append(False)

    def when_placed(self) -> Deferred[None]:
        return self.placed

    def tokens(self, *ids: int) -> None:
        self.sent.extend(ids)
        self.on_tokens(TokenBatch(tuple(ids)))

    def end(self, finish: int) -> None:
        self.result.callback(FleetOutcome(list(self.sent), finish, "node", 0))


class _Backend:
    """Records every generation asked of it; one live node with a 4096-token window."""

    def __init__(self) -> None:
        self.generations: list[_Generation] = []

    def generate(self, request: HeadRequest, on_tokens: Any = None) -> _Generation:
        generation = _Generation(request.prompt, request.max_new, on_tokens)
        self.generations.append(generation)
        return generation

    def status(self, model: str | None = None) -> BackendStatus:
        return BackendStatus(live_nodes=1, window=4096, context_limit=4096, lanes_total=4)


class ExchangeTestCase(SynchronousTestCase):
    def setUp(self) -> None:
        self.build(GateLimits(stall_timeout_s=2.0, resume_grace_s=5.0))

    def build(self, limits: GateLimits) -> None:
        """The API under test, on a memory reactor, with ``limits``."""
        self.reactor = ThreadlessReactor()
        self.backend = _Backend()
        self.api = OpenAIApi(
            self.reactor,
            self.backend,
            tokenizer(),
            MODEL,
            seed_source=lambda: 7,
            workers=InlineWorkers(),  # type: ignore[arg-type]
            limits=limits,
        )

    def open(self, path: str, body: dict[str, Any]) -> tuple[Any, StringTransport]:
        """A connection to the API with one request sent on it."""
        address = IPv4Address("TCP", "127.0.0.1", 40000)
        channel = self.api.site().buildProtocol(address)
        transport = StringTransport(peerAddress=address)
        channel.makeConnection(transport)
        channel.dataReceived(request_bytes(path, json.dumps(body).encode()))
        return channel, transport

    def exchange(self) -> Exchange:
        (exchange,) = self.api.exchanges
        return exchange

    def count(self, label: str) -> float:
        value = self.api.metrics.requests.labels(label)._value.get()
        return float(value)

    @staticmethod
    def events(transport: StringTransport) -> list[Any]:
        """The JSON of each server-sent event written so far (``[DONE]`` as the string)."""
        found = []
        for line in transport.value().split(b"\n"):
            line = line.strip()
            if line.startswith(b"data: "):
                data = line[len(b"data: ") :]
                found.append("[DONE]" if data == b"[DONE]" else json.loads(data))
        return found


class StreamTests(ExchangeTestCase):
    def test_a_streamed_chat_moves_placed_streaming_done(self) -> None:
        """A streamed chat request is placed (nothing written), streams once its generation
        is placed (the role chunk), writes a delta per released text and the finish chunk,
        then ``[DONE]``; it is counted ``ok`` and leaves the API's requests."""
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3, "stream": True}  # fmt: skip
        _, transport = self.open("/v1/chat/completions", chat)
        exchange = self.exchange()
        self.assertEqual(exchange.phase, Phase.PLACED)
        self.assertEqual(transport.value(), b"")
        (generation,) = self.backend.generations
        generation.placed.callback(None)
        self.assertEqual(exchange.phase, Phase.STREAMING)
        text = tokenizer().encode("ab cd", add_special_tokens=False)
        generation.tokens(*text)
        generation.end(FINISH_LENGTH)
        self.assertEqual(exchange.phase, Phase.DONE)
        events = self.events(transport)
        self.assertEqual(events[0]["choices"][0]["delta"], {"role": "assistant", "content": ""})
        shown = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-2])
        self.assertEqual(shown, tokenizer().decode(text))
        self.assertEqual(events[-2]["choices"][0]["finish_reason"], "length")
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual(self.api.exchanges, set())
        self.assertEqual(self.count("ok"), 1)

    def test_an_unstreamed_completion_is_one_body(self) -> None:
        """An unstreamed text completion writes nothing until its generation ends, then one
        ``text_completion`` body with the text, the finish reason and the usage."""
        body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2}
        _, transport = self.open("/v1/completions", body)
        (generation,) = self.backend.generations
        generation.placed.callback(None)
        self.assertEqual(self.exchange().phase, Phase.PLACED)
        generation.tokens(7)
        self.assertEqual(transport.value(), b"")
        generation.end(FINISH_EOS)
        answer = json.loads(transport.value().split(b"\r\n\r\n", 1)[1])
        self.assertEqual(answer["object"], "text_completion")
        self.assertEqual(answer["choices"][0]["finish_reason"], "stop")
        self.assertEqual(answer["usage"], {"prompt_tokens": 2, "completion_tokens": 1,
                                           "total_tokens": 3})  # fmt: skip


class BackPressureTests(ExchangeTestCase):
    def stream(self) -> tuple[Any, StringTransport, _Generation]:
        body = {"model": MODEL, "prompt": [5], "max_tokens": 100, "stream": True}
        channel, transport = self.open("/v1/completions", body)
        (generation,) = self.backend.generations
        generation.placed.callback(None)
        generation.tokens(7, 8)
        return channel, transport, generation

    def test_a_client_that_stops_reading_is_cut_off_after_the_stall_timeout(self) -> None:
        """When the connection stays full (twisted.web pauses the producer) for the stall
        timeout, the client is cut off (the connection aborted) and its generation
        cancelled; nothing is written after; the request counts as ``cancelled``."""
        channel, transport, generation = self.stream()
        channel.pauseProducing()
        self.reactor.advance(1.9)
        self.assertFalse(transport.disconnected)
        self.assertEqual(generation.cancels, 0)
        self.reactor.advance(0.1)
        self.assertTrue(transport.disconnected)
        self.assertEqual(generation.cancels, 1)
        self.assertEqual(self.exchange().phase, Phase.GONE)
        written = transport.value()
        channel.connectionLost(Failure(ConnectionAborted()))
        generation.tokens(9)
        generation.end(FINISH_CANCELLED)
        self.assertEqual(transport.value(), written)
        self.assertEqual(self.api.exchanges, set())
        self.assertEqual(self.count("cancelled"), 1)

    def test_a_client_that_reads_again_in_time_is_kept(self) -> None:
        """A pause followed by a resume (the client read again) before the stall timeout
        disarms it: the generation was parked at the pause and unparked at the resume
        (docs/protocol.md section 8.5, "Shares"), and the stream goes on and ends
        normally."""
        channel, transport, generation = self.stream()
        channel.pauseProducing()
        self.assertEqual(generation.parks, [True])
        self.reactor.advance(1.5)
        channel.resumeProducing()
        self.assertEqual(generation.parks, [True, False])
        self.reactor.advance(10)
        self.assertFalse(transport.disconnected)
        generation.end(FINISH_LENGTH)
        self.assertEqual(self.events(transport)[-1], "[DONE]")
        # The one timer left forgets the ended stream, kept for a resume (resume.py).
        (kept,) = self.reactor.getDelayedCalls()
        self.assertEqual(kept.func, self.api.exchanges._forget)

    def test_a_client_that_goes_away_cancels_its_generation(self) -> None:
        """Without a resume grace (--resume-grace 0), a client whose connection closes
        mid-stream cancels its generation; the exchange is gone and writes nothing more."""
        self.build(GateLimits(stall_timeout_s=2.0, resume_grace_s=0))
        channel, transport, generation = self.stream()
        channel.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(generation.cancels, 1)
        self.assertEqual(self.exchange().phase, Phase.GONE)
        written = transport.value()
        generation.end(FINISH_CANCELLED)
        self.assertEqual(transport.value(), written)
        self.assertEqual(self.count("cancelled"), 1)


    def test_a_client_that_goes_away_is_waited_for_then_cancelled(self) -> None:
        """With a resume grace of 5 s, a client whose connection closes mid-stream parks its
        generation (the exchange is away, nothing cancelled, nothing written); when the
        grace passes with no resume, the generation is cancelled, the exchange is gone and
        counted ``cancelled``, and it leaves the API's requests."""
        channel, transport, generation = self.stream()
        channel.connectionLost(Failure(ConnectionDone()))
        self.assertEqual((generation.parks, generation.cancels), ([True], 0))
        self.assertEqual(self.exchange().phase, Phase.AWAY)
        written = transport.value()
        self.reactor.advance(4.9)
        self.assertEqual(generation.cancels, 0)
        self.reactor.advance(0.1)
        self.assertEqual(generation.cancels, 1)
        self.assertEqual(self.exchange().phase, Phase.GONE)
        generation.end(FINISH_CANCELLED)
        self.assertEqual(transport.value(), written)
        self.assertEqual(self.count("cancelled"), 1)
        self.assertEqual(self.api.exchanges, set())


class _HeldWorkers(InlineWorkers):
    """Workers whose work runs only when the test says so."""

    def __init__(self) -> None:
        self.held: list[tuple[Callable[[], Any], Deferred[Any]]] = []

    def run(self, work: Callable[[], _T], client: object = "", **budget: Any) -> Deferred[_T]:
        done: Deferred[_T] = Deferred()
        self.held.append((work, done))
        return done

    def release(self) -> None:
        for work, done in self.held:
            done.callback(work())
        self.held = []


class LifeTests(ExchangeTestCase):
    def test_a_client_gone_while_preparing_starts_no_generation(self) -> None:
        """A chat request whose client leaves while its prompt is rendered on a worker is
        gone: when the render ends, no generation is started, nothing is written, and the
        request leaves the API's requests."""
        workers = _HeldWorkers()
        self.api.workers = workers
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        channel, transport = self.open("/v1/chat/completions", chat)
        self.assertEqual(self.exchange().phase, Phase.PREPARING)
        exchange = self.exchange()
        channel.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(exchange.phase, Phase.GONE)
        workers.release()
        self.assertEqual(self.backend.generations, [])
        self.assertEqual(transport.value(), b"")
        self.assertEqual(self.api.exchanges, set())

    def test_the_drain_timeout_ends_a_stream_cleanly_with_stop(self) -> None:
        """A stream still running when the drain timeout passes is cancelled on its node and
        ends cleanly for the client: its last choice chunk says ``stop``, then ``[DONE]``;
        it is counted ``drained`` and the drain then fires."""
        body = {"model": MODEL, "prompt": [5], "max_tokens": 100, "stream": True}
        _, transport = self.open("/v1/completions", body)
        (generation,) = self.backend.generations
        generation.placed.callback(None)
        generation.tokens(7)
        drained = self.api.drain(3.0)
        self.reactor.advance(2.9)
        self.assertEqual(generation.cancels, 0)
        self.reactor.advance(0.1)
        self.assertEqual(generation.cancels, 1)
        self.assertNoResult(drained)
        generation.end(FINISH_CANCELLED)
        events = self.events(transport)
        self.assertEqual(events[-2]["choices"][0]["finish_reason"], "stop")
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual(self.count("drained"), 1)
        self.successResultOf(drained)


class ErrorTests(ExchangeTestCase):
    def test_a_backend_failure_is_answered_by_its_mapping(self) -> None:
        """A generation that fails with a full queue answers 503 ``queue_full`` in OpenAI's
        error shape, counted under ``unavailable``."""
        _, transport = self.open("/v1/completions", {"model": MODEL, "prompt": [5]})
        (generation,) = self.backend.generations
        generation.result.errback(QueueFull("the queue is full"))
        head, _, body = transport.value().partition(b"\r\n\r\n")
        self.assertIn(b" 503 ", head.split(b"\r\n")[0])
        self.assertEqual(json.loads(body)["error"]["code"], "queue_full")
        self.assertEqual(self.count("unavailable"), 1)
        self.assertEqual(self.api.exchanges, set())

    def test_an_error_mid_stream_is_an_event_then_done(self) -> None:
        """A failure after the stream began is written as an error event then ``[DONE]``."""
        body = {"model": MODEL, "prompt": [5], "max_tokens": 4, "stream": True}
        _, transport = self.open("/v1/completions", body)
        (generation,) = self.backend.generations
        generation.placed.callback(None)
        generation.result.errback(QueueFull("the queue is full"))
        events = self.events(transport)
        self.assertEqual(events[-2]["error"]["code"], "queue_full")
        self.assertEqual(events[-1], "[DONE]")


class PureTests(SynchronousTestCase):
    def test_moves_end_in_done_or_gone_and_nothing_leaves_them(self) -> None:
        """Every phase but done and gone can be answered and lost; from done and gone the
        only input is ``lost``, which changes nothing."""
        for phase in (Phase.PREPARING, Phase.PLACED, Phase.STREAMING):
            self.assertEqual(MOVES[(phase, "answered")], Phase.DONE)
            self.assertEqual(MOVES[(phase, "lost")], Phase.GONE)
        for phase in (Phase.DONE, Phase.GONE):
            self.assertEqual([k for k in MOVES if k[0] is phase], [(phase, "lost")])
            self.assertEqual(MOVES[(phase, "lost")], phase)

    def test_finish_reasons_and_labels(self) -> None:
        """A stop string or EOS is ``stop``; a drain's cancel ``stop``; a cancel whose client
        left ``cancelled``; else ``length``.  A request counts ``drained`` before
        ``cancelled`` before ``ok``."""
        cancelled = FleetOutcome([], FINISH_CANCELLED, "n", 0)
        self.assertEqual(finish_reason(cancelled, True, drained=False, gone=True), "stop")
        eos = FleetOutcome([], FINISH_EOS, "n", 0)
        self.assertEqual(finish_reason(eos, False, drained=False, gone=False), "stop")
        self.assertEqual(finish_reason(cancelled, False, drained=True, gone=False), "stop")
        self.assertEqual(finish_reason(cancelled, False, drained=False, gone=True), "cancelled")
        length = FleetOutcome([], FINISH_LENGTH, "n", 0)
        self.assertEqual(finish_reason(length, False, drained=False, gone=False), "length")
        self.assertEqual(request_label(["cancelled"], True), "drained")
        self.assertEqual(request_label(["stop", "cancelled"], False), "cancelled")
        self.assertEqual(request_label(["stop", "length"], False), "ok")


class ErrorMappingTests(SynchronousTestCase):
    def test_each_generation_failure_has_its_answer(self) -> None:
        """Each way a generation fails is answered in one place (sfnode.head.api.failures): too
        long 400 ``context_length_exceeded`` on the prompt's field, a node's refusal 502, a
        client's full share of the queue 429 with ``Retry-After``, a full queue 503
        ``queue_full``, the wall budget 504, no logprobs 400 on ``logprobs``, any other fleet
        failure 503 ``no_node_available``; anything else is unexpected (None)."""
        from sfnode.generation import StreamTooLong
        from sfnode.head.api.failures import fleet_error
        from sfnode.head.fleet.backend import (
            ClientQueueFull,
            GenerationTimedOut,
            LogprobsUnavailable,
            NodeDeclined,
            NoNodeAvailable,
        )

        def answer(error: BaseException) -> tuple[int, str | None, str | None, str]:
            found = fleet_error(error, "messages")
            assert found is not None
            return found.status, found.code, found.param, found.outcome

        self.assertEqual(
            answer(StreamTooLong(9, 4)),
            (400, "context_length_exceeded", "messages", "too_long"),
        )
        self.assertEqual(answer(NodeDeclined("no"))[::3], (502, "error"))
        limited = fleet_error(ClientQueueFull("127.0.0.1", 2), "prompt")
        assert limited is not None
        self.assertEqual((limited.status, limited.code), (429, "rate_limit_exceeded"))
        self.assertEqual(limited.headers, {b"retry-after": b"1"})
        self.assertEqual(answer(QueueFull("full"))[:2], (503, "queue_full"))
        self.assertEqual(answer(GenerationTimedOut("late"))[:2], (504, "generation_timeout"))
        self.assertEqual(answer(LogprobsUnavailable("none"))[:3], (400, "unsupported_parameter",
                                                                   "logprobs"))  # fmt: skip
        self.assertEqual(answer(NoNodeAvailable("none"))[:2], (503, "no_node_available"))
        self.assertIsNone(fleet_error(ValueError("?"), "prompt"))
