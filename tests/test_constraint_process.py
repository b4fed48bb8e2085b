"""A constrained stream survives the death of its node (docs/protocol.md section 12.3): real
``twistd sfnode`` processes on the tiny Llama with ``--weights float32``, driven by the head
library (:class:`~sfnode.head.fleet.fleet.Fleet`) in the test, and through the HTTP API with the
``openai`` package.

The generation is sampled, with a JSON Schema that asks for a long array and a presence
penalty, so that the node is still generating when it is killed and the survivor has both a
grammar and penalty counts to rebuild from the delivered tokens; or with a free string that
runs past its budget, so that the survivor closes the answer early as the dead node would
have (issue 33: exact after failover).  No sleeps: every wait is on a
line a process logs or on the fleet.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import jsonschema
from twisted.internet import defer, reactor
from twisted.trial.unittest import TestCase

from sfnode.decoding.constraint import response_format_grammar
from sfnode.generation import TokenBatch
from sfnode.head.fleet.backend import HeadRequest
from sfnode.head.fleet.fleet import Fleet, FleetSettings, Policy
from sfnode.head.link import HeadIds
from sfnode.linkf.wire import Constraint, GenParams, SamplerControls
from tests.clients import openai_client
from tests.processes import LOOPBACK, spawn_nodes

LONG_ARRAY = {
    "type": "object",
    "properties": {
        "digits": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 60,
            "maxItems": 70,
        }
    },
    "required": ["digits"],
    "additionalProperties": False,
}
NOTE = {
    "type": "object",
    "properties": {"note": {"type": "string"}},
    "required": ["note"],
    "additionalProperties": False,
}
"""A schema whose shortest answer is a few tokens and whose string, sampled from the tiny
model, runs on past any budget: the node must close it."""


def schema_request(name: str, schema: Any, max_tokens: int, **sampling: Any) -> dict[str, Any]:
    """A seeded chat completion sampled at temperature 0.9 under ``schema``."""
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": "the quick brown fox"}],
        "max_tokens": max_tokens,
        "temperature": 0.9,
        "seed": 2024,
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}},
        **sampling,
    }


class ConstrainedFailoverTests(TestCase):
    timeout = 300

    @defer.inlineCallbacks
    def two_nodes(self) -> Generator[defer.Deferred[Any], Any, tuple[str, list[Any], Fleet]]:
        """The tiny model's folder, two float32 node processes and a fleet of both."""
        from tests.tinymodel import save_tiny_model

        folder = str(save_tiny_model(Path(self.mktemp()).resolve() / "tiny"))
        started = yield spawn_nodes(
            self,
            [(f"node{i}", ["sfnode", "--listen", LOOPBACK, "--identity", f"n{i}", "--engine",
                           "transformers", "--model", folder, "--weights", "float32"])
             for i in range(2)],
        )  # fmt: skip
        nodes = [node for node, _ in started]
        endpoints = [endpoint for _, endpoint in started]
        fleet = Fleet(
            reactor,
            FleetSettings(policy=Policy.LEAST_LOADED),
            ids=HeadIds(),
            retry=lambda _: 0.05,
        )
        self.addCleanup(fleet.stop)
        for endpoint in endpoints:
            yield fleet.add_node(endpoint)
        return folder, nodes, fleet

    @defer.inlineCallbacks
    def openai_client(self, folder: str, fleet: Fleet) -> Generator[defer.Deferred[Any], Any, Any]:
        """An ``openai`` client of a head (its HTTP API on loopback) over ``fleet``."""
        from transformers import AutoTokenizer
        from twisted.internet.endpoints import TCP4ServerEndpoint

        from sfnode.head.api.http import OpenAIApi

        api = OpenAIApi(reactor, fleet, AutoTokenizer.from_pretrained(folder), "tiny")
        self.addCleanup(api.stop)
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(api.site())
        self.addCleanup(port.stopListening)
        return openai_client(self, f"http://127.0.0.1:{port.getHost().port}/v1", api_key="-")

    def kill_at_first_tokens(
        self, fleet: Fleet, nodes: list[Any], killed: list[defer.Deferred[None]]
    ) -> None:
        """SIGKILL the node serving the next generation of ``fleet`` when the head gets that
        generation's first tokens (its end put in ``killed``), on the reactor, before the head
        reads anything after them: the node's finish, if it came already, is still unread, so
        the generation is still the node's and fails over.  (Killed when the client read its
        first chunk instead, the node had sometimes finished by then on a loaded machine.)"""
        generate = fleet.generate

        def generating(request: HeadRequest, on_tokens: Any = None) -> Any:
            def seen(batch: TokenBatch) -> None:
                if batch.tokens and not killed:
                    serving = [n.name for n in fleet.status().nodes if n.sessions]
                    self.assertEqual(len(serving), 1)
                    killed.append(nodes[int(serving[0][1:])].kill())
                if on_tokens is not None:
                    on_tokens(batch)

            return generate(request, seen)

        fleet.generate = generating  # type: ignore[method-assign]

    @defer.inlineCallbacks
    def test_a_killed_nodes_streamed_json_answer_equals_the_uninterrupted_one_over_http(
        self,
    ) -> Generator[defer.Deferred[Any], Any, None]:
        """Through the HTTP API with the ``openai`` package: a seeded, sampled chat completion
        under a ``json_schema`` and a presence penalty, streamed; the node serving it is
        SIGKILLed at its first content chunk; the stream goes on from the other node and its
        text equals the same request's uninterrupted answer, which validates."""
        from twisted.internet import threads

        folder, nodes, fleet = yield self.two_nodes()
        client = yield self.openai_client(folder, fleet)
        request = schema_request("digits", LONG_ARRAY, 200, top_p=0.95, presence_penalty=0.4)
        reference = yield threads.deferToThread(
            lambda: client.chat.completions.create(**request)
        )
        killed: list[defer.Deferred[None]] = []
        self.kill_at_first_tokens(fleet, nodes, killed)

        def streamed() -> str:
            pieces = []
            for chunk in client.chat.completions.create(**request, stream=True):
                text = chunk.choices[0].delta.content if chunk.choices else None
                pieces.append(text or "")
            return "".join(pieces)

        text = yield threads.deferToThread(streamed)
        yield killed[0]
        self.assertEqual(fleet.status().failovers, 1)
        self.assertEqual(text, reference.choices[0].message.content)
        jsonschema.validate(json.loads(text), LONG_ARRAY)

    @defer.inlineCallbacks
    def test_a_killed_nodes_constrained_answer_equals_the_uninterrupted_one(
        self,
    ) -> Generator[defer.Deferred[Any], Any, None]:
        """SIGKILL the node serving a constrained, sampled stream right after its first
        tokens: the fleet finishes it on the other node, and the caller's tokens equal an
        uninterrupted run's, token for token, and validate against the schema."""
        folder, nodes, fleet = yield self.two_nodes()

        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        prompt = tokenizer.encode("the quick brown fox jumps over the lazy dog")
        grammar = response_format_grammar(
            {"type": "json_schema", "json_schema": {"name": "digits", "schema": LONG_ARRAY}}
        )
        constraint = Constraint(0, grammar, SamplerControls(presence_penalty=0.4))
        params = GenParams(temperature=0.9, top_p=0.95, seed=2024)
        reference = yield fleet.generate(
            HeadRequest(prompt, 200, params=params, constraint=constraint),
        ).result
        self.assertEqual((reference.node, reference.failovers), ("n0", 0))

        streamed: list[int] = []
        killed: list[defer.Deferred[None]] = []

        def seen(tokens: Sequence[int], logprobs: Any = None) -> None:
            streamed.extend(tokens)
            if not killed:
                killed.append(nodes[0].kill())

        outcome = yield fleet.generate(
            HeadRequest(prompt, 200, params=params, constraint=constraint),
            on_tokens=seen,
        ).result
        yield killed[0]
        self.assertEqual((outcome.node, outcome.failovers), ("n1", 1))
        self.assertEqual(streamed, outcome.tokens)
        self.assertEqual(outcome.tokens, reference.tokens)
        answer = json.loads(tokenizer.decode(outcome.tokens, skip_special_tokens=True))
        jsonschema.validate(answer, LONG_ARRAY)

    @defer.inlineCallbacks
    def test_a_closed_answer_after_a_failover_equals_the_uninterrupted_one(
        self,
    ) -> Generator[defer.Deferred[Any], Any, None]:
        """Within a budget (docs/api.md "Budgets"): a seeded, sampled chat completion under a
        ``json_schema`` whose free string would run past ``max_tokens``, streamed; the node
        serving it is SIGKILLed at its first content chunk; the other node finishes it, and
        closes it within the budget exactly as the uninterrupted answer was closed: the same
        text, ``finish_reason: "stop"`` and ``finish_details: {"closed": true}`` on both, an
        answer that parses and validates."""
        from twisted.internet import threads

        folder, nodes, fleet = yield self.two_nodes()
        client = yield self.openai_client(folder, fleet)
        request = schema_request("note", NOTE, 120)
        reference = yield threads.deferToThread(
            lambda: client.chat.completions.create(**request)
        )
        choice = reference.choices[0]
        self.assertEqual(
            (choice.finish_reason, choice.model_extra.get("finish_details")),
            ("stop", {"closed": True}),
        )
        self.assertLessEqual(reference.usage.completion_tokens, 120)
        killed: list[defer.Deferred[None]] = []
        self.kill_at_first_tokens(fleet, nodes, killed)

        def streamed() -> tuple[str, Any, Any]:
            pieces, finish, details = [], None, None
            for chunk in client.chat.completions.create(**request, stream=True):
                if not chunk.choices:
                    continue
                text = chunk.choices[0].delta.content
                pieces.append(text or "")
                if chunk.choices[0].finish_reason is not None:
                    finish = chunk.choices[0].finish_reason
                    details = chunk.choices[0].model_extra.get("finish_details")
            return "".join(pieces), finish, details

        text, finish, details = yield threads.deferToThread(streamed)
        yield killed[0]
        self.assertEqual(fleet.status().failovers, 1)
        self.assertEqual(
            (text, finish, details), (choice.message.content, "stop", {"closed": True})
        )
        jsonschema.validate(json.loads(text), NOTE)
