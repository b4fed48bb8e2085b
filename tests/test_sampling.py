"""Sampling parameters from the request to the engine, and seeded sampling across failover.

A sampled token is drawn at ``position = seed + len(context) + k`` (docs/engine.md section 2), so
a stream is a pure function of (context, parameters, seed) and a failover that hands the
delivered tokens to another node as context continues it exactly.  These tests pin that:

- the mock engine honours GenParams: its sampler over the mock's sparse logits draws exactly what
  the torch sampler draws over the same logits made dense; sampled streams differ from greedy,
  depend on the seed, and continue exactly from any prefix; greedy output is unchanged;
- the parameters a head assigns reach the node's engine (through a link, through the fleet's
  placement, and through the HTTP API with OpenAI's defaults: temperature 1, top_p 1, and the
  head's seed when the request gives none);
- a sampled generation whose node dies mid-way, streaming or not, ends with exactly the tokens of
  an uninterrupted run: on mock nodes through the fleet and through HTTP, and on the tiny real
  model (random non-unit norms) through the fleet.

Every expected stream is computed locally (the mock's draws, or the tiny model's full forward
and the torch sampler), never by a second run of the code under test.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Generator, Sequence
from typing import Any

from twisted.internet import defer, reactor
from twisted.internet.endpoints import TCP4ServerEndpoint
from twisted.internet.task import Clock
from twisted.trial.unittest import SynchronousTestCase

from sfnode.decoding.draws import draw_position
from sfnode.decoding.sparse_sampler import sample_sparse
from sfnode.engines.mock import (
    MOCK_CANDIDATES,
    MockEngine,
    mock_logits,
    mock_next_token,
    mock_token,
)
from sfnode.generation import Engine, EngineStop, GenerationRequest, GenerationResult, TokenBatch
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.fleet.fleet import Fleet, FleetSettings, Policy
from sfnode.linkf.wire import FINISH_LENGTH, GenParams
from sfnode.node.agent import NodeAgent
from sfnode.node.config import NodeConfig
from sfnode.node.tap import node_factory
from tests.nodefixture import PROMPT, Gen, NodeTestCase, RunningNode
from tests.test_http import MESSAGES, HttpTestCase, sse_events
from tests.tinymodel import TINY_VOCAB

SAMPLED = GenParams(temperature=1.0, top_p=1.0, seed=1234)
"""OpenAI's defaults with a fixed seed.  Every value here is exact in float32 (the wire's type)."""
NARROWED = GenParams(temperature=0.75, top_p=0.875, min_p=0.0625, top_k=5, seed=2**40 + 3)
"""Every field set, none to its default, all exact in float32."""


def sampled_run(
    context: Sequence[int], count: int, params: GenParams, vocab: int = 32000
) -> list[int]:
    """The mock engine's uninterrupted run, computed here: token k is drawn at seed+len+k."""
    context = list(context)
    start = len(context)
    out: list[int] = []
    for k in range(count):
        token = mock_token(context, params, draw_position(params.seed, start, k), vocab)
        context.append(token)
        out.append(token)
    return out


def greedy_run(context: Sequence[int], count: int, vocab: int = 32000) -> list[int]:
    context = list(context)
    for _ in range(count):
        context.append(mock_next_token(context, vocab))
    return context[len(context) - count :]


def differing(a: Sequence[int], b: Sequence[int]) -> int:
    return sum(1 for x, y in zip(a, b, strict=True) if x != y)


def record_params(engine: Any) -> list[GenParams]:
    """Wrap ``engine.submit`` to record the GenParams of every request it gets."""
    seen: list[GenParams] = []
    submit = engine.submit

    def recording(request: GenerationRequest, on_tokens: Any) -> Any:
        seen.append(request.params)
        return submit(request, on_tokens)

    engine.submit = recording
    return seen


def kill_after(engines: Sequence[Any], count: int, kill: Callable[[int], Any]) -> list[int]:
    """Wrap each engine's ``submit``: once the engine of node ``i`` handed over ``count`` tokens
    of one generation, ``kill(i)`` runs on the next reactor turn (once in all).  Returns the
    list of the indexes killed."""
    killed: list[int] = []
    for index, engine in enumerate(engines):
        submit = engine.submit

        def watching(request: Any, on_tokens: Any, index: int = index, submit: Any = submit) -> Any:
            made: list[int] = []

            def watched(batch: TokenBatch) -> None:
                on_tokens(batch)
                made.extend(batch.tokens)
                if len(made) >= count and not killed:
                    killed.append(index)
                    reactor.callLater(0, kill, index)

            return submit(request, watched)

        engine.submit = watching
    return killed


