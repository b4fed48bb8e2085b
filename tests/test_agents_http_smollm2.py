"""The issue's targets through the HTTP API on the bundled model at default settings, with the
official ``openai`` package: what agent frameworks see of a fleet (docs/api.md).

One fleet serves every case (the bundled SmolLM2 on a transformers node, a head over real
TCP), so there is one slow test: ``tool_choice: "required"`` gives valid calls (a declared
function, arguments that validate) for each of twelve different user turns, a named function
likewise, and eight ``json_schema`` answers validate against a nested schema (an enum,
integer bounds, an array with ``maxItems``, required keys, ``additionalProperties: false``).
The tools reach the model through the generic rendering (SmolLM2's template has none), and the
calls come back as ``message.tool_calls``.  The node runs at its default settings; the requests
are greedy (``temperature: 0``), as tests/test_agents_smollm2.py asks of the engine (sampled at
temperature 1, a turn may go on writing parallel calls until ``max_tokens``).  Locally
``SFNODE_SKIP_SLOW=1`` skips it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Generator
from typing import Any

import jsonschema
from twisted.internet import defer, reactor, threads
from twisted.internet.endpoints import TCP4ServerEndpoint

from sfnode.head.fleet.fleet import FleetSettings
from tests.agents import CITY_QUESTIONS, NESTED_SCHEMA, TOOLS, USER_TURNS
from tests.bundled import BUNDLED_MODEL_SKIP
from tests.clients import openai_client
from tests.nodefixture import NodeTestCase
from tests.test_agents_smollm2 import NAMED

MODEL = "SmolLM2-135M-Instruct"


class BundledAgentsOverHttpTests(NodeTestCase):
    skip = BUNDLED_MODEL_SKIP
    timeout = 1200

    @defer.inlineCallbacks
    def fleet_client(self) -> Generator[defer.Deferred[Any], Any, Any]:
        """The bundled model on a transformers node behind a head over real TCP, and an
        ``openai`` client for it."""
        from sfnode.engines.transformers_engine import TransformersEngine
        from sfnode.engines.weights.loading import load_model
        from sfnode.head.api.http import OpenAIApi
        from sfnode.head.fleet.fleet import Fleet
        from sfnode.node.agent import NodeAgent
        from sfnode.node.config import NodeConfig
        from sfnode.node.tap import node_factory

        loaded = load_model(threads=2)
        engine = TransformersEngine.from_loaded(loaded, reactor)
        agent = NodeAgent(reactor, engine, NodeConfig(identity="smol", model_name=MODEL))
        agent.start()
        self.addCleanup(agent.stop)
        port = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(
            node_factory(agent)
        )
        self.addCleanup(port.stopListening)
        # 32 requests on 8 lanes: on a loaded machine the last wait longer than the queue's
        # default 30 s for a lane.
        fleet = Fleet(reactor, FleetSettings(queue_timeout_s=900), ids=self.ids)
        self.addCleanup(fleet.stop)
        yield fleet.add_node(f"tcp:127.0.0.1:{port.getHost().port}")
        seeds = itertools.count(1000)
        api = OpenAIApi(reactor, fleet, loaded.tokenizer, MODEL, seed_source=lambda: next(seeds))
        self.addCleanup(api.stop)
        http = yield TCP4ServerEndpoint(reactor, 0, interface="127.0.0.1").listen(api.site())
        self.addCleanup(http.stopListening)
        return openai_client(self, f"http://127.0.0.1:{http.getHost().port}/v1", timeout=1000)

    @defer.inlineCallbacks
    def test_tool_calls_and_json_schema_answers_are_all_valid(
        self,
    ) -> Generator[defer.Deferred[Any], Any, None]:
        """Twelve user turns with ``tool_choice: "required"``, the same twelve each naming a
        function, and eight ``json_schema`` questions, all at once through the API: every
        tool answer holds calls of declared functions (the named one when named) whose
        arguments validate, with ``finish_reason`` ``tool_calls`` (the node closes a
        second call it cannot finish within the budget), and every schema answer ends and
        validates."""
        client = yield self.fleet_client()
        cases: list[tuple[str, Any, str | None]] = [(t, "required", None) for t in USER_TURNS]
        cases += [
            (turn, {"type": "function", "function": {"name": name}}, name)
            for turn, name in zip(USER_TURNS, NAMED, strict=True)
        ]

        def ask_tool(turn: str, choice: Any) -> Any:
            return client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": turn}],
                tools=TOOLS,  # type: ignore[arg-type]
                tool_choice=choice,
                max_tokens=256,
                temperature=0,
            )

        def ask_json(question: str) -> Any:
            return client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": question}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "city", "schema": NESTED_SCHEMA, "strict": True},
                },
                max_tokens=256,
                temperature=0,
            )

        tool_answers = [threads.deferToThread(ask_tool, t, c) for t, c, _ in cases]
        json_answers = [threads.deferToThread(ask_json, q) for q in CITY_QUESTIONS]
        answers = yield defer.gatherResults(tool_answers + json_answers, consumeErrors=True)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for (turn, _, named), answer in zip(cases, answers, strict=False):
            choice = answer.choices[0]
            self.assertEqual(choice.finish_reason, "tool_calls", turn)
            self.assertTrue(choice.message.tool_calls, turn)
            for call in choice.message.tool_calls:
                self.assertIn(call.function.name, schemas, turn)
                if named is not None:
                    self.assertEqual(call.function.name, named, turn)
                arguments = json.loads(call.function.arguments)
                jsonschema.validate(arguments, schemas[call.function.name])
        for question, answer in zip(CITY_QUESTIONS, answers[len(cases) :], strict=True):
            self.assertEqual(answer.choices[0].finish_reason, "stop", question)
            jsonschema.validate(json.loads(answer.choices[0].message.content), NESTED_SCHEMA)

    @defer.inlineCallbacks
    def test_answers_parse_within_small_budgets_streamed_and_not(
        self,
    ) -> Generator[defer.Deferred[Any], Any, None]:
        """Issue 33's budgets through the API with the ``openai`` client: twelve forced tool
        calls at ``max_tokens`` 96 and eight ``json_object`` answers at 32, each asked
        streamed and not: every answer parses (calls of declared functions whose arguments
        validate, ``finish_reason`` ``tool_calls``; one JSON object, ``stop``), within its
        budget; some were closed early and say so in ``finish_details`` (the streamed
        finish chunk as the body); and a budget below the shortest call is a 400 naming
        ``max_tokens``."""
        import openai

        client = yield self.fleet_client()
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

        def ask(content: str, stream: bool, **extra: Any) -> tuple[str, list[Any], Any, Any]:
            """(finish_reason, [(name, arguments)], content, finish_details) of one answer."""
            messages = [{"role": "user", "content": content}]
            if not stream:
                answer = client.chat.completions.create(
                    model=MODEL,
                    messages=messages,
                    temperature=0,
                    **extra,  # type: ignore[arg-type]
                )
                choice = answer.choices[0]
                calls = [(c.function.name, c.function.arguments)
                         for c in choice.message.tool_calls or ()]  # fmt: skip
                details = (choice.model_extra or {}).get("finish_details")
                return choice.finish_reason, calls, choice.message.content, details
            chunks = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                temperature=0,
                stream=True,
                **extra,  # type: ignore[arg-type]
            )
            found: dict[int, list[str]] = {}
            text, finish, details = "", None, None
            for chunk in chunks:
                if not chunk.choices:
                    continue
                streamed = chunk.choices[0]
                text += streamed.delta.content or ""
                for delta in streamed.delta.tool_calls or ():
                    entry = found.setdefault(delta.index, ["", ""])
                    entry[0] += (delta.function.name or "") if delta.function else ""
                    entry[1] += (delta.function.arguments or "") if delta.function else ""
                if streamed.finish_reason is not None:
                    finish = streamed.finish_reason
                    details = (streamed.model_extra or {}).get("finish_details")
            calls = [(name, arguments) for name, arguments in (found[i] for i in sorted(found))]
            return str(finish), calls, text, details

        tool_asks = [
            threads.deferToThread(
                ask, turn, stream, tools=TOOLS, tool_choice="required", max_tokens=96
            )
            for stream in (False, True)
            for turn in USER_TURNS
        ]
        json_asks = [
            threads.deferToThread(
                ask, question, stream, response_format={"type": "json_object"}, max_tokens=32
            )
            for stream in (False, True)
            for question in CITY_QUESTIONS
        ]
        answers = yield defer.gatherResults(tool_asks + json_asks, consumeErrors=True)
        tool_answers, json_answers = answers[: len(tool_asks)], answers[len(tool_asks) :]
        for finish, calls, _, details in tool_answers:
            self.assertEqual(finish, "tool_calls")
            self.assertTrue(calls)
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), schemas[name])
            self.assertIn(details, (None, {"closed": True}))
        for finish, _, content, details in json_answers:
            self.assertEqual(finish, "stop")
            self.assertIsInstance(json.loads(content), dict)
            self.assertIn(details, (None, {"closed": True}))
        closed = [a[3] for a in answers if a[3] is not None]
        self.assertTrue(closed)

        def too_small() -> Any:
            return client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": USER_TURNS[0]}],
                tools=TOOLS, tool_choice="required", max_tokens=8,  # type: ignore[arg-type]
            )  # fmt: skip

        with self.assertRaises(openai.BadRequestError) as caught:
            yield threads.deferToThread(too_small)
        error = caught.exception.body
        assert isinstance(error, dict)
        self.assertEqual(error["param"], "max_tokens")
        self.assertIn("at least", error["message"])
