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
from twisted.logger import Logger

from sfnode.head.fleet.fleet import FleetSettings
from tests.agents import CITY_QUESTIONS, NESTED_SCHEMA, TOOLS, USER_TURNS
from tests.bundled import BUNDLED_MODEL_SKIP
from tests.nodefixture import NodeTestCase
from tests.test_agents_smollm2 import NAMED

MODEL = "SmolLM2-135M-Instruct"


class BundledAgentsOverHttpTests(NodeTestCase):
    skip = BUNDLED_MODEL_SKIP
    timeout = 1200

    @defer.inlineCallbacks
    def test_tool_calls_and_json_schema_answers_are_all_valid(
        self,
    ) -> Generator[defer.Deferred[Any], Any, None]:
        """Twelve user turns with ``tool_choice: "required"``, the same twelve each naming a
        function, and eight ``json_schema`` questions, all at once through the API: every
        tool answer holds calls of declared functions (the named one when named) whose
        arguments validate (``finish_reason`` ``tool_calls``, or ``length`` when the model
        went on writing parallel calls: a call cut short is not listed), and every schema
        answer ends and validates."""
        import openai

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
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{http.getHost().port}/v1",
            api_key="unused",
            max_retries=0,
            timeout=1000,
        )
        self.addCleanup(client.close)

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
        cut = [turn for (turn, _, _), a in zip(cases, answers, strict=False)
               if a.choices[0].finish_reason == "length"]  # fmt: skip
        Logger().info("tool answers ended by max_tokens: {count} of {total}: {cut}",
                      count=len(cut), total=len(cases), cut=cut)  # fmt: skip
        for (turn, _, named), answer in zip(cases, answers, strict=False):
            choice = answer.choices[0]
            self.assertIn(choice.finish_reason, ("tool_calls", "length"), turn)
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