class MockSamplerTests(SynchronousTestCase):
    """The mock engine's sampling, alone, on a Clock."""

    def run_engine(self, context: Sequence[int], params: GenParams, count: int) -> list[int]:
        clock = Clock()
        engine = MockEngine(clock)
        engine.start()
        produced: list[int] = []
        generation = engine.submit(GenerationRequest(tuple(context), params, count),
                                   produced.extend)  # fmt: skip
        results: list[GenerationResult] = []
        generation.result.addCallback(results.append)
        while not results:
            clock.advance(0)
        self.assertEqual(results[0].stop, EngineStop.LENGTH)
        self.assertEqual(list(results[0].tokens), produced)
        return produced

    def test_the_sparse_sampler_draws_what_the_torch_sampler_draws(self) -> None:
        """sample_sparse over the mock's logits equals sfnode.decoding.sampler.sample_token over the
        same logits made dense (-inf elsewhere), for greedy, temperatures 0.5 to 2 and every filter,
        at 100 positions each: the mock samples by the sampler's rules, not its own."""
        import torch

        from sfnode.decoding.sampler import sample_token

        grid = [
            GenParams(),
            GenParams(temperature=1.0, top_p=1.0),
            GenParams(temperature=0.5, top_p=1.0),
            GenParams(temperature=2.0, top_p=1.0),
            GenParams(temperature=1.0, top_p=1.0, top_k=3),
            GenParams(temperature=1.0, top_p=1.0, top_k=20),
            GenParams(temperature=1.0, top_p=1.0, min_p=0.25),
            GenParams(temperature=1.0, top_p=0.75),
            GenParams(temperature=1.0, top_p=0.5),
            GenParams(temperature=1.0, top_p=0.0),
            NARROWED,
        ]
        for context in ([1, 2, 3], PROMPT):
            logits = mock_logits(context, TINY_VOCAB)
            dense = torch.full((TINY_VOCAB,), float("-inf"))
            for token, logit in logits:
                dense[token] = logit
            for params in grid:
                for position in range(100):
                    self.assertEqual(
                        sample_sparse(logits, params, position),
                        sample_token(dense, params, position),
                        (context, params, position),
                    )

    def test_greedy_output_is_unchanged(self) -> None:
        """All-zero parameters, and temperature 0 with any seed or filter, give the mock's greedy
        chain of mock_next_token."""
        expected = greedy_run(PROMPT, 24)
        self.assertEqual(self.run_engine(PROMPT, GenParams(), 24), expected)
        greedy_with_extras = GenParams(temperature=0.0, top_p=0.5, top_k=3, seed=99)
        self.assertEqual(self.run_engine(PROMPT, greedy_with_extras, 24), expected)

    def test_a_sampled_stream_differs_from_greedy_and_depends_on_the_seed(self) -> None:
        """At temperature 1 the engine's stream equals the locally computed draws, differs from
        the greedy one in at least a quarter of 40 tokens, is the same for the same seed, and
        another seed gives another stream."""
        stream = self.run_engine(PROMPT, SAMPLED, 40)
        self.assertEqual(stream, sampled_run(PROMPT, 40, SAMPLED))
        self.assertGreaterEqual(differing(stream, greedy_run(PROMPT, 40)), 10)
        self.assertEqual(self.run_engine(PROMPT, SAMPLED, 40), stream)
        other = GenParams(temperature=1.0, top_p=1.0, seed=SAMPLED.seed + 1000)
        self.assertGreaterEqual(differing(self.run_engine(PROMPT, other, 40), stream), 10)

    def test_a_continuation_draws_where_the_stream_left_off(self) -> None:
        """11 tokens, then a new request whose context is the prompt plus those 11, give the
        same 30 tokens as one request: each draw depends on the absolute position only (what a
        failover relies on)."""
        whole = self.run_engine(PROMPT, SAMPLED, 30)
        head = self.run_engine(PROMPT, SAMPLED, 11)
        rest = self.run_engine([*PROMPT, *head], SAMPLED, 19)
        self.assertEqual(head + rest, whole)

    def test_filters_narrow_the_draw(self) -> None:
        """top_k 1, top_p 0 and min_p 1 each leave only the best candidate (the greedy chain);
        top_k 2 draws only among the two best candidates, and takes the second sometimes."""
        greedy = greedy_run(PROMPT, 24)
        for narrow in (
            GenParams(temperature=1.0, top_p=1.0, top_k=1, seed=5),
            GenParams(temperature=1.0, top_p=0.0, seed=5),
            GenParams(temperature=1.0, top_p=1.0, min_p=1.0, seed=5),
        ):
            self.assertEqual(self.run_engine(PROMPT, narrow, 24), greedy, narrow)
        two = GenParams(temperature=1.0, top_p=1.0, top_k=2, seed=5)
        context = list(PROMPT)
        ranks = []
        for token in self.run_engine(PROMPT, two, 40):
            best = [t for t, _ in mock_logits(context)[:MOCK_CANDIDATES]]
            ranks.append(best.index(token))
            context.append(token)
        self.assertEqual(set(ranks), {0, 1})


class NodeSamplingTests(NodeTestCase):
    @defer.inlineCallbacks
    def test_assigned_parameters_reach_the_engine(self) -> Gen:
        """The GenParams of a SESSION_ASSIGN (every field set) reach the node's engine exactly,
        and the generation's tokens are the sampled draws, not the greedy chain."""
        node = yield self.start_node()
        seen = record_params(node.engine)
        link = yield self.dial(node)
        link.assign(1, params=NARROWED)
        link.append(1, PROMPT)
        outcome = yield link.generate(1, HeadRequest((), 24)).result
        self.assertEqual(seen, [NARROWED])
        self.assertEqual(outcome.tokens, sampled_run(PROMPT, 24, NARROWED))
        self.assertNotEqual(outcome.tokens, greedy_run(PROMPT, 24))


class FleetSamplingCase(NodeTestCase):
    """Nodes on any engine, killed on demand, and least-loaded fleets over them."""

    @defer.inlineCallbacks
    def start_engine_node(
        self, engine: Engine, identity: str, model_name: str = "mock"
    ) -> Generator[defer.Deferred[Any], Any, RunningNode]:
        agent = NodeAgent(reactor, engine, NodeConfig(identity=identity, model_name=model_name))
        agent.start()
        endpoint = TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1")
        port = yield endpoint.listen(node_factory(agent))
        self.addCleanup(agent.stop)
        self.addCleanup(port.stopListening)
        return RunningNode(agent, engine, port)  # type: ignore[arg-type]

    @defer.inlineCallbacks
    def kill(self, node: RunningNode) -> Gen:
        """The node dies: no more connections, the open ones closed, its engine stopped."""
        yield node.port.stopListening()
        yield node.agent.stop()

    @defer.inlineCallbacks
    def fleet_of(self, nodes: Sequence[RunningNode]) -> Generator[defer.Deferred[Any], Any, Fleet]:
        fleet = Fleet(reactor, FleetSettings(policy=Policy.LEAST_LOADED), ids=self.ids)
        self.addCleanup(fleet.stop)
        for node in nodes:
            yield fleet.add_node(node.endpoint)
        return fleet

    @defer.inlineCallbacks
    def mock_pair(self, delay_s: float = 0.002) -> Generator[Any, Any, list[RunningNode]]:
        nodes = []
        for name in ("a", "b"):
            engine = MockEngine(reactor, token_delay_s=delay_s)
            nodes.append((yield self.start_engine_node(engine, name)))
        return nodes


class FleetSamplingTests(FleetSamplingCase):
    """The fleet's placement carries parameters; sampled failover continues exactly."""

    @defer.inlineCallbacks
    def test_a_sampled_fleet_generation_carries_its_parameters(self) -> Gen:
        """fleet.generate and a session's turns with parameters place the session with them:
        the node's engine gets them and the tokens are the sampled draws."""
        node = yield self.start_engine_node(MockEngine(reactor), "solo")
        seen = record_params(node.engine)
        fleet = yield self.fleet_of([node])
        outcome = yield fleet.generate(HeadRequest(PROMPT, 32, params=SAMPLED)).result
        self.assertEqual(outcome.tokens, sampled_run(PROMPT, 32, SAMPLED))
        self.assertGreaterEqual(differing(outcome.tokens, greedy_run(PROMPT, 32)), 8)
        session = yield fleet.open_session(PROMPT, params=NARROWED)
        first = yield session.generate(10).result
        yield session.append([*PROMPT, *first.tokens, 7, 8])
        second = yield session.generate(10).result
        self.assertEqual(first.tokens, sampled_run(PROMPT, 10, NARROWED))
        self.assertEqual(second.tokens, sampled_run([*PROMPT, *first.tokens, 7, 8], 10, NARROWED))
        self.assertEqual(seen, [SAMPLED, NARROWED, NARROWED])

    @defer.inlineCallbacks
    def test_sampled_streaming_failover_continues_exactly(self) -> Gen:
        """A sampled stream whose node dies after 7 tokens continues on the other node, which
        gets the same parameters: the streamed tokens, each once, equal the uninterrupted
        sampled run (and not the greedy one)."""
        nodes = yield self.mock_pair()
        fleet = yield self.fleet_of(nodes)
        seen = [record_params(node.engine) for node in nodes]
        killed = kill_after([n.engine for n in nodes], 7, lambda i: self.kill(nodes[i]))
        streamed: list[int] = []
        outcome = yield fleet.generate(
            HeadRequest(PROMPT, 40, params=SAMPLED), on_tokens=streamed.extend
        ).result
        expected = sampled_run(PROMPT, 40, SAMPLED)
        self.assertEqual(len(killed), 1)
        self.assertEqual((outcome.tokens, streamed), (expected, expected))
        self.assertEqual((outcome.finish, outcome.failovers), (FINISH_LENGTH, 1))
        self.assertEqual(seen[1 - killed[0]], [SAMPLED])
        self.assertGreaterEqual(differing(expected, greedy_run(PROMPT, 40)), 10)

    @defer.inlineCallbacks
    def test_sampled_non_streaming_failover_continues_exactly(self) -> Gen:
        """The same without a token callback: the result holds exactly the uninterrupted
        sampled run."""
        nodes = yield self.mock_pair()
        fleet = yield self.fleet_of(nodes)
        killed = kill_after([n.engine for n in nodes], 7, lambda i: self.kill(nodes[i]))
        outcome = yield fleet.generate(HeadRequest(PROMPT, 40, params=NARROWED)).result
        self.assertEqual(len(killed), 1)
        self.assertEqual(outcome.tokens, sampled_run(PROMPT, 40, NARROWED))
        self.assertEqual((outcome.finish, outcome.failovers), (FINISH_LENGTH, 1))


class RealModelSamplingTests(FleetSamplingCase):
    """Sampled failover on two transformers nodes serving the tiny model with random norms."""

    timeout = 240

    def tiny_engine(self) -> Any:
        from sfnode.engines.config import EngineConfig
        from sfnode.engines.transformers_engine import TransformersEngine
        from tests.tinymodel import tiny_llama_random_norms

        return TransformersEngine(tiny_llama_random_norms(), reactor, EngineConfig(max_lanes=2))

    def reference(self, prompt: Sequence[int], count: int, params: GenParams) -> list[int]:
        """The tiny model's full forward over the whole context per token and the torch sampler
        at seed + len(prompt) + k: no cache, no batching, no engine."""
        import torch

        from sfnode.decoding.sampler import sample_token
        from tests.tinymodel import tiny_llama_random_norms

        model = tiny_llama_random_norms()
        context = list(prompt)
        out: list[int] = []
        with torch.inference_mode():
            for k in range(count):
                logits = model(torch.tensor([context])).logits[0, -1, :].to(torch.float32)
                token = sample_token(logits, params, draw_position(params.seed, len(prompt), k))
                context.append(token)
                out.append(token)
        return out

    @defer.inlineCallbacks
    def tiny_pair(self) -> Generator[Any, Any, list[RunningNode]]:
        nodes = []
        for name in ("a", "b"):
            nodes.append((yield self.start_engine_node(self.tiny_engine(), name, "tiny")))
        return nodes

    @defer.inlineCallbacks
    def run_failover(self, params: GenParams, streaming: bool) -> Gen:
        nodes = yield self.tiny_pair()
        fleet = yield self.fleet_of(nodes)
        killed = kill_after([n.engine for n in nodes], 7, lambda i: self.kill(nodes[i]))
        streamed: list[int] = []
        on_tokens = streamed.extend if streaming else None
        prompt = [(i * 37) % TINY_VOCAB for i in range(3, 40)]
        outcome = yield fleet.generate(
            HeadRequest(prompt, 32, params=params), on_tokens=on_tokens
        ).result
        expected = self.reference(prompt, 32, params)
        self.assertEqual(len(killed), 1)
        self.assertEqual(outcome.tokens, expected)
        if streaming:
            self.assertEqual(streamed, expected)
        self.assertEqual((outcome.finish, outcome.failovers), (FINISH_LENGTH, 1))

    def test_sampled_streaming_failover_continues_exactly(self) -> defer.Deferred[None]:
        """Tiny real model, streaming, temperature 1: the node dies after 7 tokens and the
        stream continues on the other node with exactly the reference draws."""
        return self.run_failover(SAMPLED, streaming=True)

    def test_sampled_non_streaming_failover_continues_exactly(self) -> defer.Deferred[None]:
        """Tiny real model, not streaming, every filter set: exactly the reference draws."""
        return self.run_failover(NARROWED, streaming=False)


class HttpSamplingTests(HttpTestCase):
    """The HTTP API's sampling fields reach the node; sampled failover behind HTTP is exact."""

    def params_sent(self, node: RunningNode) -> list[GenParams]:
        return record_params(node.engine)

    @defer.inlineCallbacks
    def test_request_parameters_reach_the_node(self) -> Gen:
        """temperature, top_p, top_k, min_p and seed of a chat request arrive at the node's
        engine as given, and the answer is the text of the sampled draws."""
        node = yield self.start_vocab_node()
        seen = self.params_sent(node)
        head = yield self.start_head([node])
        body = {"model": "mock", "messages": MESSAGES, "max_tokens": 16, "temperature": 0.75,
                "top_p": 0.875, "top_k": 5, "min_p": 0.0625, "seed": 2**40 + 3}  # fmt: skip
        code, content = yield self.call(head, b"POST", "/v1/chat/completions", body)
        self.assertEqual(code, 200, content)
        self.assertEqual(seen, [NARROWED])
        prompt = self.prompt_ids(MESSAGES)
        answer = json.loads(content)["choices"][0]["message"]["content"]
        self.assertEqual(answer, self.text_of(sampled_run(prompt, 16, NARROWED, TINY_VOCAB)))

    @defer.inlineCallbacks
    def test_openai_defaults_sample_at_temperature_one(self) -> Gen:
        """A request without sampling fields samples with OpenAI's defaults (temperature 1,
        top_p 1) and the head's seed (7 here); temperature 0 is greedy."""
        node = yield self.start_vocab_node()
        seen = self.params_sent(node)
        head = yield self.start_head([node])
        prompt = self.prompt_ids(MESSAGES)
        body = {"model": "mock", "messages": MESSAGES, "max_tokens": 24}
        _, content = yield self.call(head, b"POST", "/v1/chat/completions", body)
        _, greedy = yield self.call(
            head, b"POST", "/v1/chat/completions", {**body, "temperature": 0}
        )
        defaults = GenParams(temperature=1.0, top_p=1.0, seed=7)
        self.assertEqual(seen, [defaults, GenParams(temperature=0.0, top_p=1.0, seed=7)])
        sampled_text = json.loads(content)["choices"][0]["message"]["content"]
        greedy_text = json.loads(greedy)["choices"][0]["message"]["content"]
        self.assertEqual(sampled_text, self.text_of(sampled_run(prompt, 24, defaults, TINY_VOCAB)))
        self.assertEqual(greedy_text, self.text_of(greedy_run(prompt, 24, TINY_VOCAB)))
        self.assertNotEqual(sampled_text, greedy_text)

    @defer.inlineCallbacks
    def run_failover(self, stream: bool) -> Gen:
        nodes = []
        for name in ("a", "b"):
            nodes.append((yield self.start_vocab_node(identity=name, token_delay_s=0.002)))
        head = yield self.start_head(nodes)

        @defer.inlineCallbacks
        def kill(index: int) -> Gen:
            yield nodes[index].port.stopListening()
            yield nodes[index].agent.stop()

        killed = kill_after([n.engine for n in nodes], 7, kill)
        body = {"model": "mock", "prompt": "the quick brown fox", "max_tokens": 48,
                "temperature": 1.0, "seed": 1234, "stream": stream}  # fmt: skip
        code, content = yield self.call(head, b"POST", "/v1/completions", body)
        self.assertEqual(code, 200, content)
        self.assertEqual(len(killed), 1)
        prompt = [int(t) for t in self.tokenizer_ids("the quick brown fox")]
        expected = self.text_of(sampled_run(prompt, 48, SAMPLED, TINY_VOCAB))
        if stream:
            events = sse_events(content)
            self.assertEqual(events[-1], "[DONE]")
            text = "".join(e["choices"][0]["text"] for e in events[:-1])
            finish = events[-2]["choices"][0]["finish_reason"]
        else:
            choice = json.loads(content)["choices"][0]
            text, finish = choice["text"], choice["finish_reason"]
        self.assertEqual((text, finish), (expected, "length"))
        self.assertEqual(head.fleet.failovers, 1)

    def tokenizer_ids(self, text: str) -> list[int]:
        from tests.test_http import tokenizer

        return list(tokenizer().encode(text))

    def test_sampled_streaming_failover_over_http_is_exact(self) -> defer.Deferred[None]:
        """A streamed sampled completion whose node dies after 7 tokens streams exactly the
        text of the uninterrupted sampled run, then [DONE]."""
        return self.run_failover(stream=True)

    def test_sampled_non_streaming_failover_over_http_is_exact(self) -> defer.Deferred[None]:
        """The same completion not streamed answers exactly that text."""
        return self.run_failover(stream=False)
